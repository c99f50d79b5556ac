//! A rate-limited axum server, configured from the environment.
//!
//! ```sh
//! cargo run --example server                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server  # shared through Redis
//! DATABASE_URL=postgres://app@localhost/app \
//!   cargo run --example server --features postgres             # shared through PostgreSQL
//! # TLS, and a primary found through Redis Sentinel (crate features):
//! REDIS_URL=rediss://redis.internal:6380 REDIS_CA_CERT=ca.pem \
//!   cargo run --example server --features tls
//! REDIS_URL=redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster \
//!   cargo run --example server --features sentinel
//! # A Redis Cluster, from its seed nodes:
//! REDIS_CLUSTER=redis://10.0.0.1:6379,redis://10.0.0.2:6379 \
//!   cargo run --example server --features cluster
//! # The operator's admin router and console on a private port:
//! ADMIN_BIND=127.0.0.1:3001 ADMIN_TOKEN=$(openssl rand -hex 32) \
//!   cargo run --example server --features admin
//! ```
//!
//! Every variable, with its default and meaning, is listed once, in the
//! production guide's section "The example server"
//! (`src/docs/guide/production.md`; on docs.rs: `guide::production`).
//!
//! With `RULES`, every path is served (`hello`), `POST /login` answers 200
//! when the header `x-password` is `demo` and 401 otherwise (to show a rule
//! counting failed logins only), `POST /completions` answers its body back
//! with its words counted in `x-usage-tokens` (to show a rule settling
//! its cost from that header; the body is bounded by `BODY_LIMIT`,
//! `BODY_MEMORY` and `BODY_TIMEOUT`), and `/health` is never limited. A rule set
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
//! reading. `SIGHUP` is logged and ignored: the settings are read at start,
//! and the rules are followed as they change without a signal. What the
//! server defends against, and what it leaves to a reverse proxy: the
//! production guide ("What the example server defends against").

use std::process::ExitCode;

mod accept;
#[cfg(feature = "admin")]
mod admin;
mod app;
mod bodies;
mod connections;
mod serve;
mod settings;
mod signals;
mod store;

use axum::Router;
use tokio::net::TcpListener;
use tower_redis_ratelimit::{MemoryStore, Store};
use tracing_subscriber::EnvFilter;

use crate::app::{Operated, router, rules_router};
use crate::serve::{ConnectionLimits, serve};
use crate::settings::{BadSetting, Settings};
use crate::signals::{ignore_hangups, shutdown_signal};
use crate::store::{connect_redis, without_password};

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    // Listening for SIGTERM from the start: one sent while the server
    // starts stops it gracefully too; a SIGHUP never kills it.
    let stop = shutdown_signal();
    ignore_hangups();
    let Ready {
        listener,
        app,
        limits,
        operated,
        admin,
    } = match setup().await {
        Ok(ready) => ready,
        Err(bad) => {
            eprintln!("{bad}");
            return ExitCode::from(2);
        }
    };
    // The admin router stops with the app; the rules are followed (the
    // watch in `operated`) until both have stopped.
    match admin {
        #[cfg(feature = "admin")]
        Some(admin) => {
            let stopped = signals::shared(stop);
            tokio::join!(
                serve(listener, app, limits, stopped()),
                serve(
                    admin.listener,
                    admin.router,
                    admin::limits(limits),
                    stopped()
                ),
            );
        }
        _ => serve(listener, app, limits, stop).await,
    }
    drop(operated);
    ExitCode::SUCCESS
}

/// What `setup` readies.
struct Ready {
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    operated: Operated,
    admin: Option<AdminListener>,
}

/// The admin router on its own listener.
#[cfg(feature = "admin")]
use crate::admin::AdminListener;
#[cfg(not(feature = "admin"))]
enum AdminListener {}

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

/// Reads the settings, opens the store and binds the listeners.
async fn setup() -> Result<Ready, BadSetting> {
    let settings = Settings::from_env()?;
    let (app, operated) = match (
        &settings.redis_url,
        &settings.redis_cluster,
        &settings.database_url,
    ) {
        (Some(url), _, _) => app(connect_redis(url).await?, &settings).await?,
        #[cfg(feature = "cluster")]
        (None, Some(nodes), _) => {
            app(store::connect_redis_cluster(nodes).await?, &settings).await?
        }
        #[cfg(feature = "postgres")]
        (None, None, Some(url)) => app(store::connect_postgres(url).await?, &settings).await?,
        _ => app(MemoryStore::new(), &settings).await?,
    };
    let listener = TcpListener::bind(&settings.bind).await.map_err(|error| {
        BadSetting::new(
            "BIND",
            format!("cannot listen on {:?}: {error}", settings.bind),
        )
    })?;
    log_start(&settings, &listener);
    let admin = match &settings.admin {
        #[cfg(feature = "admin")]
        Some(admin) => Some(crate::admin::listen(admin, &operated).await?),
        _ => None,
    };
    Ok(Ready {
        listener,
        app,
        limits: settings.limits,
        operated,
        admin,
    })
}

/// The app over `store`: the rules' router, or one policy's.
async fn app<St: Store>(store: St, settings: &Settings) -> Result<(Router, Operated), BadSetting> {
    match &settings.rules {
        Some(source) => rules_router(store, source, settings).await,
        None => router(store, settings),
    }
}

/// The lines logged at start: how connections are bounded, then what is
/// limited, how, and where.
fn log_start(settings: &Settings, listener: &TcpListener) {
    let store = match (
        &settings.redis_url,
        &settings.redis_cluster,
        &settings.database_url,
    ) {
        (Some(url), _, _) => format!("redis {}", without_password(url)),
        (None, Some(nodes), _) => format!("redis cluster {}", store::cluster_nodes(nodes)),
        (None, None, Some(_)) => "postgres".to_owned(),
        (None, None, None) => "memory".to_owned(),
    };
    let addr = listener
        .local_addr()
        .map_or_else(|_| settings.bind.clone(), |addr| addr.to_string());
    let limits = &settings.limits;
    tracing::info!(
        max_connections = limits.caps.total,
        max_connections_per_ip = limits.caps.per_client,
        header_timeout = ?limits.header_timeout,
        shutdown_grace = ?limits.grace,
        "connection limits"
    );
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
