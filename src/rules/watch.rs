//! Following rule sets at runtime: a watch of their source (a file here,
//! or a versioned key in Redis, `redis_source.rs`), what it last did, and
//! putting a new set in force.

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::{RuleSet, Rules, RulesError};

/// A running watch of a rule source ([`Rules::watch_file`],
/// [`Rules::follow_redis`]): it stops when dropped.
#[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
#[derive(Debug)]
pub struct Watch {
    pub(super) task: Option<tokio::task::JoinHandle<()>>,
    pub(super) status: Arc<Mutex<WatchStatus>>,
    pub(super) source: Source,
}

/// Where a watch reads its rule sets (and where the admin router publishes
/// one).
#[derive(Clone)]
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) enum Source {
    File(PathBuf),
    #[cfg(feature = "redis")]
    Redis {
        client: Box<redis::Client>,
        key: String,
    },
}

/// The key and path only: a client's address may carry a password.
impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => f.debug_tuple("File").field(path).finish(),
            #[cfg(feature = "redis")]
            Self::Redis { key, .. } => f.debug_struct("Redis").field("key", key).finish(),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "file {}", path.display()),
            #[cfg(feature = "redis")]
            Self::Redis { key, .. } => write!(f, "redis {key}"),
        }
    }
}

/// What a watch last did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WatchStatus {
    /// Where the rules come from: `file <path>` or `redis <key>`.
    pub source: String,
    /// The version in force, for a Redis source (the counter the publisher
    /// increments); for a file, how many times its rules were put in force.
    pub version: u64,
    /// The text of the rule set in force, once the watch put one in force.
    pub text: Option<String>,
    /// When the rule set in force was put in force.
    pub loaded_at: Option<SystemTime>,
    /// Why the latest rule set seen was rejected (the previous rules stay
    /// in force), or why the source could not be read; `None` once a
    /// rule set is in force again.
    pub error: Option<String>,
    /// The last rule set that was rejected, kept after a later one is put
    /// in force.
    pub rejected: Option<Rejected>,
}

/// A rule set a watch rejected: the rules in force stayed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejected {
    /// Its text.
    pub text: String,
    /// Why it was rejected: the rule and field, and the problem.
    pub error: String,
    /// When it was seen.
    pub at: SystemTime,
}

impl Watch {
    /// What the watch last did.
    pub fn status(&self) -> WatchStatus {
        match self.status.lock() {
            Ok(status) => status.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The shared status and the source, for the admin router.
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    pub(crate) fn shared(&self) -> (Arc<Mutex<WatchStatus>>, Source) {
        (Arc::clone(&self.status), self.source.clone())
    }
}

impl Watch {
    /// Keep following for as long as the runtime runs, without a handle
    /// (a server that follows its rules for its whole life).
    pub fn detach(mut self) {
        self.task = None;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

pub(super) fn record(status: &Mutex<WatchStatus>, change: impl FnOnce(&mut WatchStatus)) {
    match status.lock() {
        Ok(mut status) => change(&mut status),
        Err(poisoned) => change(&mut poisoned.into_inner()),
    }
}

impl RuleSet {
    /// Read a rule set written in JSON (text starting with `{`) or TOML.
    pub fn parse(text: &str) -> Result<Self, RulesError> {
        if text.trim_start().starts_with('{') {
            Self::from_json(text)
        } else {
            Self::from_toml(text)
        }
    }

    /// Read a rule set from a file: JSON if its name ends in `.json`, else
    /// TOML.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self, RulesError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|error| RulesError {
            rule: None,
            field: path.display().to_string(),
            problem: error.to_string(),
        })?;
        Self::parse_as(path, &text)
    }

    /// Read `text` as the file `path` holds it: JSON if its name ends in
    /// `.json`, Envoy's reference server's YAML if in `.yaml` or `.yml`
    /// (feature `envoy`), else TOML.
    pub(crate) fn parse_as(path: &std::path::Path, text: &str) -> Result<Self, RulesError> {
        match Format::of(path) {
            Format::Json => Self::from_json(text),
            #[cfg(feature = "envoy")]
            Format::EnvoyYaml => {
                Self::from_envoy_yaml([(path.to_str().unwrap_or("the YAML file"), text)])
            }
            Format::Toml => Self::from_toml(text),
        }
    }
}

/// How a rules file is written, told by its name.
#[derive(Clone, Copy)]
pub(crate) enum Format {
    Json,
    #[cfg(feature = "envoy")]
    EnvoyYaml,
    Toml,
}

impl Format {
    pub(crate) fn of(path: &std::path::Path) -> Self {
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if extension.eq_ignore_ascii_case("json") {
            return Self::Json;
        }
        #[cfg(feature = "envoy")]
        if extension.eq_ignore_ascii_case("yaml") || extension.eq_ignore_ascii_case("yml") {
            return Self::EnvoyYaml;
        }
        Self::Toml
    }

    /// A rule set of no rules, written out: a watched file lifts every
    /// limit only when it says so, since a save that truncates the file
    /// first, or is caught half written, would lift them for a moment.
    pub(crate) fn no_rules(self) -> &'static str {
        match self {
            Self::Json => "{\"rules\": []}",
            #[cfg(feature = "envoy")]
            Self::EnvoyYaml => "descriptors: []",
            Self::Toml => "rules = []",
        }
    }

