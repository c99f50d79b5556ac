//! Each algorithm's decision arithmetic, written once: pure functions over
//! one key's state and the time `now` (µs since the epoch), with no I/O, no
//! clock and no lock (governor's `gcra.rs` is the model).
//!
//! [`MemoryStore`](crate::MemoryStore) holds the states and calls these; the
//! sliding log's `Transaction` execution takes its client-side decision
//! through [`sliding_log::decide`]; the Redis scripts
//! (`src/store/redis/scripts/`) mirror them operation for operation, and
//! differential tests compare every script with them.
//!
//! Every algorithm has, over its `State`:
//! - `check`: decide one request of `policy.cost()` and count it if
//!   admitted; returns the decision and when (µs) the state stops mattering;
//! - `peek`: the decision `check` would take now, changing nothing;
//! - `penalty` and `reward`: take or give back `units` of quota, as `units`
//!   admitted requests would (or as if they had not been counted, never
//!   below an empty state); they return when the state stops mattering.
//!
//! A reset is the empty state. A block is kept beside the state and
//! consulted before any decision ([`block_left`], [`blocked`]).

use std::time::Duration;

use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus};
use crate::policy::{MAX_MAX, MAX_WINDOW, Policy, duration_micros};

pub(crate) mod concurrency;
pub use concurrency::CONCURRENCY_RETRY_CAP;
pub(crate) mod fixed_window;
pub(crate) mod gcra;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;

/// The most units one penalty or reward moves: counts stay at most this
/// (2^53, where Redis's doubles are still exact).
pub(crate) const MAX_UNITS: u64 = MAX_MAX;

/// `units` as a penalty or reward moves them: at most [`MAX_UNITS`].
pub(crate) fn units(units: u64) -> u64 {
    units.min(MAX_UNITS)
}

/// How long (µs) a block of `duration` lasts: at most
/// [`MAX_WINDOW`](crate::policy::MAX_WINDOW).
pub(crate) fn block_micros(duration: Duration) -> u64 {
    duration_micros(duration.min(MAX_WINDOW))
}

/// The time left (µs) of a block that ends at `until`, if it is still on
/// at `now`.
#[inline]
pub(crate) fn block_left(until: u64, now: u64) -> Option<u64> {
    (until > now).then(|| until - now)
}

/// The decision for any request of a key blocked for `left` more µs:
/// denied, nothing remaining, and every rate waits (and resets) when the
/// block ends.
pub(crate) fn blocked(policy: &Policy, left: u64) -> Decision {
    let left = Micros(left);
    let mut builder = DecisionBuilder::new(false).algorithm(policy.algorithm());
    for rate in policy.rates() {
        builder.rate(RateStatus {
            rate: *rate,
            remaining: 0,
            reset: left,
            wait: left,
        });
    }
    match builder.build() {
        Some(decision) => decision.into_blocked(),
        None => unreachable!("a policy always has a rate"),
    }
}

/// Build a decision from a builder that was given every rate of a policy.
/// Always inlined: out of line, the builder and the decision are copied
/// through memory (measured: +15 ns per check).
#[inline(always)]
pub(crate) fn built(builder: DecisionBuilder) -> Decision {
    match builder.build() {
        Some(decision) => decision,
        // `Policy` guarantees at least one rate.
        None => unreachable!("a policy always has a rate"),
    }
}

/// The times (µs) of the fast-path tests' checks: 200 from `base`, in
/// bursts a few ms apart with a gap of 0.4 s every 17 checks.
#[cfg(test)]
pub(crate) fn burst_times(base: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..200u64).scan(base, |now, step| {
        *now += if step % 17 == 0 {
            400_000
        } else {
            step % 5 * 997
        };
        Some((step, *now))
    })
}
