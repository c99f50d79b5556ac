//! A rate-limited axum server, configured from the environment.
//!
//! ```sh
//! cargo run --example server                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server  # shared through Redis
//! # TLS, and a primary found through Redis Sentinel (crate features):
//! REDIS_URL=rediss://redis.internal:6380 REDIS_CA_CERT=ca.pem \
//!   cargo run --example server --features tls
//! REDIS_URL=redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster \
//!   cargo run --example server --features sentinel
//! ```
//!
//! | variable     | default          | meaning                                              |
//! |--------------|------------------|------------------------------------------------------|
//! | `BIND`       | `127.0.0.1:3000` | address to listen on                                 |
//! | `HEADER_TIMEOUT` | `10s`        | a connection must send a request's headers within this, or it is closed (an idle kept-alive connection waits for its next request under it too) |
//! | `SHUTDOWN_GRACE` | `20s`        | after `SIGTERM`, how long the requests in flight may take; then the remaining connections are closed and the server exits 0 |
//! | `REDIS_URL`  | unset            | unset: limits held in this process; set: in Redis: `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS, `--features tls`), `redis+sentinel://[user:password@]host[:port][,host[:port]…]/service[/db]` (`--features sentinel`; `rediss+sentinel://` with both) |
//! | `REDIS_CA_CERT` | unset         | with a TLS URL: a PEM file of the CA(s) to trust instead of the system's roots |
//! | `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY` | unset | with a TLS URL: PEM files of a client certificate and its key (mutual TLS) |
//! | `RATE_LIMIT` | `5/10s`          | the policy, such as `3/s, 20/min`; `off`: no limit (for benchmarks) |
//! | `KEY`        | `ip`             | `ip` (the peer address) or `header:NAME`             |
//! | `EXECUTION`  | `transaction`    | how Redis runs the sliding log: `transaction` or `script` (refused with another `ALGORITHM`) |
//! | `ALGORITHM`  | `sliding-log`    | `sliding-log`, `fixed-window`, `sliding-window`, `gcra` or `concurrency` |
//! | `DENY_CACHE` | `on`             | `off`: ask the store about every request of a denied key |
//! | `BATCHES`    | `2`              | with `REDIS_URL`: batches of checks in flight per algorithm (`RedisStore::with_batches`); `0`: one script per check |
//! | `LOCAL_QUOTA` | unset           | `N/HOLD` (`100/250ms`): admit hot keys locally from batches of `N` units taken from the store, each used within `HOLD`; at most `INSTANCES × N` more admitted in a window (none more under `fixed-window`). With `RULES`, set `local_quota` on the rules instead |
//! | `TRUSTED_PROXIES` | unset       | comma-separated addresses or CIDR blocks of your reverse proxies (`10.0.0.0/8, fd00::/8`); set: the key's address is the client's, read from `PROXY_HEADER` when the peer is one of them |
//! | `PROXY_HEADER` | `x-forwarded-for` | with `TRUSTED_PROXIES`: `x-forwarded-for`, `forwarded` or `x-real-ip` |
//! | `FAIL_MODE`  | `open`           | when the store fails: `open` (admit), `closed` (answer 503) or `fallback:N` (limit in process to 1/N of the policy, for N instances) |
//! | `HEADERS`    | `x`              | rate-limit fields: `x` (`X-RateLimit-*`), `ietf` (`RateLimit-Policy`, `RateLimit`) or `both` |
//! | `RULES`      | unset            | limits as data instead of `RATE_LIMIT`/`KEY`/`ALGORITHM`/`EXECUTION`: a rules file (`examples/rules.toml`; TOML, or JSON if it ends in `.json`), re-read every second, or `redis`: the rule set published at `RULES_KEY` in `REDIS_URL`, followed as it changes |
//! | `RULES_KEY`  | `rl:rules`       | with `RULES=redis`: the key (and pub/sub channel) of the rule set |
//!
//! With `RULES`, every path is served (`hello`), `POST /login` answers 200
//! when the header `x-password` is `demo` and 401 otherwise (to show a rule
//! counting failed logins only), and `/health` is never limited. A rule set
//! that does not validate stops the start (exit 2); at runtime it is
//! rejected and logged, and the rules in force stay. Publish a rule set to
//! Redis with `tower_redis_ratelimit::rules::publish` (it validates first),
//! or by hand: `HSET rl:rules rules "<text>"`, `HINCRBY rl:rules version 1`,
//! then `PUBLISH rl:rules <version>`.
//!
//! With `ALGORITHM=concurrency`, `RATE_LIMIT` is one rate read as "at most N
//! requests in flight / lease time": `5/30s` allows 5 at once, and a slot of
//! a crashed process frees itself after 30 s.
//!
//! An empty variable counts as unset. `GET /` answers `hello` and is
//! limited; `GET /health` is never limited. A bad setting is reported on
//! stderr, naming the variable, and the program exits with status 2.
//! `SIGTERM` or Ctrl-C stops the server gracefully: it stops accepting,
//! lets the requests in flight finish within `SHUTDOWN_GRACE`, and exits
//! with status 0, even while clients hold half-sent requests or stop
//! reading.

