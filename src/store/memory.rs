//! [`MemoryStore`]: the sliding log in process memory.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::decision::{Decision, DecisionBuilder, RateState};
use crate::policy::{Policy, duration_micros};
use crate::store::{Store, StoreError, bounded_key};

const SHARDS: usize = 16;
/// Every this many operations, one shard (in turn) drops its idle keys: each
/// shard is swept every `SWEEP_STRIDE * SHARDS` operations.
const SWEEP_STRIDE: u64 = 1024;
/// How many keys are looked at to pick one to evict when the store is full.
const EVICTION_SAMPLE: usize = 8;

/// The default bound on the number of keys a [`MemoryStore`] holds.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// Rate limits held in this process: for one process, for tests, and as a
/// fallback. The same sliding-log semantics as
/// [`RedisStore`](crate::RedisStore), decided on an injectable [`Clock`].
///
/// Memory is bounded: keys longer than
/// [`MAX_RAW_KEY_LEN`](crate::store::MAX_RAW_KEY_LEN) bytes are held as a
/// fixed-size hash, keys whose entries have all left the longest window
/// are dropped, and when more than `max_keys` keys are active the least
/// recently used of a small sample is evicted (as Redis's approximate LRU
/// does), which forgets that key's history.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::{ManualClock, MemoryStore, Policy, Store};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let clock = ManualClock::new(Duration::from_secs(1_000));
/// let store = MemoryStore::with_clock(clock.clone());
/// let policy: Policy = "2/s".parse()?;
/// assert!(store.check("k", &policy).await?.allowed());
/// assert!(store.check("k", &policy).await?.allowed());
/// let denied = store.check("k", &policy).await?;
/// assert!(!denied.allowed());
/// clock.advance(denied.retry_after());
/// assert!(store.check("k", &policy).await?.allowed());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    clock: Arc<dyn Clock>,
    hasher: RandomState,
    shards: Box<[Mutex<Shard>]>,
    max_keys_per_shard: usize,
    ops: AtomicU64,
}

#[derive(Debug, Default)]
struct Shard {
    keys: HashMap<Box<str>, Log>,
    inserts_since_sweep: u64,
}

#[derive(Debug, Default)]
struct Log {
    /// Entry timestamps in microseconds, oldest first; one per unit of cost.
    entries: VecDeque<u64>,
    /// How long this key's entries matter (the longest window it was checked with).
    horizon: u64,
}

impl MemoryStore {
    /// A store on the system clock holding at most [`DEFAULT_MAX_KEYS`] keys.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::new())
    }

    /// A store on `clock`.
    pub fn with_clock(clock: impl Clock) -> Self {
        Self::build(Arc::new(clock), DEFAULT_MAX_KEYS)
    }

    /// Hold at most `max_keys` keys (at least one per internal shard).
    /// Set it before use: the store returned starts empty.
    #[must_use]
    pub fn with_max_keys(self, max_keys: usize) -> Self {
        Self::build(Arc::clone(&self.inner.clock), max_keys)
    }

    fn build(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Self {
            inner: Arc::new(Inner {
                clock,
                hasher: RandomState::new(),
                shards,
                max_keys_per_shard: max_keys.div_ceil(SHARDS).max(1),
                ops: AtomicU64::new(0),
            }),
        }
    }

    /// How many keys the store holds now.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).keys.len())
            .sum()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Take the decision synchronously (the [`Store`] impl calls this).
    pub fn check_now(&self, key: &str, policy: &Policy) -> Decision {
        let key = bounded_key(key);
        let key = key.as_ref();
        let now = duration_micros(self.inner.clock.now());
        let op = self.inner.ops.fetch_add(1, Ordering::Relaxed);
        if op % SWEEP_STRIDE == SWEEP_STRIDE - 1 {
            self.sweep_one((op / SWEEP_STRIDE) as usize % SHARDS, now);
        }
        let index = (self.inner.hasher.hash_one(key) as usize) % SHARDS;
        let mut shard = self.inner.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let horizon = duration_micros(policy.longest_window());
        if let Some(log) = shard.keys.get_mut(key) {
            log.horizon = log.horizon.max(horizon);
            return check_log(&mut log.entries, now, policy);
        }
        if shard.keys.len() >= self.inner.max_keys_per_shard {
            shard.make_room(now, self.inner.max_keys_per_shard);
        }
        let mut log = Log {
            entries: VecDeque::new(),
            horizon,
        };
        let decision = check_log(&mut log.entries, now, policy);
        if !log.entries.is_empty() {
            shard.keys.insert(key.into(), log);
            shard.inserts_since_sweep += 1;
        }
        decision
    }

    /// Sweep one shard, unless another thread holds it (it will be swept on
    /// a later turn).
    fn sweep_one(&self, index: usize, now: u64) {
        match self.inner.shards[index].try_lock() {
            Ok(mut shard) => shard.sweep(now),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner().sweep(now),
            Err(TryLockError::WouldBlock) => {}
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Store for MemoryStore {
    async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
        Ok(self.check_now(key, policy))
    }
}

impl Shard {
    /// Drop every key whose entries have all left its longest window.
    fn sweep(&mut self, now: u64) {
        self.inserts_since_sweep = 0;
        self.keys.retain(|_, log| {
            log.entries
                .back()
                .is_some_and(|&newest| newest.saturating_add(log.horizon) > now)
        });
    }

    /// Make room for one more key.
    fn make_room(&mut self, now: u64, max: usize) {
        // A full sweep is O(keys): do one only if many keys came since the
        // last, so a flood of new keys costs O(1) per key.
        if self.inserts_since_sweep >= (max as u64 / 2).max(1) {
            self.sweep(now);
        }
        while self.keys.len() >= max {
            let victim = self
                .keys
                .iter()
                .take(EVICTION_SAMPLE)
                .min_by_key(|(_, log)| log.entries.back().copied().unwrap_or(0))
                .map(|(key, _)| key.clone());
            match victim {
                Some(key) => {
                    self.keys.remove(&key);
                }
                None => break,
            }
        }
    }
}

/// The sliding log: decide one request at `now` (microseconds) on `entries`
/// (timestamps, oldest first). Admitted requests add `cost` entries; denied
/// requests change nothing but the trimming of dead entries.
pub(crate) fn check_log(entries: &mut VecDeque<u64>, now: u64, policy: &Policy) -> Decision {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn idle_keys_are_swept_and_the_key_count_is_bounded() {
        let clock = ManualClock::new(Duration::from_secs(1_000));
        let store = MemoryStore::with_clock(clock.clone()).with_max_keys(160);
        let policy: Policy = "5/s".parse().unwrap();
        for i in 0..10_000 {
            store.check_now(&format!("k{i}"), &policy);
            assert!(store.len() <= 160);
        }
        assert!(store.len() >= 150, "{}", store.len());
        // Every key goes idle; enough operations later they are gone.
        clock.advance(Duration::from_secs(2));
        for _ in 0..SWEEP_STRIDE * SHARDS as u64 {
            store.check_now("busy", &policy);
        }
        assert!(store.len() <= 16, "{}", store.len());
    }
}
