//! The crate's store conformance suite (feature `test-util`): prove that a
//! [`Store`] of your own counts as [`MemoryStore`] does.
//!
//! [`check_store`] runs, for every algorithm and several policies (one
//! rate, two rates, a cost of 2), a long seeded sequence of checks,
//! operator commands ([`Command`]), releases of concurrency slots and
//! moves of the clock against your store and against a `MemoryStore`,
//! both on [`ManualClock`]s moved alike, and panics at the first decision
//! that differs, naming the step. A decision is compared in everything a
//! caller reads: allowed, blocked, the algorithm, every rate's limit,
//! remaining, reset and wait, and the retry-after (lease ids are each
//! store's own).
//!
//! ```
//! use tower_redis_ratelimit::MemoryStore;
//! use tower_redis_ratelimit::store::conformance;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! // Your store, built on the clock the suite moves.
//! conformance::check_store(MemoryStore::with_clock).await;
//! # });
//! ```
//!
//! A store kept in Redis or elsewhere on real time cannot follow a manual
//! clock; test it against a `MemoryStore` the same way, with margins
//! (the crate's own tests do, in `tests/it/conformance.rs`).

use std::time::Duration;

use crate::clock::ManualClock;
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Policy};
use crate::store::{Command, MemoryStore, Store};

/// Where both clocks start: 2023-11-14, a whole second.
const START: Duration = Duration::from_secs(1_700_000_000);
/// Steps per policy.
const STEPS: usize = 400;
/// Keys the sequence spreads over.
const KEYS: [&str; 3] = ["a", "b", "203.0.113.9"];

/// Run the suite against the store `make` builds on the clock it is given
/// (see the [module](self)). Panics at the first difference.
pub async fn check_store<S: Store>(make: impl Fn(ManualClock) -> S) {
    for policy in policies() {
        for seed in [1, 2, 3] {
            let clock = ManualClock::new(START);
            let reference_clock = ManualClock::new(START);
            let store = make(clock.clone());
            let reference = MemoryStore::with_clock(reference_clock.clone());
            let mut run = Run {
                policy: &policy,
                rng: Rng(seed),
                held: Vec::new(),
            };
            for step in 0..STEPS {
                let op = run.next_op();
                let what = format!("policy {policy}, seed {seed}, step {step}: {op:?}");
                match op {
                    Op::Advance(by) => {
                        clock.advance(by);
                        reference_clock.advance(by);
                    }
                    Op::Check(key) => {
                        let got = store.check(key, &policy).await;
                        let expected = reference.check(key, &policy).await;
                        let (got, expected) = outcomes(&what, got, expected);
                        same(&what, &got, &expected);
                        if got.allowed() {
                            run.held.push(Held {
                                key,
                                got: got.clone(),
                                expected: expected.clone(),
                            });
                        }
                    }
                    Op::Command(key, command) => {
                        let got = store.command(key, &policy, command).await;
                        let expected = reference.command(key, &policy, command).await;
                        let (got, expected) = outcomes(&what, got, expected);
                        same(&what, &got, &expected);
                    }
                    Op::GiveBack(i, release) => {
                        let held = run.held.swap_remove(i % run.held.len());
                        let units = policy.cost();
                        if release {
                            if let (Some(got), Some(expected)) =
                                (held.got.lease(), held.expected.lease())
                            {
                                release_both(
                                    &what, &store, &reference, held.key, &policy, got, expected,
                                )
                                .await;
                            }
                        } else if let (Some(got), Some(expected)) =
                            (held.got.refund_id(), held.expected.refund_id())
                        {
                            let got = store
                                .command(held.key, &policy, Command::Refund { id: got, units })
                                .await;
                            let expected = reference
                                .command(
                                    held.key,
                                    &policy,
                                    Command::Refund {
                                        id: expected,
                                        units,
                                    },
                                )
                                .await;
                            let (got, expected) = outcomes(&what, got, expected);
                            same(&what, &got, &expected);
                        }
                    }
                }
            }
        }
    }
}

