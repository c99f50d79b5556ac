//! The integration tests that set process-wide state: the tracing
//! dispatcher and the metrics recorder. In the binary of the other tests
//! (`tests/it`), their limiters would log and count into this state at the
//! same time, from other threads.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../it/support/mod.rs"]
mod support;

mod logging;
mod metrics;

/// Held by each test of this binary for its whole run: one test's
/// limiters must not register tracing callsites or report metrics while
/// another sets its dispatcher or reads its recorder.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Wait for the other tests of this binary to finish.
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().await
}
