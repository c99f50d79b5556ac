//! [`RateLimitLayer`]: the layer and its settings.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use crate::breaker::{Breaker, CircuitBreaker, Permit, Ticket};
use crate::decision::Decision;
use crate::deny_cache::{DEFAULT_DENY_CACHE_SIZE, DenyCache};
use crate::policy::Policy;
use crate::service::RateLimit;
use crate::store::DynStore;
#[allow(unused_imports)] // for rustdoc links
use crate::store::Store;
use crate::store::memory::MemoryStore;

/// What to do when the store cannot decide (Redis down, slow or failing,
/// or the circuit breaker open).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Admit the request without limiting it, and log the failure at warn
    /// (the default: the limiter never takes the service down).
    #[default]
    Open,
    /// Answer `503 Service Unavailable`.
    Closed,
    /// Limit in this process while the store fails, with the same policy
    /// divided among `instances` processes (each rate's max divided by
    /// `instances`, rounded down, at least the cost), and go back to the
    /// store when it answers again. Build it with [`FailMode::fallback`].
    /// Responses decided by the fallback carry the limit it enforces (the
    /// divided maxes) in their rate-limit fields, under the same policy names.
    Fallback {
        /// Where the limits are held meanwhile.
        store: MemoryStore,
        /// How many processes share the limit.
        instances: u32,
    },
}

impl FailMode {
    /// [`FailMode::Fallback`] to `store`, for `instances` processes sharing
    /// the limit (1 when this process is alone).
    ///
    /// ```
    /// use tower_redis_ratelimit::{FailMode, MemoryStore};
    ///
    /// // Four replicas: while Redis is down each allows a quarter of the limit.
    /// let mode = FailMode::fallback(MemoryStore::new(), 4);
    /// ```
    pub fn fallback(store: MemoryStore, instances: u32) -> Self {
        Self::Fallback {
            store,
            instances: instances.max(1),
        }
    }
}

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
    settings: Arc<Settings>,
    key: Arc<K>,
}

/// Who took a decision: the store, or the fail mode's fallback store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    Store,
    Fallback,
}

/// A check under way, or its outcome (taken once).
pub(crate) enum Check {
    Done(Option<Result<Decision, crate::store::StoreError>>),
    Waiting(crate::store::BoxFuture<(String, Result<Decision, crate::store::StoreError>)>),
}

/// What every request of one layer shares, whatever its key extractor.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn DynStore>,
    pub(crate) policy: Arc<Policy>,
    /// Namespaces the keys of this layer in the store.
    pub(crate) name: Arc<str>,
    pub(crate) fail_mode: FailMode,
    pub(crate) rejection: Rejection,
    pub(crate) headers: HeaderStyle,
    pub(crate) problem_json: bool,
    /// Keys never limited.
    pub(crate) allowed: Arc<std::collections::HashSet<String>>,
    /// Denials held in process (`None`: off).
    pub(crate) deny_cache: Option<Arc<DenyCache>>,
    /// Shared by every clone of the layer's services.
    pub(crate) breaker: Option<Arc<Breaker>>,
    /// The policy the fallback store enforces.
    pub(crate) fallback_policy: Option<Arc<Policy>>,
}

impl Settings {
    /// The check of `key`: the store's, or a failure at once while the
    /// circuit is open. A check that must wait takes the key and hands it
    /// back with its answer. The ticket, when the breaker let the check
    /// through, goes back to [`store_answered`](Self::store_answered).
    pub(crate) fn check(&self, key: &mut String) -> (Check, Option<Ticket>) {
        let ticket = match self.breaker.as_deref().map(Breaker::permit) {
            Some(Permit::Skip) => {
                return (
                    Check::Done(Some(Err(crate::store::StoreError::CircuitOpen))),
                    None,
                );
            }
            Some(Permit::Ask(ticket)) => Some(ticket),
            None => None,
        };
        if let Some(decision) = self.store.check_in_process(key, &self.policy) {
            return (Check::Done(Some(Ok(decision))), ticket);
        }
        let check = Check::Waiting(
            Arc::clone(&self.store).check_owned(std::mem::take(key), Arc::clone(&self.policy)),
        );
        (check, ticket)
    }

