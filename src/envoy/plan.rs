//! What each descriptor of a request is checked against: the rules its
//! domain and entries match, or its own `limit`.

use std::collections::HashSet;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use smallvec::SmallVec;

use super::price;
use crate::key;
use crate::limiter::Limiter;
use crate::policy::Rate;
use crate::rules::{ActiveRules, Rule};

/// What one descriptor is checked against.
pub(super) struct DescriptorPlan<'a> {
    /// `is_negative_hits`: the cost is given back, not taken.
    pub(super) negative: bool,
    pub(super) limits: Vec<Limit<'a>>,
    /// An `unlimited` rule matched it.
    pub(super) unlimited: bool,
    /// The limits refusing every request it matches.
    pub(super) refused: Vec<Refusal>,
}

pub(super) struct Limit<'a> {
    /// `None`: the descriptor's own `limit`.
    pub(super) rule: Option<&'a Rule>,
    /// The key of the count.
    pub(super) key: String,
    /// The units it is asked for: the descriptor's cost, or (a rule
    /// counted in money that names its usage) the catalog's price of
    /// that many tokens.
    pub(super) cost: u64,
    pub(super) limiter: Limiter,
    pub(super) shadow: bool,
    /// Charged the cost after the response (a penalty past the max if
    /// need be), never refusing.
    pub(super) charge: bool,
}

impl Limit<'_> {
    /// The name its status reports (a descriptor's own `limit` has none).
    pub(super) fn shown_name(&self) -> Option<&Arc<str>> {
        self.rule.and_then(|rule| rule.envoy().shown_name.as_ref())
    }
}

/// A limit of 0: every request it matches is over the limit, uncounted.
pub(super) struct Refusal {
    /// The name its status reports.
    pub(super) name: Option<Arc<str>>,
    /// The rate whose unit and reset its status reports.
    pub(super) rate: Option<Rate>,
    /// Reported, never refusing.
    pub(super) shadow: bool,
    /// Not a limit of 0: the price catalog has no price for the
    /// descriptor's usage (its status reports the rule's rate, nothing
    /// left, and no reset: waiting cures nothing).
    pub(super) unpriced: bool,
}

impl<'a> DescriptorPlan<'a> {
    /// A plan of no limit yet.
    pub(super) fn new(descriptor: &RateLimitDescriptor) -> Self {
        Self {
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
        let mut plan = Self::new(descriptor);
        plan.limits.push(Limit {
            rule: None,
            key: own_key(domain, descriptor),
            cost,
            limiter,
            shadow: false,
            charge: false,
        });
        plan
    }

    /// The plan of a descriptor carrying its own `limit` of 0 requests per
    /// the unit of `rate`: every request over it.
    pub(super) fn own_refusal(descriptor: &RateLimitDescriptor, rate: Rate) -> Self {
        let mut plan = Self::new(descriptor);
        plan.refused.push(Refusal {
            name: None,
            rate: Some(rate),
            shadow: false,
            unpriced: false,
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
        let entries: SmallVec<[(&str, &str); 4]> = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let mut plan = Self::new(descriptor);
        let settles = descriptor.hits_addend.as_ref().is_some_and(|h| h.value > 0);
        for (rule, limiters) in active.descriptor_rules(domain, &entries) {
            let envoy = rule.envoy();
            replaced.extend(envoy.replaces.iter().map(String::as_str));
            if envoy.unlimited {
                plan.unlimited = true;
                continue;
            }
            if envoy.refuse {
                plan.refused.push(Refusal {
                    name: envoy.shown_name.clone(),
                    rate: envoy.refused_rate,
                    shadow: envoy.shadow,
                    unpriced: false,
                });
                continue;
            }
            // The tier is the value of the rule's `tier_entry`, which
            // is not part of the key: a rule's tiers share a count.
            let tier_entry = envoy.tier_entry.as_deref();
            let tier = tier_entry
                .and_then(|name| entries.iter().find(|(k, _)| *k == name))
                .map(|(_, value)| *value);
            let limiter = limiters.pick(tier);
            // The descriptor Envoy sends again when the stream is done,
            // with the cost the response reported.
            let settling = settles && rule.settle().is_some_and(|s| s.from_hits_addend());
            // A rule naming its usage counts the descriptor's tokens, or
            // (counted in money) their price; a usage the catalog cannot
            // price is refused, never free.
            let catalog = active.set().catalog();
            let cost = match price::units(rule, catalog, &entries, cost) {
                Ok(units) => units,
                // What a stream reported is charged all the same: at the
                // catalog's dearest price, never free.
                Err(unpriced) if settling && catalog.is_some() => {
                    price::log_unpriced(rule, &entries, &unpriced, settling);
                    catalog.map_or(cost, |c| c.at_dearest(cost))
                }
                Err(unpriced) => {
                    price::log_unpriced(rule, &entries, &unpriced, settling);
                    plan.refused.push(Refusal {
                        name: envoy.shown_name.clone(),
                        rate: limiter.policy().rates().first().copied(),
                        shadow: envoy.shadow,
                        unpriced: true,
                    });
                    continue;
                }
            };
            // Neither are the entries of the usage's model and kind: the
            // models and kinds of a key spend one budget.
            let usage = envoy.usage.as_ref();
            let left_out =
                |key: &str| Some(key) == tier_entry || usage.is_some_and(|u| u.names(key));
            plan.limits.push(Limit {
                rule: Some(rule),
                key: key_of(descriptor, left_out),
                cost,
                limiter: limiter.clone(),
                shadow: envoy.shadow,
                // A price of 0 is asked as a peek.
                charge: settling && cost > 0,
            });
        }
        plan
    }

    /// Drop the limits another limit of the request replaces (by the name
    /// their statuses report, as the reference server does).
    pub(super) fn drop_replaced(&mut self, replaced: &HashSet<&str>) {
        let kept = |name: Option<&Arc<str>>| name.is_none_or(|name| !replaced.contains(&**name));
        self.limits.retain(|l| kept(l.shown_name()));
        self.refused.retain(|r| kept(r.name.as_ref()));
    }
}

/// The key of a descriptor's count: its entries' values but those
/// `left_out` (the tier's, the usage's model and kind), joined (a long
/// one is held by its hash, as every key).
fn key_of(descriptor: &RateLimitDescriptor, left_out: impl Fn(&str) -> bool) -> String {
    let kept = || {
        descriptor
            .entries
            .iter()
            .filter(|entry| !left_out(entry.key.as_str()))
    };
    let mut values = kept();
    if let (Some(only), None) = (values.next(), values.next()) {
        // One value (the usual descriptor) is its key, as `joined` makes
        // it: one allocation where the list takes three.
        return only.value.clone();
    }
    let values: Vec<String> = kept().map(|entry| entry.value.clone()).collect();
    key::joined(&values)
}

/// The key of a descriptor's own `limit`: the domain and every entry's key
/// and value, joined so that two different descriptors (or domains) never
/// share a count.
fn own_key(domain: &str, descriptor: &RateLimitDescriptor) -> String {
    let parts: Vec<String> = std::iter::once(domain.to_owned())
        .chain(
            descriptor
                .entries
                .iter()
                .flat_map(|entry| [entry.key.clone(), entry.value.clone()]),
        )
        .collect();
    key::joined(&parts)
}
