//! [`MemoryStore`]: every algorithm in process memory. These are the
//! reference semantics that the Redis scripts follow.

use compact_str::CompactString;
use hashbrown::HashTable;
use std::sync::{Arc, Mutex, PoisonError, TryLockError};

use crate::algorithm;
use crate::clock::{Clock, SystemClock};
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Policy};
use crate::store::{Command, KeyHasher, State, Store, StoreError, StoreKey};

const SHARDS: usize = 16;
/// When a check finds this long (µs) passed since its shard last swept,
/// one shard (in turn) drops its idle keys: every shard, idle or not, is
/// swept within `SHARDS` such checks of any one shard. By the clock, not by
/// the number of checks: the work of a sweep grows with the keys held, not
/// with the traffic. Timed per shard, under its lock, so threads share no
/// counter.
const SWEEP_PERIOD: u64 = 1_000_000;
/// How long (µs) a sweep keeps a key after its state stopped mattering: a
/// key that comes back within it reuses its entry instead of allocating a
/// new one. (A state past its end decides as no state would, so keeping it
/// changes no decision.)
const SWEEP_GRACE: u64 = 1_000_000;
/// How many keys are looked at to pick one to evict when the store is full.
const EVICTION_SAMPLE: usize = 8;

/// The default bound on the number of keys a [`MemoryStore`] holds.
pub(crate) const DEFAULT_MAX_KEYS: usize = 100_000;

/// Rate limits held in this process: for one process, for tests, and as a
/// fallback. Every [`Algorithm`] with the same semantics as
/// [`RedisStore`][crate::RedisStore], decided on an injectable [`Clock`].
///
/// Memory is bounded: keys longer than
/// [`MAX_RAW_KEY_LEN`](crate::store::MAX_RAW_KEY_LEN) bytes are held as a
/// fixed-size hash, keys whose state no longer matters are dropped, and when
/// more than `max_keys` keys are held the one of a small sample whose state
/// ends soonest is evicted (as Redis's approximate LRU does), which forgets
/// that key's history.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::clock::ManualClock;
/// use tower_redis_ratelimit::{MemoryStore, Policy, Store};
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
#[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    clock: Arc<dyn Clock>,
    hasher: KeyHasher,
    shards: Box<[Padded]>,
    max_keys_per_shard: usize,
}

/// A shard on cache lines of its own, so that threads working on two
/// shards do not take each other's lines (128 bytes: the adjacent-line
/// prefetcher fetches lines in pairs).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Debug, Default)]
struct Shard {
    /// One map per algorithm, so one key under two algorithms never mixes.
    /// Keyed by `Entry::key`, found by its hash: one hash per check picks
    /// both the shard and the bucket.
    keys: [HashTable<Entry>; Algorithm::ALL.len()],
    /// The keys an operator blocked ([`Command::Block`]), whatever their
    /// algorithm, found by the same hash. Usually empty: a check then
    /// looks no further.
    blocks: HashTable<Block>,
    inserts_since_sweep: u64,
    /// When (µs) this shard last swept a shard (a clock moved back
    /// counts as a period passed), and how many sweeps it started (which
    /// shard is next).
    swept_at: u64,
    sweeps: u64,
    /// Concurrency leases taken in this shard so far: a lease's id is the
    /// shard's index and this count, unique in the store, and taken under
    /// the shard's lock (two threads share no counter).
    leases: u64,
}

/// The ids of `n` new leases of shard `index`, whose count of leases taken
/// is `taken`: consecutive, never given before by this store.
fn shard_lease_ids(taken: &mut u64, index: usize, n: u64) -> u128 {
    let first = *taken;
    *taken += n;
    ((index as u128) << 64) | u128::from(first)
}

#[derive(Debug)]
struct Entry {
    /// Up to 24 bytes inline: the usual key is read from the entry itself.
    key: CompactString,
    state: State,
    /// When (µs) this state stops mattering: it can be dropped after.
    expires_at: u64,
}

