//! Rule sets written as Envoy's reference rate limit server's YAML
//! (`domain`, nested `descriptors` with `key`, `value` and `rate_limit`):
//! read unchanged into descriptor rules, one per limit, counted in fixed
//! windows as the reference server counts them.

use serde::Deserialize;
use serde_json::{Value, json};

use super::validate::RuleSetSpec;
use super::{RuleSet, RulesError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Root {
    domain: Option<String>,
    #[serde(default)]
    descriptors: Vec<Node>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Node {
    key: Option<String>,
    value: Option<String>,
    rate_limit: Option<Limit>,
    #[serde(default)]
    descriptors: Vec<Node>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    share_threshold: bool,
    // Accepted as the reference server does; they name its statistics,
    // which this crate does not keep.
    #[serde(default, rename = "detailed_metric")]
    _detailed_metric: bool,
    #[serde(default, rename = "value_to_metric")]
    _value_to_metric: bool,
    #[serde(default, rename = "metadata")]
    _metadata: Option<serde_yaml_ng::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limit {
    requests_per_unit: Option<u64>,
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<Replaces>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Replaces {
    name: Option<String>,
}

/// The window of a reference-server unit (any case), as a policy writes
/// it: windows aligned to the Unix epoch, except that a month is a
/// calendar month and a week a calendar week from Monday (the reference
/// server's are 30 days, and 7 days from a Thursday), in UTC.
pub(crate) fn window_of_unit(unit: &str) -> Option<&'static str> {
    Some(match unit.to_ascii_lowercase().as_str() {
        "second" => "1s",
        "minute" => "1m",
        "hour" => "1h",
        "day" => "1d",
        "week" => "week",
        "month" => "month",
        "year" => "365d",
        _ => return None,
    })
}

impl RuleSet {
    /// Read the configuration files of Envoy's reference rate limit server
    /// (`envoyproxy/ratelimit`), each a domain with its descriptors, as
    /// one rule set: every `rate_limit` becomes a descriptor rule, counted
    /// in fixed windows, named by its `name` or else by its place
    /// (`domain.key_value.key`). `files` are each file's name (for the
    /// errors) and text. `shadow_mode`, `unlimited`, `replaces` and
    /// `requests_per_unit: 0` (every request over the limit) keep their
    /// meaning; `detailed_metric`, `value_to_metric` and `metadata`
    /// are accepted and have no effect; `quota_mode` and `share_threshold`
    /// are refused (not supported).
    pub fn from_envoy_yaml<'a>(
        files: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, RulesError> {
        let mut rules = Vec::new();
        let mut domains = std::collections::HashSet::new();
        for (file, text) in files {
            let fault = |problem: String| RulesError {
                rule: None,
                field: file.to_owned(),
                problem,
            };
            let root: Root = super::expansion::yaml(text).map_err(|e| fault(e.to_string()))?;
            let domain = root
                .domain
                .filter(|d| !d.is_empty())
                .ok_or_else(|| fault("config file cannot have empty domain".to_owned()))?;
            if !domains.insert(domain.clone()) {
                return Err(fault(format!("duplicate domain '{domain}' in config file")));
            }
            let mut path = Vec::new();
            walk(&domain, &root.descriptors, &mut path, &mut rules).map_err(fault)?;
        }
        let spec: RuleSetSpec =
            serde_json::from_value(json!({ "rules": rules })).map_err(|e| RulesError {
                rule: None,
                field: "envoy yaml".to_owned(),
                problem: e.to_string(),
            })?;
        Self::validate(spec)
    }
}

/// The rules of `nodes` under the entries `path`, into `rules`.
fn walk(
    domain: &str,
    nodes: &[Node],
    path: &mut Vec<String>,
    rules: &mut Vec<Value>,
) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for node in nodes {
        let key = node
            .key
            .as_deref()
            .filter(|k| !k.is_empty())
            .ok_or("descriptor has empty key")?;
        let entry = match node.value.as_deref().filter(|v| !v.is_empty()) {
            Some(value) => format!("{key}={value}"),
            None => key.to_owned(),
        };
        if !seen.insert(entry.clone()) {
            return Err(format!(
                "duplicate descriptor composite key '{domain}.{}'",
                place(path, &entry)
            ));
        }
        if node.quota_mode {
            return Err(format!(
                "{}: quota_mode is not supported",
                place(path, &entry)
            ));
        }
        if node.share_threshold {
            return Err(format!(
                "{}: share_threshold is not supported (every value matching a wildcard is \
                 counted apart)",
                place(path, &entry)
            ));
        }
        path.push(entry);
        if let Some(limit) = &node.rate_limit {
            rules.push(rule(domain, path, limit, node.shadow_mode)?);
        }
        walk(domain, &node.descriptors, path, rules)?;
        path.pop();
    }
    Ok(())
}

/// `key_value.key` for the errors and names.
fn place(path: &[String], last: &str) -> String {
    path.iter()
        .map(String::as_str)
        .chain(std::iter::once(last))
        .map(|e| e.replacen('=', "_", 1))
        .collect::<Vec<_>>()
        .join(".")
}

fn rule(domain: &str, path: &[String], limit: &Limit, shadow: bool) -> Result<Value, String> {
    let at = || {
        format!(
            "{domain}.{}",
            place(&path[..path.len() - 1], &path[path.len() - 1])
        )
    };
    let mut rule = json!({
        "name": limit.name.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| generated_name(&at())),
        "domain": domain,
        "descriptor": path,
    });
    let unit = limit.unit.as_deref().filter(|u| !u.is_empty());
    if limit.unlimited {
        if unit.is_some() {
            return Err(format!(
                "{}: should not specify rate limit unit when unlimited",
                at()
            ));
        }
        rule["unlimited"] = json!(true);
    } else {
        let unit = unit.ok_or_else(|| format!("{}: invalid rate limit unit ''", at()))?;
        let window = window_of_unit(unit)
            .ok_or_else(|| format!("{}: invalid rate limit unit '{unit}'", at()))?;
        match limit.requests_per_unit.unwrap_or(0) {
            // Every request over the limit, as the reference server.
            0 => rule["refuse"] = json!(true),
            requests => {
                rule["policy"] = json!(format!("{requests}/{window}"));
                rule["algorithm"] = json!("fixed-window");
            }
        }
    }
    if shadow {
        rule["shadow"] = json!(true);
    }
    let mut replaces = Vec::new();
    for r in &limit.replaces {
        let name = r
            .name
            .as_deref()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("{}: should not have an empty replaces entry", at()))?;
        if limit.name.as_deref() == Some(name) {
            return Err(format!(
                "{}: replaces should not contain name of same descriptor",
                at()
            ));
        }
        replaces.push(name.to_owned());
    }
    if !replaces.is_empty() {
        rule["replaces"] = json!(replaces);
    }
    Ok(rule)
}

/// A rule name for the limit at `place`: the place itself when it is a
/// valid name (letters, digits, `-`, `_`, `.`, at most 64), else what of
/// it is, with a hash of the whole to keep names apart.
fn generated_name(place: &str) -> String {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if place.len() <= 64 && place.chars().all(valid) {
        return place.to_owned();
    }
    let cleaned: String = place
        .chars()
        .map(|c| if valid(c) { c } else { '_' })
        .take(40)
        .collect();
    let hash = sha1_smol::Sha1::from(place.as_bytes()).digest().to_string();
    format!("{cleaned}.{}", &hash[..16])
}
