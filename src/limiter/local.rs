//! Local-first limiting of hot keys ([`LocalQuota`]): each process takes a
//! batch of a key's quota from the store at once and admits from it
//! locally, so a hot key costs the store one check per batch.
//!
//! When the store cannot give a whole batch, the check falls back to an
//! ordinary check of one request, and the key's checks stay checks of one
//! request until that refusal's wait ends (at most `hold`). A local
//! admission carries the decision of the check that took the batch.
//! `block`, `reset` and `penalty` through the limiter drop what this
//! process holds of the key (other processes use theirs for at most
//! `hold`). A batch is never asked of a fallback store, nor while the
//! circuit is open; one taken by a check cancelled before its answer is
//! spent unused (but for the sliding log's `Transaction` execution, which
//! takes a cancelled check's entries back out). Units are held per count (a limiter's name; a rule's
//! tiers and its reloads share one), one batch of a key at a time, and
//! used only under the policy they were taken under. What a batch leaves
//! unused when it expires goes back to the store (a light client is not
//! locked out by units nobody uses), except a fixed window's whose window
//! ends within a second of the batch's end: they end with it.
//!
//! Making room for a new key costs a check the same whatever the keys held
//! (a bounded look at the oldest keys of one of 16 shards, each with its
//! own lock), so a flood of distinct keys slows neither new keys nor the
//! hot keys held.
//!
//! The bound per algorithm: under the sliding log at most `max + N ×
//! batch` in any window (a unit counted at `t` and used until `t + hold`
//! can leave the store's window before the request it admitted does);
//! under GCRA and the sliding window counter `N × batch` more than their
//! own bursts (each alone can admit up to `2 × max − 1` in one sliding
//! window); under the fixed window none more (a unit is only used in the
//! window that counted it).

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::held::{GiveBack, Held, Registry, Units};
use super::{Check, DecidedBy, Limiter, Verdict};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy, PolicyError, Rate};

/// How a [`Limiter`] admits hot keys locally
/// ([`Limiter::with_local_quota`]): a check of a key this process holds no
/// units of takes `batch` units from the store in one check, admits this
/// request and keeps the rest; the next checks of the key take a kept unit
/// with no round trip. Kept units are used within `hold`; what is left then
/// goes back to the store. A key near its limit is decided in the store,
/// request by request.
///
/// The [production guide](crate::guide::production#hot-keys-a-local-quota)
/// states the bound on what it admits, what a process holds (in keys and
/// bytes), when to use a local quota and how to choose `batch` and
/// `hold`.
///
/// ```
/// use tower_redis_ratelimit::limiter::LocalQuota;
/// use tower_redis_ratelimit::{Limiter, MemoryStore, Policy};
///
/// let quota: LocalQuota = "100/250ms".parse()?; // batches of 100, each used within 250 ms
/// let limiter = Limiter::new(MemoryStore::new(), "10000/s".parse::<Policy>()?).with_local_quota(quota)?;
/// # let _ = limiter;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalQuota {
    batch: u64,
    hold: Duration,
}

impl LocalQuota {
    /// Take `batch` requests' worth of quota at a time (`batch` × the
    /// policy's cost units, lowered to the policy's smallest max), each
    /// used within `hold` of being taken.
    ///
    /// # Errors
    /// A batch under 2 (nothing would be kept), or a `hold` of zero or
    /// longer than [`MAX_WINDOW`](crate::policy::MAX_WINDOW).
    pub fn new(batch: u64, hold: Duration) -> Result<Self, PolicyError> {
        if batch < 2 {
            return Err(PolicyError::Invalid {
                input: batch.to_string(),
                reason: "a local quota's batch must be at least 2 units".to_owned(),
            });
        }
        if hold.is_zero() || hold > crate::policy::MAX_WINDOW {
            return Err(PolicyError::Invalid {
                input: format!("{hold:?}"),
                reason: "a local quota's hold must be longer than zero and at most MAX_WINDOW"
                    .to_owned(),
            });
        }
        Ok(Self { batch, hold })
    }

    /// Units taken from the store at once.
    pub fn batch(&self) -> u64 {
        self.batch
    }

    /// How long taken units may be used.
    pub fn hold(&self) -> Duration {
        self.hold
    }

