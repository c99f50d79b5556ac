//! [`Rules`]: a rule set served by limiters, one per rule and policy,
//! swapped whole at runtime.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use http::Method;

use super::admission::Admission;
use super::check::{Planned, RulesCheck};
#[cfg(feature = "envoy")]
use super::descriptor::DescriptorIndex;
use super::index::PathIndex;
use super::{Counting, Rule, RuleSet};
use crate::limiter::{CircuitBreaker, FailMode, Limiter};
use crate::policy::{Algorithm, Policy};
use crate::store::Store;

/// A rule set at work: every rule's limiters (one per policy: the default
/// and each tier's), checked together for each request, and replaced as a
/// whole when the rules change ([`replace`](Self::replace)), with no
/// request ever seeing half of a change.
///
/// A rule's counts are kept under the rule's name (and the algorithm, as
/// every limiter's), so they **survive any reload that keeps the rule's
/// name**, a changed max applies to them at once, and a rule's tiers share
/// them: a caller moved to another tier keeps what it used. See the
/// [rules guide](crate::guide::rules#changing-rules-at-runtime) for what a
/// change of window or algorithm does.
///
/// Cheap to clone: clones share the rules.
///
/// ```
/// use http::Method;
/// use tower_redis_ratelimit::MemoryStore;
/// use tower_redis_ratelimit::rules::{Call, RuleSet, Rules};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml(r#"
///     [[rules]]
///     name = "exports"
///     path = "/exports"
///     key = "header:x-tenant"
///     policy = "2/min"
///     tiers = { pro = "100/min" }
/// "#)?);
/// // A worker limiting its jobs by the same rules, without HTTP.
/// let check = |tier| rules.current().check(&Method::POST, "/exports", tier, |_rule| {
///     Ok::<_, std::convert::Infallible>(Some(Call::new("tenant-7")))
/// });
/// assert!(check(None)?.await?.allowed());
/// assert!(check(None)?.await?.allowed());
/// assert!(!check(None)?.await?.allowed());
/// assert!(check(Some("pro"))?.await?.allowed());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Rules {
    inner: Arc<Inner>,
}

struct Inner {
    /// Every rule's limiter is made from this one (store, fail mode,
    /// breaker and deny cache shared).
    template: Limiter,
    current: RwLock<Arc<ActiveRules>>,
}

/// The rules in force at one moment and their limiters: what one request
/// is checked against from start to end, whatever reload happens meanwhile.
pub struct ActiveRules {
    set: RuleSet,
    limiters: Vec<RuleLimiters>,
    /// Which rules may match a path.
    index: PathIndex,
    /// Which descriptor rules a descriptor matches.
    #[cfg(feature = "envoy")]
    descriptors: DescriptorIndex,
}

/// A rule's limiters: its default policy's, and each tier's.
pub(crate) struct RuleLimiters {
    default: Limiter,
    tiers: HashMap<String, Limiter>,
}

/// What one rule counts for one request: its key, and its cost when it is
/// not the rule's own (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    key: String,
    cost: Option<u64>,
}

impl Call {
    /// Count under `key`, at the rule's cost.
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            cost: None,
        }
    }

    /// Cost `cost` units instead of the rule's cost. A cost above the
    /// smallest max of the rule's policy is lowered to it (a request can
    /// never cost more than the whole quota); a cost of 0 is not counted.
    #[must_use]
    pub fn with_cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self
    }
}

impl Rules {
    /// Serve `rules` with limiters on `store` (fail open, with the default
    /// circuit breaker and deny cache, as [`Limiter::new`]).
    pub fn new<St: Store>(store: St, rules: RuleSet) -> Self {
        let template = Limiter::new(
            store,
            "1/s"
                .parse::<Policy>()
                .unwrap_or_else(|_| unreachable!("a valid policy")),
        );
        Self::from_template(template, rules)
    }

    fn from_template(template: Limiter, rules: RuleSet) -> Self {
        let active = ActiveRules::build(&template, rules);
        Self {
            inner: Arc::new(Inner {
                template,
                current: RwLock::new(Arc::new(active)),
            }),
        }
    }

    fn map(self, change: impl FnOnce(Limiter) -> Limiter) -> Self {
        let template = change(self.inner.template.clone());
        let rules = self.current().set.clone();
        Self::from_template(template, rules)
    }

