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
pub(super) struct Planned {
    pub(super) rule: Arc<str>,
    pub(super) counting: Counting,
    pub(super) block: Option<Duration>,
    pub(super) limiter: Limiter,
    pub(super) key: String,
    pub(super) cost: u64,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The future of [`ActiveRules::check`](super::ActiveRules::check).
#[must_use = "a check does nothing unless awaited"]
pub struct RulesCheck {
    state: Option<Result<Admission, BoxFuture<Result<Admission, LimitError>>>>,
}

impl RulesCheck {
    pub(super) fn ready(admission: Admission) -> Self {
        Self {
            state: Some(Ok(admission)),
        }
    }

    pub(super) fn run(planned: Vec<Planned>) -> Self {
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
            p.limiter.count_cached_denial(&p.key, &denied);
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
    let mut blocks: Vec<(usize, BoxFuture<Option<Decision>>)> = Vec::new();
    for (i, (c, p)) in checks.iter_mut().zip(&planned).enumerate() {
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
            blocks.push((
                i,
                Box::pin(async move {
                    match limiter.block(&key, block).await {
                        // The denial announces the block once it is written.
                        Ok(_) => Some(crate::algorithm::blocked(
                            limiter.policy(),
                            crate::algorithm::block_micros(block),
                        )),
                        Err(error) => {
                            tracing::error!(%error, "rules: could not block a key after its breach; its denial claims no block");
                            None
                        }
                    }
                }),
            ));
        }
    }
    let (blocked, _) = futures_util::future::join(
        futures_util::future::join_all(
            blocks
                .into_iter()
                .map(|(i, block)| async move { (i, block.await) }),
        ),
        futures_util::future::join_all(undo),
    )
    .await;
    for (i, decision) in blocked {
        if let (Some(decision), Some(check)) = (decision, checks.get_mut(i)) {
            check.decision = Some(decision);
        }
    }
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
