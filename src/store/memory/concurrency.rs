//! The concurrency limit in memory: the reference semantics of
//! [`Algorithm::Concurrency`](crate::Algorithm::Concurrency).
//!
//! A key holds up to `max` leases, each with an expiry (`now + lease time`).
//! Expired leases are dropped before counting; a request is admitted if
//! fewer than `max` leases remain, and then holds a lease until it is
//! released.

use std::time::Duration;

use crate::decision::{Decision, DecisionBuilder, Lease, RateStatus};
use crate::policy::{Algorithm, Policy};
use crate::store::CONCURRENCY_RETRY_CAP;

/// The leases held: (lease, expiry µs).
#[derive(Debug, Default)]
pub(super) struct State {
    leases: Vec<(Lease, u64)>,
}

impl State {
    pub(super) fn release(&mut self, lease: Lease) {
        self.leases.retain(|(held, _)| *held != lease);
    }
}

#[inline]
pub(super) fn check(state: &mut State, now: u64, policy: &Policy, lease: Lease) -> (Decision, u64) {
    let rate = policy.rates()[0];
    state.leases.retain(|&(_, expiry)| expiry > now);
    let held = state.leases.len() as u64;
    let allowed = held < rate.max();
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Concurrency);
    // A slot frees when a request finishes, which the limiter cannot know:
    // suggest retrying after the soonest lease expiry, at most CONCURRENCY_RETRY_CAP.
    let soonest = state.leases.iter().map(|&(_, expiry)| expiry).min();
    builder.rate(RateStatus {
        rate,
        // Saturating: a key checked with a lower max may hold more leases.
        remaining: rate.max().saturating_sub(held + u64::from(allowed)),
        reset: Duration::ZERO,
        wait: match (allowed, soonest) {
            (false, Some(expiry)) => Duration::from_micros(expiry - now).min(CONCURRENCY_RETRY_CAP),
            _ => Duration::ZERO,
        },
    });
    if allowed {
        state.leases.push((lease, now + rate.window_micros()));
    }
    let expires_at = state.leases.iter().map(|&(_, e)| e).max().unwrap_or(0);
    match builder.build() {
        Some(decision) if allowed => (decision.with_lease(lease), expires_at),
        Some(decision) => (decision, expires_at),
        None => unreachable!("a policy always has a rate"),
    }
}
