//! The crate's store conformance kit (feature `test-util`): prove that a
//! [`Store`] of your own counts as [`MemoryStore`] does.
//!
//! [`check_store`] drives your store and a `MemoryStore` alike, both on
//! [`ManualClock`]s moved together, and returns the first difference as a
//! [`Mismatch`] naming the algorithm, policy, cost, seed, step and both
//! answers. It runs:
//!
//! - for every algorithm and several policies (one rate, two rates, a cost
//!   of 2, a calendar quota), then for all five algorithms on the same
//!   keys at once, and for two policies of one counting algorithm other
//!   than the sliding log on the same keys (a limit and its tightened
//!   rollout), long seeded sequences of checks (through
//!   [`Store::check`] and [`Store::check_in_process`]), every operator
//!   [`Command`], refunds and releases of concurrency slots, and moves of
//!   the clock: small ones, past a window, and to the microsecond before
//!   or at a time a decision names (its retry-after, a rate's reset), where
//!   a state kept a moment too short or too long shows;
//! - for every algorithm, many checks of one key at once (the futures
//!   polled together): exactly as many are admitted as one at a time.
//!
//! A decision is compared in everything a caller reads: allowed, blocked,
//! the algorithm, every rate's limit, remaining, reset and wait, and the
//! retry-after (lease and refund ids are each store's own). The kit calls
//! [`Store::command`] and [`Store::release`]: a store must implement both.
//!
//! ```
//! use tower_redis_ratelimit::MemoryStore;
//! use tower_redis_ratelimit::store::conformance;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! // Your store, built on the clock the kit moves.
//! if let Err(mismatch) = conformance::check_store(MemoryStore::with_clock).await {
//!     panic!("{mismatch}");
//! }
//! # });
//! ```
//!
//! A store kept in Redis or elsewhere on real time cannot follow a manual
//! clock; test it against a `MemoryStore` the same way, with margins
//! (the crate's own tests do, in `tests/it/conformance.rs`).

use std::fmt;
use std::time::Duration;

use crate::clock::ManualClock;
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy};
use crate::store::{Command, MemoryStore, Store, StoreError};

/// Where both clocks start: 2023-11-14, a whole second.
const START: Duration = Duration::from_secs(1_700_000_000);
/// Steps per sequence.
const STEPS: usize = 400;
/// The seeds of the sequences.
const SEEDS: [u64; 3] = [1, 2, 3];
/// Keys the sequences spread over.
const KEYS: [&str; 3] = ["a", "b", "203.0.113.9"];

/// The first difference [`check_store`] found between a store and
/// [`MemoryStore`]: where, and both answers as a caller reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Mismatch {
    /// The algorithm of the policy the step ran under.
    pub algorithm: Algorithm,
    /// The policy, as text.
    pub policy: String,
    /// Units one request of the policy counts as.
    pub cost: u64,
    /// The seed of the sequence (0 for the checks at once).
    pub seed: u64,
    /// The step of the sequence at which the answers differ.
    pub step: usize,
    /// What the step did.
    pub op: String,
    /// `MemoryStore`'s answer.
    pub expected: String,
    /// The store's answer.
    pub got: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the store differs from MemoryStore under {:?} \"{}\" (cost {}), seed {}, step {}: {}\n  \
             expected: {}\n  got:      {}",
            self.algorithm,
            self.policy,
            self.cost,
            self.seed,
            self.step,
            self.op,
            self.expected,
            self.got
        )
    }
}

impl std::error::Error for Mismatch {}

/// Run the kit against the store `make` builds on the clock it is given
/// (see the [module](self)): `Ok` when it counts as [`MemoryStore`] does,
/// else the first [`Mismatch`].
pub async fn check_store<S: Store>(make: impl Fn(ManualClock) -> S) -> Result<(), Mismatch> {
    for seed in SEEDS {
        for policy in policies() {
            Sequence::new(&make, vec![policy], seed).run().await?;
        }
        Sequence::new(&make, one_per_algorithm(), seed)
            .run()
            .await?;
        for pair in two_per_algorithm() {
            Sequence::new(&make, pair, seed).run().await?;
        }
    }
    for policy in one_per_algorithm() {
        at_once(&make, &policy).await?;
    }
    Ok(())
}

/// The policies run alone: every algorithm, one rate and two (with a cost
/// of 2 for the counting ones), a calendar quota.
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
    policies.extend("2/s, 20/day in Europe/Paris".parse::<Policy>());
    policies.extend(Policy::concurrency(3));
    policies
}

