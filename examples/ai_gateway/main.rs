//! An AI gateway: an OpenAI-compatible proxy in front of `UPSTREAM_URL`
//! that limits each API key, and the user, team and organisation it
//! spends for, in requests, tokens and money, all at once.
//!
//! ```sh
//! UPSTREAM_URL=https://api.openai.com UPSTREAM_KEY=sk-... \
//!   RULES=examples/ai_gateway/rules.toml KEYS=examples/ai_gateway/keys.toml \
//!   cargo run --example ai_gateway                      # counts in memory
//! REDIS_URL=redis://127.0.0.1:6379 ...                 # shared by every gateway process
//! DATABASE_URL=postgres://app@localhost/app ... --features postgres
//! ```
//!
//! Clients use any OpenAI SDK with the gateway as its base URL and a key
//! of the keys file (`KEYS`), which names the key's user, team and
//! organisation. The rules file (`RULES`, TOML or JSON, re-read every
//! second) holds the price catalog and the budgets of each level
//! ([the AI gateways guide](https://docs.rs/tower-redis-ratelimit/latest/tower_redis_ratelimit/guide/ai_gateways/index.html)).
//! `POST /v1/chat/completions`, `/v1/completions` and `/v1/embeddings`
//! are estimated, checked against every budget at once, and settled to
//! the usage the upstream reports (streamed or not); `GET /v1/models`
//! passes through; any other path is answered 404 (it would reach the
//! upstream on the gateway's key, counted by no budget). Answers carry OpenAI's `x-ratelimit-*` fields; a denial
//! is OpenAI's `429` error JSON: `rate_limit_exceeded` with `retry-after`
//! (the SDKs wait and retry), or `insufficient_quota` (they do not).
//!
//! A budget's `notify` thresholds are told once per key and period across
//! every process: a log line, and a JSON `POST` to `WEBHOOK_URL` when set.
//! With `ADMIN_BIND` and `ADMIN_TOKEN` (feature `admin`), the admin router
//! shows each budget's spend: `GET /api/limits/team-spend/keys/red`.
//!
//! Settings (environment; an empty variable counts as unset):
//! - `UPSTREAM_URL` (required), `UPSTREAM_KEY` (sent upstream as the
//!   bearer token; the clients' keys never are), `UPSTREAM_TIMEOUT`
//!   (seconds the upstream may stay silent, default 120: a stream silent
//!   longer is cut, and charged what it streamed).
//! - `RULES`, `KEYS` (required): the files, each read again within a
//!   second of a change (a file that no longer reads leaves what is in
//!   force, and says why in the log).
//! - `REDIS_URL` or `DATABASE_URL`: where the counts are (else memory).
//! - `BIND` (default `127.0.0.1:3000`), `BODY_LIMIT` (bytes of a request,
//!   default 4 MiB), `BODY_MEMORY` (bytes of every request held at once,
//!   default 256 MiB), `WEBHOOK_URL`, `ADMIN_BIND`, `ADMIN_TOKEN`.
//!
//! A bad setting exits 2 naming it; `SIGTERM` stops the gateway after the
//! requests in flight (at most 30 s).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tower_redis_ratelimit::ai::OpenAiLayer;
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{MemoryStore, RedisStore};
use tracing_subscriber::EnvFilter;

#[path = "../server/accept.rs"]
mod accept;
// Shared with the example server, which reads its defaults.
#[allow(dead_code)]
#[path = "../server/bodies.rs"]
mod bodies;
#[path = "../server/connections.rs"]
mod connections;
mod keys;
mod proxy;
#[path = "../server/serve.rs"]
mod serve;
#[path = "../server/signals.rs"]
mod signals;
mod webhook;

use crate::bodies::{Bodies, BodyBounds};
use crate::proxy::Upstream;
use crate::serve::ConnectionLimits;

