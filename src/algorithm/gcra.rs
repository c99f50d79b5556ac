//! GCRA: the reference semantics of
//! [`Algorithm::Gcra`](crate::Algorithm::Gcra) (`scripts/gcra.lua` mirrors
//! it).
//!
//! Each rate is a token bucket of capacity `max` refilled at one token per
//! `T = window / max`, kept as a theoretical arrival time (TAT). The
//! arithmetic works on the TAT's offset from now, `d` (µs, an `f64`), where
//! magnitudes are small: at today's timestamps (~1.7e15 µs) a double only
//! resolves 0.25 µs, which would round intervals and lose bursts. The TAT is
//! stored as whole µs plus a fraction, with the max it was written under:
//! after a change of the rate's max, the offset is read as
//! `d / (w / max_written) · T`, so the units a key used are kept (a lowered max
//! bites at once, a raised one gives exactly the difference).
//!
//! A request of cost `c` at `now` moves the offset to `max(d, 0) + c·T` and
//! is admitted if that is at most the window (with a relative tolerance of
//! 1e-9 for the rounding of sums of `T`). The Redis script does the same
//! IEEE operations in the same order, so both give the same answers.
//!
//! A penalty of `u` units moves every rate's offset to
//! `max(d, 0) + u·T` (at most [`MAX_OFFSET`], twice the longest window;
//! even beyond the window, so the key waits until the excess has drained);
//! a reward moves it to
//! `max(d, 0) − u·T`, never below zero (a full bucket).

use super::built;
use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus};
use crate::policy::{Algorithm, Policy, Rate};

/// Relative tolerance of the admission test and the token count.
pub(crate) const EPSILON: f64 = 1e-9;

/// The largest offset a penalty leaves: twice the longest window (20
/// years), so a TAT stays far below 2^53 µs, where Redis's doubles are
/// exact.
pub(crate) const MAX_OFFSET: f64 = 2.0 * crate::policy::MAX_WINDOW.as_micros() as f64;

/// One TAT per rate, found by its window.
///
/// One rate's state is held inline (no allocation, and no pointer to
/// follow from the store's table).
pub(crate) type State = smallvec::SmallVec<[Tat; 1]>;

/// A rate's theoretical arrival time (TAT).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Tat {
    /// The rate's window (µs), which finds its TAT.
    window: u64,
    /// The TAT in whole µs since the epoch, and the fraction below.
    whole: u64,
    fraction: f64,
    /// The rate's max when the TAT was written: the units it holds are
    /// kept when the max changes.
    max: u64,
}

impl Tat {
    /// Its fields as words (the fraction's bits), for a state written to
    /// bytes ([`KeyState::to_bytes`](crate::store::KeyState::to_bytes)).
    pub(crate) fn words(&self) -> [u64; 4] {
        [self.window, self.whole, self.fraction.to_bits(), self.max]
    }

    /// A TAT read back from [`words`](Self::words), unless its window is
    /// zero, its fraction not in [0, 1), or its time or max past any a
    /// state holds.
    pub(crate) fn from_words([window, whole, fraction, max]: [u64; 4]) -> Option<Self> {
        let fraction = f64::from_bits(fraction);
        // A TAT is at most MAX_OFFSET past a time below 2^53 µs (year
        // 2255), and a max at most MAX_MAX.
        let fits = window > 0
            && (0.0..1.0).contains(&fraction)
            && whole <= (1 << 53) + MAX_OFFSET as u64
            && (1..=crate::policy::MAX_MAX).contains(&max);
        fits.then_some(Self {
            window,
            whole,
            fraction,
            max,
        })
    }
}

/// One rate of a check, planned from the state: its window and interval
/// (µs), and its offset now and after the request.
#[derive(Clone, Copy)]
struct Plan {
    window: f64,
    interval: f64,
    now: f64,
    after: f64,
}