/// A blocked key: every request of it is denied until `until` (µs).
#[derive(Debug)]
struct Block {
    key: Box<str>,
    until: u64,
}

impl MemoryStore {
    /// The bound on the number of keys held unless
    /// [`with_max_keys`](Self::with_max_keys) says otherwise (100,000).
    pub const DEFAULT_MAX_KEYS: usize = DEFAULT_MAX_KEYS;

    /// A store on the system clock holding at most [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) keys.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::new())
    }

    /// A store on `clock`.
    pub fn with_clock(clock: impl Clock) -> Self {
        Self::build(Arc::new(clock), DEFAULT_MAX_KEYS)
    }

    /// Hold at most `max_keys` keys, spread over 16 shards that each hold
    /// at most `max_keys / 16` (at least one): a shard that is full makes
    /// room before the total is reached (see
    /// [in production without Redis](crate::guide::memory)). Set it before
    /// use: the store returned starts empty.
    #[must_use]
    pub fn with_max_keys(self, max_keys: usize) -> Self {
        Self::build(Arc::clone(&self.inner.clock), max_keys)
    }

    fn build(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        let shards = (0..SHARDS).map(|_| Padded::default()).collect();
        Self {
            inner: Arc::new(Inner {
                clock,
                hasher: KeyHasher::new(),
                shards,
                max_keys_per_shard: max_keys.div_ceil(SHARDS).max(1),
            }),
        }
    }

    /// How many keys the store holds now (over every algorithm).
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| {
                let shard = s.0.lock().unwrap_or_else(PoisonError::into_inner);
                shard.keys.iter().map(HashTable::len).sum::<usize>()
            })
            .sum()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now(&self) -> u64 {
        self.inner.clock.now_micros()
    }

    /// The shard a key of `hash` lives in: bits 32 and up, apart from the
    /// low bits that pick a bucket and the top 7 that hashbrown keeps as a
    /// tag.
    #[inline]
    fn shard_of(hash: u64) -> usize {
        (hash >> 32) as usize % SHARDS
    }

    fn lock(&self, index: usize) -> std::sync::MutexGuard<'_, Shard> {
        self.inner.shards[index]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Decide now, with no future to await: a `MemoryStore` never waits,
    /// so synchronous code (a thread, a blocking job) can limit with it
    /// directly. Counts exactly as [`Store::check`], which calls it.
    ///
    /// ```
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let store = MemoryStore::new();
    /// let policy: Policy = "2/s".parse()?;
    /// assert!(store.check_now("job", &policy).allowed());
    /// assert!(store.check_now("job", &policy).allowed());
    /// assert!(!store.check_now("job", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    pub fn check_now(&self, key: &str, policy: &Policy) -> Decision {
        let key = StoreKey::new(key, &self.inner.hasher);
        self.check_key(&key, policy)
    }

    /// The hasher of this store's tables, for a [`StoreKey`] built by a
    /// caller (the limiter reads its key once).
    #[inline]
    pub(crate) fn hasher(&self) -> &KeyHasher {
        &self.inner.hasher
    }

    /// The check of `key`, hashed by [`hasher`](Self::hasher).
    #[inline(always)]
    pub(crate) fn check_key(&self, key: &StoreKey<'_>, policy: &Policy) -> Decision {
        let now = self.now();
        let (hash, index) = (key.hash(), Self::shard_of(key.hash()));
        let algorithm = policy.algorithm().index();
        let mut shard = self.lock(index);
        if now.wrapping_sub(shard.swept_at) >= SWEEP_PERIOD {
            self.sweep_in_turn(&mut shard, index, now);
        }
        if !shard.blocks.is_empty()
            && let Some(left) = shard.block_left(key, now)
        {
            return algorithm::blocked(policy, left);
        }
        // A held key's decision is returned as the state's check writes it
        // (no copy); a new key's takes the call below. Only an admitted
        // concurrency check takes a lease.
        let Shard { keys, leases, .. } = &mut *shard;
        if let Some(entry) = keys[algorithm].find_mut(hash, |e| key.is(&e.key)) {
            let lease = || Lease::new(shard_lease_ids(leases, index, 1));
            return entry.state.check(now, policy, lease, &mut entry.expires_at);
        }
        self.check_new(&mut shard, index, hash, key.to_text(), policy, now)
    }

    /// The check of a key the shard does not hold: its entry is held only
    /// if its state matters after the check.
    fn check_new(
        &self,
        shard: &mut Shard,
        index: usize,
        hash: u64,
        key: CompactString,
        policy: &Policy,
        now: u64,
    ) -> Decision {
        let mut entry = Entry {
            key,
            state: State::new(policy.algorithm()),
            expires_at: 0,
        };
        let lease = || Lease::new(shard_lease_ids(&mut shard.leases, index, 1));
        let decision = entry.state.check(now, policy, lease, &mut entry.expires_at);
        if entry.expires_at > now {
            self.insert(shard, policy.algorithm().index(), hash, entry, now);
        }
        decision
    }

    /// Run an operator's [`Command`] now, with no future to await (as
    /// [`Store::command`], which calls it): the decision a request of `policy.cost()` would get
    /// afterwards, consuming nothing. A penalty of the concurrency limit
    /// takes anonymous slots that expire after the lease time; a reward
    /// frees the oldest leases (see [`Store::command`]).
    pub fn command_now(&self, key: &str, policy: &Policy, command: Command) -> Decision {
        let hasher = &self.inner.hasher;
        let key = StoreKey::new(key, hasher);
        let now = self.now();
        let algorithm = policy.algorithm().index();
        let (hash, index) = (key.hash(), Self::shard_of(key.hash()));
        let mut shard = self.lock(index);
        let shard = &mut *shard;
        match command {
            Command::Reset => {
                if let Ok(found) = shard.keys[algorithm].find_entry(hash, |e| key.is(&e.key)) {
                    found.remove();
                }
                if let Ok(found) = shard.blocks.find_entry(hash, |b| key.is(&b.key)) {
                    found.remove();
                }
            }
            Command::Block(duration) => {
                let until = now.saturating_add(algorithm::block_micros(duration));
                shard.block(&key, until, now, hasher);
            }
            Command::Penalty(_) | Command::Reward(_) | Command::Refund { .. } => {
                let lease_ids = |n| shard_lease_ids(&mut shard.leases, index, n);
                let held = shard.keys[algorithm]
                    .find_mut(hash, |e| key.is(&e.key))
                    .map(|e| (&mut e.state, &mut e.expires_at));
                if let Some((state, expires_at)) =
                    State::count_held(held, now, policy, command, lease_ids)
                {
                    let key = key.to_text();
                    let entry = Entry {
                        key,
                        state,
                        expires_at,
                    };
                    self.insert(shard, algorithm, hash, entry, now);
                }
            }
            Command::Peek => {}
        }
        let block_left = shard.block_left(&key, now);
        let held = shard.keys[algorithm].find(hash, |e| key.is(&e.key));
        State::peek_held(block_left, held.map(|e| &e.state), now, policy)
    }

    /// Hold the new `entry` (found by `hash`), making room first when the
    /// shard is full.
    fn insert(&self, shard: &mut Shard, algorithm: usize, hash: u64, entry: Entry, now: u64) {
        let hasher = &self.inner.hasher;
        if shard.len() >= self.inner.max_keys_per_shard {
            shard.make_room(now, self.inner.max_keys_per_shard, hasher);
        }
        shard.keys[algorithm].insert_unique(hash, entry, |e| hasher.hash(e.key.as_bytes()));
        shard.inserts_since_sweep += 1;
    }
    /// Give back a concurrency slot now, with no future to await (as
    /// [`Store::release`], which calls it).
    pub fn release_now(&self, key: &str, policy: &Policy, lease: Lease) {
        let key = StoreKey::new(key, &self.inner.hasher);
        let mut shard = self.lock(Self::shard_of(key.hash()));
        let map = &mut shard.keys[policy.algorithm().index()];
        if let Some(Entry {
            state: State::Leases(leases),
            ..
        }) = map.find_mut(key.hash(), |e| key.is(&e.key))
        {
            leases.release(lease);
        }
    }

    /// Shard `index`'s turn to sweep, at `now`: the next shard in its
    /// turn (itself every `SHARDS` turns) drops its idle keys.
    #[cold]
    fn sweep_in_turn(&self, shard: &mut Shard, index: usize, now: u64) {
        shard.swept_at = now;
        shard.sweeps += 1;
        let turn = (index + shard.sweeps as usize) % SHARDS;
        if turn == index {
            shard.sweep(now, SWEEP_GRACE);
        } else {
            self.sweep_one(turn, now);
        }
    }

    /// Sweep one shard, unless another thread holds it (it will be swept on
    /// a later turn). Never waits, so holding another shard's lock is safe.
    fn sweep_one(&self, index: usize, now: u64) {
        match self.inner.shards[index].0.try_lock() {
            Ok(mut shard) => shard.sweep(now, SWEEP_GRACE),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner().sweep(now, SWEEP_GRACE),
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

    fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision> {
        Some(self.check_now(key, policy))
    }

    fn memory(&self) -> Option<&MemoryStore> {
        Some(self)
    }

    async fn release(&self, key: &str, policy: &Policy, lease: Lease) -> Result<(), StoreError> {
        self.release_now(key, policy, lease);
        Ok(())
    }

    async fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> Result<Decision, StoreError> {
        Ok(self.command_now(key, policy, command))
    }
}

impl Shard {
    /// Block `key` until `until` (µs; at `now` or before lifts it).
    fn block(&mut self, key: &StoreKey<'_>, until: u64, now: u64, hasher: &KeyHasher) {
        match self.blocks.find_mut(key.hash(), |b| key.is(&b.key)) {
            Some(block) => block.until = until,
            None if until > now => {
                let block = Block {
                    key: key.to_text(),
                    until,
                };
                self.blocks
                    .insert_unique(key.hash(), block, |b| hasher.hash(b.key.as_bytes()));
            }
            None => {}
        }
    }

    /// The time left (µs) of `key`'s block, if it is blocked at `now`.
    fn block_left(&self, key: &StoreKey<'_>, now: u64) -> Option<u64> {
        let block = self.blocks.find(key.hash(), |b| key.is(&b.key))?;
        algorithm::block_left(block.until, now)
    }

    fn len(&self) -> usize {
        self.keys.iter().map(HashTable::len).sum()
    }

    /// Drop every key whose state stopped mattering more than `grace` µs
    /// ago.
    fn sweep(&mut self, now: u64, grace: u64) {
        self.inserts_since_sweep = 0;
        for map in &mut self.keys {
            map.retain(|entry| entry.expires_at.saturating_add(grace) > now);
        }
        self.blocks.retain(|block| block.until > now);
    }

    /// Make room for one more key.
    fn make_room(&mut self, now: u64, max: usize, hasher: &KeyHasher) {
        // A full sweep is O(keys): do one only if many keys came since the
        // last, so a flood of new keys costs O(1) per key.
        if self.inserts_since_sweep >= (max as u64 / 2).max(1) {
            // Short of room: no grace.
            self.sweep(now, 0);
        }
        while self.len() >= max {
            let victim = self
                .keys
                .iter()
                .enumerate()
                .flat_map(|(i, map)| map.iter().take(EVICTION_SAMPLE).map(move |e| (i, e)))
                .take(EVICTION_SAMPLE)
                .min_by_key(|(_, entry)| entry.expires_at)
                .map(|(i, entry)| (i, entry.key.clone()));
            match victim {
                Some((i, key)) => {
                    if let Ok(found) =
                        self.keys[i].find_entry(hasher.hash(key.as_bytes()), |e| e.key == key)
                    {
                        found.remove();
                    }
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests;
