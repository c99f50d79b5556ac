//! [`RulesCheck`]: the future that checks a request against every rule
//! that matched it, all-or-nothing, and answers an [`Admission`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::Counting;
use super::admission::{Admission, Checked};
use crate::decision::Decision;
use crate::limiter::{DecidedBy, LimitError, Limiter};

/// A matching rule's check, planned: its limiter, key and cost.
pub(crate) struct Planned {
    pub(super) rule: Arc<str>,
    pub(super) counting: Counting,
    pub(super) settle: Option<Arc<super::SettleFrom>>,
    pub(super) block: Option<Duration>,
    pub(super) limiter: Limiter,
    pub(super) key: String,
    pub(super) cost: u64,
}

impl Planned {
    /// `rule`'s check of `key` at `cost` with `limiter`.
    pub(crate) fn new(rule: &super::Rule, limiter: Limiter, key: String, cost: u64) -> Self {
        Self {
            rule: rule.shared_name(),
            counting: rule.counting().clone(),
            settle: rule.shared_settle(),
            block: rule.block(),
            limiter,
            key,
            cost,
        }
    }
}

#[cfg(feature = "envoy")]
impl Planned {
    /// A check of `key` at `cost` with `limiter`, under no rule (its name
    /// the limiter's).
    pub(crate) fn anonymous(limiter: Limiter, key: String, cost: u64) -> Self {
        Self {
            rule: Arc::from(limiter.name()),
            counting: Counting::All,
            settle: None,
            block: None,
            limiter,
            key,
            cost,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The future of [`ActiveRules::check`](super::ActiveRules::check).
#[must_use = "a check does nothing unless awaited"]
pub struct RulesCheck {
    state: State,
    /// What the matching rules that check nothing settle from.
    unchecked: Vec<Arc<super::SettleFrom>>,
}

enum State {
    /// Answered without asking the store (no rule matched).
    Ready(Admission),
    /// The rules' checks under way.
    Deciding(BoxFuture<Result<Admission, LimitError>>),
    /// Answered.
    Done,
}

impl RulesCheck {
    pub(super) fn ready(admission: Admission) -> Self {
        Self {
            state: State::Ready(admission),
            unchecked: Vec::new(),
        }
    }

    /// Check the `planned` rules; `unchecked` are what the matching rules
    /// that check nothing settle from (their headers are stripped).
    pub(crate) fn run(planned: Vec<Planned>, unchecked: Vec<Arc<super::SettleFrom>>) -> Self {
        let state = if planned.is_empty() {
            State::Ready(Admission::default())
        } else {
            State::Deciding(Box::pin(decide(planned)))
        };
        Self { state, unchecked }
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
        let unchecked = |this: &mut Self, mut admission: Admission| {
            admission.unchecked = std::mem::take(&mut this.unchecked);
            admission
        };
        if let State::Deciding(future) = &mut self.state {
            let out = std::task::ready!(future.as_mut().poll(cx));
            self.state = State::Done;
            return Poll::Ready(out.map(|admission| unchecked(&mut self, admission)));
        }
        match std::mem::replace(&mut self.state, State::Done) {
            State::Ready(admission) => Poll::Ready(Ok(unchecked(&mut self, admission))),
            State::Deciding(_) | State::Done => Poll::Ready(Err(LimitError::Store(
                crate::store::StoreError::UnexpectedReply(
                    "a rules check polled after it completed".into(),
                ),
            ))),
        }
    }
}

/// A request against every rule that matched it, all-or-nothing: a
/// denial held in process answers first; else every rule is checked; a
/// denial (or failure) gives back what the admitting rules took and
/// blocks the keys of breached rules that block.
async fn decide(planned: Vec<Planned>) -> Result<Admission, LimitError> {
    if let Some(denied) = first_cached_denial(&planned) {
        return Ok(denied);
    }
    let (mut checks, failure) = check_all(&planned).await;
    if failure.is_none() && checks.iter().all(Checked::allowed) {
        let shown = checks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.decision.as_ref()?)))
            .min_by_key(|(_, d)| d.remaining())
            .map(|(i, _)| i);
        return Ok(Admission {
            allowed: true,
            shown,
            checks,
            forbidden: None,
            unchecked: Vec::new(),
        });
    }
    compensate(&mut checks, &planned).await;
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
        unchecked: Vec::new(),
    })
}

