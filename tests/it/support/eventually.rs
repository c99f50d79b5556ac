//! Waiting for what a background task does (a settlement, a refund, a
//! clean-up) to show in the store.

use std::future::Future;
use std::time::{Duration, Instant};

/// Read with `read` every `step` until it gives `expected`; fail, naming
/// `what`, the last value and the expected one, once `within` has passed.
pub async fn eventually<F, Fut>(
    within: Duration,
    step: Duration,
    what: &str,
    expected: u64,
    read: F,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = u64>,
{
    let deadline = Instant::now() + within;
    loop {
        let value = read().await;
        if value == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {value}, expected {expected}"
        );
        tokio::time::sleep(step).await;
    }
}
