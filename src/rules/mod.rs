//! Limits as data: a [`RuleSet`] read from TOML or JSON, validated as a
//! whole, and matched against a request's method and path (or gRPC
//! method) and the caller's tier; [`Rules`], the engine serving it (a
//! limiter per rule and policy, replaced whole at runtime); and its
//! sources, a watched file ([`Rules::watch_file`]) or a versioned key in
//! Redis ([`publish`], [`Rules::follow_redis`]). The HTTP glue is
//! [`RulesLayer`](crate::rules::RulesLayer). The README's "Limits as data" holds
//! the schema.
//!
//! ```
//! use tower_redis_ratelimit::rules::RuleSet;
//!
//! let rules = RuleSet::from_toml(r#"
//!     [[rules]]
//!     name = "everything"
//!     key = "global"
//!     policy = "1000/s"
//!
//!     [[rules]]
//!     name = "api"
//!     path = "/api/{*rest}"
//!     key = "client_ip"
//!     policy = "100/min"          # callers of no known tier
//!     tiers = { pro = "5000/min" }
//!
//!     [[rules]]
//!     name = "login"
//!     methods = ["POST"]
//!     path = "/login"
//!     key = "client_ip+path"
//!     policy = "5/min"
//! "#)?;
//! let names = |method, path, tier| {
//!     rules.matching(method, path).map(|rule| (rule.name(), rule.policy(tier).to_string())).collect::<Vec<_>>()
//! };
//! assert_eq!(
//!     names(&http::Method::GET, "/api/users/7", Some("pro")),
//!     [("everything", "1000/s".to_owned()), ("api", "5000/min".to_owned())],
//! );
//! assert_eq!(names(&http::Method::POST, "/login", None).len(), 2);
//! assert_eq!(names(&http::Method::GET, "/login", None).len(), 1);
//! # Ok::<(), tower_redis_ratelimit::rules::RulesError>(())
//! ```

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;
use serde::Deserialize;

use crate::limiter::LocalQuota;
use crate::policy::{Algorithm, Policy};

mod engine;
mod json;
mod watch;

pub use crate::http::{RuleLimit, RulesLayer};
pub use engine::{ActiveRules, Admission, Call, Rules, RulesCheck};
pub use watch::{PublishError, Watch, WatchStatus, publish};

/// The longest `block` a rule may set: a day. (A typo of `15d` for `15m`
/// would otherwise lock every breaching caller out for two weeks.)
pub const MAX_BLOCK: Duration = Duration::from_secs(24 * 3600);

/// An ordered list of validated rules.
#[derive(Debug, Clone)]
pub struct RuleSet {
    version: Option<u64>,
    tier: TierFrom,
    rules: Vec<Rule>,
}

/// Where a request's tier (plan) comes from, when the rule set names it
/// (`tier = "header:x-plan"` or `tier = "extension"`). A layer's own tier
/// closure takes precedence.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TierFrom {
    /// No tier: every caller gets each rule's default policy (unless the
    /// layer has a tier closure).
    #[default]
    None,
    /// A request header, **set by something you trust** (an auth gateway
    /// that overwrites it): a client that can send it chooses its own plan.
    Header(HeaderName),
    /// The [`Tier`] request extension, set by your authentication
    /// middleware before the layer runs.
    Extension,
}

/// A caller's tier (plan), as a request extension: insert it in an
/// authentication middleware and name `tier = "extension"` in the rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tier(pub String);

/// Which responses a rule counts (`count = ["4xx"]`, or every response but
/// `refund = ["5xx"]`): decided after the inner service answered, by giving
/// the unit back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Counting {
    /// Every admitted request counts (the default).
    #[default]
    All,
    /// Only responses of these statuses count; the others are refunded.
    Only(Statuses),
    /// Responses of these statuses are refunded; the others count.
    Except(Statuses),
}

/// A set of HTTP statuses: classes (`4xx`) and single codes (`401`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Statuses {
    classes: [bool; 6],
    codes: HashSet<u16>,
}

impl Statuses {
    /// Whether `status` is in the set.
    pub fn contains(&self, status: u16) -> bool {
        self.codes.contains(&status)
            || self
                .classes
                .get(usize::from(status / 100))
                .copied()
                .unwrap_or(false)
    }
}

