//! Limits as data: a [`RuleSet`] read from TOML or JSON, validated as a
//! whole, and matched against a request's method and path (or gRPC
//! method) and the caller's tier; [`Rules`], the engine serving it (a
//! limiter per rule and policy, replaced whole at runtime); and its
//! sources, a watched file ([`Rules::watch_file`]) or a versioned key in
//! Redis ([`publish`], [`Rules::follow_redis`]). The HTTP glue is
//! [`RulesLayer`]. The [rules guide](crate::guide::rules) describes
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
#![cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;

use crate::limiter::LocalQuota;
use crate::policy::Policy;

mod admission;
mod catalog;
mod check;
mod descriptor;
mod engine;
#[cfg(feature = "envoy")]
mod envoy_yaml;
mod expansion;
mod fields;
mod index;
mod json;
#[cfg(feature = "redis")]
mod redis_source;
mod shape;
mod target;
mod unit;
mod validate;
mod watch;

use target::Target;
use validate::RuleSetSpec;

pub use crate::http::{RuleLimit, RulesLayer};
pub use admission::Admission;
pub(crate) use admission::{Charge, ToSettle};
pub use catalog::{Catalog, NotPriced, Prices, Usage};
#[cfg(feature = "envoy")]
pub(crate) use check::Planned;
pub use check::RulesCheck;
pub use descriptor::Descriptor;
pub use engine::{ActiveRules, Call, Rules};
#[cfg(feature = "envoy")]
pub(crate) use envoy_yaml::{rate_of_unit, window_of_unit};
pub use expansion::MAX_VALUES;
pub use unit::Unit;

#[cfg(feature = "redis")]
pub use redis_source::{PublishError, publish};
#[cfg(feature = "admin")]
pub(crate) use watch::{Format, Source};
pub use watch::{Rejected, Watch, WatchStatus};

/// The longest `block` a rule may set: a day. (A typo of `15d` for `15m`
/// would otherwise lock every breaching caller out for two weeks.)
pub const MAX_BLOCK: Duration = Duration::from_secs(24 * 3600);

/// An ordered list of validated rules.
#[derive(Debug, Clone)]
pub struct RuleSet {
    version: Option<u64>,
    tier: TierFrom,
    rules: Vec<Rule>,
    /// The prices that rules counted in money charge (`[catalog]`).
    catalog: Option<Arc<Catalog>>,
    /// The places of a reference-server configuration that hold no limit:
    /// each domain (no entries), and each descriptor without a
    /// `rate_limit`. A descriptor reaching one is matched, and limited by
    /// nothing (the reference's whitelisted values).
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    places: Vec<Descriptor>,
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

/// Where a rule's real cost comes from after the response (`settle = {
/// header = "x-usage-tokens", strip = true }`): the rule's `cost` is then
/// an estimate, and the difference is charged or given back once the
/// response (or its streamed body) reports the cost. The response's
/// [`ActualCost`](crate::response::ActualCost) extension is read first,
/// always; then the header (in the headers, then the trailers); then the
/// layer's body meter ([`RulesLayer::with_meter`]) when `body = true`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SettleFrom {
    header: Option<HeaderName>,
    strip: bool,
    body: bool,
    hits_addend: bool,
}

impl SettleFrom {
    /// The header giving the cost.
    pub fn header(&self) -> Option<&HeaderName> {
        self.header.as_ref()
    }

    /// Whether the header is removed before the client sees it.
    pub fn strips_header(&self) -> bool {
        self.strip
    }

    /// Whether the layer's body meter counts the cost.
    pub fn meters_body(&self) -> bool {
        self.body
    }

    /// Whether a descriptor rule is charged the `hits_addend` a
    /// descriptor carries (Envoy's `apply_on_stream_done`), after the
    /// response: `settle = { hits_addend = true }`.
    pub fn from_hits_addend(&self) -> bool {
        self.hits_addend
    }

