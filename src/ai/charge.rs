//! What an admitted request is charged once its answer has told its
//! usage: each rule's estimate settled to the real cost (tokens, or the
//! catalog's price), in the store, in one atomic step per rule; then the
//! budgets' notices.

use std::sync::Arc;

use super::notice::Notices;
use super::usage::Reported;
use crate::limiter::{Permit, Settled};
use crate::rules::{ActiveRules, Charge, Unit, Usage};

/// How an answer ended, as far as its cost goes.
#[derive(Debug)]
pub(crate) enum Ended {
    /// It reported its usage (or failed to: [`Reported`]).
    Reported(Reported),
    /// The upstream answered an error: it produced nothing billable.
    Refused,
    /// It stopped before its usage came (a client gone, a stream cut):
    /// `output` content chunks were streamed.
    Cut {
        /// Content chunks streamed, about a token each.
        output: u64,
    },
}

/// An admitted request's charges, settled once when its answer ends (or
/// is dropped: then as [`Ended::Cut`] at what was streamed).
#[derive(Debug)]
pub(crate) struct Bill {
    charges: Vec<Charge>,
    rules: Arc<ActiveRules>,
    model: String,
    estimate: Usage,
    notices: Arc<Notices>,
    /// Concurrency slots, held until the answer ends.
    permits: Vec<Permit>,
    /// Content chunks streamed so far (for a cut stream).
    pub(crate) streamed: u64,
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
            streamed: 0,
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
            Ended::Refused => Usage::new(),
            Ended::Cut { output } => Usage::new()
                .with("input", self.estimate.get("input"))
                .with("output", output),
        };
        let charges = std::mem::take(&mut self.charges);
        let (rules, model, estimate, notices) = (
            Arc::clone(&self.rules),
            self.model.clone(),
            self.estimate.clone(),
            Arc::clone(&self.notices),
        );
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("ai: no tokio runtime to settle a request; its estimates stand");
            return;
        };
        runtime.spawn(async move {
            let settling = charges
                .into_iter()
                .map(|charge| settle_one(charge, &rules, &model, &usage, &estimate, &notices));
            futures_util::future::join_all(settling).await;
        });
    }
}

impl Drop for Bill {
    fn drop(&mut self) {
        if !self.done {
            let bill = Bill {
                charges: std::mem::take(&mut self.charges),
                rules: Arc::clone(&self.rules),
                model: std::mem::take(&mut self.model),
                estimate: std::mem::take(&mut self.estimate),
                notices: Arc::clone(&self.notices),
                permits: std::mem::take(&mut self.permits),
                streamed: self.streamed,
                done: false,
            };
            let output = bill.streamed;
            bill.settle(Ended::Cut { output });
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
    estimate: &Usage,
    notices: &Notices,
) {
    let Some(rule) = rules
        .set()
        .rules()
        .iter()
        .find(|r| r.name() == &*charge.rule)
    else {
        return;
    };
    let unit = rule.unit();
    // A check's decision counts the request; a command's (the settlement)
    // answers as one more unit would after it.
    let mut after = (charge.decision.clone(), false);
    if let (Some(unsettled), Some(cost)) =
        (charge.unsettled, cost(unit, rules, model, usage, estimate))
    {
        match unsettled.settle(cost).await {
            Ok(Settled::Charged { decision, .. } | Settled::GivenBack { decision, .. }) => {
                after = (decision, true);
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
/// the estimate stands: a rule counting requests).
fn cost(
    unit: Unit,
    rules: &ActiveRules,
    model: &str,
    usage: &Usage,
    estimate: &Usage,
) -> Option<u64> {
    match unit {
        Unit::Tokens => Some(usage.total()),
        Unit::Money => {
            let catalog = rules.set().catalog()?;
            match catalog.cost(model, usage) {
                Ok(cost) => Some(cost),
                Err(error) => {
                    // The rule set was replaced since the admission and no
                    // longer prices the model: the estimate's price, if any.
                    tracing::warn!(%error, "ai: cannot price a request's usage; charging its estimate");
                    catalog.cost(model, estimate).ok()
                }
            }
        }
        _ => None,
    }
}