impl Counting {
    /// Whether a response of `status` counts (`None`: the inner service
    /// failed without a response, which counts as a 500).
    pub fn counts(&self, status: Option<u16>) -> bool {
        let status = status.unwrap_or(500);
        match self {
            Self::All => true,
            Self::Only(statuses) => statuses.contains(status),
            Self::Except(statuses) => !statuses.contains(status),
        }
    }
}

/// One validated rule: what it matches, how it picks the key, and the
/// policy of each tier. (Its `Debug` shows how many keys its `allow` and
/// `only` lists hold, not the keys: they are often credentials.)
#[derive(Clone)]
pub struct Rule {
    name: Arc<str>,
    methods: Option<HashSet<Method>>,
    target: Target,
    key: Vec<KeyPart>,
    policy: Policy,
    tiers: BTreeMap<String, Policy>,
    allow: HashSet<String>,
    only: Option<HashSet<String>>,
    counting: Counting,
    block: Option<Duration>,
    local_quota: Option<LocalQuota>,
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("methods", &self.methods)
            .field("target", &self.target)
            .field("key", &self.key)
            .field("policy", &self.policy)
            .field("tiers", &self.tiers)
            .field("allow", &format_args!("{} keys", self.allow.len()))
            .field(
                "only",
                &self
                    .only
                    .as_ref()
                    .map(|only| format!("{} keys", only.len())),
            )
            .field("counting", &self.counting)
            .field("block", &self.block)
            .field("local_quota", &self.local_quota)
            .finish()
    }
}

/// What a rule matches besides the method.
#[derive(Debug, Clone)]
enum Target {
    /// Every request.
    Any,
    /// A path pattern: literal segments, `{name}` (one segment), a final
    /// `{*name}` (one segment or more).
    Path(Vec<Segment>),
    /// A gRPC method, `/package.Service/Method`, or a whole service,
    /// `/package.Service/*`.
    Grpc {
        service: String,
        method: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
    Rest,
}

/// One part of a rule's key, by the name of a built-in extractor.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyPart {
    /// `ip`: the peer address.
    Ip,
    /// `client_ip`: the client address behind trusted proxies.
    ClientIp,
    /// `header:NAME`: a request header (or gRPC metadata).
    Header(HeaderName),
    /// `global`: one key for every request.
    Global,
    /// `path`: the request path (the gRPC method).
    Path,
}

/// Why a rule set was rejected: which rule (by name, or by position when
/// it has none), which field, and what is wrong. A rule set that does not
/// parse or validate is rejected as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{field}: {problem}", match .rule { Some(rule) => format!("rule {rule}, field "), None => String::new() })]
pub struct RulesError {
    rule: Option<String>,
    field: String,
    problem: String,
}

impl RulesError {
    /// The rule at fault (`"login" (#3)`), if the fault is in one rule.
    pub fn rule(&self) -> Option<&str> {
        self.rule.as_deref()
    }

    /// The field at fault (`policy`, `tiers.pro`, ...).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong.
    pub fn problem(&self) -> &str {
        &self.problem
    }
}

