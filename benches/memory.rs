//! Nanoseconds per decision of `MemoryStore`, for each algorithm, on one
//! thread and on two threads sharing the store.
//!
//! ```sh
//! cargo bench --bench memory
//! ```
//!
//! Each decision is `MemoryStore::check_now` on one of 10,000 keys in turn,
//! under a limit no key reaches (`1000000/s`), on the system clock: the
//! work of an admitted request. With two threads, each makes `iters`
//! decisions on its own keys at the same time, and the time reported per
//! iteration is the wall time divided by two: the store's throughput, as ns
//! per decision.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tower_redis_ratelimit::{MemoryStore, Policy};

const KEYS: usize = 10_000;

fn policies() -> Vec<(&'static str, Policy)> {
    let base: Policy = "1000000/s".parse().unwrap();
    vec![
        ("sliding-log", base.clone()),
        ("fixed-window", base.clone().fixed_window().unwrap()),
        ("sliding-window", base.clone().sliding_window().unwrap()),
        ("gcra", base.gcra().unwrap()),
    ]
}

fn keys(prefix: &str) -> Vec<String> {
    (0..KEYS).map(|i| format!("{prefix}{i}")).collect()
}

fn decide(store: &MemoryStore, keys: &[String], policy: &Policy, iters: u64) {
    for i in 0..iters as usize {
        let decision = store.check_now(&keys[i % KEYS], policy);
        debug_assert!(decision.allowed());
        black_box(decision);
    }
}

fn bench(c: &mut Criterion) {
    let one = keys("a");
    let two = keys("b");
    for (name, policy) in policies() {
        let mut group = c.benchmark_group(format!("memory/{name}"));
        group.bench_function("1-thread", |b| {
            let store = MemoryStore::new();
            b.iter_custom(|iters| {
                let start = Instant::now();
                decide(&store, &one, &policy, iters);
                start.elapsed()
            });
        });
        group.bench_function("2-threads", |b| {
            let store = MemoryStore::new();
            b.iter_custom(|iters| {
                let start = Instant::now();
                std::thread::scope(|s| {
                    s.spawn(|| decide(&store, &one, &policy, iters));
                    s.spawn(|| decide(&store, &two, &policy, iters));
                });
                start.elapsed() / 2
            });
        });
        group.finish();
    }
    // The concurrency limit takes and gives back a lease per decision.
    let concurrency = Policy::concurrency(1_000_000).unwrap();
    let mut group = c.benchmark_group("memory/concurrency");
    group.bench_function("1-thread", |b| {
        let store = MemoryStore::new();
        b.iter_custom(|iters| {
            let start = Instant::now();
            for i in 0..iters as usize {
                let key = &one[i % KEYS];
                let decision = store.check_now(key, &concurrency);
                if let Some(lease) = decision.lease() {
                    store.release_now(key, &concurrency, lease);
                }
                black_box(decision);
            }
            start.elapsed()
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
