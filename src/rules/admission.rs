//! [`Admission`]: the verdict of every matching rule on one request, and
//! settling it once the response is known (refunds by outcome).

use std::sync::Arc;
use std::time::Instant;

use super::check::Planned;
use super::{Counting, SettleFrom};
use crate::decision::Decision;
use crate::limiter::{DecidedBy, Limiter, Permit, Unsettled};
use crate::store::bounded_key;

/// Where a matching rule's real cost comes from, and its check to settle
/// from it (`None`: nothing to settle, the header only stripped).
pub(crate) type ToSettle = (Arc<SettleFrom>, Option<Unsettled>);

/// A settlement with nothing counted to settle: its header is stripped
/// all the same, when it strips one.
fn strip_only(from: Arc<SettleFrom>) -> Option<ToSettle> {
    from.strips_header().then_some((from, None))
}

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
    /// Its place among the planned checks.
    pub(super) plan: usize,
    /// Its units were given back (the request was denied).
    pub(super) given_back: bool,
}

impl Checked {
    pub(super) fn new(
        (plan, p): (usize, &Planned),
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
            plan,
            given_back: false,
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

/// A check of an admission whose estimate a front end settles itself
/// (the AI gateway, from the usage an answer reports): its rule, decision
/// and, when it was counted, what settles it.
#[derive(Debug)]
pub(crate) struct Charge {
    pub(crate) rule: Arc<str>,
    pub(crate) decision: Decision,
    pub(crate) key: String,
    pub(crate) unsettled: Option<Unsettled>,
}

/// One check of an admission, as a front end reports it.
#[cfg(feature = "envoy")]
pub(crate) struct CheckedView<'a> {
    /// Its place among the planned checks.
    pub(crate) plan: usize,
    /// `None`: admitted without limit.
    pub(crate) decision: Option<&'a Decision>,
    pub(crate) decided_by: DecidedBy,
    /// Its units were given back (the request was denied).
    pub(crate) given_back: bool,
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
    /// What the matching rules that did not check the request (a key on
    /// their `allow` list, no key, a cost of 0) settle from: their headers
    /// are stripped all the same.
    pub(super) unchecked: Vec<Arc<SettleFrom>>,
}

impl Admission {
    pub(super) fn forbidden(rule: &str) -> Self {
        Self {
            allowed: false,
            shown: None,
            checks: Vec::new(),
            forbidden: Some(Arc::from(rule)),
            unchecked: Vec::new(),
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

    /// Every check that answered, by its place among the planned checks.
    #[cfg(feature = "envoy")]
    pub(crate) fn checked(&self) -> impl Iterator<Item = CheckedView<'_>> {
        self.checks.iter().map(|c| CheckedView {
            plan: c.plan,
            decision: c.decision.as_ref(),
            decided_by: c.decided_by,
            given_back: c.given_back,
        })
    }

    /// Every checked rule's name and decision (`None`: admitted without
    /// limit, as by fail-open).
    pub fn decisions(&self) -> impl Iterator<Item = (&str, Option<&Decision>)> {
        self.checks.iter().map(|c| (&*c.rule, c.decision.as_ref()))
    }

    /// Every check that decided, to be settled by the front end (counting
    /// by outcome does not apply), and the concurrency slots to hold until
    /// the response ends.
    pub(crate) fn into_charges(self) -> (Vec<Permit>, Vec<Charge>) {
        let mut permits = Vec::new();
        let mut charges = Vec::new();
        for c in self.checks {
            if let Some(permit) = c.permit {
                permits.push(permit);
                continue;
            }
            let Some(decision) = c.decision else { continue };
            let unsettled = (c.cost > 0)
                .then(|| c.limiter.estimated(c.cost).ok())
                .flatten()
                .and_then(|policy| {
                    let key = bounded_key(&c.key).into_owned();
                    c.limiter
                        .unsettled(key, policy, c.decided_by, &decision, c.at)
                });
            charges.push(Charge {
                rule: c.rule,
                decision,
                key: c.key,
                unsettled,
            });
        }
        (permits, charges)
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

    /// [`settle`](Self::settle), and where the real cost comes from for
    /// every matching rule that settles, with its check to settle when the
    /// response counts (`None`: nothing of this rule's to settle, but its
    /// header is stripped all the same).
    pub(crate) fn conclude(self, status: Option<u16>) -> (Vec<Permit>, Vec<ToSettle>) {
        let mut permits = Vec::new();
        let mut settling: Vec<_> = self.unchecked.into_iter().filter_map(strip_only).collect();
        for c in self.checks {
            if let Some(permit) = c.permit {
                permits.push(permit);
                continue;
            }
            let counted = c.decision.as_ref().is_some_and(Decision::allowed)
                && c.decided_by == DecidedBy::Store;
            if !counted || c.cost == 0 {
                settling.extend(c.settle.and_then(strip_only));
                continue;
            }
            if c.counting.counts(status) {
                if let Some(from) = c.settle {
                    let unsettled = c.decision.as_ref().and_then(|decision| {
                        let policy = c.limiter.estimated(c.cost).ok()?;
                        let key = bounded_key(&c.key).into_owned();
                        c.limiter
                            .unsettled(key, policy, c.decided_by, decision, c.at)
                    });
                    settling.push((from, unsettled));
                }
                continue;
            }
            settling.extend(c.settle.clone().and_then(strip_only));
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
        (permits, settling)
    }
}
