//! GCRA in memory: the reference semantics of
//! [`Algorithm::Gcra`](crate::Algorithm::Gcra).
//!
//! Each rate is a token bucket of capacity `max` refilled at one token per
//! `T = window / max`, kept as a theoretical arrival time (TAT, in µs as an
//! `f64`, exactly as the Redis script keeps it). A request of cost `c` at
//! `now` moves the TAT to `max(TAT, now) + c·T` and is admitted if that is at
//! most `now + window`. The arithmetic is the same IEEE operations in the
//! same order as the Lua script, so both give the same answers.

use std::time::Duration;

use crate::decision::{Decision, DecisionBuilder, RateStatus};
use crate::policy::{Algorithm, Policy};

/// One TAT per rate, found by its window.
pub(super) type State = Vec<(u64, f64)>;

pub(super) fn check(state: &mut State, now: u64, policy: &Policy) -> (Decision, u64) {
    let cost = policy.cost() as f64;
    let now_f = now as f64;
    let rates = policy.rates();
    // (window, T, TAT from now on, TAT after this request)
    let plans: Vec<(f64, f64, f64, f64)> = rates
        .iter()
        .map(|rate| {
            let window = rate.window_micros();
            let w = window as f64;
            let interval = w / rate.max() as f64;
            let stored = state
                .iter()
                .find(|(win, _)| *win == window)
                .map_or(now_f, |&(_, tat)| tat);
            let tat = stored.max(now_f);
            (w, interval, tat, tat + cost * interval)
        })
        .collect();
    let allowed = plans.iter().all(|&(w, _, _, new_tat)| new_tat - now_f <= w);

    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Gcra);
    let mut expires_at = 0u64;
    let mut next = Vec::with_capacity(rates.len());
    for (rate, &(w, interval, tat, new_tat)) in rates.iter().zip(&plans) {
        let kept = if allowed { new_tat } else { tat };
        let denies = !allowed && new_tat - now_f > w;
        // Tokens left now: how many more intervals fit before now + window.
        let remaining = ((now_f + w - kept) / interval).floor().max(0.0) as u64;
        builder.rate(RateStatus {
            rate: *rate,
            remaining: remaining.min(rate.max()),
            reset: micros_ceil(kept - now_f),
            // Admitted once now + window reaches the new TAT.
            wait: if denies {
                micros_ceil(new_tat - w - now_f)
            } else {
                Duration::ZERO
            },
        });
        if kept > now_f {
            expires_at = expires_at.max(kept.ceil() as u64);
            next.push((rate.window_micros(), kept));
        }
    }
    *state = next;
    match builder.build() {
        Some(decision) => (decision, expires_at),
        None => unreachable!("a policy always has a rate"),
    }
}

fn micros_ceil(us: f64) -> Duration {
    if us > 0.0 {
        Duration::from_micros(us.ceil() as u64)
    } else {
        Duration::ZERO
    }
}