/// A key this process already holds a denial for denies at once: the
/// other rules are not asked, so a flood from a denied key costs the
/// store nothing and spends no other rule's quota.
fn first_cached_denial(planned: &[Planned]) -> Option<Admission> {
    // (The cache holds denials at the policy's own cost: a cheaper request
    // might be admitted.)
    let (i, p, denied) = planned
        .iter()
        .enumerate()
        .filter(|(_, p)| p.cost == p.limiter.policy().cost())
        .find_map(|(i, p)| Some((i, p, p.limiter.cached_denial(&p.key)?)))?;
    p.limiter.count_cached_denial(&p.key, &denied);
    Some(Admission {
        allowed: false,
        shown: Some(0),
        checks: vec![Checked::new(
            (i, p),
            Some(denied),
            DecidedBy::DenyCache,
            None,
        )],
        forbidden: None,
        unchecked: Vec::new(),
    })
}

/// Check every rule: what each decided, and a failure if one failed (its
/// check is left out).
async fn check_all(planned: &[Planned]) -> (Vec<Checked>, Option<LimitError>) {
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
    let mut rest = planned;
    if let [first, others @ ..] = rest
        && first.limiter.circuit_open()
    {
        verdicts.push(check(first).await);
        rest = others;
    }
    verdicts.extend(futures_util::future::join_all(rest.iter().map(check)).await);
    let mut checks = Vec::with_capacity(planned.len());
    let mut failure = None;
    for (plan, verdict) in planned.iter().enumerate().zip(verdicts) {
        match verdict {
            Ok(verdict) => {
                let (decision, decided_by, permit) = verdict.into_parts();
                let mut checked = Checked::new(plan, decision, decided_by, permit);
                checked.at = started;
                checks.push(checked);
            }
            Err(error) => failure = Some(error),
        }
    }
    (checks, failure)
}

/// After a denial (or failure): give back what the admitting rules took,
/// and block the keys of breached rules that block (their denial then
/// shows the block, once it is written).
async fn compensate(checks: &mut [Checked], planned: &[Planned]) {
    let mut undo: Vec<BoxFuture<(usize, bool)>> = Vec::new();
    let mut blocks: Vec<BoxFuture<(usize, Option<Decision>)>> = Vec::new();
    for (i, c) in checks.iter_mut().enumerate() {
        // A check that failed is left out of `checks`: each finds its
        // own plan by its place.
        let block = planned.get(c.plan).and_then(|p| p.block);
        if c.allowed() {
            if let Some(permit) = c.permit.take() {
                undo.push(Box::pin(async move {
                    let released = permit.release().await;
                    if let Err(error) = &released {
                        tracing::warn!(%error, "rules: could not give back a concurrency slot of a denied request");
                    }
                    (i, released.is_ok())
                }));
            } else if c.decided_by == DecidedBy::Store && c.cost > 0 && c.refundable() {
                let (limiter, key, cost) = (c.limiter.clone(), c.key.clone(), c.cost);
                let id = c.decision.as_ref().and_then(Decision::refund_id);
                undo.push(Box::pin(async move {
                    let refunded = limiter.refund(&key, id, cost).await;
                    if let Err(error) = &refunded {
                        tracing::warn!(%error, "rules: could not give back the quota a denied request took");
                    }
                    (i, refunded.is_ok())
                }));
            }
        } else if let (Some(block), DecidedBy::Store, Some(decision)) =
            (block, c.decided_by, &c.decision)
            && !decision.blocked()
        {
            let (limiter, key) = (c.limiter.clone(), c.key.clone());
            blocks.push(Box::pin(async move {
                match limiter.block(&key, block).await {
                    // The state the block leaves: what the denial shows.
                    Ok(blocked) => (i, Some(blocked)),
                    Err(error) => {
                        tracing::error!(%error, "rules: could not block a key after its breach; its denial claims no block");
                        (i, None)
                    }
                }
            }));
        }
    }
    let (blocked, undone) = futures_util::future::join(
        futures_util::future::join_all(blocks),
        futures_util::future::join_all(undo),
    )
    .await;
    for (i, given_back) in undone {
        if let Some(check) = checks.get_mut(i) {
            check.given_back = given_back;
        }
    }
    for (i, decision) in blocked {
        if let (Some(decision), Some(check)) = (decision, checks.get_mut(i)) {
            check.decision = Some(decision);
        }
    }
}
