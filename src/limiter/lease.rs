//! [`Permit`]: a concurrency slot, given back when dropped.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::decision::{Decision, Lease};
use crate::policy::Policy;
use crate::store::{DynStore, StoreError};

/// An admission from [`Limiter::acquire`](crate::Limiter::acquire) (or
/// [`Verdict::into_permit`](crate::Verdict::into_permit)): under a
/// [`Concurrency`](crate::Algorithm::Concurrency) policy it holds a slot,
/// given back when the permit is dropped (the work finished, failed,
/// panicked or was cancelled) or [released](Self::release). A slot whose
/// process died frees itself when its lease expires.
pub struct Permit {
    decision: Option<Decision>,
    held: Option<Held>,
}

/// A slot to give back.
struct Held {
    /// The store that granted the lease (the fallback's, during an outage).
    store: Arc<dyn DynStore>,
    policy: Arc<Policy>,
    key: String,
    lease: Lease,
}

impl Permit {
    pub(crate) fn new(
        store: Arc<dyn DynStore>,
        policy: Arc<Policy>,
        key: String,
        lease: Lease,
        decision: Option<Decision>,
    ) -> Self {
        Self {
            decision,
            held: Some(Held {
                store,
                policy,
                key,
                lease,
            }),
        }
    }

    pub(crate) fn without_lease(decision: Option<Decision>) -> Self {
        Self {
            decision,
            held: None,
        }
    }

    /// The decision that admitted it (none when nothing limited it).
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// The slot held, if any.
    pub fn lease(&self) -> Option<Lease> {
        self.held.as_ref().map(|held| held.lease)
    }

    /// Give the slot back now, and say whether the store took it back (on
    /// an error the slot frees itself when its lease expires).
    pub async fn release(mut self) -> Result<(), StoreError> {
        match self.held.take() {
            Some(held) => {
                held.store
                    .release_owned(held.key, held.policy, held.lease)
                    .await
            }
            None => Ok(()),
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("lease", &self.lease())
            .finish_non_exhaustive()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        // Outside a runtime nothing can run the release (and polling a
        // Redis release there would panic): the lease expires on its own.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "no tokio runtime to release a concurrency lease; it frees itself when it expires"
            );
            return;
        };
        let mut release = held.store.release_owned(held.key, held.policy, held.lease);
        // Poll once here: an in-process store releases at once, so the slot
        // is free before the next check. A store that must wait (Redis) goes
        // on in a task.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match release.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(error)) => {
                tracing::warn!(%error, "could not release a concurrency lease; it frees itself when it expires");
            }
            Poll::Pending => {
                runtime.spawn(async move {
                    if let Err(error) = release.await {
                        tracing::warn!(%error, "could not release a concurrency lease; it frees itself when it expires");
                    }
                });
            }
        }
    }
}
