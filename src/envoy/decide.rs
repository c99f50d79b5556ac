//! Checking every descriptor of a request against its plan: the enforced
//! limits all-or-nothing, peeks, shadows, give-backs and charges, each
//! into an [`Outcome`] that tells what its status reports.

use std::collections::HashMap;
use std::sync::Arc;

use smallvec::SmallVec;

use super::plan::{DescriptorPlan, Limit};
use super::service::OVERRIDE_NAME;
use crate::decision::Decision;
use crate::limiter::{DecidedBy, Limiter};
use crate::rules::{Planned, RulesCheck};

/// One check's outcome.
pub(super) struct Outcome {
    pub(super) descriptor: usize,
    /// The name its status reports.
    pub(super) name: Option<Arc<str>>,
    pub(super) limiter: Limiter,
    /// `None`: admitted uncounted (the store failed, failing open).
    pub(super) decision: Option<Decision>,
    pub(super) decided_by: DecidedBy,
    /// Whether it refuses the request.
    pub(super) denies: bool,
    /// The units left, as its status tells them.
    pub(super) remaining: u64,
}

impl Outcome {
    /// The outcome of `limit` of descriptor `descriptor`.
    fn of(descriptor: usize, limit: &Limit<'_>, decision: Option<Decision>) -> Self {
        let remaining = decision.as_ref().map_or(0, Decision::remaining);
        Self {
            descriptor,
            name: limit.shown_name().cloned(),
            limiter: limit.limiter.clone(),
            denies: false,
            remaining,
            decision,
            decided_by: DecidedBy::Store,
        }
    }

    /// How it ranks to decide a descriptor and to show its fields: a
    /// denial before an admission, then the fewest units left.
    pub(super) fn rank(&self) -> (bool, std::cmp::Reverse<u64>) {
        (self.denies, std::cmp::Reverse(self.remaining))
    }
}

pub(super) struct Outcomes {
    pub(super) all: Vec<Outcome>,
    /// Whether the request is refused.
    pub(super) denied: bool,
}

impl Outcomes {
    pub(super) fn of(&self, descriptor: usize) -> impl Iterator<Item = &Outcome> {
        self.all.iter().filter(move |o| o.descriptor == descriptor)
    }
}

/// What a limit of a descriptor is asked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// Checked with the others, all-or-nothing.
    Enforced,
    /// A cost no window can hold: over the limit, uncounted.
    TooCostly,
    /// A cost of 0: is the key past its limit?
    Peek,
    /// Counted and reported, never refusing; only peeked in a refused
    /// request, which counts nowhere.
    Shadow,
    /// `is_negative_hits`: its units given back.
    GiveBack,
    /// Charged after the response.
    Charge,
}

fn ask(plan: &DescriptorPlan<'_>, limit: &Limit<'_>) -> Ask {
    if plan.negative {
        Ask::GiveBack
    } else if limit.charge {
        Ask::Charge
    } else if limit.cost == 0 {
        Ask::Peek
    } else if limit.shadow {
        Ask::Shadow
    } else if limit.cost > limit.limiter.policy().max_cost() {
        Ask::TooCostly
    } else {
        Ask::Enforced
    }
}

