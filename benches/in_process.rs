//! Nanoseconds per decision in process: `MemoryStore` for each algorithm,
//! `Limiter::check` over it, and governor's keyed limiters beside them, in
//! one run (the machines are shared: only ratios taken in one run mean
//! anything).
//!
//! ```sh
//! cargo bench --bench in_process
//! ```
//!
//! Each decision is one of 10,000 `String` keys in turn, under a limit no
//! key reaches (`1000000/s`; governor: 1,000,000 per second, a burst of
//! 1,000,000), on the system clock: the work of an admitted request. With
//! two threads, each makes `iters` decisions on its own keys at the same
//! time, and the time reported per iteration is the wall time divided by
//! two: the throughput, as ns per decision.
//!
//! `limiter-denied/{unwatched,watched}` times 100 denied checks (of 100
//! keys over their limit) through `Limiter::check`, without and with the
//! most denied keys counted (issue 26).
//!
//! `sliding-log/<n>-entries` holds about `n` entries per key: a manual clock
//! moves 1 µs per decision and the window is `n` rounds of the keys long, so
//! that many of each key's entries are in it (one thread).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkGroup, Criterion, criterion_group, criterion_main, measurement::WallTime,
};
use governor::{Quota, RateLimiter};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};

const KEYS: usize = 10_000;

fn keys(prefix: &str) -> Vec<String> {
    (0..KEYS).map(|i| format!("{prefix}{i}")).collect()
}

/// Time `decide(keys, iters)` on one thread, and on two threads with keys
/// of their own (wall time / 2).
fn one_and_two<F>(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, decide: F)
where
    F: Fn(&[String], u64) + Sync,
{
    let one = keys("a");
    let two = keys("b");
    group.bench_function(format!("{name}/1-thread"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            decide(&one, iters);
            start.elapsed()
        });
    });
    group.bench_function(format!("{name}/2-threads"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| decide(&one, iters));
                s.spawn(|| decide(&two, iters));
            });
            start.elapsed() / 2
        });
    });
}

fn memory(policy: &Policy) -> impl Fn(&[String], u64) + Sync + '_ {
    let store = MemoryStore::new();
    move |keys, iters| {
        for i in 0..iters as usize {
            let decision = store.check_now(&keys[i % KEYS], policy);
            debug_assert!(decision.allowed());
            black_box(decision);
        }
    }
}

fn bench(c: &mut Criterion) {
    let base: Policy = "1000000/s".parse().unwrap();
    let mut group = c.benchmark_group("in_process");

    // governor's keyed limiters, default clock (quanta, as SystemClock).
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).unwrap());
    let dashmap = RateLimiter::keyed(quota);
    one_and_two(&mut group, "governor-dashmap", |keys, iters| {
        for i in 0..iters as usize {
            black_box(dashmap.check_key(&keys[i % KEYS]).is_ok());
        }
    });
    let hashmap = RateLimiter::hashmap(quota);
    one_and_two(&mut group, "governor-hashmap", |keys, iters| {
        for i in 0..iters as usize {
            black_box(hashmap.check_key(&keys[i % KEYS]).is_ok());
        }
    });

    let gcra = base.clone().gcra().unwrap();
    for (name, policy) in [
        ("gcra", &gcra),
        ("fixed-window", &base.clone().fixed_window().unwrap()),
        ("sliding-window", &base.clone().sliding_window().unwrap()),
        ("sliding-log", &base),
    ] {
        one_and_two(&mut group, name, memory(policy));
    }

    // The concurrency limit takes and gives back a lease per decision.
    let concurrency = Policy::concurrency(1_000_000).unwrap();
    let store = MemoryStore::new();
    one_and_two(&mut group, "concurrency", |keys, iters| {
        for i in 0..iters as usize {
            let key = &keys[i % KEYS];
            let decision = store.check_now(key, &concurrency);
            if let Some(lease) = decision.lease() {
                store.release_now(key, &concurrency, lease);
            }
            black_box(decision);
        }
    });

    // Limiter::check over MemoryStore, beside the same store's check_now:
    // both take the key as an owned String with room for the limiter's
    // name, as the layer's extractors and `Limiter::check` make it.
    let owned = |key: &str| {
        let mut owned = String::with_capacity(key.len() + 32);
        owned.push_str(key);
        owned
    };
    let store = MemoryStore::new();
    one_and_two(&mut group, "gcra-owned-key", |keys, iters| {
        for i in 0..iters as usize {
            let key = owned(&keys[i % KEYS]);
            black_box(store.check_now(&key, &gcra));
        }
    });
    let limiter = Limiter::new(MemoryStore::new(), gcra.clone()).with_name("api");
    one_and_two(&mut group, "limiter-gcra", |keys, iters| {
        for i in 0..iters as usize {
            let verdict = limiter.check_owned(owned(&keys[i % KEYS])).now();
            drop(black_box(
                verdict.expect("in process").expect("no store error"),
            ));
        }
    });

    // Denied checks through Limiter::check, with the most denied keys not
    // counted (nobody watches them) and counted (an admin router, or
    // most_denied, watches them): every key over its limit (1 per hour,
    // each key used once before the timing), one thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let hourly: Policy = "1/h".parse::<Policy>().unwrap().gcra().unwrap();
    let denying = keys("d");
    for watched in [false, true] {
        let limiter = Limiter::new(MemoryStore::new(), hourly.clone()).with_name("denied");
        if watched {
            runtime.block_on(limiter.most_denied()).unwrap();
        }
        for key in &denying {
            limiter.check_owned(owned(key)).now();
        }
        let name = if watched { "watched" } else { "unwatched" };
        group.bench_function(format!("limiter-denied/{name}"), |b| {
            // Inside the runtime: a due share of the denials is spawned.
            let _entered = runtime.enter();
            b.iter(|| {
                for key in denying.iter().take(100) {
                    let verdict = limiter.check_owned(owned(key)).now();
                    let verdict = verdict.expect("in process").expect("no store error");
                    debug_assert!(!verdict.allowed());
                    drop(black_box(verdict));
                }
            });
        });
    }

    // The sliding log at 10 and 1,000 entries per key.
    let one = keys("a");
    for entries in [10u64, 1_000] {
        // One round of the keys is KEYS decisions, KEYS µs on this clock.
        let window_ms = entries * KEYS as u64 / 1_000;
        let policy: Policy = format!("1000000/{window_ms}ms").parse().unwrap();
        group.bench_function(format!("sliding-log/{entries}-entries"), |b| {
            // Filled here, so that only a run of this benchmark pays for it.
            let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
            let store = MemoryStore::with_clock(clock.clone());
            let step = Duration::from_micros(1);
            for _ in 0..entries + 1 {
                for key in &one {
                    store.check_now(key, &policy);
                    clock.advance(step);
                }
            }
            let held = 1_000_000
                - store
                    .command_now(&one[0], &policy, Command::Peek)
                    .remaining();
            assert!(held.abs_diff(entries) <= 1, "{held} entries, not {entries}");
            b.iter_custom(|iters| {
                let start = Instant::now();
                for i in 0..iters as usize {
                    black_box(store.check_now(&one[i % KEYS], &policy));
                    clock.advance(step);
                }
                start.elapsed()
            });
        });
    }
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