/// The offset of `tat` from `now` under `rate` (of interval `interval`):
/// the units it holds are kept when the max changed (the offset is read as
/// `d / (w / max_written) · T`), so a lowered max bites at once and a
/// raised one gives exactly the difference. Unchanged max: the offset as
/// is.
#[inline]
fn offset(tat: &Tat, now: u64, rate: &Rate, interval: f64) -> f64 {
    let d = (tat.whole as i64 - now as i64) as f64 + tat.fraction;
    if tat.max == rate.max() {
        d
    } else {
        d / (tat.window as f64 / tat.max as f64) * interval
    }
}

/// The offset (at least 0) of the state's TAT of `rate`'s window from
/// `now`, under `rate` of interval `interval`.
#[inline]
fn offset_of(state: &State, now: u64, rate: &Rate, interval: f64) -> f64 {
    let window = rate.window_micros();
    state
        .iter()
        .find(|tat| tat.window == window)
        .map_or(0.0, |tat| offset(tat, now, rate, interval))
        .max(0.0)
}

/// The plan of `rate` for a request of `cost` at `now`.
#[inline]
fn plan(state: &State, now: u64, cost: f64, rate: &Rate) -> Plan {
    planned(rate, cost, |interval| offset_of(state, now, rate, interval))
}

/// The plan of `rate` for a request of `cost` at the offset `d` (at least
/// 0) that `offset` gives for the rate's interval.
#[inline]
fn planned(rate: &Rate, cost: f64, offset: impl FnOnce(f64) -> f64) -> Plan {
    let window = float(rate.window_micros());
    let interval = window / float(rate.max());
    let d = offset(interval);
    Plan {
        window,
        interval,
        now: d,
        after: d + cost * interval,
    }
}

/// An offset kept after a check (at least 0), in whole µs and the
/// fraction below, and rounded up: the TAT it writes, the reset it shows
/// and the expiry of the state, from one conversion.
#[derive(Clone, Copy)]
struct Kept {
    offset: f64,
    whole: u64,
    fraction: f64,
    up: u64,
}

impl Kept {
    #[inline]
    fn of(offset: f64) -> Self {
        let whole = floor_non_negative(offset);
        let fraction = offset - float(whole);
        Self {
            offset,
            whole,
            fraction,
            up: whole + u64::from(fraction > 0.0),
        }
    }
}

/// The status of `rate` whose offset is `kept` after the check (`new_d`
/// had the request been admitted), and whether it keeps the request out.
#[inline]
fn status(rate: &Rate, allowed: bool, plan: Plan, kept: Kept) -> RateStatus {
    let Plan {
        window: w,
        interval,
        after: new_d,
        ..
    } = plan;
    let denies = !allowed && new_d > w * (1.0 + EPSILON);
    // Tokens left now: how many more intervals fit in the window.
    let remaining = floor_non_negative((w - kept.offset) / interval + EPSILON);
    RateStatus {
        rate: *rate,
        remaining: remaining.min(rate.max()),
        reset: Micros(kept.up),
        // Admitted once the offset has shrunk to the window.
        wait: if denies {
            micros_ceil(new_d - w)
        } else {
            Micros::ZERO
        },
    }
}

/// The TAT of an offset `kept` (> 0) at `now`, for `rate`.
#[inline]
fn tat(rate: &Rate, now: u64, kept: Kept) -> Tat {
    Tat {
        window: rate.window_micros(),
        whole: now + kept.whole,
        fraction: kept.fraction,
        max: rate.max(),
    }
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
    let cost = float(policy.cost());
    match policy.rates() {
        [rate] => check_one(state, now, cost, rate, expires_at),
        rates => check_many(state, now, cost, rates, expires_at),
    }
}

