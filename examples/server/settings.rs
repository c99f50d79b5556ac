//! The settings, read from the environment: a bad value names its
//! variable.

use std::fmt;
use std::time::Duration;

use tower_redis_ratelimit::key::ProxyHeader;
use tower_redis_ratelimit::limiter::LocalQuota;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::response::HeaderStyle;
use tower_redis_ratelimit::{Algorithm, FailMode, MemoryStore, Policy, Rate, key};

use crate::bodies::{BodyBounds, DEFAULT_BODY_LIMIT, DEFAULT_BODY_MEMORY, DEFAULT_BODY_TIMEOUT};
use crate::connections::{self, Caps};
use crate::serve::ConnectionLimits;

/// What the server is configured with.
pub(crate) struct Settings {
    pub(crate) bind: String,
    /// `RULES`: limits as data instead of one policy.
    pub(crate) rules: Option<RulesSource>,
    pub(crate) redis_url: Option<String>,
    /// `REDIS_CLUSTER`: the seed nodes of a Redis Cluster (feature
    /// `cluster`), in place of `REDIS_URL`.
    pub(crate) redis_cluster: Option<Vec<String>>,
    /// `DATABASE_URL`: the counts in PostgreSQL (feature `postgres`). Never
    /// logged: it may hold a password.
    pub(crate) database_url: Option<String>,
    /// The policy, with its algorithm and execution; `None`: `RATE_LIMIT=off`.
    pub(crate) policy: Option<Policy>,
    pub(crate) key: ClientKey,
    pub(crate) deny_cache: bool,
    /// `LOCAL_QUOTA`: hot keys admitted locally.
    pub(crate) local_quota: Option<LocalQuota>,
    /// `HEADER_TIMEOUT`, `SHUTDOWN_GRACE`, `MAX_CONNECTIONS` and
    /// `MAX_CONNECTIONS_PER_IP`.
    pub(crate) limits: ConnectionLimits,
    /// `TRUSTED_PROXIES` (and `PROXY_HEADER`): the client's address behind them.
    pub(crate) client_ip: Option<key::ClientIp>,
    pub(crate) fail_mode: FailMode,
    pub(crate) fail_mode_text: String,
    pub(crate) headers: HeaderStyle,
    pub(crate) headers_text: String,
    /// `ADMIN_BIND`, `ADMIN_TOKEN` and `ADMIN_HOST_NAMES`: the operator's
    /// router on a listener of its own.
    pub(crate) admin: Option<AdminSettings>,
    /// `BODY_LIMIT`, `BODY_MEMORY` and `BODY_TIMEOUT`: the bounds of the
    /// bodies the routes of the rules read.
    pub(crate) bodies: BodyBounds,
}

/// Where the admin router listens, the token it requires, and the names
/// it serves besides its address (refused at start without the `admin`
/// feature).
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) struct AdminSettings {
    pub(crate) bind: String,
    /// Never logged nor shown in an error.
    pub(crate) token: String,
    /// `ADMIN_HOST_NAMES`: `host` or `host:port`, each checked by
    /// `Admin::with_host_name` when the router is built.
    pub(crate) host_names: Vec<String>,
}

/// Why Redis's TLS settings are refused beside `DATABASE_URL`.
const POSTGRES_TLS: &str = "a certificate for Redis; the counts are in PostgreSQL (DATABASE_URL), \
     whose TLS is set in DATABASE_URL itself: sslmode=verify-full&sslrootcert=/path/ca.pem";

