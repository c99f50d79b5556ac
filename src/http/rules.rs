//! [`RulesLayer`]: requests limited by a rule set ([`Rules`]): the key,
//! tier and cost of each matching rule taken from the request, the
//! verdict rendered as [`RateLimitLayer`](super::RateLimitLayer) renders
//! one, and the outcome counted once the inner service answered.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::body::ResponseBody;
use super::denial;
use super::settings::{HeaderStyle, Rendering};
use super::settlement::{BodyPart, Meter, MeterFn, settle_response};
use crate::key::{self, ClientIp, KeyError, KeyExtractor};
use crate::limiter::LimitError;
use crate::rules::{
    Admission, Call, KeyPart, Rule, Rules, RulesCheck, SettleFrom, Tier, TierFrom, ToSettle,
};

/// The key part of a header a request does not carry.
const MISSING: &str = "hex:";

type TierFn = dyn Fn(&HeaderMap, &http::Extensions) -> Option<String> + Send + Sync;
type CostFn = dyn Fn(&Rule, &HeaderMap) -> Option<u64> + Send + Sync;

/// Limits requests by a rule set: every rule matching a request counts it
/// under the rule's key, with the caller's tier's policy, and the request
/// is denied (429, or RESOURCE_EXHAUSTED for gRPC) if any rule denies it,
/// answered 403 (PERMISSION_DENIED) if a rule's `only` list leaves its key
/// out, and passed on untouched when no rule matches.
///
/// The tier comes from [`with_tier`](Self::with_tier) if set, else from
/// where the rule set says: `tier = "extension"`, the [`Tier`] request
/// extension, or `tier = "header:NAME"`, read **only from requests whose
/// peer is a proxy [`with_client_ip`](Self::with_client_ip) trusts** (with
/// none, never: a client would pick its own plan); else there is none. The
/// `client_ip` key part is the address behind those proxies (by default
/// the peer address). A request without a `header:NAME` key part's header
/// counts with every other request without it, under one key of their
/// own (a rule with an `only` list refuses it).
///
/// The response carries the rate-limit fields of the rule with the fewest
/// units left (of the denying rule, on a denial). Counting by outcome
/// (`count`, `refund`) reads the HTTP status of the inner service's
/// response (an inner error counts as a 500); a gRPC status sent in
/// trailers is not read.
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::rules::{RuleSet, Rules};
/// use tower_redis_ratelimit::MemoryStore;
/// use tower_redis_ratelimit::rules::RulesLayer;
///
/// let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml(r#"
///     [[rules]]
///     name = "api"
///     path = "/api/{*rest}"
///     key = "ip"
///     policy = "100/min"
/// "#)?);
/// let app: Router = Router::new()
///     .route("/api/items", get(|| async { "items" }))
///     .layer(RulesLayer::new(rules));
/// # Ok::<(), tower_redis_ratelimit::rules::RulesError>(())
/// ```
#[derive(Clone)]
pub struct RulesLayer {
    shared: Arc<Settings>,
}

#[derive(Clone)]
struct Settings {
    rules: Rules,
    client_ip: ClientIp,
    tier: Option<Arc<TierFn>>,
    cost: Option<Arc<CostFn>>,
    meter: Option<Arc<MeterFn>>,
    rendering: Rendering,
    /// Whether [`Settings::warn_if_tier_unread`] warned.
    warned: Arc<std::sync::atomic::AtomicBool>,
    /// Whether [`Settings::warn_if_body_unmetered`] warned.
    warned_meter: Arc<std::sync::atomic::AtomicBool>,
}

impl RulesLayer {
    /// Limit requests by `rules` (which may be replaced at runtime).
    pub fn new(rules: Rules) -> Self {
        Self {
            shared: Arc::new(Settings {
                rules,
                client_ip: key::client_ip(),
                tier: None,
                cost: None,
                meter: None,
                rendering: Rendering::default(),
                warned: Arc::default(),
                warned_meter: Arc::default(),
            }),
        }
    }

    /// The rules this layer serves (replace them through it).
    pub fn rules(&self) -> &Rules {
        &self.shared.rules
    }