/// One policy of each algorithm, for the keys they share.
fn one_per_algorithm() -> Vec<Policy> {
    let parsed = |text: &str, algorithm| {
        text.parse::<Policy>()
            .and_then(|p| p.with_algorithm(algorithm))
    };
    [
        parsed("4/1s", Algorithm::SlidingLog),
        parsed("3/1s, 10/10s", Algorithm::FixedWindow),
        parsed("4/1s", Algorithm::SlidingWindow).and_then(|p| p.with_cost(2)),
        parsed("3/1s, 10/10s", Algorithm::Gcra),
        Policy::concurrency(3),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// A store's answer to a step.
type Answer = Result<Decision, StoreError>;

/// Two policies of each counting algorithm on the same keys (a limit and
/// its tightened rollout share a key): their counts and expiries meet.
/// Not the sliding log's: a check under the shorter window trims the log
/// to it (in Redis too), and `MemoryStore` then keeps or drops the rest by
/// its sweep's schedule, which no other store need follow.
fn two_per_algorithm() -> Vec<Vec<Policy>> {
    [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
    ]
    .into_iter()
    .map(|algorithm| {
        ["2/1s, 3/1min", "2/1s"]
            .into_iter()
            .filter_map(|text| {
                let policy = text.parse::<Policy>().ok()?;
                policy.with_algorithm(algorithm).ok()
            })
            .collect()
    })
    .collect()
}

/// What a caller reads of an answer.
fn read(answer: &Answer) -> String {
    match answer {
        Ok(d) => {
            let rates: Vec<String> = d
                .rates()
                .iter()
                .map(|r| {
                    format!(
                        "{}: remaining {}, reset {:?}, wait {:?}",
                        r.rate(),
                        r.remaining(),
                        r.reset(),
                        r.wait()
                    )
                })
                .collect();
            format!(
                "{}{}, {:?}, retry after {:?}; {}",
                if d.allowed() { "admitted" } else { "denied" },
                if d.blocked() { " (blocked)" } else { "" },
                d.algorithm(),
                d.retry_after(),
                rates.join("; ")
            )
        }
        Err(error) => format!("error: {error}"),
    }
}

/// One seeded sequence of steps against a store and a `MemoryStore`.
struct Sequence<S> {
    store: S,
    clock: ManualClock,
    reference: MemoryStore,
    reference_clock: ManualClock,
    policies: Vec<Policy>,
    seed: u64,
    rng: Rng,
    /// Admitted checks, to give back later.
    held: Vec<Held>,
    /// The reference's latest decision: the times it names.
    latest: Option<Decision>,
}

/// An admitted check: its key, policy, and both stores' decisions.
struct Held {
    key: &'static str,
    policy: usize,
    got: Decision,
    expected: Decision,
}

#[derive(Debug)]
enum Op {
    Advance(Duration),
    /// A check through `check_in_process` (or `check` when the store
    /// answers `None`), else through `check`.
    Check(&'static str, usize, bool),
    Command(&'static str, usize, Command),
    /// Release (a concurrency slot) or refund the i-th admitted check held.
    GiveBack(usize),
}

impl<S: Store> Sequence<S> {
    fn new(make: &impl Fn(ManualClock) -> S, policies: Vec<Policy>, seed: u64) -> Self {
        let clock = ManualClock::new(START);
        let reference_clock = ManualClock::new(START);
        Self {
            store: make(clock.clone()),
            clock,
            reference: MemoryStore::with_clock(reference_clock.clone()),
            reference_clock,
            policies,
            seed,
            rng: Rng(seed),
            held: Vec::new(),
            latest: None,
        }
    }

    async fn run(mut self) -> Result<(), Mismatch> {
        for step in 0..STEPS {
            let op = self.next_op();
            let policy = match &op {
                Op::Check(_, p, _) | Op::Command(_, p, _) => *p,
                Op::GiveBack(i) => self.held[*i].policy,
                Op::Advance(_) => 0,
            };
            let Some((got, expected)) = self.answers(&op).await else {
                continue;
            };
            if read(&got) != read(&expected) {
                let policy = &self.policies[policy];
                return Err(Mismatch {
                    algorithm: policy.algorithm(),
                    policy: policy.to_string(),
                    cost: policy.cost(),
                    seed: self.seed,
                    step,
                    op: format!("{op:?}"),
                    expected: read(&expected),
                    got: read(&got),
                });
            }
        }
        Ok(())
    }

    /// Run `op` on both stores: their answers (none to a move of the
    /// clocks).
    async fn answers(&mut self, op: &Op) -> Option<(Answer, Answer)> {
        let answers = match *op {
            Op::Advance(by) => {
                self.clock.advance(by);
                self.reference_clock.advance(by);
                return None;
            }
            Op::Check(key, p, in_process) => {
                let policy = &self.policies[p];
                let got = match in_process
                    .then(|| self.store.check_in_process(key, policy))
                    .flatten()
                {
                    Some(decision) => Ok(decision),
                    None => self.store.check(key, policy).await,
                };
                let expected = self.reference.check(key, policy).await;
                if let (Ok(got), Ok(expected)) = (&got, &expected) {
                    self.latest = Some(expected.clone());
                    if got.allowed() && expected.allowed() {
                        let (got, expected) = (got.clone(), expected.clone());
                        self.held.push(Held {
                            key,
                            policy: p,
                            got,
                            expected,
                        });
                    }
                }
                (got, expected)
            }
            Op::Command(key, p, command) => {
                let policy = &self.policies[p];
                let got = self.store.command(key, policy, command).await;
                (got, self.reference.command(key, policy, command).await)
            }
            Op::GiveBack(i) => self.give_back(i).await,
        };
        Some(answers)
    }

    /// Give back the `i`-th admitted check held: release its concurrency
    /// slot, or refund it; the answers are the peeks after it.
    async fn give_back(&mut self, i: usize) -> (Answer, Answer) {
        let held = self.held.swap_remove(i);
        let policy = &self.policies[held.policy];
        if let (Some(got), Some(expected)) = (held.got.lease(), held.expected.lease()) {
            let released = self.store.release(held.key, policy, got).await;
            self.reference
                .release(held.key, policy, expected)
                .await
                .ok();
            if let Err(error) = released {
                return (
                    Err(error),
                    self.reference
                        .command(held.key, policy, Command::Peek)
                        .await,
                );
            }
        } else if let (Some(got), Some(expected)) =
            (held.got.refund_id(), held.expected.refund_id())
        {
            let units = policy.cost();
            let got = self
                .store
                .command(held.key, policy, Command::Refund { id: got, units })
                .await;
            let refund = Command::Refund {
                id: expected,
                units,
            };
            return (got, self.reference.command(held.key, policy, refund).await);
        }
        let got = self.store.command(held.key, policy, Command::Peek).await;
        (
            got,
            self.reference
                .command(held.key, policy, Command::Peek)
                .await,
        )
    }

    fn next_op(&mut self) -> Op {
        let key = KEYS[self.rng.below(KEYS.len() as u64) as usize];
        let p = self.rng.below(self.policies.len() as u64) as usize;
        match self.rng.below(100) {
            0..=29 => Op::Check(key, p, false),
            30..=49 => Op::Check(key, p, true),
            50..=62 => Op::Advance(self.step_of_time()),
            63..=69 => Op::Advance(self.a_named_time()),
            70..=79 if !self.held.is_empty() => {
                Op::GiveBack(self.rng.below(self.held.len() as u64) as usize)
            }
            70..=84 => Op::Command(key, p, Command::Peek),
            85..=88 => Op::Command(key, p, Command::Penalty(1 + self.rng.below(4))),
            89..=92 => Op::Command(key, p, Command::Reward(1 + self.rng.below(4))),
            93..=95 => {
                let ms = self.rng.below(3_000);
                Op::Command(key, p, Command::Block(Duration::from_millis(ms)))
            }
            _ => Op::Command(key, p, Command::Reset),
        }
    }

    /// Mostly a small step, now and then past the longest window.
    fn step_of_time(&mut self) -> Duration {
        let longest = self.policies.iter().map(Policy::longest_window).max();
        let micros = longest.map_or(1_000_000, |w| {
            u64::try_from(w.as_micros()).unwrap_or(u64::MAX)
        });
        let micros = micros.min(10_000_000);
        Duration::from_micros(if self.rng.below(10) == 0 {
            micros + self.rng.below(micros)
        } else {
            self.rng.below(micros / 4 + 1)
        })
    }

    /// To a time the latest decision names (its retry-after, a rate's
    /// reset or wait), or a microsecond before it.
    fn a_named_time(&mut self) -> Duration {
        let Some(latest) = &self.latest else {
            return Duration::from_micros(self.rng.below(1_000));
        };
        let mut times = vec![latest.retry_after()];
        for rate in latest.rates() {
            times.extend([rate.reset(), rate.wait()]);
        }
        let time = times[self.rng.below(times.len() as u64) as usize];
        // The latest decision was taken at this step's time or before.
        let before = Duration::from_micros(self.rng.below(2));
        time.saturating_sub(before)
    }
}

/// Many checks of one key at once, polled together: exactly as many
/// admitted as `MemoryStore` admits one at a time.
async fn at_once<S: Store>(
    make: &impl Fn(ManualClock) -> S,
    policy: &Policy,
) -> Result<(), Mismatch> {
    const CALLS: usize = 24;
    let store = make(ManualClock::new(START));
    let reference = MemoryStore::with_clock(ManualClock::new(START));
    let checks = (0..CALLS).map(|_| store.check("at-once", policy));
    let answers = futures_util::future::join_all(checks).await;
    let mut expected = 0;
    for _ in 0..CALLS {
        expected += usize::from(reference.check_now("at-once", policy).allowed());
    }
    let admitted = answers
        .iter()
        .filter(|a| a.as_ref().is_ok_and(Decision::allowed))
        .count();
    let error = answers.iter().find_map(|a| a.as_ref().err());
    if admitted == expected && error.is_none() {
        return Ok(());
    }
    Err(Mismatch {
        algorithm: policy.algorithm(),
        policy: policy.to_string(),
        cost: policy.cost(),
        seed: 0,
        step: CALLS,
        op: format!("{CALLS} checks of one key at once"),
        expected: format!("{expected} admitted"),
        got: match error {
            Some(error) => format!("error: {error}"),
            None => format!("{admitted} admitted"),
        },
    })
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
