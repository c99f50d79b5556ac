//! [`Rules`]: a rule set served by limiters, one per rule and policy,
//! swapped whole at runtime.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Method;

use super::{Counting, Rule, RuleSet};
use crate::decision::Decision;
use crate::limiter::{CircuitBreaker, DecidedBy, FailMode, LimitError, Limiter, Permit};
use crate::policy::{Algorithm, Policy};
use crate::store::Store;

/// A rule set at work: every rule's limiters (one per policy: the default
/// and each tier's), checked together for each request, and replaced as a
/// whole when the rules change ([`replace`](Self::replace)), with no
/// request ever seeing half of a change.
///
/// A rule's counts are kept under `{rule}@{policy}` (the policy as in
/// [`Limiter::with_name`]), so they **survive a reload while the rule's
/// name and policy are unchanged**, and a changed policy starts afresh.
/// Tiers with the same policy share counts.
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
}

struct RuleLimiters {
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

    /// The rules in force now.
    pub fn current(&self) -> Arc<ActiveRules> {
        match self.inner.current.read() {
            Ok(current) => Arc::clone(&current),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Put `rules` in force, for every request that starts from now on
    /// (requests under way finish under the rules they started with).
    /// Counts of rules whose name and policy are unchanged carry over.
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
                // A rule counting by outcome gives units back all the time:
                // a denial held in this process could refuse a request the
                // store would admit after another request's refund.
                let make = |policy: &Policy| {
                    let mut limiter = template.for_rule(rule.name(), policy.clone());
                    if *rule.counting() != Counting::All {
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
        Self { set, limiters }
    }

    /// The rule set.
    pub fn set(&self) -> &RuleSet {
        &self.set
    }

    /// The limiter of rule `name` for callers of `tier` (for operator
    /// commands: peek, reset, block, penalty, reward of one key).
    pub fn limiter(&self, name: &str, tier: Option<&str>) -> Option<&Limiter> {
        let i = self.set.rules().iter().position(|r| r.name() == name)?;
        Some(self.limiters[i].pick(tier))
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
        for (i, rule) in self.set.rules().iter().enumerate() {
            if !rule.matches(method, path) {
                continue;
            }
            let Some(Call { key, cost }) = call(rule)? else {
                // A rule that lets only some keys call refuses a request
                // without a key; any other rule does not apply to it.
                if !rule.admits_keyless() {
                    return Ok(RulesCheck::ready(Admission::forbidden(rule.name())));
                }
                continue;
            };
            if !rule.admits(&key) {
                return Ok(RulesCheck::ready(Admission::forbidden(rule.name())));
            }
            if rule.allows(&key) {
                continue;
            }
            let limiter = self.limiters[i].pick(tier).clone();
            let policy = limiter.policy();
            let cost = match cost {
                None => policy.cost(),
                // A concurrency slot is one request, whatever it costs.
                Some(_) if policy.algorithm() == Algorithm::Concurrency => policy.cost(),
                Some(0) => continue,
                Some(cost) => cost
                    .min(policy.rates().iter().map(|r| r.max()).min().unwrap_or(1))
                    .min(crate::policy::MAX_COST),
            };
            planned.push(Planned {
                rule: rule.shared_name(),
                counting: rule.counting().clone(),
                block: rule.block(),
                limiter,
                key,
                cost,
            });
        }
        Ok(RulesCheck::run(planned))
    }
}

impl RuleLimiters {
    fn pick(&self, tier: Option<&str>) -> &Limiter {
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

struct Planned {
    rule: Arc<str>,
    counting: Counting,
    block: Option<Duration>,
    limiter: Limiter,
    key: String,
    cost: u64,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The future of [`ActiveRules::check`].
#[must_use = "a check does nothing unless awaited"]
pub struct RulesCheck {
    state: Option<Result<Admission, BoxFuture<Result<Admission, LimitError>>>>,
}

impl RulesCheck {
    fn ready(admission: Admission) -> Self {
        Self {
            state: Some(Ok(admission)),
        }
    }

    fn run(planned: Vec<Planned>) -> Self {
        if planned.is_empty() {
            return Self::ready(Admission::default());
        }
        Self {
            state: Some(Err(Box::pin(decide(planned)))),
        }
    }
}

impl fmt::Debug for RulesCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RulesCheck")
    }
}

impl Future for RulesCheck {
    type Output = Result<Admission, LimitError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.state.as_mut() {
            Some(Err(future)) => {
                let out = std::task::ready!(future.as_mut().poll(cx));
                self.state = None;
                Poll::Ready(out)
            }
            Some(Ok(_)) => match self.state.take() {
                Some(Ok(admission)) => Poll::Ready(Ok(admission)),
                _ => unreachable!("matched just above"),
            },
            None => Poll::Ready(Err(LimitError::Store(
                crate::store::StoreError::UnexpectedReply(
                    "a rules check polled after it completed".into(),
                ),
            ))),
        }
    }
}

async fn decide(planned: Vec<Planned>) -> Result<Admission, LimitError> {
    // A key this process already holds a denial for denies at once: the
    // other rules are not asked, so a flood from a denied key costs the
    // store nothing and spends no other rule's quota.
    for p in &planned {
        // (The cache holds denials at the policy's own cost: a cheaper
        // request might be admitted.)
        if p.cost != p.limiter.policy().cost() {
            continue;
        }
        if let Some(denied) = p.limiter.cached_denial(&p.key) {
            crate::metrics::decision(p.limiter.name(), crate::metrics::Outcome::Limited);
            let shown = Checked::new(p, Some(denied), DecidedBy::DenyCache, None);
            return Ok(Admission {
                allowed: false,
                shown: Some(0),
                checks: vec![shown],
                forbidden: None,
            });
        }
    }
    let started = Instant::now();
    let check = |p: &Planned| {
        let limiter = p.limiter.clone();
        let key = p.key.clone();
        let cost = p.cost;
        async move { limiter.check_n(&key, cost).await }
    };
    // The rules share one circuit breaker. While it is open, its next check
    // is the probe and it fails every other fast until the probe answers:
    // sent together, the probe's own siblings would fail (or, failing open,
    // admit uncounted) although the store answers. So one rule's check goes
    // first, alone, and the others follow its answer.
    let mut verdicts = Vec::with_capacity(planned.len());
    let mut rest = &planned[..];
    if let [first, others @ ..] = rest
        && first.limiter.circuit_open()
    {
        verdicts.push(check(first).await);
        rest = others;
    }
    verdicts.extend(futures_util::future::join_all(rest.iter().map(check)).await);
    let mut checks = Vec::with_capacity(planned.len());
    let mut failure = None;
    for (p, verdict) in planned.iter().zip(verdicts) {
        match verdict {
            Ok(verdict) => {
                let (decision, decided_by, permit) = verdict.into_parts();
                let mut checked = Checked::new(p, decision, decided_by, permit);
                checked.at = started;
                checks.push(checked);
            }
            Err(error) => failure = Some(error),
        }
    }
    let allowed = failure.is_none() && checks.iter().all(Checked::allowed);
    if allowed {
        let shown = checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.decision.as_ref()?)))
            .min_by_key(|(_, d)| d.remaining())
            .map(|(i, _)| i);
        return Ok(Admission {
            allowed,
            shown,
            checks,
            forbidden: None,
        });
    }
    // Denied (or failed): give back what the admitting rules took, and
    // block the keys of breached rules that block.
    let mut undo = Vec::new();
    for (c, p) in checks.iter_mut().zip(&planned) {
        if c.allowed() {
            if let Some(permit) = c.permit.take() {
                undo.push(Box::pin(async move {
                    if let Err(error) = permit.release().await {
                        tracing::warn!(%error, "rules: could not give back a concurrency slot of a denied request");
                    }
                }) as BoxFuture<()>);
            } else if c.decided_by == DecidedBy::Store && c.cost > 0 && c.refundable() {
                let (limiter, key, cost) = (c.limiter.clone(), c.key.clone(), c.cost);
                let id = c.decision.as_ref().and_then(Decision::refund_id);
                undo.push(Box::pin(async move {
                    if let Err(error) = limiter.refund(&key, id, cost).await {
                        tracing::warn!(%error, "rules: could not give back the quota a denied request took");
                    }
                }));
            }
        } else if let (Some(block), DecidedBy::Store, Some(decision)) =
            (p.block, c.decided_by, &c.decision)
            && !decision.blocked()
        {
            let (limiter, key) = (c.limiter.clone(), c.key.clone());
            c.decision = Some(crate::algorithm::blocked(
                limiter.policy(),
                crate::algorithm::block_micros(block),
            ));
            undo.push(Box::pin(async move {
                if let Err(error) = limiter.block(&key, block).await {
                    tracing::warn!(%error, "rules: could not block a key after its breach");
                }
            }));
        }
    }
    futures_util::future::join_all(undo).await;
    if let Some(error) = failure {
        return Err(error);
    }
    let shown = checks
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.allowed())
        .max_by_key(|(_, c)| c.decision.as_ref().map(Decision::retry_after))
        .map(|(i, _)| i);
    Ok(Admission {
        allowed: false,
        shown,
        checks,
        forbidden: None,
    })
}

