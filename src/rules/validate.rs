//! A rule set as written (TOML or JSON) and its validation: every field
//! checked, a bad set refused whole with the rule and field named.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;
use serde::Deserialize;

use super::MAX_BLOCK;
use super::descriptor::Descriptor;
use super::target::{Target, parse_grpc, parse_path};
use super::{
    Counting, EnvoyFlags, KeyPart, Rule, RuleSet, RulesError, SettleFrom, Statuses, TierFrom,
};
use crate::limiter::LocalQuota;
use crate::policy::{Algorithm, Policy, parse_duration};

/// The file's shape, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RuleSetSpec {
    version: Option<u64>,
    tier: Option<String>,
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
}

/// `settle = { header = "x-usage-tokens", strip = true, body = true }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleSpec {
    header: Option<String>,
    #[serde(default)]
    strip: bool,
    #[serde(default)]
    body: bool,
    #[serde(default)]
    hits_addend: bool,
}

impl RuleSet {
    pub(super) fn validate(spec: RuleSetSpec) -> Result<Self, RulesError> {
        let mut names = HashSet::new();
        let mut rules = Vec::with_capacity(spec.rules.len());
        for (i, rule) in spec.rules.into_iter().enumerate() {
            let label = label(rule.name.as_deref(), i);
            let rule = Rule::validate(rule, &label)?;
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
        })
    }
}

