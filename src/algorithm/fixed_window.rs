//! The fixed window: the reference semantics of
//! [`Algorithm::FixedWindow`](crate::Algorithm::FixedWindow)
//! (`scripts/fixed_window.lua` mirrors it).
//!
//! Each rate counts the requests admitted in the current window of
//! wall-clock time, `[index × window, (index + 1) × window)` with
//! `index = floor(now / window)`; a calendar rate's window is the day,
//! week or month of its calendar holding `now`, from one boundary to the
//! next, found by its start. A request is admitted if every rate has
//! room for its cost; only then does it count, in every rate.
//!
//! A penalty adds its units to every rate's count in the current window (at
//! most [`MAX_UNITS`]; the key then waits for the next window), a reward
//! takes them off (never below zero).

use super::{MAX_UNITS, built};
use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus};
use crate::policy::{Algorithm, Calendar, Policy, Rate};

/// One counter per rate, found by its slot.
///
/// One rate's state is held inline (no allocation, and no pointer to
/// follow from the store's table).
pub(crate) type State = smallvec::SmallVec<[Counter; 1]>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counter {
    /// Which rate counts here: its window in µs, or a calendar's
    /// [`Calendar::slot`] (never a window).
    slot: u64,
    /// Which window it counts: `floor(now / window)`, or the calendar
    /// window's start (µs since the epoch).
    index: u64,
    count: u64,
}

impl Counter {
    /// Its fields as words, for a state written to bytes
    /// ([`KeyState::to_bytes`](crate::store::KeyState::to_bytes)).
    pub(crate) fn words(&self) -> [u64; 3] {
        [self.slot, self.index, self.count]
    }

    /// A counter read back from [`words`](Self::words), unless its slot
    /// is zero, its window's end is past the clock's range or its count
    /// past any a state holds.
    pub(crate) fn from_words([slot, index, count]: [u64; 3]) -> Option<Self> {
        let fits = Calendar::from_slot(slot).is_some()
            || (slot > 0 && index.checked_add(1)?.checked_mul(slot).is_some());
        // A count is at most MAX_UNITS (a penalty stops there).
        (fits && count <= super::MAX_UNITS).then_some(Self { slot, index, count })
    }
}

/// The current window of `rate` at `now`: the slot of its counter, the
/// window's index and its end (µs).
#[inline]
pub(crate) fn place(rate: &Rate, now: u64) -> (u64, u64, u64) {
    match rate.calendar() {
        None => {
            let window = rate.window_micros();
            let index = now / window;
            (window, index, (index + 1) * window)
        }
        Some(calendar) => {
            let (start, end) = calendar.window_at(now);
            (calendar.slot(), start, end)
        }
    }
}

/// The slot of `rate`'s counter.
#[inline]
fn slot(rate: &Rate) -> u64 {
    rate.calendar()
        .map_or_else(|| rate.window_micros(), |calendar| calendar.slot())
}

/// The end of `counter`'s window, if it is still the current one at `now`
/// (a counter of another policy on this key).
fn current_until(counter: &Counter, now: u64) -> Option<u64> {
    match Calendar::from_slot(counter.slot) {
        None => {
            let window = counter.slot;
            (counter.index == now / window).then(|| (counter.index + 1) * window)
        }
        Some(calendar) => {
            let (start, end) = calendar.window_at(now);
            (start == counter.index).then_some(end)
        }
    }
}

/// Decide one request at `now`; `expires_at` becomes when the state stops
/// mattering.
#[inline]
pub(crate) fn check(
    counters: &mut State,
    now: u64,
    policy: &Policy,
    expires_at: &mut u64,
) -> Decision {
    match policy.rates() {
        [rate] => check_one(counters, now, policy, rate, expires_at),
        _ => check_many(counters, now, policy, expires_at),
    }
}

/// [`check`] of a policy of one rate over a state of that rate's window
/// only (a key's usual state): the same decision and state, without the
/// builder. A state of other windows too, which the general path keeps,
/// is left to it.
#[inline]
fn check_one(
    counters: &mut State,
    now: u64,
    policy: &Policy,
    rate: &Rate,
    expires_at: &mut u64,
) -> Decision {
    let cost = policy.cost();
    let (slot, index, end) = place(rate, now);
    let counter = match counters.as_slice() {
        [] => None,
        [c] if c.slot == slot => Some(*c),
        _ => return check_many(counters, now, policy, expires_at),
    };
    let count = counter.filter(|c| c.index == index).map_or(0, |c| c.count);
    let allowed = count + cost <= rate.max();
    // Above zero either way (a cost is at least 1, and a denial means the
    // window already counts more than `max - cost`): the counter stays.
    let count = if allowed { count + cost } else { count };
    let status = status(rate, allowed, count, cost, end - now);
    let counter = Counter { slot, index, count };
    match counters.as_mut_slice() {
        [only] => *only = counter,
        _ => counters.push(counter),
    }
    *expires_at = end;
    DecisionBuilder::one(allowed, Algorithm::FixedWindow, status)
}

