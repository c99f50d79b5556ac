//! Envoy's global rate limit service, answered by the crate's rules: point
//! Envoy's `envoy.filters.http.ratelimit` (or Istio, Envoy Gateway,
//! Contour) at it in place of the reference server.
//!
//! ```sh
//! # The reference server's YAML, unchanged (a file, or a directory of them):
//! RULES=config.yaml cargo run --example envoy_rls --features envoy
//! # The crate's own rules (TOML or JSON, descriptor rules), counted in Redis
//! # (`cluster` and `sentinel` reach every deployment: one node, a Redis
//! # Cluster, a primary behind Sentinel):
//! RULES=rules.toml REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run --example envoy_rls --features envoy,cluster,sentinel
//! RULES=config.yaml REDIS_CLUSTER=redis://10.0.0.1:6379,redis://10.0.0.2:6379 \
//!   cargo run --example envoy_rls --features envoy,cluster,sentinel
//! RULES=config.yaml REDIS_URL=redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster \
//!   cargo run --example envoy_rls --features envoy,cluster,sentinel
//! # The operator's admin router and Prometheus metrics on a port of their own:
//! ADMIN_BIND=127.0.0.1:8082 ADMIN_TOKEN=$(openssl rand -hex 32) RULES=config.yaml \
//!   cargo run --example envoy_rls --features envoy,admin
//! # For production, optimised across crates (a call takes about 15 % fewer
//! # instructions than in a plain release build):
//! CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
//!   cargo build --release --example envoy_rls --features envoy,cluster,sentinel
//! ```
//!
//! Variables (an empty one counts as unset; a bad value is reported on
//! stderr naming the variable, and the program exits with status 2):
//! - `RULES` (required): a rule file (`.yaml`/`.yml`: the reference
//!   server's YAML; `.json`: JSON; else TOML), re-read every second (a
//!   file that does not validate, or an empty one, leaves the rules in
//!   force); or a directory of reference-server YAML files, read at start;
//!   or `redis`: the rule set published at `RULES_KEY` (default
//!   `rl:rules`), followed as it changes.
//! - `REDIS_URL`: unset, counts in this process; set, in Redis: one node
//!   (`redis://`, `rediss://` with `--features tls`), or the primary that
//!   Sentinels name, followed across failovers
//!   (`redis+sentinel://host:port,host:port/service`, `--features sentinel`).
//! - `REDIS_CLUSTER` (`--features cluster`), in place of `REDIS_URL`: the
//!   counts in a Redis Cluster, found from the seed nodes listed
//!   (`redis://host:port`, comma-separated; one is enough, more survive
//!   its loss). The reference server's `REDIS_TYPE=cluster` with its list
//!   of `host:port` in `REDIS_URL` reads here as that list, each written as
//!   a URL, in `REDIS_CLUSTER`.
//! - `RULES=redis` needs `REDIS_URL` of one node: the rule set's pub/sub
//!   would follow neither a cluster nor a failover.
//! - `GRPC_BIND` (default `127.0.0.1:8081`): where Envoy reaches the
//!   service; `grpc.health.v1.Health` answers there too.
//! - `GRPC_THREADS` (default: one per core the process may use): the
//!   threads serving calls. Each connection stays on one; fewer, busier
//!   threads spend less CPU a call, so a service sharing its cores (beside
//!   Envoy, or a load generator) may do better with fewer.
//! - `FAIL_MODE` (`open`, default, or `closed`): when the store fails,
//!   admit, or answer `UNAVAILABLE` (Envoy's `failure_mode_deny` then
//!   decides).
//! - `HEADERS` (`x`, default, `ietf`, `both` or `none`): the rate-limit
//!   fields Envoy adds to responses.
//! - `ADMIN_BIND`, `ADMIN_TOKEN` (`--features admin`): the admin router
//!   (rules in force, key commands, console) and `/metrics`.
//!
//! `SIGTERM` or Ctrl-C stops it gracefully: it stops accepting, calls in
//! flight finish, and it exits 0 within 10 s whatever its clients do (the
//! connections still open then are closed); `SIGHUP` is logged and
//! ignored. Out of file descriptors, it waits before accepting again (10 ms
//! doubling up to a second) instead of spinning. Each connection carries
//! at most 128 calls at once and a call is answered within 5 s (the
//! store's own timeout is far shorter); a message over 64 KiB is refused
//! with `RESOURCE_EXHAUSTED`. The calls run on one thread per core, each
//! connection on the thread it was dealt to (Envoy opens one or more per
//! worker thread).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use futures_util::Stream;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use tower_redis_ratelimit::envoy::RateLimitService;
use tower_redis_ratelimit::response::HeaderStyle;
use tower_redis_ratelimit::rules::{RuleSet, Rules, Watch};
use tower_redis_ratelimit::{FailMode, MemoryStore, RedisStore, Store};