use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;
use tower_redis_ratelimit::key::ProxyHeader;
use tower_redis_ratelimit::limiter::LocalQuota;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::response::HeaderStyle;
use tower_redis_ratelimit::rules::RulesLayer;
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{
    Algorithm, FailMode, Limiter, MemoryStore, Policy, Rate, RateLimitLayer, RedisStore, Store, key,
};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    let (listener, app, limits) = match setup().await {
        Ok(ready) => ready,
        Err(bad) => {
            eprintln!("{bad}");
            return ExitCode::from(2);
        }
    };
    serve(listener, app, limits).await;
    ExitCode::SUCCESS
}

/// How long a client may hold a connection without progress.
#[derive(Clone, Copy)]
struct ConnectionLimits {
    /// `HEADER_TIMEOUT`: to send a request's headers.
    header_timeout: Duration,
    /// `SHUTDOWN_GRACE`: for the requests in flight after the stop.
    grace: Duration,
}

/// Serves `app` until `SIGTERM` or Ctrl-C, then stops accepting and lets
/// the requests in flight finish for at most the grace period. (axum::serve
/// has neither a header timeout nor a bounded stop: one client holding
/// half-sent headers would hold the stop forever.)
async fn serve(listener: TcpListener, app: Router, limits: ConnectionLimits) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    let stop = shutdown_signal();
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, say: wait, then go on.
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // `key::peer_ip()` reads the client address that this records.
        let app = app
            .clone()
            .map_request(move |mut request: http::Request<_>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            });
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, %peer, "connection ended");
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    tracing::info!(open, "shutting down: finishing the requests in flight");
    if tokio::time::timeout(limits.grace, graceful.shutdown())
        .await
        .is_err()
    {
        // Returning from main closes them.
        tracing::warn!(
            grace = ?limits.grace,
            "grace period over: closing the connections still open"
        );
    }
}

/// Resolves at the first `SIGTERM` (what orchestrators send) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

/// Logs at `info` unless `RUST_LOG` says otherwise.
fn init_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal, not in log files.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .init();
}

/// Reads the settings, opens the store and binds the listener.
async fn setup() -> Result<(TcpListener, Router, ConnectionLimits), BadSetting> {
    let settings = Settings::from_env()?;
    let app = match (&settings.rules, &settings.redis_url) {
        (Some(source), None) => rules_router(MemoryStore::new(), source, &settings).await?,
        (Some(source), Some(url)) => {
            rules_router(connect_redis(url).await?, source, &settings).await?
        }
        (None, None) => router(MemoryStore::new(), &settings)?,
        (None, Some(url)) => router(connect_redis(url).await?, &settings)?,
    };
    let listener = TcpListener::bind(&settings.bind).await.map_err(|error| {
        BadSetting::new(
            "BIND",
            format!("cannot listen on {:?}: {error}", settings.bind),
        )
    })?;
    log_start(&settings, &listener);
    Ok((listener, app, settings.limits))
}

