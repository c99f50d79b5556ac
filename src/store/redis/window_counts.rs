//! Where a window counter's counts are in Redis, as its batches of plain
//! commands ([`plain`](super::plain)) name them: one integer per rate and
//! window, `{state}:{window µs or calendar}:{window index}` (the scripts'
//! names), its window placed on Redis's time, and its expiry.

use crate::algorithm::fixed_window;
use crate::policy::{Algorithm, Policy, Rate};

/// One rate's count of one check: its key, its window's index and the
/// count's expiry (µs), and the sliding window's previous window's count.
pub(super) struct Count {
    pub(super) key: String,
    pub(super) index: u64,
    pub(super) expires: u64,
    pub(super) previous: Option<String>,
}

/// Where `rate`'s count is at Redis time `at` (µs): the key
/// `{state}:{window µs or calendar}:{window index}`, as the scripts name it.
pub(super) fn count(algorithm: Algorithm, state: &str, rate: &Rate, at: u64) -> Count {
    let (index, end) = place(algorithm, rate, at);
    match (algorithm, rate.calendar()) {
        (Algorithm::SlidingWindow, _) => {
            let window = rate.window_micros();
            Count {
                key: sliding_key(state, window, index),
                index,
                // It counts as the previous window until the next one ends.
                expires: end.saturating_add(window),
                previous: Some(sliding_key(state, window, index.saturating_sub(1))),
            }
        }
        (_, None) => Count {
            key: format!("{state}:{}:{index}", rate.window_micros()),
            index,
            expires: end,
            previous: None,
        },
        (_, Some(calendar)) => Count {
            key: format!("{state}:{}:{index}", calendar.field()),
            index,
            expires: end,
            previous: None,
        },
    }
}

/// The sliding window's count of window `index` of `window` µs.
fn sliding_key(state: &str, window: u64, index: u64) -> String {
    format!("{state}:{window}:{index}")
}

/// The sliding window's counts of `state` that may be a previous count
/// about this process's time `now` (µs): for every rate, its window's,
/// the one before and the one before that (Redis's clock may be a window
/// away).
pub(super) fn previous_keys(state: &str, policy: &Policy, now: u64) -> Vec<String> {
    policy
        .rates()
        .iter()
        .flat_map(|rate| {
            let window = rate.window_micros();
            let (index, _) = place(Algorithm::SlidingWindow, rate, now);
            (index.saturating_sub(2)..=index).map(move |index| sliding_key(state, window, index))
        })
        .collect()
}

/// The index and end (µs) of `rate`'s window at `now`.
pub(super) fn place(algorithm: Algorithm, rate: &Rate, now: u64) -> (u64, u64) {
    match algorithm {
        Algorithm::SlidingWindow => {
            let window = rate.window_micros();
            let index = now / window;
            (index, (index + 1) * window)
        }
        _ => {
            let (_, index, end) = fixed_window::place(rate, now);
            (index, end)
        }
    }
}

/// The expiry (ms) of a count that stops counting at `end` (µs).
pub(super) fn expiry(end: u64) -> u64 {
    end.div_ceil(1000)
}