/// One rule's part in an admission.
#[derive(Debug)]
struct Checked {
    rule: Arc<str>,
    counting: Counting,
    limiter: Limiter,
    key: String,
    cost: u64,
    decision: Option<Decision>,
    decided_by: DecidedBy,
    permit: Option<Permit>,
    /// When the check was sent.
    at: Instant,
}

impl Checked {
    fn new(
        p: &Planned,
        decision: Option<Decision>,
        decided_by: DecidedBy,
        permit: Option<Permit>,
    ) -> Self {
        Self {
            rule: Arc::clone(&p.rule),
            counting: p.counting.clone(),
            limiter: p.limiter.clone(),
            key: p.key.clone(),
            cost: p.cost,
            decision,
            decided_by,
            permit,
            at: Instant::now(),
        }
    }

    fn allowed(&self) -> bool {
        self.decision.as_ref().is_none_or(Decision::allowed)
    }

    /// Whether giving this check's units back cannot lend them to a later
    /// window: for the window counters, only while the window that counted
    /// it lasts (by this process's clock).
    fn refundable(&self) -> bool {
        let Some(decision) = &self.decision else {
            return false;
        };
        // The time left, when the request was counted, in the window that
        // counted it: a fixed window's reset is its end; an admitted
        // sliding window counter's reset is the end of the window after.
        let fixed = match decision.algorithm() {
            Algorithm::FixedWindow => true,
            Algorithm::SlidingWindow => false,
            _ => return true,
        };
        let window_left = decision
            .rates()
            .iter()
            .map(|r| {
                if fixed {
                    r.reset()
                } else {
                    r.reset().saturating_sub(r.rate().window())
                }
            })
            .min()
            .unwrap_or_default();
        self.at.elapsed() < window_left
    }
}

