//! [`Reservation`]: a request admitted against an estimate of its cost,
//! and [`settle`](Reservation::settle), which charges or gives back the
//! difference once the real cost is known (an LLM's tokens, a metered
//! API's units).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{DecidedBy, FailMode, LimitError, Limiter, Verdict};
use crate::decision::Decision;
use crate::key::KeyHash;
use crate::policy::{Algorithm, Policy, PolicyError};
use crate::store::{Command, StoreError, bounded_key};

/// A check admitted (or denied) against an estimate of its cost, to be
/// settled with the real cost once it is known
/// ([`Limiter::reserve`](crate::Limiter::reserve)).
///
/// Dropped without [`settle`](Self::settle), the estimate stands: what a
/// response that never reports its cost leaves.
#[derive(Debug)]
#[must_use = "a reservation is settled with the real cost (dropped, the estimate stands)"]
pub struct Reservation {
    verdict: Verdict,
    pending: Option<Unsettled>,
}

/// What a counted reservation needs to settle: who counted it, under which
/// policy, and when.
#[derive(Debug, Clone)]
pub(crate) struct Unsettled {
    limiter: Limiter,
    /// The key as the limiter holds it ([`bounded_key`]).
    key: String,
    /// The policy that counted the estimate (its cost is the estimate).
    policy: Arc<Policy>,
    decided_by: DecidedBy,
    decision: Decision,
    /// When the check was sent.
    at: Instant,
}

/// What [`Reservation::settle`] did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Settled {
    /// The real cost was the estimate: nothing was sent.
    AsEstimated,
    /// `units` more than the estimate were charged, even past the max:
    /// the key then waits until the excess has drained. The decision is
    /// the key's state after.
    Charged {
        /// The units charged on top of the estimate.
        units: u64,
        /// The key's state after the charge.
        decision: Decision,
    },
    /// `units` of the estimate were given back. The decision is the key's
    /// state after.
    GivenBack {
        /// The units given back.
        units: u64,
        /// The key's state after.
        decision: Decision,
    },
    /// `units` of the estimate were kept: the fixed or sliding window that
    /// counted the request has ended, and giving them back would lend them
    /// to a window that never counted them.
    Kept {
        /// The units the real cost was below the estimate.
        units: u64,
    },
    /// Nothing counted the reservation (it was denied, its key is allowed,
    /// or the store failed and [`FailMode::Open`](crate::FailMode::Open)
    /// admitted it): there is nothing to settle.
    NotCounted,
}

impl Limiter {
    /// Check `key` at an `estimate` of its cost, to [`settle`](Reservation::settle)
    /// the real cost once it is known: the difference is charged (even
    /// past the max: the key waits until the excess drained) or given
    /// back, atomically in the store. An estimate above the largest cost
    /// the policy counts ([`Policy::max_cost`]: its smallest max, and
    /// [`MAX_COST`](crate::policy::MAX_COST) under the sliding log) is
    /// lowered to it; the settlement charges the rest. A reservation is
    /// always checked in the store, never admitted from a
    /// [local quota](Self::with_local_quota)'s batch (whose unused units
    /// the batch gives back itself), so its units are given back exactly.
    ///
    /// ```
    /// use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// let tokens = Limiter::new(MemoryStore::new(), "10000/h".parse::<Policy>()?.gcra()?);
    /// let reservation = tokens.reserve("customer-42", 1000).await?;
    /// assert!(reservation.allowed());
    /// // ... call the model; it reports 1,250 tokens ...
    /// reservation.settle(1250).await?;
    /// // 1,250 spent: a peek says what one more unit would leave.
    /// assert_eq!(tokens.peek("customer-42").await?.remaining(), 10000 - 1250 - 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Errors
    /// A concurrency limit (a slot is a request in flight, not a cost:
    /// [`PolicyError::Unsupported`]), an estimate of 0, or a store failure
    /// under [`FailMode::Closed`].
    pub async fn reserve(&self, key: &str, estimate: u64) -> Result<Reservation, LimitError> {
        let policy = self.estimated(estimate)?;
        let at = Instant::now();
        // Always in the store, under the estimate's policy (never from a
        // local quota's batch, whose units are given back by the batch's
        // own return: a settlement could not give them back exactly).
        let verdict = self
            .start(self.owned_key(key), Some(Arc::clone(&policy)))
            .await?;
        Ok(self.reservation(bounded_key(key).into_owned(), policy, verdict, at))
    }

    /// The check of `key` (as given) under `policy`, the policy
    /// [`estimated`](Self::estimated) gave.
    pub(crate) fn check_estimated(&self, key: String, policy: &Arc<Policy>) -> super::Check {
        if Arc::ptr_eq(policy, &self.inner.policy) {
            self.check_owned(key)
        } else {
            self.start(key, Some(Arc::clone(policy)))
        }
    }

    /// The policy that counts `estimate`, lowered to the largest cost the
    /// policy counts ([`Policy::max_cost`]).
    pub(crate) fn estimated(&self, estimate: u64) -> Result<Arc<Policy>, PolicyError> {
        let policy = &self.inner.policy;
        settleable(policy)?;
        let estimate = estimate.min(policy.max_cost());
        if estimate == policy.cost() {
            return Ok(Arc::clone(policy));
        }
        Ok(Arc::new((**policy).clone().with_cost(estimate)?))
    }