/// [`check`] of any number of rates.
fn check_many(
    state: &mut State,
    now: u64,
    cost: f64,
    rates: &[Rate],
    expires: &mut u64,
) -> Decision {
    let allowed = rates.iter().all(|rate| {
        let plan = plan(state, now, cost, rate);
        plan.after <= plan.window * (1.0 + EPSILON)
    });

    // An admitted request keeps one TAT per rate, in the policy's order:
    // written in place when the state already has that layout (every check
    // after a key's first), else into a new state. Each rate reads only its
    // own window's TAT, so writing one in place changes no other's plan.
    let in_place = allowed
        && state.len() == rates.len()
        && state
            .iter()
            .zip(rates)
            .all(|(tat, rate)| tat.window == rate.window_micros());
    let mut next = State::new();
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Gcra);
    let mut expires_at = 0u64;
    for (i, rate) in rates.iter().enumerate() {
        let plan = plan(state, now, cost, rate);
        let kept = Kept::of(if allowed { plan.after } else { plan.now });
        builder.rate(status(rate, allowed, plan, kept));
        if kept.up > 0 {
            expires_at = expires_at.max(now + kept.up);
            let tat = tat(rate, now, kept);
            if in_place {
                state[i] = tat;
            } else if allowed {
                next.push(tat);
            }
        }
    }
    if allowed && !in_place {
        *state = next;
    }
    // Denied, the state is left as it was, and so is its expiry (it may
    // hold another policy's longer rates).
    if allowed {
        *expires = expires_at;
    }
    built(builder)
}

/// [`check`] of a policy of one rate (the usual case): the same arithmetic
/// and the same state, planned once and without a builder. (A one-rate
/// check keeps that rate's TAT alone, whatever the state held.)
#[inline]
fn check_one(
    state: &mut State,
    now: u64,
    cost: f64,
    rate: &Rate,
    expires_at: &mut u64,
) -> Decision {
    let plan = plan(state, now, cost, rate);
    let allowed = plan.after <= plan.window * (1.0 + EPSILON);
    let kept = Kept::of(if allowed { plan.after } else { plan.now });
    let status = status(rate, allowed, plan, kept);
    // Denied, the state is left as it was, and so is its expiry (it may
    // hold another policy's longer rates). Admitted, the offset is at
    // least one interval (a cost is at least 1): the state becomes this
    // rate's TAT alone.
    if allowed {
        *expires_at = now + kept.up;
        let tat = tat(rate, now, kept);
        match state.as_mut_slice() {
            [only] => *only = tat,
            _ => {
                state.clear();
                state.push(tat);
            }
        }
    }
    DecisionBuilder::one(allowed, Algorithm::Gcra, status)
}

/// The decision of a check admitted or denied elsewhere (by Redis's batch
/// script, `decide_batched` in `scripts/gcra.lua`, on the same arithmetic)
/// from each rate's offset before it (`offsets`, at least 0, in the
/// policy's order): what [`check`] decides on a state of those offsets.
/// `None` when there is not one offset per rate.
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // Redis's batches alone
pub(crate) fn decided(policy: &Policy, allowed: bool, offsets: &[f64]) -> Option<Decision> {
    let cost = float(policy.cost());
    let status_of = |rate: &Rate, d: f64| {
        let plan = planned(rate, cost, |_| d);
        status(
            rate,
            allowed,
            plan,
            Kept::of(if allowed { plan.after } else { plan.now }),
        )
    };
    match (policy.rates(), offsets) {
        ([rate], [d]) => Some(DecisionBuilder::one(
            allowed,
            Algorithm::Gcra,
            status_of(rate, *d),
        )),
        (rates, offsets) if rates.len() == offsets.len() => {
            let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Gcra);
            for (rate, d) in rates.iter().zip(offsets) {
                builder.rate(status_of(rate, *d));
            }
            Some(built(builder))
        }
        _ => None,
    }
}

/// The decision [`check`] would take at `now`, changing nothing.
pub(crate) fn peek(state: &State, now: u64, policy: &Policy) -> Decision {
    check(&mut state.clone(), now, policy, &mut 0)
}

/// Take `units` tokens from every rate, even beyond an empty bucket.
pub(crate) fn penalty(state: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    let units = units as f64;
    set(state, now, policy, |d, interval| {
        let kept = d + units * interval;
        if kept > MAX_OFFSET { MAX_OFFSET } else { kept }
    })
}