    /// What every rule does when the store fails (default
    /// [`FailMode::Open`]); a fallback store limits each rule by its own
    /// policy shared by the instances.
    #[must_use]
    pub fn with_fail_mode(self, fail_mode: FailMode) -> Self {
        self.map(|l| l.with_fail_mode(fail_mode))
    }

    /// The circuit breaker every rule shares ([`Limiter::with_circuit_breaker`]).
    #[must_use]
    pub fn with_circuit_breaker(self, breaker: CircuitBreaker) -> Self {
        self.map(|l| l.with_circuit_breaker(breaker))
    }

    /// No circuit breaker.
    #[must_use]
    pub fn without_circuit_breaker(self) -> Self {
        self.map(Limiter::without_circuit_breaker)
    }

    /// The deny cache every rule shares ([`Limiter::with_deny_cache`]).
    #[must_use]
    pub fn with_deny_cache(self, capacity: usize) -> Self {
        self.map(|l| l.with_deny_cache(capacity))
    }

    /// No deny cache.
    #[must_use]
    pub fn without_deny_cache(self) -> Self {
        self.map(Limiter::without_deny_cache)
    }

    /// Count the denials of every rule, now and after reloads (for the
    /// admin router's top keys).
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(crate) fn watch_denials(&self) {
        self.inner.template.watch_denials();
    }

    /// A limiter of these rules' store and settings counting under `name`
    /// with `policy` (a front end's limits beside the rules, as Envoy's
    /// descriptors' own).
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    pub(crate) fn limiter_for(&self, name: &str, policy: Policy) -> Limiter {
        self.inner.template.for_rule(name, policy)
    }

    /// The rules in force now.
    pub fn current(&self) -> Arc<ActiveRules> {
        match self.inner.current.read() {
            Ok(current) => Arc::clone(&current),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Put `rules` in force, for every request that starts from now on
    /// (requests under way finish under the rules they started with).
    /// A rule counts under its name: the counts of every rule whose name is
    /// kept carry over, whatever its new policy (another algorithm, or
    /// another window of a windowed counter, starts afresh).
    pub fn replace(&self, rules: RuleSet) {
        let active = Arc::new(ActiveRules::build(&self.inner.template, rules));
        match self.inner.current.write() {
            Ok(mut current) => *current = active,
            Err(poisoned) => *poisoned.into_inner() = active,
        }
    }
}

impl fmt::Debug for Rules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rules")
            .field("rules", &self.current().set)
            .finish_non_exhaustive()
    }
}

impl ActiveRules {
    fn build(template: &Limiter, set: RuleSet) -> Self {
        let limiters = set
            .rules()
            .iter()
            .map(|rule| {
                // A rule counting by outcome, or settling its cost after
                // the response, gives units back all the time: a denial
                // held in this process could refuse a request the store
                // would admit after another process's refund.
                let make = |policy: &Policy| {
                    let mut limiter = template.for_rule(rule.name(), policy.clone());
                    if *rule.counting() != Counting::All || rule.settle().is_some() {
                        limiter = limiter.without_deny_cache();
                    }
                    if let Some(quota) = rule.local_quota() {
                        // Validated with the rule set against each of its
                        // policies: this cannot fail.
                        limiter = match limiter.clone().with_local_quota(quota) {
                            Ok(local) => local,
                            Err(error) => {
                                tracing::error!(%error, rule = rule.name(), "rules: local quota not applied");
                                limiter
                            }
                        };
                    }
                    limiter
                };
                RuleLimiters {
                    default: make(rule.policy(None)),
                    tiers: rule
                        .tiers()
                        .map(|(tier, policy)| (tier.to_owned(), make(policy)))
                        .collect(),
                }
            })
            .collect();
        let index = PathIndex::new(set.rules());
        #[cfg(feature = "envoy")]
        let descriptors = DescriptorIndex::new(
            set.rules().len(),
            |i| set.rules().get(i)?.descriptor(),
            &set.places,
        );
        Self {
            set,
            limiters,
            index,
            #[cfg(feature = "envoy")]
            descriptors,
        }
    }

    /// The rule set.
    pub fn set(&self) -> &RuleSet {
        &self.set
    }