#[path = "server/accept.rs"]
mod accept;
#[path = "server/signals.rs"]
mod signals;

/// How long the calls in flight have after `SIGTERM`.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A setting the program cannot run with.
struct BadSetting(&'static str, String);

fn var(name: &'static str) -> Result<Option<String>, BadSetting> {
    match std::env::var(name) {
        Ok(v) if v.is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(_) => Err(BadSetting(name, "not valid UTF-8".to_owned())),
    }
}

/// Where the counts are kept, when in Redis.
enum RedisAt {
    /// `REDIS_URL`: one node, or (`redis+sentinel://`) the primary its
    /// Sentinels name.
    Url(String),
    /// `REDIS_CLUSTER`: seed nodes of a Redis Cluster (refused at start
    /// without the `cluster` feature).
    Cluster(#[cfg_attr(not(feature = "cluster"), allow(dead_code))] Vec<String>),
}

impl RedisAt {
    fn from_env() -> Result<Option<Self>, BadSetting> {
        match (var("REDIS_URL")?, var("REDIS_CLUSTER")?) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(BadSetting(
                "REDIS_CLUSTER",
                "set REDIS_URL (one node, or Sentinel) or REDIS_CLUSTER, not both".to_owned(),
            )),
            (Some(url), None) if is_sentinel(&url) && !cfg!(feature = "sentinel") => {
                Err(BadSetting(
                    "REDIS_URL",
                    "a Sentinel URL needs `--features envoy,sentinel`".to_owned(),
                ))
            }
            (Some(url), None) => Ok(Some(Self::Url(url))),
            (None, Some(_)) if !cfg!(feature = "cluster") => Err(BadSetting(
                "REDIS_CLUSTER",
                "Redis Cluster needs `--features envoy,cluster`".to_owned(),
            )),
            (None, Some(nodes)) => {
                let nodes: Vec<String> = nodes
                    .split(',')
                    .map(str::trim)
                    .filter(|node| !node.is_empty())
                    .map(str::to_owned)
                    .collect();
                if nodes.is_empty() {
                    return Err(BadSetting(
                        "REDIS_CLUSTER",
                        "names no node: list them as redis://host:port, comma-separated".to_owned(),
                    ));
                }
                Ok(Some(Self::Cluster(nodes)))
            }
        }
    }

    /// The store, connected.
    async fn connect(&self) -> Result<RedisStore, BadSetting> {
        match self {
            Self::Url(url) => RedisStore::connect(url)
                .await
                .map_err(|e| BadSetting("REDIS_URL", e.to_string())),
            #[cfg(feature = "cluster")]
            Self::Cluster(nodes) => RedisStore::connect_cluster(nodes)
                .await
                .map_err(|e| BadSetting("REDIS_CLUSTER", e.to_string())),
            #[cfg(not(feature = "cluster"))]
            Self::Cluster(_) => Err(BadSetting(
                "REDIS_CLUSTER",
                "Redis Cluster needs `--features envoy,cluster`".to_owned(),
            )),
        }
    }
}

/// Whether `url` names a primary through its Sentinels.
fn is_sentinel(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

/// What `RULES` says.
enum Source {
    File(std::path::PathBuf),
    Directory(std::path::PathBuf),
    Redis(String),
}

struct Settings {
    source: Source,
    redis: Option<RedisAt>,
    bind: SocketAddr,
    threads: usize,
    fail_mode: FailMode,
    headers: Option<HeaderStyle>,
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    admin: Option<(String, String)>,
}

impl Settings {
    fn from_env() -> Result<Self, BadSetting> {
        let source = match var("RULES")? {
            None => {
                return Err(BadSetting(
                    "RULES",
                    "is required: a rule file, a directory of reference-server YAML files, or `redis`"
                        .to_owned(),
                ));
            }
            Some(text) if text == "redis" => {
                Source::Redis(var("RULES_KEY")?.unwrap_or_else(|| "rl:rules".to_owned()))
            }
            Some(path) if std::path::Path::new(&path).is_dir() => Source::Directory(path.into()),
            Some(path) => Source::File(path.into()),
        };
        let redis = RedisAt::from_env()?;
        if matches!(source, Source::Redis(_))
            && !matches!(&redis, Some(RedisAt::Url(url)) if !is_sentinel(url))
        {
            return Err(BadSetting(
                "RULES",
                "`redis` needs REDIS_URL of one node (the rule set's pub/sub would not follow \
                 a cluster or a failover): use a rules file"
                    .to_owned(),
            ));
        }
        let bind = var("GRPC_BIND")?
            .unwrap_or_else(|| "127.0.0.1:8081".to_owned())
            .parse()
            .map_err(|e| BadSetting("GRPC_BIND", format!("not an address and port: {e}")))?;
        let threads = match var("GRPC_THREADS")? {
            None => std::thread::available_parallelism().map_or(1, usize::from),
            Some(n) => match n.parse::<usize>() {
                Ok(n) if (1..=1024).contains(&n) => n,
                _ => {
                    return Err(BadSetting(
                        "GRPC_THREADS",
                        format!("{n:?}: a number of threads, 1 to 1024"),
                    ));
                }
            },
        };
        let fail_mode = match var("FAIL_MODE")?.as_deref() {
            None | Some("open") => FailMode::Open,
            Some("closed") => FailMode::Closed,
            Some(other) => {
                return Err(BadSetting(
                    "FAIL_MODE",
                    format!("unknown fail mode {other:?}: use `open` or `closed`"),
                ));
            }
        };
        let headers = match var("HEADERS")?.as_deref() {
            None | Some("x") => Some(HeaderStyle::XRateLimit),
            Some("ietf") => Some(HeaderStyle::Ietf),
            Some("both") => Some(HeaderStyle::Both),
            Some("none") => None,
            Some(other) => {
                return Err(BadSetting(
                    "HEADERS",
                    format!("unknown style {other:?}: use `x`, `ietf`, `both` or `none`"),
                ));
            }
        };
        let admin = match (var("ADMIN_BIND")?, var("ADMIN_TOKEN")?) {
            (None, None) => None,
            (Some(bind), Some(token)) if cfg!(feature = "admin") => Some((bind, token)),
            (Some(_), Some(_)) => {
                return Err(BadSetting(
                    "ADMIN_BIND",
                    "the admin router needs `--features admin`".to_owned(),
                ));
            }
            (Some(_), None) => {
                return Err(BadSetting("ADMIN_TOKEN", "ADMIN_BIND needs it".to_owned()));
            }
            (None, Some(_)) => {
                return Err(BadSetting("ADMIN_BIND", "ADMIN_TOKEN needs it".to_owned()));
            }
        };
        Ok(Self {
            source,
            redis,
            bind,
            threads,
            fail_mode,
            headers,
            admin,
        })
    }
}

/// Every `.yaml`/`.yml` file of `dir`, as one rule set.
fn read_directory(dir: &std::path::Path) -> Result<RuleSet, BadSetting> {
    let bad = |e: String| BadSetting("RULES", e);
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| bad(format!("{}: {e}", dir.display())))? {
        let path = entry.map_err(|e| bad(e.to_string()))?.path();
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
        {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| bad(format!("{}: {e}", path.display())))?;
            files.push((path.display().to_string(), text));
        }
    }
    files.sort();
    RuleSet::from_envoy_yaml(files.iter().map(|(n, t)| (n.as_str(), t.as_str())))
        .map_err(|e| bad(e.to_string()))
}

