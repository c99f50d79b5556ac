//! Each field of a rule read on its own, refused with the rule and the
//! field named (what no field alone can say is checked in `validate`).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;

use super::MAX_BLOCK;
use super::shape::Shape;
use super::target::{Target, parse_grpc, parse_path};
use super::validate::SettleSpec;
use super::{Counting, KeyPart, RulesError, SettleFrom, Statuses};
use crate::policy::{Policy, parse_duration};

/// Where a rule's real cost comes from after the response.
pub(super) fn settle(spec: SettleSpec, label: &str) -> Result<SettleFrom, RulesError> {
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

pub(super) fn name(name: Option<String>, label: &str) -> Result<String, RulesError> {
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

pub(super) fn methods(methods: &[String], label: &str) -> Result<HashSet<Method>, RulesError> {
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

pub(super) fn target(
    path: Option<String>,
    grpc: Option<String>,
    label: &str,
) -> Result<Target, RulesError> {
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

pub(super) fn key(key: Option<String>, label: &str) -> Result<Vec<KeyPart>, RulesError> {
    match key {
        Some(key) => parse_key(&key).map_err(|p| fault(label, "key", p)),
        None => Err(fault(
            label,
            "key",
            "is missing (e.g. \"client_ip\", \"global\")",
        )),
    }
}

pub(super) fn tiers(
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

pub(super) fn counting(
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

pub(super) fn block(text: &str, label: &str) -> Result<Duration, RulesError> {
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

pub(super) fn only_list(only: Vec<String>, label: &str) -> Result<HashSet<String>, RulesError> {
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

pub(super) fn fault(rule: &str, field: &str, problem: impl fmt::Display) -> RulesError {
    RulesError {
        rule: Some(rule.to_owned()),
        field: field.to_owned(),
        problem: problem.to_string(),
    }
}

/// `["4xx", "401"]` as a set of statuses.
pub(super) fn parse_statuses(list: &[String]) -> Result<Statuses, String> {
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

/// `notify = [50, 80, 95, 100]`: shares in percent, 1 to 100, each once;
/// kept in increasing order.
pub(super) fn notify(shares: Vec<u64>, label: &str) -> Result<Vec<u8>, RulesError> {
    if shares.is_empty() {
        return Err(fault(
            label,
            "notify",
            "is empty: leave it out to be told nothing",
        ));
    }
    let mut out = Vec::with_capacity(shares.len());
    for share in shares {
        let share = u8::try_from(share)
            .ok()
            .filter(|s| (1..=100).contains(s))
            .ok_or_else(|| {
                fault(
                    label,
                    "notify",
                    format!("{share} is not a share of the budget in percent, 1 to 100"),
                )
            })?;
        if out.contains(&share) {
            return Err(fault(label, "notify", format!("{share} is given twice")));
        }
        out.push(share);
    }
    out.sort_unstable();
    Ok(out)
}
