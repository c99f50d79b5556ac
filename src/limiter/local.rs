//! Local-first limiting of hot keys ([`LocalQuota`]): each process takes a
//! batch of a key's quota from the store at once and admits from it
//! locally, so a hot key costs the store one check per batch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Check, LimitError, Limiter, Source, Verdict};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy, PolicyError};

/// How a [`Limiter`] admits hot keys locally
/// ([`Limiter::with_local_quota`]): a check of a key this process holds no
/// units of takes `batch` units from the store in one check (all or
/// nothing, like any check of that cost), admits this request and keeps
/// the rest; the next checks of the key take a kept unit with no round
/// trip. Kept units are used for at most `hold` (for the fixed window, at
/// most until the window that counted them ends) and then dropped, still
/// counted: unused units are quota this process took and did not use.
///
/// When the store cannot give a whole batch, the check falls back to an
/// ordinary check of one request, and the key's checks stay checks of one
/// request until that refusal's wait ends (at most `hold`): a key near its
/// limit is decided exactly, request by request, one round trip each.
///
/// **The bound.** Every unit a process admits was counted in the store
/// before it was used. With `N` processes, at most `N × batch` units are
/// held at any moment, so in any window of the policy at most `N × batch`
/// more requests are admitted than the algorithm alone admits: under the
/// sliding log at most `max + N × batch` (a unit counted at `t` and used
/// until `t + hold` can leave the store's window before the request it
/// admitted does), under GCRA and the sliding window counter `N × batch`
/// more than their own bursts (each alone can admit up to `2 × max − 1` in
/// one sliding window); under the fixed window none more: at most `max` in
/// each of its windows (a unit is only used in the window that counted
/// it). A key then costs the store one check per
/// `batch` admitted requests (plus one per denial that the deny cache does
/// not answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalQuota {
    batch: u64,
    hold: Duration,
}