/// The rules, in force and followed from their source.
async fn rules<St: Store>(
    store: St,
    settings: &Settings,
) -> Result<(Rules, Option<Watch>), BadSetting> {
    let empty = RuleSet::from_toml("").map_err(|e| BadSetting("RULES", e.to_string()))?;
    let rules = Rules::new(store, empty).with_fail_mode(settings.fail_mode.clone());
    let watch = match &settings.source {
        Source::File(path) => {
            let set = RuleSet::from_file(path).map_err(|e| BadSetting("RULES", e.to_string()))?;
            rules.replace(set);
            Some(rules.watch_file(path, Duration::from_secs(1)))
        }
        Source::Directory(dir) => {
            rules.replace(read_directory(dir)?);
            None
        }
        Source::Redis(key) => {
            let url = match &settings.redis {
                Some(RedisAt::Url(url)) => url.as_str(),
                _ => "",
            };
            let client = tower_redis_ratelimit::redis::Client::open(url)
                .map_err(|e| BadSetting("REDIS_URL", e.to_string()))?;
            let watch = rules
                .follow_redis(client, key.clone(), Duration::from_secs(1))
                .await
                .map_err(|e| BadSetting("RULES", e.to_string()))?;
            Some(watch)
        }
    };
    Ok((rules, watch))
}