/// The one line logged at start: what is limited, how, and where.
fn log_start(settings: &Settings, listener: &TcpListener) {
    let store = match &settings.redis_url {
        None => "memory".to_owned(),
        Some(url) => format!("redis {}", without_password(url)),
    };
    let addr = listener
        .local_addr()
        .map_or_else(|_| settings.bind.clone(), |addr| addr.to_string());
    if let Some(source) = &settings.rules {
        tracing::info!(
            store = %store,
            rules = %source,
            trusted_proxies = settings.client_ip.is_some(),
            fail_mode = %settings.fail_mode_text,
            headers = %settings.headers_text,
            "listening on http://{addr}"
        );
        return;
    }
    let Some(policy) = &settings.policy else {
        tracing::info!("listening on http://{addr}, RATE_LIMIT=off: nothing is limited");
        return;
    };
    tracing::info!(
        store = %store,
        policy = %policy,
        key = %settings.key,
        trusted_proxies = settings.client_ip.is_some(),
        fail_mode = %settings.fail_mode_text,
        headers = %settings.headers_text,
        algorithm = %policy.algorithm(),
        execution = %policy.execution(),
        deny_cache = settings.deny_cache,
        "listening on http://{addr}"
    );
}

/// The app, with its limited routes counted in `store` as the settings say.
fn router<St: Store>(store: St, settings: &Settings) -> Result<Router, BadSetting> {
    let Some(policy) = settings.policy.clone() else {
        // `RATE_LIMIT=off`: the same routes with no layer, the baseline of
        // the benchmarks.
        return Ok(with_health(Router::new().route("/", get(hello))));
    };
    let limiter = limiter(store, policy, settings)?;
    // The client's address: the peer's, or behind trusted proxies the one
    // they forwarded (never a header the client wrote itself).
    match (&settings.key, &settings.client_ip) {
        (ClientKey::PeerIp, None) => routes(
            RateLimitLayer::from_limiter(limiter, key::peer_ip()),
            settings,
        ),
        (ClientKey::PeerIp, Some(client_ip)) => routes(
            RateLimitLayer::from_limiter(limiter, client_ip.clone()),
            settings,
        ),
        // A request without the header is limited by its address, so
        // leaving the header out does not get around the limit.
        (ClientKey::Header(header), None) => routes(
            RateLimitLayer::from_limiter(limiter, header.clone().or(key::peer_ip())),
            settings,
        ),
        (ClientKey::Header(header), Some(client_ip)) => routes(
            RateLimitLayer::from_limiter(limiter, header.clone().or(client_ip.clone())),
            settings,
        ),
    }
}

/// The engine of the limited routes: `policy` in `store`, with the fail
/// mode, deny cache and local quota the settings say.
fn limiter<St: Store>(
    store: St,
    policy: Policy,
    settings: &Settings,
) -> Result<Limiter, BadSetting> {
    let limiter = Limiter::new(store, policy).with_fail_mode(settings.fail_mode.clone());
    // The deny cache is on by default.
    let limiter = if settings.deny_cache {
        limiter
    } else {
        limiter.without_deny_cache()
    };
    match settings.local_quota {
        Some(quota) => limiter
            .with_local_quota(quota)
            .map_err(|error| BadSetting::new("LOCAL_QUOTA", error)),
        None => Ok(limiter),
    }
}

/// Every path limited by the rules from `source`, which are followed as
/// they change for as long as the server runs, and `GET /health`.
async fn rules_router<St: Store>(
    store: St,
    source: &RulesSource,
    settings: &Settings,
) -> Result<Router, BadSetting> {
    let empty = RuleSet::from_toml("").map_err(|error| BadSetting::new("RULES", error))?;
    let mut rules = Rules::new(store, empty).with_fail_mode(settings.fail_mode.clone());
    if !settings.deny_cache {
        rules = rules.without_deny_cache();
    }
    let watch = match source {
        RulesSource::File(path) => {
            let set = RuleSet::from_file(path).map_err(|error| BadSetting::new("RULES", error))?;
            rules.replace(set);
            rules.watch_file(path, std::time::Duration::from_secs(1))
        }
        RulesSource::Redis(key) => {
            let Some(url) = &settings.redis_url else {
                return Err(BadSetting::new("RULES", "`redis` needs REDIS_URL"));
            };
            let client = rules_client(url)?;
            // The pub/sub message brings a change at once; the version
            // check every second is the backstop.
            rules
                .follow_redis(client, key.clone(), std::time::Duration::from_secs(1))
                .await
                .map_err(|error| BadSetting::new("RULES", error))?
        }
    };
    // Follow the rules for the life of the server.
    watch.detach();
    let mut layer = RulesLayer::new(rules).with_headers(settings.headers);
    if let Some(client_ip) = &settings.client_ip {
        layer = layer.with_client_ip(client_ip.clone());
    }
    let limited = Router::new()
        .route("/login", axum::routing::post(login))
        .fallback(hello)
        .layer(layer);
    Ok(with_health(limited))
}

