//! Least privilege: a Redis user with only the ACL rules
//! `RedisStore::acl_rules` gives can run every algorithm, execution and
//! operator command, batched or not, and Redis refuses it any other command
//! or key. (The conformance suites run as that user too: their Redis harness
//! connects as it.) Credentials never show in `Debug` output or errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::RedisServer;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

fn every_policy() -> Vec<Policy> {
    let base: Policy = "3/60s, 5/120s".parse().unwrap();
    vec![
        base.clone().with_execution(Execution::Transaction).unwrap(),
        base.clone().with_execution(Execution::Script).unwrap(),
        base.clone().fixed_window().unwrap(),
        base.clone().sliding_window().unwrap(),
        base.clone().gcra().unwrap(),
        Policy::concurrency(3).unwrap(),
    ]
}

/// Every algorithm and execution admits exactly its limit, and every
/// operator command runs, through `store` (keys named after `tag`).
async fn everything_works(store: &RedisStore, tag: &str) {
    store.ping().await.unwrap();
    // The most denied keys, shared and read back (the admin router's top).
    let (limit, denials) = (format!("acl-{tag}"), vec![("denied".to_owned(), 3)]);
    store.share_denials(&limit, denials.clone()).await.unwrap();
    assert_eq!(store.shared_denials(&limit).await.unwrap(), Some(denials));
    for (i, policy) in every_policy().into_iter().enumerate() {
        let key = format!("acl-{tag}-{i}");
        // Checks up to the limit and one over, concurrently (batches).
        let checks: Vec<_> = (0..4)
            .map(|_| {
                let (store, policy, key) = (store.clone(), policy.clone(), key.clone());
                tokio::spawn(async move { store.check(&key, &policy).await })
            })
            .collect();
        let mut admitted = Vec::new();
        for check in checks {
            let decision = check.await.unwrap().unwrap();
            if decision.allowed() {
                admitted.push(decision);
            }
        }
        assert_eq!(admitted.len(), 3, "{policy:?}");
        for decision in &admitted {
            if let Some(lease) = decision.lease() {
                store.release(&key, &policy, lease).await.unwrap();
            }
        }
        for command in [
            Command::Peek,
            Command::Penalty(1),
            Command::Reward(1),
            Command::Block(Duration::from_secs(5)),
            Command::Block(Duration::ZERO),
            Command::Reset,
        ] {
            store
                .command(&key, &policy, command)
                .await
                .unwrap_or_else(|e| panic!("{policy:?} {command:?}: {e}"));
        }
        assert!(store.check(&key, &policy).await.unwrap().allowed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_rules_are_enough_for_everything_the_store_does() {
    let server = RedisServer::start();
    let url = server.least_privileged_url("rl");
    for batches in [2, 0] {
        let store = RedisStore::connect(&url)
            .await
            .unwrap()
            .with_batches(batches);
        everything_works(&store, &batches.to_string()).await;
        // A flushed script cache is reloaded (SCRIPT LOAD) as this user.
        assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
        for policy in every_policy() {
            store.check("after-flush", &policy).await.unwrap();
        }
    }
}

#[tokio::test]
async fn redis_refuses_the_user_any_other_command_or_key() {
    let server = RedisServer::start();
    let url = server.least_privileged_url("rl");
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // Its own keys: allowed.
    let _: Option<String> = redis::cmd("GET")
        .arg("rl:fixed:{mine}")
        .query_async(&mut conn)
        .await
        .unwrap();
    // A key outside the prefix, and commands not in the list: refused.
    for (args, what) in [
        (vec!["GET", "other:key"], "a key outside the prefix"),
        (vec!["SET", "session:1", "x"], "a key outside the prefix"),
        (vec!["FLUSHALL"], "FLUSHALL"),
        (vec!["KEYS", "*"], "KEYS"),
        (vec!["CONFIG", "GET", "*"], "CONFIG"),
        (vec!["EVAL", "return 1", "0"], "EVAL"),
        (
            vec!["INCR", "rl:fixed:{mine}"],
            "a command the store never sends",
        ),
    ] {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        // (redis-rs hands an error reply queried as a `Value` back as one.)
        let refusal = match cmd.query_async::<redis::Value>(&mut conn).await {
            Err(error) => error.to_string(),
            Ok(redis::Value::ServerError(error)) => format!("{error:?}"),
            Ok(other) => panic!("{what} was allowed: {other:?}"),
        };
        assert!(
            refusal.to_lowercase().contains("noperm"),
            "{what}: {refusal}"
        );
    }
    // A store under another prefix is refused by Redis (inside its script).
    let other = RedisStore::connect(&url)
        .await
        .unwrap()
        .with_prefix("other");
    for policy in every_policy() {
        let error = other.check("k", &policy).await.unwrap_err();
        assert!(
            error.to_string().to_lowercase().contains("noperm"),
            "{policy:?}: {error}"
        );
    }
}

#[tokio::test]
async fn credentials_never_show_in_debug_output_or_errors() {
    let server = RedisServer::start();
    let url = server.least_privileged_url("rl");
    let store = RedisStore::connect(&url).await.unwrap();
    let shown = format!("{store:?} {:#?}", store);
    assert!(!shown.contains("least-privilege"), "{shown}");
    // A wrong password: the error says so without repeating it.
    let wrong = url.replace("least-privilege", "wrong-secret-42");
    let error = RedisStore::connect(&wrong).await.unwrap_err();
    let text = format!("{error} {error:?}");
    assert!(!text.contains("wrong-secret-42"), "{text}");
    assert!(
        matches!(error, StoreError::Backend { .. }),
        "a refused password is the backend's error: {text}"
    );
}

/// On a Redis Cluster the same rules are enough (the user is created on
/// every node: ACLs are not shared): topology, `ping()` and every check.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_rules_are_enough_on_a_cluster() {
    let cluster = support::RedisCluster::start();
    let urls: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|node| node.least_privileged_url("rl"))
        .collect();
    let store = RedisStore::connect_cluster(&urls).await.unwrap();
    for i in 0..4 {
        everything_works(&store, &format!("cluster-{i}")).await;
    }
}
