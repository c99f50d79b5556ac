//! The operator's side (feature `admin`): an axum [`Router`] to mount on a
//! listener of its own, from which an operator sees and steers the limits of
//! a running server without writing code.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_redis_ratelimit::admin::Admin;
//! use tower_redis_ratelimit::rules::{RuleSet, Rules};
//! use tower_redis_ratelimit::MemoryStore;
//!
//! let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("")?);
//! let watch = rules.watch_file("rules.toml", std::time::Duration::from_secs(1));
//! let metrics = tower_redis_ratelimit::admin::prometheus_builder().install_recorder()?;
//! let admin = Admin::new(std::env::var("ADMIN_TOKEN")?)?
//!     .with_rules(&rules)
//!     .with_watch(&watch)
//!     .with_metrics(metrics)
//!     .into_router();
//! // Never on the public listener: a port only operators reach.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9000").await?;
//! axum::serve(listener, admin).await?;
//! # Ok(()) }
//! ```
//!
//! Every route, `/metrics` and the console included, needs
//! `Authorization: Bearer <token>` (compared in constant time; 401
//! otherwise). Bodies are JSON, errors `application/problem+json` naming
//! what was wrong. No cookies and no CORS headers; a request that says it
//! comes from another site's page (`Sec-Fetch-Site`, `Origin`) is refused
//! (403), and a change (`POST`, `PUT`) must declare
//! `Content-Type: application/json` (415 otherwise), which another origin's
//! page cannot send without a preflight this router never answers: a
//! browser that adds the token to every request (as the console needs)
//! cannot be driven by another site.
//!
//! | route | does |
//! |---|---|
//! | `GET /api/rules` | the rules in force: each rule's policies, and the watch's source, version, text, load time, error and last rejected set |
//! | `PUT /api/rules` | publish a rule set `{"text": "..."}` (TOML or JSON), validated first: to Redis (every process follows it) or into the watched file |
//! | `GET /api/limits/{name}/top` | the keys denied most over this minute and the last (a rule's tiers together), by every process that operates its limits with an admin router and shares the store (by this process over a [`MemoryStore`](crate::MemoryStore)) |
//! | `GET /api/limits/{name}/keys/{key}` | peek: the decision one more request would get (its `remaining` is what that request would leave), reset, blocked |
//! | `POST /api/limits/{name}/keys/{key}/reset` | forget the key's counts, leases and block |
//! | `POST /api/limits/{name}/keys/{key}/block` | `{"seconds": N}`: deny the key for N seconds, at most a day ([`rules::MAX_BLOCK`](crate::rules::MAX_BLOCK); 0 lifts a block) |
//! | `POST /api/limits/{name}/keys/{key}/penalty` | `{"units": N}`: take N units of its quota |
//! | `POST /api/limits/{name}/keys/{key}/reward` | `{"units": N}`: give N units back |
//! | `GET /metrics` | the crate's metrics in Prometheus's text format |
//! | `GET /` | the console: a page that refreshes itself every second with decisions per second per rule (this process's, from the metrics), the store's health, the top limited keys with buttons to peek, reset and block, and the rules in force |
//!
//! `{name}` is a rule's name or a [`Limiter`]'s
//! ([`with_limiter`](Admin::with_limiter)); `?tier=` picks a rule's tier.
//! The key is the one the layer counts (the extractor's output, as the
//! store's keys and the logs show it), percent-encoded in the path. The key
//! commands go to the store, so they take effect in every process sharing
//! it.

mod auth;
mod keys;
mod problem;
mod rules;

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::response::IntoResponse as _;
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::Limiter;
use crate::rules::{Rules, Source, Watch, WatchStatus};

use self::auth::Token;

/// The shortest token [`Admin::new`] accepts, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why an [`Admin`] cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The bearer token is too short to resist guessing.
    #[error("the admin token is {len} bytes long; it must be at least {MIN_TOKEN_LEN}")]
    TokenTooShort {
        /// Its length in bytes.
        len: usize,
    },
    /// The token holds a space, a control character or a byte outside
    /// ASCII: it cannot be sent in a header as is.
    #[error("the admin token must be printable ASCII with no space (a trailing newline?)")]
    TokenNotPrintable,
}

/// The builder of the admin router: what it operates, and its token.
#[derive(Debug)]
#[must_use]
pub struct Admin {
    token: Token,
    operated: Operated,
}