    /// The caller's tier (plan), from the request's headers and extensions
    /// (claims an authentication middleware put there): it overrides the
    /// rule set's `tier`.
    #[must_use]
    pub fn with_tier(
        self,
        tier: impl Fn(&HeaderMap, &http::Extensions) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.map(|s| s.tier = Some(Arc::new(tier)))
    }

    /// The cost of a request under a rule (`None`: the rule's own cost),
    /// such as its `content-length`. A cost above the policy's smallest max
    /// is lowered to it; a cost of 0 is not counted.
    #[must_use]
    pub fn with_cost(
        self,
        cost: impl Fn(&Rule, &HeaderMap) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.map(|s| s.cost = Some(Arc::new(cost)))
    }

    /// The meter of streamed bodies, for rules that settle their cost
    /// from the body (`settle = { body = true }`): it sees each data frame
    /// and the trailers, and the cost is the sum of what it returns (see
    /// [`Settlement::from_body`](crate::response::Settlement::from_body)).
    #[must_use]
    pub fn with_meter(
        self,
        meter: impl Fn(BodyPart<'_>) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.map(|s| s.meter = Some(Arc::new(meter)))
    }

    /// How `client_ip` key parts find the client behind proxies.
    #[must_use]
    pub fn with_client_ip(self, client_ip: ClientIp) -> Self {
        self.map(|s| s.client_ip = client_ip)
    }

    /// Which rate-limit fields responses carry (default `X-RateLimit-*`).
    #[must_use]
    pub fn with_headers(self, style: HeaderStyle) -> Self {
        self.map(|s| s.rendering.headers = style)
    }

    /// Deny with `application/problem+json` (RFC 9457) instead of text.
    #[must_use]
    pub fn with_problem_json(self) -> Self {
        self.map(|s| s.rendering.problem_json = true)
    }

    fn map(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = (*self.shared).clone();
        change(&mut settings);
        self.shared = Arc::new(settings);
        self
    }
}

impl fmt::Debug for RulesLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RulesLayer")
            .field("rules", &self.shared.rules)
            .field("headers", &self.shared.rendering.headers)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for RulesLayer {
    type Service = RuleLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        self.shared.warn_if_tier_unread();
        // What this layer does not read is said, not silently ignored.
        for rule in self.shared.rules.current().set().rules() {
            if !rule.notify().is_empty() || rule.unit() == crate::rules::Unit::Money {
                tracing::warn!(
                    rule = rule.name(),
                    "rules: the rule counts money or tells notices, which OpenAiLayer (module \
                     `ai`) does: RulesLayer counts its cost in units and tells nothing"
                );
            }
        }
        if let Some(from) = self
            .shared
            .rules
            .current()
            .set()
            .rules()
            .iter()
            .filter_map(Rule::settle)
            .find(|from| from.meters_body())
        {
            self.shared.warn_if_body_unmetered(from);
        }
        RuleLimit {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Settings {
    /// Warn (once per layer) when the rule set reads the tier from a
    /// header that this layer never reads: with no trusted proxy, a
    /// client would pick its own plan, so the header is ignored and every
    /// caller gets the default policy.
    fn warn_if_tier_unread(&self) {
        if self.tier.is_some() || self.client_ip.trusts_any() {
            return;
        }
        if let TierFrom::Header(name) = self.rules.current().set().tier()
            && !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                header = %name,
                "rules: the rule set reads the tier from a header, but this layer trusts no \
                 proxy, so the header is never read and every caller gets the default policy: \
                 trust the proxy that sets it (RulesLayer::with_client_ip(key::client_ip().trusting([...])?)) \
                 or read the tier yourself (RulesLayer::with_tier)"
            );
        }
    }
}

/// The service of a [`RulesLayer`].
#[derive(Clone)]
pub struct RuleLimit<S> {
    inner: S,
    shared: Arc<Settings>,
}

impl<S> RuleLimit<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for RuleLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuleLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Settings {
    fn tier<B>(&self, request: &Request<B>, from: &TierFrom) -> Option<String> {
        if let Some(tier) = &self.tier {
            return tier(request.headers(), request.extensions());
        }
        tier_of(request, from, &self.client_ip)
    }

