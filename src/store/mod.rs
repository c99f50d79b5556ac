//! Where the state of every key lives: the [`Store`] trait, and the
//! in-process and Redis stores.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::{Decision, Lease};
use crate::policy::Policy;

#[cfg(feature = "test-util")]
pub mod conformance;
mod key_state;
pub(crate) mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod store_key;
mod table_key;

pub(crate) use key_state::State;
pub use key_state::{KeyState, STATE_ENCODING_VERSION, StateError};
pub use memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_SEEN_BYTES, DEFAULT_TABLE, DEFAULT_TIMEOUT, PostgresStore, PostgresStoreBuilder,
};
#[cfg(feature = "redis")]
pub use redis::{RedisStore, RedisStoreBuilder, TrackedConnection, TrackedManager};
pub use store_key::MAX_RAW_KEY_LEN;
pub(crate) use store_key::{StoreKey, bounded, bounded_key};
pub(crate) use table_key::KeyHasher;

/// The Lua scripts `RedisStore` runs, as sent to Redis (feature
/// `test-util`): for differential tests and benchmarks that run them
/// directly. Their arguments and replies follow the crate's version.
#[cfg(all(feature = "test-util", feature = "redis"))]
pub mod scripts {
    pub use crate::store::redis::{
        CONCURRENCY_COMMAND_SCRIPT, CONCURRENCY_SCRIPT, FIXED_WINDOW_BATCH_SCRIPT,
        FIXED_WINDOW_COMMAND_SCRIPT, FIXED_WINDOW_SCRIPT, GCRA_BATCH_SCRIPT, GCRA_COMMAND_SCRIPT,
        GCRA_SCRIPT, SLIDING_LOG_BATCH_SCRIPT, SLIDING_LOG_COMMAND_SCRIPT, SLIDING_LOG_SCRIPT,
        SLIDING_WINDOW_BATCH_SCRIPT, SLIDING_WINDOW_COMMAND_SCRIPT, SLIDING_WINDOW_SCRIPT,
        decode_batched_reply,
    };
}

/// Keeps the state of every limited key and takes the decision for one
/// request, atomically.
///
/// The crate ships [`MemoryStore`] and `RedisStore` (feature `redis`). To
/// keep the state somewhere else, keep a [`KeyState`] per key wherever
/// you can read and write it atomically and call it from these methods:
/// its decisions are the crate's. The guide's page
/// [writing a store](crate::guide::writing_a_store) gives the contract
/// and a complete store; the conformance kit (`store::conformance`,
/// feature `test-util`) holds yours to `MemoryStore`'s decisions.
pub trait Store: Send + Sync + 'static {
    /// Count one request of `key` (of `policy.cost()` units) against
    /// `policy`, and say whether it is admitted. A denied request must not
    /// count against the key.
    fn check(
        &self,
        key: &str,
        policy: &Policy,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Whether a denial of `policy` with `retry_after = t` is final: no
    /// request of that key is admitted before `t`, whatever other clients do
    /// meanwhile. The layer then denies the key locally until `t` with no
    /// round trip (the deny cache). The default, `false`, never caches.
    fn denials_are_final(&self, policy: &Policy) -> bool {
        let _ = policy;
        false
    }

    /// Run an operator's [`Command`] on `key` under `policy`, atomically
    /// (one script in Redis), and return the state it leaves: the decision a
    /// request of `policy.cost()` would get now, consuming nothing. The
    /// default answers [`StoreError::Unsupported`]; a store that keeps it
    /// has no operator commands, refunds or settled costs, and fails the
    /// conformance kit.
    fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        let _ = (key, policy, command);
        async { Err(StoreError::Unsupported("operator commands")) }
    }

    /// The decision at once, when the store takes it in process (as
    /// [`MemoryStore`] does): the caller then needs no
    /// future. The default, `None`, means "call [`check`](Self::check)".
    /// A store that answers `Some` must count exactly as `check` would.
    fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision> {
        let _ = (key, policy);
        None
    }

    /// The [`MemoryStore`] that takes every decision of this store, when
    /// it is one (or a wrapper that only forwards to one, and may answer
    /// `Some` too). Such a store never fails and holds no denial final: a
    /// [`Limiter`](crate::Limiter) then asks it directly, with no breaker,
    /// no deny cache and no future. The
    /// default, `None`: any other store, even one deciding in process
    /// ([`check_in_process`](Self::check_in_process)), is asked as a store.
    fn memory(&self) -> Option<&MemoryStore> {
        None
    }

    /// Add `counts` (keys of the limit named `limit`, and how many times
    /// this process denied each since it last shared them) to what every
    /// process sharing the store counted this minute, keeping a bounded
    /// number of keys. Sent at most about once a second per limit and
    /// process. The default keeps nothing: each process then shows its own
    /// (see [`shared_denials`](Self::shared_denials)).
    fn share_denials(
        &self,
        limit: &str,
        counts: Vec<(String, u64)>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (limit, counts);
        async { Ok(()) }
    }

    /// The keys of the limit named `limit` that every process sharing the
    /// store denied most over this minute and the last, most first
    /// ([`share_denials`](Self::share_denials)); `None`, the default, when
    /// the store does not keep them.
    fn shared_denials(
        &self,
        limit: &str,
    ) -> impl Future<Output = Result<Option<Vec<(String, u64)>>, StoreError>> + Send {
        let _ = limit;
        async { Ok(None) }
    }

    /// Give back the concurrency slot `lease` of `key`, taken by an admitted
    /// [`Concurrency`](crate::Algorithm::Concurrency) check. The default does
    /// nothing: a store that keeps it never frees a slot, and fails the
    /// conformance kit.
    fn release(
        &self,
        key: &str,
        policy: &Policy,
        lease: Lease,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (key, policy, lease);
        async { Ok(()) }
    }
}

