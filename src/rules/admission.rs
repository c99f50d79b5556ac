//! [`Admission`]: the verdict of every matching rule on one request, and
//! settling it once the response is known (refunds by outcome).

use std::sync::Arc;
use std::time::Instant;

use super::check::Planned;
use super::{Counting, SettleFrom};
use crate::decision::Decision;
use crate::limiter::{DecidedBy, Limiter, Permit, Unsettled};
use crate::store::bounded_key;

/// One rule's part in an admission.
#[derive(Debug)]
pub(super) struct Checked {
    pub(super) rule: Arc<str>,
    pub(super) counting: Counting,
    pub(super) settle: Option<Arc<SettleFrom>>,
    pub(super) limiter: Limiter,
    pub(super) key: String,
    pub(super) cost: u64,
    pub(super) decision: Option<Decision>,
    pub(super) decided_by: DecidedBy,
    pub(super) permit: Option<Permit>,
    /// When the check was sent.
    pub(super) at: Instant,
}

impl Checked {
    pub(super) fn new(
        p: &Planned,
        decision: Option<Decision>,
        decided_by: DecidedBy,
        permit: Option<Permit>,
    ) -> Self {
        Self {
            rule: Arc::clone(&p.rule),
            counting: p.counting.clone(),
            settle: p.settle.clone(),
            limiter: p.limiter.clone(),
            key: p.key.clone(),
            cost: p.cost,
            decision,
            decided_by,
            permit,
            at: Instant::now(),
        }
    }

    pub(super) fn allowed(&self) -> bool {
        self.decision.as_ref().is_none_or(Decision::allowed)
    }

    /// Whether giving this check's units back cannot lend them to a later
    /// window: for the window counters, only while the window that counted
    /// it lasts (by this process's clock).
    pub(super) fn refundable(&self) -> bool {
        let Some(decision) = &self.decision else {
            return false;
        };
        decision.refundable_since(self.at)
    }
}

/// The verdict of every matching rule on one request.
#[derive(Debug, Default)]
pub struct Admission {
    pub(super) allowed: bool,
    /// The check whose decision a response shows: the denial waiting
    /// longest, or the admission with the fewest units left.
    pub(super) shown: Option<usize>,
    pub(super) checks: Vec<Checked>,
    /// The rule whose `only` list the key is not on.
    pub(super) forbidden: Option<Arc<str>>,
}

impl Admission {
    pub(super) fn forbidden(rule: &str) -> Self {
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
    ///
    /// A rule that settles its cost after the response (`settle`) keeps
    /// its estimate here: [`RulesLayer`](super::RulesLayer) settles it from
    /// the response.
    pub fn settle(self, status: Option<u16>) -> Vec<Permit> {
        self.conclude(status).0
    }

    /// [`settle`](Self::settle), and the checks of rules whose real cost
    /// the response gives (those it counts), with where it comes from.
    pub(crate) fn conclude(
        self,
        status: Option<u16>,
    ) -> (Vec<Permit>, Vec<(Unsettled, Arc<SettleFrom>)>) {
        let mut permits = Vec::new();
        let mut unsettled = Vec::new();
        for c in self.checks {
            if let Some(permit) = c.permit {
                permits.push(permit);
                continue;
            }
            let counted = c.decision.as_ref().is_some_and(Decision::allowed)
                && c.decided_by == DecidedBy::Store;
            if !counted || c.cost == 0 {
                continue;
            }
            if c.counting.counts(status) {
                if let (Some(from), Some(decision)) = (&c.settle, &c.decision)
                    && let Ok(policy) = c.limiter.estimated(c.cost)
                    && let Some(u) = c.limiter.unsettled(
                        bounded_key(&c.key).into_owned(),
                        policy,
                        c.decided_by,
                        decision,
                        c.at,
                    )
                {
                    unsettled.push((u, Arc::clone(from)));
                }
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
        (permits, unsettled)
    }
}
