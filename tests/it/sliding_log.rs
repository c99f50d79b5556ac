//! The sliding log (`Algorithm::SlidingLog`, the default) on every store
//! and both executions: what only it does. Its windows roll with every
//! request, `reset` and `retry_after` follow its entries, and it alone keeps
//! a minimum spacing. (What every algorithm does is in conformance.rs; the
//! Redis-only checks of the log are in redis_store.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::harness::{Harness, MS};

/// Every admitted request is full again a window after it (`reset`); a
/// denied one is admitted when the oldest entry leaves.
async fn reset_and_retry_after_follow_the_entries(h: Harness) {
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

/// Rates `2/500ms, 3/3s`: each denial waits for the oldest entry of the
/// rate that denies.
async fn several_rates_wait_for_their_own_oldest_entry(h: Harness) {
    let p = h.policy("2/500ms, 3/3s");
    let t0 = h.mark();
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(
        (d.limit(), d.remaining()),
        (2, 1),
        "the rate with least remaining"
    );
    let d = h.check("k", &p).await;
    assert_eq!((d.limit(), d.remaining()), (2, 0));
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), 2, "denied by the short rate");
    h.assert_near(
        d.retry_after(),
        (500 * MS).saturating_sub(h.since(t0)),
        "short retry_after",
    );
    h.advance_past(500 * MS).await;
    // The denied request did not count against the long rate.
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!((d.limit(), d.remaining()), (3, 0));
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), 3, "denied by the long rate");
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(3).saturating_sub(h.since(t0)),
        "long retry_after",
    );
}

support::every_store_and_execution!([
    reset_and_retry_after_follow_the_entries,
    window_rolls,
    reset_and_retry_differ,
    min_spacing,
    several_rates_wait_for_their_own_oldest_entry,
]);