    /// Tell the breaker how the store did with the check of `ticket`.
    pub(crate) fn store_answered(&self, ticket: Option<Ticket>, ok: bool) {
        if let (Some(breaker), Some(ticket)) = (&self.breaker, ticket) {
            if ok {
                breaker.success(ticket);
            } else {
                breaker.failure(ticket);
            }
        }
    }

    /// The policy a decision of `origin` was taken under: the layer's, or
    /// the fallback's share of it.
    fn enforced(&self, origin: Origin) -> &Policy {
        match (origin, &self.fallback_policy) {
            (Origin::Fallback, Some(policy)) => policy,
            _ => &self.policy,
        }
    }

    /// Where a lease the fallback granted goes back to.
    pub(crate) fn fallback_release_target(&self) -> Option<(Arc<dyn DynStore>, Arc<Policy>)> {
        match (&self.fail_mode, &self.fallback_policy) {
            (FailMode::Fallback { store, .. }, Some(policy)) => {
                Some((Arc::new(store.clone()), Arc::clone(policy)))
            }
            _ => None,
        }
    }

    /// The fallback's decision for `key`, when the fail mode has one.
    pub(crate) fn fallback_decision(&self, key: &str) -> Option<Decision> {
        match (&self.fail_mode, &self.fallback_policy) {
            (FailMode::Fallback { store, .. }, Some(policy)) => Some(store.check_now(key, policy)),
            _ => None,
        }
    }

    /// The deny cache, when it may answer for this layer.
    fn usable_deny_cache(&self) -> Option<&DenyCache> {
        let answers_at_once = matches!(self.rejection, Rejection::Reject | Rejection::Custom(_));
        self.deny_cache
            .as_deref()
            .filter(|_| answers_at_once && self.store.denials_are_final_dyn(&self.policy))
    }

    /// A denial of `key` still held in the deny cache.
    pub(crate) fn cached_denial(&self, key: &str) -> Option<Decision> {
        self.usable_deny_cache()?.get(key)
    }

    /// Remember a denial from the store, decided after `sent`.
    pub(crate) fn remember_denial(&self, key: &str, decision: &Decision, sent: std::time::Instant) {
        if let Some(cache) = self.usable_deny_cache() {
            cache.insert(key, decision, sent);
        }
    }

    /// Put the rate-limit fields of `decision`, taken by `origin`, on
    /// `headers`, in the chosen style. They describe the limit enforced (the
    /// fallback's share during an outage), under the layer's policy names.
    pub(crate) fn set_headers(
        &self,
        headers: &mut http::HeaderMap,
        decision: &Decision,
        origin: Origin,
    ) {
        if matches!(self.headers, HeaderStyle::XRateLimit | HeaderStyle::Both) {
            crate::response::set_headers(headers, decision);
        }
        if matches!(self.headers, HeaderStyle::Ietf | HeaderStyle::Both) {
            crate::response::set_ietf_headers(
                headers,
                &self.policy,
                self.enforced(origin),
                decision,
            );
        }
    }

