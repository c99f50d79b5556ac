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
use super::target::{Target, parse_grpc, parse_path};
use super::{Counting, KeyPart, Rule, RuleSet, RulesError, Statuses, TierFrom};
use crate::limiter::LocalQuota;
use crate::policy::{Algorithm, Policy};

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
    fn validate(spec: RuleSpec, label: &str) -> Result<Self, RulesError> {
        let name = match spec.name {
            Some(name) if name.is_empty() => return Err(fault(label, "name", "is empty")),
            Some(name)
                if name.len() > 64
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) =>
            {
                return Err(fault(
                    label,
                    "name",
                    "use at most 64 letters, digits, `-`, `_` and `.` (it names the rule's keys in the store)",
                ));
            }
            Some(name) => name,
            None => return Err(fault(label, "name", "is missing")),
        };
        let methods = spec
            .methods
            .map(|methods| {
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
                        Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| {
                            fault(label, "methods", format!("{m:?} is not an HTTP method"))
                        })
                    })
                    .collect()
            })
            .transpose()?;
        let target = match (spec.path, spec.grpc) {
            (Some(_), Some(_)) => {
                return Err(fault(
                    label,
                    "grpc",
                    "a rule matches a path or a gRPC method, not both",
                ));
            }
            (Some(path), None) => {
                Target::Path(parse_path(&path).map_err(|p| fault(label, "path", p))?)
            }
            (None, Some(grpc)) => parse_grpc(&grpc).map_err(|p| fault(label, "grpc", p))?,
            (None, None) => Target::Any,
        };
        let key = match spec.key {
            Some(key) => parse_key(&key).map_err(|p| fault(label, "key", p))?,
            None => {
                return Err(fault(
                    label,
                    "key",
                    "is missing (e.g. \"client_ip\", \"global\")",
                ));
            }
        };
        let algorithm = spec
            .algorithm
            .map(|a| {
                a.parse::<Algorithm>()
                    .map_err(|e| fault(label, "algorithm", e))
            })
            .transpose()?;
        let execution = spec
            .execution
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
        let policy_of = |field: &str, text: &str| -> Result<Policy, RulesError> {
            let mut policy: Policy = text.parse().map_err(|e| fault(label, field, e))?;
            if let Some(algorithm) = algorithm {
                policy = policy
                    .with_algorithm(algorithm)
                    .map_err(|e| fault(label, field, e))?;
            }
            if let Some(execution) = execution {
                policy = policy
                    .with_execution(execution)
                    .map_err(|e| fault(label, "execution", e))?;
            }
            if let Some(cost) = spec.cost {
                policy = policy.with_cost(cost).map_err(|e| fault(label, field, e))?;
            }
            Ok(policy)
        };
        let policy = match &spec.policy {
            Some(text) => policy_of("policy", text)?,
            None => return Err(fault(label, "policy", "is missing (e.g. \"100/min\")")),
        };
        let mut tiers = BTreeMap::new();
        for (tier, text) in &spec.tiers {
            if tier.trim().is_empty() {
                return Err(fault(label, "tiers", "a tier's name is empty"));
            }
            tiers.insert(tier.clone(), policy_of(&format!("tiers.{tier}"), text)?);
        }
        let counting = match (spec.count, spec.refund) {
            (Some(_), Some(_)) => {
                return Err(fault(
                    label,
                    "refund",
                    "name what counts (`count`) or what is refunded (`refund`), not both",
                ));
            }
            (Some(list), None) => {
                Counting::Only(parse_statuses(&list).map_err(|p| fault(label, "count", p))?)
            }
            (None, Some(list)) => {
                Counting::Except(parse_statuses(&list).map_err(|p| fault(label, "refund", p))?)
            }
            (None, None) => Counting::All,
        };
        let field = match counting {
            Counting::Only(_) => "count",
            _ => "refund",
        };
        if counting != Counting::All && matches!(target, Target::Grpc { .. }) {
            return Err(fault(
                label,
                field,
                "counting by outcome reads the HTTP status, and a gRPC call's status is in its trailers",
            ));
        }
        if counting != Counting::All
            && std::iter::once(&policy)
                .chain(tiers.values())
                .any(|p| p.algorithm() == Algorithm::Concurrency)
        {
            return Err(fault(
                label,
                field,
                "a concurrency limit counts requests in flight, not responses: its slot is given back when the response ends",
            ));
        }
        let block = spec
            .block
            .map(|text| {
                let block = duration(&text).map_err(|_| {
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
            })
            .transpose()?;
        if block.is_some()
            && std::iter::once(&policy)
                .chain(tiers.values())
                .any(|p| p.algorithm() == Algorithm::Concurrency)
        {
            return Err(fault(
                label,
                "block",
                "a concurrency limit does not block after a breach",
            ));
        }
        let local_quota = spec
            .local_quota
            .map(|text| {
                let quota = text
                    .parse::<LocalQuota>()
                    .map_err(|e| fault(label, "local_quota", e))?;
                if counting != Counting::All {
                    return Err(fault(
                        label,
                        "local_quota",
                        "a rule counting by outcome gives a request's units back after its \
                         response, and a unit admitted from a local batch cannot be given back",
                    ));
                }
                let policies = std::iter::once(("policy".to_owned(), &policy)).chain(
                    tiers
                        .iter()
                        .map(|(tier, policy)| (format!("tiers.{tier}"), policy)),
                );
                for (field, policy) in policies {
                    quota
                        .batch_for(policy)
                        .map_err(|e| fault(label, "local_quota", format!("with {field}: {e}")))?;
                }
                Ok(quota)
            })
            .transpose()?;
        let only = spec
            .only
            .map(|only| {
                if only.is_empty() {
                    Err(fault(
                        label,
                        "only",
                        "is empty: nobody could call; leave it out to let everyone call",
                    ))
                } else {
                    Ok(only.into_iter().collect::<HashSet<_>>())
                }
            })
            .transpose()?;
        Ok(Self {
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
        })
    }
}

/// A duration written as a rate's window (`"30s"`, `"15m"`, `"1d"`).
fn duration(text: &str) -> Result<Duration, crate::PolicyError> {
    format!("1/{}", text.trim())
        .parse::<crate::policy::Rate>()
        .map(|rate| rate.window())
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