impl Rule {
    /// Each field read on its own, then what no field alone can say
    /// ([`check_combinations`](Self::check_combinations)).
    fn validate(spec: RuleSpec, label: &str) -> Result<Self, RulesError> {
        // In the order of the fields, so a rule with several faults is
        // told the first.
        let name = name(spec.name, label)?;
        let methods = spec.methods.map(|m| methods(&m, label)).transpose()?;
        let envoy = EnvoyFlags {
            shadow: spec.shadow,
            unlimited: spec.unlimited,
            refuse: spec.refuse,
            replaces: spec.replaces,
            tier_entry: spec.tier_entry,
        };
        if envoy.unlimited && envoy.refuse {
            return Err(fault(
                label,
                "refuse",
                "a rule is unlimited or refuses all, not both",
            ));
        }
        let descriptor = match (spec.domain, spec.descriptor) {
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
        let (target, key) = match (&descriptor, spec.key) {
            // For Envoy alone: nothing of HTTP.
            (Some(_), None) => {
                for (field, set) in [
                    ("path", spec.path.is_some()),
                    ("grpc", spec.grpc.is_some()),
                    ("methods", methods.is_some()),
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
                (Target::None, Vec::new())
            }
            (descriptor, key_text) => {
                // The HTTP layer reads none of Envoy's answers: a rule that
                // serves both would refuse, shadow or tier one way through
                // Envoy and another through the layer.
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
                (target(spec.path, spec.grpc, label)?, key(key_text, label)?)
            }
        };
        let shape = Shape::read(spec.algorithm, spec.execution, spec.cost, label)?;
        let checked = !envoy.unlimited && !envoy.refuse;
        let policy = match (&spec.policy, checked) {
            (Some(text), true) => shape.policy("policy", text)?,
            (None, true) => return Err(fault(label, "policy", "is missing (e.g. \"100/min\")")),
            (Some(_), false) => {
                return Err(fault(
                    label,
                    "policy",
                    "an unlimited or refusing rule has no policy",
                ));
            }
            // Never checked: such a rule answers without its limiter.
            (None, false) => shape.policy("unlimited", "4294967295/s")?,
        };
        let tiers = tiers(&spec.tiers, &shape)?;
        let counting = counting(spec.count, spec.refund, label)?;
        let block = spec.block.map(|text| block(&text, label)).transpose()?;
        let local_quota = spec
            .local_quota
            .map(|text| {
                text.parse::<LocalQuota>()
                    .map_err(|e| fault(label, "local_quota", e))
            })
            .transpose()?;
        let only = spec.only.map(|only| only_list(only, label)).transpose()?;
        let settle = spec.settle.map(|s| settle(s, label)).transpose()?;
        let rule = Self {
            name: Arc::from(name),
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
            descriptor,
            envoy,
        };
        rule.check_combinations(label)?;
        Ok(rule)
    }

    /// The checks of several fields together.
    fn check_combinations(&self, label: &str) -> Result<(), RulesError> {
        let policies = || {
            std::iter::once(("policy".to_owned(), &self.policy)).chain(
                self.tiers
                    .iter()
                    .map(|(tier, policy)| (format!("tiers.{tier}"), policy)),
            )
        };
        let concurrency = policies().any(|(_, p)| p.algorithm() == Algorithm::Concurrency);
        let by_outcome = match self.counting {
            Counting::All => None,
            Counting::Only(_) => Some("count"),
            Counting::Except(_) => Some("refund"),
        };
        if let Some(field) = by_outcome {
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
        }
        if self.descriptor.is_some() {
            // Envoy asks before the request and never tells the outcome: a
            // cost after the response comes as a descriptor sent again at
            // the stream's end, with its hits_addend.
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
        if self.settle.is_some() {
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
        }
        if self.block.is_some() && concurrency {
            return Err(fault(
                label,
                "block",
                "a concurrency limit does not block after a breach",
            ));
        }
        if let Some(quota) = self.local_quota {
            if by_outcome.is_some() {
                return Err(fault(
                    label,
                    "local_quota",
                    "a rule counting by outcome gives a request's units back after its \
                     response, and a unit admitted from a local batch cannot be given back",
                ));
            }
            for (field, policy) in policies() {
                quota
                    .batch_for(policy)
                    .map_err(|e| fault(label, "local_quota", format!("with {field}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// What every policy of a rule (its own and its tiers') takes from the
/// rule: an algorithm, an execution and a cost.
struct Shape<'a> {
    label: &'a str,
    algorithm: Option<Algorithm>,
    execution: Option<crate::policy::Execution>,
    cost: Option<u64>,
}

impl<'a> Shape<'a> {
    fn read(
        algorithm: Option<String>,
        execution: Option<String>,
        cost: Option<u64>,
        label: &'a str,
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
        })
    }

    /// The policy written `text` in `field`, in this shape.
    fn policy(&self, field: &str, text: &str) -> Result<Policy, RulesError> {
        let label = self.label;
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
        } else {
            None
        }
    }
}

/// Where a rule's real cost comes from after the response.
fn settle(spec: SettleSpec, label: &str) -> Result<SettleFrom, RulesError> {
    let header = spec
        .header
        .map(|name| {
            HeaderName::try_from(name.trim()).map_err(|_| {
                fault(
                    label,
                    "settle.header",
                    format!("{name:?} is not a valid header name"),
                )
            })
        })
        .transpose()?;
    if let Some(reason) = header.as_ref().and_then(crate::http::unusable_cost_header) {
        return Err(fault(
            label,
            "settle.header",
            format!(
                "{:?} can never settle a cost: {reason}",
                header.as_ref().map(HeaderName::as_str).unwrap_or_default()
            ),
        ));
    }
    if spec.strip && header.is_none() {
        return Err(fault(
            label,
            "settle.strip",
            "strips the cost header, and settle names none (settle.header)",
        ));
    }
    Ok(SettleFrom {
        header,
        strip: spec.strip,
        body: spec.body,
        hits_addend: spec.hits_addend,
    })
}

fn name(name: Option<String>, label: &str) -> Result<String, RulesError> {
    match name {
        Some(name) if name.is_empty() => Err(fault(label, "name", "is empty")),
        Some(name)
            if name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) =>
        {
            Err(fault(
                label,
                "name",
                "use at most 64 letters, digits, `-`, `_` and `.` (it names the rule's keys in the store)",
            ))
        }
        Some(name) => Ok(name),
        None => Err(fault(label, "name", "is missing")),
    }
}

fn methods(methods: &[String], label: &str) -> Result<HashSet<Method>, RulesError> {
    if methods.is_empty() {
        return Err(fault(
            label,
            "methods",
            "is empty: leave it out to match every method",
        ));
    }
    methods
        .iter()
        .map(|m| {
            Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| fault(label, "methods", format!("{m:?} is not an HTTP method")))
        })
        .collect()
}

fn target(path: Option<String>, grpc: Option<String>, label: &str) -> Result<Target, RulesError> {
    match (path, grpc) {
        (Some(_), Some(_)) => Err(fault(
            label,
            "grpc",
            "a rule matches a path or a gRPC method, not both",
        )),
        (Some(path), None) => Ok(Target::Path(
            parse_path(&path).map_err(|p| fault(label, "path", p))?,
        )),
        (None, Some(grpc)) => parse_grpc(&grpc).map_err(|p| fault(label, "grpc", p)),
        (None, None) => Ok(Target::Any),
    }
}

fn key(key: Option<String>, label: &str) -> Result<Vec<KeyPart>, RulesError> {
    match key {
        Some(key) => parse_key(&key).map_err(|p| fault(label, "key", p)),
        None => Err(fault(
            label,
            "key",
            "is missing (e.g. \"client_ip\", \"global\")",
        )),
    }
}

fn tiers(
    tiers: &BTreeMap<String, String>,
    shape: &Shape<'_>,
) -> Result<BTreeMap<String, Policy>, RulesError> {
    tiers
        .iter()
        .map(|(tier, text)| {
            if tier.trim().is_empty() {
                return Err(fault(shape.label, "tiers", "a tier's name is empty"));
            }
            Ok((tier.clone(), shape.policy(&format!("tiers.{tier}"), text)?))
        })
        .collect()
}

fn counting(
    count: Option<Vec<String>>,
    refund: Option<Vec<String>>,
    label: &str,
) -> Result<Counting, RulesError> {
    match (count, refund) {
        (Some(_), Some(_)) => Err(fault(
            label,
            "refund",
            "name what counts (`count`) or what is refunded (`refund`), not both",
        )),
        (Some(list), None) => Ok(Counting::Only(
            parse_statuses(&list).map_err(|p| fault(label, "count", p))?,
        )),
        (None, Some(list)) => Ok(Counting::Except(
            parse_statuses(&list).map_err(|p| fault(label, "refund", p))?,
        )),
        (None, None) => Ok(Counting::All),
    }
}

fn block(text: &str, label: &str) -> Result<Duration, RulesError> {
    let block = parse_duration(text).map_err(|_| {
        fault(
            label,
            "block",
            format!("{text:?} is not a duration such as \"30s\" or \"15m\""),
        )
    })?;
    if block > MAX_BLOCK {
        return Err(fault(
            label,
            "block",
            format!(
                "{text:?} is longer than a day, the longest block a rule may set \
                 (did you mean minutes, `m`?)"
            ),
        ));
    }
    Ok(block)
}

fn only_list(only: Vec<String>, label: &str) -> Result<HashSet<String>, RulesError> {
    if only.is_empty() {
        return Err(fault(
            label,
            "only",
            "is empty: nobody could call; leave it out to let everyone call",
        ));
    }
    Ok(only.into_iter().collect())
}

/// How a rule is named in errors: `"login" (#3)`, or `#3` without a name.
pub(super) fn label(name: Option<&str>, index: usize) -> String {
    match name {
        Some(name) => format!("{name:?} (#{})", index + 1),
        None => format!("#{}", index + 1),
    }
}

fn fault(rule: &str, field: &str, problem: impl fmt::Display) -> RulesError {
    RulesError {
        rule: Some(rule.to_owned()),
        field: field.to_owned(),
        problem: problem.to_string(),
    }
}

/// `["4xx", "401"]` as a set of statuses.
fn parse_statuses(list: &[String]) -> Result<Statuses, String> {
    if list.is_empty() {
        return Err("is empty: name statuses such as \"4xx\" or \"401\"".to_owned());
    }
    let mut statuses = Statuses::default();
    for item in list {
        let text = item.trim().to_ascii_lowercase();
        let bad = || format!("{item:?} is not a status class (\"4xx\") or code (\"401\")");
        match text.as_bytes() {
            [d @ b'1'..=b'5', b'x', b'x'] => statuses.classes[usize::from(d - b'0')] = true,
            [b'1'..=b'5', b'0'..=b'9', b'0'..=b'9'] => {
                statuses.codes.insert(text.parse().map_err(|_| bad())?);
            }
            _ => return Err(bad()),
        }
    }
    Ok(statuses)
}

/// `client_ip+header:x-api-key` as parts.
pub(super) fn parse_key(text: &str) -> Result<Vec<KeyPart>, String> {
    text.split('+')
        .map(str::trim)
        .map(|part| match part {
            "ip" => Ok(KeyPart::Ip),
            "client_ip" => Ok(KeyPart::ClientIp),
            "global" => Ok(KeyPart::Global),
            "path" => Ok(KeyPart::Path),
            other => match other.strip_prefix("header:") {
                Some(name) => HeaderName::try_from(name)
                    .map(KeyPart::Header)
                    .map_err(|_| format!("{name:?} is not a valid header name")),
                None => Err(format!(
                    "unknown key part {other:?}: use ip, client_ip, header:NAME, global or path, \
                     joined with `+`"
                )),
            },
        })
        .collect()
}