async fn setup() -> Result<(Settings, Rules, Option<Watch>), BadSetting> {
    let settings = Settings::from_env()?;
    let (rules, watch) = match &settings.redis {
        None => rules(MemoryStore::new(), &settings).await?,
        Some(redis) => rules(redis.connect().await?, &settings).await?,
    };
    Ok((settings, rules, watch))
}

// The program's own runtime (settings, the store's connections, the
// rules' reloads, accepting) is single-threaded: the calls have threads of
// their own.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    // Listening for SIGTERM from the start: one sent while the program
    // starts stops it gracefully too; a SIGHUP never kills it.
    let stop = signals::shared(signals::shutdown_signal());
    signals::ignore_hangups();
    let (settings, rules, watch) = match setup().await {
        Ok(ready) => ready,
        Err(BadSetting(variable, problem)) => {
            eprintln!("{variable}: {problem}");
            return ExitCode::from(2);
        }
    };
    let mut service = RateLimitService::new(rules.clone());
    service = match settings.headers {
        Some(style) => service.with_headers(style),
        None => service.without_headers(),
    };
    let listener = match TcpListener::bind(settings.bind).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("GRPC_BIND: cannot listen on {}: {e}", settings.bind);
            return ExitCode::from(2);
        }
    };
    let addr = listener.local_addr().map_or(settings.bind, |a| a);
    #[cfg(feature = "admin")]
    if let Some((bind, token)) = &settings.admin {
        match admin(bind, token, &rules, watch.as_ref()).await {
            Ok(()) => {}
            Err(BadSetting(variable, problem)) => {
                eprintln!("{variable}: {problem}");
                return ExitCode::from(2);
            }
        }
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer<RateLimitService>>()
        .await;
    // The calls run on threads of their own (one per core by default), each
    // serving the connections dealt to it on its own single-threaded
    // runtime: a connection's calls never move between cores nor wake
    // another thread (on tokio's multi-threaded runtime a call took about
    // 40 % more CPU, and the p99 was half as long again).
    let (ended, mut threads_ended) = tokio::sync::mpsc::unbounded_channel();
    let mut threads = Vec::new();
    for i in 0..settings.threads {
        let (deal, dealt) = tokio::sync::mpsc::unbounded_channel();
        let served = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(128)
            .max_concurrent_streams(Some(128))
            .timeout(Duration::from_secs(5))
            .layer(tower::util::MapResponseLayer::new(
                over_size_as_resource_exhausted,
            ))
            .add_service(health_service.clone())
            .add_service(service.clone().into_server())
            .serve_with_incoming_shutdown(dealt_connections(dealt), stop());
        let ended = ended.clone();
        // Each runtime is built here, before the listening starts: built
        // on its thread, a flood of connections could take the descriptors
        // its reactor needs first, and the thread would end.
        let thread = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|runtime| {
                std::thread::Builder::new()
                    .name(format!("calls-{i}"))
                    .spawn(move || {
                        let _ = ended.send(runtime.block_on(served));
                    })
            });
        match thread {
            Ok(_) => threads.push(deal),
            Err(error) => {
                tracing::error!(%error, "cannot start a thread for the calls");
                return ExitCode::FAILURE;
            }
        }
    }
    drop(ended);
    tracing::info!(
        rules = rules.current().set().rules().len(),
        threads = threads.len(),
        "rate limit service listening on {addr}"
    );
    tokio::select! {
        () = deal(listener, threads) => {}
        () = stop() => {}
        // A thread's server ends before the stop only when it fails.
        Some(Err(error)) = threads_ended.recv() => {
            tracing::error!(%error, "the gRPC server failed");
            return ExitCode::FAILURE;
        }
    }
    // Each thread's server finishes the calls in flight once stopped;
    // tonic waits for every connection to close, however long its client
    // keeps it open: the grace period bounds the wait.
    tracing::info!(grace = ?SHUTDOWN_GRACE, "shutting down: finishing the calls in flight");
    let finished = async {
        let mut served = Ok(());
        while let Some(ended) = threads_ended.recv().await {
            served = served.and(ended);
        }
        served
    };
    let served = match tokio::time::timeout(SHUTDOWN_GRACE, finished).await {
        Ok(served) => served,
        Err(_) => {
            // Returning from main closes them.
            tracing::warn!(
                grace = ?SHUTDOWN_GRACE,
                "grace period over: closing the connections still open"
            );
            Ok(())
        }
    };
    drop(watch);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "the gRPC server failed");
            ExitCode::FAILURE
        }
    }
}