impl LocalQuota {
    /// Take `batch` units at a time (lowered to the policy's smallest max),
    /// each used within `hold` of being taken.
    ///
    /// # Errors
    /// A batch under 2 (nothing would be kept) or a zero `hold`.
    pub fn new(batch: u64, hold: Duration) -> Result<Self, PolicyError> {
        if batch < 2 {
            return Err(PolicyError::Invalid {
                input: batch.to_string(),
                reason: "a local quota's batch must be at least 2 units".to_owned(),
            });
        }
        if hold.is_zero() {
            return Err(PolicyError::Invalid {
                input: "0".to_owned(),
                reason: "a local quota's hold must be longer than zero".to_owned(),
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
}

/// At most this many keys are held locally; past it, keys are checked in
/// the store as without a local quota.
const MAX_LOCAL_KEYS: usize = 10_000;

/// The units of each key this process holds.
pub(crate) struct Local {
    config: LocalQuota,
    /// The batch for this limiter's policy.
    batch: u64,
    keys: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Units>>>>,
}

#[derive(Default)]
struct Units {
    left: u64,
    until: Option<Instant>,
    /// Until when the store could not give a whole batch: checks of one
    /// request meanwhile, without asking for a batch first.
    no_batch_until: Option<Instant>,
    /// The decision of the check that took them (what a local admission
    /// shows).
    decision: Option<Decision>,
}

impl Units {
    /// Take one kept unit, if any is still usable.
    fn take(&mut self) -> Option<Verdict> {
        if self.left == 0 || self.until.is_none_or(|until| Instant::now() >= until) {
            self.left = 0;
            return None;
        }
        self.left -= 1;
        Some(Verdict {
            decision: self.decision.clone(),
            source: Source::LocalQuota,
            permit: None,
        })
    }
}

impl Local {
    pub(crate) fn new(config: LocalQuota, policy: &Policy) -> Result<Self, PolicyError> {
        if policy.algorithm() == Algorithm::Concurrency {
            return Err(PolicyError::Unsupported {
                algorithm: policy.algorithm(),
                what: "a local quota (a slot is one request in flight)",
            });
        }
        let smallest = policy.rates().iter().map(|r| r.max()).min().unwrap_or(1);
        let batch = config
            .batch
            .saturating_mul(policy.cost())
            .min(smallest)
            .min(crate::policy::MAX_COST);
        Ok(Self {
            config,
            batch,
            keys: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn config(&self) -> LocalQuota {
        self.config
    }

    fn units_of(&self, key: &str) -> Option<Arc<tokio::sync::Mutex<Units>>> {
        let mut keys = match self.keys.lock() {
            Ok(keys) => keys,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(units) = keys.get(key) {
            return Some(Arc::clone(units));
        }
        if keys.len() >= MAX_LOCAL_KEYS {
            // Forget keys holding nothing usable; if all hold some, check
            // this one in the store.
            keys.retain(|_, units| {
                units.try_lock().map_or(true, |u| {
                    u.left > 0 && u.until.is_some_and(|t| Instant::now() < t)
                })
            });
            if keys.len() >= MAX_LOCAL_KEYS {
                return None;
            }
        }
        let units = Arc::new(tokio::sync::Mutex::new(Units::default()));
        keys.insert(key.to_owned(), Arc::clone(&units));
        Some(units)
    }

    /// The check of `key` (as given, not namespaced) at the policy's cost.
    pub(crate) fn check(self: &Arc<Self>, limiter: &Limiter, key: String) -> Check {
        let Some(units) = self.units_of(&key) else {
            return limiter.start_in_store(key, None);
        };
        if let Ok(mut held) = units.try_lock()
            && let Some(verdict) = held.take()
        {
            crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Allowed);
            return Check::done(Ok(verdict));
        }
        let (local, limiter) = (Arc::clone(self), limiter.clone());
        Check::boxed(Box::pin(async move {
            // One refill at a time per key: the others wait for its units.
            let mut held = units.lock().await;
            if let Some(verdict) = held.take() {
                crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Allowed);
                return Ok(verdict);
            }
            local.refill(&limiter, key, &mut held).await
        }))
    }

    async fn refill(
        &self,
        limiter: &Limiter,
        key: String,
        held: &mut Units,
    ) -> Result<Verdict, LimitError> {
        // A key this process holds a denial for is denied without asking.
        if let Some(denied) = limiter.cached_denial(&key) {
            crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Limited);
            return Ok(Verdict {
                decision: Some(denied),
                source: Source::DenyCache,
                permit: None,
            });
        }
        let cost = limiter.policy().cost();
        let batch_refused = held.no_batch_until.is_some_and(|t| Instant::now() < t);
        if self.batch > cost && !batch_refused {
            let policy = Arc::new(limiter.policy().clone().with_cost(self.batch)?);
            // Before the store decided: what the store's times are counted
            // from is later, so the units never outlive their window.
            let sent = Instant::now();
            let verdict = limiter.start_in_store(key.clone(), Some(policy)).await?;
            if verdict.allowed() && verdict.source() == Source::Store {
                let decision = verdict.decision().cloned();
                let mut until = sent + self.config.hold;
                if let Some(d) = &decision
                    && d.algorithm() == Algorithm::FixedWindow
                {
                    // Used only in the window that counted them.
                    let window_left = d
                        .rates()
                        .iter()
                        .map(|r| r.reset())
                        .min()
                        .unwrap_or_default();
                    until = until.min(sent + window_left);
                }
                held.left = (self.batch - cost) / cost;
                held.until = Some(until);
                held.decision = decision;
                return Ok(verdict);
            }
            if verdict.allowed() {
                // Admitted without the store (fail open, fallback): keep
                // nothing.
                return Ok(verdict);
            }
            // Not a whole batch until the refusal's wait ends (at most
            // `hold`): one request at a time till then, one round trip each.
            let wait = verdict.retry_after().min(self.config.hold);
            held.no_batch_until = Some(sent + wait);
        }
        // Not a whole batch left: one request, exactly.
        limiter.start_in_store(key, None).await
    }
}
