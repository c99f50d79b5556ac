//! `PostgresStore` under faults, against a real PostgreSQL server started by
//! each test: a row another session holds locked, a decision timed out
//! mid-statement, the server gone (the circuit breaker), and many callers
//! finding the pool empty at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::postgres::{PostgresServer, through};
use crate::support::proxy::{Direction, FaultProxy};
use tower_redis_ratelimit::limiter::{CircuitBreaker, DecidedBy};
use tower_redis_ratelimit::{
    FailMode, LimitError, Limiter, Policy, PostgresStore, Store, StoreError,
};

/// A row locked by another session for 10 s (an operator's psql left in
/// `BEGIN; SELECT … FOR UPDATE`) costs its own key alone: each of its
/// checks fails by the fail mode within the store's timeout, while 50 other
/// keys are decided by the store in their usual time, and the circuit
/// breaker (5 failures) stays closed. Once the row is let go, the key
/// counts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_row_costs_its_own_key_alone() {
    let server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(store, "100/min".parse::<Policy>().unwrap())
        .with_fail_mode(FailMode::Closed)
        .with_circuit_breaker(CircuitBreaker::new(5, Duration::from_secs(1)));
    assert!(limiter.check("stuck").await.unwrap().allowed());
    // The pool's sessions open beforehand: the free keys' checks below
    // take one each as usual, none pays for a new connection.
    let warm: Vec<_> = (0..10)
        .map(|i| {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check(&format!("warm-{i}")).await })
        })
        .collect();
    for check in warm {
        assert!(check.await.unwrap().unwrap().allowed());
    }
    let holder = server.client().await;
    let rows = holder
        .query("SELECT key FROM rate_limits", &[])
        .await
        .unwrap();
    let stuck_row: Vec<u8> = rows[0].get(0);
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .query(
            "SELECT * FROM rate_limits WHERE key = $1 FOR UPDATE",
            &[&stuck_row],
        )
        .await
        .unwrap();
    let held_until = Instant::now() + Duration::from_secs(10);

    let stuck = tokio::spawn({
        let limiter = limiter.clone();
        async move {
            let mut failures = 0;
            while Instant::now() + Duration::from_secs(1) < held_until {
                let asked = Instant::now();
                let outcome = limiter.check("stuck").await;
                let took = asked.elapsed();
                match outcome {
                    Err(LimitError::Store(StoreError::KeyBusy(_))) => failures += 1,
                    other => panic!("the locked key answered {other:?}"),
                }
                // The sessions' lock_timeout: half the store's 1 s.
                assert!(took < Duration::from_millis(900), "took {took:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            failures
        }
    });
    let mut slowest = Duration::ZERO;
    for i in 0..50 {
        let asked = Instant::now();
        let verdict = limiter.check(&format!("free-{i}")).await.unwrap();
        slowest = slowest.max(asked.elapsed());
        assert!(verdict.allowed());
        assert_eq!(verdict.decided_by(), DecidedBy::Store);
        assert_eq!(verdict.decision().unwrap().remaining(), 99);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let failures = stuck.await.unwrap();
    assert!(
        failures >= 6,
        "{failures} failures of the locked key: more than the breaker's 5"
    );
    // Each decided in its usual time (a few ms here), far from the locked
    // key's half second.
    assert!(slowest < Duration::from_millis(250), "slowest {slowest:?}");
    let verdict = limiter.check("free-0").await.unwrap();
    assert_eq!(
        verdict.decided_by(),
        DecidedBy::Store,
        "the breaker is closed"
    );
    assert_eq!(verdict.decision().unwrap().remaining(), 98);

    holder.batch_execute("ROLLBACK").await.unwrap();
    let verdict = limiter.check("stuck").await.unwrap();
    assert_eq!(
        verdict.decision().unwrap().remaining(),
        98,
        "the locked key's failed checks counted nothing"
    );
}

/// A lock on the whole table (an index built without `CONCURRENTLY`, a
/// `LOCK TABLE`) is not a stuck row: once keys beyond two meet it, their
/// checks fail as the store failing, which the circuit breaker counts; a
/// lock that stops reads fails the first check so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_table_fails_as_the_store_not_as_busy_keys() {
    let server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .connect()
        .await
        .unwrap();
    // A store that keeps no rows: each decision reads first.
    let reader = PostgresStore::builder(&server.url())
        .seen_bytes(0)
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1min".parse().unwrap();
    for key in ["a", "b", "c", "d"] {
        assert!(store.check(key, &policy).await.unwrap().allowed());
    }
    let holder = server.client().await;
    // Writes wait, reads go on.
    holder
        .batch_execute("BEGIN; LOCK TABLE rate_limits IN EXCLUSIVE MODE")
        .await
        .unwrap();
    for key in ["a", "b"] {
        let error = store.check(key, &policy).await.unwrap_err();
        assert!(matches!(error, StoreError::KeyBusy(_)), "{key}: {error}");
    }
    let error = store.check("c", &policy).await.unwrap_err();
    assert!(matches!(error, StoreError::Backend { .. }), "c: {error}");
    holder.batch_execute("ROLLBACK").await.unwrap();
    // Reads wait too.
    holder
        .batch_execute("BEGIN; LOCK TABLE rate_limits IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let error = reader.check("d", &policy).await.unwrap_err();
    assert!(matches!(error, StoreError::Backend { .. }), "d: {error}");
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(store.check("d", &policy).await.unwrap().remaining(), 3);
}

/// A decision that times out while its statement is on the wire leaves the
/// pool without its session, and its statement is cancelled on the server:
/// the next decision opens another session rather than queue behind the
/// statement, and is decided at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_decision_does_not_return_its_session_to_the_pool() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = through(&proxy);
    let store = PostgresStore::builder(&url)
        .pool_size(1)
        .timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1min".parse().unwrap();
    assert_eq!(store.check("k", &policy).await.unwrap().remaining(), 4);
    assert_eq!(proxy.stats().accepted, 1);
    // The answers are held: the decision times out with its statement
    // sent.
    proxy.stall(Direction::ToClient, Duration::from_secs(30));
    let error = store.check("k", &policy).await.unwrap_err();
    assert!(matches!(error, StoreError::Timeout(_)), "{error}");
    proxy.heal();
    let asked = Instant::now();
    let decision = store.check("k", &policy).await.unwrap();
    // At once: a new connection through the proxy (the 30 s stall is
    // not waited for).
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    // The timed-out write may have been done by the server (its answer was
    // lost), never twice.
    assert!((2..=3).contains(&decision.remaining()), "{decision:?}");
    // Three connections: the first session, the cancel request sent for
    // its timed-out statement, and the new session; the first is dropped.
    let deadline = Instant::now() + Duration::from_secs(5);
    let done = |stats: &crate::support::proxy::Stats| (stats.accepted, stats.open) == (3, 1);
    while !done(&proxy.stats()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = proxy.stats();
    assert!(done(&stats), "{stats:?}");
}

/// A write whose answer is lost when its connection is cut (PostgreSQL ran
/// it; the store never heard) is not sent again: the check fails, and the
/// count holds it once. The store had seen the key, so the write was the
/// decision's first statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_answer_is_lost_counts_once() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = through(&proxy);
    let store = PostgresStore::builder(&url)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1min".parse().unwrap();
    for round in 0..3 {
        let key = format!("k-{round}");
        assert_eq!(store.check(&key, &policy).await.unwrap().remaining(), 4);
        proxy.stall(Direction::ToClient, Duration::from_secs(30));
        let lost = tokio::spawn({
            let (store, policy, key) = (store.clone(), policy.clone(), key.clone());
            async move { store.check(&key, &policy).await }
        });
        // Long enough for PostgreSQL to run and commit the write.
        tokio::time::sleep(Duration::from_millis(300)).await;
        proxy.cut_all();
        let error = lost.await.unwrap().expect_err("its connection was cut");
        eprintln!("{error}");
        proxy.heal();
        assert_eq!(
            store.check(&key, &policy).await.unwrap().remaining(),
            2,
            "round {round}: the lost write counted once, not twice"
        );
    }
}

/// The circuit breaker on PostgreSQL: with the server gone, it opens after
/// its run of failures and answers at once without asking; with the server
/// back, a probe after the cooldown closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_breaker_opens_and_recovers_on_postgres() {
    let mut server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(store, "100/min".parse::<Policy>().unwrap())
        .with_fail_mode(FailMode::Closed)
        .with_circuit_breaker(CircuitBreaker::new(3, Duration::from_millis(500)));
    assert!(limiter.check("k").await.unwrap().allowed());
    server.stop();
    for attempt in 0..3 {
        let error = limiter.check("k").await.unwrap_err();
        assert!(
            !matches!(error, LimitError::Store(StoreError::CircuitOpen)),
            "attempt {attempt}: {error}"
        );
    }
    let asked = Instant::now();
    let error = limiter.check("k").await.unwrap_err();
    assert!(
        matches!(error, LimitError::Store(StoreError::CircuitOpen)),
        "{error}"
    );
    assert!(
        asked.elapsed() < Duration::from_millis(50),
        "the store was asked"
    );
    server.restart();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let verdict = limiter.check("k").await.unwrap();
    assert_eq!(verdict.decided_by(), DecidedBy::Store);
    assert_eq!(verdict.decision().unwrap().remaining(), 98);
}

/// 200 callers finding the pool empty at once (a fresh store, a restarted
/// database) open at most the pool's size and one more connections, not
/// one each, and are all decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_finding_the_pool_empty_open_a_bounded_number_of_connections() {
    let server = PostgresServer::start();
    let proxy = FaultProxy::start(server.port());
    let url = through(&proxy);
    let store = PostgresStore::builder(&url)
        .pool_size(8)
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let policy = Arc::new("100/min".parse::<Policy>().unwrap());
    for round in 0..2 {
        let before = proxy.stats().accepted;
        let mut callers = Vec::new();
        for i in 0..200 {
            let (store, policy) = (store.clone(), Arc::clone(&policy));
            callers.push(tokio::spawn(async move {
                store.check(&format!("k-{i}"), &policy).await
            }));
        }
        for caller in callers {
            assert!(caller.await.unwrap().unwrap().allowed());
        }
        let opened = proxy.stats().accepted - before;
        assert!(opened <= 9, "round {round}: {opened} connections opened");
        // Every session cut: the next round finds the pool's sessions
        // closed, as after a restart of the database.
        proxy.cut_all();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
