//! A rule set as written (TOML or JSON) and its validation: every field
//! checked, a bad set refused whole with the rule and field named.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use http::header::HeaderName;
use serde::Deserialize;

use super::catalog::{Catalog, CatalogSpec};
use super::descriptor::{Descriptor, UsageEntries};
use super::fields::{
    block, counting, fault, key, label, methods, name, notify, only_list, settle, target, tiers,
};
use super::shape::Shape;
use super::target::Target;
use super::unit::Unit;
use super::{Counting, EnvoyFlags, KeyPart, Rule, RuleSet, RulesError, TierFrom};
use crate::limiter::LocalQuota;
use crate::policy::{Algorithm, Policy};

/// The file's shape, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RuleSetSpec {
    version: Option<u64>,
    tier: Option<String>,
    catalog: Option<CatalogSpec>,
    #[serde(default)]
    rules: Vec<RuleSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    name: Option<String>,
    methods: Option<Vec<String>>,
    path: Option<String>,
    grpc: Option<String>,
    key: Option<String>,
    policy: Option<String>,
    algorithm: Option<String>,
    execution: Option<String>,
    cost: Option<u64>,
    #[serde(default)]
    tiers: BTreeMap<String, String>,
    #[serde(default)]
    allow: Vec<String>,
    only: Option<Vec<String>>,
    count: Option<Vec<String>>,
    refund: Option<Vec<String>>,
    block: Option<String>,
    local_quota: Option<String>,
    settle: Option<SettleSpec>,
    notify: Option<Vec<u64>>,
    domain: Option<String>,
    descriptor: Option<Vec<String>>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    refuse: bool,
    #[serde(default)]
    replaces: Vec<String>,
    tier_entry: Option<String>,
    usage: Option<UsageSpec>,
}

/// `usage = { model = "model", kind = "token_kind" }`: the entries of the
/// descriptor naming the model and the kind of tokens of its `hits_addend`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageSpec {
    model: Option<String>,
    kind: Option<String>,
}

/// `settle = { header = "x-usage-tokens", strip = true, body = true }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SettleSpec {
    pub(super) header: Option<String>,
    #[serde(default)]
    pub(super) strip: bool,
    #[serde(default)]
    pub(super) body: bool,
    #[serde(default)]
    pub(super) hits_addend: bool,
}

impl RuleSet {
    pub(super) fn validate(spec: RuleSetSpec) -> Result<Self, RulesError> {
        let catalog = spec.catalog.map(Catalog::validate).transpose()?;
        let currency = catalog.as_ref().map(Catalog::currency);
        let mut names = HashSet::new();
        let mut rules = Vec::with_capacity(spec.rules.len());
        for (i, rule) in spec.rules.into_iter().enumerate() {
            let label = label(rule.name.as_deref(), i);
            let rule = Rule::validate(rule, &label, currency)?;
            if !names.insert(rule.name.clone()) {
                return Err(fault(&label, "name", "another rule has this name"));
            }
            rules.push(rule);
        }
        let tier = match spec.tier.as_deref().map(str::trim) {
            None => TierFrom::None,
            Some("extension") => TierFrom::Extension,
            Some(text) => match text.strip_prefix("header:") {
                Some(name) => HeaderName::try_from(name)
                    .map(TierFrom::Header)
                    .map_err(|_| RulesError {
                        rule: None,
                        field: "tier".to_owned(),
                        problem: format!("{name:?} is not a valid header name"),
                    })?,
                None => {
                    return Err(RulesError {
                        rule: None,
                        field: "tier".to_owned(),
                        problem: format!("{text:?}: use \"header:NAME\" or \"extension\""),
                    });
                }
            },
        };
        Ok(Self {
            version: spec.version,
            tier,
            rules,
            catalog: catalog.map(Arc::new),
            places: Vec::new(),
        })
    }
}

