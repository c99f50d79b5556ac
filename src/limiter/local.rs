//! Local-first limiting of hot keys ([`LocalQuota`]): each process takes a
//! batch of a key's quota from the store at once and admits from it
//! locally, so a hot key costs the store one check per batch.
//!
//! When the store cannot give a whole batch, the check falls back to an
//! ordinary check of one request, and the key's checks stay checks of one
//! request until that refusal's wait ends (at most `hold`). A local
//! admission carries the decision of the check that took the batch.
//! `block`, `reset` and `penalty` through the limiter drop what this
//! process holds of the key (other processes use theirs for at most
//! `hold`). A batch is never asked of a fallback store, nor while the
//! circuit is open; one taken by a check cancelled before its answer is
//! spent unused. Units are held per limiter name.
//!
//! Making room for a new key costs a check the same whatever the keys held
//! (a bounded look at the oldest keys of one of 16 shards, each with its
//! own lock), so a flood of distinct keys slows neither new keys nor the
//! hot keys held.
//!
//! The bound per algorithm: under the sliding log at most `max + N ×
//! batch` in any window (a unit counted at `t` and used until `t + hold`
//! can leave the store's window before the request it admitted does);
//! under GCRA and the sliding window counter `N × batch` more than their
//! own bursts (each alone can admit up to `2 × max − 1` in one sliding
//! window); under the fixed window none more (a unit is only used in the
//! window that counted it).

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use hashbrown::HashTable;

use super::{Check, DecidedBy, Limiter, Verdict};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy, PolicyError, Rate};

/// How a [`Limiter`] admits hot keys locally
/// ([`Limiter::with_local_quota`]): a check of a key this process holds no
/// units of takes `batch` units from the store in one check, admits this
/// request and keeps the rest; the next checks of the key take a kept unit
/// with no round trip. Kept units are used within `hold`, then dropped,
/// still counted. A key near its limit is decided in the store, request by
/// request.
///
/// **The bound.** Every unit was counted in the store before it is used:
/// with `N` processes, at most `N × batch` more requests are admitted in
/// any window than the algorithm alone admits (none more under the fixed
/// window). A process holds units of at most 10,000 keys per limiter; past
/// that a key is checked in the store as without a local quota. The
/// [production guide](crate::guide::production) says when to use it and
/// how to choose `batch` and `hold`.
///
/// ```
/// use tower_redis_ratelimit::limiter::LocalQuota;
/// use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};
///
/// let quota: LocalQuota = "100/250ms".parse()?; // batches of 100, each used within 250 ms
/// let limiter = Limiter::new(MemoryStore::new(), "10000/s".parse::<Policy>()?).with_local_quota(quota)?;
/// # let _ = limiter;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalQuota {
    batch: u64,
    hold: Duration,
}

impl LocalQuota {
    /// Take `batch` requests' worth of quota at a time (`batch` × the
    /// policy's cost units, lowered to the policy's smallest max), each
    /// used within `hold` of being taken.
    ///
    /// # Errors
    /// A batch under 2 (nothing would be kept), or a `hold` of zero or
    /// longer than [`MAX_WINDOW`](crate::policy::MAX_WINDOW).
    pub fn new(batch: u64, hold: Duration) -> Result<Self, PolicyError> {
        if batch < 2 {
            return Err(PolicyError::Invalid {
                input: batch.to_string(),
                reason: "a local quota's batch must be at least 2 units".to_owned(),
            });
        }
        if hold.is_zero() || hold > crate::policy::MAX_WINDOW {
            return Err(PolicyError::Invalid {
                input: format!("{hold:?}"),
                reason: "a local quota's hold must be longer than zero and at most MAX_WINDOW"
                    .to_owned(),
            });
        }
        Ok(Self { batch, hold })
    }

    /// Units taken from the store at once.
    pub fn batch(&self) -> u64 {
        self.batch
    }

    /// How long taken units may be used.
    pub fn hold(&self) -> Duration {
        self.hold
    }

    /// The units one batch takes under `policy`: `batch` requests at the
    /// policy's cost, at most its smallest max.
    ///
    /// # Errors
    /// A policy this quota cannot serve: a concurrency limit, a minimum
    /// spacing, or a smallest max that holds fewer than two requests.
    pub(crate) fn batch_for(&self, policy: &Policy) -> Result<u64, PolicyError> {
        let unsupported = |what| PolicyError::Unsupported {
            algorithm: policy.algorithm(),
            what,
        };
        if policy.algorithm() == Algorithm::Concurrency {
            return Err(unsupported(
                "a local quota (a slot is one request in flight)",
            ));
        }
        if policy.min_spacing().is_some() {
            return Err(unsupported(
                "a local quota with a minimum spacing (local units would not be spaced)",
            ));
        }
        // Whole requests at the policy's cost, at most the smallest max.
        let cost = policy.cost();
        let smallest = policy.rates().iter().map(|r| r.max()).min().unwrap_or(1);
        let requests = self
            .batch
            .min(smallest / cost)
            .min(crate::policy::MAX_COST / cost);
        if requests < 2 {
            return Err(PolicyError::Invalid {
                input: policy.to_string(),
                reason: "a local quota's batch must hold at least two requests at the \
                         policy's cost within its smallest max"
                    .to_owned(),
            });
        }
        Ok(requests * cost)
    }
}