    /// The settlement of a response under this rule, with the layer's
    /// body `meter`.
    pub(crate) fn settlement(
        &self,
        meter: Option<&Arc<crate::response::MeterFn>>,
    ) -> crate::response::Settlement {
        crate::response::Settlement::of(
            self.header.clone(),
            self.strip,
            meter.filter(|_| self.body).cloned(),
        )
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
    settle: Option<Arc<SettleFrom>>,
    /// What the policy counts: requests, tokens or money.
    unit: Unit,
    /// The shares of each budget (percent) whose crossing is told once per
    /// key and period (`notify`).
    notify: Vec<u8>,
    /// What the rule matches of Envoy's descriptors (`domain` and
    /// `descriptor`).
    descriptor: Option<Descriptor>,
    /// A descriptor rule's `shadow`, `unlimited` and `replaces`.
    envoy: EnvoyFlags,
}

/// What a descriptor rule may say besides its policy, as Envoy's
/// reference server's configuration does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct EnvoyFlags {
    /// Counted and reported, never refusing.
    pub(crate) shadow: bool,
    /// Matched, never counted nor refusing.
    pub(crate) unlimited: bool,
    /// Matched, every request over the limit (the reference server's
    /// `requests_per_unit: 0`).
    pub(crate) refuse: bool,
    /// The rules this one replaces when both match one request.
    pub(crate) replaces: Vec<String>,
    /// The entry of the descriptor whose value picks the tier's policy.
    pub(crate) tier_entry: Option<String>,
    /// The name a descriptor's status reports and `replaces` names: the
    /// rule's own name, or a reference-server limit's `name` (none when it
    /// has none). Not the rule's counting identity.
    pub(crate) shown_name: Option<Arc<str>>,
    /// The rate whose unit and reset a refusing rule's status reports
    /// (a reference-server `requests_per_unit: 0` of that unit).
    pub(crate) refused_rate: Option<crate::policy::Rate>,
    /// The entries of the descriptor naming the model and the kind of
    /// tokens its `hits_addend` counts (`usage`), left out of the key.
    pub(crate) usage: Option<descriptor::UsageEntries>,
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
            .field("settle", &self.settle)
            .field("unit", &self.unit)
            .field("notify", &self.notify)
            .field("descriptor", &self.descriptor)
            .field("envoy", &self.envoy)
            .finish()
    }
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

    /// Read and validate a rule set written in JSON. A text of more than
    /// [`MAX_VALUES`] values is refused.
    pub fn from_json(text: &str) -> Result<Self, RulesError> {
        // serde_json keeps the last of duplicate keys; a rule set refuses
        // them, as TOML does.
        json::refuse_duplicate_keys(text)?;
        let spec: RuleSetSpec = expansion::json(text).map_err(|error| RulesError {
            rule: None,
            field: "JSON".to_owned(),
            problem: error.to_string(),
        })?;
        Self::validate(spec)
    }

    /// The version the file declares, if any.
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// Where the tier of a request comes from.
    pub fn tier(&self) -> &TierFrom {
        &self.tier
    }

    /// The price catalog (`[catalog]`), which prices the usage that rules
    /// counted in money charge.
    pub fn catalog(&self) -> Option<&Catalog> {
        self.catalog.as_deref()
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

impl Rule {
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

    /// Where the real cost comes from after the response, when the rule
    /// settles it (`settle = { ... }`): its `cost` is then an estimate.
    pub fn settle(&self) -> Option<&SettleFrom> {
        self.settle.as_deref()
    }

    pub(crate) fn shared_settle(&self) -> Option<Arc<SettleFrom>> {
        self.settle.clone()
    }

    /// What the rule's policy counts (`"60/min"`: requests; `"20000
    /// tokens/min"`: tokens; `"100 USD/month"`: money, in micro-units of
    /// the catalog's currency).
    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// The shares of the budget, in percent, whose crossing is told once
    /// per key and period (`notify = [50, 80, 95, 100]`), in increasing
    /// order.
    pub fn notify(&self) -> &[u8] {
        &self.notify
    }

    /// What the rule matches of a request to Envoy's rate limit service
    /// (`domain` and `descriptor`), when it is a descriptor rule (with a
    /// `key`, it serves the HTTP layer too, under the same count).
    pub fn descriptor(&self) -> Option<&Descriptor> {
        self.descriptor.as_ref()
    }

    /// A descriptor rule's `shadow`, `unlimited` and `replaces`.
    #[cfg(feature = "envoy")]
    pub(crate) fn envoy(&self) -> &EnvoyFlags {
        &self.envoy
    }

    /// Whether the rule matches a request of `method` to `path`.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if let Some(methods) = &self.methods
            && !methods.contains(method)
        {
            return false;
        }
        self.target.matches(path)
    }
}

#[cfg(test)]
mod tests;
