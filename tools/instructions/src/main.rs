//! A plain loop of decisions for `scripts/instructions-in-process`, which
//! runs it under valgrind's callgrind twice (two counts of decisions) and
//! takes the difference of the instructions: the instructions of one
//! decision, without the setup. Not a timing benchmark (`benches/in_process.rs`
//! times the same cases).
//!
//! ```sh
//! cargo run --release --manifest-path tools/instructions/Cargo.toml -- gcra 100000
//! scripts/instructions-in-process   # every case, counted
//! ```
//!
//! The cases are those of `benches/in_process.rs`, one thread: 10,000
//! `String` keys in turn under a limit no key reaches, each key decided
//! once before the counted loop (its entry exists, as for a client seen
//! before).
//!
//! With `CLOCK=frozen`, governor and the stores read a clock that does not
//! move (governor's `FakeRelativeClock`, a `ManualClock`) instead of the
//! system clock: the count leaves out reading the time, which both pay
//! alike and which moves most from run to run under valgrind.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};

const KEYS: usize = 10_000;

/// The cases, in the order the script reports them.
const CASES: &[&str] = &[
    "governor-dashmap",
    "gcra",
    "fixed-window",
    "sliding-window",
    "sliding-log-10",
    "gcra-owned-key",
    "limiter-gcra",
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(case), Some(n)) = (args.first(), args.get(1)) else {
        eprintln!("usage: instructions <case> <decisions>; cases: {CASES:?}");
        std::process::exit(2);
    };
    let n: usize = n.parse().expect("a number of decisions");
    let keys: Vec<String> = (0..KEYS).map(|i| format!("a{i}")).collect();
    let base: Policy = "1000000/s".parse().unwrap();
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).unwrap());
    match case.as_str() {
        "governor-dashmap" if frozen() => {
            let clock = governor::clock::FakeRelativeClock::default();
            let limiter: RateLimiter<
                String,
                governor::state::keyed::DashMapStateStore<String>,
                governor::clock::FakeRelativeClock,
                governor::middleware::NoOpMiddleware<governor::nanos::Nanos>,
            > = RateLimiter::new(quota, Default::default(), clock);
            run(&keys, n, |key| limiter.check_key(key).is_ok());
        }
        "governor-dashmap" => {
            let limiter = RateLimiter::keyed(quota);
            run(&keys, n, |key| limiter.check_key(key).is_ok());
        }
        "gcra" => store_case(&keys, n, &base.gcra().unwrap()),
        "fixed-window" => store_case(&keys, n, &base.fixed_window().unwrap()),
        "sliding-window" => store_case(&keys, n, &base.sliding_window().unwrap()),
        "sliding-log-10" => {
            // About 10 entries per key: a manual clock moving 1 µs per
            // decision and a window of 10 rounds of the keys.
            let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
            let store = MemoryStore::with_clock(clock.clone());
            let policy: Policy = format!("1000000/{}ms", 10 * KEYS / 1_000).parse().unwrap();
            let step = Duration::from_micros(1);
            for _ in 0..11 {
                for key in &keys {
                    store.check_now(key, &policy);
                    clock.advance(step);
                }
            }
            run(&keys, n, |key| {
                clock.advance(step);
                store.check_now(key, &policy).allowed()
            });
        }
        "gcra-owned-key" => {
            let store = memory_store();
            let policy = base.gcra().unwrap();
            run(&keys, n, |key| {
                store.check_now(&owned(key), &policy).allowed()
            });
        }
        "limiter-gcra" => {
            let limiter = Limiter::new(memory_store(), base.gcra().unwrap()).with_name("api");
            run(&keys, n, |key| {
                let verdict = limiter.check_owned(owned(key)).now();
                verdict
                    .expect("in process")
                    .expect("no store error")
                    .allowed()
            });
        }
        other => panic!("unknown case {other:?}; cases: {CASES:?}"),
    }
}

/// The key as an owned `String` with room for a limiter's name, as the
/// layer's extractors and `Limiter::check` make it.
fn owned(key: &str) -> String {
    let mut owned = String::with_capacity(key.len() + 32);
    owned.push_str(key);
    owned
}

/// Whether the clocks are frozen (`CLOCK=frozen`).
fn frozen() -> bool {
    std::env::var("CLOCK").is_ok_and(|clock| clock == "frozen")
}

/// A store on the system clock, or on a clock that does not move.
fn memory_store() -> MemoryStore {
    if frozen() {
        MemoryStore::with_clock(ManualClock::new(Duration::from_secs(1_700_000_000)))
    } else {
        MemoryStore::new()
    }
}

fn store_case(keys: &[String], n: usize, policy: &Policy) {
    let store = memory_store();
    run(keys, n, |key| store.check_now(key, policy).allowed());
}

/// Decide every key once, then `n` decisions over the keys in turn.
fn run(keys: &[String], n: usize, mut decide: impl FnMut(&String) -> bool) {
    for key in keys {
        assert!(decide(key), "a limit no key reaches");
    }
    for i in 0..n {
        black_box(decide(black_box(&keys[i % KEYS])));
    }
}