    /// The units one batch takes under `policy`: `batch` requests at the
    /// policy's cost, at most its smallest max.
    ///
    /// # Errors
    /// A policy this quota cannot serve: a concurrency limit, a minimum
    /// spacing, or a smallest max that holds fewer than two requests.
    pub(crate) fn batch_for(&self, policy: &Policy) -> Result<u64, PolicyError> {
        let unsupported = |what| PolicyError::Unsupported {
            algorithm: policy.algorithm(),
            what,
        };
        if policy.algorithm() == Algorithm::Concurrency {
            return Err(unsupported(
                "a local quota (a slot is one request in flight)",
            ));
        }
        if policy.min_spacing().is_some() {
            return Err(unsupported(
                "a local quota with a minimum spacing (local units would not be spaced)",
            ));
        }
        // Whole requests at the policy's cost, a batch at most the largest
        // cost the policy counts.
        let cost = policy.cost();
        let requests = self.batch.min(policy.max_cost() / cost);
        if requests < 2 {
            return Err(PolicyError::Invalid {
                input: policy.to_string(),
                reason: "a local quota's batch must hold at least two requests at the \
                         policy's cost within its smallest max"
                    .to_owned(),
            });
        }
        Ok(requests * cost)
    }
}

/// `"100/250ms"`: batches of 100 units, each used within 250 ms (the form
/// of `LOCAL_QUOTA` in the example server and of a rule's `local_quota`).
impl FromStr for LocalQuota {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rate: Rate = s.parse().map_err(|_| PolicyError::Invalid {
            input: s.trim().to_owned(),
            reason: "write a local quota as the batch and how long its units are used, \
                     such as \"100/250ms\""
                .to_owned(),
        })?;
        if rate.calendar().is_some() {
            return Err(PolicyError::Invalid {
                input: s.trim().to_owned(),
                reason: "a local quota holds its units for a duration (\"100/250ms\"), \
                         not a calendar period"
                    .to_owned(),
            });
        }
        Self::new(rate.max(), rate.window())
    }
}

/// The local quota of one limiter: its batch, and the units this process
/// holds of its count.
pub(crate) struct Local {
    config: LocalQuota,
    /// The batch for this limiter's policy.
    batch: u64,
    /// Shared by every limiter counting under the same name (a rule's
    /// tiers, its limiters after a reload): one batch per key and count.
    held: Arc<Held>,
}

/// How long before the end of the window that counted them a window
/// counter's units may still go back: given back after it they would come
/// off the next window.
const RETURN_MARGIN: Duration = Duration::from_secs(1);

impl Local {
    /// The local quota `config` for `policy`, holding the units of its
    /// count in `held`.
    pub(crate) fn new(
        config: LocalQuota,
        policy: &Policy,
        held: Arc<Held>,
    ) -> Result<Self, PolicyError> {
        Ok(Self {
            config,
            batch: config.batch_for(policy)?,
            held,
        })
    }

    /// The units of `name`'s count in `registry`.
    pub(crate) fn held_of(registry: &Registry, name: &str) -> Arc<Held> {
        registry.of(name)
    }

    /// The same quota, holding the units in `held` (for a limiter of
    /// another name: units are counted under a name, and only usable
    /// under it).
    pub(crate) fn under(&self, held: Arc<Held>) -> Self {
        Self {
            config: self.config,
            batch: self.batch,
            held,
        }
    }

    pub(crate) fn config(&self) -> LocalQuota {
        self.config
    }

    /// Drop what this process holds of `key` (a command changed it in the
    /// store: a block, a reset, a penalty), giving nothing back.
    pub(crate) fn forget(&self, key: &str) {
        self.held.forget(key);
    }

    /// The check of `key` (as the limiter holds it, not namespaced) at the
    /// policy's cost.
    pub(crate) fn check(self: &Arc<Self>, limiter: &Limiter, key: String) -> Check {
        let Some(units) = self.held.units_of(&key) else {
            return limiter.start_in_store(key, None);
        };
        if let Ok(mut held) = units.try_lock() {
            if let Some(verdict) = held.take(limiter.policy()) {
                return Check::done(limiter.counted(&key, Ok(verdict)));
            }
            if held.batch_refused() {
                // Near the limit: ordinary checks, side by side (the deny
                // cache answers them there).
                drop(held);
                return limiter.start_in_store(key, None);
            }
        }
        // Before waiting for a refill: a key this process holds a denial
        // for is denied without asking. (After the units: a key holding
        // units has no denial here, and a local admission allocates
        // nothing.)
        if let Some(denied) = limiter.cached_denial_held(&key) {
            let verdict = Ok(Verdict::without_permit(Some(denied), DecidedBy::DenyCache));
            return Check::done(limiter.counted(&key, verdict));
        }
        let (local, limiter) = (Arc::clone(self), limiter.clone());
        Check::boxed(Box::pin(async move {
            // One refill at a time per key: the others wait for its units.
            let mut held = units.lock().await;
            if let Some(verdict) = held.take(limiter.policy()) {
                return limiter.counted(&key, Ok(verdict));
            }
            // Units of an expired batch, or taken under another policy (a
            // rule's other tier), go back before a batch is taken: one
            // batch per key and count at a time.
            held.cancel_return();
            if let Some(back) = held.leftover(Instant::now()) {
                give_back(&limiter, &key, back).await;
            }
            if !held.batch_refused()
                && local.refill(&limiter, &key, &mut held, &units).await
                && let Some(verdict) = held.batch_verdict.take()
            {
                return limiter.counted(&key, Ok(verdict));
            }
            // No batch: one request, outside the lock, like any check.
            drop(held);
            limiter.start_in_store(key, None).await
        }))
    }