/// A setting that cannot work: the variable, and why.
struct BadSetting(&'static str, String);

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn number<T: std::str::FromStr>(name: &'static str, default: T) -> Result<T, BadSetting> {
    match var(name) {
        None => Ok(default),
        Some(text) => text
            .trim()
            .parse()
            .map_err(|_| BadSetting(name, format!("{text:?} is not a number"))),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let stop = signals::shutdown_signal();
    signals::ignore_hangups();
    match run(stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(BadSetting(name, problem)) => {
            eprintln!("{name}: {problem}");
            ExitCode::from(2)
        }
    }
}

async fn run(stop: impl Future<Output = ()> + Send + 'static) -> Result<(), BadSetting> {
    let required =
        |name: &'static str| var(name).ok_or_else(|| BadSetting(name, "is required".to_owned()));
    let timeout = Duration::from_secs(number("UPSTREAM_TIMEOUT", 120u64)?.max(1));
    let upstream_url = required("UPSTREAM_URL")?;
    let upstream = Upstream::new(&upstream_url, var("UPSTREAM_KEY").as_deref(), timeout)
        .map_err(|e| BadSetting("UPSTREAM_URL", e))?;
    let rules_path = PathBuf::from(required("RULES")?);
    let keys_path = PathBuf::from(required("KEYS")?);
    let webhook = var("WEBHOOK_URL")
        .map(|url| webhook::url(&url))
        .transpose()
        .map_err(|e| BadSetting("WEBHOOK_URL", e))?;
    let keys = keys::Watched::follow(keys_path).map_err(|e| BadSetting("KEYS", e))?;
    let keys_count = keys.len();
    let set = RuleSet::from_file(&rules_path).map_err(|e| BadSetting("RULES", e.to_string()))?;
    let rules = match (var("REDIS_URL"), var("DATABASE_URL")) {
        (Some(_), Some(_)) => {
            return Err(BadSetting(
                "DATABASE_URL",
                "the counts are in Redis (REDIS_URL) or in PostgreSQL, not both".to_owned(),
            ));
        }
        (Some(url), None) => {
            let store = RedisStore::connect(&url)
                .await
                .map_err(|e| BadSetting("REDIS_URL", format!("cannot use Redis: {e}")))?;
            Rules::new(store, set)
        }
        (None, Some(url)) => postgres_rules(&url, set).await?,
        (None, None) => Rules::new(MemoryStore::new(), set),
    };
    let watch = rules.watch_file(&rules_path, Duration::from_secs(1));
    let bounds = BodyBounds {
        limit: number("BODY_LIMIT", 4usize << 20)?,
        memory: number("BODY_MEMORY", 256usize << 20)?,
        timeout: bodies::DEFAULT_BODY_TIMEOUT,
    };
    if bounds.limit == 0 || bounds.memory < bounds.limit {
        return Err(BadSetting(
            "BODY_MEMORY",
            "must hold at least one body of BODY_LIMIT bytes (and BODY_LIMIT be over 0)".to_owned(),
        ));
    }
    let limits = OpenAiLayer::new(rules.clone())
        .with_max_body(bounds.limit)
        .on_notice(webhook::teller(webhook, rules.clone()));
    // The endpoints the layer reads, and the models' list; nothing else
    // reaches the upstream (which would serve it on the gateway's key,
    // counted by no budget).
    let app = Router::new()
        .route("/v1/chat/completions", post(proxy::forward))
        .route("/v1/completions", post(proxy::forward))
        .route("/v1/embeddings", post(proxy::forward))
        .route("/v1/models", get(proxy::forward))
        .route("/v1/models/{model}", get(proxy::forward))
        .with_state(Arc::new(upstream))
        .layer(limits)
        .layer(from_fn_with_state(Bodies::new(bounds), bodies::bounded))
        .layer(from_fn_with_state(keys, keys::authenticate));
    let bind = var("BIND").unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    let listener = TcpListener::bind(&bind)
        .await
        .map_err(|e| BadSetting("BIND", format!("cannot listen on {bind:?}: {e}")))?;
    let stop = signals::shared(stop);
    admin(&rules, &watch, stop()).await?;
    match listener.local_addr() {
        Ok(addr) => tracing::info!(
            rules = rules.current().set().rules().len(),
            keys = keys_count,
            "listening on http://{addr}"
        ),
        Err(_) => tracing::info!("listening on http://{bind}"),
    }
    let limits = ConnectionLimits {
        header_timeout: Duration::from_secs(10),
        grace: Duration::from_secs(30),
        caps: connections::Caps {
            // Within the open files, keeping some for the store and logs.
            total: connections::open_files_limit().map_or(
                connections::DEFAULT_MAX_CONNECTIONS,
                |files| {
                    let room = files.saturating_sub(connections::RESERVED_FILES);
                    usize::try_from(room).map_or(connections::DEFAULT_MAX_CONNECTIONS, |room| {
                        room.min(connections::DEFAULT_MAX_CONNECTIONS)
                    })
                },
            ),
            per_client: connections::DEFAULT_MAX_CONNECTIONS_PER_IP,
        },
    };
    serve::serve(listener, app, limits, stop()).await;
    drop(watch);
    Ok(())
}

#[cfg(feature = "postgres")]
async fn postgres_rules(url: &str, set: RuleSet) -> Result<Rules, BadSetting> {
    let store = tower_redis_ratelimit::PostgresStore::connect(url)
        .await
        // Not the URL: it may hold a password.
        .map_err(|e| BadSetting("DATABASE_URL", format!("cannot use PostgreSQL: {e}")))?;
    Ok(Rules::new(store, set))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_rules(_: &str, _: RuleSet) -> Result<Rules, BadSetting> {
    Err(BadSetting(
        "DATABASE_URL",
        "PostgreSQL needs the postgres feature: cargo run --example ai_gateway --features postgres"
            .to_owned(),
    ))
}

/// The admin router on `ADMIN_BIND`, behind `ADMIN_TOKEN`, until `stop`.
#[cfg(feature = "admin")]
async fn admin(
    rules: &Rules,
    watch: &tower_redis_ratelimit::rules::Watch,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BadSetting> {
    let (Some(bind), Some(token)) = (var("ADMIN_BIND"), var("ADMIN_TOKEN")) else {
        if var("ADMIN_BIND").is_some() {
            return Err(BadSetting(
                "ADMIN_TOKEN",
                "is required with ADMIN_BIND".to_owned(),
            ));
        }
        return Ok(());
    };
    let listener = TcpListener::bind(&bind)
        .await
        .map_err(|e| BadSetting("ADMIN_BIND", format!("cannot listen on {bind:?}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| BadSetting("ADMIN_BIND", e.to_string()))?;
    let router = tower_redis_ratelimit::admin::Admin::new(token, addr)
        .map_err(|e| BadSetting("ADMIN_TOKEN", e.to_string()))?
        .with_rules(rules)
        .with_watch(watch)
        .into_router();
    tracing::info!("admin router on http://{addr} (bearer token required)");
    tokio::spawn(async move {
        let served = axum::serve(listener, router).with_graceful_shutdown(stop);
        if let Err(error) = served.await {
            tracing::error!(%error, "the admin router stopped");
        }
    });
    Ok(())
}

#[cfg(not(feature = "admin"))]
async fn admin(
    _: &Rules,
    _: &tower_redis_ratelimit::rules::Watch,
    _: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BadSetting> {
    match var("ADMIN_BIND") {
        Some(_) => Err(BadSetting(
            "ADMIN_BIND",
            "the admin router needs the admin feature: cargo run --example ai_gateway --features admin"
                .to_owned(),
        )),
        None => Ok(()),
    }
}