/// An operator's command on one key ([`Store::command`]). Every store
/// gives them the same meaning, for every [`Algorithm`](crate::Algorithm),
/// up to the saturation of a penalty (see [`Command::Penalty`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// Change nothing: the state, and the decision a request of the
    /// policy's cost would get now.
    Peek,
    /// Forget the key: its counts, its leases and its block.
    Reset,
    /// Deny every request of the key for this long from now, in every
    /// process sharing the store (replacing an earlier block; zero lifts
    /// it; at most [`MAX_WINDOW`](crate::policy::MAX_WINDOW), and a block shorter
    /// than a microsecond lifts it). The counts are kept. A blocked key's
    /// decision: denied, nothing remaining, every rate's wait and reset the
    /// time left. (A [`Limiter`](crate::Limiter)'s allowed keys are never
    /// checked, so never blocked, and its fallback store, limiting while
    /// this store fails, does not know of blocks.)
    Block(Duration),
    /// Take `units` of quota, as `units` admitted requests would (even
    /// beyond the max: the key then waits until the excess has drained).
    ///
    /// A penalty saturates where more would change no decision, or where
    /// each unit takes memory: the fixed window and sliding window counter
    /// count at most 2^53, a GCRA debt is at most twice
    /// [`MAX_WINDOW`](crate::policy::MAX_WINDOW), the sliding log adds at most its
    /// largest `max` entries and the concurrency limit takes at most `max`
    /// slots, both at most [`MAX_COST`](crate::policy::MAX_COST) (10,000) per
    /// command, since they keep one entry per unit. So a penalty far past
    /// the max followed by a reward admits sooner under the sliding log than
    /// under the window counters. A concurrency penalty takes anonymous
    /// slots, which nobody releases: they expire after the lease time, like
    /// the lease of a crashed process.
    Penalty(u64),
    /// Give `units` of quota back, as if `units` admitted requests had not
    /// been counted (never below an empty state): the sliding log drops its
    /// newest entries, the sliding window counter takes the units off the
    /// current window's count and then the previous one's, and the
    /// concurrency limit frees its `units` oldest leases (expiring soonest),
    /// anonymous or held by requests in flight, whose release then does
    /// nothing.
    Reward(u64),
    /// Give back the `units` one admitted check counted, the check whose
    /// decision carried `id` ([`Decision::refund_id`](crate::Decision::refund_id)):
    /// where the algorithm keeps entries per request, exactly that check's
    /// (the sliding log's entries, the concurrency limit's slot: removing
    /// them again does nothing), elsewhere as [`Reward`](Self::Reward)
    /// (the window counters and GCRA hold no request's identity). What a
    /// rule counting by outcome sends after the response.
    Refund {
        /// The refund id of the admitted check's decision.
        id: crate::decision::RefundId,
        /// The units it cost.
        units: u64,
    },
}

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed: an error reply, or the connection failed. The
    /// source is the backend's own error (a [`RedisError`][::redis::RedisError] for
    /// [`RedisStore`]).
    #[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
    #[error("{backend}: {source}")]
    Backend {
        /// Which backend (`"redis"`).
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// No answer within the store's timeout.
    #[error("no answer from the store within {0:?}")]
    Timeout(Duration),
    /// Not asked: the limiter's circuit breaker is open after a run of
    /// failures.
    #[error("not asked: the circuit breaker is open after repeated store failures")]
    CircuitOpen,
    /// No connection came free in the pool's connection timeout.
    #[error("no connection to the store came free in the pool's connection timeout")]
    PoolTimeout,
    /// The backend answered something the store did not expect.
    #[error("unexpected reply from the store: {0}")]
    UnexpectedReply(String),
    /// The store cannot do this.
    #[error("the store does not support {0}")]
    Unsupported(&'static str),
    /// The key's state was held by another session longer than the store
    /// waits for it (a row locked in PostgreSQL past the sessions'
    /// `lock_timeout`): this key's check failed, and the fail mode decides
    /// it. The store itself answered, so the circuit breaker does not count
    /// it as a failure. The source is the backend's error.
    #[error("the key's state is held by another session: {0}")]
    KeyBusy(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl StoreError {
    /// A failure of `backend`, with its error as the source.
    pub fn backend(
        backend: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Backend {
            backend,
            source: Box::new(source),
        }
    }

    /// The backend's error, when it is an `E`.
    pub fn backend_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Self::Backend { source, .. } => source.downcast_ref::<E>(),
            _ => None,
        }
    }
}

#[cfg(feature = "redis")]
impl From<::redis::RedisError> for StoreError {
    fn from(error: ::redis::RedisError) -> Self {
        Self::backend("redis", error)
    }
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Keys, each with how many times it was denied.
type DeniedKeys = Vec<(String, u64)>;

/// A [`Store`] behind a pointer, so the layer's types do not name the store.
pub(crate) trait DynStore: Send + Sync + 'static {
    /// The check, owning its key; the future hands the key back with the
    /// answer, so the layer need not copy it.
    fn check_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
    ) -> BoxFuture<(String, Result<Decision, StoreError>)>;

    /// The decision at once, when the store takes it in process
    /// ([`MemoryStore`]): no boxed future to allocate
    /// and poll. `None` for any other store.
    fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision>;

    fn release_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        lease: Lease,
    ) -> BoxFuture<Result<(), StoreError>>;

    fn command_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        command: Command,
    ) -> BoxFuture<Result<Decision, StoreError>>;

    fn denials_are_final_dyn(&self, policy: &Policy) -> bool;

    fn share_denials_owned(
        self: Arc<Self>,
        limit: Arc<str>,
        counts: Vec<(String, u64)>,
    ) -> BoxFuture<Result<(), StoreError>>;

    fn shared_denials_owned(
        self: Arc<Self>,
        limit: Arc<str>,
    ) -> BoxFuture<Result<Option<DeniedKeys>, StoreError>>;
}

