//! Where the state of every key lives: the [`Store`] trait, and the
//! in-process and Redis stores.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::{Decision, Lease};
use crate::policy::Policy;

pub mod memory;
pub mod redis;

/// Keeps the state of every limited key and takes the decision for one
/// request, atomically.
///
/// Implement it to put the state somewhere else; the crate ships
/// [`MemoryStore`](memory::MemoryStore) and [`RedisStore`](redis::RedisStore).
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

    /// Give back the concurrency slot `lease` of `key`, taken by an admitted
    /// [`Concurrency`](crate::Algorithm::Concurrency) check. The default does
    /// nothing (for stores without that algorithm).
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

/// Why a store could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// No answer within the store's timeout.
    #[error("no answer from the store within {0:?}")]
    Timeout(Duration),
    /// Not asked: the layer's circuit breaker is open after a run of
    /// failures.
    #[error("not asked: the circuit breaker is open after repeated store failures")]
    CircuitOpen,
    /// No connection came free in the pool's connection timeout.
    #[error("no redis connection came free in the pool's connection timeout")]
    PoolTimeout,
    /// Redis answered something the store did not expect.
    #[error("unexpected reply from redis: {0}")]
    UnexpectedReply(String),
}

/// The longest `retry_after` of a denied concurrency request: slots usually
/// free within one request's duration, long before the oldest lease expires,
/// and the limiter cannot know when.
pub const CONCURRENCY_RETRY_CAP: Duration = Duration::from_secs(1);

/// Keys longer than this many bytes are stored under their hash.
pub const MAX_RAW_KEY_LEN: usize = 128;

/// `key` itself when it is short and cannot break a Redis hash tag;
/// otherwise `#` and its SHA-1 (a fixed hash, the same in every process), so
/// a client-chosen key bounds the memory it takes and cannot break the key
/// layout. A raw key never starts with `#`, so the two cannot meet.
pub(crate) fn bounded_key(key: &str) -> std::borrow::Cow<'_, str> {
    let needs_hash = key.len() > MAX_RAW_KEY_LEN
        || key.starts_with('#')
        || key.bytes().any(|b| b == b'{' || b == b'}');
    if needs_hash {
        std::borrow::Cow::Owned(format!(
            "#{}",
            sha1_smol::Sha1::from(key.as_bytes()).digest()
        ))
    } else {
        std::borrow::Cow::Borrowed(key)
    }
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

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
    /// ([`MemoryStore`](memory::MemoryStore)): no boxed future to allocate
    /// and poll. `None` for any other store.
    fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision>;

    fn release_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        lease: Lease,
    ) -> BoxFuture<Result<(), StoreError>>;

    fn denials_are_final_dyn(&self, policy: &Policy) -> bool;
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
        let store: &dyn std::any::Any = self;
        store
            .downcast_ref::<memory::MemoryStore>()
            .map(|memory| memory.check_now(key, policy))
    }

    fn release_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
        lease: Lease,
    ) -> BoxFuture<Result<(), StoreError>> {
        Box::pin(async move { self.release(&key, &policy, lease).await })
    }

    fn denials_are_final_dyn(&self, policy: &Policy) -> bool {
        self.denials_are_final(policy)
    }
}