/// Give `units` tokens back to every rate, up to a full bucket.
pub(crate) fn reward(state: &mut State, now: u64, policy: &Policy, units: u64) -> u64 {
    let units = units as f64;
    set(state, now, policy, |d, interval| {
        let kept = d - units * interval;
        if kept < 0.0 { 0.0 } else { kept }
    })
}

/// Move every rate's offset `d` (at least 0) to `f(d, T)`: the state
/// becomes this policy's TATs still ahead of `now`. Returns when it stops
/// mattering.
fn set(state: &mut State, now: u64, policy: &Policy, f: impl Fn(f64, f64) -> f64) -> u64 {
    let mut next = State::with_capacity(policy.rates().len());
    let mut expires_at = 0;
    for rate in policy.rates() {
        let interval = float(rate.window_micros()) / float(rate.max());
        let kept = Kept::of(f(offset_of(state, now, rate, interval), interval));
        if kept.up > 0 {
            expires_at = expires_at.max(now + kept.up);
            next.push(tat(rate, now, kept));
        }
    }
    *state = next;
    expires_at
}

/// `x.floor()` for `x >= 0`, 0 below: a truncating cast, where `f64::floor`
/// is a libm call on x86-64 without SSE4.1 (5% of a decision in perf).
///
/// The cast is the signed one (one instruction on x86-64, where the
/// unsigned one takes a branch and a fix-up): the same for every value
/// below 2^63, and every offset, count and time here is below 2^53 (a
/// value above 2^63 gives `i64::MAX`, never a wrapped number).
#[inline]
fn floor_non_negative(x: f64) -> u64 {
    if x > 0.0 { x as i64 as u64 } else { 0 }
}

/// `x.ceil()` for `x > 0`, without libm (see [`floor_non_negative`]).
#[inline]
fn ceil_positive(x: f64) -> u64 {
    let whole = x as i64;
    let whole = if (whole as f64) < x {
        whole.saturating_add(1)
    } else {
        whole
    };
    whole as u64
}

/// `x` as a double: the signed conversion (see [`floor_non_negative`]),
/// exact as `x as f64` for the windows, maxes, costs and times here (all
/// below 2^53).
#[inline]
fn float(x: u64) -> f64 {
    x as i64 as f64
}

