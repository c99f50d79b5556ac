//! One conformance suite, run against every store: MemoryStore on a manual
//! clock (exact values) and RedisStore in both executions against a real
//! redis-server (real time, short windows, margins).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use support::harness::{Harness, MS};
use tower_redis_ratelimit::Execution;

async fn admits_max_then_denies(h: Harness) {
    let p = h.policy("3/1s");
    let t0 = h.mark();
    for remaining in [2, 1, 0] {
        let d = h.check("k", &p).await;
        assert!(d.allowed());
        assert_eq!((d.limit(), d.remaining()), (3, remaining));
        assert_eq!(d.reset(), Duration::from_secs(1));
        assert_eq!(d.retry_after(), Duration::ZERO);
    }
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!((d.limit(), d.remaining()), (3, 0));
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(t0)),
        "retry_after",
    );
}

async fn window_rolls(h: Harness) {
    let p = h.policy("3/1s");
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    h.advance(500 * MS).await;
    let t1 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    assert!(!h.check("k", &p).await.allowed());
    // The first two leave the window; the third is still in it.
    h.advance_past(500 * MS).await;
    let d = h.check("k", &p).await;
    assert!(
        d.allowed(),
        "a rolling window admits once the oldest entries leave"
    );
    assert_eq!(d.remaining(), 1);
    assert!(h.check("k", &p).await.allowed());
    let d = h.check("k", &p).await;
    assert!(!d.allowed(), "the entry from t1 still counts");
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(t1)),
        "retry_after",
    );
}

async fn retry_after_is_exact_and_honest(h: Harness) {
    let p = h.policy("2/1s");
    assert!(h.check("k", &p).await.allowed());
    h.advance(100 * MS).await;
    assert!(h.check("k", &p).await.allowed());
    let denied = h.check("k", &p).await;
    assert!(!denied.allowed());
    let wait = denied.retry_after();
    assert!(
        wait > Duration::ZERO && wait <= Duration::from_secs(1),
        "{wait:?}"
    );
    if let Harness::Memory { .. } = h {
        // Exact: one microsecond early is still too early.
        h.advance(wait - Duration::from_micros(1)).await;
        let d = h.check("k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.retry_after(), Duration::from_micros(1));
        h.advance(Duration::from_micros(1)).await;
    } else {
        h.advance(wait).await;
    }
    assert!(
        h.check("k", &p).await.allowed(),
        "waiting retry_after must be enough"
    );
}

async fn denied_attempts_do_not_lock_out(h: Harness) {
    let p = h.policy("2/1s");
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    for _ in 0..5 {
        assert!(!h.check("k", &p).await.allowed());
        h.advance(80 * MS).await;
    }
    h.advance_past(600 * MS).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed(), "denied attempts must not count");
    assert_eq!(d.remaining(), 1);
}

/// Rates `2c/500ms, 3c/3s` with cost `c`: all-or-nothing, and the headline
/// rate is the one that says the most.
async fn several_rates(h: Harness, cost: u64) {
    let p = h
        .policy(&format!("{}/500ms, {}/3s", 2 * cost, 3 * cost))
        .with_cost(cost)
        .unwrap();
    let t0 = h.mark();
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(
        (d.limit(), d.remaining()),
        (2 * cost, cost),
        "the rate with least remaining"
    );
    let d = h.check("k", &p).await;
    assert_eq!((d.limit(), d.remaining()), (2 * cost, 0));
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), 2 * cost, "denied by the short rate");
    h.assert_near(
        d.retry_after(),
        (500 * MS).saturating_sub(h.since(t0)),
        "short retry_after",
    );
    h.advance_past(500 * MS).await;
    // The denied request did not count against the long rate.
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!((d.limit(), d.remaining()), (3 * cost, 0));
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), 3 * cost, "denied by the long rate");
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(3).saturating_sub(h.since(t0)),
        "long retry_after",
    );
}

async fn multi_rate_is_all_or_nothing(h: Harness) {
    several_rates(h, 1).await;
}

async fn cost_with_several_rates(h: Harness) {
    several_rates(h, 2).await;
}

async fn min_spacing(h: Harness) {
    let p = h.policy("10/1s").with_min_spacing(200 * MS).unwrap();
    let t0 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.remaining(), 9);
    h.assert_near(
        d.retry_after(),
        (200 * MS).saturating_sub(h.since(t0)),
        "spacing retry_after",
    );
    h.advance(d.retry_after()).await;
    assert!(h.check("k", &p).await.allowed());
}

async fn cost(h: Harness) {
    let p = h.policy("5/1s").with_cost(2).unwrap();
    let t0 = h.mark();
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 3);
    assert_eq!(h.check("k", &p).await.remaining(), 1);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.remaining(), 1);
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(t0)),
        "cost retry_after",
    );
    // One unit is still free for a cheaper request.
    let cheap = h.policy("5/1s");
    let d = h.check("k", &cheap).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 0);
}

async fn reset_and_retry_differ(h: Harness) {
    let p = h.policy("3/1s");
    let t0 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    h.advance(300 * MS).await;
    let t1 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    h.advance(300 * MS).await;
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    // Admitted when the oldest leaves; full again when the newest leaves.
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(t0)),
        "retry_after",
    );
    h.assert_near(
        d.reset(),
        Duration::from_secs(1).saturating_sub(h.since(t1)),
        "reset",
    );
}

async fn keys_are_independent(h: Harness) {
    let p = h.policy("1/1s");
    assert!(h.check("a", &p).await.allowed());
    assert!(!h.check("a", &p).await.allowed());
    assert!(h.check("b", &p).await.allowed());
    assert!(h.check("a b {c}", &p).await.allowed());
    assert!(!h.check("a b {c}", &p).await.allowed());
}

support::suite! {
    cases: [
        admits_max_then_denies,
        window_rolls,
        retry_after_is_exact_and_honest,
        denied_attempts_do_not_lock_out,
        multi_rate_is_all_or_nothing,
        min_spacing,
        cost,
        cost_with_several_rates,
        reset_and_retry_differ,
        keys_are_independent,
    ],
    memory: Harness::memory(),
    redis_transaction: Harness::redis(Execution::Transaction).await,
    redis_script: Harness::redis(Execution::Script).await,
    manager_transaction: Harness::redis_manager(Execution::Transaction).await,
    manager_script: Harness::redis_manager(Execution::Script).await,
    #[cfg(feature = "cluster")]
    cluster_transaction: Harness::redis_cluster(Execution::Transaction).await,
    #[cfg(feature = "cluster")]
    cluster_script: Harness::redis_cluster(Execution::Script).await,
}