/// The verdict of every matching rule on one request.
#[derive(Debug, Default)]
pub struct Admission {
    allowed: bool,
    /// The check whose decision a response shows: the denial waiting
    /// longest, or the admission with the fewest units left.
    shown: Option<usize>,
    checks: Vec<Checked>,
    /// The rule whose `only` list the key is not on.
    forbidden: Option<Arc<str>>,
}

impl Admission {
    fn forbidden(rule: &str) -> Self {
        Self {
            allowed: false,
            shown: None,
            checks: Vec::new(),
            forbidden: Some(Arc::from(rule)),
        }
    }

    /// Whether every matching rule admitted the request (true when none
    /// matched).
    pub fn allowed(&self) -> bool {
        self.allowed || (self.forbidden.is_none() && self.checks.is_empty())
    }

    /// The rule that refused the caller outright (its key is not on the
    /// rule's `only` list): answer 403, not 429.
    pub fn forbidden_by(&self) -> Option<&str> {
        self.forbidden.as_deref()
    }

    /// The rule whose decision a response shows (the denying one waiting
    /// longest, or the admitting one with the fewest units left), its
    /// limiter, decision and decided_by.
    pub fn shown(&self) -> Option<(&str, &Limiter, &Decision, DecidedBy)> {
        let c = &self.checks[self.shown?];
        Some((&c.rule, &c.limiter, c.decision.as_ref()?, c.decided_by))
    }

    /// Every checked rule's name and decision (`None`: admitted without
    /// limit, as by fail-open).
    pub fn decisions(&self) -> impl Iterator<Item = (&str, Option<&Decision>)> {
        self.checks.iter().map(|c| (&*c.rule, c.decision.as_ref()))
    }

    /// The request was answered with `status` (`None`: the inner service
    /// failed): give back the units of every rule that does not count this
    /// outcome (in a task: the response does not wait), and return the
    /// concurrency slots to hold until the response ends.
    ///
    /// A refund is one atomic step in the store
    /// ([`Command::Refund`](crate::store::Command::Refund)). Exact for the sliding
    /// log (the request's own entries are removed) and for GCRA (its debt is
    /// additive). For the fixed and sliding window counters (a reward of the
    /// cost) a refund is skipped once the window that counted the request
    /// has ended by this process's clock (a refund must not lend a unit to a
    /// later window, and the refund of a request counted in the previous
    /// window of a sliding counter would be taken from the current one); a
    /// refund sent just before the window ends and applied just after is the
    /// exception, one round trip wide. Concurrency limits do not count
    /// outcomes (their slot is given back when the response ends).
    pub fn settle(self, status: Option<u16>) -> Vec<Permit> {
        let mut permits = Vec::new();
        for c in self.checks {
            if let Some(permit) = c.permit {
                permits.push(permit);
                continue;
            }
            let counted = c.decision.as_ref().is_some_and(Decision::allowed)
                && c.decided_by == DecidedBy::Store;
            if !counted || c.cost == 0 || c.counting.counts(status) {
                continue;
            }
            if !c.refundable() {
                continue;
            }
            let Some(decision) = c.decision else { continue };
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                tracing::warn!("no tokio runtime to refund a request; it stays counted");
                continue;
            };
            let (limiter, key, cost) = (c.limiter, c.key, c.cost);
            let id = decision.refund_id();
            runtime.spawn(async move {
                if let Err(error) = limiter.refund(&key, id, cost).await {
                    tracing::warn!(%error, rule = limiter.name(), "rules: could not refund a request; it stays counted");
                }
            });
        }
        permits
    }
}
