//! What the rest of the crate asks of a [`Limiter`] beyond its public
//! API: the rules (a limiter per rule, the first look at cached denials,
//! refunds), the admin router (commands on a key as the limiter holds it,
//! the most denied keys), the local quota and the metrics.

use std::sync::Arc;

use super::breaker::Breaker;
use super::{
    DecidedBy, FailMode, LimitError, Limiter, Verdict, bounded_key, classify, local, names,
};
use crate::decision::{Decision, RateStatus};
use crate::metrics::Outcome;
use crate::policy::Policy;
use crate::store::{Command, StoreError};

impl Limiter {
    /// Count the verdict of a check of `key` (as held: [`bounded_key`](crate::store::bounded_key), not
    /// namespaced) in the metrics, and a denial among the limiter's most denied keys
    /// (sharing them through the store when a share is due).
    #[inline(always)]
    pub(crate) fn counted(
        &self,
        key: &str,
        verdict: Result<Verdict, LimitError>,
    ) -> Result<Verdict, LimitError> {
        if !self.inner.counted {
            return verdict;
        }
        // Without the metrics, only a denial is recorded (among the most
        // denied keys).
        if !cfg!(feature = "metrics") && verdict.as_ref().is_ok_and(Verdict::allowed) {
            return verdict;
        }
        let (outcome, decider) = classify(&verdict);
        crate::metrics::decision(&self.inner.name, outcome, decider);
        if matches!(outcome, Outcome::Denied | Outcome::Blocked) {
            self.denied(key);
        }
        verdict
    }

    /// Count `denied`, a denial the deny cache gave `key` (as given) before
    /// any check was started (the rules' first look).
    pub(crate) fn count_cached_denial(&self, key: &str, denied: &Decision) {
        let verdict = Verdict::without_permit(Some(denied.clone()), DecidedBy::DenyCache);
        let _counted = self.counted(&bounded_key(key), Ok(verdict));
    }

    /// The same limiter, whose verdicts are not counted.
    pub(crate) fn uncounted(self) -> Self {
        self.map(|s| s.counted = false)
    }

    /// Count the denials of this limiter and of every limiter derived
    /// from it (a rule set's) from now on.
    pub(crate) fn watch_denials(&self) {
        self.inner.registry.watch();
    }