/// The admin router and `/metrics` on `bind`, behind `token`.
#[cfg(feature = "admin")]
async fn admin(
    bind: &str,
    token: &str,
    rules: &Rules,
    watch: Option<&Watch>,
) -> Result<(), BadSetting> {
    use tower_redis_ratelimit::admin::Admin;
    let metrics = tower_redis_ratelimit::admin::prometheus_builder()
        .install_recorder()
        .map_err(|e| {
            BadSetting(
                "ADMIN_BIND",
                format!("cannot install the metrics recorder: {e}"),
            )
        })?;
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| BadSetting("ADMIN_BIND", format!("cannot listen on {bind:?}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| BadSetting("ADMIN_BIND", e.to_string()))?;
    let mut admin = Admin::new(token.to_owned(), addr)
        .map_err(|e| BadSetting("ADMIN_TOKEN", e.to_string()))?
        .with_metrics(metrics)
        .with_rules(rules);
    if let Some(watch) = watch {
        admin = admin.with_watch(watch);
    }
    let router = admin.into_router();
    tracing::info!("admin router on http://{addr} (bearer token required)");
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            tracing::error!(%error, "the admin router stopped");
        }
    });
    Ok(())
}

/// A message over the size limit answered as gRPC says
/// (`RESOURCE_EXHAUSTED`, in its table of status codes; grpc-go and
/// grpc-java answer so): tonic answers `OUT_OF_RANGE`, which neither
/// service here answers for anything else.
fn over_size_as_resource_exhausted(
    mut response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let status = response.headers_mut().get_mut("grpc-status");
    if let Some(status) = status.filter(|s| *s == "11") {
        *status = http::HeaderValue::from_static("8");
    }
    response
}

/// Deal the listener's connections to the calls' `threads` in turn.
async fn deal(listener: TcpListener, threads: Vec<UnboundedSender<std::net::TcpStream>>) {
    let mut acceptor = accept::Acceptor::new(listener);
    for thread in threads.iter().cycle() {
        let (stream, _) = acceptor.accept().await;
        // As tonic's own listener sets it: answers are small and not batched.
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
        // Out of this runtime's reactor, into the thread's.
        match stream.into_std() {
            Ok(stream) => {
                let _ = thread.send(stream);
            }
            Err(error) => tracing::debug!(%error, "cannot hand a connection over"),
        }
    }
}

/// The connections dealt to one thread, as tonic takes them.
fn dealt_connections(
    dealt: UnboundedReceiver<std::net::TcpStream>,
) -> impl Stream<Item = std::io::Result<TcpStream>> {
    futures_util::stream::unfold(dealt, |mut dealt| async move {
        let stream = dealt.recv().await?;
        Some((TcpStream::from_std(stream), dealt))
    })
}