impl Rule {
    /// Each field read on its own, then what no field alone can say
    /// ([`check_combinations`](Self::check_combinations)).
    fn validate(spec: RuleSpec, label: &str, currency: Option<&str>) -> Result<Self, RulesError> {
        // In the order of the fields, so a rule with several faults is
        // told the first.
        let name: Arc<str> = Arc::from(name(spec.name, label)?);
        let methods = spec.methods.map(|m| methods(&m, label)).transpose()?;
        let envoy = EnvoyFlags {
            shadow: spec.shadow,
            unlimited: spec.unlimited,
            refuse: spec.refuse,
            replaces: spec.replaces,
            tier_entry: spec.tier_entry,
            shown_name: Some(Arc::clone(&name)),
            refused_rate: None,
            usage: spec.usage.map(|u| UsageEntries {
                model: u.model,
                kind: u.kind,
            }),
        };
        let descriptor = descriptor_for(spec.domain, spec.descriptor, &envoy, label)?;
        let http = Http {
            path: spec.path,
            grpc: spec.grpc,
            methods: methods.is_some(),
            key: spec.key,
        };
        let (target, key) = http.read(descriptor.as_ref(), &envoy, label)?;
        let shape = Shape::read(spec.algorithm, spec.execution, spec.cost, label, currency)?;
        let policy = shape.rule_policy(spec.policy.as_deref(), &envoy)?;
        let tiers = tiers(&spec.tiers, &shape)?;
        let unit = shape.unit(spec.policy.as_deref(), &spec.tiers)?;
        let notify = spec
            .notify
            .map(|n| notify(n, label))
            .transpose()?
            .unwrap_or_default();
        let counting = counting(spec.count, spec.refund, label)?;
        let block = spec.block.map(|text| block(&text, label)).transpose()?;
        let local_quota = spec
            .local_quota
            .map(|text| local_quota(&text, label))
            .transpose()?;
        let only = spec.only.map(|only| only_list(only, label)).transpose()?;
        let settle = spec.settle.map(|s| settle(s, label)).transpose()?;
        let rule = Self {
            name,
            methods,
            target,
            key,
            policy,
            tiers,
            allow: spec.allow.into_iter().collect(),
            only,
            counting,
            block,
            local_quota,
            settle: settle.map(Arc::new),
            unit,
            notify,
            descriptor,
            envoy,
        };
        rule.check_combinations(label)?;
        Ok(rule)
    }

