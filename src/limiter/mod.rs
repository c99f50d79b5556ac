//! The engine: [`Limiter`] decides, with no HTTP in sight. The tower layer
//! is a `Limiter` plus a key extractor plus the rendering of its verdicts;
//! workers, job queues and clients of third-party APIs use it directly.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::decision::Decision;
use crate::metrics::{Decider, Outcome};
use crate::policy::{Policy, PolicyError};
use crate::store::{
    Command, DynStore, MemoryStore, Store, StoreError, StoreKey, bounded, bounded_key,
};

mod breaker;
mod check;
mod deny_cache;
mod error;
mod fail_mode;
mod held;
mod hooks;
mod lease;
mod local;
mod names;
mod reservation;
pub(crate) mod top;
mod verdict;

pub use breaker::CircuitBreaker;
pub use check::Check;
pub use error::LimitError;
pub use fail_mode::FailMode;
pub use lease::Permit;
pub use local::LocalQuota;
pub use reservation::{Reservation, Settled};
pub(crate) use reservation::{Unsettled, settleable};
pub use verdict::{DecidedBy, Verdict};

use breaker::Breaker;
use deny_cache::{DEFAULT_DENY_CACHE_SIZE, DenyCache};

/// A rate limiter: a [`Store`], a [`Policy`], a name the keys are counted
/// under, and what to do when the store fails ([`FailMode`], a circuit
/// breaker, a local deny cache). Cheap to clone: clones share everything.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};
///
/// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
/// let limiter = Limiter::new(MemoryStore::new(), "2/s".parse::<Policy>()?);
/// assert!(limiter.check("job-queue").await?.allowed());
/// assert!(limiter.check("job-queue").await?.allowed());
/// assert!(!limiter.check("job-queue").await?.allowed());
/// // Wait (at most 2 s) until the next one is admitted.
/// limiter.until_ready("job-queue", Duration::from_secs(2)).await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    store: Arc<dyn DynStore>,
    /// The store's [`MemoryStore`], when it declares one
    /// ([`Store::memory`]): asked directly.
    memory: Option<MemoryStore>,
    policy: Arc<Policy>,
    /// Namespaces the keys of this limiter in the store.
    name: Arc<str>,
    /// `{name}:`, what a store key starts with (set with the name, by
    /// [`Inner::set_name`]).
    key_prefix: Arc<str>,
    /// The denials of this limiter, by key, found by its name in the
    /// registry of every limiter derived from the same one.
    denials: Arc<top::Denials>,
    registry: Arc<top::Registry>,
    /// The units held in process of every count of this limiter and the
    /// limiters derived from it, by name.
    held: Arc<held::Registry>,
    /// Whether its verdicts are counted (not for a local quota's batches:
    /// the request a batch is asked for is counted on its own).
    counted: bool,
    fail_mode: FailMode,
    /// Keys never limited.
    allowed: Arc<HashSet<String>>,
    /// Denials held in process (`None`: off).
    deny_cache: Option<Arc<DenyCache>>,
    /// Whether the store says its denials of `policy` are final
    /// ([`Store::denials_are_final`]): the deny cache answers only then.
    final_denials: bool,
    /// Shared by every clone.
    breaker: Option<Arc<Breaker>>,
    /// The policy the fallback store enforces.
    fallback_policy: Option<Arc<Policy>>,
    /// Units of hot keys held in process (`None`: off).
    local: Option<Arc<local::Local>>,
}

impl Limiter {
    /// Limit keys to `policy`, in `store`. The name keys are counted under
    /// is derived from the policy (see [`with_name`](Self::with_name)).
    pub fn new<St: Store>(store: St, policy: Policy) -> Self {
        let name: Arc<str> = Arc::from(default_name(&policy));
        let registry = Arc::new(top::Registry::default());
        let final_denials = store.denials_are_final(&policy);
        let memory = store.memory().cloned();
        Self {
            inner: Arc::new(Inner {
                store: Arc::new(store),
                memory,
                policy: Arc::new(policy),
                denials: registry.of(&name),
                key_prefix: Arc::from(format!("{name}:")),
                name,
                registry,
                held: Arc::default(),
                counted: true,
                fail_mode: FailMode::default(),
                allowed: Arc::default(),
                deny_cache: Some(Arc::new(DenyCache::new(DEFAULT_DENY_CACHE_SIZE))),
                final_denials,
                breaker: Some(Arc::new(Breaker::new(CircuitBreaker::default()))),
                fallback_policy: None,
                local: None,
            }),
        }
    }

