//! The admin router keeps the Prometheus recorder's memory flat when
//! nobody scrapes `/metrics`. A binary of its own: it installs the
//! process's metrics recorder, and it reads the process's resident memory,
//! which other tests running beside it would move.
#![cfg(all(feature = "admin", target_os = "linux"))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use tower_redis_ratelimit::admin::{Admin, prometheus_builder};
use tower_redis_ratelimit::{Algorithm, Limiter, MemoryStore, Policy};

/// This process's resident memory, in bytes.
fn resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb * 1024
}

/// Checks of `limiter` until `at_least` were made and `during` has passed
/// (several of the upkeep's seconds), or `cap` has passed whatever was
/// made (a slow debug build on a busy machine), a pause now and then so
/// that other tasks run: how many were made. Each records one sample of
/// the store's latency histogram.
async fn checks(limiter: &Limiter, at_least: u64, during: Duration, cap: Duration) -> u64 {
    let start = Instant::now();
    let mut made = 0;
    while (made < at_least || start.elapsed() < during) && start.elapsed() < cap {
        for _ in 0..1_000 {
            assert!(limiter.check("k").await.unwrap().allowed());
        }
        made += 1_000;
        tokio::task::yield_now().await;
    }
    made
}

/// Checks measured: enough that samples held until a scrape (16.6 bytes
/// each) would show far above the noise of resident memory.
const MEASURED: u64 = 300_000;

/// What resident memory may move by whatever the checks hold: pages the
/// allocator and the runtime touch for the first time.
const NOISE: u64 = 256 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histogram_samples_are_not_held_until_a_scrape() {
    let handle = prometheus_builder().install_recorder().unwrap();
    let _router = Admin::new(
        "an-admin-token-of-32-bytes-long!",
        "127.0.0.1:9000".parse().unwrap(),
    )
    .unwrap()
    .with_metrics(handle)
    .into_router();
    // GCRA keeps one value per key, whatever the number of checks.
    let policy = "1000000000/s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
        .unwrap();
    let limiter = Limiter::new(MemoryStore::new(), policy).with_name("flat");
    // Warm up: every structure the checks and the recorder keep is built.
    let second = Duration::from_secs(1);
    checks(&limiter, 0, 2 * second, 2 * second).await;

    let before = resident();
    let started = Instant::now();
    let made = checks(&limiter, MEASURED, 6 * second, 180 * second).await;
    let grown = resident().saturating_sub(before);
    let per_check = grown.saturating_sub(NOISE) as f64 / made as f64;
    eprintln!(
        "{made} checks in {:.1} s: resident memory grew by {grown} bytes ({per_check:.2} bytes a check beyond {NOISE})",
        started.elapsed().as_secs_f64()
    );
    // Held until a scrape, the samples take about 16 bytes each (RSS grew
    // by 16.6 bytes a check before the upkeep ran); folded into their
    // buckets every second, nearly nothing. However few checks a slow
    // machine made within the cap, what they grew by is measured: the
    // assertion is on bytes per check.
    assert!(
        per_check < 2.0,
        "resident memory grew by {grown} bytes over {made} samples ({per_check:.1} bytes each beyond {NOISE})"
    );
}