/// A demonstration login: `x-password: demo` succeeds, anything else fails.
async fn login(headers: http::HeaderMap) -> http::StatusCode {
    if headers.get("x-password").is_some_and(|p| p == "demo") {
        http::StatusCode::OK
    } else {
        http::StatusCode::UNAUTHORIZED
    }
}

/// `GET /`, limited by `limiter`, and `GET /health`, never limited.
fn routes<K>(limiter: RateLimitLayer<K>, settings: &Settings) -> Result<Router, BadSetting>
where
    K: key::KeyExtractor<axum::body::Body>,
{
    let limiter = limiter.with_headers(settings.headers);
    // `route_layer` limits only the routes of this router...
    Ok(with_health(
        Router::new().route("/", get(hello)).route_layer(limiter),
    ))
}

/// ...and `/health` is added beside them, outside the limit.
fn with_health(limited: Router) -> Router {
    Router::new().route("/health", get(health)).merge(limited)
}

async fn hello() -> &'static str {
    "hello"
}

async fn health() -> &'static str {
    "ok"
}

async fn connect_redis(url: &str) -> Result<RedisStore, BadSetting> {
    let batches = match var("BATCHES")? {
        None => RedisStore::DEFAULT_BATCHES_IN_FLIGHT,
        Some(text) => text.trim().parse().map_err(|_| {
            BadSetting::new("BATCHES", format!("{text:?} is not a number of batches"))
        })?,
    };
    let store = redis_builder()?.connect(url).await.map_err(|error| {
        let hint = if url.starts_with("rediss") && !cfg!(feature = "tls") {
            " (TLS needs the tls feature: cargo run --example server --features tls)"
        } else {
            ""
        };
        let url = without_password(url);
        BadSetting::new(
            "REDIS_URL",
            format!("cannot use Redis at {url}: {error}{hint}"),
        )
    })?;
    Ok(store.with_batches(batches))
}

/// A client for the rule set's Redis (`RULES=redis`), with the TLS
/// certificates of `REDIS_CA_CERT`, `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY`.
fn rules_client(url: &str) -> Result<redis::Client, BadSetting> {
    if url.contains("+sentinel://") {
        return Err(BadSetting::new(
            "RULES",
            "`redis` with a Sentinel URL is not supported (the rule set's pub/sub would not follow a failover): use a rules file",
        ));
    }
    #[cfg(feature = "tls")]
    if url.starts_with("rediss://") {
        let read = |name: &'static str| -> Result<Option<Vec<u8>>, BadSetting> {
            var(name)?
                .map(|path| {
                    std::fs::read(&path)
                        .map_err(|error| BadSetting::new(name, format!("{path}: {error}")))
                })
                .transpose()
        };
        let client_tls = match (read("REDIS_CLIENT_CERT")?, read("REDIS_CLIENT_KEY")?) {
            (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
            _ => None,
        };
        let certificates = redis::TlsCertificates {
            client_tls,
            root_cert: read("REDIS_CA_CERT")?,
        };
        return redis::Client::build_with_tls(url, certificates)
            .map_err(|error| BadSetting::new("REDIS_URL", error));
    }
    redis::Client::open(url).map_err(|error| BadSetting::new("REDIS_URL", error))
}

/// The connection settings: TLS certificates from `REDIS_CA_CERT`,
/// `REDIS_CLIENT_CERT` and `REDIS_CLIENT_KEY` (PEM files).
fn redis_builder() -> Result<tower_redis_ratelimit::store::RedisStoreBuilder, BadSetting> {
    #[allow(unused_mut)]
    let mut builder = RedisStore::builder();
    let ca = var("REDIS_CA_CERT")?;
    let client = (var("REDIS_CLIENT_CERT")?, var("REDIS_CLIENT_KEY")?);
    #[cfg(feature = "tls")]
    {
        let read = |name: &'static str, path: &str| {
            std::fs::read(path).map_err(|error| BadSetting::new(name, format!("{path}: {error}")))
        };
        if let Some(path) = ca {
            builder = builder.root_certificate(read("REDIS_CA_CERT", &path)?);
        }
        match client {
            (Some(cert), Some(key)) => {
                builder = builder.client_certificate(
                    read("REDIS_CLIENT_CERT", &cert)?,
                    read("REDIS_CLIENT_KEY", &key)?,
                );
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(BadSetting::new(
                    "REDIS_CLIENT_KEY",
                    "REDIS_CLIENT_CERT needs its key",
                ));
            }
            (None, Some(_)) => {
                return Err(BadSetting::new(
                    "REDIS_CLIENT_CERT",
                    "REDIS_CLIENT_KEY needs its certificate",
                ));
            }
        }
    }
    #[cfg(not(feature = "tls"))]
    if ca.is_some() || client.0.is_some() || client.1.is_some() {
        return Err(BadSetting::new(
            "REDIS_CA_CERT",
            "TLS certificates need the tls feature: cargo run --example server --features tls",
        ));
    }
    Ok(builder)
}

