//! The concurrency limit: the reference semantics of
//! [`Algorithm::Concurrency`](crate::Algorithm::Concurrency)
//! (`scripts/concurrency.lua` mirrors it).
//!
//! A key holds up to `max` leases, each with an expiry (`now + lease time`).
//! Expired leases are dropped before counting; a request is admitted if
//! fewer than `max` leases remain, and then holds a lease until it is
//! released.
//!
//! A penalty takes `units` anonymous slots (at most `max`: more would change
//! no decision), which expire after the lease time like any lease; a reward
//! frees the `units` oldest leases (those expiring soonest), anonymous or
//! held by a request in flight (whose later release then does nothing).

use std::time::Duration;

/// The longest `retry_after` of a denied concurrency request: slots usually
/// free within one request's duration, long before the oldest lease expires,
/// and the limiter cannot know when.
pub const CONCURRENCY_RETRY_CAP: Duration = Duration::from_secs(1);

/// [`CONCURRENCY_RETRY_CAP`] in µs.
const RETRY_CAP_MICROS: u64 = CONCURRENCY_RETRY_CAP.as_micros() as u64;

use super::built;
use crate::decision::{Decision, DecisionBuilder, Lease, Micros, RateStatus};
use crate::policy::{Algorithm, Policy};

/// The leases held: (lease, expiry µs).
#[derive(Debug, Default, Clone)]
pub(crate) struct State {
    leases: Vec<(Lease, u64)>,
}

impl State {
    /// Give `lease` back (nothing if it is not held).
    pub(crate) fn release(&mut self, lease: Lease) {
        self.leases.retain(|(held, _)| *held != lease);
    }

    fn expire(&mut self, now: u64) {
        self.leases.retain(|&(_, expiry)| expiry > now);
    }

    /// The leases held, with their expiries (µs).
    pub(crate) fn leases(&self) -> &[(Lease, u64)] {
        &self.leases
    }

    /// The state holding `leases`.
    pub(crate) fn of_leases(leases: Vec<(Lease, u64)>) -> Self {
        Self { leases }
    }

    /// When the state stops mattering: its last lease expires.
    fn expiry(&self) -> u64 {
        self.leases.iter().map(|&(_, e)| e).max().unwrap_or(0)
    }
}

/// The decision for one request at `now`, taking nothing: `held` leases
/// are live, the soonest of them expiring at `soonest()`. Always inlined:
/// the decision is built in place (measured).
#[inline(always)]
fn decide(held: u64, soonest: impl FnOnce() -> Option<u64>, now: u64, policy: &Policy) -> Decision {
    let rate = policy.rates()[0];
    let allowed = held < rate.max();
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Concurrency);
    // A slot frees when a request finishes, which the limiter cannot know:
    // suggest retrying after the soonest lease expiry, at most CONCURRENCY_RETRY_CAP.
    let soonest = if allowed { None } else { soonest() };
    builder.rate(RateStatus {
        rate,
        // Saturating: a key checked with a lower max may hold more leases.
        remaining: rate.max().saturating_sub(held + u64::from(allowed)),
        reset: Micros::ZERO,
        wait: match (allowed, soonest) {
            (false, Some(expiry)) => Micros((expiry - now).min(RETRY_CAP_MICROS)),
            _ => Micros::ZERO,
        },
    });
    built(builder)
}

/// Decide one request at `now`; admitted, it holds the lease `lease`
/// gives (asked only then).
#[inline]
pub(crate) fn check(
    state: &mut State,
    now: u64,
    policy: &Policy,
    lease: impl FnOnce() -> Lease,
    expires_at: &mut u64,
) -> Decision {
    state.expire(now);
    let held = state.leases.len() as u64;
    let rate = policy.rates()[0];
    let allowed = held < rate.max();
    let lease = allowed.then(|| {
        let lease = lease();
        state.leases.push((lease, now + rate.window_micros()));
        lease
    });
    // Asked only of a denied request, which pushed nothing.
    let leases = &state.leases;
    let soonest = || leases.iter().map(|&(_, expiry)| expiry).min();
    let decision = decide(held, soonest, now, policy);
    *expires_at = state.expiry();
    match lease {
        Some(lease) => decision.with_lease(lease),
        None => decision,
    }
}

/// The decision [`check`] would take at `now`, taking no lease.
pub(crate) fn peek(state: &State, now: u64, policy: &Policy) -> Decision {
    let live = || state.leases.iter().filter(|&&(_, expiry)| expiry > now);
    let soonest = || live().map(|&(_, expiry)| expiry).min();
    decide(live().count() as u64, soonest, now, policy)
}

/// How many slots a penalty of `units` takes: at most `max`.
pub(crate) fn penalty_slots(policy: &Policy, units: u64) -> u64 {
    // One lease per slot: at most MAX_COST, as a request's cost.
    units
        .min(policy.rates()[0].max())
        .min(crate::policy::MAX_COST)
}

/// Take [`penalty_slots`] anonymous slots, the leases `first`, `first + 1`,
/// ..., expiring after the lease time.
pub(crate) fn penalty(
    state: &mut State,
    now: u64,
    policy: &Policy,
    units: u64,
    first: u128,
) -> u64 {
    state.expire(now);
    let expiry = now + policy.rates()[0].window_micros();
    for j in 0..penalty_slots(policy, units) {
        state
            .leases
            .push((Lease::new(first + u128::from(j)), expiry));
    }
    state.expiry()
}

/// Free the `units` oldest leases (expiring soonest).
pub(crate) fn reward(state: &mut State, now: u64, units: u64) -> u64 {
    state.expire(now);
    state.leases.sort_by_key(|&(_, expiry)| expiry);
    let n = usize::try_from(units)
        .unwrap_or(usize::MAX)
        .min(state.leases.len());
    state.leases.drain(..n);
    state.expiry()
}
