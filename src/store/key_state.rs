//! [`KeyState`]: one key's state under one algorithm and the decision
//! arithmetic on it, the same every store of the crate runs: the way to
//! write a [`Store`](crate::Store) of your own.

use std::time::Duration;

use crate::algorithm::{self, concurrency, fixed_window, gcra, sliding_log, sliding_window};
use crate::decision::{Decision, Lease, RefundId};
use crate::policy::{Algorithm, Policy, duration_micros};
use crate::store::Command;

/// The state of one limited key under one [`Algorithm`], with its block,
/// and the decisions taken on it: what [`MemoryStore`](crate::MemoryStore)
/// and the Redis scripts compute, for a [`Store`](crate::Store) of your own
/// to keep wherever it keeps state (a map behind a lock, a row read and
/// written in one transaction).
///
/// Every method takes `now`, the time since the Unix epoch (a
/// [`Clock`](crate::clock::Clock)'s reading). A state whose
/// [`expires_at`](Self::expires_at) has passed may be dropped: a fresh one
/// decides the same from then on.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::KeyState;
/// use tower_redis_ratelimit::Policy;
///
/// let policy: Policy = "2/s".parse()?;
/// let mut state = KeyState::new(policy.algorithm());
/// let now = Duration::from_secs(1_700_000_000);
/// assert!(state.check(now, &policy).allowed());
/// assert!(state.check(now, &policy).allowed());
/// let denied = state.check(now, &policy);
/// assert_eq!((denied.allowed(), denied.retry_after()), (false, Duration::from_secs(1)));
/// assert!(state.check(now + Duration::from_secs(1), &policy).allowed());
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
///
/// A store built on it proves itself with the crate's conformance suite
/// (feature `test-util`: `store::conformance`).
#[derive(Debug)]
pub struct KeyState {
    state: State,
    /// When (µs) the state stops mattering.
    expires_at: u64,
    /// Until when (µs) the key is blocked (0: not).
    blocked_until: u64,
    /// With the time, the next slot's lease id: a count from a random
    /// start.
    next_lease: u64,
}

impl KeyState {
    /// The empty state of a key under `algorithm`.
    pub fn new(algorithm: Algorithm) -> Self {
        Self {
            state: State::new(algorithm),
            expires_at: 0,
            blocked_until: 0,
            // Random: a state made afresh (after a reset, or dropped once it
            // expired) in the same microsecond as an earlier one of the key
            // must not hand out an id a request may still release.
            next_lease: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
        }
    }

    /// Decide one request of `policy.cost()` units at `now`, counting it
    /// if admitted ([`Store::check`](crate::Store::check)).
    pub fn check(&mut self, now: Duration, policy: &Policy) -> Decision {
        let now = duration_micros(now);
        if let Some(left) = algorithm::block_left(self.blocked_until, now) {
            return algorithm::blocked(policy, left);
        }
        let next_lease = &mut self.next_lease;
        let lease = || key_lease_ids(next_lease, now, 1);
        self.state.check(now, policy, lease, &mut self.expires_at)
    }

    /// Run an operator's `command` at `now` and return the decision a
    /// request of `policy.cost()` would get afterwards, consuming nothing
    /// ([`Store::command`](crate::Store::command)).
    pub fn command(&mut self, now: Duration, policy: &Policy, command: Command) -> Decision {
        let now = duration_micros(now);
        match command {
            Command::Reset => *self = Self::new(policy.algorithm()),
            Command::Block(duration) => {
                self.blocked_until = now.saturating_add(algorithm::block_micros(duration));
            }
            Command::Penalty(_) | Command::Reward(_) | Command::Refund { .. } => {
                let next_lease = &mut self.next_lease;
                let lease_ids = |n| key_lease_ids(next_lease, now, n).id();
                if let Some(expires_at) = self.state.count(now, policy, command, lease_ids) {
                    self.expires_at = expires_at;
                }
            }
            Command::Peek => {}
        }
        self.peek(now, policy)
    }

    /// Give back the concurrency slot `lease` ([`Store::release`](crate::Store::release)).
    pub fn release(&mut self, lease: Lease) {
        if let State::Leases(leases) = &mut self.state {
            leases.release(lease);
        }
    }

    /// When the state stops mattering (since the Unix epoch): past it, and
    /// past its block, it may be dropped.
    pub fn expires_at(&self) -> Duration {
        Duration::from_micros(self.expires_at.max(self.blocked_until))
    }

    /// The decision a request would get at `now` (µs), changing nothing.
    fn peek(&self, now: u64, policy: &Policy) -> Decision {
        if let Some(left) = algorithm::block_left(self.blocked_until, now) {
            return algorithm::blocked(policy, left);
        }
        self.state.peek(now, policy)
    }
}

/// The first of `n` lease ids no slot of a key holds: the time (µs) and a
/// count from a random start, `next`, which moves past them.
fn key_lease_ids(next: &mut u64, now: u64, n: u64) -> Lease {
    let first = (u128::from(now) << 64) | u128::from(*next);
    *next = next.wrapping_add(n);
    Lease::new(first)
}

/// The state of one key under one algorithm.
#[derive(Debug)]
pub(crate) enum State {
    Log(sliding_log::State),
    Fixed(fixed_window::State),
    Sliding(sliding_window::State),
    Gcra(gcra::State),
    Leases(concurrency::State),
}

