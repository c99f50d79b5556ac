//! A primary demoted by a failover (a Sentinel promoting a replica) answers
//! every write with `READONLY`. Whatever the store sends — a check, a
//! batch, an operator's command, a refund or a lease release — the
//! connection that got it is retired, so the next call opens a new one (to
//! the new primary, behind Sentinel) instead of asking the replica again.
//! Here `REPLICAOF` a port nothing listens on demotes the server, and
//! `REPLICAOF NO ONE` gives it back. (Checks: `redis_store`'s
//! `a_readonly_answer_retires_the_connection_under_every_algorithm`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::{self, RedisServer};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

/// Demote `server`, run `call` (which must fail: every write is refused),
/// promote it again, run one check, and wait until every connection open
/// before the demotion is closed.
async fn retires_its_connection<F, T>(server: &RedisServer, store: &RedisStore, what: &str, call: F)
where
    F: Future<Output = Result<T, StoreError>>,
    T: std::fmt::Debug,
{
    let nowhere = support::free_port().to_string();
    let before = support::client_ids(server);
    let reply = server.command(&["REPLICAOF", "127.0.0.1", &nowhere]);
    assert!(reply.starts_with("+OK"), "REPLICAOF: {reply}");
    let outcome = call.await;
    let reply = server.command(&["REPLICAOF", "NO", "ONE"]);
    assert!(reply.starts_with("+OK"), "REPLICAOF NO ONE: {reply}");
    match outcome {
        Ok(answer) => panic!("{what} on a replica succeeded: {answer:?}"),
        Err(error) => eprintln!("{what} on a replica: {error}"),
    }

    // The store still works, on a new connection...
    let policy: Policy = "5/86400s".parse().unwrap();
    assert!(
        store
            .check(&format!("after-{what}"), &policy)
            .await
            .unwrap()
            .allowed(),
        "{what}"
    );
    // ...and the connection that met the replica is gone (closed when the
    // pool dropped it), not kept for the next call.
    support::wait_until_retired(server, &before, what).await;
}

#[tokio::test]
async fn a_lease_release_on_a_demoted_primary_retires_the_connection() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = Policy::concurrency(2).unwrap();
    let decision = store.check("release", &policy).await.unwrap();
    let lease = decision
        .lease()
        .expect("an admitted concurrency check holds a lease");

    let release = store.release("release", &policy, lease);
    retires_its_connection(&server, &store, "release", release).await;

    // Released on the primary, the slot is free.
    store.release("release", &policy, lease).await.unwrap();
    assert_eq!(
        support::zcard(&server, &store.redis_key("conc", "release")),
        0
    );
}

#[tokio::test]
async fn a_refund_on_a_demoted_primary_retires_the_connection() {
    let server = RedisServer::start();
    let base: Policy = "5/86400s".parse().unwrap();
    for (name, policy) in [
        (
            "log-transaction",
            base.clone().with_execution(Execution::Transaction).unwrap(),
        ),
        (
            "log-script",
            base.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("concurrency", Policy::concurrency(2).unwrap()),
    ] {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let key = format!("refund-{name}");
        let decision = store.check(&key, &policy).await.unwrap();
        let id = decision
            .refund_id()
            .expect("an admitted check has a refund id");

        let refund = store.command(&key, &policy, Command::Refund { id, units: 1 });
        retires_its_connection(&server, &store, &format!("refund ({name})"), refund).await;
    }
}