/// `"100/250ms"`: batches of 100 units, each used within 250 ms (the form
/// of `LOCAL_QUOTA` in the example server and of a rule's `local_quota`).
impl FromStr for LocalQuota {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rate: Rate = s.parse().map_err(|_| PolicyError::Invalid {
            input: s.trim().to_owned(),
            reason: "write a local quota as the batch and how long its units are used, \
                     such as \"100/250ms\""
                .to_owned(),
        })?;
        Self::new(rate.max(), rate.window())
    }
}

/// At most this many keys are held locally; past it, keys are checked in
/// the store as without a local quota.
const MAX_LOCAL_KEYS: usize = 10_000;
/// The held keys are split over this many shards, each with a lock of its
/// own and at most `MAX_LOCAL_KEYS / SHARDS` keys.
const SHARDS: usize = 16;
const MAX_KEYS_PER_SHARD: usize = MAX_LOCAL_KEYS / SHARDS;
/// How many held keys, oldest first, a new key looks at to make room in a
/// full shard: the cost of a key past the bound does not grow with the
/// keys held.
const EVICTION_TRIES: usize = 4;

/// The units of each key this process holds.
pub(crate) struct Local {
    config: LocalQuota,
    /// The batch for this limiter's policy.
    batch: u64,
    hasher: RandomState,
    shards: Box<[Mutex<Shard>]>,
}

/// Some of the held keys.
#[derive(Default)]
struct Shard {
    /// Found by the key's hash (computed once per check).
    keys: HashTable<Held>,
    /// The held keys, oldest first: where room is made. A key looked at
    /// and kept goes to the back; an entry whose key was forgotten is
    /// dropped when it comes up.
    order: VecDeque<(u64, Weak<tokio::sync::Mutex<Units>>)>,
}

struct Held {
    key: Box<str>,
    units: Arc<tokio::sync::Mutex<Units>>,
}

impl Shard {
    /// Make room for one more key by dropping a held key that holds
    /// nothing usable and that no check is using, looking at no more than
    /// [`EVICTION_TRIES`] keys; false when none of them could go.
    fn make_room(&mut self, now: Instant) -> bool {
        for _ in 0..EVICTION_TRIES {
            let Some((hash, weak)) = self.order.pop_front() else {
                return false;
            };
            // Forgotten (and no check holds it any more): nothing to drop.
            let Some(units) = weak.upgrade() else {
                continue;
            };
            let Ok(found) = self
                .keys
                .find_entry(hash, |held| Arc::ptr_eq(&held.units, &units))
            else {
                // Forgotten, and a check still finishing with it.
                continue;
            };
            // The table's reference and this one: more is a check in flight.
            let idle = Arc::strong_count(&units) == 2
                && units.try_lock().is_ok_and(|held| !held.usable(now));
            if idle {
                found.remove();
                return true;
            }
            self.order.push_back((hash, weak));
        }
        false
    }

    /// Drop the entries of forgotten keys from `order` once it is twice
    /// the shard's bound (amortised: one pass per that many forgets).
    fn compact(&mut self) {
        if self.order.len() < 2 * MAX_KEYS_PER_SHARD {
            return;
        }
        let keys = &self.keys;
        self.order.retain(|(hash, weak)| {
            weak.upgrade().is_some_and(|units| {
                keys.find(*hash, |held| Arc::ptr_eq(&held.units, &units))
                    .is_some()
            })
        });
    }
}

#[derive(Default)]
struct Units {
    left: u64,
    until: Option<Instant>,
    /// Until when the store could not give a whole batch: checks of one
    /// request meanwhile, without asking for a batch first.
    no_batch_until: Option<Instant>,
    /// The decision of the check that took them (what a local admission
    /// shows: the headers stay those of that check while its units last).
    decision: Option<Decision>,
    /// The verdict of the batch just taken, for the check that took it.
    batch_verdict: Option<Verdict>,
}

impl Units {
    /// Whether the store could not give a batch lately.
    fn batch_refused(&self) -> bool {
        self.no_batch_until.is_some_and(|t| Instant::now() < t)
    }

    /// Whether these units still matter at `now`: some left to use, or a
    /// refused batch still waited out.
    fn usable(&self, now: Instant) -> bool {
        self.left > 0 && self.until.is_some_and(|t| now < t)
            || self.no_batch_until.is_some_and(|t| now < t)
    }

