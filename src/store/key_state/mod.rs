//! [`KeyState`]: one key's state under every algorithm it is counted by,
//! its block, and the decision arithmetic on them, the same every store of
//! the crate runs: the way to write a [`Store`](crate::Store) of your own.

mod encoding;
#[cfg(test)]
mod tests;

use std::time::Duration;

use smallvec::SmallVec;

use crate::algorithm::{self, concurrency, fixed_window, gcra, sliding_log, sliding_window};
use crate::decision::{Decision, Lease, RefundId};
use crate::policy::{Algorithm, Policy, duration_micros};
use crate::store::Command;

pub use encoding::{STATE_ENCODING_VERSION, StateError};

/// The state of one limited key: its counts under each [`Algorithm`] it is
/// checked by, and its block. What [`MemoryStore`](crate::MemoryStore)
/// and the Redis scripts compute, for a [`Store`](crate::Store) of your
/// own to keep wherever it keeps state: a map behind a lock, or a row,
/// document or value read and written in one transaction
/// ([`to_bytes`](Self::to_bytes), [`from_bytes`](Self::from_bytes)).
///
/// Keep **one `KeyState` per key**: it holds the key's counts under every
/// algorithm apart (a fixed window and a GCRA on one key count apart, as
/// in `MemoryStore`), and one block over all of them (a
/// [`Command::Block`] denies the key under every algorithm; a
/// [`Command::Reset`] under any algorithm lifts it, and clears that
/// algorithm's counts only).
///
/// Every method takes `now`, the time since the Unix epoch (a
/// [`Clock`](crate::clock::Clock)'s reading). Once `now` reaches
/// [`expires_at`](Self::expires_at), the state may be dropped: a fresh one
/// decides exactly the same from then on (not a microsecond before).
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::store::KeyState;
/// use tower_redis_ratelimit::Policy;
///
/// let policy: Policy = "2/s".parse()?;
/// let mut state = KeyState::new();
/// let now = Duration::from_secs(1_700_000_000);
/// assert!(state.check(now, &policy).allowed());
/// assert!(state.check(now, &policy).allowed());
/// let denied = state.check(now, &policy);
/// assert_eq!((denied.allowed(), denied.retry_after()), (false, Duration::from_secs(1)));
/// // Kept as bytes (a row's column) and read back, it decides the same.
/// let mut state = KeyState::from_bytes(&state.to_bytes())?;
/// assert!(!state.check(now, &policy).allowed());
/// assert!(state.check(now + Duration::from_secs(1), &policy).allowed());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A store built on it proves itself with the crate's conformance kit
/// (feature `test-util`: `store::conformance`); the guide's page
/// [writing a store](crate::guide::writing_a_store) shows one whole.
#[derive(Debug, Clone)]
pub struct KeyState {
    /// The key's counts under each algorithm it is checked by (at most one
    /// each).
    counted: SmallVec<[Counted; 1]>,
    /// Until when (µs) the key is blocked, under every algorithm (0: not).
    blocked_until: u64,
    /// With the time, the next slot's lease id: a count from a random
    /// start.
    next_lease: u64,
}

/// A key's counts under one algorithm, and when (µs) they stop mattering.
#[derive(Debug, Clone)]
struct Counted {
    state: State,
    expires_at: u64,
}