impl Settings {
    pub(crate) fn from_env() -> Result<Self, BadSetting> {
        let bind = var("BIND")?.unwrap_or_else(|| "127.0.0.1:3000".to_owned());
        let redis_url = var("REDIS_URL")?;
        let database_url = var("DATABASE_URL")?;
        if database_url.is_some() {
            if redis_url.is_some() {
                return Err(BadSetting::new(
                    "DATABASE_URL",
                    "the counts are kept in one place: set REDIS_URL or DATABASE_URL, not both",
                ));
            }
            if !cfg!(feature = "postgres") {
                return Err(BadSetting::new(
                    "DATABASE_URL",
                    "PostgreSQL needs the postgres feature: cargo run --example server --features postgres",
                ));
            }
            // Settings of Redis's alone: given with DATABASE_URL, a mistake
            // to be told, not ignored.
            for (name, why) in [
                (
                    "EXECUTION",
                    "how the sliding log runs in Redis; with DATABASE_URL every \
                     algorithm is decided in this process and written to PostgreSQL",
                ),
                ("REDIS_CA_CERT", POSTGRES_TLS),
                ("REDIS_CLIENT_CERT", POSTGRES_TLS),
                ("REDIS_CLIENT_KEY", POSTGRES_TLS),
            ] {
                if var(name)?.is_some() {
                    return Err(BadSetting::new(name, why));
                }
            }
        }
        let redis_cluster = redis_cluster(redis_url.is_some() || database_url.is_some())?;

        let rules = match var("RULES")? {
            None => None,
            Some(text) if text == "redis" => {
                if redis_url.is_none() {
                    return Err(BadSetting::new("RULES", "`redis` needs REDIS_URL"));
                }
                Some(RulesSource::Redis(
                    var("RULES_KEY")?.unwrap_or_else(|| "rl:rules".to_owned()),
                ))
            }
            Some(path) => Some(RulesSource::File(path.into())),
        };
        if rules.is_some() {
            for single in ["RATE_LIMIT", "KEY", "ALGORITHM", "EXECUTION"] {
                if var(single)?.is_some() {
                    return Err(BadSetting::new(
                        single,
                        "the rules (RULES) say what is limited and how: set one of them",
                    ));
                }
            }
            if var("LOCAL_QUOTA")?.is_some() {
                return Err(BadSetting::new(
                    "LOCAL_QUOTA",
                    "with RULES, a local quota belongs to each rule that needs one: \
                     set `local_quota = \"100/250ms\"` on those rules",
                ));
            }
        }

        let rate_limit = var("RATE_LIMIT")?.unwrap_or_else(|| "5/10s".to_owned());
        let policy: Option<Policy> = match rate_limit.as_str() {
            "off" => None,
            text => Some(
                text.parse()
                    .map_err(|error| BadSetting::new("RATE_LIMIT", error))?,
            ),
        };

        // Unset: the policy's own (the sliding log, or the fixed window of
        // a calendar quota such as "1000000/month").
        let algorithm = var("ALGORITHM")?
            .map(|text| {
                text.parse::<Algorithm>()
                    .map_err(|error| BadSetting::new("ALGORITHM", error))
            })
            .transpose()?;
        let execution = var("EXECUTION")?
            .map(|text| {
                text.parse::<Execution>()
                    .map_err(|error| BadSetting::new("EXECUTION", error))
            })
            .transpose()?;
        let policy = policy
            .map(|policy| {
                let policy = match algorithm {
                    Some(algorithm) => policy
                        .with_algorithm(algorithm)
                        .map_err(|error| BadSetting::new("ALGORITHM", error))?,
                    None => policy,
                };
                match execution {
                    // Refused for an algorithm other than the sliding log,
                    // as a rule's `execution` is.
                    Some(execution) => policy
                        .with_execution(execution)
                        .map_err(|error| BadSetting::new("EXECUTION", error)),
                    None => Ok(policy),
                }
            })
            .transpose()?;

        let deny_cache = match var("DENY_CACHE")?.as_deref() {
            None | Some("on") => true,
            Some("off") => false,
            Some(other) => {
                return Err(BadSetting::new(
                    "DENY_CACHE",
                    format!("unknown value {other:?}: use `on` or `off`"),
                ));
            }
        };

        let local_quota = var("LOCAL_QUOTA")?
            .map(|text| {
                text.parse::<LocalQuota>()
                    .map_err(|error| BadSetting::new("LOCAL_QUOTA", error))
            })
            .transpose()?;

        let key = match var("KEY")? {
            None => ClientKey::PeerIp,
            Some(text) => {
                ClientKey::parse(&text).map_err(|problem| BadSetting::new("KEY", problem))?
            }
        };

        let proxy_header = match var("PROXY_HEADER")?.as_deref() {
            None | Some("x-forwarded-for") => ProxyHeader::XForwardedFor,
            Some("forwarded") => ProxyHeader::Forwarded,
            Some("x-real-ip") => ProxyHeader::XRealIp,
            Some(other) => {
                return Err(BadSetting::new(
                    "PROXY_HEADER",
                    format!(
                        "unknown header {other:?}: use `x-forwarded-for`, `forwarded` or `x-real-ip`"
                    ),
                ));
            }
        };
        let client_ip = match var("TRUSTED_PROXIES")? {
            None => None,
            Some(text) => {
                let entries: Vec<&str> = text
                    .split(',')
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .collect();
                if entries.is_empty() {
                    return Err(BadSetting::new(
                        "TRUSTED_PROXIES",
                        "no address or CIDR block in it",
                    ));
                }
                let client_ip = key::client_ip()
                    .trusting(entries)
                    .map_err(|error| BadSetting::new("TRUSTED_PROXIES", error))?
                    .header(proxy_header);
                Some(client_ip)
            }
        };

        let limits = ConnectionLimits {
            header_timeout: duration("HEADER_TIMEOUT")?.unwrap_or(Duration::from_secs(10)),
            grace: duration("SHUTDOWN_GRACE")?.unwrap_or(Duration::from_secs(20)),
            caps: connection_caps(client_ip.is_some())?,
        };

        let fail_mode_text = var("FAIL_MODE")?.unwrap_or_else(|| "open".to_owned());
        let fail_mode = match fail_mode_text.as_str() {
            "open" => FailMode::Open,
            "closed" => FailMode::Closed,
            text => match text.strip_prefix("fallback:").map(str::parse::<u32>) {
                Some(Ok(instances)) if instances > 0 => {
                    FailMode::fallback(MemoryStore::new(), instances)
                }
                _ => {
                    return Err(BadSetting::new(
                        "FAIL_MODE",
                        format!(
                            "unknown fail mode {text:?}: use `open`, `closed` or `fallback:N` \
                             (N instances sharing the limit, at least 1)"
                        ),
                    ));
                }
            },
        };

        let headers_text = var("HEADERS")?.unwrap_or_else(|| "x".to_owned());
        let headers = match headers_text.as_str() {
            "x" => HeaderStyle::XRateLimit,
            "ietf" => HeaderStyle::Ietf,
            "both" => HeaderStyle::Both,
            other => {
                return Err(BadSetting::new(
                    "HEADERS",
                    format!("unknown style {other:?}: use `x`, `ietf` or `both`"),
                ));
            }
        };

        let admin = admin_settings(&bind)?;
        let bodies = body_bounds(rules.is_some())?;

        Ok(Self {
            bind,
            rules,
            redis_url,
            redis_cluster,
            database_url,
            policy,
            key,
            deny_cache,
            local_quota,
            limits,
            client_ip,
            fail_mode,
            fail_mode_text,
            headers,
            headers_text,
            admin,
            bodies,
        })
    }
}