fn micros_ceil(us: f64) -> Micros {
    if us > 0.0 {
        Micros(ceil_positive(us))
    } else {
        Micros::ZERO
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The units a key used are kept across a change of max: lowered, the
    /// key is denied at once; raised again, it gets exactly the difference.
    #[test]
    fn a_changed_max_keeps_the_units_used() {
        let policy = |text: &str| text.parse::<Policy>().unwrap().gcra().unwrap();
        let (ten, five) = (policy("10/10s"), policy("5/10s"));
        let now = 1_700_000_000_000_000;
        let mut state = State::new();
        for _ in 0..8 {
            assert!(check(&mut state, now, &ten, &mut 0).allowed());
        }
        let lowered = check(&mut state, now, &five, &mut 0);
        assert!(!lowered.allowed());
        assert_eq!(lowered.remaining(), 0);
        let admitted = (0..5)
            .filter(|_| check(&mut state, now, &ten, &mut 0).allowed())
            .count();
        assert_eq!(admitted, 2);
        // Unchanged T reads the TAT as is: 10 used of 10.
        assert_eq!(peek(&state, now, &ten).remaining(), 0);
    }

    /// A decision taken from the offsets before a check (what Redis's
    /// batch script replies) is the decision the check took: admitted or
    /// denied, one rate or two, a cost above one, idle gaps.
    #[test]
    fn decided_from_the_offsets_is_the_check() {
        let policy = |text: &str| text.parse::<Policy>().unwrap().gcra().unwrap();
        let policies = [
            policy("7/10s"),
            policy("3/1s, 20/1min"),
            policy("5/1s").with_cost(2).unwrap(),
        ];
        for policy in &policies {
            let mut state = State::new();
            let mut now = 1_700_000_000_000_000;
            for step in 0..60u64 {
                now += [0, 1, 142_857, 700_000][(step % 4) as usize];
                let cost = float(policy.cost());
                let offsets: Vec<f64> = policy
                    .rates()
                    .iter()
                    .map(|rate| plan(&state, now, cost, rate).now)
                    .collect();
                let checked = check(&mut state, now, policy, &mut 0);
                assert_eq!(
                    decided(policy, checked.allowed(), &offsets),
                    Some(checked),
                    "{policy:?} step {step}"
                );
            }
            assert_eq!(decided(policy, true, &[]), None);
        }
    }

    #[test]
    fn cast_floor_and_ceil_match_libm() {
        for x in [
            -3.5,
            -0.0,
            0.0,
            1e-12,
            0.5,
            1.0,
            1.000_000_1,
            2.5,
            142_857.14,
            1e15 + 0.5,
            4e15,
            9_007_199_254_740_992.0,  // 2^53
            4.611_686_018_427_388e18, // 2^62
        ] {
            assert_eq!(
                floor_non_negative(x),
                x.floor().max(0.0) as u64,
                "floor {x}"
            );
            if x > 0.0 {
                assert_eq!(ceil_positive(x), x.ceil() as u64, "ceil {x}");
            }
        }
        for x in [0, 1, 999_999, 1 << 52, (1 << 53) - 1, 1 << 53, 1 << 62] {
            assert_eq!(float(x).to_bits(), (x as f64).to_bits(), "float {x}");
        }
    }

    /// The one-rate fast path takes the decisions, and leaves the state,
    /// of the general path: over bursts, denials, costs above one, idle
    /// gaps, and a state left by a policy of other windows.
    #[test]
    fn one_rate_takes_the_general_paths_decisions() {
        let base = 1_763_800_000_000_000u64;
        for text in ["3/1s", "7/1s", "4/10ms", "1000/1s"] {
            for cost in [1, 2, 3] {
                let policy: Policy = text.parse::<Policy>().unwrap().gcra().unwrap();
                let policy = policy.with_cost(cost).unwrap();
                let rate = policy.rates()[0];
                let (mut fast, mut general) = (State::new(), State::new());
                // A state of other windows, as a changed policy leaves.
                for state in [&mut fast, &mut general] {
                    state.push(Tat {
                        window: 5_000_000,
                        whole: base + 3_000_000,
                        fraction: 0.25,
                        max: 5,
                    });
                    state.push(Tat {
                        window: 60_000_000,
                        whole: base + 1_000,
                        fraction: 0.5,
                        max: 100,
                    });
                }
                for (step, now) in super::super::burst_times(base) {
                    // Written alike when admitted, left alike when denied.
                    let (mut expires_a, mut expires_b) = (7, 7);
                    let a = check_one(&mut fast, now, cost as f64, &rate, &mut expires_a);
                    let b = check_many(&mut general, now, cost as f64, &[rate], &mut expires_b);
                    assert_eq!(
                        (a, expires_a),
                        (b, expires_b),
                        "{text} cost {cost} step {step}"
                    );
                    assert_eq!(fast, general, "{text} cost {cost} step {step}");
                }
            }
        }
    }

    /// At today's timestamps, a burst of exactly `max` fits for awkward
    /// intervals, and very high rates are still enforced.
    #[test]
    fn bursts_are_exact_at_real_timestamps() {
        let now = 1_763_800_000_000_000u64;
        // Intervals of 142857.14 µs, 20408.16 µs, 0.33 µs and 0.1 µs.
        for text in [
            "7/1s",
            "49/1s",
            "3/1s",
            "1000/1s",
            "30000/10ms",
            "10000/1ms",
        ] {
            let policy: Policy = text.parse::<Policy>().unwrap().gcra().unwrap();
            let max = policy.rates()[0].max();
            let mut state = State::new();
            for i in 0..max {
                assert!(
                    check(&mut state, now, &policy, &mut 0).allowed(),
                    "{text}: request {i} of {max}"
                );
            }
            let denied = check(&mut state, now, &policy, &mut 0);
            assert!(!denied.allowed(), "{text}: request {} of {max}", max + 1);
            assert!(denied.retry_after() > Duration::ZERO, "{text}");
        }
    }
}