    /// Take one kept unit, if any is still usable.
    fn take(&mut self) -> Option<Verdict> {
        if self.left == 0 || self.until.is_none_or(|until| Instant::now() >= until) {
            self.left = 0;
            return None;
        }
        self.left -= 1;
        Some(Verdict::without_permit(
            self.decision.clone(),
            DecidedBy::LocalQuota,
        ))
    }
}

impl Local {
    pub(crate) fn new(config: LocalQuota, policy: &Policy) -> Result<Self, PolicyError> {
        Ok(Self {
            config,
            batch: config.batch_for(policy)?,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        })
    }

    /// The same quota, holding no units (for a limiter of another name:
    /// units are counted under a name, and only usable under it).
    pub(crate) fn fresh(&self) -> Self {
        Self {
            config: self.config,
            batch: self.batch,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    pub(crate) fn config(&self) -> LocalQuota {
        self.config
    }

    /// The hash of `key` and its shard, locked.
    fn shard_of(&self, key: &str) -> (u64, std::sync::MutexGuard<'_, Shard>) {
        let hash = self.hasher.hash_one(key);
        // Bits 32 and up: not the bucket bits nor hashbrown's top-7 tag.
        let shard = &self.shards[(hash >> 32) as usize % SHARDS];
        (hash, shard.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Drop what this process holds of `key` (a command changed it in the
    /// store: a block, a reset, a penalty).
    pub(crate) fn forget(&self, key: &str) {
        let (hash, mut shard) = self.shard_of(key);
        if let Ok(found) = shard.keys.find_entry(hash, |held| &*held.key == key) {
            found.remove();
        }
    }

    /// How many keys this process holds units (or a refusal) of.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .keys
                    .len()
            })
            .sum()
    }

    /// The units of `key`, held from now on if they were not; `None` when
    /// its shard is full of keys that still matter (then `key` is checked
    /// in the store as without a local quota).
    fn units_of(&self, key: &str) -> Option<Arc<tokio::sync::Mutex<Units>>> {
        let (hash, mut shard) = self.shard_of(key);
        if let Some(held) = shard.keys.find(hash, |held| &*held.key == key) {
            return Some(Arc::clone(&held.units));
        }
        if shard.keys.len() >= MAX_KEYS_PER_SHARD && !shard.make_room(Instant::now()) {
            return None;
        }
        let units = Arc::new(tokio::sync::Mutex::new(Units::default()));
        let hasher = &self.hasher;
        shard.keys.insert_unique(
            hash,
            Held {
                key: key.into(),
                units: Arc::clone(&units),
            },
            |held| hasher.hash_one(&*held.key),
        );
        shard.order.push_back((hash, Arc::downgrade(&units)));
        shard.compact();
        Some(units)
    }

    /// The check of `key` (as given, not namespaced) at the policy's cost.
    pub(crate) fn check(self: &Arc<Self>, limiter: &Limiter, key: String) -> Check {
        let Some(units) = self.units_of(&key) else {
            return limiter.start_in_store(key, None);
        };
        if let Ok(mut held) = units.try_lock() {
            if let Some(verdict) = held.take() {
                return Check::done(limiter.counted(&key, Ok(verdict)));
            }
            if held.batch_refused() {
                // Near the limit: ordinary checks, side by side (the deny
                // cache answers them there).
                drop(held);
                return limiter.start_in_store(key, None);
            }
        }
        // Before waiting for a refill: a key this process holds a denial
        // for is denied without asking. (After the units: a key holding
        // units has no denial here, and a local admission allocates
        // nothing.)
        if let Some(denied) = limiter.cached_denial(&key) {
            let verdict = Ok(Verdict::without_permit(Some(denied), DecidedBy::DenyCache));
            return Check::done(limiter.counted(&key, verdict));
        }
        let (local, limiter) = (Arc::clone(self), limiter.clone());
        Check::boxed(Box::pin(async move {
            // One refill at a time per key: the others wait for its units.
            let mut held = units.lock().await;
            if let Some(verdict) = held.take() {
                return limiter.counted(&key, Ok(verdict));
            }
            if !held.batch_refused()
                && local.refill(&limiter, &key, &mut held).await
                && let Some(verdict) = held.batch_verdict.take()
            {
                return limiter.counted(&key, Ok(verdict));
            }
            // No batch: one request, outside the lock, like any check.
            drop(held);
            limiter.start_in_store(key, None).await
        }))
    }

    /// Ask the store for a batch of `key`: true (its verdict in
    /// `held.batch_verdict`) when the store gave one; false when it could
    /// not (a denial: no batch until that denial's wait ends, at most
    /// `hold`) or failed (the caller's check of one request then meets the
    /// fail mode, as without a local quota).
    async fn refill(&self, limiter: &Limiter, key: &str, held: &mut Units) -> bool {
        if limiter.circuit_open() {
            return false;
        }
        let Ok(policy) = limiter.policy().clone().with_cost(self.batch) else {
            return false;
        };
        // A batch is asked for failing closed: a store failure must not
        // charge a batch to the fallback store nor admit one unlimited.
        // Uncounted: the request the batch is asked for is counted by the
        // verdict it gets.
        let strict = limiter
            .clone()
            .with_fail_mode(super::FailMode::Closed)
            .uncounted();
        // Before the store decided: what the store's times are counted
        // from is later, so the units never outlive their window.
        let sent = Instant::now();
        let Ok(verdict) = strict
            .start_in_store(key.to_owned(), Some(Arc::new(policy)))
            .await
        else {
            return false;
        };
        if !verdict.allowed() {
            let wait = verdict.retry_after().min(self.config.hold);
            held.no_batch_until = sent.checked_add(wait);
            return false;
        }
        let decision = verdict.decision().cloned();
        let mut until = sent.checked_add(self.config.hold);
        if let Some(d) = &decision
            && d.algorithm() == Algorithm::FixedWindow
        {
            // Used only in the window that counted them.
            let window_left = d
                .rates()
                .iter()
                .map(|r| r.reset())
                .min()
                .unwrap_or_default();
            until = until.min(sent.checked_add(window_left));
        }
        let cost = limiter.policy().cost();
        held.left = (self.batch - cost) / cost;
        held.until = until;
        held.decision = decision;
        held.batch_verdict = Some(verdict);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hold usable units of `key`, as a batch just taken would; false when
    /// the key is checked in the store instead.
    fn hold(local: &Local, key: &str, hold: Duration) -> bool {
        let Some(units) = local.units_of(key) else {
            return false;
        };
        let mut units = units.try_lock().unwrap();
        units.left = 5;
        units.until = Some(Instant::now() + hold);
        true
    }

    #[test]
    fn the_keys_held_stay_bounded_and_expired_ones_make_room() {
        let hold_for = Duration::from_millis(300);
        let quota = LocalQuota::new(10, hold_for).unwrap();
        let local = Local::new(quota, &"1000/s".parse().unwrap()).unwrap();
        let held = (0..2 * MAX_LOCAL_KEYS)
            .filter(|i| hold(&local, &format!("k{i}"), hold_for))
            .count();
        assert_eq!(local.held(), MAX_LOCAL_KEYS, "every shard full, none over");
        assert!(held >= MAX_LOCAL_KEYS, "{held}");
        // Past the bound a key is not held, and no held key was dropped
        // for it while its units last.
        assert!(!hold(&local, "one more", hold_for));
        assert_eq!(local.held(), MAX_LOCAL_KEYS);

        // Once the units ran out, new keys take their places.
        std::thread::sleep(hold_for + Duration::from_millis(100));
        let newer = (0..MAX_LOCAL_KEYS / 2)
            .filter(|i| hold(&local, &format!("new{i}"), hold_for))
            .count();
        assert_eq!(newer, MAX_LOCAL_KEYS / 2);
        assert_eq!(local.held(), MAX_LOCAL_KEYS);
    }

    #[test]
    fn a_key_in_use_is_not_dropped_to_make_room() {
        let hold_for = Duration::from_secs(60);
        let local = Local::new(
            LocalQuota::new(10, hold_for).unwrap(),
            &"1000/s".parse().unwrap(),
        )
        .unwrap();
        // Units nobody uses, of no value: any may go to make room...
        let in_use: Vec<_> = (0..2 * MAX_LOCAL_KEYS)
            .filter_map(|i| local.units_of(&format!("k{i}")))
            .collect();
        assert_eq!(in_use.len(), MAX_LOCAL_KEYS);
        // ...but every one is held by a check in flight.
        assert!(local.units_of("another").is_none());
        drop(in_use);
        assert!(local.units_of("another").is_some());
    }

    #[test]
    fn forgotten_keys_do_not_grow_the_order_of_a_shard() {
        let hold_for = Duration::from_secs(60);
        let local = Local::new(
            LocalQuota::new(10, hold_for).unwrap(),
            &"1000/s".parse().unwrap(),
        )
        .unwrap();
        for _ in 0..5 {
            for i in 0..MAX_LOCAL_KEYS / 4 {
                let key = format!("k{i}");
                assert!(hold(&local, &key, hold_for));
                local.forget(&key);
            }
        }
        for shard in local.shards.iter() {
            let shard = shard.lock().unwrap();
            assert!(
                shard.order.len() <= 2 * MAX_KEYS_PER_SHARD,
                "{}",
                shard.order.len()
            );
            assert!(shard.keys.is_empty());
        }
    }
}
