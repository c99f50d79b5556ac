//! The sliding window counter: the reference semantics of
//! [`Algorithm::SlidingWindow`](crate::Algorithm::SlidingWindow)
//! (`scripts/sliding_window.lua` mirrors it).
//!
//! Each rate keeps the count of the current fixed window and of the one
//! before. At `elapsed` µs into the current window, the rolling count is
//! estimated as `previous × (window − elapsed) / window + current`: the
//! previous window weighted by how much of it the rolling window still
//! covers. A request of cost `c` is admitted if, for every rate,
//! `previous × (window − elapsed) + (current + c) × window ≤ max × window`
//! (integer arithmetic, no rounding).
//!
//! A penalty adds its units to every rate's current count (at most
//! [`MAX_UNITS`]); a reward takes them off the current count, then what is
//! left of them off the previous one (never below zero).

use super::{MAX_UNITS, built};
use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus};
use crate::policy::{Algorithm, Policy, Rate};

/// Two counters per rate, found by its window.
///
/// One rate's state is held inline (no allocation, and no pointer to
/// follow from the store's table).
pub(crate) type State = smallvec::SmallVec<[Counters; 1]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counters {
    window: u64,
    /// Index of the window `current` counts.
    index: u64,
    current: u64,
    previous: u64,
}

impl Counters {
    /// Its fields as words, for a state written to bytes
    /// ([`KeyState::to_bytes`](crate::store::KeyState::to_bytes)).
    pub(crate) fn words(&self) -> [u64; 4] {
        [self.window, self.index, self.current, self.previous]
    }

    /// Counters read back from [`words`](Self::words), unless the window
    /// is zero, the next one ends past the clock's range or a count is past
    /// any a state holds.
    pub(crate) fn from_words([window, index, current, previous]: [u64; 4]) -> Option<Self> {
        let fits = window > 0
            && index.checked_add(2)?.checked_mul(window).is_some()
            && current <= super::MAX_UNITS
            && previous <= super::MAX_UNITS;
        fits.then_some(Self {
            window,
            index,
            current,
            previous,
        })
    }
}

/// The counters of `window` rolled forward to the window holding `now`.
fn rolled(state: &State, window: u64, now: u64) -> Counters {
    let index = now / window;
    let (current, previous) = match state.iter().find(|c| c.window == window) {
        Some(c) if c.index == index => (c.current, c.previous),
        Some(c) if c.index + 1 == index => (0, c.current),
        _ => (0, 0),
    };
    Counters {
        window,
        index,
        current,
        previous,
    }
}

/// Whether `cost` more fits: `previous × (window − elapsed) + (current + cost) × window ≤ max × window`.
fn fits(c: &Counters, elapsed: u64, cost: u64, max: u64) -> bool {
    let w = u128::from(c.window);
    u128::from(c.previous) * (w - u128::from(elapsed)) + u128::from(c.current + cost) * w
        <= u128::from(max) * w
}

/// The smallest integer `elapsed` at which
/// `previous × (window − elapsed) ≤ room × window`: with
/// `x = room × window / previous`, that is `window − floor(x)`.
fn elapsed_needed(previous: u64, window: u64, room: u64) -> u64 {
    if previous == 0 {
        return 0;
    }
    let w = u128::from(window);
    let x = (u128::from(room) * w) / u128::from(previous);
    u64::try_from(w.saturating_sub(x)).unwrap_or(u64::MAX)
}

/// Time from `now` until a request of `cost` fits, with no other request.
fn wait(c: &Counters, now: u64, cost: u64, max: u64) -> u64 {
    let start = c.index * c.window;
    let elapsed = now - start;
    // In this window, once enough of the previous one has slid out.
    if c.current + cost <= max {
        let needed = elapsed_needed(c.previous, c.window, max - c.current - cost);
        if needed < c.window {
            return needed.saturating_sub(elapsed);
        }
    }
    // In the next window, where this window's count becomes the previous one.
    let needed = elapsed_needed(c.current, c.window, max - cost);
    (c.window - elapsed) + needed
}

/// Decide one request at `now`; `expires_at` becomes when the state stops
/// mattering.
#[inline]
pub(crate) fn check(
    state: &mut State,
    now: u64,
    policy: &Policy,
    expires_at: &mut u64,
) -> Decision {
    match policy.rates() {
        [rate] => check_one(state, now, policy, rate, expires_at),
        _ => check_many(state, now, policy, expires_at),
    }
}

