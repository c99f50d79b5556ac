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
//! // Never on the public listener: a port only operators reach.
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9000").await?;
//! let admin = Admin::new(std::env::var("ADMIN_TOKEN")?, listener.local_addr()?)?
//!     .with_rules(&rules)
//!     .with_watch(&watch)
//!     .with_metrics(metrics)
//!     .into_router();
//! axum::serve(listener, admin).await?;
//! # Ok(()) }
//! ```
//!
//! The router serves only the hosts it is bound to: a request whose `Host`
//! (or, over HTTP/2, whose URI's authority) or `Origin` names another host
//! is refused (403), so a page of a name an attacker's DNS points at the
//! admin address (DNS rebinding) reaches nothing. It serves the IP address
//! given to [`Admin::new`] (any IP address when that is unspecified,
//! `0.0.0.0` or `[::]`) with any port, as no DNS answer can rebind an IP
//! address and a mapped port (`docker -p 19000:9000`, a Kubernetes
//! Service's) differs from the bound one; `localhost` with the bound port
//! when it takes loopback connections; and the names listed with
//! [`with_host_name`](Admin::with_host_name) (a reverse proxy's, a DNS
//! name of the admin network). A `Host` without a port went to 80 or 443,
//! an `Origin` without one to its scheme's.
//!
//! Every route, `/metrics` and the console included, needs
//! `Authorization: Bearer <token>` (compared in constant time; 401
//! otherwise). Bodies are JSON of at most 2 MiB, every error
//! `application/problem+json` naming what was wrong. No cookies and no
//! CORS headers; a request that says it comes from another site's page
//! (`Sec-Fetch-Site`, `Origin`) is refused (403), and a change (`POST`,
//! `PUT`) must declare `Content-Type: application/json` (415 otherwise),
//! which another origin's page cannot send without a preflight this router
//! never answers: a browser that adds the token to every request (as the
//! console needs) cannot be driven by another site.
//!
//! | route | does |
//! |---|---|
//! | `GET /api/rules` | the rules in force: each rule's policies, and the watch's source, version, text, load time, error and last rejected set |
//! | `PUT /api/rules` | publish a rule set `{"text": "..."}` (TOML or JSON), validated first: to Redis (every process follows it) or into the watched file; a set of no rules, which lifts every limit at once, only with `"confirm_empty": true` |
//! | `GET /api/limits/{name}/top` | the keys denied most over this minute and the last (a rule's tiers together), by every process that operates its limits with an admin router and shares the store (by this process over a [`MemoryStore`](crate::MemoryStore)) |
//! | `GET /api/limits/{name}/keys/{key}` | peek: the decision one more request would get (its `remaining` is what that request would leave), reset, blocked |
//! | `POST /api/limits/{name}/keys/{key}/reset` | forget the key's counts, leases and block |
//! | `POST /api/limits/{name}/keys/{key}/block` | `{"seconds": N}`: deny the key for N seconds, at most a day ([`rules::MAX_BLOCK`](crate::rules::MAX_BLOCK); 0 lifts a block) |
//! | `POST /api/limits/{name}/keys/{key}/penalty` | `{"units": N}`: take N units of its quota |
//! | `POST /api/limits/{name}/keys/{key}/reward` | `{"units": N}`: give N units back |
//! | `GET /metrics` | the crate's metrics in Prometheus's text format (given [`with_metrics`](Admin::with_metrics)) |
//! | `GET /` | the console: a page that refreshes itself every second with decisions per second per rule (this process's, from the metrics), the store's health, the top limited keys with buttons to peek, reset and block, and the rules in force |
//!
//! `{name}` is a rule's name or a [`Limiter`]'s
//! ([`with_limiter`](Admin::with_limiter)); `?tier=` picks a rule's tier.
//! The key is the one the layer counts (the extractor's output),
//! percent-encoded in the path; a key longer than 128 bytes is shown, and
//! answered, by its hash (`#` and 40 hex digits), which steers it too. The
//! key commands go to the store, so they take effect in every process
//! sharing it.

mod auth;
mod hosts;
mod keys;
mod problem;
mod prometheus;
mod rules;
mod rules_file;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse as _;
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::Limiter;
use crate::rules::{Rules, Source, Watch, WatchStatus};

use self::auth::{Gate, Token};
use self::hosts::Hosts;

pub use self::prometheus::prometheus_builder;

/// The shortest token [`Admin::new`] accepts, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// The least a token must carry, in bits, as [`Admin::new`] estimates it:
/// its length times log2 of its alphabet's size, the alphabet inferred
/// from the classes of characters present (16 for hexadecimal digits of
/// one case; otherwise digits 10, lowercase 26, uppercase 26, other
/// printable ASCII 32, summed). `openssl rand -hex 8` gives 64, `-hex 32`
/// 256. A token that repeats itself is refused whatever it carries (fewer
/// than 4 different characters, or a shorter string written again:
/// [`AdminError::TokenRepetitive`]).
pub const MIN_TOKEN_BITS: u32 = 64;

/// The fewest different characters a token may hold.
const MIN_DISTINCT_CHARACTERS: usize = 4;

/// The largest body a route reads, in bytes (413 above).
const MAX_BODY: usize = 2 << 20;