/// The status of `rate` whose window ends in `left` µs and counts `count`
/// after the check.
#[inline]
fn status(rate: &Rate, allowed: bool, count: u64, cost: u64, left: u64) -> RateStatus {
    let denies = !allowed && count + cost > rate.max();
    RateStatus {
        rate: *rate,
        remaining: rate.max().saturating_sub(count),
        reset: Micros(if count > 0 { left } else { 0 }),
        // The counter starts again at the next window.
        wait: Micros(if denies { left } else { 0 }),
    }
}

/// The decision of a store that counts first: `added` holds each rate's
/// count after the request's cost was added, and its window's end (µs).
/// The request is admitted when every count is at most its max; denied,
/// the store takes its cost back off every count, and the decision is on
/// the counts before it, as [`check`]'s on the same counts.
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // Redis's batches alone
pub(crate) fn decided_after_adding(policy: &Policy, now: u64, added: &[(u64, u64)]) -> Decision {
    let cost = policy.cost();
    let rates = policy.rates();
    let allowed = rates
        .iter()
        .zip(added)
        .all(|(rate, &(count, _))| count <= rate.max());
    let status = |rate: &Rate, &(count, end): &(u64, u64)| {
        let count = if allowed {
            count
        } else {
            count.saturating_sub(cost)
        };
        status(rate, allowed, count, cost, end.saturating_sub(now))
    };
    if let ([rate], [one]) = (rates, added) {
        return DecisionBuilder::one(allowed, Algorithm::FixedWindow, status(rate, one));
    }
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::FixedWindow);
    for (rate, one) in rates.iter().zip(added) {
        builder.rate(status(rate, one));
    }
    built(builder)
}

/// [`check`] of any policy over any state.
fn check_many(counters: &mut State, now: u64, policy: &Policy, expires: &mut u64) -> Decision {
    let cost = policy.cost();
    let rates = policy.rates();
    let allowed = rates
        .iter()
        .all(|rate| count_now(counters, rate, now) + cost <= rate.max());

    // The counters are written in place when they hold exactly one per
    // rate, in the policy's order (a key's usual state), and every one
    // stays; else they are rebuilt. Each rate reads only its own window's
    // counter, so writing one in place changes no other's count.
    let mut in_place = one_per_rate(counters, rates);
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::FixedWindow);
    let mut expires_at = 0;
    let mut next = State::new();
    for (i, rate) in rates.iter().enumerate() {
        let (slot, index, end) = place(rate, now);
        let count = count_now(counters, rate, now);
        let count = if allowed { count + cost } else { count };
        builder.rate(status(rate, allowed, count, cost, end - now));
        let counter = Counter { slot, index, count };
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
        keep_other_windows(counters, &mut next, now, &mut expires_at);
        *counters = next;
    }
    *expires = expires_at;
    built(builder)
}

/// The count of `rate` in its current window at `now`.
#[inline]
fn count_now(counters: &State, rate: &Rate, now: u64) -> u64 {
    let (slot, index, _) = place(rate, now);
    counters
        .iter()
        .find(|c| c.slot == slot && c.index == index)
        .map_or(0, |c| c.count)
}

/// Whether `counters` hold exactly one counter per rate, in the order of
/// `rates` (a key's usual state).
#[inline]
fn one_per_rate(counters: &State, rates: &[Rate]) -> bool {
    counters.len() == rates.len()
        && counters
            .iter()
            .zip(rates)
            .all(|(c, rate)| c.slot == slot(rate))
}

/// Add to `next` the counters of other windows (another policy on this
/// key) still current at `now`, as Redis keeps their counts, and
/// move `expires_at` to their end.
#[inline]
fn keep_other_windows(counters: &State, next: &mut State, now: u64, expires_at: &mut u64) {
    for other in counters.iter() {
        if next.iter().any(|c| c.slot == other.slot) {
            continue;
        }
        if let Some(end) = current_until(other, now) {
            *expires_at = (*expires_at).max(end);
            next.push(*other);
        }
    }
}

