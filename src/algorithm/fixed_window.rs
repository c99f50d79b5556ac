//! The fixed window: the reference semantics of
//! [`Algorithm::FixedWindow`](crate::Algorithm::FixedWindow)
//! (`scripts/fixed_window.lua` mirrors it).
//!
//! Each rate counts the requests admitted in the current window of
//! wall-clock time, `[index × window, (index + 1) × window)` with
//! `index = floor(now / window)`. A request is admitted if every rate has
//! room for its cost; only then does it count, in every rate.
//!
//! A penalty adds its units to every rate's count in the current window (at
//! most [`MAX_UNITS`]; the key then waits for the next window), a reward
//! takes them off (never below zero).

use std::time::Duration;

use super::{MAX_UNITS, built};
use crate::decision::{Decision, DecisionBuilder, RateStatus};
use crate::policy::{Algorithm, Policy, Rate};

/// One counter per rate, found by its window.
///
/// One rate's state is held inline (no allocation, and no pointer to
/// follow from the store's table).
pub(crate) type State = smallvec::SmallVec<[Counter; 1]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counter {
    window: u64,
    index: u64,
    count: u64,
}

#[inline]
pub(crate) fn check(counters: &mut State, now: u64, policy: &Policy) -> (Decision, u64) {
    if let [rate] = policy.rates()
        && let Some(decided) = check_one(counters, now, policy.cost(), rate)
    {
        return decided;
    }
    check_many(counters, now, policy)
}

/// [`check`] of a policy of one rate over a state of that rate's window
/// only (a key's usual state): the same decision and state, without the
/// builder. `None`, changing nothing, for a state of other windows, which
/// the general path keeps.
#[inline]
fn check_one(counters: &mut State, now: u64, cost: u64, rate: &Rate) -> Option<(Decision, u64)> {
    let window = rate.window_micros();
    let counter = match counters.as_slice() {
        [] => None,
        [c] if c.window == window => Some(*c),
        _ => return None,
    };
    let index = now / window;
    let end = (index + 1) * window;
    let count = counter.filter(|c| c.index == index).map_or(0, |c| c.count);
    let allowed = count + cost <= rate.max();
    // Above zero either way (a cost is at least 1, and a denial means the
    // window already counts more than `max - cost`): the counter stays.
    let count = if allowed { count + cost } else { count };
    let status = status(rate, allowed, count, cost, end - now);
    let counter = Counter {
        window,
        index,
        count,
    };
    match counters.as_mut_slice() {
        [only] => *only = counter,
        _ => counters.push(counter),
    }
    Some((
        DecisionBuilder::one(allowed, Algorithm::FixedWindow, status),
        end,
    ))
}

/// The status of `rate` whose window ends in `left` µs and counts `count`
/// after the check.
#[inline]
fn status(rate: &Rate, allowed: bool, count: u64, cost: u64, left: u64) -> RateStatus {
    let denies = !allowed && count + cost > rate.max();
    RateStatus {
        rate: *rate,
        remaining: rate.max().saturating_sub(count),
        reset: Duration::from_micros(if count > 0 { left } else { 0 }),
        // The counter starts again at the next window.
        wait: Duration::from_micros(if denies { left } else { 0 }),
    }
}

/// [`check`] of any policy over any state.
fn check_many(counters: &mut State, now: u64, policy: &Policy) -> (Decision, u64) {
    let cost = policy.cost();
    let rates = policy.rates();
    // The count of a rate in the current window.
    let count_of = |counters: &State, rate: &Rate| {
        let window = rate.window_micros();
        let index = now / window;
        counters
            .iter()
            .find(|c| c.window == window && c.index == index)
            .map_or(0, |c| c.count)
    };
    let allowed = rates
        .iter()
        .all(|rate| count_of(counters, rate) + cost <= rate.max());

    // The counters are written in place when they hold exactly one per
    // rate, in the policy's order (a key's usual state), and every one
    // stays; else they are rebuilt. Each rate reads only its own window's
    // counter, so writing one in place changes no other's count.
    let mut in_place = counters.len() == rates.len()
        && counters
            .iter()
            .zip(rates)
            .all(|(c, rate)| c.window == rate.window_micros());
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::FixedWindow);
    let mut expires_at = 0;
    let mut next = State::new();
    for (i, rate) in rates.iter().enumerate() {
        let window = rate.window_micros();
        let index = now / window;
        let end = (index + 1) * window;
        let count = count_of(counters, rate);
        let count = if allowed { count + cost } else { count };
        builder.rate(status(rate, allowed, count, cost, end - now));
        let counter = Counter {
            window,
            index,
            count,
        };
        if count > 0 {
            expires_at = expires_at.max(end);
        }
        if in_place && count > 0 {
            counters[i] = counter;
            continue;
        }
        if in_place {
            // This counter goes: rebuild from the rates written so far.
            in_place = false;
            next.extend_from_slice(&counters[..i]);
        }
        if count > 0 {
            next.push(counter);
        }
    }
    if !in_place {
        // Counters of other windows (another policy on this key) stay while
        // their window lasts, as the Redis hash keeps their fields.
        for other in counters.iter() {
            if !next.iter().any(|c| c.window == other.window) && other.index == now / other.window {
                expires_at = expires_at.max((other.index + 1) * other.window);
                next.push(*other);
            }
        }
        *counters = next;
    }
    (built(builder), expires_at)
}

