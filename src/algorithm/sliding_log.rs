//! The sliding log: the reference semantics of
//! [`Algorithm::SlidingLog`](crate::Algorithm::SlidingLog)
//! (`scripts/sliding_log.lua` mirrors it).
//!
//! A key keeps one entry (a timestamp) per admitted unit of cost. A request
//! of cost `c` is admitted if, for every rate, the entries inside
//! `(now − window, ∞)` leave room for `c` more, and the newest entry is at
//! least the minimum spacing old; only then does it add `c` entries at
//! `now`.
//!
//! The decision ([`decide`]) reads the log through [`Log`], so that the
//! memory store (the whole log) and the `Transaction` execution (the counts
//! and entries Redis returned) take it through the same arithmetic.
//!
//! A penalty adds its units as entries at `now` (at most the policy's
//! largest `max`, which is all a decision can see, and at most
//! [`MAX_PENALTY_ENTRIES`]); a reward removes the newest entries.

use super::built;
use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus, RefundId};
use crate::policy::{Algorithm, Policy, Rate, duration_micros};
use std::collections::VecDeque;

/// The entries of one key: timestamps in µs, oldest first, one per unit of cost.
pub(crate) type State = VecDeque<u64>;

/// What the decision reads of a log, without the request's own entries.
pub(crate) trait Log {
    /// How many entries rate `i` counts: those inside its window.
    fn count(&self, i: usize, rate: &Rate) -> u64;
    /// The newest entry.
    fn newest(&self) -> Option<u64>;
    /// For rate `i` (which counts more than `rank` entries): the entry of
    /// reverse rank `rank` (0 is the newest).
    fn nth_newest(&self, i: usize, rank: u64) -> Option<u64>;
}

/// Where a decision stands in time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Times {
    /// Windows are counted back from this time, and the spacing is measured
    /// to it.
    pub(crate) at: u64,
    /// Waits are measured from this time...
    pub(crate) from: u64,
    /// ...plus this much.
    pub(crate) pad: u64,
}

impl Times {
    /// Everything measured at `now`, exactly.
    #[inline]
    pub(crate) fn exact(now: u64) -> Self {
        Self {
            at: now,
            from: now,
            pad: 0,
        }
    }

    /// The time left until `at` (padded), at most `most`: a rate's wait or
    /// reset never exceeds its window (nor a spacing wait the longest
    /// window), whatever the padding. Exact times are within it anyway.
    #[inline]
    fn until(self, at: u64, most: u64) -> u64 {
        at.saturating_add(self.pad)
            .saturating_sub(self.from)
            .min(most)
    }
}

/// Decide one request of `policy.cost()` on `log`: admitted only if every
/// rate has room for its cost and the spacing has passed. Changes nothing.
#[inline]
pub(crate) fn decide(log: &impl Log, policy: &Policy, times: Times) -> Decision {
    // One rate and no spacing (the usual policy): that rate's state is the
    // decision, without the builder.
    if let ([rate], None) = (policy.rates(), policy.min_spacing()) {
        let cost = policy.cost();
        let count = log.count(0, rate);
        let allowed = count + cost <= rate.max();
        let state = rate_state(log, (0, rate), count, cost, allowed, times);
        return DecisionBuilder::one(allowed, Algorithm::SlidingLog, state);
    }
    decide_many(log, policy, times)
}

/// [`decide`] of any policy.
fn decide_many(log: &impl Log, policy: &Policy, times: Times) -> Decision {
    let cost = policy.cost();
    let newest = log.newest();

    let mut allowed = true;
    let mut spacing_wait = 0;
    if let (Some(spacing), Some(last)) = (policy.min_spacing(), newest) {
        let ready_at = last.saturating_add(duration_micros(spacing));
        if ready_at > times.at {
            allowed = false;
            spacing_wait = times.until(ready_at, policy.longest_window_micros());
        }
    }
    let rates = policy.rates();
    let counts: smallvec::SmallVec<[u64; 8]> = rates
        .iter()
        .enumerate()
        .map(|(i, rate)| log.count(i, rate))
        .collect();
    for (rate, count) in rates.iter().zip(&counts) {
        if count + cost > rate.max() {
            allowed = false;
        }
    }

    let mut builder = DecisionBuilder::new(allowed);
    builder.wait(Micros(spacing_wait));
    for (i, (rate, &count)) in rates.iter().zip(counts.iter()).enumerate() {
        builder.rate(rate_state(log, (i, rate), count, cost, allowed, times));
    }
    built(builder)
}

