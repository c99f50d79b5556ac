//! Local-first limiting of hot keys ([`LocalQuota`]): each process takes a
//! batch of a key's quota from the store at once and admits from it
//! locally, so a hot key costs the store one check per batch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Check, Limiter, Source, Verdict};
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
/// A local admission carries the decision of the check that took the
/// batch. `block`, `reset` and `penalty` through the limiter drop what
/// this process holds of the key (other processes use theirs for at most
/// `hold`). A batch is never asked of a fallback store, nor while the
/// circuit is open; one taken by a check cancelled before its answer is
/// spent unused. Units are held per limiter name.
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
    /// Take `batch` requests' worth of quota at a time (`batch` × the
    /// policy's cost units, lowered to the policy's smallest max), each
    /// used within `hold` of being taken.
    ///
    /// # Errors
    /// A batch under 2 (nothing would be kept), or a `hold` of zero or
    /// longer than [`MAX_WINDOW`](crate::MAX_WINDOW).
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
    /// shows: the headers stay those of that check while its units last).
    decision: Option<Decision>,
    /// The verdict of the batch just taken, for the check that took it.
    batch_verdict: Option<Verdict>,
}

impl Units {
    /// Whether the store could not give a batch lately.
    fn batch_refused(&self) -> bool {
        self.no_batch_until.is_some_and(|t| Instant::now() < t)
    }

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
        // Whole requests at the policy's cost, at most the smallest max.
        let cost = policy.cost();
        let smallest = policy.rates().iter().map(|r| r.max()).min().unwrap_or(1);
        let requests = config
            .batch
            .min(smallest / cost)
            .min(crate::policy::MAX_COST / cost);
        if requests < 2 {
            return Err(PolicyError::Invalid {
                input: policy.to_string(),
                reason: "a local quota's batch must hold at least two requests at the \
                         policy's cost within its smallest max"
                    .to_owned(),
            });
        }
        Ok(Self {
            config,
            batch: requests * cost,
            keys: Mutex::new(HashMap::new()),
        })
    }

    /// The same quota, holding no units (for a limiter of another name:
    /// units are counted under a name, and only usable under it).
    pub(crate) fn fresh(&self) -> Self {
        Self {
            config: self.config,
            batch: self.batch,
            keys: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn config(&self) -> LocalQuota {
        self.config
    }

    /// Drop what this process holds of `key` (a command changed it in the
    /// store: a block, a reset, a penalty).
    pub(crate) fn forget(&self, key: &str) {
        let mut keys = match self.keys.lock() {
            Ok(keys) => keys,
            Err(poisoned) => poisoned.into_inner(),
        };
        keys.remove(key);
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
            // Forget keys holding nothing usable that no check is using
            // (a key in use must keep one set of units); if none can go,
            // check this one in the store.
            let now = Instant::now();
            keys.retain(|_, units| {
                Arc::strong_count(units) > 1
                    || units.try_lock().map_or(true, |u| {
                        u.left > 0 && u.until.is_some_and(|t| now < t)
                            || u.no_batch_until.is_some_and(|t| now < t)
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
        if let Ok(mut held) = units.try_lock() {
            if let Some(verdict) = held.take() {
                crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Allowed);
                return Check::done(Ok(verdict));
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
        if let Some(denied) = limiter.cached_denial(&key) {
            crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Limited);
            return Check::done(Ok(Verdict {
                decision: Some(denied),
                source: Source::DenyCache,
                permit: None,
            }));
        }
        let (local, limiter) = (Arc::clone(self), limiter.clone());
        Check::boxed(Box::pin(async move {
            // One refill at a time per key: the others wait for its units.
            let mut held = units.lock().await;
            if let Some(verdict) = held.take() {
                crate::metrics::decision(limiter.name(), crate::metrics::Outcome::Allowed);
                return Ok(verdict);
            }
            if !held.batch_refused()
                && local.refill(&limiter, &key, &mut held).await
                && let Some(verdict) = held.batch_verdict.take()
            {
                return Ok(verdict);
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
    /// fail mode, as without a local quota).
    async fn refill(&self, limiter: &Limiter, key: &str, held: &mut Units) -> bool {
        if limiter.circuit_open() {
            return false;
        }
        let Ok(policy) = limiter.policy().clone().with_cost(self.batch) else {
            return false;
        };
        // A batch is asked for failing closed: a store failure must not
        // charge a batch to the fallback store nor admit one unlimited.
        let strict = limiter.clone().with_fail_mode(super::FailMode::Closed);
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
            until = until.min(sent.checked_add(window_left));
        }
        let cost = limiter.policy().cost();
        held.left = (self.batch - cost) / cost;
        held.until = until;
        held.decision = decision;
        held.batch_verdict = Some(verdict);
        true
    }
}