    /// Count a denial of `key` among the limit's most denied keys.
    pub(crate) fn denied(&self, key: &str) {
        let Some(counts) = self.inner.denials.record(key, std::time::Instant::now()) else {
            return;
        };
        // Shared in the background, when there is a runtime to do it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let share = Arc::clone(&self.inner.store)
                .share_denials_owned(Arc::clone(&self.inner.name), counts);
            runtime.spawn(async move {
                if let Err(error) = share.await {
                    tracing::warn!(%error, "rate limit: sharing the most denied keys failed; those counts are lost");
                }
            });
        }
    }

    /// A limiter like this one (same store, fail mode, breaker and deny
    /// cache, shared) for `policy`, named as the rule: one per rule and
    /// tier of a rule set, all counting under the rule's name.
    pub(crate) fn for_rule(&self, rule: &str, policy: Policy) -> Self {
        // Counted under the rule's name alone: a changed policy (or another
        // tier's) applies to the same counts (the store keeps each
        // algorithm's state apart, and each window's counters apart).
        let name = rule.to_owned();
        self.clone().map(|s| {
            if let FailMode::Fallback { instances, .. } = &s.fail_mode {
                s.fallback_policy = Some(Arc::new(policy.shared_by(*instances)));
            }
            s.set_name(Arc::from(name));
            // One count, one set of units held: a rule's tiers share them.
            s.local = s.local.as_ref().and_then(|l| {
                let held = local::Local::held_of(&s.held, &s.name);
                local::Local::new(l.config(), &policy, held)
                    .ok()
                    .map(Arc::new)
            });
            s.final_denials = s.store.denials_are_final_dyn(&policy);
            s.policy = Arc::new(policy);
            s.denials = s.registry.of(&s.name);
            names::claim_or_warn(&s.name, names::Owner::Rule, &s.denials);
            s.allowed = Arc::default();
        })
    }

    /// This limiter asking its count under `policy` (of the same
    /// algorithm) instead of its own: the same name, store and settings,
    /// so the same count.
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    pub(crate) fn with_policy(&self, policy: Policy) -> Self {
        self.clone().map(|s| {
            s.final_denials = s.store.denials_are_final_dyn(&policy);
            s.policy = Arc::new(policy);
        })
    }

    /// Whether this limiter's circuit breaker is open (or probing): a check
    /// now is failed fast, or is the one probe let through.
    pub(crate) fn circuit_open(&self) -> bool {
        self.inner.breaker.as_deref().is_some_and(Breaker::is_open)
    }

    /// The denial this process holds for `key` in its deny cache, if the
    /// cache may answer for this limiter: a check of `key` now would be
    /// denied without asking the store.
    pub(crate) fn cached_denial(&self, key: &str) -> Option<Decision> {
        self.cached_denial_held(&bounded_key(key))
    }

    /// [`cached_denial`](Self::cached_denial) of `key` as this limiter
    /// holds it ([`bounded_key`](crate::store::bounded_key)).
    pub(crate) fn cached_denial_held(&self, key: &str) -> Option<Decision> {
        self.cached(&self.store_key(key.to_owned()))
    }

    /// The deny cache's denial of store key `key`, when it may answer for
    /// this limiter and was decided under this limiter's rates: a rule's
    /// tiers, or its policy before a reload, share its counts and the
    /// cache, but not each other's denials.
    #[inline]
    pub(crate) fn cached(&self, key: &str) -> Option<Decision> {
        self.usable_deny_cache()?.get(key).filter(|denied| {
            denied.rates().iter().map(RateStatus::rate).eq(self
                .inner
                .policy
                .rates()
                .iter()
                .copied())
        })
    }

    /// Run `command` on `key` as this limiter holds it: as given when it
    /// is short, else its hashed form ([`bounded_key`](crate::store::bounded_key)), the form
    /// [`most_denied`](Self::most_denied) shows (so an operator can steer
    /// a key too long to be shown).
    pub(crate) async fn command_limited(
        &self,
        key: &str,
        command: Command,
    ) -> Result<Decision, StoreError> {
        self.command_under(key, Arc::clone(&self.inner.policy), command)
            .await
    }

    /// [`command_limited`](Self::command_limited) under `policy` (a local
    /// quota gives units back under the policy that took them).
    async fn command_under(
        &self,
        key: &str,
        policy: Arc<Policy>,
        command: Command,
    ) -> Result<Decision, StoreError> {
        let outcome = self.command_counted(key, policy, command).await;
        // Units held here would admit past a block, or past a penalty's
        // count: drop them (other processes hold theirs for at most their
        // hold).
        if matches!(
            command,
            Command::Block(_) | Command::Penalty(_) | Command::Reset
        ) && let Some(local) = &self.inner.local
        {
            local.forget(key);
        }
        outcome
    }

    /// Run `command` on `key` (as held) under `policy` as part of the
    /// counting itself (a settlement, a refund): the units this process
    /// holds stay, since they are counted in the store already.
    pub(crate) async fn command_counted(
        &self,
        key: &str,
        policy: Arc<Policy>,
        command: Command,
    ) -> Result<Decision, StoreError> {
        let key = self.store_key(key.to_owned());
        let outcome = Arc::clone(&self.inner.store)
            .command_owned(key.clone(), policy, command)
            .await;
        // A command that changes the key (even one whose reply was lost: it
        // may have run) makes this process's cached denial stale. A peek
        // changes nothing, and leaves a flooded key's denial cached.
        if command != Command::Peek
            && let Some(cache) = &self.inner.deny_cache
        {
            cache.remove(&key);
        }
        outcome
    }

    /// Give back one admitted check of `key` costing `units`, whose
    /// decision carried `id` ([`Command::Refund`]); without one, a reward.
    pub(crate) async fn refund(
        &self,
        key: &str,
        id: Option<crate::decision::RefundId>,
        units: u64,
    ) -> Result<Decision, StoreError> {
        let policy = Arc::clone(&self.inner.policy);
        self.give_back(&bounded_key(key), policy, id, units).await
    }

    /// [`refund`](Self::refund) of `key` as this limiter holds it
    /// ([`bounded_key`](crate::store::bounded_key)), under `policy` (the one that took
    /// the units).
    pub(crate) async fn give_back(
        &self,
        key: &str,
        policy: Arc<Policy>,
        id: Option<crate::decision::RefundId>,
        units: u64,
    ) -> Result<Decision, StoreError> {
        self.command_under(key, policy, give_back(id, units)).await
    }

    /// The key as given, of store key `key`, which [`store_key`](Self::store_key)
    /// spelled: what follows the prefix (a length, nothing to compare).
    #[inline]
    pub(crate) fn raw_key<'k>(&self, key: &'k str) -> &'k str {
        debug_assert!(key.starts_with(&*self.inner.key_prefix), "{key}");
        key.get(self.inner.key_prefix.len()..).unwrap_or(key)
    }
}

/// The command that gives back `units` of one admitted check whose
/// decision carried `id` ([`Command::Refund`]); without one, a reward.
pub(crate) fn give_back(id: Option<crate::decision::RefundId>, units: u64) -> Command {
    match id {
        Some(id) => Command::Refund { id, units },
        None => Command::Reward(units),
    }
}