    /// The limiter of rule `name` for callers of `tier` (for operator
    /// commands: peek, reset, block, penalty, reward of one key).
    pub fn limiter(&self, name: &str, tier: Option<&str>) -> Option<&Limiter> {
        let i = self.position(name)?;
        Some(self.limiters[i].pick(tier))
    }

    /// The rule named `name`.
    pub fn rule(&self, name: &str) -> Option<&Rule> {
        Some(&self.set.rules()[self.position(name)?])
    }

    fn position(&self, name: &str) -> Option<usize> {
        self.set.rules().iter().position(|r| r.name() == name)
    }

    /// The descriptor rules a descriptor of `domain` with `entries` (key,
    /// value) matches, with their limiters, in the set's order.
    #[cfg(feature = "envoy")]
    pub(crate) fn descriptor_rules<'a>(
        &'a self,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> impl Iterator<Item = (&'a Rule, &'a RuleLimiters)> + 'a {
        self.descriptors
            .rules(domain, entries)
            .iter()
            .map(|&i| (&self.set.rules()[i], &self.limiters[i]))
    }

    /// Whether `domain` is a domain of the descriptor rules (or of a
    /// reference-server configuration, even one without limits).
    #[cfg(feature = "envoy")]
    pub(crate) fn knows_domain(&self, domain: &str) -> bool {
        self.descriptors.knows(domain)
    }

    /// Start the check of a request of `method` to `path` by a caller of
    /// `tier`: every matching rule, with the [`Call`] that `call` gives it
    /// (`None`: the rule does not apply to this request, as a header key
    /// without its header).
    ///
    /// The request is admitted when every rule admits it. A denial by one
    /// rule spends no other rule's quota: the units the others took are
    /// given back before the verdict is returned (one more round trip for a
    /// denial). The rules' checks are sent together (one round trip of
    /// latency, not one per rule), and a rule whose key is already denied
    /// in this process's deny cache (at the rule's own cost) denies before
    /// any is sent. This is not one atomic step across keys: for
    /// the round trip between a check and its refund, a unit taken by a
    /// request that ends up denied is spent, and a concurrent request can
    /// be denied for it (never admitted over a limit). Across cluster slots
    /// it is the same: each rule's key is decided atomically on its own.
    ///
    /// # Errors
    /// Whatever `call` returns.
    pub fn check<E>(
        self: &Arc<Self>,
        method: &Method,
        path: &str,
        tier: Option<&str>,
        mut call: impl FnMut(&Rule) -> Result<Option<Call>, E>,
    ) -> Result<RulesCheck, E> {
        let mut planned = Vec::new();
        // The matching rules that check nothing still strip their cost
        // header from the response.
        let mut unchecked = Vec::new();
        let mut skip = |rule: &Rule| unchecked.extend(rule.shared_settle());
        for i in self.index.candidates(path) {
            let rule = &self.set.rules()[i];
            if !rule.matches(method, path) {
                continue;
            }
            let Some(Call { key, cost }) = call(rule)? else {
                // A rule that lets only some keys call refuses a request
                // without a key; any other rule does not apply to it.
                if !rule.admits_keyless() {
                    return Ok(RulesCheck::ready(Admission::forbidden(rule.name())));
                }
                skip(rule);
                continue;
            };
            if !rule.admits(&key) {
                return Ok(RulesCheck::ready(Admission::forbidden(rule.name())));
            }
            if rule.allows(&key) {
                skip(rule);
                continue;
            }
            let limiter = self.limiters[i].pick(tier).clone();
            let policy = limiter.policy();
            let cost = match cost {
                None => policy.cost(),
                // A concurrency slot is one request, whatever it costs.
                Some(_) if policy.algorithm() == Algorithm::Concurrency => policy.cost(),
                Some(0) => {
                    skip(rule);
                    continue;
                }
                Some(cost) => cost.min(policy.max_cost()),
            };
            planned.push(Planned::new(rule, limiter, key, cost));
        }
        Ok(RulesCheck::run(planned, unchecked))
    }
}

impl RuleLimiters {
    /// The limiter of callers of `tier` (the default for an unknown one).
    pub(crate) fn pick(&self, tier: Option<&str>) -> &Limiter {
        tier.and_then(|t| self.tiers.get(t))
            .unwrap_or(&self.default)
    }
}

impl fmt::Debug for ActiveRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActiveRules")
            .field("set", &self.set)
            .finish_non_exhaustive()
    }
}