/// Why an [`Admin`] cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The bearer token is too short to resist guessing.
    #[error(
        "the admin token is {len} bytes long; it must be at least {MIN_TOKEN_LEN}: {}",
        MAKE_A_TOKEN
    )]
    TokenTooShort {
        /// Its length in bytes.
        len: usize,
    },
    /// The token holds a space, a control character or a byte outside
    /// ASCII: it cannot be sent in a header as is.
    #[error("the admin token must be printable ASCII with no space (a trailing newline?)")]
    TokenNotPrintable,
    /// The token is too short for its alphabet to carry
    /// [`MIN_TOKEN_BITS`].
    #[error(
        "the admin token is too easy to guess: drawn at random from its alphabet, it would \
         carry {bits} bits, at least {MIN_TOKEN_BITS} are needed (make it longer): {}",
        MAKE_A_TOKEN
    )]
    TokenTooWeak {
        /// What it carries, as estimated (rounded down).
        bits: u32,
    },
    /// The token repeats itself: fewer than 4 different characters, or a
    /// shorter string written again (`passwordpassword`,
    /// `admin-admin-admin-admin`).
    #[error(
        "the admin token is too easy to guess: it repeats itself (fewer than \
         {MIN_DISTINCT_CHARACTERS} different characters, or a shorter string written again): {}",
        MAKE_A_TOKEN
    )]
    TokenRepetitive,
    /// The address has port 0: the listener's own address
    /// (`listener.local_addr()`) tells the port the system picked.
    #[error(
        "the admin router's address {addr} has port 0: give the address the listener is bound to (`listener.local_addr()`)"
    )]
    PortNotBound {
        /// The address given.
        addr: SocketAddr,
    },
    /// Not a host name, or `host:port`.
    #[error(
        "{name:?} is not a host name (`admin.internal`) or a host and port (`admin.internal:9000`)"
    )]
    BadHostName {
        /// The name given.
        name: String,
    },
}

/// How to make a token, for the errors above.
const MAKE_A_TOKEN: &str =
    "make one with `openssl rand -hex 32` or `head -c 32 /dev/urandom | base64`";

/// The builder of the admin router: what it operates, the hosts it serves
/// and its token.
#[derive(Debug)]
#[must_use]
pub struct Admin {
    gate: Gate,
    operated: Operated,
}

/// What the routes operate: shared by every request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Operated {
    rules: Option<Rules>,
    watch: Option<(Arc<Mutex<WatchStatus>>, Source)>,
    limiters: Vec<Limiter>,
    metrics: Option<Arc<PrometheusHandle>>,
}

impl Admin {
    /// An admin router that answers only requests bearing `token`, for the
    /// hosts of `bound_to`: the address of the listener it is served on
    /// (`listener.local_addr()?`; its IP address, or any IP address when
    /// it is unspecified, with any port, and `localhost` with its port when
    /// it takes loopback connections). Other names by which operators
    /// reach it are listed with [`with_host_name`](Self::with_host_name).
    ///
    /// The token must be at least [`MIN_TOKEN_LEN`] bytes of printable
    /// ASCII carrying [`MIN_TOKEN_BITS`], and not repeat itself: make one
    /// with `openssl rand -hex 32`.
    ///
    /// # Errors
    /// [`AdminError::TokenTooShort`], [`AdminError::TokenNotPrintable`],
    /// [`AdminError::TokenTooWeak`], [`AdminError::TokenRepetitive`];
    /// [`AdminError::PortNotBound`] for an
    /// address of port 0 (the one asked of `bind`, not the one bound).
    pub fn new(token: impl Into<String>, bound_to: SocketAddr) -> Result<Self, AdminError> {
        Ok(Self {
            gate: Gate {
                token: Token::new(token.into())?,
                hosts: Hosts::bound_to(bound_to)?,
            },
            operated: Operated::default(),
        })
    }

    /// Also serve requests for `name`: a host name (any port) or
    /// `host:port`, by which operators reach the router (a reverse
    /// proxy's public name, a DNS name of the admin network). A name given
    /// with port 443 or 80 is served without a port too, as browsers leave
    /// the default port out of `Host`. Only list names whose DNS the
    /// operator controls.
    ///
    /// # Errors
    /// [`AdminError::BadHostName`].
    pub fn with_host_name(mut self, name: &str) -> Result<Self, AdminError> {
        self.gate.hosts.with_name(name)?;
        Ok(self)
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
    /// installed with [`prometheus_builder`]), and keep the recorder's
    /// memory flat while nobody scrapes it: every second, as long as the
    /// router lives, its histogram samples are folded into their buckets
    /// (the exporter's upkeep), on the tokio runtime this is called on (a
    /// thread of its own outside one).
    pub fn with_metrics(mut self, handle: PrometheusHandle) -> Self {
        let handle = Arc::new(handle);
        prometheus::keep_up(&handle);
        self.operated.metrics = Some(handle);
        self
    }

    /// The router, every route behind the hosts it serves and the token.
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
            .route("/metrics", get(prometheus::render))
            .route("/", get(console))
            .route("/console.js", get(console_script))
            .fallback(problem::not_found)
            .with_state(operated)
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(self.gate),
                auth::require,
            ))
            .layer(axum::middleware::from_fn(problem::every_error))
    }
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