/// `MAX_CONNECTIONS` and `MAX_CONNECTIONS_PER_IP`, within the process's
/// open-file limit: past it, accepting fails and new clients wait in the
/// backlog until they time out, however few connections each has.
fn connection_caps(behind_proxies: bool) -> Result<Caps, BadSetting> {
    // The open-file limit, and how many connections it leaves room for.
    let room = connections::open_files_limit().map(|files| {
        let fit = files.saturating_sub(connections::RESERVED_FILES);
        (files, usize::try_from(fit).unwrap_or(usize::MAX))
    });
    let total = match count("MAX_CONNECTIONS")? {
        Some(total) => total,
        None => room.map_or(connections::DEFAULT_MAX_CONNECTIONS, |(_, fit)| {
            fit.min(connections::DEFAULT_MAX_CONNECTIONS)
        }),
    };
    if let Some((files, fit)) = room
        && (total > fit || fit == 0)
    {
        let wanted = if fit == 0 {
            "no connection".to_owned()
        } else {
            format!("{total} connections")
        };
        return Err(BadSetting::new(
            "MAX_CONNECTIONS",
            format!(
                "{wanted} cannot be held: the process may open {files} files, {} of them kept \
                 for Redis, the admin router and files, leaving room for {fit} connections; \
                 raise the limit (ulimit -n, systemd's LimitNOFILE) or lower MAX_CONNECTIONS",
                connections::RESERVED_FILES,
            ),
        ));
    }
    let per_client = match count("MAX_CONNECTIONS_PER_IP")? {
        Some(per_client) if per_client > total => {
            return Err(BadSetting::new(
                "MAX_CONNECTIONS_PER_IP",
                format!("{per_client} is above MAX_CONNECTIONS ({total}): it would never apply"),
            ));
        }
        Some(per_client) => per_client,
        // The peers are the proxies, each carrying many clients.
        None if behind_proxies => total,
        None => connections::DEFAULT_MAX_CONNECTIONS_PER_IP.min(total),
    };
    Ok(Caps { total, per_client })
}

