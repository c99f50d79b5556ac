//! [`LimitError`]: why a [`Limiter`](crate::Limiter)(super::Limiter) gave no answer.

use crate::decision::Decision;
use crate::policy::PolicyError;
use crate::store::StoreError;

/// Why [`Limiter`](crate::Limiter) could not give an answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LimitError {
    /// Denied, and it would take longer than allowed to be admitted
    /// ([`Limiter::until_ready`](crate::Limiter::until_ready), [`Limiter::acquire`](crate::Limiter::acquire)).
    #[error("rate limited: retry after {:?}", .0.retry_after())]
    Limited(Box<Decision>),
    /// The store failed and the fail mode is
    /// [`FailMode::Closed`](crate::FailMode::Closed). (Operator commands,
    /// which have no fail mode, return a [`StoreError`].)
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The cost asked for cannot be counted under the policy.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl LimitError {
    /// The denial, for [`LimitError::Limited`].
    pub fn decision(&self) -> Option<&Decision> {
        match self {
            Self::Limited(decision) => Some(decision),
            _ => None,
        }
    }
}
