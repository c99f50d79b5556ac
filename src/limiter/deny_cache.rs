//! The local deny cache: a key denied until `t` is denied in process until
//! `t`, with no round trip to the store, for stores whose denials are final
//! ([`Store::denials_are_final`](crate::Store::denials_are_final)).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::decision::Decision;
use crate::store::{KeyHasher, bounded_key};

const SHARDS: usize = 16;

/// The default bound on the number of keys the deny cache holds.
pub(crate) const DEFAULT_DENY_CACHE_SIZE: usize = 10_000;

/// The longest a denial is held: an operator's reset, reward or lifted
/// block in another process (which clears only that process's cache)
/// reaches this one within it. A denied flood then costs the store one
/// check per key, process and second.
pub(crate) const MAX_HOLD: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct DenyCache {
    hasher: KeyHasher,
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    per_shard: usize,
}

#[derive(Debug)]
struct Entry {
    until: Instant,
    /// The denial, as of `at`.
    decision: Decision,
    at: Instant,
}

impl DenyCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            hasher: KeyHasher::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let index = (self.hasher.hash(key.as_bytes()) as usize) % SHARDS;
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached denial of `key`, aged to now, if it still holds.
    pub(crate) fn get(&self, key: &str) -> Option<Decision> {
        // Held like the stores hold keys: long ones as a fixed-size hash.
        let key = bounded_key(key);
        let key = key.as_ref();
        let now = Instant::now();
        let mut shard = self.shard(key);
        let entry = shard.get(key)?;
        if entry.until <= now {
            shard.remove(key);
            return None;
        }
        Some(entry.decision.aged(now - entry.at))
    }

    /// Forget the denial of `key` (after an operator reset or reward).
    pub(crate) fn remove(&self, key: &str) {
        let key = bounded_key(key);
        let key = key.as_ref();
        self.shard(key).remove(key);
    }

    /// Remember that `key` is denied until `sent + decision.retry_after()`,
    /// `sent` being when the check was sent: the store decided after that,
    /// so the key cannot be admitted before this deadline. Held at most
    /// [`MAX_HOLD`] from now.
    pub(crate) fn insert(&self, key: &str, decision: &Decision, sent: Instant) {
        let key = bounded_key(key);
        let key = key.as_ref();
        let Some(until) = sent.checked_add(decision.retry_after()) else {
            return;
        };
        let now = Instant::now();
        if until <= now {
            return;
        }
        let until = until.min(now + MAX_HOLD);
        let mut shard = self.shard(key);
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            shard.retain(|_, e| e.until > now);
            if shard.len() >= self.per_shard {
                // Full of live denials: forget the one ending soonest among a few.
                let victim = shard
                    .iter()
                    .take(8)
                    .min_by_key(|(_, e)| e.until)
                    .map(|(k, _)| k.clone());
                if let Some(victim) = victim {
                    shard.remove(&victim);
                }
            }
        }
        shard.insert(
            key.to_owned(),
            Entry {
                until,
                decision: decision.aged(now.saturating_duration_since(sent)),
                at: now,
            },
        );
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{DecisionBuilder, Micros, RateStatus};
    use crate::policy::Rate;
    use std::time::Duration;

    fn denial(wait_ms: u64) -> Decision {
        let mut b = DecisionBuilder::new(false);
        b.rate(RateStatus {
            rate: Rate::per_second(1).unwrap(),
            remaining: 0,
            reset: Micros(wait_ms * 1_000),
            wait: Micros(wait_ms * 1_000),
        });
        b.build().unwrap()
    }

    #[test]
    fn denials_are_held_until_their_deadline_then_dropped() {
        let cache = DenyCache::new(100);
        cache.insert("k", &denial(60), Instant::now());
        let cached = cache.get("k").unwrap();
        assert!(cached.retry_after() <= Duration::from_millis(60));
        assert!(cached.retry_after() > Duration::from_millis(30));
        std::thread::sleep(Duration::from_millis(70));
        assert!(cache.get("k").is_none());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_long_denial_is_held_at_most_a_second() {
        let cache = DenyCache::new(10);
        cache.insert("k", &denial(10_000), Instant::now());
        let held = cache.get("k").expect("held");
        // The denial still says when the key will be admitted.
        assert!(held.retry_after() > Duration::from_secs(9));
        std::thread::sleep(MAX_HOLD + Duration::from_millis(50));
        assert!(
            cache.get("k").is_none(),
            "asked the store again after MAX_HOLD"
        );
    }

    #[test]
    fn a_key_flood_stays_within_the_bound() {
        let cache = DenyCache::new(1_000);
        let now = Instant::now();
        for i in 0..100_000 {
            cache.insert(&format!("k{i}"), &denial(60_000), now);
        }
        assert!(cache.len() <= 1_000 + SHARDS, "{}", cache.len());
    }

    #[test]
    fn long_keys_are_held_hashed() {
        let cache = DenyCache::new(10);
        let long = "x".repeat(100_000);
        cache.insert(&long, &denial(60_000), Instant::now());
        assert!(cache.get(&long).is_some());
        let held: usize = cache
            .shards
            .iter()
            .map(|s| s.lock().unwrap().keys().map(String::len).sum::<usize>())
            .sum();
        assert!(held <= 41, "{held} bytes of keys held");
    }

    #[test]
    fn the_deadline_counts_from_when_the_check_was_sent() {
        let cache = DenyCache::new(10);
        let sent = Instant::now() - Duration::from_millis(50);
        cache.insert("k", &denial(40), sent);
        assert!(cache.get("k").is_none(), "the denial ended 10 ms ago");
    }
}