/// The decision [`check`] would take at `now`, changing nothing.
pub(crate) fn peek(counters: &State, now: u64, policy: &Policy) -> Decision {
    check(&mut counters.clone(), now, policy).0
}

/// Add `units` to every rate's count (at most [`MAX_UNITS`]).
pub(crate) fn penalty(counters: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    set(counters, now, policy, |count| {
        count.saturating_add(units).min(MAX_UNITS)
    })
}

/// Take `units` off every rate's count (never below zero).
pub(crate) fn reward(counters: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    set(counters, now, policy, |count| count.saturating_sub(units))
}

/// Set every rate's count in its current window to `f(count)`; counters of
/// other windows (another policy on this key) stay while their window
/// lasts. Returns when the state stops mattering.
fn set(counters: &mut State, now: u64, policy: &Policy, f: impl Fn(u64) -> u64) -> u64 {
    let rates = policy.rates();
    let mut next = State::with_capacity(counters.len().max(rates.len()));
    let mut expires_at = 0;
    for rate in rates {
        let window = rate.window_micros();
        let index = now / window;
        let count = f(counters
            .iter()
            .find(|c| c.window == window && c.index == index)
            .map_or(0, |c| c.count));
        if count > 0 {
            expires_at = expires_at.max((index + 1) * window);
            next.push(Counter {
                window,
                index,
                count,
            });
        }
    }
    for other in counters.iter() {
        let ours = rates.iter().any(|r| r.window_micros() == other.window);
        if !ours && other.index == now / other.window {
            expires_at = expires_at.max((other.index + 1) * other.window);
            next.push(*other);
        }
    }
    *counters = next;
    expires_at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-rate fast path takes the decisions, and leaves the state, of
    /// the general path wherever it decides: over bursts, denials, costs
    /// above one and new windows; it leaves a state of other windows to
    /// the general path.
    #[test]
    fn one_rate_takes_the_general_paths_decisions() {
        let base = 1_763_800_000_000_000u64;
        for text in ["3/1s", "7/1s", "4/10ms", "1000/1s"] {
            for cost in [1, 2, 3] {
                let policy: Policy = text.parse::<Policy>().unwrap();
                let policy = policy.fixed_window().unwrap().with_cost(cost).unwrap();
                let rate = policy.rates()[0];
                let (mut fast, mut general) = (State::new(), State::new());
                for (step, now) in super::super::burst_times(base) {
                    let b = check_many(&mut general, now, &policy);
                    // A one-rate state of the rate's own window, whose
                    // count a check never leaves at zero: the fast path
                    // decides every check.
                    let a = check_one(&mut fast, now, cost, &rate)
                        .unwrap_or_else(|| panic!("{text} cost {cost} step {step}: declined"));
                    assert_eq!(a, b, "{text} cost {cost} step {step}");
                    assert_eq!(fast, general, "{text} cost {cost} step {step}");
                }
            }
        }
        // A state of other windows (a changed policy) is the general path's.
        let policy: Policy = "3/1s".parse::<Policy>().unwrap().fixed_window().unwrap();
        let mut state = State::new();
        state.push(Counter {
            window: 60_000_000,
            index: base / 60_000_000,
            count: 2,
        });
        let before = state.clone();
        assert!(check_one(&mut state, base, 1, &policy.rates()[0]).is_none());
        assert_eq!(state, before);
        check(&mut state, base, &policy);
        assert_eq!(
            state.len(),
            2,
            "the other window's counter stays: {state:?}"
        );
    }
}