    /// A rule counting tokens or money counts thousands of units a
    /// request: a counter's algorithm, not the sliding log's entry per
    /// unit (which counts at most 10,000 a request) nor a concurrency
    /// limit's slots.
    fn check_unit(&self, label: &str) -> Result<(), RulesError> {
        if self.unit == Unit::Requests {
            return Ok(());
        }
        for (field, policy) in self.policies() {
            if matches!(
                policy.algorithm(),
                Algorithm::SlidingLog | Algorithm::Concurrency
            ) {
                return Err(fault(
                    label,
                    &field,
                    format!(
                        "counts {}, and the {} counts requests: choose algorithm = \
                         \"fixed-window\" (a budget per period, on the calendar too), \"gcra\" or \
                         \"sliding-window\" (a rate)",
                        self.unit,
                        policy.algorithm()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The checks of several fields together.
    fn check_combinations(&self, label: &str) -> Result<(), RulesError> {
        let concurrency = self
            .policies()
            .any(|(_, p)| p.algorithm() == Algorithm::Concurrency);
        self.check_counting(label, concurrency)?;
        self.check_envoy(label)?;
        self.check_usage(label)?;
        self.check_settle(label, concurrency)?;
        if self.block.is_some() && concurrency {
            return Err(fault(
                label,
                "block",
                "a concurrency limit does not block after a breach",
            ));
        }
        self.check_local_quota(label)?;
        self.check_unit(label)
    }

    /// The rule's policies: its own and its tiers', each with its field.
    fn policies(&self) -> impl Iterator<Item = (String, &Policy)> {
        std::iter::once(("policy".to_owned(), &self.policy)).chain(
            self.tiers
                .iter()
                .map(|(tier, policy)| (format!("tiers.{tier}"), policy)),
        )
    }

    /// The field that makes the rule count by outcome, if any.
    fn by_outcome(&self) -> Option<&'static str> {
        match self.counting {
            Counting::All => None,
            Counting::Only(_) => Some("count"),
            Counting::Except(_) => Some("refund"),
        }
    }

    /// Counting by outcome needs an HTTP status, and a count of requests.
    fn check_counting(&self, label: &str, concurrency: bool) -> Result<(), RulesError> {
        let Some(field) = self.by_outcome() else {
            return Ok(());
        };
        if matches!(self.target, Target::Grpc { .. }) {
            return Err(fault(
                label,
                field,
                "counting by outcome reads the HTTP status, and a gRPC call's status is in its trailers",
            ));
        }
        if concurrency {
            return Err(fault(
                label,
                field,
                "a concurrency limit counts requests in flight, not responses: its slot is given back when the response ends",
            ));
        }
        Ok(())
    }

    /// What a descriptor rule can be told: Envoy asks before the request
    /// and never tells the outcome (a cost after the response comes as a
    /// descriptor sent again at the stream's end, with its hits_addend).
    fn check_envoy(&self, label: &str) -> Result<(), RulesError> {
        if self.descriptor.is_some() {
            let settle = self.settle.as_deref();
            for (field, set) in [
                ("count", matches!(self.counting, Counting::Only(_))),
                ("refund", matches!(self.counting, Counting::Except(_))),
                (
                    "settle",
                    settle.is_some_and(|s| s.header.is_some() || s.body || !s.hits_addend),
                ),
                (
                    "tiers",
                    !self.tiers.is_empty() && self.envoy.tier_entry.is_none(),
                ),
            ] {
                if set {
                    return Err(fault(
                        label,
                        field,
                        "a descriptor rule is asked before the request and never told its response \
                         (tiers: `tier_entry` names the entry whose value is the plan; a cost after \
                         the response: settle = { hits_addend = true })",
                    ));
                }
            }
        }
        if let (Some(descriptor), Some(entry)) = (&self.descriptor, &self.envoy.tier_entry) {
            if !descriptor.has_key(entry) {
                return Err(fault(
                    label,
                    "tier_entry",
                    format!(
                        "{entry:?} is no entry of the rule's descriptor: the tier is read from one"
                    ),
                ));
            }
            if self.tiers.is_empty() {
                return Err(fault(
                    label,
                    "tier_entry",
                    "names the entry whose value picks a tier of `tiers`, and the rule has none",
                ));
            }
        }
        if self.settle.as_deref().is_some_and(|s| s.hits_addend) && self.descriptor.is_none() {
            return Err(fault(
                label,
                "settle.hits_addend",
                "a descriptor's hits_addend is Envoy's: only a descriptor rule settles from it",
            ));
        }
        Ok(())
    }

    /// A rule's `usage` names entries of its descriptor, and counts tokens
    /// (of any model and kind) or money (the catalog's price of the
    /// model's tokens of that kind).
    fn check_usage(&self, label: &str) -> Result<(), RulesError> {
        if self.descriptor.is_some() && self.unit == Unit::Money && self.envoy.usage.is_none() {
            return Err(fault(
                label,
                "usage",
                "is missing: a descriptor rule counting money prices each hits_addend as tokens \
                 of the model and kind its entries name (usage = { model = \"model\", kind = \
                 \"token_kind\" }); a rule counting money for the HTTP layer has a key and no \
                 descriptor",
            ));
        }
        let (Some(usage), Some(descriptor)) = (&self.envoy.usage, &self.descriptor) else {
            return Ok(());
        };
        match self.unit {
            Unit::Requests => {
                return Err(fault(
                    label,
                    "usage",
                    "names what a descriptor's hits_addend counts: tokens, or money at the \
                     catalog's prices, and the rule's policy counts requests \
                     (write \"20000 tokens/min\" or \"100 USD/month\")",
                ));
            }
            Unit::Money => {
                for (field, entry) in [("usage.model", &usage.model), ("usage.kind", &usage.kind)] {
                    if entry.is_none() {
                        return Err(fault(
                            label,
                            field,
                            "is missing: a rule counted in money prices each descriptor's \
                             hits_addend as tokens of its model and kind (both entries of the \
                             descriptor)",
                        ));
                    }
                }
            }
            Unit::Tokens => {
                if usage.model.is_none() && usage.kind.is_none() {
                    return Err(fault(
                        label,
                        "usage",
                        "names no entry: name the model's (model = \"model\"), the kind's \
                         (kind = \"token_kind\") or both",
                    ));
                }
            }
        }
        for (field, entry) in [("usage.model", &usage.model), ("usage.kind", &usage.kind)] {
            let Some(entry) = entry else { continue };
            if !descriptor.has_key(entry) {
                return Err(fault(
                    label,
                    field,
                    format!(
                        "{entry:?} is no entry of the rule's descriptor: add it there \
                         (`\"{entry}\"`, any value), and it is left out of the key"
                    ),
                ));
            }
            if self.envoy.tier_entry.as_ref() == Some(entry) {
                return Err(fault(
                    label,
                    field,
                    format!("{entry:?} is the tier_entry: the plan and the usage are two entries"),
                ));
            }
        }
        if usage.model.is_some() && usage.model == usage.kind {
            return Err(fault(
                label,
                "usage.kind",
                "is the model's entry too: the model and the kind are two entries",
            ));
        }
        Ok(())
    }

    /// A cost settled after the response needs a count of units, not of
    /// requests in flight nor of a local batch's.
    fn check_settle(&self, label: &str, concurrency: bool) -> Result<(), RulesError> {
        if self.settle.is_none() {
            return Ok(());
        }
        if concurrency {
            return Err(fault(
                label,
                "settle",
                "a concurrency limit counts requests in flight, not a cost",
            ));
        }
        if self.local_quota.is_some() {
            return Err(fault(
                label,
                "settle",
                "units admitted from a local batch cannot be settled after the response \
                 (leave out local_quota)",
            ));
        }
        Ok(())
    }

    /// A local quota fits every policy of the rule, and gives nothing back.
    fn check_local_quota(&self, label: &str) -> Result<(), RulesError> {
        let Some(quota) = self.local_quota else {
            return Ok(());
        };
        if self.by_outcome().is_some() {
            return Err(fault(
                label,
                "local_quota",
                "a rule counting by outcome gives a request's units back after its \
                 response, and a unit admitted from a local batch cannot be given back",
            ));
        }
        for (field, policy) in self.policies() {
            quota
                .batch_for(policy)
                .map_err(|e| fault(label, "local_quota", format!("with {field}: {e}")))?;
        }
        Ok(())
    }
}

/// The fields of a rule for the HTTP layer, read together with the
/// descriptor: without a `key`, a descriptor rule serves Envoy alone.
struct Http {
    path: Option<String>,
    grpc: Option<String>,
    methods: bool,
    key: Option<String>,
}

impl Http {
    /// What the rule matches of an HTTP request, and its key.
    fn read(
        self,
        descriptor: Option<&Descriptor>,
        envoy: &EnvoyFlags,
        label: &str,
    ) -> Result<(Target, Vec<KeyPart>), RulesError> {
        if descriptor.is_some() && self.key.is_none() {
            // For Envoy alone: nothing of HTTP.
            for (field, set) in [
                ("path", self.path.is_some()),
                ("grpc", self.grpc.is_some()),
                ("methods", self.methods),
            ] {
                if set {
                    return Err(fault(
                        label,
                        field,
                        "a descriptor rule without a `key` serves Envoy alone, and matches \
                         no HTTP request: give it a `key` to serve the HTTP layer too",
                    ));
                }
            }
            return Ok((Target::None, Vec::new()));
        }
        // The HTTP layer reads none of Envoy's answers: a rule that serves
        // both would refuse, shadow or tier one way through Envoy and
        // another through the layer.
        if descriptor.is_some()
            && let Some(field) = envoy.field()
        {
            return Err(fault(
                label,
                field,
                "applies to Envoy alone, and this rule has a `key` for the HTTP layer \
                 too: write the Envoy rule without a `key`, beside the HTTP one",
            ));
        }
        Ok((target(self.path, self.grpc, label)?, key(self.key, label)?))
    }
}

/// The descriptor a rule of `envoy` flags matches, if any: flags that
/// contradict each other, or set on a rule matching no descriptor, are
/// refused.
fn descriptor_for(
    domain: Option<String>,
    entries: Option<Vec<String>>,
    envoy: &EnvoyFlags,
    label: &str,
) -> Result<Option<Descriptor>, RulesError> {
    if envoy.unlimited && envoy.refuse {
        return Err(fault(
            label,
            "refuse",
            "a rule is unlimited or refuses all, not both",
        ));
    }
    let descriptor = match (domain, entries) {
        (None, None) => None,
        (domain, entries) => Some(descriptor_of(domain, entries, label)?),
    };
    if descriptor.is_none()
        && let Some(field) = envoy.field()
    {
        return Err(fault(
            label,
            field,
            "applies to descriptor rules only (`domain` and `descriptor`)",
        ));
    }
    Ok(descriptor)
}

/// A rule's `local_quota`.
fn local_quota(text: &str, label: &str) -> Result<LocalQuota, RulesError> {
    text.parse::<LocalQuota>()
        .map_err(|e| fault(label, "local_quota", e))
}

/// A descriptor rule's `domain` and `descriptor`, together.
fn descriptor_of(
    domain: Option<String>,
    entries: Option<Vec<String>>,
    label: &str,
) -> Result<Descriptor, RulesError> {
    let domain = domain.ok_or_else(|| {
        fault(
            label,
            "domain",
            "is missing: a descriptor rule names the domain of its descriptors",
        )
    })?;
    let entries = entries.ok_or_else(|| {
        fault(
            label,
            "descriptor",
            "is missing: a rule with a domain matches a descriptor (`descriptor = [\"remote_address\"]`)",
        )
    })?;
    Descriptor::parse(&domain, &entries).map_err(|problem| fault(label, "descriptor", problem))
}

impl EnvoyFlags {
    /// The first flag set, by its field's name.
    fn field(&self) -> Option<&'static str> {
        if self.shadow {
            Some("shadow")
        } else if self.unlimited {
            Some("unlimited")
        } else if self.refuse {
            Some("refuse")
        } else if !self.replaces.is_empty() {
            Some("replaces")
        } else if self.tier_entry.is_some() {
            Some("tier_entry")
        } else if self.usage.is_some() {
            Some("usage")
        } else {
            None
        }
    }
}