    /// The response to a request `decision`, taken by `origin`, denies (a
    /// gRPC call when `grpc`).
    pub(crate) fn denial(
        &self,
        decision: &Decision,
        grpc: bool,
        origin: Origin,
    ) -> Response<Bytes> {
        let mut response = match &self.rejection {
            Rejection::Custom(respond) => {
                let mut response = respond(decision);
                let mut fields = http::HeaderMap::new();
                self.set_headers(&mut fields, decision, origin);
                fields.insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from(crate::response::retry_after_secs(decision)),
                );
                for (name, value) in &fields {
                    if !response.headers().contains_key(name) {
                        response.headers_mut().insert(name.clone(), value.clone());
                    }
                }
                return response;
            }
            _ if grpc => crate::response::grpc_too_many_requests(decision),
            _ if self.problem_json => crate::response::problem_json(decision, &self.policy),
            _ => crate::response::too_many_requests(decision),
        };
        // The builders set the X-RateLimit fields; switch to the chosen style.
        if self.headers == HeaderStyle::Ietf {
            for name in [
                &crate::response::X_RATELIMIT_LIMIT,
                &crate::response::X_RATELIMIT_REMAINING,
                &crate::response::X_RATELIMIT_RESET,
            ] {
                response.headers_mut().remove(name);
            }
        }
        if self.headers != HeaderStyle::XRateLimit {
            crate::response::set_ietf_headers(
                response.headers_mut(),
                &self.policy,
                self.enforced(origin),
                decision,
            );
        }
        response
    }

    /// The store key of an extracted key: `{name}:{key}`, written into the
    /// extracted key's own buffer (no allocation when it has room, as the
    /// IP extractors leave).
    pub(crate) fn store_key(&self, mut key: String) -> String {
        key.reserve(self.name.len() + 1);
        key.insert(0, ':');
        key.insert_str(0, &self.name);
        key
    }
}

impl<K> RateLimitLayer<K> {
    /// Limit requests by the key `key` picks, to `policy`, in `store`.
    pub fn new<St: Store>(store: St, policy: Policy, key: K) -> Self {
        let name = default_name(&policy);
        Self {
            settings: Arc::new(Settings {
                store: Arc::new(store),
                policy: Arc::new(policy),
                name: Arc::from(name),
                fail_mode: FailMode::default(),
                rejection: Rejection::default(),
                headers: HeaderStyle::default(),
                problem_json: false,
                allowed: Arc::default(),
                deny_cache: Some(Arc::new(DenyCache::new(DEFAULT_DENY_CACHE_SIZE))),
                breaker: Some(Arc::new(Breaker::new(CircuitBreaker::default()))),
                fallback_policy: None,
            }),
            key: Arc::new(key),
        }
    }

    /// What to do when the store fails (default [`FailMode::Open`]).
    #[must_use]
    pub fn with_fail_mode(self, fail_mode: FailMode) -> Self {
        self.map_settings(|s| {
            s.fallback_policy = match &fail_mode {
                FailMode::Fallback { instances, .. } => {
                    Some(Arc::new(s.policy.shared_by(*instances)))
                }
                _ => None,
            };
            s.fail_mode = fail_mode;
        })
    }

    /// The circuit breaker (default [`CircuitBreaker::default`]: open after
    /// 5 consecutive store failures, probe every second). While it is open,
    /// requests are answered by the fail mode at once instead of each
    /// waiting for the store's timeout. Only results of checks let through
    /// in the breaker's current state count: a check sent before the circuit
    /// opened and answered late neither closes nor reopens it; only the
    /// probe's result does. `None` turns it off.
    #[must_use]
    pub fn with_circuit_breaker(self, breaker: Option<CircuitBreaker>) -> Self {
        self.map_settings(|s| s.breaker = breaker.map(|b| Arc::new(Breaker::new(b))))
    }

    /// What to do with denied requests (default [`Rejection::Reject`]).
    #[must_use]
    pub fn with_rejection(self, rejection: Rejection) -> Self {
        self.map_settings(|s| s.rejection = rejection)
    }

    /// Which rate-limit fields responses carry (default
    /// [`HeaderStyle::XRateLimit`]).
    #[must_use]
    pub fn with_headers(self, style: HeaderStyle) -> Self {
        self.map_settings(|s| s.headers = style)
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
        self.map_settings(|s| s.problem_json = enabled)
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
        let mut allowed = (*self.settings.allowed).clone();
        allowed.extend(keys.into_iter().map(Into::into));
        self.map_settings(|s| s.allowed = Arc::new(allowed))
    }