    /// Whether `text` names its list of rules (`rules`, or `descriptors`
    /// beside the domain in Envoy's YAML), as [`no_rules`](Self::no_rules) does: text of
    /// comments, or of a header caught before its rules, does not.
    pub(crate) fn names_its_rules(self, text: &str) -> bool {
        match self {
            Self::Json => super::expansion::json::<serde_json::Value>(text)
                .is_ok_and(|value| value.get("rules").is_some()),
            #[cfg(feature = "envoy")]
            Self::EnvoyYaml => super::expansion::yaml::<serde_yaml_ng::Value>(text)
                .is_ok_and(|value| value.get("descriptors").is_some()),
            Self::Toml => text
                .parse::<toml::Table>()
                .is_ok_and(|table| table.contains_key("rules")),
        }
    }
}

impl Rules {
    /// Follow the rule set in `path` (JSON if it ends in `.json`, else
    /// TOML): it is read at once and then every `every`, and when its text
    /// changed and validates, put in force ([`replace`](Self::replace);
    /// counts of every rule whose name is kept carry over). A text that
    /// does not validate, a file that cannot be read, and a file of no
    /// rules that does not say so (empty, blank, comments only) leave the
    /// rules in force, logged and in [`Watch::status`]: a save that
    /// truncates the file first must not lift every limit; a file lifts
    /// them when it says so (`rules = []`, `{"rules": []}` in JSON,
    /// `descriptors: []` in Envoy's YAML). Needs a tokio runtime.
    pub fn watch_file(&self, path: impl Into<PathBuf>, every: Duration) -> Watch {
        let path = path.into();
        let rules = self.clone();
        let source = Source::File(path.clone());
        let status = Arc::new(Mutex::new(WatchStatus {
            source: source.to_string(),
            ..WatchStatus::default()
        }));
        let status_in = Arc::clone(&status);
        let task = tokio::spawn(async move {
            // The first read puts the file in force too: it may have changed
            // since the rules were loaded from it.
            let mut seen: Option<String> = None;
            let mut first = true;
            loop {
                if !std::mem::take(&mut first) {
                    tokio::time::sleep(every).await;
                }
                let Some(text) = read(&path, &status_in).await else {
                    continue;
                };
                if seen.as_deref() != Some(&*text) {
                    take_in(&rules, &path, &text, &status_in);
                    seen = Some(text);
                }
            }
        });
        Watch {
            task: Some(task),
            status,
            source,
        }
    }
}

/// The text of the watched file `path`, or `None` (logged, and in
/// `status`) when it cannot be read.
async fn read(path: &std::path::Path, status: &Mutex<WatchStatus>) -> Option<String> {
    let owned = path.to_owned();
    let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(owned)).await;
    match read.unwrap_or_else(|error| Err(std::io::Error::other(error))) {
        Ok(text) => Some(text),
        Err(error) => {
            let error = format!("{}: {error}", path.display());
            tracing::warn!(%error, "rules: cannot read the rules file; the rules in force stay");
            record(status, |s| s.error = Some(error));
            None
        }
    }
}

/// Put the watched file's new `text` in force, unless it holds no rules
/// without saying so (empty, blank, comments: a truncating save caught
/// half way, say), which keeps the rules in force until it changes.
fn take_in(rules: &Rules, path: &std::path::Path, text: &str, status: &Mutex<WatchStatus>) {
    let format = Format::of(path);
    let parsed = RuleSet::parse_as(path, text);
    let unstated = text.trim().is_empty()
        || matches!(&parsed, Ok(set) if set.rules().is_empty() && !format.names_its_rules(text));
    if unstated {
        let error = format!(
            "{}: the file is empty or names no rules; the rules in force stay \
             (to lift every limit, write `{}`)",
            path.display(),
            format.no_rules()
        );
        tracing::warn!(%error, "rules: a rules file of no rules is not applied unless it says so");
        record(status, |s| s.error = Some(error));
    } else {
        apply(
            rules,
            parsed,
            text,
            status,
            None,
            &path.display().to_string(),
        );
    }
}

pub(super) fn apply(
    rules: &Rules,
    parsed: Result<RuleSet, RulesError>,
    text: &str,
    status: &Mutex<WatchStatus>,
    version: Option<u64>,
    source: &str,
) {
    match parsed {
        Ok(set) => {
            rules.replace(set);
            tracing::info!(source, version, "rules: new rule set in force");
            crate::metrics::rules_loaded(true);
            record(status, |s| {
                s.version = version.unwrap_or(s.version + 1);
                s.text = Some(text.to_owned());
                s.loaded_at = Some(SystemTime::now());
                s.error = None;
            });
        }
        Err(error) => {
            tracing::error!(source, version, %error, "rules: rule set rejected; the rules in force stay");
            crate::metrics::rules_loaded(false);
            let error = error.to_string();
            record(status, |s| {
                s.rejected = Some(Rejected {
                    text: text.to_owned(),
                    error: error.clone(),
                    at: SystemTime::now(),
                });
                s.error = Some(error);
            });
        }
    }
}
