//! What each descriptor of a request is checked against: the rules its
//! domain and entries match, or its own `limit`.

use std::collections::HashSet;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

use crate::key;
use crate::limiter::Limiter;
use crate::rules::{ActiveRules, Rule};

/// What one descriptor is checked against.
pub(super) struct DescriptorPlan<'a> {
    pub(super) cost: u64,
    /// `is_negative_hits`: the cost is given back, not taken.
    pub(super) negative: bool,
    pub(super) limits: Vec<Limit<'a>>,
    /// An `unlimited` rule matched it.
    pub(super) unlimited: bool,
    /// The rules refusing every request it matches.
    pub(super) refused: Vec<&'a Rule>,
}

pub(super) struct Limit<'a> {
    /// `None`: the descriptor's own `limit`.
    pub(super) rule: Option<&'a Rule>,
    /// The key of the count.
    pub(super) key: String,
    pub(super) limiter: Limiter,
    pub(super) shadow: bool,
    /// Charged the cost after the response (a penalty past the max if
    /// need be), never refusing.
    pub(super) charge: bool,
}

impl<'a> DescriptorPlan<'a> {
    /// A plan of no limit yet, at `cost`.
    fn new(descriptor: &RateLimitDescriptor, cost: u64) -> Self {
        Self {
            cost,
            negative: descriptor.is_negative_hits,
            limits: Vec::new(),
            unlimited: false,
            refused: Vec::new(),
        }
    }

    /// The plan of a descriptor carrying its own `limit`, counted by
    /// `limiter` under the domain and the descriptor's entries.
    pub(super) fn own_limit(
        domain: &str,
        descriptor: &RateLimitDescriptor,
        cost: u64,
        limiter: Limiter,
    ) -> Self {
        let mut plan = Self::new(descriptor, cost);
        plan.limits.push(Limit {
            rule: None,
            key: format!("{domain}.{}", key_of(descriptor, None)),
            limiter,
            shadow: false,
            charge: false,
        });
        plan
    }

    /// The plan of a descriptor checked against the rules of `active` that
    /// `domain` and its entries match; the names of the rules these
    /// replace go into `replaced`.
    pub(super) fn of_rules(
        active: &'a ActiveRules,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        cost: u64,
        replaced: &mut HashSet<&'a str>,
    ) -> Self {
        let entries: Vec<(&str, &str)> = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let mut plan = Self::new(descriptor, cost);
        for (rule, limiters) in active.descriptor_rules(domain, &entries) {
            replaced.extend(rule.envoy().replaces.iter().map(String::as_str));
            if rule.envoy().unlimited {
                plan.unlimited = true;
                continue;
            }
            if rule.envoy().refuse {
                plan.refused.push(rule);
                continue;
            }
            // The tier is the value of the rule's `tier_entry`, which
            // is not part of the key: a rule's tiers share a count.
            let tier_entry = rule.envoy().tier_entry.as_deref();
            let tier = tier_entry
                .and_then(|name| entries.iter().find(|(k, _)| *k == name))
                .map(|(_, value)| *value);
            plan.limits.push(Limit {
                rule: Some(rule),
                key: key_of(descriptor, tier_entry),
                limiter: limiters.pick(tier).clone(),
                shadow: rule.envoy().shadow,
                // The descriptor Envoy sends again when the stream
                // is done, with the cost the response reported.
                charge: descriptor.hits_addend.as_ref().is_some_and(|h| h.value > 0)
                    && rule.settle().is_some_and(|s| s.from_hits_addend()),
            });
        }
        plan
    }

    /// Drop the rules another rule of the request replaces.
    pub(super) fn drop_replaced(&mut self, replaced: &HashSet<&str>) {
        self.limits
            .retain(|l| l.rule.is_none_or(|rule| !replaced.contains(rule.name())));
        self.refused.retain(|rule| !replaced.contains(rule.name()));
    }
}

/// The key of a descriptor's count: its entries' values but the tier's,
/// joined (a long one is held by its hash, as every key).
fn key_of(descriptor: &RateLimitDescriptor, tier_entry: Option<&str>) -> String {
    let values: Vec<String> = descriptor
        .entries
        .iter()
        .filter(|entry| Some(entry.key.as_str()) != tier_entry)
        .map(|entry| entry.value.clone())
        .collect();
    key::joined(&values)
}