/// [`check`] of a policy of one rate over a state of that rate's window
/// only (a key's usual state): the same decision and state, without the
/// builder or a vector of counters. A state of other windows too, which
/// the general path keeps, is left to it.
#[inline]
fn check_one(
    state: &mut State,
    now: u64,
    policy: &Policy,
    rate: &Rate,
    expires_at: &mut u64,
) -> Decision {
    let cost = policy.cost();
    let window = rate.window_micros();
    match state.as_slice() {
        [] => {}
        [c] if c.window == window => {}
        _ => return check_many(state, now, policy, expires_at),
    }
    let c = rolled(state, window, now);
    let allowed = fits(&c, now - c.index * c.window, cost, rate.max());
    let (status, c) = after(rate, c, now, cost, allowed);
    if c.current > 0 || c.previous > 0 {
        *expires_at = now + status.reset.0;
        match state.as_mut_slice() {
            [only] => *only = c,
            _ => state.push(c),
        }
    } else {
        *expires_at = 0;
        state.clear();
    }
    DecisionBuilder::one(allowed, Algorithm::SlidingWindow, status)
}

/// The status of `rate` after a check that was `allowed` or not, and its
/// counters `c` (rolled to `now`) after it.
#[inline]
fn after(
    rate: &Rate,
    mut c: Counters,
    now: u64,
    cost: u64,
    allowed: bool,
) -> (RateStatus, Counters) {
    let elapsed = now - c.index * c.window;
    let w = u128::from(c.window);
    let denies = !allowed && !fits(&c, elapsed, cost, rate.max());
    let wait_us = if denies {
        wait(&c, now, cost, rate.max())
    } else {
        0
    };
    if allowed {
        c.current += cost;
    }
    // Requests that still fit now: floor((max × w − previous × (w − elapsed)) / w) − current.
    let weighted = u128::from(c.previous) * (w - u128::from(elapsed));
    let room = (u128::from(rate.max()) * w).saturating_sub(weighted) / w;
    let remaining = u64::try_from(room)
        .unwrap_or(u64::MAX)
        .saturating_sub(c.current);
    let status = RateStatus {
        rate: *rate,
        remaining,
        reset: Micros(reset(&c, now)),
        wait: Micros(wait_us),
    };
    (status, c)
}

/// The decision of a store that counts first: `added` holds each rate's
/// current count after the request's cost was added, and its previous
/// window's count. The request is admitted when every rate's estimate fits
/// with the cost counted; denied, the store takes the cost back off every
/// current count, and the decision is on the counts before it, as
/// [`check`]'s on the same counts.
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // Redis's batches alone
pub(crate) fn decided_after_adding(policy: &Policy, now: u64, added: &[(u64, u64)]) -> Decision {
    let cost = policy.cost();
    let rates = policy.rates();
    let before = |rate: &Rate, &(current, previous): &(u64, u64)| {
        let window = rate.window_micros();
        Counters {
            window,
            index: now / window,
            current: current.saturating_sub(cost),
            previous,
        }
    };
    let allowed = rates.iter().zip(added).all(|(rate, one)| {
        let c = before(rate, one);
        fits(&c, now - c.index * c.window, cost, rate.max())
    });
    if let ([rate], [one]) = (rates, added) {
        let (status, _) = after(rate, before(rate, one), now, cost, allowed);
        return DecisionBuilder::one(allowed, Algorithm::SlidingWindow, status);
    }
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::SlidingWindow);
    for (rate, one) in rates.iter().zip(added) {
        builder.rate(after(rate, before(rate, one), now, cost, allowed).0);
    }
    built(builder)
}

/// [`check`] of any policy over any state.
fn check_many(state: &mut State, now: u64, policy: &Policy, expires: &mut u64) -> Decision {
    let cost = policy.cost();
    let rates = policy.rates();
    let counters: smallvec::SmallVec<[Counters; 4]> = rates
        .iter()
        .map(|rate| rolled(state, rate.window_micros(), now))
        .collect();
    let allowed = rates.iter().zip(&counters).all(|(rate, c)| {
        let elapsed = now - c.index * c.window;
        fits(c, elapsed, cost, rate.max())
    });

    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::SlidingWindow);
    let mut expires_at = 0;
    let mut next = State::with_capacity(rates.len());
    for (rate, c) in rates.iter().zip(&counters) {
        let (status, c) = after(rate, *c, now, cost, allowed);
        let reset = status.reset.0;
        builder.rate(status);
        if c.current > 0 || c.previous > 0 {
            expires_at = expires_at.max(now + reset);
            next.push(c);
        }
    }
    keep_others(state, &mut next, now, policy, &mut expires_at);
    *state = next;
    *expires = expires_at;
    built(builder)
}

