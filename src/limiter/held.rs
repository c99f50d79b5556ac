//! The units of a local quota this process holds ([`Held`]): per count
//! (a limiter's name; a rule's tiers and reloads share one), per key, in
//! shards of a bounded number of keys, each key's units behind a lock of
//! their own, and what a batch's units may do ([`Units`]).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use hashbrown::HashTable;

use super::{DecidedBy, Verdict};
use crate::decision::{Decision, RefundId};
use crate::policy::Policy;
use crate::store::KeyHasher;

/// At most this many keys are held locally; past it, keys are checked in
/// the store as without a local quota.
pub(super) const MAX_LOCAL_KEYS: usize = 10_000;
/// The held keys are split over this many shards, each with a lock of its
/// own and at most `MAX_LOCAL_KEYS / SHARDS` keys.
const SHARDS: usize = 16;
pub(super) const MAX_KEYS_PER_SHARD: usize = MAX_LOCAL_KEYS / SHARDS;
/// How many held keys, oldest first, a new key looks at to make room in a
/// full shard: the cost of a key past the bound does not grow with the
/// keys held.
const EVICTION_TRIES: usize = 4;

/// The units this process holds of one count, by key.
pub(crate) struct Held {
    hasher: KeyHasher,
    pub(super) shards: Box<[Mutex<Shard>]>,
}