    /// The key of `rule` for `request`, and its cost.
    fn call<B>(&self, rule: &Rule, request: &Request<B>) -> Result<Option<Call>, KeyError> {
        let call = Call::new(rule_key(rule, request, &self.client_ip)?);
        Ok(Some(
            match self
                .cost
                .as_ref()
                .and_then(|cost| cost(rule, request.headers()))
            {
                Some(cost) => call.with_cost(cost),
                None => call,
            },
        ))
    }

    /// Settle the checks of rules whose real cost `response` gives (now,
    /// or when its body ends: the meters), and strip every matching rule's
    /// stripped header, read by all before any strips it.
    fn settle<B>(&self, settling: Vec<ToSettle>, response: &mut Response<B>) -> Vec<Meter> {
        let settlements = settling.into_iter().map(|(from, unsettled)| {
            self.warn_if_body_unmetered(&from);
            (Arc::new(from.settlement(self.meter.as_ref())), unsettled)
        });
        settle_response(settlements, response)
    }

    /// Warn (once per layer) when a rule settles from the body and this
    /// layer has no body meter: its estimate stands.
    fn warn_if_body_unmetered(&self, from: &SettleFrom) {
        if from.meters_body()
            && self.meter.is_none()
            && !self
                .warned_meter
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                "rules: a rule settles its cost from the body (`settle = {{ body = true }}`), but \
                 this layer has no body meter, so the body settles nothing: install one with \
                 RulesLayer::with_meter"
            );
        }
    }

    fn render(&self, admission: &Admission, grpc: bool) -> Response<Bytes> {
        if let Some(rule) = admission.forbidden_by() {
            tracing::debug!(
                rule,
                "rules: key not on the rule's `only` list; answering 403"
            );
            if grpc {
                return denial::grpc(
                    denial::grpc_status::PERMISSION_DENIED,
                    "not allowed to call this method",
                );
            }
            return denial::forbidden();
        }
        match admission.shown() {
            Some((_, limiter, decision, decided_by)) => {
                self.rendering.denial(limiter, decision, grpc, decided_by)
            }
            None => denial::store_unavailable(),
        }
    }

    fn set_headers(&self, headers: &mut HeaderMap, admission: &Admission) {
        if let Some((_, limiter, decision, decided_by)) = admission.shown() {
            self.rendering
                .set_headers(headers, limiter, decision, decided_by);
        }
    }
}

/// The tier of `request` where the rule set says it comes `from`.
pub(crate) fn tier_of<B>(
    request: &Request<B>,
    from: &TierFrom,
    client_ip: &ClientIp,
) -> Option<String> {
    match from {
        // Believed only from a trusted proxy (which sets it), never
        // from a client: it would pick its own plan.
        TierFrom::Header(name) if client_ip.peer_is_trusted(request) => request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        TierFrom::Extension => request.extensions().get::<Tier>().map(|t| t.0.clone()),
        _ => None,
    }
}

/// The key of `rule` for `request`.
pub(crate) fn rule_key<B>(
    rule: &Rule,
    request: &Request<B>,
    client_ip: &ClientIp,
) -> Result<String, KeyError> {
    let mut parts = Vec::with_capacity(rule.key().len());
    for part in rule.key() {
        let value = match part {
            KeyPart::Ip => key::peer_ip().extract(request)?,
            KeyPart::ClientIp => client_ip.extract(request)?,
            KeyPart::Header(name) => key::Header::from_name(name.clone()).extract(request)?,
            KeyPart::Global => Some("global".to_owned()),
            KeyPart::Path => Some(request.uri().path().to_owned()),
        };
        // A request without the header counts with every other request
        // without it, under a key no header value gives (the header
        // part encodes any value starting with `hex:` in hex).
        parts.push(value.unwrap_or_else(|| MISSING.to_owned()));
    }
    Ok(key::joined(&parts))
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RuleLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = RulesFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let grpc = denial::is_grpc(request.headers());
        let active = self.shared.rules.current();
        let tier = self.shared.tier(&request, active.set().tier());
        let check = active.check(
            request.method(),
            request.uri().path(),
            tier.as_deref(),
            |rule| self.shared.call(rule, &request),
        );
        let state = match check {
            Ok(check) => {
                let clone = self.inner.clone();
                State::Checking {
                    check,
                    pending: Some((std::mem::replace(&mut self.inner, clone), request)),
                }
            }
            Err(error) => {
                tracing::error!(%error, "rules: cannot pick a rule's key; answering 500");
                State::Answered {
                    response: Some(denial::cannot_pick_key(&error, grpc)),
                }
            }
        };
        RulesFuture {
            state,
            shared: Arc::clone(&self.shared),
            grpc,
        }
    }
}