    /// What to do when the store fails (default [`FailMode::Open`]).
    #[must_use]
    pub fn with_fail_mode(self, fail_mode: FailMode) -> Self {
        self.map(|s| {
            s.fallback_policy = match &fail_mode {
                FailMode::Fallback { instances, .. } => {
                    Some(Arc::new(s.policy.shared_by(*instances)))
                }
                _ => None,
            };
            s.fail_mode = fail_mode;
        })
    }

    /// The circuit breaker (default [`CircuitBreaker::default`]: open after
    /// 5 consecutive store failures, probe every second). While it is open,
    /// checks are answered by the fail mode at once instead of each waiting
    /// for the store's timeout. Only results of checks let through in the
    /// breaker's current state count: a check sent before the circuit opened
    /// and answered late neither closes nor reopens it; only the probe's
    /// result does. [`without_circuit_breaker`](Self::without_circuit_breaker)
    /// turns it off.
    #[must_use]
    pub fn with_circuit_breaker(self, breaker: CircuitBreaker) -> Self {
        self.map(|s| s.breaker = Some(Arc::new(Breaker::new(breaker))))
    }

    /// No circuit breaker: every check asks the store, and waits for its
    /// timeout when it does not answer.
    #[must_use]
    pub fn without_circuit_breaker(self) -> Self {
        self.map(|s| s.breaker = None)
    }

    /// Hold denials in process: once the store denies a key until `t`, the
    /// key's checks are denied locally until `t`, with no round trip, so a
    /// flood from one key costs the store nothing. Used only where that is
    /// exact ([`Store::denials_are_final`]: a cached denial never refuses a
    /// check the store would admit). At most `capacity` keys are held
    /// (default 10,000, at least 1);
    /// [`without_deny_cache`](Self::without_deny_cache) turns the cache off.
    ///
    /// The cache is this process's: after a [`reset`](Self::reset), a
    /// [`reward`](Self::reward) or a lifted [`block`](Self::block) in another
    /// process, this one may go on denying the key until the cached denial
    /// ends. (Commands through this limiter forget its own cached denial.)
    #[must_use]
    pub fn with_deny_cache(self, capacity: usize) -> Self {
        let cache = Arc::new(DenyCache::new(capacity.max(1)));
        self.map(|s| s.deny_cache = Some(cache))
    }

    /// No deny cache: every check of a denied key asks the store.
    #[must_use]
    pub fn without_deny_cache(self) -> Self {
        self.map(|s| s.deny_cache = None)
    }

    /// Never limit the keys in `keys` (trusted internal callers, the
    /// applications authorised for a resource): their checks are admitted
    /// with no decision. Adds to the keys already allowed.
    #[must_use]
    pub fn with_allowed_keys<S: Into<String>>(self, keys: impl IntoIterator<Item = S>) -> Self {
        let mut allowed = (*self.inner.allowed).clone();
        allowed.extend(keys.into_iter().map(Into::into));
        self.map(|s| s.allowed = Arc::new(allowed))
    }

