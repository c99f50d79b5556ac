//! The keys denied most, per limit, from bounded memory: what the admin
//! router shows an operator as "who is limited right now".
//!
//! Each limit (a rule, or a limiter's name) keeps a Space-Saving sketch
//! (Metwally et al.) of [`CAPACITY`] counters per minute, this minute's and
//! the last: a key denied more often than 1/[`CAPACITY`] of the minute's
//! denials is always in it, and its count is over by at most the smallest
//! count held. A third sketch holds the denials since they were last shared
//! through the store (at most once a second per limit and process), so
//! that every process's denials add up there.
//!
//! Nothing is counted, and the store is sent nothing, until the limits are
//! operated: an admin router built on them, or a call of
//! [`Limiter::most_denied`](crate::Limiter::most_denied). A limiter nobody
//! watches pays one atomic load per denial.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Counters per sketch.
pub(crate) const CAPACITY: usize = 32;
/// How often a process shares a limit's denials through the store, at most.
pub(crate) const SHARE_EVERY: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);

/// The sketches of every limit of a limiter and the limiters derived from
/// it (a rule set's), found by the limit's name: a rule's sketch outlives a
/// reload of the rules.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    limits: Mutex<HashMap<Arc<str>, Arc<Denials>>>,
    /// Whether denials are counted (and shared).
    watched: Arc<AtomicBool>,
}

impl Registry {
    /// The sketch of the limit `name`.
    pub(crate) fn of(&self, name: &Arc<str>) -> Arc<Denials> {
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(limits.entry(Arc::clone(name)).or_insert_with(|| {
            Arc::new(Denials {
                state: Mutex::default(),
                watched: Arc::clone(&self.watched),
            })
        }))
    }

    /// Count the denials of every limit of this registry from now on.
    pub(crate) fn watch(&self) {
        self.watched.store(true, Ordering::Relaxed);
    }
}

/// The denials of one limit.
#[derive(Debug, Default)]
pub(crate) struct Denials {
    state: Mutex<State>,
    watched: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct State {
    /// When this minute began (`None`: nothing counted yet).
    minute_started: Option<Instant>,
    this_minute: Sketch,
    last_minute: Sketch,
    /// Since the last share.
    unshared: Sketch,
    last_shared: Option<Instant>,
}

impl Denials {
    /// Count one denial of `key` at `now`. Returns the denials to share
    /// through the store when a share is due.
    pub(crate) fn record(&self, key: &str, now: Instant) -> Option<Vec<(String, u64)>> {
        if !self.watched.load(Ordering::Relaxed) {
            return None;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.roll(now);
        state.this_minute.add(key, 1);
        state.unshared.add(key, 1);
        let due = state
            .last_shared
            .is_none_or(|at| now.saturating_duration_since(at) >= SHARE_EVERY);
        if !due {
            return None;
        }
        state.last_shared = Some(now);
        Some(std::mem::take(&mut state.unshared).into_counts())
    }

    /// The denials not shared yet (taken: they are shared now).
    pub(crate) fn take_unshared(&self) -> Vec<(String, u64)> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut state.unshared).into_counts()
    }

    /// This process's keys denied most over this minute and the last, most
    /// first.
    pub(crate) fn top(&self, now: Instant) -> Vec<(String, u64)> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.roll(now);
        let mut merged = state.last_minute.clone();
        for counter in &state.this_minute.counters {
            merged.add(&counter.key, counter.count);
        }
        merged.into_counts()
    }
}

impl State {
    /// Move to the minute holding `now`.
    fn roll(&mut self, now: Instant) {
        let Some(started) = self.minute_started else {
            self.minute_started = Some(now);
            return;
        };
        let elapsed = now.saturating_duration_since(started);
        if elapsed < MINUTE {
            return;
        }
        self.last_minute = if elapsed < 2 * MINUTE {
            std::mem::take(&mut self.this_minute)
        } else {
            self.this_minute = Sketch::default();
            Sketch::default()
        };
        // Denials not shared by now belong to a minute that is over: shared
        // later, they would be counted in the wrong one.
        self.unshared = Sketch::default();
        self.minute_started = Some(now);
    }
}

/// A Space-Saving sketch of at most [`CAPACITY`] counters.
#[derive(Debug, Default, Clone)]
struct Sketch {
    counters: Vec<Counter>,
}

#[derive(Debug, Clone)]
struct Counter {
    key: Box<str>,
    count: u64,
}

impl Sketch {
    /// Count `n` more of `key`: its counter, a free one, or the smallest
    /// one's, taken over (Space-Saving's step).
    fn add(&mut self, key: &str, n: u64) {
        if let Some(counter) = self.counters.iter_mut().find(|c| &*c.key == key) {
            counter.count += n;
            return;
        }
        if self.counters.len() < CAPACITY {
            self.counters.push(Counter {
                key: key.into(),
                count: n,
            });
            return;
        }
        if let Some(smallest) = self.counters.iter_mut().min_by_key(|c| c.count) {
            smallest.key = key.into();
            smallest.count += n;
        }
    }

    /// The counts, most first.
    fn into_counts(self) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = self
            .counters
            .into_iter()
            .map(|c| (c.key.into(), c.count))
            .collect();
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched() -> Arc<Denials> {
        let registry = Registry::default();
        registry.watch();
        registry.of(&Arc::from("limit"))
    }

    #[test]
    fn nothing_is_counted_until_watched() {
        let registry = Registry::default();
        let denials = registry.of(&Arc::from("limit"));
        assert_eq!(denials.record("a", Instant::now()), None);
        assert!(denials.top(Instant::now()).is_empty());
        registry.watch();
        assert!(denials.record("a", Instant::now()).is_some());
    }

    #[test]
    fn a_heavy_hitter_is_kept_among_many_keys() {
        let denials = watched();
        let start = Instant::now();
        // 10,000 keys denied once each, one key denied 2,000 times among them.
        for i in 0..10_000 {
            denials.record(&format!("k{i}"), start);
            if i % 5 == 0 {
                denials.record("flooder", start);
            }
        }
        let top = denials.top(start);
        assert!(top.len() <= CAPACITY);
        assert_eq!(top[0].0, "flooder");
        // Over by at most the smallest count held: 12,000 / 32 = 375.
        assert!((2_000..=2_375).contains(&top[0].1), "{top:?}");
    }

    #[test]
    fn minutes_roll_and_age_out() {
        let denials = watched();
        let start = Instant::now();
        for _ in 0..3 {
            denials.record("a", start);
        }
        denials.record("b", start + Duration::from_secs(61));
        assert_eq!(
            denials.top(start + Duration::from_secs(62)),
            vec![("a".to_owned(), 3), ("b".to_owned(), 1)]
        );
        // Two minutes on, "a" is gone; three, everything.
        assert_eq!(
            denials.top(start + Duration::from_secs(122)),
            vec![("b".to_owned(), 1)]
        );
        assert!(denials.top(start + Duration::from_secs(300)).is_empty());
    }

    #[test]
    fn shares_come_at_most_once_a_second_with_what_came_since() {
        let denials = watched();
        let start = Instant::now();
        assert_eq!(denials.record("a", start), Some(vec![("a".to_owned(), 1)]));
        assert_eq!(
            denials.record("a", start + Duration::from_millis(500)),
            None
        );
        assert_eq!(
            denials.record("b", start + Duration::from_millis(900)),
            None
        );
        assert_eq!(
            denials.record("a", start + Duration::from_millis(1_000)),
            Some(vec![("a".to_owned(), 2), ("b".to_owned(), 1)])
        );
        assert!(denials.take_unshared().is_empty());
    }
}