pin_project! {
    /// The future of [`RuleLimit`].
    pub struct RulesFuture<S: Service<Request<ReqBody>>, ReqBody> {
        #[pin]
        state: State<S, ReqBody>,
        shared: Arc<Settings>,
        grpc: bool,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<Request<ReqBody>>, ReqBody> {
        Checking {
            #[pin]
            check: RulesCheck,
            pending: Option<(S, Request<ReqBody>)>,
        },
        Calling {
            #[pin]
            future: S::Future,
            admission: Option<Admission>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S: Service<Request<ReqBody>>, ReqBody> fmt::Debug for RulesFuture<S, ReqBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RulesFuture")
    }
}

impl<S, ReqBody, ResBody> Future for RulesFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { check, pending } => {
                    let admission = ready!(check.poll(cx));
                    let next = checked(admission, pending, this.shared, *this.grpc);
                    this.state.set(next);
                }
                StateProj::Calling { future, admission } => {
                    let result = ready!(future.poll(cx));
                    let admission = admission.take().unwrap_or_default();
                    // Polled again, the future answers 503 rather than
                    // polling the finished inner future.
                    this.state.set(State::Answered { response: None });
                    return Poll::Ready(match result {
                        Ok(response) => Ok(admitted_response(this.shared, admission, response)),
                        Err(error) => {
                            drop(admission.settle(None));
                            Err(error)
                        }
                    });
                }
                StateProj::Answered { response } => {
                    let response = response.take().unwrap_or_else(denial::store_unavailable);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

/// The state after the rules' check: the inner service called with the
/// request `pending` when admitted, else the answer.
#[inline]
fn checked<S, ReqBody>(
    admission: Result<Admission, LimitError>,
    pending: &mut Option<(S, Request<ReqBody>)>,
    shared: &Settings,
    grpc: bool,
) -> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    match admission {
        Ok(admission) if admission.allowed() => match pending.take() {
            Some((mut service, request)) => State::Calling {
                future: service.call(request),
                admission: Some(admission),
            },
            None => State::Answered {
                response: Some(denial::store_unavailable()),
            },
        },
        Ok(admission) => State::Answered {
            response: Some(shared.render(&admission, grpc)),
        },
        Err(error) => {
            if !matches!(error, LimitError::Store(_)) {
                tracing::error!(%error, "rules: a check failed");
            }
            State::Answered {
                response: Some(denial::unavailable(grpc)),
            }
        }
    }
}

/// The inner service's response to an admitted request: the rate-limit
/// fields of `admission` added, its cost settled now when the response
/// gives it (else when its body ends), its leases held by the body.
#[inline]
fn admitted_response<B>(
    shared: &Settings,
    admission: Admission,
    mut response: Response<B>,
) -> Response<ResponseBody<B>> {
    let status = response.status().as_u16();
    let mut headers = HeaderMap::new();
    shared.set_headers(&mut headers, &admission);
    let (permits, settling) = admission.conclude(Some(status));
    let meters = shared.settle(settling, &mut response);
    let (mut parts, body) = response.into_parts();
    for (name, value) in headers {
        if let Some(name) = name {
            parts.headers.insert(name, value);
        }
    }
    Response::from_parts(parts, ResponseBody::metered(body, permits, meters))
}