impl State {
    pub(crate) fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::FixedWindow => Self::Fixed(Default::default()),
            Algorithm::SlidingWindow => Self::Sliding(Default::default()),
            Algorithm::Gcra => Self::Gcra(Default::default()),
            Algorithm::Concurrency => Self::Leases(Default::default()),
            Algorithm::SlidingLog => Self::Log(Default::default()),
        }
    }

    /// Decide one request; `expires_at` becomes when the state stops
    /// mattering (returned through it: a decision returned alone is built
    /// in the caller's place, where a pair with the time was copied twice).
    /// `lease` is asked only by an admitted concurrency check, for the id
    /// of its slot.
    #[inline(always)]
    pub(crate) fn check(
        &mut self,
        now: u64,
        policy: &Policy,
        lease: impl FnOnce() -> Lease,
        expires_at: &mut u64,
    ) -> Decision {
        if !self.matches(policy.algorithm()) {
            *self = Self::new(policy.algorithm());
        }
        match self {
            Self::Log(log) => {
                let decision = sliding_log::check(log, now, policy, expires_at);
                if decision.allowed() {
                    // What a refund of this check removes.
                    return decision.with_entries(sliding_log::entries_of(now));
                }
                decision
            }
            Self::Fixed(counters) => fixed_window::check(counters, now, policy, expires_at),
            Self::Sliding(counters) => sliding_window::check(counters, now, policy, expires_at),
            Self::Gcra(tats) => gcra::check(tats, now, policy, expires_at),
            Self::Leases(leases) => concurrency::check(leases, now, policy, lease, expires_at),
        }
    }

    /// The decision a request would get now, changing nothing.
    pub(crate) fn peek(&self, now: u64, policy: &Policy) -> Decision {
        match self {
            _ if !self.matches(policy.algorithm()) => {
                Self::new(policy.algorithm()).peek(now, policy)
            }
            Self::Log(log) => sliding_log::peek(log, now, policy),
            Self::Fixed(counters) => fixed_window::peek(counters, now, policy),
            Self::Sliding(counters) => sliding_window::peek(counters, now, policy),
            Self::Gcra(tats) => gcra::peek(tats, now, policy),
            Self::Leases(leases) => concurrency::peek(leases, now, policy),
        }
    }

    /// Run the part of an operator's `command` that changes the counts (a
    /// penalty, a reward, a refund; `None` for the others, which a store
    /// keeps itself): returns when the state expires. `lease_ids` gives the
    /// first of `n` lease ids no request holds, for a penalty's anonymous
    /// concurrency slots. Every store's commands run it.
    pub(crate) fn count(
        &mut self,
        now: u64,
        policy: &Policy,
        command: Command,
        lease_ids: impl FnOnce(u64) -> u128,
    ) -> Option<u64> {
        Some(match command {
            Command::Penalty(units) => {
                let units = algorithm::units(units);
                let first = match policy.algorithm() {
                    Algorithm::Concurrency => lease_ids(concurrency::penalty_slots(policy, units)),
                    _ => 0,
                };
                self.penalty(now, policy, units, first)
            }
            Command::Reward(units) => self.reward(now, policy, algorithm::units(units)),
            Command::Refund { id, units } => self.refund(now, policy, id, algorithm::units(units)),
            Command::Peek | Command::Reset | Command::Block(_) => return None,
        })
    }

    /// Take `units` of quota (anonymous slots from lease `first` on, for the
    /// concurrency limit); returns when the state expires.
    fn penalty(&mut self, now: u64, policy: &Policy, units: u64, first: u128) -> u64 {
        if !self.matches(policy.algorithm()) {
            *self = Self::new(policy.algorithm());
        }
        match self {
            Self::Log(log) => sliding_log::penalty(log, now, policy, units),
            Self::Fixed(counters) => fixed_window::penalty(counters, now, policy, units),
            Self::Sliding(counters) => sliding_window::penalty(counters, now, policy, units),
            Self::Gcra(tats) => gcra::penalty(tats, now, policy, units),
            Self::Leases(leases) => concurrency::penalty(leases, now, policy, units, first),
        }
    }

    /// Give `units` of quota back; returns when the state expires.
    fn reward(&mut self, now: u64, policy: &Policy, units: u64) -> u64 {
        if !self.matches(policy.algorithm()) {
            *self = Self::new(policy.algorithm());
        }
        match self {
            Self::Log(log) => sliding_log::reward(log, now, policy, units),
            Self::Fixed(counters) => fixed_window::reward(counters, now, policy, units),
            Self::Sliding(counters) => sliding_window::reward(counters, now, policy, units),
            Self::Gcra(tats) => gcra::reward(tats, now, policy, units),
            Self::Leases(leases) => concurrency::reward(leases, now, units),
        }
    }

    /// Give back one admitted check (its decision's `lease`): its own
    /// entries where the state keeps them, else as a reward.
    fn refund(&mut self, now: u64, policy: &Policy, id: RefundId, units: u64) -> u64 {
        match self {
            _ if !self.matches(policy.algorithm()) => self.reward(now, policy, 0),
            Self::Log(log) => sliding_log::refund(log, now, policy, id, units),
            Self::Leases(leases) => {
                leases.release(id.into());
                concurrency::reward(leases, now, 0)
            }
            _ => self.reward(now, policy, units),
        }
    }

    fn matches(&self, algorithm: Algorithm) -> bool {
        matches!(
            (self, algorithm),
            (Self::Log(_), Algorithm::SlidingLog)
                | (Self::Fixed(_), Algorithm::FixedWindow)
                | (Self::Sliding(_), Algorithm::SlidingWindow)
                | (Self::Gcra(_), Algorithm::Gcra)
                | (Self::Leases(_), Algorithm::Concurrency)
        )
    }
}