/// The state of rate `i` of the policy, which counts `count` entries, for
/// a request of `cost` that was `allowed` or not.
#[inline]
fn rate_state(
    log: &impl Log,
    (i, rate): (usize, &Rate),
    count: u64,
    cost: u64,
    allowed: bool,
    times: Times,
) -> RateStatus {
    let window = rate.window_micros();
    let (remaining, reset, wait) = if allowed {
        (rate.max() - count - cost, window, 0)
    } else {
        let reset = match log.newest() {
            Some(t) if count > 0 => times.until(t.saturating_add(window), window),
            _ => 0,
        };
        let wait = if count + cost > rate.max() {
            // Admitted once at most `max - cost` entries are left in the
            // window: when the entry of reverse rank `max - cost` leaves.
            log.nth_newest(i, rate.max() - cost)
                .map_or(window, |t| times.until(t.saturating_add(window), window))
        } else {
            0
        };
        (rate.max().saturating_sub(count), reset, wait)
    };
    RateStatus {
        rate: *rate,
        remaining,
        reset: Micros(reset),
        wait: Micros(wait),
    }
}

/// A whole log, read at `now`.
struct Entries<'a> {
    entries: &'a State,
    now: u64,
}

impl Log for Entries<'_> {
    #[inline]
    fn count(&self, _: usize, rate: &Rate) -> u64 {
        let start = self.now.saturating_sub(rate.window_micros());
        // After `trim`, the longest window holds every entry: no search
        // (which on a long log reads a cache line per step).
        if self.entries.front().is_none_or(|&t| t > start) {
            return self.entries.len() as u64;
        }
        (self.entries.len() - self.entries.partition_point(|&t| t <= start)) as u64
    }

    #[inline]
    fn newest(&self) -> Option<u64> {
        self.entries.back().copied()
    }

    #[inline]
    fn nth_newest(&self, _: usize, rank: u64) -> Option<u64> {
        let rank = usize::try_from(rank).ok()?;
        let index = self.entries.len().checked_sub(rank + 1)?;
        self.entries.get(index).copied()
    }
}

/// Drop the entries out of every window.
#[inline]
fn trim(entries: &mut State, now: u64, policy: &Policy) {
    let dead_before = now.saturating_sub(policy.longest_window_micros());
    while entries.front().is_some_and(|&t| t <= dead_before) {
        entries.pop_front();
    }
}

/// Add `n` entries at `now`, in order.
fn add(entries: &mut State, now: u64, n: u64) {
    // Usually the newest: appended without a search.
    if entries.back().is_none_or(|&t| t <= now) {
        // Pushed one by one: `extend` of a repeated item costs ~40
        // instructions more for the usual single entry.
        for _ in 0..n {
            entries.push_back(now);
        }
    } else {
        let at = entries.partition_point(|&t| t <= now);
        for _ in 0..n {
            entries.insert(at, now);
        }
    }
}

/// When the state stops mattering: its newest entry leaves the longest window.
fn expiry(entries: &State, policy: &Policy) -> u64 {
    let horizon = policy.longest_window_micros();
    entries.back().map_or(0, |&t| t.saturating_add(horizon))
}

/// Decide one request at `now`: admitted requests add `cost` entries;
/// denied requests change nothing but the trimming of dead entries.
/// `expires_at` becomes when the state stops mattering.
#[inline]
pub(crate) fn check(
    entries: &mut State,
    now: u64,
    policy: &Policy,
    expires_at: &mut u64,
) -> Decision {
    trim(entries, now, policy);
    let decision = decide(&Entries { entries, now }, policy, Times::exact(now));
    if decision.allowed() {
        add(entries, now, policy.cost());
    }
    *expires_at = expiry(entries, policy);
    decision
}

/// The refund id an admitted check's decision carries: the time of its
/// entries (entries at one time are alike, so removing any of them is
/// removing the check's).
pub(crate) fn entries_of(now: u64) -> RefundId {
    RefundId::new(u128::from(now))
}

/// Remove the `units` entries one admitted check wrote (its decision's
/// refund id, see [`entries_of`]), as far as they are still there.
pub(crate) fn refund(
    entries: &mut State,
    now: u64,
    policy: &Policy,
    id: RefundId,
    units: u64,
) -> u64 {
    trim(entries, now, policy);
    if let Ok(at) = u64::try_from(id.id()) {
        let mut left = units;
        entries.retain(|&entry| {
            if left > 0 && entry == at {
                left -= 1;
                return false;
            }
            true
        });
    }
    expiry(entries, policy)
}

