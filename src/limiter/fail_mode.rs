//! [`FailMode`]: what a [`Limiter`](crate::Limiter) answers when its store cannot.

use std::sync::Arc;

use super::{DecidedBy, LimitError, Limiter, Verdict};
use crate::policy::Policy;
use crate::store::StoreError;
use crate::store::memory::MemoryStore;

/// What to do when the store cannot decide (Redis down, slow or failing,
/// or the circuit breaker open).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Admit without limiting, and log the failure at warn (the default:
    /// the limiter never takes the service down).
    #[default]
    Open,
    /// Fail: [`Limiter::check`](crate::Limiter::check) returns [`LimitError::Store`], and the layer
    /// answers `503 Service Unavailable`.
    Closed,
    /// Limit in this process while the store fails, with the same policy
    /// divided among `instances` processes (each rate's max divided by
    /// `instances`, rounded down, at least the cost), and go back to the
    /// store when it answers again. Build it with [`FailMode::fallback`](crate::FailMode::fallback).
    /// Decisions of the fallback carry the limit it enforces (the divided
    /// maxes); the layer shows them under the same policy names.
    Fallback {
        /// Where the limits are held meanwhile.
        store: MemoryStore,
        /// How many processes share the limit.
        instances: u32,
    },
}

impl FailMode {
    /// [`FailMode::Fallback`](crate::FailMode::Fallback) to `store`, for `instances` processes sharing
    /// the limit (1 when this process is alone).
    ///
    /// ```
    /// use tower_redis_ratelimit::{FailMode, MemoryStore};
    ///
    /// // Four replicas: while Redis is down each allows a quarter of the limit.
    /// let mode = FailMode::fallback(MemoryStore::new(), 4);
    /// ```
    pub fn fallback(store: MemoryStore, instances: u32) -> Self {
        Self::Fallback {
            store,
            instances: instances.max(1),
        }
    }
}

impl Limiter {
    /// The answer to a check of store key `key` under `policy` that the
    /// store failed with `error`, as the fail mode says.
    pub(super) fn fail(
        &self,
        key: &str,
        policy: &Arc<Policy>,
        error: StoreError,
    ) -> Result<Verdict, LimitError> {
        let then = match &self.inner.fail_mode {
            FailMode::Open => "admitting (FailMode::Open)",
            FailMode::Fallback { .. } => "limiting in process (FailMode::Fallback)",
            FailMode::Closed => "failing (FailMode::Closed)",
        };
        // While the circuit is open nothing was asked: no warning per check.
        if matches!(error, StoreError::CircuitOpen) {
            tracing::debug!("rate limit: circuit open; {then}");
        } else {
            tracing::warn!(%error, "rate limit store failed; {then}");
        }
        match &self.inner.fail_mode {
            FailMode::Open => Ok(Verdict::unlimited(DecidedBy::FailOpen)),
            FailMode::Fallback { store, instances } => {
                let shared;
                let fallback_policy = match &self.inner.fallback_policy {
                    Some(p) if Arc::ptr_eq(policy, &self.inner.policy) => p,
                    _ => {
                        shared = Arc::new(policy.shared_by(*instances));
                        &shared
                    }
                };
                let decision = store.check_now(key, fallback_policy);
                Ok(Verdict::of(
                    &(Arc::new(store.clone()) as Arc<dyn crate::store::DynStore>),
                    fallback_policy,
                    key,
                    decision,
                    DecidedBy::Fallback,
                ))
            }
            FailMode::Closed => Err(LimitError::Store(error)),
        }
    }
}