impl Held {
    pub(super) fn new() -> Self {
        Self {
            hasher: KeyHasher::new(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    /// The hash of `key` and its shard, locked.
    fn shard_of(&self, key: &str) -> (u64, std::sync::MutexGuard<'_, Shard>) {
        let hash = self.hasher.hash(key.as_bytes());
        // Bits 32 and up: not the bucket bits nor hashbrown's top-7 tag.
        let shard = &self.shards[(hash >> 32) as usize % SHARDS];
        (hash, shard.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Drop what this process holds of `key` (a command changed it in the
    /// store: a block, a reset, a penalty), giving nothing back.
    pub(super) fn forget(&self, key: &str) {
        let (hash, mut shard) = self.shard_of(key);
        if let Ok(found) = shard.keys.find_entry(hash, |held| &*held.key == key) {
            let (held, _) = found.remove();
            // A batch's return still on its way finds nothing left. (A
            // refill under way when this runs holds the lock: its units
            // were taken after the command, and are this count's.)
            if let Ok(mut units) = held.units.try_lock() {
                units.left = 0;
                units.batch += 1;
                units.cancel_return();
            }
        }
    }

    /// How many keys this process holds units (or a refusal) of, and the
    /// bytes of those keys.
    #[cfg(test)]
    pub(super) fn count(&self) -> (usize, usize) {
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
                let bytes: usize = shard.keys.iter().map(|held| held.key.len()).sum();
                (shard.keys.len(), bytes)
            })
            .fold((0, 0), |(n, b), (sn, sb)| (n + sn, b + sb))
    }

    /// The units of `key`, held from now on if they were not; `None` when
    /// its shard is full of keys that still matter (then `key` is checked
    /// in the store as without a local quota).
    pub(super) fn units_of(&self, key: &str) -> Option<Arc<tokio::sync::Mutex<Units>>> {
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
            HeldKey {
                key: key.into(),
                units: Arc::clone(&units),
            },
            |held| hasher.hash(held.key.as_bytes()),
        );
        shard.order.push_back((hash, Arc::downgrade(&units)));
        shard.compact();
        Some(units)
    }
}

/// The units held of every count of a limiter and of the limiters derived
/// from it (a rule set's), found by the count's name.
#[derive(Default)]
pub(crate) struct Registry {
    counts: Mutex<HashMap<Arc<str>, Weak<Held>>>,
}

impl Registry {
    /// The units held of the count `name`.
    pub(super) fn of(&self, name: &str) -> Arc<Held> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = counts.get(name).and_then(Weak::upgrade) {
            return held;
        }
        // Names of counts no limiter uses any more go as new ones come.
        counts.retain(|_, held| held.strong_count() > 0);
        let held = Arc::new(Held::new());
        counts.insert(Arc::from(name), Arc::downgrade(&held));
        held
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// Some of the held keys.
#[derive(Default)]
pub(super) struct Shard {
    /// Found by the key's hash (computed once per check).
    pub(super) keys: HashTable<HeldKey>,
    /// The held keys, oldest first: where room is made. A key looked at
    /// and kept goes to the back; an entry whose key was forgotten is
    /// dropped when it comes up.
    pub(super) order: VecDeque<(u64, Weak<tokio::sync::Mutex<Units>>)>,
}

pub(super) struct HeldKey {
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
pub(super) struct Units {
    pub(super) left: u64,
    pub(super) until: Option<Instant>,
    /// The policy the units were taken under: usable only by checks of an
    /// equal one (a rule's tiers share the units of a count, not each
    /// other's maxes).
    pub(super) policy: Option<Arc<Policy>>,
    /// Counts the batches taken: a batch's return finds whether its units
    /// are still the ones held.
    pub(super) batch: u64,
    /// Until when units left unused may go back to the store: a window
    /// counter's, until shortly before the window that counted them ends
    /// (given back later they would come off the next one); `None`:
    /// always.
    pub(super) return_by: Option<Instant>,
    /// The task that gives back what is left when the batch expires
    /// (aborted once nothing is left to give back).
    pub(super) return_task: Option<tokio::task::AbortHandle>,
    /// The refund id of the batch's check (the sliding log's entries).
    pub(super) refund_id: Option<RefundId>,
    /// Until when the store could not give a whole batch: checks of one
    /// request meanwhile, without asking for a batch first.
    pub(super) no_batch_until: Option<Instant>,
    /// The decision of the check that took them (what a local admission
    /// shows: the headers stay those of that check while its units last).
    pub(super) decision: Option<Decision>,
    /// The verdict of the batch just taken, for the check that took it.
    pub(super) batch_verdict: Option<Verdict>,
}

impl Units {
    /// Whether the store could not give a batch lately.
    pub(super) fn batch_refused(&self) -> bool {
        self.no_batch_until.is_some_and(|t| Instant::now() < t)
    }

    /// Whether these units still matter at `now`: some left to use, or a
    /// refused batch still waited out.
    pub(super) fn usable(&self, now: Instant) -> bool {
        self.left > 0 && self.until.is_some_and(|t| now < t)
            || self.no_batch_until.is_some_and(|t| now < t)
    }

    /// Take one kept unit for a check under `policy`, if any is still
    /// usable and its policy lends them to this one.
    pub(super) fn take(&mut self, policy: &Policy) -> Option<Verdict> {
        if self.left == 0 || self.until.is_none_or(|until| Instant::now() >= until) {
            // Expired: what is left goes back to the store (its return is
            // on its way, or the units end with their window).
            return None;
        }
        if !self
            .policy
            .as_deref()
            .is_some_and(|taken| lends(taken, policy))
        {
            return None;
        }
        self.left -= 1;
        if self.left == 0 {
            self.cancel_return();
        }
        Some(Verdict::without_permit(
            self.decision.clone(),
            DecidedBy::LocalQuota,
        ))
    }

    /// What is left of the batch, taken (nothing more will be used of
    /// it), to give back to the store: `None` when nothing is left or too
    /// late to give it back.
    pub(super) fn leftover(&mut self, now: Instant) -> Option<GiveBack> {
        let left = std::mem::take(&mut self.left);
        let policy = self.policy.clone()?;
        (left > 0 && self.return_by.is_none_or(|by| now < by))
            .then(|| (left * policy.cost(), self.refund_id, policy))
    }

    /// No return of this batch is needed any more.
    pub(super) fn cancel_return(&mut self) {
        if let Some(task) = self.return_task.take() {
            task.abort();
        }
    }
}

/// Whether units taken under `taken` may admit a check under `policy`:
/// the same policy, or one that counts alike (algorithm, cost, windows)
/// and allows at least as much in each window (a rule's higher tier may
/// use a lower tier's units; a lower tier gives a higher one's back and
/// takes its own).
fn lends(taken: &Policy, policy: &Policy) -> bool {
    taken == policy
        || taken.algorithm() == policy.algorithm()
            && taken.cost() == policy.cost()
            && taken.execution() == policy.execution()
            && taken.rates().len() == policy.rates().len()
            && policy.rates().iter().all(|q| {
                taken.rates().iter().any(|p| {
                    p.window() == q.window() && p.calendar() == q.calendar() && p.max() <= q.max()
                })
            })
}

/// Units given back to the store: how many, the refund id of the batch's
/// check, and the policy they were taken under.
pub(super) type GiveBack = (u64, Option<RefundId>, Arc<Policy>);