/// `ADMIN_BIND` and `ADMIN_TOKEN`: both or neither, never the public
/// listener (the token itself is checked when the admin router is built);
/// `ADMIN_HOST_NAMES` only with them.
fn admin_settings(public: &str) -> Result<Option<AdminSettings>, BadSetting> {
    let host_names = admin_host_names()?;
    let (bind, token) = match (var("ADMIN_BIND")?, var("ADMIN_TOKEN")?) {
        (None, None) if !host_names.is_empty() => {
            return Err(BadSetting::new(
                "ADMIN_HOST_NAMES",
                "the names the admin router serves need the admin router: set ADMIN_BIND and ADMIN_TOKEN",
            ));
        }
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(BadSetting::new(
                "ADMIN_TOKEN",
                "ADMIN_BIND is set: set ADMIN_TOKEN too (at least 16 bytes), the token every admin request must bear",
            ));
        }
        (None, Some(_)) => {
            return Err(BadSetting::new(
                "ADMIN_BIND",
                "ADMIN_TOKEN is set: set ADMIN_BIND too, the address of the admin listener (never BIND's)",
            ));
        }
        (Some(bind), Some(token)) => (bind, token),
    };
    if !cfg!(feature = "admin") {
        return Err(BadSetting::new(
            "ADMIN_BIND",
            "the admin router is a crate feature: run with `--features admin`",
        ));
    }
    // (Port 0 picks a free port for each listener: never the same.)
    if bind == public && !bind.ends_with(":0") {
        return Err(BadSetting::new(
            "ADMIN_BIND",
            "the same address as BIND: the admin router is never on the public listener",
        ));
    }
    Ok(Some(AdminSettings {
        bind,
        token,
        host_names,
    }))
}

/// `ADMIN_HOST_NAMES`: comma-separated host names (`host` or `host:port`)
/// by which operators reach the admin router besides its address (a
/// reverse proxy's public name, a DNS name of the admin network). Each is
/// checked when the router is built; an empty one (a doubled or trailing
/// comma) here.
fn admin_host_names() -> Result<Vec<String>, BadSetting> {
    let Some(text) = var("ADMIN_HOST_NAMES")? else {
        return Ok(Vec::new());
    };
    text.split(',')
        .map(|name| {
            let name = name.trim();
            if name.is_empty() {
                Err(BadSetting::new(
                    "ADMIN_HOST_NAMES",
                    format!("{text:?} holds an empty name: give names separated by commas (`admin.internal, ops.example:8443`)"),
                ))
            } else {
                Ok(name.to_owned())
            }
        })
        .collect()
}

/// The value of environment variable `name`; `None` if it is unset or empty.
pub(crate) fn var(name: &'static str) -> Result<Option<String>, BadSetting> {
    match std::env::var(name) {
        Ok(value) if value.is_empty() => Ok(None),
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(BadSetting::new(name, "not valid UTF-8")),
    }
}

/// The count (at least 1) in environment variable `name`; `None` if it is
/// unset or empty.
fn count(name: &'static str) -> Result<Option<usize>, BadSetting> {
    var(name)?
        .map(|text| match text.trim().parse::<usize>() {
            Ok(count) if count > 0 => Ok(count),
            _ => Err(BadSetting::new(
                name,
                format!("{text:?} is not a count of at least 1"),
            )),
        })
        .transpose()
}

/// The duration in environment variable `name`, written as a rate's
/// window (`500ms`, `10s`, `1m`); `None` if it is unset or empty.
pub(crate) fn duration(name: &'static str) -> Result<Option<Duration>, BadSetting> {
    var(name)?
        .map(|text| {
            format!("1/{}", text.trim())
                .parse::<Rate>()
                .map(|rate| rate.window())
                .map_err(|_| {
                    BadSetting::new(
                        name,
                        format!("{text:?} is not a duration such as `500ms`, `10s` or `1m`"),
                    )
                })
        })
        .transpose()
}