    /// Ask the store for a batch of `key`: true (its verdict in
    /// `held.batch_verdict`) when the store gave one; false when it could
    /// not (a denial: no batch until that denial's wait ends, at most
    /// `hold`) or failed (the caller's check of one request then meets the
    /// fail mode, as without a local quota). What is left of the batch
    /// when it expires goes back to the store then (`cell` is where the
    /// units live).
    async fn refill(
        &self,
        limiter: &Limiter,
        key: &str,
        held: &mut Units,
        cell: &Arc<tokio::sync::Mutex<Units>>,
    ) -> bool {
        if limiter.circuit_open() {
            return false;
        }
        let Ok(policy) = limiter.policy().clone().with_cost(self.batch) else {
            return false;
        };
        // A batch is asked for failing closed: a store failure must not
        // charge a batch to the fallback store nor admit one unlimited.
        // Uncounted: the request the batch is asked for is counted by the
        // verdict it gets.
        let strict = limiter
            .clone()
            .with_fail_mode(super::FailMode::Closed)
            .uncounted();
        // Before the store decided: what the store's times are counted
        // from is later, so the units never outlive their window.
        let sent = Instant::now();
        let Ok(verdict) = strict
            .start_in_store(key.to_owned(), Some(Arc::new(policy)))
            .await
        else {
            return false;
        };
        if !verdict.allowed() {
            let wait = verdict.retry_after().min(self.config.hold);
            held.no_batch_until = sent.checked_add(wait);
            return false;
        }
        let decision = verdict.decision().cloned();
        let mut until = sent.checked_add(self.config.hold);
        let window_left = decision.as_ref().and_then(Decision::counting_window_left);
        if let (Some(d), Some(left)) = (&decision, window_left)
            && d.algorithm() == Algorithm::FixedWindow
        {
            // Used only in the window that counted them.
            until = until.min(sent.checked_add(left));
        }
        let cost = limiter.policy().cost();
        held.cancel_return();
        held.left = (self.batch - cost) / cost;
        held.until = until;
        held.policy = Some(Arc::new(limiter.policy().clone()));
        held.batch += 1;
        held.return_by =
            window_left.and_then(|left| sent.checked_add(left.saturating_sub(RETURN_MARGIN)));
        held.refund_id = decision.as_ref().and_then(Decision::refund_id);
        held.decision = decision;
        held.batch_verdict = Some(verdict);
        if let Some(until) = until {
            held.return_task = self.return_at(limiter, key, cell, held.batch, until);
        }
        true
    }

    /// When batch number `batch` of `key` expires (at `until`), give what
    /// is left of it back to the store, unless it was replaced or
    /// forgotten meanwhile: a unit nobody used must not hold a light
    /// user's quota for the rest of the window.
    fn return_at(
        &self,
        limiter: &Limiter,
        key: &str,
        cell: &Arc<tokio::sync::Mutex<Units>>,
        batch: u64,
        until: Instant,
    ) -> Option<tokio::task::AbortHandle> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (limiter, key, cell) = (limiter.clone(), key.to_owned(), Arc::clone(cell));
        let task = runtime.spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await;
            let back = {
                let mut held = cell.lock().await;
                if held.batch != batch {
                    return;
                }
                // This task: done once it has given back.
                held.return_task = None;
                held.leftover(Instant::now())
            };
            if let Some(back) = back {
                give_back(&limiter, &key, back).await;
            }
        });
        Some(task.abort_handle())
    }
}

/// Give `units` of `key` (as held) back to the store: the batch's own
/// entries where the algorithm keeps them (its refund id), else as a
/// reward. A failure leaves them counted, as before they were returned.
async fn give_back(limiter: &Limiter, key: &str, (units, id, policy): GiveBack) {
    if let Err(error) = limiter.give_back(key, policy, id, units).await {
        tracing::debug!(%error, "local quota: unused units not given back; they stay counted");
    }
}

#[cfg(test)]
mod tests;
