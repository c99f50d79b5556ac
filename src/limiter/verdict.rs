//! [`Verdict`]: the answer of a check, and [`DecidedBy`], who gave it.

use std::sync::Arc;
use std::time::Duration;

use super::Permit;
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy};
use crate::store::DynStore;

/// Who answered a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecidedBy {
    /// The store.
    Store,
    /// The deny cache: a denial the store gave earlier, still in force.
    DenyCache,
    /// The fail mode's fallback store, while the store fails.
    Fallback,
    /// Nobody: the store failed and [`FailMode::Open`](crate::FailMode::Open) admitted.
    FailOpen,
    /// Nobody: the key is one of the allowed keys.
    AllowedKey,
    /// A unit this process took from the store earlier
    /// ([`Limiter::with_local_quota`](crate::Limiter::with_local_quota)); the decision is that check's.
    LocalQuota,
}

/// The answer of [`Limiter::check`](crate::Limiter::check): admitted or not, by whom, and the
/// decision (none when nothing limited the check: an allowed key, or a
/// store failure under [`FailMode::Open`](crate::FailMode::Open)).
///
/// Under a [`Concurrency`](crate::Algorithm::Concurrency) policy an admitted
/// verdict holds a slot until it (or the [`Permit`] taken from it) is dropped.
#[derive(Debug)]
#[must_use = "a verdict of a concurrency policy holds its slot until it is dropped"]
pub struct Verdict {
    decision: Option<Decision>,
    decided_by: DecidedBy,
    /// Boxed: a verdict moves several times per request, and only a
    /// concurrency admission holds a permit.
    permit: Option<Box<Permit>>,
}

impl Verdict {
    /// Whether the check is admitted.
    pub fn allowed(&self) -> bool {
        self.decision.as_ref().is_none_or(Decision::allowed)
    }

    /// The decision, when something limited the check.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    /// Who answered.
    pub fn decided_by(&self) -> DecidedBy {
        self.decided_by
    }

    /// How long to wait before a check can be admitted (zero when admitted).
    pub fn retry_after(&self) -> Duration {
        match &self.decision {
            Some(decision) if !decision.allowed() => decision.retry_after(),
            _ => Duration::ZERO,
        }
    }

    /// The concurrency slot this admitted verdict holds, if any: dropping
    /// the permit gives the slot back.
    pub fn into_permit(self) -> Option<Permit> {
        self.permit.map(|permit| *permit)
    }

    /// The decision, who answered, and the permit, apart (what the layer
    /// needs to render a verdict).
    pub fn into_parts(self) -> (Option<Decision>, DecidedBy, Option<Permit>) {
        let (decision, decided_by, permit) = self.into_boxed_parts();
        (decision, decided_by, permit.map(|permit| *permit))
    }

    /// [`into_parts`](Self::into_parts), the permit left in its box (it
    /// moves with the response).
    pub(crate) fn into_boxed_parts(self) -> (Option<Decision>, DecidedBy, Option<Box<Permit>>) {
        (self.decision, self.decided_by, self.permit)
    }

    /// The verdict of `decision` for store key `key` under `policy`,
    /// decided by `decided_by` in `store`: an admitted check of a
    /// concurrency policy holds its slot in a permit (the lease of an
    /// admitted sliding-log check only names its entries, for a refund).
    pub(super) fn of(
        store: &Arc<dyn DynStore>,
        policy: &Arc<Policy>,
        key: &str,
        decision: Decision,
        decided_by: DecidedBy,
    ) -> Self {
        let permit = decision
            .lease()
            .filter(|_| decision.allowed() && policy.algorithm() == Algorithm::Concurrency)
            .map(|lease| {
                Box::new(Permit::new(
                    Arc::clone(store),
                    Arc::clone(policy),
                    key.to_owned(),
                    lease,
                    Some(decision.clone()),
                ))
            });
        Self {
            decision: Some(decision),
            decided_by,
            permit,
        }
    }

    /// The verdict of `decision` by `decided_by`, holding no slot (a
    /// denial, or a unit of the local quota).
    pub(super) fn without_permit(decision: Option<Decision>, decided_by: DecidedBy) -> Self {
        Self {
            decision,
            decided_by,
            permit: None,
        }
    }

    pub(super) fn unlimited(decided_by: DecidedBy) -> Self {
        Self {
            decision: None,
            decided_by,
            permit: None,
        }
    }
}
