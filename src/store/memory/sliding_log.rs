//! The sliding log in memory: the reference semantics of
//! [`Algorithm::SlidingLog`](crate::Algorithm::SlidingLog).

use std::collections::VecDeque;
use std::time::Duration;

use crate::decision::{Decision, DecisionBuilder, RateState};
use crate::policy::{Policy, duration_micros};

/// The sliding log: decide one request at `now` (microseconds) on `entries`
/// (timestamps, oldest first). Admitted requests add `cost` entries; denied
/// requests change nothing but the trimming of dead entries.
#[inline]
pub(super) fn check_log(entries: &mut VecDeque<u64>, now: u64, policy: &Policy) -> Decision {
    let longest = duration_micros(policy.longest_window());
    let dead_before = now.saturating_sub(longest);
    while entries.front().is_some_and(|&t| t <= dead_before) {
        entries.pop_front();
    }
    let cost = policy.cost();
    let n = entries.len() as u64;
    let newest = entries.back().copied();

    let mut allowed = true;
    let mut spacing_wait = Duration::ZERO;
    if let (Some(spacing), Some(last)) = (policy.min_spacing(), newest) {
        let ready_at = last.saturating_add(duration_micros(spacing));
        if ready_at > now {
            allowed = false;
            spacing_wait = Duration::from_micros(ready_at - now);
        }
    }
    // Count per rate: entries strictly inside (now - window, ∞).
    let mut counts = [0u64; 8];
    let mut counts_vec = Vec::new();
    let rates = policy.rates();
    let counts: &mut [u64] = if rates.len() <= counts.len() {
        &mut counts[..rates.len()]
    } else {
        counts_vec.resize(rates.len(), 0);
        &mut counts_vec
    };
    for (rate, count) in rates.iter().zip(counts.iter_mut()) {
        let start = now.saturating_sub(rate.window_micros());
        *count = n - entries.partition_point(|&t| t <= start) as u64;
        if *count + cost > rate.max() {
            allowed = false;
        }
    }

    let mut builder = DecisionBuilder::new(allowed);
    builder.wait(spacing_wait);
    for (rate, &count) in rates.iter().zip(counts.iter()) {
        let window = rate.window_micros();
        let (remaining, reset, wait) = if allowed {
            (rate.max() - count - cost, window, 0)
        } else {
            let reset = match newest {
                Some(t) if count > 0 => (t + window).saturating_sub(now),
                _ => 0,
            };
            let wait = if count + cost > rate.max() {
                // Admitted once at most `max - cost` entries are left in the
                // window: when the entry of reverse rank `max - cost` leaves.
                let rank = rate.max() - cost;
                let index = (n - 1 - rank) as usize;
                entries
                    .get(index)
                    .map_or(window, |&t| (t + window).saturating_sub(now))
            } else {
                0
            };
            (rate.max().saturating_sub(count), reset, wait)
        };
        builder.rate(RateState {
            rate: *rate,
            remaining,
            reset: Duration::from_micros(reset),
            wait: Duration::from_micros(wait),
        });
    }
    if allowed {
        let at = entries.partition_point(|&t| t <= now);
        if at == entries.len() {
            entries.extend(std::iter::repeat_n(now, cost as usize));
        } else {
            for _ in 0..cost {
                entries.insert(at, now);
            }
        }
    }
    match builder.build() {
        Some(decision) => decision,
        // `Policy` guarantees at least one rate.
        None => unreachable!("a policy always has a rate"),
    }
}

/// The entries of one key: timestamps in µs, oldest first, one per unit of cost.
pub(super) type State = VecDeque<u64>;

/// Decide one request; the state matters until its newest entry leaves the
/// longest window.
#[inline]
pub(super) fn check(entries: &mut State, now: u64, policy: &Policy) -> (Decision, u64) {
    let decision = check_log(entries, now, policy);
    let horizon = duration_micros(policy.longest_window());
    let expires_at = entries.back().map_or(0, |&t| t.saturating_add(horizon));
    (decision, expires_at)
}
