//! Where the state of every key lives: the [`Store`] trait, and the
//! in-process and Redis stores.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::Decision;
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
    /// Redis answered something the store did not expect.
    #[error("unexpected reply from redis: {0}")]
    UnexpectedReply(String),
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A [`Store`] behind a pointer, so the layer's types do not name the store.
pub(crate) trait DynStore: Send + Sync + 'static {
    fn check_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
    ) -> BoxFuture<Result<Decision, StoreError>>;
}

impl<S: Store> DynStore for S {
    fn check_owned(
        self: Arc<Self>,
        key: String,
        policy: Arc<Policy>,
    ) -> BoxFuture<Result<Decision, StoreError>> {
        Box::pin(async move { self.check(&key, &policy).await })
    }
}
