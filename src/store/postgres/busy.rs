//! Keys whose rows were found locked lately. A row another session holds
//! costs its own key ([`StoreError::KeyBusy`](crate::StoreError::KeyBusy),
//! which the circuit breaker does not count); locks met on many keys at
//! once are the table's (an index built, a table altered or locked), and
//! fail as the store failing.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Distinct keys found locked within the window that make it the table's.
const MANY: usize = 3;
/// At most this many recent lock timeouts remembered.
const REMEMBERED: usize = 64;

pub(super) struct Busy {
    /// The keys' hashes and when each was found locked, oldest first.
    recent: Mutex<VecDeque<(u64, Instant)>>,
    /// How long a lock timeout is remembered.
    window: Duration,
    hasher: std::collections::hash_map::RandomState,
}

impl Busy {
    pub(super) fn new(window: Duration) -> Self {
        Self {
            recent: Mutex::new(VecDeque::new()),
            window,
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// `key`'s row was found locked now: whether rows of many keys were
    /// lately (this one among them).
    pub(super) fn many(&self, key: &[u8]) -> bool {
        let hash = self.hasher.hash_one(key);
        let now = Instant::now();
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        while recent
            .front()
            .is_some_and(|&(_, at)| now.duration_since(at) > self.window)
        {
            recent.pop_front();
        }
        if recent.len() == REMEMBERED {
            recent.pop_front();
        }
        recent.push_back((hash, now));
        let mut distinct: Vec<u64> = recent.iter().map(|&(h, _)| h).collect();
        distinct.sort_unstable();
        distinct.dedup();
        distinct.len() >= MANY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_locked_again_and_again_is_its_own_the_third_key_is_the_tables() {
        let busy = Busy::new(Duration::from_secs(60));
        for _ in 0..10 {
            assert!(!busy.many(b"stuck"));
        }
        assert!(!busy.many(b"second"));
        assert!(busy.many(b"third"));
        let forgetful = Busy::new(Duration::ZERO);
        assert!(!forgetful.many(b"a"));
        std::thread::sleep(Duration::from_millis(2));
        assert!(!forgetful.many(b"b"));
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            !forgetful.many(b"c"),
            "each forgotten once its window passed"
        );
    }
}