/// `BODY_LIMIT`, `BODY_MEMORY` and `BODY_TIMEOUT`: only routes of the
/// rules read a body (`POST /completions`), so without `RULES` they are
/// refused.
fn body_bounds(rules: bool) -> Result<BodyBounds, BadSetting> {
    let limit = byte_size("BODY_LIMIT")?;
    let memory = byte_size("BODY_MEMORY")?;
    let timeout = duration("BODY_TIMEOUT")?;
    if !rules {
        for (name, set) in [
            ("BODY_LIMIT", limit.is_some()),
            ("BODY_MEMORY", memory.is_some()),
            ("BODY_TIMEOUT", timeout.is_some()),
        ] {
            if set {
                return Err(BadSetting::new(
                    name,
                    "only the routes of the rules (RULES) read a request body",
                ));
            }
        }
    }
    let bounds = BodyBounds {
        limit: limit.unwrap_or(DEFAULT_BODY_LIMIT),
        memory: memory.unwrap_or(DEFAULT_BODY_MEMORY),
        timeout: timeout.unwrap_or(DEFAULT_BODY_TIMEOUT),
    };
    if bounds.memory < bounds.limit {
        return Err(BadSetting::new(
            "BODY_MEMORY",
            format!(
                "{} bytes cannot hold one body of BODY_LIMIT ({} bytes)",
                bounds.memory, bounds.limit
            ),
        ));
    }
    // A body's room is counted in one step of at most u32::MAX bytes, and
    // all of them in one semaphore.
    if u32::try_from(bounds.limit).is_err() {
        return Err(BadSetting::new(
            "BODY_LIMIT",
            format!("at most {} bytes (4GiB less one byte)", u32::MAX),
        ));
    }
    if bounds.memory > tokio::sync::Semaphore::MAX_PERMITS {
        return Err(BadSetting::new(
            "BODY_MEMORY",
            format!("at most {} bytes", tokio::sync::Semaphore::MAX_PERMITS),
        ));
    }
    Ok(bounds)
}

/// The size in bytes in environment variable `name`: a count of bytes, or
/// of `KiB`, `MiB` or `GiB` (at least 1 byte); `None` if unset or empty.
fn byte_size(name: &'static str) -> Result<Option<usize>, BadSetting> {
    var(name)?
        .map(|text| {
            let trimmed = text.trim();
            let (number, unit) = [("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)]
                .into_iter()
                .find_map(|(suffix, unit)| Some((trimmed.strip_suffix(suffix)?, unit)))
                .unwrap_or((trimmed, 1));
            number
                .trim()
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(unit))
                .filter(|&bytes| bytes > 0)
                .ok_or_else(|| {
                    BadSetting::new(
                        name,
                        format!("{text:?} is not a size such as `65536`, `64KiB` or `16MiB`"),
                    )
                })
        })
        .transpose()
}

/// Where the rules come from (`RULES`).
pub(crate) enum RulesSource {
    /// A file, re-read every second.
    File(std::path::PathBuf),
    /// A key in Redis, followed.
    Redis(String),
}

impl fmt::Display for RulesSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "file {}", path.display()),
            Self::Redis(key) => write!(f, "redis key {key}"),
        }
    }
}

/// Which key requests are counted under (`KEY`).
pub(crate) enum ClientKey {
    /// `ip`: the address of the connecting peer.
    PeerIp,
    /// `header:NAME`: the value of a request header, else the peer address.
    Header(key::Header),
}

impl ClientKey {
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        if text == "ip" {
            return Ok(Self::PeerIp);
        }
        if let Some(name) = text.strip_prefix("header:") {
            return key::Header::new(name)
                .map(Self::Header)
                .map_err(|_| format!("{name:?} is not a valid HTTP header name"));
        }
        Err(format!("unknown key {text:?}: use `ip` or `header:NAME`"))
    }
}

impl fmt::Display for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PeerIp => f.write_str("ip"),
            Self::Header(header) => write!(f, "header:{} (else ip)", header.name()),
        }
    }
}

/// A setting the server cannot run with: which variable, and why.
pub(crate) struct BadSetting {
    pub(crate) variable: &'static str,
    pub(crate) problem: String,
}

impl BadSetting {
    pub(crate) fn new(variable: &'static str, problem: impl fmt::Display) -> Self {
        Self {
            variable,
            problem: problem.to_string(),
        }
    }
}

impl fmt::Display for BadSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.variable, self.problem)
    }
}

/// `REDIS_CLUSTER`: seed nodes, comma-separated; `elsewhere`: the counts
/// are kept in another place already.
fn redis_cluster(elsewhere: bool) -> Result<Option<Vec<String>>, BadSetting> {
    let Some(list) = var("REDIS_CLUSTER")? else {
        return Ok(None);
    };
    if elsewhere {
        return Err(BadSetting::new(
            "REDIS_CLUSTER",
            "the counts are kept in one place: set one of REDIS_URL, REDIS_CLUSTER and DATABASE_URL",
        ));
    }
    if !cfg!(feature = "cluster") {
        return Err(BadSetting::new(
            "REDIS_CLUSTER",
            "Redis Cluster needs the cluster feature: cargo run --example server --features cluster",
        ));
    }
    let nodes: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|node| !node.is_empty())
        .map(str::to_owned)
        .collect();
    if nodes.is_empty() {
        return Err(BadSetting::new(
            "REDIS_CLUSTER",
            "names no node: list them as redis://host:port, comma-separated",
        ));
    }
    Ok(Some(nodes))
}