impl Default for KeyState {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyState {
    /// The state of a key never checked.
    pub fn new() -> Self {
        Self {
            counted: SmallVec::new(),
            blocked_until: 0,
            // Random: a state made afresh (dropped once it expired) in the
            // same microsecond as an earlier one of the key must not hand
            // out an id a request may still release.
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
        let Self {
            counted,
            next_lease,
            ..
        } = self;
        let counted = under(counted, policy.algorithm(), now);
        let lease = || key_lease_ids(next_lease, now, 1);
        counted
            .state
            .check(now, policy, lease, &mut counted.expires_at)
    }

    /// Run an operator's `command` at `now` and return the decision a
    /// request of `policy.cost()` would get afterwards, consuming nothing
    /// ([`Store::command`](crate::Store::command)).
    pub fn command(&mut self, now: Duration, policy: &Policy, command: Command) -> Decision {
        let now = duration_micros(now);
        let algorithm = policy.algorithm();
        match command {
            Command::Reset => {
                self.counted.retain(|c| c.state.algorithm() != algorithm);
                self.blocked_until = 0;
            }
            Command::Block(duration) => {
                self.blocked_until = now.saturating_add(algorithm::block_micros(duration));
            }
            Command::Penalty(_) | Command::Reward(_) | Command::Refund { .. } => {
                self.count(now, policy, command);
            }
            Command::Peek => {}
        }
        self.peek(now, policy)
    }

    /// Give back the concurrency slot `lease` ([`Store::release`](crate::Store::release)).
    pub fn release(&mut self, lease: Lease) {
        for counted in &mut self.counted {
            if let State::Leases(leases) = &mut counted.state {
                leases.release(lease);
            }
        }
    }

    /// When the state stops mattering (since the Unix epoch): from then
    /// on, a fresh state decides the same, and it may be dropped (a row's
    /// expiry). Exact to the microsecond: a state dropped earlier may
    /// admit what it would deny.
    pub fn expires_at(&self) -> Duration {
        let counted = self.counted.iter().map(|c| c.expires_at).max();
        Duration::from_micros(counted.unwrap_or(0).max(self.blocked_until))
    }

    /// A penalty, reward or refund on the counts under `policy`'s
    /// algorithm.
    fn count(&mut self, now: u64, policy: &Policy, command: Command) {
        let algorithm = policy.algorithm();
        let Self {
            counted,
            next_lease,
            ..
        } = self;
        let lease_ids = |n| key_lease_ids(next_lease, now, n).id();
        let held = counted
            .iter_mut()
            .find(|c| c.state.algorithm() == algorithm)
            .map(|c| (&mut c.state, &mut c.expires_at));
        if let Some((state, expires_at)) = State::count_held(held, now, policy, command, lease_ids)
        {
            counted.push(Counted { state, expires_at });
        }
    }

    /// The decision a request would get at `now` (µs), changing nothing.
    fn peek(&self, now: u64, policy: &Policy) -> Decision {
        let algorithm = policy.algorithm();
        let held = self
            .counted
            .iter()
            .find(|c| c.state.algorithm() == algorithm);
        let block_left = algorithm::block_left(self.blocked_until, now);
        State::peek_held(block_left, held.map(|c| &c.state), now, policy)
    }
}

/// The counts under `algorithm`, made when there are none; counts that
/// stopped mattering by `now` are dropped first (a fresh state decides the
/// same).
fn under(counted: &mut SmallVec<[Counted; 1]>, algorithm: Algorithm, now: u64) -> &mut Counted {
    counted.retain(|c| c.expires_at > now);
    let at = match counted
        .iter()
        .position(|c| c.state.algorithm() == algorithm)
    {
        Some(at) => at,
        None => {
            counted.push(Counted {
                state: State::new(algorithm),
                expires_at: 0,
            });
            counted.len() - 1
        }
    };
    &mut counted[at]
}

/// The first of `n` lease ids no slot of a key holds: the time (µs) and a
/// count from a random start, `next`, which moves past them.
fn key_lease_ids(next: &mut u64, now: u64, n: u64) -> Lease {
    let first = (u128::from(now) << 64) | u128::from(*next);
    *next = next.wrapping_add(n);
    Lease::new(first)
}

/// The state of one key under one algorithm.
#[derive(Debug, Clone)]
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

    /// A penalty, reward or refund (`command`) on `held`, a key's state
    /// under `policy`'s algorithm and when it expires (µs), or on none:
    /// then the new state to hold and its expiry, when it matters after
    /// `now` (a refund of counts no longer held gives back nothing). An
    /// expiry only moves later: the state may hold another policy's longer
    /// rates. The one way every store of the crate counts a command.
    pub(crate) fn count_held(
        held: Option<(&mut Self, &mut u64)>,
        now: u64,
        policy: &Policy,
        command: Command,
        lease_ids: impl FnOnce(u64) -> u128,
    ) -> Option<(Self, u64)> {
        match held {
            Some((state, expires_at)) => {
                if let Some(at) = state.count(now, policy, command, lease_ids) {
                    *expires_at = (*expires_at).max(at);
                }
                None
            }
            None if matches!(command, Command::Refund { .. }) => None,
            None => {
                let mut state = Self::new(policy.algorithm());
                let expires_at = state.count(now, policy, command, lease_ids)?;
                (expires_at > now).then_some((state, expires_at))
            }
        }
    }

    /// The decision a request of `policy` would get at `now` (µs) from a
    /// key blocked for `block_left` more µs, else from `held`, its state
    /// under the policy's algorithm (none: a fresh one), changing nothing.
    /// The one way every store of the crate answers a command.
    pub(crate) fn peek_held(
        block_left: Option<u64>,
        held: Option<&Self>,
        now: u64,
        policy: &Policy,
    ) -> Decision {
        if let Some(left) = block_left {
            return algorithm::blocked(policy, left);
        }
        match held {
            Some(state) => state.peek(now, policy),
            None => Self::new(policy.algorithm()).peek(now, policy),
        }
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
        self.algorithm() == algorithm
    }

    /// The algorithm this state counts under.
    pub(crate) fn algorithm(&self) -> Algorithm {
        match self {
            Self::Log(_) => Algorithm::SlidingLog,
            Self::Fixed(_) => Algorithm::FixedWindow,
            Self::Sliding(_) => Algorithm::SlidingWindow,
            Self::Gcra(_) => Algorithm::Gcra,
            Self::Leases(_) => Algorithm::Concurrency,
        }
    }
}