    /// The reservation of `verdict`, a check of `key` (as held) under
    /// `policy` sent at `at`.
    pub(crate) fn reservation(
        &self,
        key: String,
        policy: Arc<Policy>,
        verdict: Verdict,
        at: Instant,
    ) -> Reservation {
        let pending = verdict
            .decision()
            .and_then(|decision| self.unsettled(key, policy, verdict.decided_by(), decision, at));
        Reservation { verdict, pending }
    }

    /// What settling a check of `key` (as held) under `policy`, sent at
    /// `at` and answered `decision` by `decided_by`, needs; `None` when it
    /// counted nothing (denied, or admitted without a store).
    pub(crate) fn unsettled(
        &self,
        key: String,
        policy: Arc<Policy>,
        decided_by: DecidedBy,
        decision: &Decision,
        at: Instant,
    ) -> Option<Unsettled> {
        let counted = decision.allowed()
            && matches!(
                decided_by,
                DecidedBy::Store | DecidedBy::LocalQuota | DecidedBy::Fallback
            );
        counted.then(|| Unsettled {
            limiter: self.clone(),
            key,
            policy,
            decided_by,
            decision: decision.clone(),
            at,
        })
    }
}

/// Whether a cost under `policy` can be settled after the response.
pub(crate) fn settleable(policy: &Policy) -> Result<(), PolicyError> {
    if policy.algorithm() == Algorithm::Concurrency {
        return Err(PolicyError::Unsupported {
            algorithm: Algorithm::Concurrency,
            what: "a cost settled after the response (a slot is one request in flight, not a cost)",
        });
    }
    Ok(())
}

impl Reservation {
    /// Whether the check is admitted.
    pub fn allowed(&self) -> bool {
        self.verdict.allowed()
    }

    /// The check's verdict.
    pub fn verdict(&self) -> &Verdict {
        &self.verdict
    }

    /// How long to wait before a denied check could be admitted.
    pub fn retry_after(&self) -> Duration {
        self.verdict.retry_after()
    }

    /// The estimate counted (0 when nothing counted it).
    pub fn estimate(&self) -> u64 {
        self.pending.as_ref().map_or(0, |p| p.policy.cost())
    }

    /// Settle the reservation at its real `cost`: charge what it exceeds
    /// the estimate by (even past the max), or give back what it falls
    /// short by, in one atomic step in the store, sent once (a lost reply
    /// is not sent again: it counts at most once).
    ///
    /// # Errors
    /// The store failed (or the circuit breaker is open): the estimate
    /// stands. Logged at warn and counted in the metrics
    /// (`ratelimit_settlements_total{result="failed"}`).
    pub async fn settle(self, cost: u64) -> Result<Settled, StoreError> {
        match self.pending {
            Some(pending) => pending.settle(cost).await,
            None => Ok(Settled::NotCounted),
        }
    }
}

impl Unsettled {
    /// The name of the limit that counted it.
    pub(crate) fn limit_name(&self) -> &str {
        self.limiter.name()
    }

    /// The estimate counted.
    pub(crate) fn estimate(&self) -> u64 {
        self.policy.cost()
    }

    /// [`Reservation::settle`].
    pub(crate) async fn settle(self, cost: u64) -> Result<Settled, StoreError> {
        let estimate = self.estimate();
        let name = self.limiter.name().to_owned();
        let (command, units) = match cost.cmp(&estimate) {
            std::cmp::Ordering::Equal => {
                crate::metrics::settlement(&name, "as_estimated");
                return Ok(Settled::AsEstimated);
            }
            std::cmp::Ordering::Greater => (Command::Penalty(cost - estimate), cost - estimate),
            std::cmp::Ordering::Less => {
                let units = estimate - cost;
                // A window counter's units go back only while the window
                // that counted them lasts.
                if !self.decision.refundable_since(self.at) {
                    crate::metrics::settlement(&name, "kept");
                    return Ok(Settled::Kept { units });
                }
                (
                    super::hooks::give_back(self.decision.refund_id(), units),
                    units,
                )
            }
        };
        match self.send(command).await {
            Ok(decision) => {
                let charged = matches!(command, Command::Penalty(_));
                crate::metrics::settlement(&name, if charged { "charged" } else { "given_back" });
                Ok(if charged {
                    Settled::Charged { units, decision }
                } else {
                    Settled::GivenBack { units, decision }
                })
            }
            Err(error) => {
                crate::metrics::settlement(&name, "failed");
                tracing::warn!(
                    %error,
                    key = %KeyHash::held(&name, &self.key),
                    estimate,
                    cost,
                    "rate limit: settling a cost failed; the estimate stands"
                );
                Err(error)
            }
        }
    }

    /// Send `command` where the reservation was counted: the store, or
    /// the fail mode's fallback store.
    async fn send(&self, command: Command) -> Result<Decision, StoreError> {
        let limiter = &self.limiter;
        if self.decided_by == DecidedBy::Fallback {
            let FailMode::Fallback { store, instances } = limiter.fail_mode() else {
                return Err(StoreError::Unsupported(
                    "settling without the fallback store",
                ));
            };
            let policy = self.policy.shared_by(*instances);
            let key = limiter.store_key(self.key.clone());
            return Ok(store.command_now(&key, &policy, command));
        }
        if limiter.circuit_open() {
            return Err(StoreError::CircuitOpen);
        }
        limiter
            .command_counted(&self.key, Arc::clone(&self.policy), command)
            .await
    }
}