    /// Hold denials in process: once the store denies a key until `t`, the
    /// key's requests are denied locally until `t`, with no round trip, so a
    /// flood from one key costs the store nothing. Used only where that is
    /// exact ([`Store::denials_are_final`]: a cached denial never refuses a
    /// request the store would admit) and when denials are answered at once
    /// ([`Rejection::Reject`] or [`Rejection::Custom`]). At most `capacity`
    /// keys are held (default 10,000; on); 0 turns the cache off.
    #[must_use]
    pub fn with_deny_cache(self, capacity: usize) -> Self {
        let cache = (capacity > 0).then(|| Arc::new(DenyCache::new(capacity)));
        self.map_settings(|s| s.deny_cache = cache)
    }

    /// Name this limit. Keys are counted per name, so two layers sharing a
    /// store and a key extractor keep separate counts unless they share a
    /// name. The default is the policy text without spaces (`"3/s,20/min"`),
    /// followed by every setting that changes what is counted or how, when
    /// it is not the default: the cost (`"2/min;cost=2"`), the minimum
    /// spacing (`"2/min;spacing=10s"`) and, for the sliding log, the
    /// execution (`"2/min;script"`), in that order. (The algorithm is not in
    /// the name: the stores keep each algorithm's state apart.) So layers
    /// with the same policy share counts, layers whose policies count
    /// differently never do, and changing a policy starts its counts afresh. Use one name for one policy only: a check trims entries older
    /// than its own longest window, so a shorter policy under the same name
    /// would erase history a longer one needs. The store key is
    /// `{name}:{key}`, so on a shared store no name should be another's
    /// followed by `:` (default names hold no `:`).
    #[must_use]
    pub fn with_name(self, name: impl Into<String>) -> Self {
        let name: String = name.into();
        self.map_settings(|s| s.name = Arc::from(name))
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.settings.policy
    }

    /// The name keys are counted under.
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    fn map_settings(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = Settings {
            store: Arc::clone(&self.settings.store),
            policy: Arc::clone(&self.settings.policy),
            name: Arc::clone(&self.settings.name),
            fail_mode: self.settings.fail_mode.clone(),
            rejection: self.settings.rejection.clone(),
            headers: self.settings.headers,
            problem_json: self.settings.problem_json,
            allowed: Arc::clone(&self.settings.allowed),
            deny_cache: self.settings.deny_cache.clone(),
            breaker: self.settings.breaker.clone(),
            fallback_policy: self.settings.fallback_policy.clone(),
        };
        change(&mut settings);
        self.settings = Arc::new(settings);
        self
    }
}

fn default_name(policy: &Policy) -> String {
    use crate::policy::{Algorithm, Execution};
    use std::fmt::Write as _;

    // Writing to a `String` never fails.
    let mut name = policy.to_string().replace(' ', "");
    if policy.cost() != 1 {
        let _ = write!(name, ";cost={}", policy.cost());
    }
    if let Some(spacing) = policy.min_spacing() {
        let _ = write!(name, ";spacing={}", crate::policy::duration_text(spacing));
    }
    // Only the sliding log runs differently by execution.
    if policy.algorithm() == Algorithm::SlidingLog && policy.execution() != Execution::default() {
        let _ = write!(name, ";{}", policy.execution());
    }
    name
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            key: Arc::clone(&self.key),
        }
    }
}

impl<K> fmt::Debug for RateLimitLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.settings.policy.to_string())
            .field("name", &self.settings.name)
            .field("fail_mode", &self.settings.fail_mode)
            .field("breaker", &self.settings.breaker.is_some())
            .field("rejection", &self.settings.rejection)
            .field("headers", &self.settings.headers)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_parts(inner, Arc::clone(&self.settings), Arc::clone(&self.key))
    }
}
