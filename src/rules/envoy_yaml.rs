//! Rule sets written as Envoy's reference rate limit server's YAML
//! (`domain`, nested `descriptors` with `key`, `value` and `rate_limit`):
//! read unchanged into descriptor rules, one per limit, counted in fixed
//! windows as the reference server counts them.

use std::collections::HashSet;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};

use super::descriptor::Descriptor;
use super::validate::RuleSetSpec;
use super::{RuleSet, RulesError};
use crate::policy::{Policy, Rate};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Root {
    domain: Option<String>,
    /// `descriptors:` with nothing after it is none, as an absent list.
    #[serde(default)]
    descriptors: Option<Vec<Node>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Node {
    key: Option<String>,
    value: Option<String>,
    rate_limit: Option<Limit>,
    #[serde(default)]
    descriptors: Option<Vec<Node>>,
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
    /// in fixed windows. A rule counts under a name made of its place
    /// (`domain.key_value.key`, or a hash of it when that is no valid
    /// name); a limit's own `name`, whatever it holds, is what its status
    /// reports and what `replaces` names, as in the reference server. A
    /// descriptor without a `rate_limit` is matched and limited by nothing
    /// (its value is "whitelisted"). `files` are each file's name (for the
    /// errors) and text. `shadow_mode`, `unlimited`, `replaces` and
    /// `requests_per_unit: 0` (every request over the limit) keep their
    /// meaning; `detailed_metric`, `value_to_metric` and `metadata`
    /// are accepted and have no effect; `quota_mode` and `share_threshold`
    /// are refused (not supported).
    pub fn from_envoy_yaml<'a>(
        files: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, RulesError> {
        let mut loaded = Loaded::default();
        let mut domains = HashSet::new();
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
            loaded.place(&domain, &[]).map_err(fault)?;
            let mut path = Vec::new();
            loaded
                .walk(
                    &domain,
                    root.descriptors.as_deref().unwrap_or_default(),
                    &mut path,
                )
                .map_err(fault)?;
        }
        let spec: RuleSetSpec =
            serde_json::from_value(json!({ "rules": loaded.rules })).map_err(|e| RulesError {
                rule: None,
                field: "envoy yaml".to_owned(),
                problem: e.to_string(),
            })?;
        let mut set = Self::validate(spec)?;
        for (rule, shown) in set.rules.iter_mut().zip(loaded.shown) {
            rule.envoy.shown_name = shown.name.map(Arc::from);
            rule.envoy.refused_rate = shown.refused_rate;
        }
        set.places = loaded.places;
        Ok(set)
    }
}

/// What a status of a reference-server limit reports beside its rule.
struct Shown {
    /// The limit's `name`, if it has one.
    name: Option<String>,
    /// `requests_per_unit: 0`: the rate of its unit.
    refused_rate: Option<Rate>,
}

/// The reference server's configuration, read so far.
#[derive(Default)]
struct Loaded {
    /// The rules, as the crate's rule set writes them.
    rules: Vec<Value>,
    /// What each rule's status reports, in the rules' order.
    shown: Vec<Shown>,
    /// The rules' names (their counting identities).
    names: HashSet<String>,
    /// The places holding no limit.
    places: Vec<Descriptor>,
}

impl Loaded {
    /// The rules of `nodes` under the entries `path`.
    fn walk(&mut self, domain: &str, nodes: &[Node], path: &mut Vec<String>) -> Result<(), String> {
        let mut seen = HashSet::new();
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
            match &node.rate_limit {
                Some(limit) => self.rule(domain, path, limit, node.shadow_mode)?,
                None => self.place(domain, path)?,
            }
            self.walk(
                domain,
                node.descriptors.as_deref().unwrap_or_default(),
                path,
            )?;
            path.pop();
        }
        Ok(())
    }

    /// A place of `domain` and entries `path` that holds no limit.
    fn place(&mut self, domain: &str, path: &[String]) -> Result<(), String> {
        self.places.push(Descriptor::place(domain, path)?);
        Ok(())
    }

    /// The rule of `limit` at `path`.
    fn rule(
        &mut self,
        domain: &str,
        path: &[String],
        limit: &Limit,
        shadow: bool,
    ) -> Result<(), String> {
        let at = format!(
            "{domain}.{}",
            place(&path[..path.len() - 1], &path[path.len() - 1])
        );
        let mut rule = json!({
            "name": self.identity(&at, domain, path),
            "domain": domain,
            "descriptor": path,
        });
        let mut refused_rate = None;
        let unit = limit.unit.as_deref().filter(|u| !u.is_empty());
        if limit.unlimited {
            if unit.is_some() {
                return Err(format!(
                    "{at}: should not specify rate limit unit when unlimited"
                ));
            }
            rule["unlimited"] = json!(true);
        } else {
            let unit = unit.ok_or_else(|| format!("{at}: invalid rate limit unit ''"))?;
            let window = window_of_unit(unit)
                .ok_or_else(|| format!("{at}: invalid rate limit unit '{unit}'"))?;
            match limit.requests_per_unit.unwrap_or(0) {
                // Every request over the limit, as the reference server.
                0 => {
                    rule["refuse"] = json!(true);
                    refused_rate = rate_of_unit(unit);
                }
                requests => {
                    rule["policy"] = json!(format!("{requests}/{window}"));
                    rule["algorithm"] = json!("fixed-window");
                }
            }
        }
        if shadow {
            rule["shadow"] = json!(true);
        }
        let name = limit.name.clone().filter(|n| !n.is_empty());
        let mut replaces = Vec::new();
        for r in &limit.replaces {
            let replaced = r
                .name
                .as_deref()
                .filter(|n| !n.is_empty())
                .ok_or_else(|| format!("{at}: should not have an empty replaces entry"))?;
            if name.as_deref() == Some(replaced) {
                return Err(format!(
                    "{at}: replaces should not contain name of same descriptor"
                ));
            }
            replaces.push(replaced.to_owned());
        }
        if !replaces.is_empty() {
            rule["replaces"] = json!(replaces);
        }
        self.rules.push(rule);
        self.shown.push(Shown { name, refused_rate });
        Ok(())
    }

    /// The counting identity of the limit at `at` (of `domain` and
    /// entries `path`): the place itself when it is a valid rule name,
    /// else what of it is, with a hash of the domain and entries; unique
    /// in the set (two places that read alike, as `a_b` and `a=b`, are
    /// told apart by the hash).
    fn identity(&mut self, at: &str, domain: &str, path: &[String]) -> String {
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if at.len() <= 64 && at.chars().all(valid) && self.names.insert(at.to_owned()) {
            return at.to_owned();
        }
        let cleaned: String = at
            .chars()
            .map(|c| if valid(c) { c } else { '_' })
            .take(40)
            .collect();
        // JSON writes the list injectively: no two lists hash alike.
        let whole = json!([domain, path]).to_string();
        let hash = sha1_smol::Sha1::from(whole.as_bytes()).digest().to_string();
        let name = format!("{cleaned}.{}", &hash[..16]);
        self.names.insert(name.clone());
        name
    }
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

/// One request per `unit` (a reference-server unit, any case): the rate
/// whose unit and reset a status reports for a limit of 0 of that unit.
pub(crate) fn rate_of_unit(unit: &str) -> Option<Rate> {
    let policy: Policy = format!("1/{}", window_of_unit(unit)?).parse().ok()?;
    policy.rates().first().copied()
}
