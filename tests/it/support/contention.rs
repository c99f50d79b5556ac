//! Many checks of one key at once through independent stores, for the
//! Redis-only tests of exactness under contention.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tower_redis_ratelimit::{Decision, Policy, RedisStore, Store, StoreError};

use super::RedisServer;

/// All `checks` through `store` at once (each waits at a barrier for the
/// others); the decisions in order.
pub async fn all_at_once(
    store: &RedisStore,
    checks: Vec<(String, Policy)>,
) -> Vec<Result<Decision, StoreError>> {
    let store = Arc::new(store.clone());
    let barrier = Arc::new(Barrier::new(checks.len()));
    let tasks: Vec<_> = checks
        .into_iter()
        .map(|(key, policy)| {
            let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                store.check(&key, &policy).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// Two independent stores (two pools, as two processes would have).
pub async fn two_stores(server: &RedisServer) -> [RedisStore; 2] {
    // A generous timeout: these tests are about counting, not speed.
    let timeout = Duration::from_secs(10);
    [
        RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_timeout(timeout),
        RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_timeout(timeout),
    ]
}

/// Two stores on `server` standing for app servers whose clocks are `skew`
/// ahead and behind: (ahead, behind).
pub async fn skewed_stores(server: &RedisServer, skew: Duration) -> (RedisStore, RedisStore) {
    use tower_redis_ratelimit::clock::{SkewedClock, SystemClock};
    let ahead = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_clock(SkewedClock::ahead(SystemClock::new(), skew));
    let behind = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_clock(SkewedClock::behind(SystemClock::new(), skew));
    (ahead, behind)
}

/// [`two_stores`] send `total` checks of `key` under `policy` at once
/// (tasks released together by a barrier, alternating between the stores);
/// returns how many were admitted.
pub async fn admitted_under_contention(
    server: &RedisServer,
    policy: Policy,
    key: &'static str,
    total: usize,
) -> usize {
    let stores = two_stores(server).await;
    let policy = Arc::new(policy);
    let barrier = Arc::new(Barrier::new(total));
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let store = stores[i % 2].clone();
        let policy = Arc::clone(&policy);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.check(key, &policy).await.unwrap().allowed()
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    admitted
}
