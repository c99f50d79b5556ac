//! What an admitted request is charged once its answer has told its
//! usage: each rule's estimate settled to the real cost (tokens, or the
//! catalog's price), in the store, in one atomic step per rule; then the
//! budgets' notices.

use std::sync::Arc;

use super::notice::Notices;
use super::usage::Reported;
use crate::limiter::{Permit, Settled};
use crate::rules::{ActiveRules, Charge, Unit, Usage};

/// A response extension saying the answer is not the upstream's: a
/// proxy's own `502` or `504` when the upstream could not be reached or
/// did not answer in time. What the request cost the upstream cannot be
/// known, so [`OpenAiLayer`](super::OpenAiLayer) charges its estimate (an
/// upstream's own error answer is charged nothing).
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_redis_ratelimit::ai::Unanswered;
///
/// let mut timed_out = Response::new("the upstream did not answer in time");
/// *timed_out.status_mut() = StatusCode::GATEWAY_TIMEOUT;
/// timed_out.extensions_mut().insert(Unanswered);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unanswered;

/// How an answer ended, as far as its cost goes.
#[derive(Debug, Clone)]
pub(crate) enum Ended {
    /// It reported its usage (or failed to: [`Reported`]).
    Reported(Reported),
    /// The upstream answered an error: it produced nothing billable.
    Refused,
    /// A stream stopped before its usage came (a client gone, the
    /// upstream cut or silent): `output` content chunks were streamed.
    Cut {
        /// Content chunks streamed, about a token each.
        output: u64,
    },
    /// No answer came to read (the upstream unreachable or too slow, an
    /// answer the proxy made itself, the request dropped before its
    /// answer, an answer not read to its end): what it cost cannot be
    /// known, and its estimate stands.
    Unknown,
}

/// An admitted request's charges, settled once: when its answer ends, or
/// as [`if_dropped`](Self::if_dropped) says when it is dropped before.
#[derive(Debug)]
pub(crate) struct Bill {
    charges: Vec<Charge>,
    rules: Arc<ActiveRules>,
    model: String,
    estimate: Usage,
    notices: Arc<Notices>,
    /// Concurrency slots, held until the answer ends.
    permits: Vec<Permit>,
    /// How the request ended if the bill is dropped unsettled: unknown
    /// until its answer shows what it is.
    pub(crate) if_dropped: Ended,
    done: bool,
}

impl Bill {
    pub(crate) fn new(
        charges: Vec<Charge>,
        permits: Vec<Permit>,
        rules: Arc<ActiveRules>,
        model: String,
        estimate: Usage,
        notices: Arc<Notices>,
    ) -> Self {
        Self {
            charges,
            rules,
            model,
            estimate,
            notices,
            permits,
            if_dropped: Ended::Unknown,
            done: false,
        }
    }

    /// Settle every charge for an answer that `ended` so (in a task: the
    /// answer never waits for the store).
    pub(crate) fn settle(mut self, ended: Ended) {
        self.done = true;
        self.permits.clear();
        let usage = match ended {
            Ended::Reported(Reported::Usage(usage)) => usage,
            Ended::Reported(Reported::Missing) => {
                tracing::warn!(
                    model = self.model,
                    "ai: the answer reported no usage; charging its estimate"
                );
                self.estimate.clone()
            }
            Ended::Reported(Reported::Bad(why)) => {
                tracing::warn!(
                    model = self.model,
                    why,
                    "ai: the answer's usage does not read; charging its estimate"
                );
                self.estimate.clone()
            }
            Ended::Unknown => {
                tracing::debug!(
                    model = self.model,
                    "ai: no answer to read; charging the estimate"
                );
                self.estimate.clone()
            }
            Ended::Refused => Usage::new(),
            Ended::Cut { output } => Usage::new()
                .with("input", self.estimate.get("input"))
                .with("output", output),
        };
        let charges = std::mem::take(&mut self.charges);
        let (rules, model, notices) = (
            Arc::clone(&self.rules),
            std::mem::take(&mut self.model),
            Arc::clone(&self.notices),
        );
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("ai: no tokio runtime to settle a request; its estimates stand");
            return;
        };
        runtime.spawn(async move {
            let settling = charges
                .into_iter()
                .map(|charge| settle_one(charge, &rules, &model, &usage, &notices));
            futures_util::future::join_all(settling).await;
        });
    }
}

impl Drop for Bill {
    fn drop(&mut self) {
        if !self.done {
            let ended = self.if_dropped.clone();
            let bill = Bill {
                charges: std::mem::take(&mut self.charges),
                rules: Arc::clone(&self.rules),
                model: std::mem::take(&mut self.model),
                estimate: std::mem::take(&mut self.estimate),
                notices: Arc::clone(&self.notices),
                permits: std::mem::take(&mut self.permits),
                if_dropped: Ended::Unknown,
                done: false,
            };
            bill.settle(ended);
        }
    }
}

/// Settle one rule's charge at `usage`, then tell the notices its state
/// after crosses.
async fn settle_one(
    charge: Charge,
    rules: &ActiveRules,
    model: &str,
    usage: &Usage,
    notices: &Notices,
) {
    let Some(rule) = rules.rule(&charge.rule) else {
        return;
    };
    let unit = rule.unit();
    // A check's decision counts the request; a command's (the settlement)
    // answers as a request of its policy's cost would after it.
    let mut after = (charge.decision.clone(), None);
    if let (Some(unsettled), Some(cost)) = (charge.unsettled, cost(unit, rules, model, usage)) {
        // The settlement answers as a request of the estimate would.
        let estimate = unsettled.estimate();
        match unsettled.settle(cost).await {
            Ok(Settled::Charged { decision, .. } | Settled::GivenBack { decision, .. }) => {
                after = (decision, Some(estimate));
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, rule = rule.name(), "ai: cannot settle a request; its estimate stands");
            }
        }
    }
    notices
        .crossed(
            rule.name(),
            &charge.key,
            unit,
            rule.notify(),
            &after.0,
            after.1,
        )
        .await;
}

/// What `usage` of `model` costs under a rule counting `unit` (`None`:
/// the estimate stands: a rule counting requests). The catalog is the
/// admission's, which priced the model's estimate: it prices its usage.
fn cost(unit: Unit, rules: &ActiveRules, model: &str, usage: &Usage) -> Option<u64> {
    match unit {
        Unit::Tokens => Some(usage.total()),
        Unit::Money => match rules.set().catalog()?.cost(model, usage) {
            Ok(cost) => Some(cost),
            Err(error) => {
                // A kind of tokens the catalog has no price for: the
                // estimate stands.
                tracing::warn!(%error, "ai: cannot price a request's usage; its estimate stands");
                None
            }
        },
        _ => None,
    }
}
