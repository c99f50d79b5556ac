//! RedisStore on a real three-master Redis Cluster: keys spread over every
//! master and each lands on the node that owns its slot, scripts reload on
//! the right node after `SCRIPT FLUSH`, the transaction execution's
//! piggy-backed `TIME`, `ping`. (The algorithm suites run on a cluster too:
//! the `cluster*` modules of tests/conformance.rs, fixed_window.rs, ...)
#![cfg(feature = "cluster")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::RedisCluster;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore, Store};

/// One policy of every algorithm (and both sliding-log executions).
fn policies() -> Vec<Policy> {
    let rate: Policy = "2/60s".parse().unwrap();
    vec![
        rate.clone().with_execution(Execution::Script).unwrap(),
        rate.clone().with_execution(Execution::Transaction).unwrap(),
        rate.clone().with_algorithm(Algorithm::FixedWindow).unwrap(),
        rate.clone()
            .with_algorithm(Algorithm::SlidingWindow)
            .unwrap(),
        rate.with_algorithm(Algorithm::Gcra).unwrap(),
        Policy::concurrency(2).unwrap(),
    ]
}

fn dbsize(node: &support::RedisServer) -> usize {
    node.command(&["DBSIZE"])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap()
}

/// Three checks of a 2-per-minute limit: two admitted, the third denied.
async fn admits_two_then_denies(store: &RedisStore, key: &str, policy: &Policy) {
    let mut allowed = Vec::new();
    for _ in 0..3 {
        let decision = store.check(key, policy).await.unwrap_or_else(|error| {
            panic!(
                "{key} with {:?}/{:?}: {error}",
                policy.algorithm(),
                policy.execution()
            )
        });
        allowed.push(decision.allowed());
    }
    assert_eq!(
        allowed,
        [true, true, false],
        "{key} with {:?}/{:?}",
        policy.algorithm(),
        policy.execution()
    );
}

#[tokio::test]
async fn keys_spread_over_every_master_and_land_on_their_slot_owner() {
    let cluster = RedisCluster::start();
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    let fixed = "5/60s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow)
        .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("client-{i}")).collect();
    for key in &keys {
        assert!(store.check(key, &fixed).await.unwrap().allowed());
    }
    let sizes: Vec<usize> = cluster.nodes().iter().map(dbsize).collect();
    assert_eq!(sizes.iter().sum::<usize>(), keys.len(), "{sizes:?}");
    assert!(
        sizes.iter().all(|&n| n > 0),
        "every master holds some keys: {sizes:?}"
    );
    for key in &keys {
        // The fixed window's count of the key: `{name}:{window}:{index}`.
        let redis_key = store.redis_key("fixed", key);
        let counts = cluster
            .node_of(&redis_key)
            .keys(&format!("{redis_key}:60000000:*"));
        assert!(
            counts.len() == 1,
            "{redis_key}'s count is on the master that owns its slot: {counts:?}"
        );
    }
}

#[tokio::test]
async fn every_algorithm_counts_on_every_master() {
    let cluster = RedisCluster::start();
    // What is tested is the count, not the speed: a loaded machine gets
    // time to load each script on each node.
    let store = RedisStore::connect_cluster(&cluster.urls())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5));
    // Keys until each master owns at least one of them.
    let mut keys: Vec<String> = Vec::new();
    let mut covered = std::collections::HashSet::new();
    for i in 0.. {
        let key = format!("k{i}");
        if covered.insert(cluster.node_of(&format!("{{{key}}}")).port()) {
            keys.push(key);
        }
        if covered.len() == cluster.nodes().len() {
            break;
        }
    }
    for policy in policies() {
        for key in &keys {
            // Both sliding-log executions use one Redis key: a fresh key
            // for each policy.
            let key = format!("{key}-{:?}-{:?}", policy.algorithm(), policy.execution());
            admits_two_then_denies(&store, &key, &policy).await;
        }
    }
}

/// Scripts are loaded on demand: after `SCRIPT FLUSH` on every node the
/// next `EVALSHA` gets `NOSCRIPT`, and the reload reaches the node that runs
/// it.
#[tokio::test]
async fn scripts_reload_after_a_flush_on_every_node() {
    let cluster = RedisCluster::start();
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    let keys: Vec<String> = (0..12).map(|i| format!("flush-{i}")).collect();
    let script_policies: Vec<Policy> = policies()
        .into_iter()
        .filter(|p| p.execution() == Execution::Script || p.algorithm() != Algorithm::SlidingLog)
        .collect();
    for policy in &script_policies {
        for key in &keys {
            store.check(key, policy).await.unwrap();
        }
    }
    for node in cluster.nodes() {
        assert!(node.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    }
    for policy in &script_policies {
        for key in &keys {
            store.check(key, policy).await.unwrap();
        }
    }
    let loads: u64 = cluster.nodes().iter().map(|n| n.calls("script|load")).sum();
    assert!(loads > 0, "scripts were loaded again");
}

/// The transaction execution with the clock measured again on every check:
/// the `TIME` rides in each `MULTI`/`EXEC` pipeline, to the key's node.
#[tokio::test]
async fn transaction_with_time_on_every_check() {
    let cluster = RedisCluster::start();
    let store = RedisStore::connect_cluster(&cluster.urls())
        .await
        .unwrap()
        .with_clock_refresh(Duration::ZERO);
    let policy = "2/60s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Transaction)
        .unwrap();
    for i in 0..9 {
        admits_two_then_denies(&store, &format!("tx-{i}"), &policy).await;
    }
    // Denied entries were taken back out: two per key remain.
    for i in 0..9 {
        let key = store.redis_key("log", &format!("tx-{i}"));
        let reply = cluster.node_of(&key).command(&["ZCARD", &key]);
        assert_eq!(reply.trim(), ":2", "{key}");
    }
}

#[tokio::test]
async fn ping_asks_every_node() {
    let mut cluster = RedisCluster::start();
    let store = RedisStore::connect_cluster(&cluster.urls())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5));
    store.ping().await.unwrap();
    let gcra = "5/60s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
        .unwrap();
    let dead_port = cluster.nodes()[2].port();
    let on = |dead: bool| {
        (0..)
            .map(|i| format!("p{i}"))
            .find(|key| {
                (cluster.node_of(&store.redis_key("gcra", key)).port() == dead_port) == dead
            })
            .unwrap()
    };
    let (dead_key, live_key) = (on(true), on(false));
    cluster.kill_node(2);
    assert!(store.ping().await.is_err(), "a dead master fails the ping");
    assert!(store.check(&dead_key, &gcra).await.is_err());
    let live = store.check(&live_key, &gcra).await;
    assert!(
        live.as_ref().is_ok_and(|decision| decision.allowed()),
        "a live master still counts: {live:?}"
    );
}

#[tokio::test]
async fn connect_cluster_reports_an_unreachable_cluster() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let result = RedisStore::connect_cluster(&[format!("redis://127.0.0.1:{port}")]).await;
    assert!(result.is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
}