/// The file's shape, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSetSpec {
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
    /// Read and validate a rule set written in TOML.
    pub fn from_toml(text: &str) -> Result<Self, RulesError> {
        let spec: RuleSetSpec = toml::from_str(text).map_err(|error| RulesError {
            rule: None,
            field: "TOML".to_owned(),
            problem: error.message().to_owned()
                + &error
                    .span()
                    .map(|span| format!(" (at byte {})", span.start))
                    .unwrap_or_default(),
        })?;
        Self::validate(spec)
    }

    /// Read and validate a rule set written in JSON.
    pub fn from_json(text: &str) -> Result<Self, RulesError> {
        // serde_json keeps the last of duplicate keys; a rule set refuses
        // them, as TOML does.
        json::refuse_duplicate_keys(text)?;
        let spec: RuleSetSpec = serde_json::from_str(text).map_err(|error| RulesError {
            rule: None,
            field: "JSON".to_owned(),
            problem: error.to_string(),
        })?;
        Self::validate(spec)
    }

    fn validate(spec: RuleSetSpec) -> Result<Self, RulesError> {
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

    /// The version the file declares, if any.
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// Where the tier of a request comes from.
    pub fn tier(&self) -> &TierFrom {
        &self.tier
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The rules that match a request of `method` to `path` (for gRPC, the
    /// path is the method, `/package.Service/Method`), in order.
    pub fn matching<'r, 'q>(
        &'r self,
        method: &'q Method,
        path: &'q str,
    ) -> impl Iterator<Item = &'r Rule> + 'q
    where
        'r: 'q,
    {
        self.rules
            .iter()
            .filter(move |rule| rule.matches(method, path))
    }
}

/// A duration written as a rate's window (`"30s"`, `"15m"`, `"1d"`).
fn duration(text: &str) -> Result<Duration, crate::PolicyError> {
    format!("1/{}", text.trim())
        .parse::<crate::policy::Rate>()
        .map(|rate| rate.window())
}

/// How a rule is named in errors: `"login" (#3)`, or `#3` without a name.
fn label(name: Option<&str>, index: usize) -> String {
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

    /// The rule's name (its limiter's name: counts are kept per name).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn shared_name(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// The parts of the key, in order.
    pub fn key(&self) -> &[KeyPart] {
        &self.key
    }

    /// The policy of callers of `tier`: the tier's own, or the rule's
    /// default for an unknown tier or none.
    pub fn policy(&self, tier: Option<&str>) -> &Policy {
        tier.and_then(|tier| self.tiers.get(tier))
            .unwrap_or(&self.policy)
    }

    /// Whether `key` (an app) may call without limit.
    pub fn allows(&self, key: &str) -> bool {
        self.allow.contains(key)
    }

    /// Whether `key` may call at all: with `only`, only the listed keys
    /// may (they are still limited, unless also in `allow`).
    pub fn admits(&self, key: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.contains(key))
    }

    pub(crate) fn admits_keyless(&self) -> bool {
        self.only.is_none()
    }

    /// The keys allowed without limit.
    pub fn allowed_keys(&self) -> impl Iterator<Item = &str> {
        self.allow.iter().map(String::as_str)
    }

    /// The tiers with a policy of their own, and their policies.
    pub fn tiers(&self) -> impl Iterator<Item = (&str, &Policy)> {
        self.tiers
            .iter()
            .map(|(tier, policy)| (tier.as_str(), policy))
    }

    /// Which responses count.
    pub fn counting(&self) -> &Counting {
        &self.counting
    }

    /// How long a key is blocked once it is denied (`block = "15m"`).
    pub fn block(&self) -> Option<Duration> {
        self.block
    }

    /// The local quota of the rule's hot keys (`local_quota = "100/250ms"`),
    /// for every tier's policy: see [`LocalQuota`].
    pub fn local_quota(&self) -> Option<LocalQuota> {
        self.local_quota
    }

    /// Whether the rule matches a request of `method` to `path`.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if let Some(methods) = &self.methods
            && !methods.contains(method)
        {
            return false;
        }
        match &self.target {
            Target::Any => true,
            Target::Path(pattern) => path_matches(pattern, path),
            Target::Grpc { service, method } => {
                let Some((s, m)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
                    return false;
                };
                s == service && method.as_deref().is_none_or(|method| method == m)
            }
        }
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

/// `/users/{id}/posts/{*rest}` as segments.
fn parse_path(pattern: &str) -> Result<Vec<Segment>, String> {
    let Some(rest) = pattern.strip_prefix('/') else {
        return Err(format!("{pattern:?} does not start with `/`"));
    };
    if pattern.contains(['?', '#']) {
        return Err(format!(
            "{pattern:?} holds `?` or `#`: the query and the fragment are not part of the \
             path a rule matches, so this rule would never match; write the path alone"
        ));
    }
    if rest.is_empty() {
        return Ok(Vec::new());
    }
    let parts: Vec<&str> = rest.split('/').collect();
    let mut segments = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let segment = if let Some(inner) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))
        {
            match inner.strip_prefix('*') {
                Some(name) if !name.is_empty() && i + 1 == parts.len() => Segment::Rest,
                Some(_) if i + 1 != parts.len() => {
                    return Err(format!(
                        "{pattern:?}: a `{{*name}}` segment must be the last"
                    ));
                }
                Some(_) => {
                    return Err(format!("{pattern:?}: `{{*}}` needs a name, as `{{*rest}}`"));
                }
                None if inner.is_empty() || inner.contains(['{', '}']) => {
                    return Err(format!("{pattern:?}: `{part}` is not a `{{name}}` segment"));
                }
                None => Segment::Param,
            }
        } else if part.contains(['{', '}']) {
            return Err(format!(
                "{pattern:?}: `{part}` mixes braces into a literal segment"
            ));
        } else if part.is_empty() && i + 1 != parts.len() {
            return Err(format!("{pattern:?} has an empty segment (`//`)"));
        } else {
            Segment::Literal((*part).to_owned())
        };
        segments.push(segment);
    }
    Ok(segments)
}