/// The decision [`check`] would take at `now`, changing nothing.
pub(crate) fn peek(counters: &State, now: u64, policy: &Policy) -> Decision {
    check(&mut counters.clone(), now, policy, &mut 0)
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
        let (slot, index, end) = place(rate, now);
        let count = f(counters
            .iter()
            .find(|c| c.slot == slot && c.index == index)
            .map_or(0, |c| c.count));
        if count > 0 {
            expires_at = expires_at.max(end);
            next.push(Counter { slot, index, count });
        }
    }
    for other in counters.iter() {
        let ours = rates.iter().any(|r| slot(r) == other.slot);
        if ours {
            continue;
        }
        if let Some(end) = current_until(other, now) {
            expires_at = expires_at.max(end);
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
    /// the general path, which keeps it.
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
                    let (mut expires_a, mut expires_b) = (0, 1);
                    let b = check_many(&mut general, now, &policy, &mut expires_b);
                    // A one-rate state of the rate's own window, whose
                    // count a check never leaves at zero: the fast path
                    // decides every check.
                    let a = check_one(&mut fast, now, &policy, &rate, &mut expires_a);
                    assert_eq!(
                        (a, expires_a),
                        (b, expires_b),
                        "{text} cost {cost} step {step}"
                    );
                    assert_eq!(fast, general, "{text} cost {cost} step {step}");
                }
            }
        }
        // A state of other windows (a changed policy) is the general path's.
        let policy: Policy = "3/1s".parse::<Policy>().unwrap().fixed_window().unwrap();
        let mut state = State::new();
        state.push(Counter {
            slot: 60_000_000,
            index: base / 60_000_000,
            count: 2,
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
            "the other window's counter stays: {state:?}"
        );
    }

    /// Calendar windows on a `MemoryStore` driven by a `ManualClock`.
    mod calendar {
        use std::time::Duration;

        use crate::MemoryStore;
        use crate::clock::ManualClock;
        use crate::policy::Policy;
        use crate::store::Command;

        /// An instant in RFC 3339 (`2026-03-28T23:00Z`) as a clock reads it.
        fn at(text: &str) -> Duration {
            let instant: jiff::Timestamp = text.parse().unwrap();
            Duration::from_micros(u64::try_from(instant.as_microsecond()).unwrap())
        }

        /// A store at `now` and the policy `text`.
        fn store_at(now: &str, text: &str) -> (MemoryStore, ManualClock, Policy) {
            let clock = ManualClock::new(at(now));
            (
                MemoryStore::with_clock(clock.clone()),
                clock,
                text.parse().unwrap(),
            )
        }

        /// `max` admitted, then a denial whose `Retry-After` and reset are
        /// the time to `boundary`; at `boundary`, a fresh window.
        fn fills_until(text: &str, now: &str, max: u64, boundary: &str) {
            let (store, clock, policy) = store_at(now, text);
            let left = at(boundary) - at(now);
            for i in 0..max {
                let decision = store.check_now("k", &policy);
                assert!(decision.allowed(), "{text} at {now}: check {i}");
                assert_eq!(decision.reset(), left, "{text} at {now}: reset");
                assert_eq!(decision.remaining(), max - i - 1);
            }
            let denied = store.check_now("k", &policy);
            assert!(!denied.allowed(), "{text} at {now}");
            assert_eq!(denied.retry_after(), left, "{text} at {now}: retry after");
            assert_eq!(denied.reset(), left, "{text} at {now}: reset");
            clock.set(at(boundary) - Duration::from_micros(1));
            assert!(
                !store.check_now("k", &policy).allowed(),
                "{text}: 1 µs before {boundary}"
            );
            clock.set(at(boundary));
            let next = store.check_now("k", &policy);
            assert!(next.allowed(), "{text} at {boundary}");
            assert_eq!(next.remaining(), max - 1);
        }

        #[test]
        fn a_month_ends_at_the_next_month() {
            fills_until("2/month", "2026-01-31T23:59:58Z", 2, "2026-02-01T00:00Z");
            fills_until("2/month", "2028-02-29T12:00Z", 2, "2028-03-01T00:00Z");
            fills_until("2/month", "2026-02-28T12:00Z", 2, "2026-03-01T00:00Z");
            fills_until("3/month", "2026-12-31T23:00Z", 3, "2027-01-01T00:00Z");
        }

        #[test]
        fn a_day_across_daylight_saving_ends_at_local_midnight() {
            // 23 hours: the day of 2026-03-29 in Paris ends at 22:00 UTC.
            fills_until(
                "1/day in Europe/Paris",
                "2026-03-29T00:30Z",
                1,
                "2026-03-29T22:00Z",
            );
            // 25 hours: 2026-10-25 ends at 23:00 UTC.
            fills_until(
                "1/day in Europe/Paris",
                "2026-10-24T22:00Z",
                1,
                "2026-10-25T23:00Z",
            );
            let (store, _, policy) = store_at("2026-10-24T22:00Z", "1/day in Europe/Paris");
            assert_eq!(
                store.check_now("k", &policy).reset(),
                Duration::from_secs(25 * 3600)
            );
        }

        #[test]
        fn a_billing_anchor_starts_each_period() {
            fills_until(
                "2/month from 15",
                "2026-02-14T23:59Z",
                2,
                "2026-02-15T00:00Z",
            );
            // From the 31st: February's period starts on its last day.
            fills_until(
                "2/month from 31",
                "2026-02-10T00:00Z",
                2,
                "2026-02-28T00:00Z",
            );
            fills_until(
                "2/month from 31",
                "2026-04-01T00:00Z",
                2,
                "2026-04-30T00:00Z",
            );
            fills_until(
                "2/month from 31",
                "2028-02-01T00:00Z",
                2,
                "2028-02-29T00:00Z",
            );
        }

        #[test]
        fn a_week_from_wednesday_and_a_fixed_offset() {
            // 2026-11-26 is a Thursday.
            fills_until(
                "4/week from wed",
                "2026-11-26T10:00Z",
                4,
                "2026-12-02T00:00Z",
            );
            fills_until("4/week", "2026-11-26T10:00Z", 4, "2026-11-30T00:00Z");
            fills_until(
                "2/day in +05:30",
                "2026-11-26T20:00Z",
                2,
                "2026-11-27T18:30Z",
            );
        }

        #[test]
        fn a_calendar_rate_beside_a_rolling_one() {
            let (store, clock, policy) = store_at("2026-05-31T23:59:00Z", "2/min, 3/month");
            assert!(store.check_now("k", &policy).allowed());
            assert!(store.check_now("k", &policy).allowed());
            let denied = store.check_now("k", &policy);
            assert_eq!(denied.retry_after(), Duration::from_secs(60)); // the minute
            assert_eq!(denied.limit(), 2);
            clock.advance(Duration::from_secs(30));
            let reset = store.check_now("k", &policy);
            assert!(!reset.allowed());
            clock.advance(Duration::from_secs(30)); // 2026-06-01: both windows are new
            for _ in 0..2 {
                assert!(store.check_now("k", &policy).allowed());
            }
            clock.advance(Duration::from_secs(60));
            assert!(store.check_now("k", &policy).allowed());
            let denied = store.check_now("k", &policy);
            assert!(!denied.allowed());
            assert_eq!(denied.limit(), 3);
            assert_eq!(
                denied.retry_after(),
                at("2026-07-01T00:00Z") - at("2026-06-01T00:01Z")
            );
        }

        #[test]
        fn commands_move_the_calendar_window() {
            let (store, clock, policy) = store_at("2026-01-31T12:00Z", "10/month in Europe/Paris");
            // A command answers as a request would after it: one more counts.
            let penalised = store.command_now("k", &policy, Command::Penalty(9));
            assert_eq!(penalised.remaining(), 0);
            // Paris's February starts at 23:00 UTC on January 31.
            assert_eq!(penalised.reset(), Duration::from_secs(11 * 3600));
            let rewarded = store.command_now("k", &policy, Command::Reward(4));
            assert_eq!(rewarded.remaining(), 4);
            assert_eq!(
                store.command_now("k", &policy, Command::Peek).remaining(),
                4
            );
            clock.set(at("2026-01-31T23:00Z") - Duration::from_micros(1));
            assert_eq!(
                store.command_now("k", &policy, Command::Peek).remaining(),
                4
            );
            clock.set(at("2026-01-31T23:00Z"));
            assert_eq!(
                store.command_now("k", &policy, Command::Peek).remaining(),
                9
            );
        }

        #[test]
        fn another_calendar_on_the_key_keeps_its_own_count() {
            let (store, _, utc) = store_at("2026-01-15T12:00Z", "5/month");
            let paris: Policy = "5/month in Europe/Paris".parse().unwrap();
            assert!(store.check_now("k", &utc).allowed());
            assert!(store.check_now("k", &utc).allowed());
            assert_eq!(store.check_now("k", &paris).remaining(), 4);
            assert_eq!(store.check_now("k", &utc).remaining(), 2);
        }
    }
}