/// What the routes operate: shared by every request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Operated {
    rules: Option<Rules>,
    watch: Option<(Arc<Mutex<WatchStatus>>, Source)>,
    limiters: Vec<Limiter>,
    metrics: Option<PrometheusHandle>,
}

impl Admin {
    /// An admin router that answers only requests bearing `token` (at
    /// least [`MIN_TOKEN_LEN`] bytes).
    ///
    /// # Errors
    /// [`AdminError::TokenTooShort`].
    pub fn new(token: impl Into<String>) -> Result<Self, AdminError> {
        Ok(Self {
            token: Token::new(token.into())?,
            operated: Operated::default(),
        })
    }

    /// Operate `rules`: list them, run key commands on each rule and tier,
    /// and count their most denied keys from now on (shared through the
    /// store, at most once a second per rule: build an admin router in
    /// every process of a deployment to see all of its denials).
    pub fn with_rules(mut self, rules: &Rules) -> Self {
        rules.watch_denials();
        self.operated.rules = Some(rules.clone());
        self
    }

    /// Show what `watch` (of the rules given to
    /// [`with_rules`](Self::with_rules)) last did, and publish rule sets to
    /// its source. The watch keeps running as its owner decides.
    pub fn with_watch(mut self, watch: &Watch) -> Self {
        self.operated.watch = Some(watch.shared());
        self
    }

    /// Run key commands on `limiter`, under its
    /// [`name`](Limiter::name), and count its most denied keys from now
    /// on (see [`with_rules`](Self::with_rules)).
    pub fn with_limiter(mut self, limiter: Limiter) -> Self {
        limiter.watch_denials();
        self.operated.limiters.push(limiter);
        self
    }

    /// Serve `GET /metrics` from `handle` (the recorder the application
    /// installed with `metrics_exporter_prometheus::PrometheusBuilder`).
    pub fn with_metrics(mut self, handle: PrometheusHandle) -> Self {
        self.operated.metrics = Some(handle);
        self
    }

    /// The router, every route behind the token.
    pub fn into_router(self) -> Router {
        let operated = Arc::new(self.operated);
        Router::new()
            .route("/api/rules", get(rules::show).put(rules::publish))
            .route("/api/limits/{name}/top", get(keys::top))
            .route("/api/limits/{name}/keys/{key}", get(keys::peek))
            .route(
                "/api/limits/{name}/keys/{key}/{command}",
                post(keys::command),
            )
            .route("/metrics", get(metrics))
            .route("/", get(console))
            .route("/console.js", get(console_script))
            .fallback(problem::not_found)
            .with_state(operated)
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(self.token),
                auth::require,
            ))
    }
}

/// A Prometheus recorder's builder with the buckets of the crate's
/// histograms (the store's latency: 100 µs to 2.5 s), to install as the
/// process's `metrics` recorder and give to [`Admin::with_metrics`].
pub fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    const STORE_SECONDS: &[f64] = &[
        0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
        2.5,
    ];
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(
                "ratelimit_store_duration_seconds".to_owned(),
            ),
            STORE_SECONDS,
        )
        // Valid buckets, never empty: this cannot fail.
        .unwrap_or_else(|_| metrics_exporter_prometheus::PrometheusBuilder::new())
}

/// The console: one page and its script, inside the crate (no build step,
/// nothing fetched from elsewhere), reading the routes above.
const CONSOLE: &str = include_str!("console.html");
const CONSOLE_SCRIPT: &str = include_str!("console.js");

/// `GET /`: the console, which may run only its own script, talk only to
/// this router, and not be framed.
async fn console() -> axum::response::Response {
    (
        [
            (http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; \
                 connect-src 'self'; base-uri 'none'; form-action 'none'; \
                 frame-ancestors 'none'",
            ),
            (http::header::X_FRAME_OPTIONS, "DENY"),
        ],
        CONSOLE,
    )
        .into_response()
}

/// `GET /console.js`: the console's script.
async fn console_script() -> axum::response::Response {
    (
        [(http::header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        CONSOLE_SCRIPT,
    )
        .into_response()
}

/// `GET /metrics`.
async fn metrics(
    axum::extract::State(operated): axum::extract::State<Arc<Operated>>,
) -> Result<axum::response::Response, problem::Problem> {
    let handle = operated.metrics.as_ref().ok_or_else(|| {
        problem::Problem::new(
            http::StatusCode::NOT_FOUND,
            "no metrics here: the application gave the admin router no Prometheus recorder",
        )
    })?;
    Ok((
        [(
            http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response())
}