    /// Name this limit: keys are counted under the name, so limiters
    /// sharing a store and a name share one count, whatever their policies
    /// (a tightened max bites at once; a rollout shares one count). Without
    /// a name a limiter counts under its policy's text. What starts afresh
    /// and what carries over, and the default name:
    /// [names and counts](crate::guide::policies#names-and-counts). The
    /// store key is `{name}:{key}`, so on a shared store no name should be
    /// another's followed by `:`. Two limits of one process that share a
    /// name with different policies (or a rule's name) are warned about.
    #[must_use]
    pub fn with_name(self, name: impl Into<String>) -> Self {
        let name: Arc<str> = Arc::from(name.into());
        self.map(|s| {
            s.denials = s.registry.of(&name);
            names::claim_or_warn(
                &name,
                names::Owner::Limiter(default_name(&s.policy)),
                &s.denials,
            );
            s.set_name(name);
            // Units taken under another name are not this name's.
            s.local = s
                .local
                .as_ref()
                .map(|l| Arc::new(l.under(local::Local::held_of(&s.held, &s.name))));
        })
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The name keys are counted under.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The keys this limiter denied most over this minute and the last,
    /// most first, each with its denials: by every process that watches
    /// them (this call, or an admin router) and shares the store, when it
    /// keeps them ([`RedisStore`][crate::RedisStore] does), else by this
    /// process. Counted from bounded memory: 32 keys per limiter and
    /// minute in each process (a key taking more than 1/32 of a process's
    /// denials in a minute is always among them) and 128 per minute in
    /// Redis; the counts are estimates (Space-Saving's). A rule's tiers
    /// count together. Each key as the limiter holds it: one over
    /// [`MAX_RAW_KEY_LEN`](crate::store::MAX_RAW_KEY_LEN) bytes (or holding
    /// `{`, `}` or a leading `#`) as `#` and its SHA-1 in hex, the form the
    /// admin router's key commands take. This process's denials not shared yet
    /// are shared first.
    ///
    /// # Errors
    /// The store failed.
    ///
    /// Denials are counted from the first call on (or from when an admin
    /// router was built on this limiter or its rules): a limiter nobody
    /// watches counts nothing and sends the store nothing more.
    #[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
    pub async fn most_denied(&self) -> Result<Vec<(String, u64)>, StoreError> {
        self.watch_denials();
        let pending = self.inner.denials.take_unshared();
        if !pending.is_empty()
            && let Err(error) = Arc::clone(&self.inner.store)
                .share_denials_owned(Arc::clone(&self.inner.name), pending)
                .await
        {
            tracing::warn!(%error, "rate limit: sharing the most denied keys failed; those counts are lost");
        }
        let shared = Arc::clone(&self.inner.store)
            .shared_denials_owned(Arc::clone(&self.inner.name))
            .await?;
        Ok(shared.unwrap_or_else(|| self.inner.denials.top(std::time::Instant::now())))
    }

    /// The fail mode.
    pub fn fail_mode(&self) -> &FailMode {
        &self.inner.fail_mode
    }

    fn map(mut self, change: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        self.inner = Arc::new(inner);
        self
    }

    /// Count one check of `key` at the policy's cost.
    ///
    /// A denial is a verdict, not an error: the error is for a store failure
    /// under [`FailMode::Closed`].
    pub async fn check(&self, key: &str) -> Result<Verdict, LimitError> {
        self.check_owned(self.owned_key(key)).await
    }

    /// `key` in a buffer with room for the limiter's name, which the store
    /// key puts before it (one allocation, not two).
    fn owned_key(&self, key: &str) -> String {
        let mut owned = String::with_capacity(self.inner.name.len() + 1 + key.len());
        owned.push_str(key);
        owned
    }

    /// [`check`](Self::check), taking the key by value: the limiter writes
    /// its name into the key's own buffer (no allocation when it has room),
    /// and the check is a named future that is answered without waiting
    /// when the store decides in process or the deny cache holds a denial
    /// ([`Check::now`]). The tower layer checks requests this way.
    pub fn check_owned(&self, key: String) -> Check {
        self.start(key, None)
    }

    /// Count one check of `key` costing `cost` units (the policy's max
    /// bounds it: a cost no rate can ever admit is an error).
    pub async fn check_n(&self, key: &str, cost: u64) -> Result<Verdict, LimitError> {
        if cost == self.inner.policy.cost() {
            return self.check(key).await;
        }
        let policy = Arc::new((*self.inner.policy).clone().with_cost(cost)?);
        self.start(self.owned_key(key), Some(policy)).await
    }

    /// The check of `key` (as given, not yet namespaced) under `policy`
    /// (the limiter's when `None`): an allowed key is admitted unlimited.
    fn start(&self, key: String, policy: Option<Arc<Policy>>) -> Check {
        if self.is_allowed(&key) {
            crate::metrics::decision(&self.inner.name, Outcome::Skipped, Decider::None);
            return Check::done(Ok(Verdict::unlimited(DecidedBy::AllowedKey)));
        }
        if policy.is_none()
            && self.inner.local.is_none()
            && let Some(memory) = &self.inner.memory
        {
            return self.start_in_memory(memory, key);
        }
        // As the limiter holds it everywhere (the store, the deny cache, the
        // local quota, the most denied keys): whatever a client sends, a
        // key held costs a bounded number of bytes, and a long key is shown
        // and steered by its hash.
        let key = bounded(key);
        if policy.is_none()
            && let Some(local) = &self.inner.local
        {
            return local.check(self, key);
        }
        self.start_in_store(key, policy)
    }

    /// The check of `key` (as given) in `memory`, the limiter's store,
    /// under the limiter's policy: the store key is read once, by the
    /// [`StoreKey`] the store checks, when it and `key` are held as they
    /// are (the common case); any other key is bounded first, as every
    /// path bounds it.
    fn start_in_memory(&self, memory: &MemoryStore, key: String) -> Check {
        if !StoreKey::raw_follows_whole(&key) {
            return self.start_in_memory_bounded(memory, &key);
        }
        let (key, policy) = (self.store_key(key), &self.inner.policy);
        let held = StoreKey::new(&key, memory.hasher());
        if !held.is_as_given() {
            return self.start_in_memory_bounded(memory, self.raw_key(&key));
        }
        let decision = memory.check_key(&held, policy);
        Check::done(self.decided(&key, policy, decision, None))
    }

    /// [`start_in_memory`](Self::start_in_memory) of a key whose store key
    /// is not read once: the key, or the name before it, is long, holds a
    /// brace or starts with `#`, or the two together pass the bound.
    #[cold]
    fn start_in_memory_bounded(&self, memory: &MemoryStore, key: &str) -> Check {
        let key = self.store_key(bounded_key(key).into_owned());
        let policy = &self.inner.policy;
        let decision = memory.check_now(&key, policy);
        Check::done(self.decided(&key, policy, decision, None))
    }

    /// Check `key` until it is admitted, sleeping each denial's
    /// `retry_after`, for at most `max_wait` in all: shaping, for workers
    /// and clients that must stay under a rate rather than be refused. A
    /// denial that cannot be waited out within `max_wait` returns
    /// [`LimitError::Limited`] at once, without sleeping.
    ///
    /// Waiting is not queueing: several waiters of one key are admitted in
    /// no particular order.
    pub async fn until_ready(&self, key: &str, max_wait: Duration) -> Result<Verdict, LimitError> {
        self.until_ready_n(key, self.inner.policy.cost(), max_wait)
            .await
    }

    /// [`until_ready`](Self::until_ready) for a check costing `cost` units.
    pub async fn until_ready_n(
        &self,
        key: &str,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Verdict, LimitError> {
        // The deadline counts the store's round trips too; a `max_wait` past
        // the clock's range never runs out.
        let deadline = Instant::now().checked_add(max_wait);
        loop {
            let verdict = self.check_n(key, cost).await?;
            if verdict.allowed() {
                return Ok(verdict);
            }
            let wait = verdict.retry_after();
            let in_time = match deadline {
                Some(deadline) => Instant::now()
                    .checked_add(wait)
                    .is_some_and(|woken| woken <= deadline),
                None => true,
            };
            if !in_time {
                let (decision, _, _) = verdict.into_parts();
                return Err(match decision {
                    Some(decision) => LimitError::Limited(Box::new(decision)),
                    // A denied verdict always has a decision.
                    None => LimitError::Store(StoreError::UnexpectedReply(
                        "a denial without a decision".into(),
                    )),
                });
            }
            // At least 1 ms: a store that answers a zero wait must not make
            // the caller check again in a tight loop.
            tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
        }
    }

    /// Take a slot of `key` ([`Concurrency`](crate::Algorithm::Concurrency)
    /// policies; under other algorithms the permit only proves admission),
    /// waiting at most `max_wait` for one: the permit gives it back when
    /// dropped, or with [`Permit::release`].
    ///
    /// Admitted with no decision (an allowed key, [`FailMode::Open`]) the
    /// permit holds no slot.
    pub async fn acquire(&self, key: &str, max_wait: Duration) -> Result<Permit, LimitError> {
        let verdict = self.until_ready(key, max_wait).await?;
        let (decision, _, permit) = verdict.into_parts();
        Ok(permit.unwrap_or_else(|| Permit::without_lease(decision)))
    }

    /// The state of `key`: the decision a check would get now, consuming
    /// nothing. Asks the store (no fail mode): an error if it fails.
    pub async fn peek(&self, key: &str) -> Result<Decision, StoreError> {
        self.command(key, Command::Peek).await
    }

    /// Forget `key`: its counts, its leases and its block, in the store and
    /// in this process's deny cache. Returns the state after.
    pub async fn reset(&self, key: &str) -> Result<Decision, StoreError> {
        self.command(key, Command::Reset).await
    }

    /// Deny every check of `key` for `duration` from now, in every process
    /// sharing the store (replacing an earlier block; zero lifts it).
    pub async fn block(&self, key: &str, duration: Duration) -> Result<Decision, StoreError> {
        self.command(key, Command::Block(duration)).await
    }

    /// Take `units` of `key`'s quota, as `units` admitted checks would
    /// (even beyond the max: the key then waits until the excess drained;
    /// it saturates as [`Command::Penalty`] says).
    pub async fn penalty(&self, key: &str, units: u64) -> Result<Decision, StoreError> {
        self.command(key, Command::Penalty(units)).await
    }

    /// Give `units` of `key`'s quota back, as if `units` admitted checks had
    /// not been counted (never below an empty state).
    pub async fn reward(&self, key: &str, units: u64) -> Result<Decision, StoreError> {
        self.command(key, Command::Reward(units)).await
    }

    async fn command(&self, key: &str, command: Command) -> Result<Decision, StoreError> {
        self.command_limited(&bounded_key(key), command).await
    }

    /// Admit hot keys locally ([`LocalQuota`]): a process takes a batch of
    /// a key's quota from the store in one check and admits from it with
    /// no round trip, within the bound the
    /// [production guide](crate::guide::production#hot-keys-a-local-quota)
    /// states.
    /// Checks of another cost than the policy's ([`check_n`](Self::check_n))
    /// go to the store as before.
    ///
    /// # Errors
    /// A policy the quota cannot serve: a concurrency limit (a slot is one
    /// request in flight), a minimum spacing (local units would not be
    /// spaced), or a smallest max that cannot hold two requests at the
    /// policy's cost.
    pub fn with_local_quota(self, quota: LocalQuota) -> Result<Self, PolicyError> {
        let held = local::Local::held_of(&self.inner.held, &self.inner.name);
        let local = Arc::new(local::Local::new(quota, &self.inner.policy, held)?);
        Ok(self.map(|s| s.local = Some(local)))
    }

    /// Whether `key` is one of the allowed keys, never limited.
    pub fn is_allowed(&self, key: &str) -> bool {
        !self.inner.allowed.is_empty() && self.inner.allowed.contains(key)
    }

    /// The store key of an extracted key: `{name}:{key}`, written into the
    /// extracted key's own buffer (no allocation when it has room, as the
    /// IP extractors leave).
    pub(crate) fn store_key(&self, mut key: String) -> String {
        key.insert_str(0, &self.inner.key_prefix);
        key
    }

    /// The deny cache, when it may answer for this limiter.
    #[inline]
    fn usable_deny_cache(&self) -> Option<&DenyCache> {
        self.inner
            .deny_cache
            .as_deref()
            .filter(|_| self.inner.final_denials)
    }

    /// The policy a verdict of `decided_by` was decided under: the limiter's,
    /// or, for [`DecidedBy::Fallback`], the fallback's share of it.
    pub fn enforced_policy(&self, decided_by: DecidedBy) -> &Policy {
        match (decided_by, &self.inner.fallback_policy) {
            (DecidedBy::Fallback, Some(policy)) => policy,
            _ => &self.inner.policy,
        }
    }
}

impl Inner {
    fn set_name(&mut self, name: Arc<str>) {
        self.key_prefix = Arc::from(format!("{name}:"));
        self.name = name;
    }
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("policy", &self.inner.policy.to_string())
            .field("name", &self.inner.name)
            .field("fail_mode", &self.inner.fail_mode)
            .field("breaker", &self.inner.breaker.is_some())
            .field("deny_cache", &self.inner.deny_cache.is_some())
            .field(
                "local_quota",
                &self.inner.local.as_ref().map(|l| l.config()),
            )
            .finish_non_exhaustive()
    }
}

/// The name keys of `policy` are counted under by default.
fn default_name(policy: &Policy) -> String {
    use crate::policy::{Algorithm, Execution};
    use std::fmt::Write as _;

    // Writing to a `String` never fails.
    let mut name = policy.to_string().replace(' ', "");
    if policy.cost() != 1 {
        let _ = write!(name, ";cost={}", policy.cost());
    }
    if let Some(spacing) = policy.min_spacing() {
        let _ = write!(name, ";spacing={}", crate::policy::duration_text(spacing));
    }
    // Only the sliding log runs differently by execution.
    if policy.algorithm() == Algorithm::SlidingLog && policy.execution() != Execution::default() {
        let _ = write!(name, ";{}", policy.execution());
    }
    name
}

/// The metrics' outcome and source of a verdict (the store, for a failure
/// the fail mode refused).
fn classify(verdict: &Result<Verdict, LimitError>) -> (Outcome, Decider) {
    let Ok(verdict) = verdict else {
        return (Outcome::FailedClosed, Decider::Store);
    };
    let decider = match verdict.decided_by() {
        DecidedBy::Store => Decider::Store,
        DecidedBy::DenyCache => Decider::DenyCache,
        DecidedBy::LocalQuota => Decider::LocalQuota,
        DecidedBy::Fallback => Decider::Fallback,
        DecidedBy::FailOpen | DecidedBy::AllowedKey => Decider::None,
    };
    let outcome = match verdict.decided_by() {
        DecidedBy::FailOpen => Outcome::FailedOpen,
        DecidedBy::AllowedKey => Outcome::Skipped,
        _ if verdict.allowed() => Outcome::Admitted,
        _ if verdict.decision().is_some_and(Decision::blocked) => Outcome::Blocked,
        _ => Outcome::Denied,
    };
    (outcome, decider)
}
