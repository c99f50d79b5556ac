//! What every policy of a rule (its own and its tiers') takes from the
//! rule: its algorithm, execution, cost and the unit it counts in.

use std::collections::BTreeMap;

use super::fields::fault;
use super::unit::{self, Unit};
use super::{EnvoyFlags, RulesError};
use crate::policy::{Algorithm, Policy};

/// What every policy of a rule (its own and its tiers') takes from the
/// rule: an algorithm, an execution and a cost.
pub(super) struct Shape<'a> {
    pub(super) label: &'a str,
    algorithm: Option<Algorithm>,
    execution: Option<crate::policy::Execution>,
    cost: Option<u64>,
    /// The price catalog's currency, which money policies count in.
    currency: Option<&'a str>,
}

impl<'a> Shape<'a> {
    pub(super) fn read(
        algorithm: Option<String>,
        execution: Option<String>,
        cost: Option<u64>,
        label: &'a str,
        currency: Option<&'a str>,
    ) -> Result<Self, RulesError> {
        let algorithm = algorithm
            .map(|a| {
                a.parse::<Algorithm>()
                    .map_err(|e| fault(label, "algorithm", e))
            })
            .transpose()?;
        let execution = execution
            .map(|e| {
                e.parse::<crate::policy::Execution>().map_err(|_| {
                    fault(
                        label,
                        "execution",
                        format!("{e:?}: use \"transaction\" or \"script\""),
                    )
                })
            })
            .transpose()?;
        Ok(Self {
            label,
            algorithm,
            execution,
            cost,
            currency,
        })
    }

    /// The unit the rule's policy and every tier's count in: one for all.
    pub(super) fn unit(
        &self,
        policy: Option<&str>,
        tiers: &BTreeMap<String, String>,
    ) -> Result<Unit, RulesError> {
        let Some(policy) = policy else {
            return Ok(Unit::Requests);
        };
        let of = |field: &str, text: &str| {
            unit::read(text, self.currency)
                .map(|(_, unit)| unit)
                .map_err(|e| fault(self.label, field, e))
        };
        let unit = of("policy", policy)?;
        for (tier, text) in tiers {
            let field = format!("tiers.{tier}");
            if of(&field, text)? != unit {
                return Err(fault(
                    self.label,
                    &field,
                    format!("counts in another unit than the rule's policy ({unit})"),
                ));
            }
        }
        Ok(unit)
    }

    /// The policy written `text` in `field`, in this shape.
    /// The rule's own `policy`: required, unless the rule is never
    /// checked (unlimited or refusing all), which takes none.
    pub(super) fn rule_policy(
        &self,
        text: Option<&str>,
        envoy: &EnvoyFlags,
    ) -> Result<Policy, RulesError> {
        let checked = !envoy.unlimited && !envoy.refuse;
        match (text, checked) {
            (Some(text), true) => self.policy("policy", text),
            (None, true) => Err(fault(self.label, "policy", "is missing (e.g. \"100/min\")")),
            (Some(_), false) => Err(fault(
                self.label,
                "policy",
                "an unlimited or refusing rule has no policy",
            )),
            // Never checked: such a rule answers without its limiter.
            (None, false) => self.policy("unlimited", "4294967295/s"),
        }
    }

    pub(super) fn policy(&self, field: &str, text: &str) -> Result<Policy, RulesError> {
        let label = self.label;
        let (text, _) = unit::read(text, self.currency).map_err(|e| fault(label, field, e))?;
        let mut policy: Policy = text.parse().map_err(|e| fault(label, field, e))?;
        if let Some(algorithm) = self.algorithm {
            policy = policy
                .with_algorithm(algorithm)
                .map_err(|e| fault(label, field, e))?;
        }
        if let Some(execution) = self.execution {
            policy = policy
                .with_execution(execution)
                .map_err(|e| fault(label, "execution", e))?;
        }
        if let Some(cost) = self.cost {
            policy = policy.with_cost(cost).map_err(|e| fault(label, field, e))?;
        }
        Ok(policy)
    }
}