impl<S: Store> DynStore for S {
    fn check_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
    ) -> BoxFuture<(String, Result<Decision, StoreError>)> {
        Box::pin(async move {
            let outcome = self.check(&key, &policy).await;
            (key, outcome)
        })
    }

    fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision> {
        Store::check_in_process(self, key, policy)
    }

    fn release_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        lease: Lease,
    ) -> BoxFuture<Result<(), StoreError>> {
        Box::pin(async move { self.release(&key, &policy, lease).await })
    }

    fn command_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        command: Command,
    ) -> BoxFuture<Result<Decision, StoreError>> {
        Box::pin(async move { self.command(&key, &policy, command).await })
    }

    fn denials_are_final_dyn(&self, policy: &Policy) -> bool {
        self.denials_are_final(policy)
    }

    fn share_denials_owned(
        self: Arc<Self>,
        limit: Arc<str>,
        counts: Vec<(String, u64)>,
    ) -> BoxFuture<Result<(), StoreError>> {
        Box::pin(async move { self.share_denials(&limit, counts).await })
    }

    fn shared_denials_owned(
        self: Arc<Self>,
        limit: Arc<str>,
    ) -> BoxFuture<Result<Option<DeniedKeys>, StoreError>> {
        Box::pin(async move { self.shared_denials(&limit).await })
    }
}
