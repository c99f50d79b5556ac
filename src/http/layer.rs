//! [`RateLimitLayer`]: the layer and its settings.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use super::service::RateLimit;
use crate::decision::Decision;
use crate::limiter::{CircuitBreaker, FailMode, Limiter, Source};
use crate::policy::Policy;
use crate::store::Store;

/// Builds the response to a denied request from its decision
/// ([`Rejection::Custom`]).
pub type Responder = dyn Fn(&Decision) -> Response<Bytes> + Send + Sync;

/// What to do with a request its key's limit denies.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Rejection {
    /// Answer `429 Too Many Requests` with `Retry-After` (the default).
    #[default]
    Reject,
    /// Shape instead of police: when the request would be admitted within
    /// `max_wait`, wait and check again (as often as needed, never waiting
    /// more than `max_wait` in all); otherwise reject it. A waiting request
    /// holds nothing of the wrapped service (no `Buffer` slot or
    /// `ConcurrencyLimit` permit its readiness reserved): once admitted, it
    /// waits for the service to be ready again before it is called.
    Delay {
        /// The longest a request may be held back.
        max_wait: Duration,
    },
    /// Answer with the response the closure builds from the decision (a
    /// degraded answer, a JSON body, a redirect). The rate-limit headers and
    /// `Retry-After` are added unless the closure set them.
    Custom(Arc<Responder>),
    /// Dry run: decide, set the headers, log the denial at `info`, but let
    /// the request through: to roll out a new limit safely.
    Shadow,
}

impl Rejection {
    /// [`Rejection::Delay`] for at most `max_wait`.
    pub fn delay(max_wait: Duration) -> Self {
        Self::Delay { max_wait }
    }

    /// [`Rejection::Custom`] with `respond`.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, Rejection, key};
    ///
    /// let degrade = Rejection::custom(|decision| {
    ///     let body = format!("{{\"cached\":true,\"retry_in_ms\":{}}}", decision.retry_after().as_millis());
    ///     let mut response = Response::new(Bytes::from(body));
    ///     *response.status_mut() = StatusCode::OK;
    ///     response
    /// });
    /// let layer = RateLimitLayer::new(MemoryStore::new(), "5/s".parse::<Policy>()?, key::global())
    ///     .with_rejection(degrade);
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    pub fn custom(respond: impl Fn(&Decision) -> Response<Bytes> + Send + Sync + 'static) -> Self {
        Self::Custom(Arc::new(respond))
    }
}

impl fmt::Debug for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Reject => f.write_str("Reject"),
            Self::Delay { max_wait } => {
                f.debug_struct("Delay").field("max_wait", max_wait).finish()
            }
            Self::Custom(_) => f.write_str("Custom(..)"),
            Self::Shadow => f.write_str("Shadow"),
        }
    }
}

/// Which rate-limit fields responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`
    /// (the default).
    #[default]
    XRateLimit,
    /// The IETF fields of draft-ietf-httpapi-ratelimit-headers-11:
    /// `RateLimit-Policy` (every rate: `"3/s";q=3;w=1`) and `RateLimit`
    /// (every rate's remaining quota and seconds: `"3/s";r=2;t=1`), as
    /// RFC 9651 structured fields.
    Ietf,
    /// Both.
    Both,
}

/// Rate-limits every request of the wrapped service under the key its
/// extractor picks, against a [`Policy`] kept in a [`Store`].
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::{FailMode, MemoryStore, Policy, RateLimitLayer, key};
///
/// let limiter = RateLimitLayer::new(MemoryStore::new(), "3/s, 20/min".parse::<Policy>()?, key::peer_ip())
///     .with_fail_mode(FailMode::Closed);
/// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(limiter);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
pub struct RateLimitLayer<K> {
    shared: Arc<Shared>,
    key: Arc<K>,
}

/// What every request of one layer shares, whatever its key extractor: the
/// engine, and how its verdicts are rendered.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) limiter: Limiter,
    pub(crate) rejection: Rejection,
    pub(crate) headers: HeaderStyle,
    pub(crate) problem_json: bool,
}