/// Both stores' answers, or a panic naming the step when either failed.
fn outcomes<E: std::fmt::Debug>(
    what: &str,
    got: Result<Decision, E>,
    expected: Result<Decision, E>,
) -> (Decision, Decision) {
    match (got, expected) {
        (Ok(got), Ok(expected)) => (got, expected),
        (got, expected) => panic!("{what}: the store answered {got:?}, MemoryStore {expected:?}"),
    }
}

async fn release_both<S: Store>(
    what: &str,
    store: &S,
    reference: &MemoryStore,
    key: &str,
    policy: &Policy,
    got: Lease,
    expected: Lease,
) {
    let got = store.release(key, policy, got).await;
    let expected = reference.release(key, policy, expected).await;
    assert!(
        got.is_ok() && expected.is_ok(),
        "{what}: release answered {got:?}, MemoryStore {expected:?}"
    );
}

/// Panic unless `got` reads as `expected` to a caller.
#[track_caller]
fn same(what: &str, got: &Decision, expected: &Decision) {
    let read = |d: &Decision| {
        (
            d.allowed(),
            d.blocked(),
            d.algorithm(),
            d.rates().to_vec(),
            d.retry_after(),
        )
    };
    assert_eq!(
        read(got),
        read(expected),
        "{what}: the store's decision (left) differs from MemoryStore's (right)"
    );
}

/// The policies the suite runs: every algorithm, one rate and two (with a
/// cost of 2 for the counting ones).
fn policies() -> Vec<Policy> {
    let mut policies = Vec::new();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
    ] {
        for text in ["5/1s", "3/1s, 10/10s"] {
            if let Ok(policy) = text
                .parse::<Policy>()
                .and_then(|p| p.with_algorithm(algorithm))
            {
                if let Ok(costly) = policy.clone().with_cost(2) {
                    policies.push(costly);
                }
                policies.push(policy);
            }
        }
    }
    if let Ok(concurrency) = Policy::concurrency(3) {
        policies.push(concurrency);
    }
    policies
}

/// An admitted check, to give back later.
struct Held {
    key: &'static str,
    got: Decision,
    expected: Decision,
}

struct Run<'p> {
    policy: &'p Policy,
    rng: Rng,
    held: Vec<Held>,
}

#[derive(Debug)]
enum Op {
    Advance(Duration),
    Check(&'static str),
    Command(&'static str, Command),
    /// Release (true) or refund (false) the i-th admitted check held.
    GiveBack(usize, bool),
}

impl Run<'_> {
    fn next_op(&mut self) -> Op {
        let key = KEYS[self.rng.below(KEYS.len() as u64) as usize];
        let longest = self.policy.longest_window();
        match self.rng.below(100) {
            0..=49 => Op::Check(key),
            50..=69 => {
                // Mostly small steps, now and then past a window.
                let micros = u64::try_from(longest.as_micros()).unwrap_or(u64::MAX);
                let by = if self.rng.below(10) == 0 {
                    micros + self.rng.below(micros)
                } else {
                    self.rng.below(micros / 4 + 1)
                };
                Op::Advance(Duration::from_micros(by))
            }
            70..=79 if !self.held.is_empty() => {
                let release = self.policy.algorithm() == Algorithm::Concurrency;
                Op::GiveBack(self.rng.below(1 << 16) as usize, release)
            }
            70..=84 => Op::Command(key, Command::Peek),
            85..=88 => Op::Command(key, Command::Penalty(1 + self.rng.below(4))),
            89..=92 => Op::Command(key, Command::Reward(1 + self.rng.below(4))),
            93..=95 => {
                let ms = self.rng.below(3_000);
                Op::Command(key, Command::Block(Duration::from_millis(ms)))
            }
            _ => Op::Command(key, Command::Reset),
        }
    }
}

/// xorshift64*: a fixed sequence per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}