/// Check every descriptor: a request refused outright (a limit of 0, a
/// cost no window holds, a peek past its limit) counts nowhere; else the
/// enforced limits are checked all-or-nothing; then the shadows (checked
/// in an admitted request, peeked in a refused one), give-backs and
/// charges, each on its own.
pub(super) async fn decide(plans: &[DescriptorPlan<'_>]) -> Result<Outcomes, tonic::Status> {
    let mut denied = plans
        .iter()
        .any(|plan| plan.refused.iter().any(|r| !r.shadow));
    let mut limits: SmallVec<[(usize, &Limit<'_>, Ask); 4]> = SmallVec::new();
    for (i, plan) in plans.iter().enumerate() {
        for limit in &plan.limits {
            limits.push((i, limit, ask(plan, limit)));
        }
    }
    let mut all = Vec::with_capacity(limits.len());
    // Read-only first: what refuses the request before anything counts.
    for &(i, limit, asked) in &limits {
        match asked {
            Ask::TooCostly => {
                // Refused, telling the units left as they stand.
                let outcome = standing(i, limit).await;
                all.push(Outcome {
                    denies: true,
                    ..outcome.unwrap_or_else(|| Outcome::of(i, limit, None))
                });
                denied = true;
            }
            Ask::Peek => {
                if let Some(outcome) = peek(i, limit).await {
                    denied |= outcome.denies;
                    all.push(outcome);
                }
            }
            _ => {}
        }
    }
    let enforced: SmallVec<[(usize, &Limit<'_>, u64); 4]> = limits
        .iter()
        .filter(|(_, _, asked)| *asked == Ask::Enforced)
        .map(|&(i, limit, _)| (i, limit, limit.cost))
        .collect();
    if !denied && !enforced.is_empty() {
        denied |= check_enforced(&enforced, &mut all).await?;
    }
    for &(i, limit, asked) in &limits {
        let cost = limit.cost;
        let outcome = match asked {
            Ask::Shadow if denied => peek(i, limit).await,
            Ask::Shadow => shadow(i, limit, cost).await,
            Ask::GiveBack => logged(limit.limiter.reward(&limit.key, cost).await)
                .map(|decision| Outcome::of(i, limit, Some(decision))),
            Ask::Charge => logged(limit.limiter.penalty(&limit.key, cost).await)
                .map(|decision| Outcome::of(i, limit, Some(decision))),
            Ask::Enforced | Ask::TooCostly | Ask::Peek => None,
        };
        all.extend(outcome);
    }
    Ok(Outcomes { all, denied })
}

/// The enforced `limits` (each of its descriptor, at its cost), checked
/// all-or-nothing: their outcomes into `all`, and whether they deny. In a
/// refused request, each admitted check whose units were given back tells
/// the count as it stands once they are.
async fn check_enforced(
    limits: &[(usize, &Limit<'_>, u64)],
    all: &mut Vec<Outcome>,
) -> Result<bool, tonic::Status> {
    let planned = limits
        .iter()
        .map(|&(_, limit, cost)| {
            let (limiter, key) = (limit.limiter.clone(), limit.key.clone());
            match limit.rule {
                Some(rule) => Planned::new(rule, limiter, key, cost),
                None => Planned::anonymous(limiter, key, cost),
            }
        })
        .collect();
    let admission = RulesCheck::run(planned, Vec::new())
        .await
        .map_err(|error| tonic::Status::unavailable(format!("rate limit store: {error}")))?;
    // A count's units left once every check of it was given back: the
    // check its store ran first left `remaining + cost` (whichever order
    // the checks of one count ran in, no other leaves more).
    let mut as_it_stands: HashMap<(&str, &str), u64> = HashMap::new();
    for checked in admission.checked().filter(|c| c.given_back) {
        let (Some(&(_, limit, cost)), Some(decision)) =
            (limits.get(checked.plan), checked.decision)
        else {
            continue;
        };
        let left = decision.remaining() + cost;
        let count = as_it_stands
            .entry((limit.limiter.name(), limit.key.as_str()))
            .or_default();
        *count = (*count).max(left);
    }
    for checked in admission.checked() {
        let Some(&(i, limit, _)) = limits.get(checked.plan) else {
            continue;
        };
        let mut outcome = Outcome::of(i, limit, checked.decision.cloned());
        outcome.decided_by = checked.decided_by;
        outcome.denies = checked.decision.is_some_and(|d| !d.allowed());
        if checked.given_back
            && let Some(&left) = as_it_stands.get(&(limit.limiter.name(), limit.key.as_str()))
        {
            outcome.remaining = left;
        }
        all.push(outcome);
    }
    Ok(!admission.allowed())
}

/// The units of `limit` (of descriptor `i`) left as its count stands, by
/// a peek. `None` when the store failed (logged: reported as admitted).
async fn standing(i: usize, limit: &Limit<'_>) -> Option<Outcome> {
    let limiter = &limit.limiter;
    let decision = logged(limiter.peek(&limit.key).await)?;
    // The peek says what a check of the policy's cost would leave.
    let remaining = if decision.allowed() {
        decision.remaining() + limiter.policy().cost()
    } else {
        0
    };
    Some(Outcome {
        remaining,
        ..Outcome::of(i, limit, Some(decision))
    })
}

/// A peek of `limit` (of descriptor `i`): over the limit only when its
/// count is past the max (a key spent exactly to it has 0 left), telling
/// the units left now. `None` when the store failed (logged: reported as
/// admitted).
async fn peek(i: usize, limit: &Limit<'_>) -> Option<Outcome> {
    let outcome = standing(i, limit).await?;
    let limiter = &limit.limiter;
    let denied = outcome.decision.as_ref().is_some_and(|d| !d.allowed());
    let past_the_max = denied
        && match limiter.policy().one_past_the_max() {
            // Admitted one past the max: the count is at most the max.
            Some(policy) => logged(limiter.with_policy(policy).peek(&limit.key).await)
                .is_none_or(|d| !d.allowed()),
            None => true,
        };
    Some(Outcome {
        denies: past_the_max && !limit.shadow,
        ..outcome
    })
}

/// A shadow limit's check at `cost`: counted when admitted, never
/// refusing (a cost no window holds is peeked, with 0 left).
async fn shadow(i: usize, limit: &Limit<'_>, cost: u64) -> Option<Outcome> {
    let limiter = &limit.limiter;
    let too_costly = cost > limiter.policy().max_cost();
    let decision = if too_costly {
        logged(limiter.peek(&limit.key).await)?
    } else {
        let verdict = logged(limiter.check_n(&limit.key, cost).await)?;
        verdict.into_parts().0?
    };
    if too_costly || !decision.allowed() {
        tracing::info!(
            rule = limit.rule.map_or(OVERRIDE_NAME, |rule| rule.name()),
            "envoy: a shadow rule would deny; not refused"
        );
    }
    let remaining = if too_costly { 0 } else { decision.remaining() };
    Some(Outcome {
        remaining,
        ..Outcome::of(i, limit, Some(decision))
    })
}

/// The value of a store's answer, or `None` with the error logged (the
/// check is reported as admitted).
fn logged<T, E: std::fmt::Display>(answer: Result<T, E>) -> Option<T> {
    answer
        .inspect_err(|error| {
            tracing::warn!(%error, "envoy: a shadow check, a peek, a give-back or a charge failed; reported as admitted");
        })
        .ok()
}
