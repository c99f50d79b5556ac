//! The units a limiter's key has left, and waiting for a settlement (it
//! runs in a task after the response) to reach the store.

use std::time::Duration;

use super::eventually::eventually;

use tower_redis_ratelimit::Limiter;

/// The units `key` has left (a peek answers what a check of the policy's
/// cost would leave, so its cost is added back).
pub async fn units_left(limiter: &Limiter, key: &str) -> u64 {
    let peek = limiter.peek(key).await.unwrap();
    assert!(peek.allowed(), "{peek:?}");
    peek.remaining() + limiter.policy().cost()
}

/// Wait until `key` has `expected` units left, at most two seconds.
pub async fn settles_to(limiter: &Limiter, key: &str, expected: u64) {
    let (within, step) = (Duration::from_secs(2), Duration::from_millis(5));
    eventually(within, step, "units left", expected, || {
        units_left(limiter, key)
    })
    .await;
}