/// `url` without the password, for logs: `redis://user:secret@host` →
/// `redis://user@host`.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((user_info, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match user_info.split_once(':') {
        Some(("", _)) => format!("{scheme}://{host}"),
        Some((user, _)) => format!("{scheme}://{user}@{host}"),
        None => url.to_owned(),
    }
}

/// What the server is configured with.
struct Settings {
    bind: String,
    /// `RULES`: limits as data instead of one policy.
    rules: Option<RulesSource>,
    redis_url: Option<String>,
    /// The policy, with its algorithm and execution; `None`: `RATE_LIMIT=off`.
    policy: Option<Policy>,
    key: ClientKey,
    deny_cache: bool,
    /// `LOCAL_QUOTA`: hot keys admitted locally.
    local_quota: Option<LocalQuota>,
    /// `HEADER_TIMEOUT` and `SHUTDOWN_GRACE`.
    limits: ConnectionLimits,
    /// `TRUSTED_PROXIES` (and `PROXY_HEADER`): the client's address behind them.
    client_ip: Option<key::ClientIp>,
    fail_mode: FailMode,
    fail_mode_text: String,
    headers: HeaderStyle,
    headers_text: String,
}

impl Settings {
    fn from_env() -> Result<Self, BadSetting> {
        let bind = var("BIND")?.unwrap_or_else(|| "127.0.0.1:3000".to_owned());
        let redis_url = var("REDIS_URL")?;

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

        let algorithm = match var("ALGORITHM")? {
            None => Algorithm::SlidingLog,
            Some(text) => text
                .parse()
                .map_err(|error| BadSetting::new("ALGORITHM", error))?,
        };
        let execution = var("EXECUTION")?
            .map(|text| {
                text.parse::<Execution>()
                    .map_err(|error| BadSetting::new("EXECUTION", error))
            })
            .transpose()?;
        let policy = policy
            .map(|policy| {
                let policy = policy
                    .with_algorithm(algorithm)
                    .map_err(|error| BadSetting::new("ALGORITHM", error))?;
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

        let limits = ConnectionLimits {
            header_timeout: duration("HEADER_TIMEOUT")?.unwrap_or(Duration::from_secs(10)),
            grace: duration("SHUTDOWN_GRACE")?.unwrap_or(Duration::from_secs(20)),
        };

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

        Ok(Self {
            bind,
            rules,
            redis_url,
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
        })
    }
}

/// The value of environment variable `name`; `None` if it is unset or empty.
fn var(name: &'static str) -> Result<Option<String>, BadSetting> {
    match std::env::var(name) {
        Ok(value) if value.is_empty() => Ok(None),
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(BadSetting::new(name, "not valid UTF-8")),
    }
}

/// The duration in environment variable `name`, written as a rate's
/// window (`500ms`, `10s`, `1m`); `None` if it is unset or empty.
fn duration(name: &'static str) -> Result<Option<Duration>, BadSetting> {
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

/// Where the rules come from (`RULES`).
enum RulesSource {
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
enum ClientKey {
    /// `ip`: the address of the connecting peer.
    PeerIp,
    /// `header:NAME`: the value of a request header, else the peer address.
    Header(key::Header),
}

impl ClientKey {
    fn parse(text: &str) -> Result<Self, String> {
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
struct BadSetting {
    variable: &'static str,
    problem: String,
}

impl BadSetting {
    fn new(variable: &'static str, problem: impl fmt::Display) -> Self {
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