impl Shared {
    /// Whether denials are answered at once, so the deny cache may answer
    /// them (a delayed or shadowed denial is not final for the request).
    pub(crate) fn answers_at_once(&self) -> bool {
        matches!(self.rejection, Rejection::Reject | Rejection::Custom(_))
    }

    /// Put the rate-limit fields of `decision`, answered by `source`, on
    /// `headers`, in the chosen style. They describe the limit enforced (the
    /// fallback's share during an outage), under the layer's policy names.
    pub(crate) fn set_headers(
        &self,
        headers: &mut http::HeaderMap,
        decision: &Decision,
        source: Source,
    ) {
        if matches!(self.headers, HeaderStyle::XRateLimit | HeaderStyle::Both) {
            super::response::set_headers(headers, decision);
        }
        if matches!(self.headers, HeaderStyle::Ietf | HeaderStyle::Both) {
            super::response::set_ietf_headers(
                headers,
                self.limiter.policy(),
                self.limiter.enforced(source),
                decision,
            );
        }
    }

    /// The response to a request `decision`, answered by `source`, denies (a
    /// gRPC call when `grpc`).
    pub(crate) fn denial(
        &self,
        decision: &Decision,
        grpc: bool,
        source: Source,
    ) -> Response<Bytes> {
        let policy = self.limiter.policy();
        let mut response = match &self.rejection {
            Rejection::Custom(respond) => {
                let mut response = respond(decision);
                let mut fields = http::HeaderMap::new();
                self.set_headers(&mut fields, decision, source);
                fields.insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from(super::response::retry_after_secs(decision)),
                );
                for (name, value) in &fields {
                    if !response.headers().contains_key(name) {
                        response.headers_mut().insert(name.clone(), value.clone());
                    }
                }
                return response;
            }
            _ if grpc => super::response::grpc_too_many_requests(decision),
            _ if self.problem_json => super::response::problem_json(decision, policy),
            _ => super::response::too_many_requests(decision),
        };
        // The builders set the X-RateLimit fields; switch to the chosen style.
        if self.headers == HeaderStyle::Ietf {
            for name in [
                &super::response::X_RATELIMIT_LIMIT,
                &super::response::X_RATELIMIT_REMAINING,
                &super::response::X_RATELIMIT_RESET,
            ] {
                response.headers_mut().remove(name);
            }
        }
        if self.headers != HeaderStyle::XRateLimit {
            super::response::set_ietf_headers(
                response.headers_mut(),
                policy,
                self.limiter.enforced(source),
                decision,
            );
        }
        response
    }
}

impl<K> RateLimitLayer<K> {
    /// Limit requests by the key `key` picks, to `policy`, in `store`
    /// (a [`Limiter`] with its defaults; see [`from_limiter`](Self::from_limiter)).
    pub fn new<St: Store>(store: St, policy: Policy, key: K) -> Self {
        Self::from_limiter(Limiter::new(store, policy), key)
    }

    /// Limit requests by the key `key` picks, with `limiter`: the layer
    /// renders its verdicts. Clones of the limiter (for operator commands,
    /// or to limit work that is not a request) share its counts, breaker
    /// and deny cache.
    ///
    /// ```
    /// use tower_redis_ratelimit::{FailMode, Limiter, MemoryStore, Policy, RateLimitLayer, key};
    ///
    /// let limiter = Limiter::new(MemoryStore::new(), "10/s".parse::<Policy>()?)
    ///     .with_fail_mode(FailMode::Closed);
    /// let layer = RateLimitLayer::from_limiter(limiter.clone(), key::peer_ip());
    /// // `limiter.block("203.0.113.9", ...)` now blocks that client in the layer.
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    pub fn from_limiter(limiter: Limiter, key: K) -> Self {
        Self {
            shared: Arc::new(Shared {
                limiter,
                rejection: Rejection::default(),
                headers: HeaderStyle::default(),
                problem_json: false,
            }),
            key: Arc::new(key),
        }
    }