/// The decision [`check`] would take at `now`, changing nothing (dead
/// entries change no count, and are too old for the spacing).
pub(crate) fn peek(entries: &State, now: u64, policy: &Policy) -> Decision {
    decide(&Entries { entries, now }, policy, Times::exact(now))
}

/// The most entries one penalty adds (each is as big as a request's).
pub(crate) const MAX_PENALTY_ENTRIES: u64 = crate::policy::MAX_COST;

/// How many entries a penalty of `units` adds: at most the policy's largest
/// `max` (more would change no decision, only what a reward gives back),
/// and at most [`MAX_PENALTY_ENTRIES`].
pub(crate) fn penalty_entries(policy: &Policy, units: u64) -> u64 {
    let largest = policy.rates().iter().map(Rate::max).max().unwrap_or(0);
    units.min(largest).min(MAX_PENALTY_ENTRIES)
}

/// Add the entries of `units` admitted requests at `now` (see
/// [`penalty_entries`]).
pub(crate) fn penalty(entries: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    trim(entries, now, policy);
    add(entries, now, penalty_entries(policy, units));
    expiry(entries, policy)
}

/// Remove the `units` newest entries.
pub(crate) fn reward(entries: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    trim(entries, now, policy);
    let keep = entries
        .len()
        .saturating_sub(usize::try_from(units).unwrap_or(usize::MAX));
    entries.truncate(keep);
    expiry(entries, policy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A log whose entries (oldest first) are all inside every window.
    struct Fake(Vec<u64>);

    impl Log for Fake {
        fn count(&self, _: usize, _: &Rate) -> u64 {
            self.0.len() as u64
        }
        fn newest(&self) -> Option<u64> {
            self.0.last().copied()
        }
        fn nth_newest(&self, _: usize, rank: u64) -> Option<u64> {
            let rank = usize::try_from(rank).ok()?;
            self.0.iter().rev().nth(rank).copied()
        }
    }

    /// A policy of one rate without spacing takes the general path's
    /// decisions (the builder's), at exact and padded times, over bursts,
    /// denials and costs above one.
    #[test]
    fn one_rate_takes_the_general_paths_decisions() {
        let base = 1_763_800_000_000_000u64;
        for text in ["3/1s", "7/1s", "4/10ms", "5/300ms"] {
            for cost in [1, 2, 3] {
                let policy = text.parse::<Policy>().unwrap().with_cost(cost).unwrap();
                let mut entries = State::new();
                let mut denied = 0;
                for (step, now) in super::super::burst_times(base) {
                    trim(&mut entries, now, &policy);
                    let log = Entries {
                        entries: &entries,
                        now,
                    };
                    let padded = Times {
                        at: now,
                        from: now - 500,
                        pad: 10_000,
                    };
                    for times in [Times::exact(now), padded] {
                        assert_eq!(
                            decide(&log, &policy, times),
                            decide_many(&log, &policy, times),
                            "{text} cost {cost} step {step} {times:?}"
                        );
                    }
                    if decide(&log, &policy, Times::exact(now)).allowed() {
                        add(&mut entries, now, cost);
                    } else {
                        denied += 1;
                    }
                }
                assert!(denied > 0, "{text} cost {cost}: never denied");
            }
        }
    }

    /// With padded waits (the `Transaction` execution's clock guard), a
    /// denial right after the first admission waits the window, not the
    /// window plus the padding (`Retry-After: 11` for `5/10s`); a denial
    /// later in the window keeps its padding.
    #[test]
    fn padded_waits_are_at_most_the_window() {
        let t0 = 1_763_800_000_000_000u64;
        let pad = 10_000;
        let policy: Policy = "3/1s".parse().unwrap();
        let log = Fake(vec![t0, t0 + 1_000, t0 + 2_000]);
        let times = |now: u64| Times {
            at: now - 5_000,
            from: now,
            pad,
        };
        let burst = decide(&log, &policy, times(t0 + 3_000));
        assert!(!burst.allowed());
        // Unpadded 997 ms, padded 1,007 ms: capped at the window.
        assert_eq!(burst.retry_after(), Duration::from_secs(1));
        assert_eq!(burst.reset(), Duration::from_secs(1));
        let later = decide(&log, &policy, times(t0 + 500_000));
        assert_eq!(later.retry_after(), Duration::from_micros(500_000 + pad));
        // Exact times are never capped below their value.
        let exact = decide(&log, &policy, Times::exact(t0 + 3_000));
        assert_eq!(exact.retry_after(), Duration::from_micros(997_000));
    }
}