fn path_matches(pattern: &[Segment], path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let parts: Vec<&str> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split('/').collect()
    };
    let mut i = 0;
    for segment in pattern {
        match segment {
            Segment::Rest => return parts.len() > i && parts[i..].iter().any(|p| !p.is_empty()),
            Segment::Param => {
                if parts.get(i).is_none_or(|p| p.is_empty()) {
                    return false;
                }
            }
            Segment::Literal(literal) => {
                if parts.get(i) != Some(&literal.as_str()) {
                    return false;
                }
            }
        }
        i += 1;
    }
    i == parts.len()
}

/// `/package.Service/Method` or `/package.Service/*`.
fn parse_grpc(text: &str) -> Result<Target, String> {
    let shape = || format!("{text:?} is not `/package.Service/Method` or `/package.Service/*`");
    let (service, method) = text
        .strip_prefix('/')
        .and_then(|t| t.split_once('/'))
        .ok_or_else(shape)?;
    if service.is_empty() || method.is_empty() || method.contains('/') {
        return Err(shape());
    }
    Ok(Target::Grpc {
        service: service.to_owned(),
        method: (method != "*").then(|| method.to_owned()),
    })
}

/// `client_ip+header:x-api-key` as parts.
fn parse_key(text: &str) -> Result<Vec<KeyPart>, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> RulesError {
        RuleSet::from_toml(text).unwrap_err()
    }

    #[test]
    fn a_bad_rule_is_named_with_its_field() {
        let e = error(
            "[[rules]]\nname = \"ok\"\nkey = \"global\"\npolicy = \"1/s\"\n\
             [[rules]]\nname = \"login\"\nkey = \"ip\"\npolicy = \"5 per minute\"\n",
        );
        assert_eq!(e.rule(), Some("\"login\" (#2)"));
        assert_eq!(e.field(), "policy");
        assert!(
            e.to_string()
                .starts_with("rule \"login\" (#2), field policy: "),
            "{e}"
        );

        let e = error(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\ntiers = { pro = \"0/s\" }\n",
        );
        assert_eq!((e.field(), e.rule()), ("tiers.pro", Some("\"a\" (#1)")));
        let e = error("[[rules]]\nkey = \"ip\"\npolicy = \"1/s\"\n");
        assert_eq!((e.field(), e.rule()), ("name", Some("#1")));
        let e = error("[[rules]]\nname = \"a\"\nkey = \"cookie\"\npolicy = \"1/s\"\n");
        assert_eq!(e.field(), "key");
        let e = error(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\npath = \"/a/{*rest}/b\"\n",
        );
        assert_eq!(e.field(), "path");
        let e = error(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"pkg.Svc/M\"\n",
        );
        assert_eq!(e.field(), "grpc");
        let e = error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\ncost = 9\n");
        assert_eq!(e.field(), "policy", "a cost above the max: {e}");
        let e = error(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\nmethods = [\"G ET\"]\n",
        );
        assert_eq!(e.field(), "methods");
        let e = error(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\n\
             [[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"2/s\"\n",
        );
        assert_eq!((e.field(), e.rule()), ("name", Some("\"a\" (#2)")));
        // Unknown fields are errors, not silently ignored.
        let e = error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\npolcy = \"2/s\"\n");
        assert_eq!(e.field(), "TOML");
        assert!(e.problem().contains("polcy"), "{e}");
    }

    #[test]
    fn the_example_rule_set_is_valid() {
        let rules = RuleSet::from_toml(include_str!("../../examples/rules.toml")).unwrap();
        assert_eq!(rules.version(), Some(1));
        let names = |method: &Method, path| {
            rules
                .matching(method, path)
                .map(Rule::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&Method::GET, "/api/users"), ["global", "api"]);
        assert_eq!(
            names(&Method::GET, "/api/reports/7"),
            ["global", "api", "reports"]
        );
        assert_eq!(names(&Method::POST, "/login"), ["global", "login"]);
        assert_eq!(names(&Method::GET, "/login"), ["global"]);
        let api = &rules.rules()[1];
        assert_eq!(api.policy(Some("pro")).to_string(), "5000/min");
        assert_eq!(api.policy(Some("enterprise")).to_string(), "100/min");
        assert!(api.allows("10.0.0.5"));
        assert_eq!(rules.rules()[3].policy(None).cost(), 10);
    }

    #[test]
    fn outcome_counting_and_blocks_are_validated() {
        let rule = |extra: &str| {
            RuleSet::from_toml(&format!(
                "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\n{extra}"
            ))
        };
        let counting = rule("count = [\"4xx\", \"500\"]\n").unwrap();
        let counting = counting.rules()[0].counting();
        assert!(counting.counts(Some(404)) && counting.counts(Some(500)));
        assert!(!counting.counts(Some(200)) && !counting.counts(Some(503)));
        let refund = rule("refund = [\"5xx\"]\n").unwrap();
        assert!(
            !refund.rules()[0].counting().counts(None),
            "an inner error is a 500"
        );
        assert_eq!(
            rule("count = [\"4xx\"]\nrefund = [\"5xx\"]\n")
                .unwrap_err()
                .field(),
            "refund"
        );
        assert_eq!(rule("count = [\"6xx\"]\n").unwrap_err().field(), "count");
        assert_eq!(rule("count = []\n").unwrap_err().field(), "count");
        let grpc = rule("grpc = \"/pkg.Svc/*\"\ncount = [\"4xx\"]\n").unwrap_err();
        assert!(grpc.problem().contains("trailers"), "{grpc}");
        let concurrency = rule("algorithm = \"concurrency\"\nrefund = [\"5xx\"]\n").unwrap_err();
        assert_eq!(concurrency.field(), "refund");
        assert_eq!(
            rule("block = \"15m\"\n").unwrap().rules()[0].block(),
            Some(Duration::from_secs(900))
        );
        assert_eq!(rule("block = \"forever\"\n").unwrap_err().field(), "block");
        assert_eq!(rule("only = []\n").unwrap_err().field(), "only");
        let e = RuleSet::from_toml("[[rules]]\nname = \"a:b\"\nkey = \"ip\"\npolicy = \"5/s\"\n")
            .unwrap_err();
        assert_eq!(
            e.field(),
            "name",
            "a `:` would reach into the store key layout"
        );
        let script = rule("execution = \"script\"\n").unwrap();
        assert_eq!(
            script.rules()[0].policy(None).execution(),
            crate::policy::Execution::Script
        );
        assert_eq!(
            rule("algorithm = \"gcra\"\nexecution = \"script\"\n")
                .unwrap_err()
                .field(),
            "execution"
        );
        assert_eq!(
            rule("execution = \"magic\"\n").unwrap_err().field(),
            "execution"
        );
        let e = RuleSet::from_toml("tier = \"cookie\"\n").unwrap_err();
        assert_eq!((e.field(), e.rule()), ("tier", None));
    }

    fn rule(extra: &str) -> Result<RuleSet, RulesError> {
        RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\n{extra}"
        ))
    }

    #[test]
    fn a_block_is_at_most_a_day() {
        for at_the_bound in ["1d", "24h", "1440m", "86400s"] {
            let set = rule(&format!("block = \"{at_the_bound}\"\n")).unwrap();
            assert_eq!(set.rules()[0].block(), Some(MAX_BLOCK), "{at_the_bound}");
        }
        for past in ["86401s", "25h", "2d", "3650d"] {
            let e = rule(&format!("block = \"{past}\"\n")).unwrap_err();
            assert_eq!(
                (e.rule(), e.field()),
                (Some("\"a\" (#1)"), "block"),
                "{past}"
            );
            assert!(e.problem().contains("longer than a day"), "{e}");
        }
    }

    #[test]
    fn a_path_holds_no_query_nor_fragment() {
        for path in ["/search?q=1", "/a?", "/page#top"] {
            let e = rule(&format!("path = \"{path}\"\n")).unwrap_err();
            assert_eq!(e.field(), "path", "{path}");
            assert!(e.problem().contains("query"), "{e}");
        }
        assert!(rule("path = \"/search\"\n").is_ok());
    }

    #[test]
    fn an_execution_is_refused_for_another_algorithm_as_policy_refuses_it() {
        for algorithm in ["gcra", "fixed-window", "sliding-window", "concurrency"] {
            for execution in ["script", "transaction"] {
                let e = rule(&format!(
                    "algorithm = \"{algorithm}\"\nexecution = \"{execution}\"\n"
                ))
                .unwrap_err();
                assert_eq!(e.field(), "execution", "{algorithm} {execution}");
                // The message is Policy's own: one validation for both.
                let policy = "5/s"
                    .parse::<Policy>()
                    .unwrap()
                    .with_algorithm(algorithm.parse().unwrap())
                    .unwrap();
                let direct = policy
                    .with_execution(execution.parse().unwrap())
                    .unwrap_err()
                    .to_string();
                assert_eq!(e.problem(), direct);
            }
        }
    }

    #[test]
    fn a_rule_carries_its_own_local_quota() {
        let set = rule("local_quota = \"3/250ms\"\ntiers = { pro = \"100/s\" }\n").unwrap();
        let quota = set.rules()[0].local_quota().unwrap();
        assert_eq!(
            (quota.batch(), quota.hold()),
            (3, Duration::from_millis(250))
        );
        let refused = |extra: &str, says: &str| {
            let e = rule(extra).unwrap_err();
            assert_eq!(e.field(), "local_quota", "{extra}: {e}");
            assert!(e.problem().contains(says), "{extra}: {e}");
        };
        refused("local_quota = \"lots\"\n", "100/250ms");
        refused("local_quota = \"1/s\"\n", "at least 2");
        refused(
            "local_quota = \"10/s\"\ntiers = { free = \"1/s\" }\n",
            "with tiers.free",
        );
        refused(
            "local_quota = \"10/s\"\nalgorithm = \"concurrency\"\n",
            "in flight",
        );
        refused(
            "local_quota = \"10/s\"\ncount = [\"4xx\"]\n",
            "counting by outcome",
        );
        assert!(rule("").unwrap().rules()[0].local_quota().is_none());
    }

    #[test]
    fn debug_does_not_show_the_keys_of_allow_and_only_lists() {
        let rules = RuleSet::from_toml(
            "[[rules]]\nname = \"a\"\nkey = \"header:x-api-key\"\npolicy = \"5/s\"\n\
             allow = [\"secret-1\"]\nonly = [\"secret-1\", \"secret-2\"]\n",
        )
        .unwrap();
        let shown = format!("{rules:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("2 keys"), "{shown}");
    }

    #[test]
    fn json_reads_the_same_schema() {
        let rules = RuleSet::from_json(
            r#"{"version": 3, "rules": [{"name": "g", "key": "global", "policy": "10/s", "algorithm": "gcra"}]}"#,
        )
        .unwrap();
        assert_eq!(rules.version(), Some(3));
        assert_eq!(rules.rules()[0].policy(None).algorithm(), Algorithm::Gcra);
        let e = RuleSet::from_json(r#"{"rules": [{"name": "g", "key": "global"}]}"#).unwrap_err();
        assert_eq!(e.field(), "policy");
    }

    #[test]
    fn paths_match_like_axum_routes() {
        let pattern = parse_path("/users/{id}/posts/{*rest}").unwrap();
        assert!(path_matches(&pattern, "/users/7/posts/a"));
        assert!(path_matches(&pattern, "/users/7/posts/a/b"));
        assert!(!path_matches(&pattern, "/users/7/posts"));
        assert!(!path_matches(&pattern, "/users/7/posts/"));
        assert!(!path_matches(&pattern, "/users//posts/a"));
        let exact = parse_path("/login").unwrap();
        assert!(path_matches(&exact, "/login"));
        assert!(!path_matches(&exact, "/login/x"));
        assert!(!path_matches(&exact, "/logins"));
        let root = parse_path("/").unwrap();
        assert!(path_matches(&root, "/"));
        assert!(!path_matches(&root, "/a"));
    }

    #[test]
    fn grpc_rules_match_a_method_or_a_service() {
        let rules = RuleSet::from_toml(
            "[[rules]]\nname = \"m\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"/pkg.Svc/Get\"\n\
             [[rules]]\nname = \"s\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"/pkg.Svc/*\"\n",
        )
        .unwrap();
        let names = |path| {
            rules
                .matching(&Method::POST, path)
                .map(Rule::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(names("/pkg.Svc/Get"), ["m", "s"]);
        assert_eq!(names("/pkg.Svc/Put"), ["s"]);
        assert!(names("/pkg.Other/Get").is_empty());
    }

    #[test]
    fn keys_combine_built_in_extractors() {
        assert_eq!(
            parse_key("client_ip+header:x-api-key").unwrap(),
            [
                KeyPart::ClientIp,
                KeyPart::Header(HeaderName::from_static("x-api-key"))
            ]
        );
        assert!(parse_key("ip+").is_err());
    }
}