/// µs from `now` until the estimate is back to zero: when both counted
/// windows have slid out.
#[inline]
fn reset(c: &Counters, now: u64) -> u64 {
    let end = (c.index + 1) * c.window;
    if c.current > 0 {
        end + c.window - now
    } else if c.previous > 0 {
        end - now
    } else {
        0
    }
}

/// Counters of other windows (another policy on this key) stay while they
/// still count, as Redis keeps their counts.
#[inline]
fn keep_others(state: &State, next: &mut State, now: u64, policy: &Policy, expires_at: &mut u64) {
    for other in state.iter() {
        let ours = policy
            .rates()
            .iter()
            .any(|r| r.window_micros() == other.window);
        if !ours && other.index + 1 >= now / other.window {
            *expires_at = (*expires_at).max((other.index + 2) * other.window);
            next.push(*other);
        }
    }
}

/// The decision [`check`] would take at `now`, changing nothing.
pub(crate) fn peek(state: &State, now: u64, policy: &Policy) -> Decision {
    check(&mut state.clone(), now, policy, &mut 0)
}

/// Add `units` to every rate's current count (at most [`MAX_UNITS`]).
pub(crate) fn penalty(state: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    set(state, now, policy, |c| {
        c.current = c.current.saturating_add(units).min(MAX_UNITS);
    })
}

/// Take `units` off every rate's current count, the rest off the previous
/// one (never below zero).
pub(crate) fn reward(state: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    set(state, now, policy, |c| {
        let from_current = units.min(c.current);
        c.current -= from_current;
        c.previous = c.previous.saturating_sub(units - from_current);
    })
}

/// Apply `f` to every rate's counters rolled forward to `now`. Returns when
/// the state stops mattering.
fn set(state: &mut State, now: u64, policy: &Policy, f: impl Fn(&mut Counters)) -> u64 {
    let mut next = State::with_capacity(state.len().max(policy.rates().len()));
    let mut expires_at = 0;
    for rate in policy.rates() {
        let mut c = rolled(state, rate.window_micros(), now);
        f(&mut c);
        if c.current > 0 || c.previous > 0 {
            expires_at = expires_at.max(now + reset(&c, now));
            next.push(c);
        }
    }
    keep_others(state, &mut next, now, policy, &mut expires_at);
    *state = next;
    expires_at
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-rate fast path takes the decisions, and leaves the state, of
    /// the general path wherever it decides: over bursts, denials, costs
    /// above one, windows that slid by and gaps longer than two windows; it
    /// leaves a state of other windows to the general path.
    #[test]
    fn one_rate_takes_the_general_paths_decisions() {
        let base = 1_763_800_000_000_000u64;
        for text in ["3/1s", "7/1s", "4/10ms", "1000/1s", "5/300ms"] {
            for cost in [1, 2, 3] {
                let policy: Policy = text.parse::<Policy>().unwrap();
                let policy = policy.sliding_window().unwrap().with_cost(cost).unwrap();
                let rate = policy.rates()[0];
                let (mut fast, mut general) = (State::new(), State::new());
                let mut denied = 0;
                for (step, now) in super::super::burst_times(base) {
                    let (mut expires_a, mut expires_b) = (0, 1);
                    let b = check_many(&mut general, now, &policy, &mut expires_b);
                    // A state of the rate's own window (or none): the fast
                    // path decides every check.
                    let a = check_one(&mut fast, now, &policy, &rate, &mut expires_a);
                    denied += usize::from(!a.allowed());
                    assert_eq!(
                        (a, expires_a),
                        (b, expires_b),
                        "{text} cost {cost} step {step}"
                    );
                    assert_eq!(fast, general, "{text} cost {cost} step {step}");
                }
                if text != "1000/1s" {
                    assert!(
                        denied > 0,
                        "{text} cost {cost}: the bursts were never denied"
                    );
                }
            }
        }
        // A state of other windows (a changed policy) is the general path's.
        let policy: Policy = "3/1s".parse::<Policy>().unwrap().sliding_window().unwrap();
        let mut state = State::new();
        state.push(Counters {
            window: 60_000_000,
            index: base / 60_000_000,
            current: 2,
            previous: 0,
        });
        let mut general = state.clone();
        let (mut expires_a, mut expires_b) = (0, 1);
        let a = check_one(
            &mut state,
            base,
            &policy,
            &policy.rates()[0],
            &mut expires_a,
        );
        let b = check_many(&mut general, base, &policy, &mut expires_b);
        assert_eq!((a, expires_a, &state), (b, expires_b, &general));
        assert_eq!(
            state.len(),
            2,
            "the other window's counters stay: {state:?}"
        );
    }
}