    /// The engine deciding for this layer: use a clone for operator
    /// commands ([`Limiter::peek`], [`Limiter::block`], ...) on the keys the
    /// layer counts.
    pub fn limiter(&self) -> &Limiter {
        &self.shared.limiter
    }

    /// What to do when the store fails (default [`FailMode::Open`]; see
    /// [`Limiter::with_fail_mode`]). [`FailMode::Closed`] answers `503
    /// Service Unavailable` (a gRPC call: `UNAVAILABLE`).
    #[must_use]
    pub fn with_fail_mode(self, fail_mode: FailMode) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().with_fail_mode(fail_mode))
    }

    /// The circuit breaker (see [`Limiter::with_circuit_breaker`]).
    #[must_use]
    pub fn with_circuit_breaker(self, breaker: CircuitBreaker) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().with_circuit_breaker(breaker))
    }

    /// No circuit breaker (see [`Limiter::without_circuit_breaker`]).
    #[must_use]
    pub fn without_circuit_breaker(self) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().without_circuit_breaker())
    }

    /// What to do with denied requests (default [`Rejection::Reject`]).
    #[must_use]
    pub fn with_rejection(self, rejection: Rejection) -> Self {
        self.map(|s| s.rejection = rejection)
    }

    /// Which rate-limit fields responses carry (default
    /// [`HeaderStyle::XRateLimit`]).
    #[must_use]
    pub fn with_headers(self, style: HeaderStyle) -> Self {
        self.map(|s| s.headers = style)
    }

    /// Answer denials with an RFC 9457 `application/problem+json` body
    /// instead of plain text: the "Quota Exceeded" problem type of
    /// draft-ietf-httpapi-ratelimit-headers (`type`
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded`,
    /// `title` `Quota Exceeded`, `status` 429), its `violated-policies`
    /// (the rates that deny the request, named as in `RateLimit-Policy`),
    /// a `detail` with the retry time, and `retry_after` in seconds.
    #[must_use]
    pub fn with_problem_json(self, enabled: bool) -> Self {
        self.map(|s| s.problem_json = enabled)
    }

    /// Never limit requests whose key (as the extractor gives it, e.g. an
    /// address or an API key) is one of `keys`: trusted internal callers,
    /// the applications authorised for a resource. Their responses carry no
    /// rate-limit headers. Adds to the keys already allowed.
    ///
    /// ```
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};
    ///
    /// let layer = RateLimitLayer::new(MemoryStore::new(), "10/s".parse::<Policy>()?, key::header("x-api-key"))
    ///     .with_allowed_keys(["internal-batch-job", "monitoring"]);
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_allowed_keys<S: Into<String>>(self, keys: impl IntoIterator<Item = S>) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().with_allowed_keys(keys))
    }

    /// Hold denials in process (see [`Limiter::with_deny_cache`]; on by
    /// default, 10,000 keys). Used only when denials are answered at once
    /// ([`Rejection::Reject`] or [`Rejection::Custom`]).
    #[must_use]
    pub fn with_deny_cache(self, capacity: usize) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().with_deny_cache(capacity))
    }

    /// No deny cache (see [`Limiter::without_deny_cache`]).
    #[must_use]
    pub fn without_deny_cache(self) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().without_deny_cache())
    }

    /// Name this limit (see [`Limiter::with_name`]).
    #[must_use]
    pub fn with_name(self, name: impl Into<String>) -> Self {
        self.map(|s| s.limiter = s.limiter.clone().with_name(name))
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        self.shared.limiter.policy()
    }

    /// The name keys are counted under.
    pub fn name(&self) -> &str {
        self.shared.limiter.name()
    }

    fn map(mut self, change: impl FnOnce(&mut Shared)) -> Self {
        let mut shared = (*self.shared).clone();
        change(&mut shared);
        self.shared = Arc::new(shared);
        self
    }
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            key: Arc::clone(&self.key),
        }
    }
}

impl<K> fmt::Debug for RateLimitLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.shared.limiter)
            .field("rejection", &self.shared.rejection)
            .field("headers", &self.shared.headers)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_parts(inner, Arc::clone(&self.shared), Arc::clone(&self.key))
    }
}
