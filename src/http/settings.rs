//! How a layer renders the engine's verdicts: [`Rejection`],
//! [`HeaderStyle`], and the settings every request of a layer shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use super::settlement::Settlement;
use crate::decision::Decision;
use crate::limiter::{DecidedBy, Limiter};
use crate::policy::Policy;

/// The estimate of a request's cost, from its parts
/// ([`RateLimitLayer::with_estimate`](crate::RateLimitLayer::with_estimate)).
pub(crate) type EstimateFn = dyn Fn(&http::request::Parts) -> Option<u64> + Send + Sync;

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
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};
    /// use tower_redis_ratelimit::response::Rejection;
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

/// How a layer renders verdicts: its HTTP settings, apart from any limiter
/// (a [`RulesLayer`](crate::rules::RulesLayer) renders the verdicts of the
/// limiter of whichever rule decided, with one `Rendering`).
#[derive(Clone, Default)]
pub(crate) struct Rendering {
    pub(crate) rejection: Rejection,
    pub(crate) headers: HeaderStyle,
    pub(crate) problem_json: bool,
}

/// What every request of one layer shares, whatever its key extractor: the
/// engine, and how its verdicts are rendered.
#[derive(Clone)]
pub(crate) struct Shared {
    /// The engine as configured (what [`RateLimitLayer::limiter`](crate::RateLimitLayer::limiter) gives).
    pub(crate) limiter: Limiter,
    /// The engine that decides requests: `limiter`, without the deny cache
    /// when denials are not answered at once (a delayed or shadowed denial
    /// is not final for the request) or costs are settled.
    pub(crate) deciding: Limiter,
    pub(crate) rendering: Rendering,
    /// Where the real cost comes from after the response (`None`: the
    /// cost counted is final).
    pub(crate) settlement: Option<Arc<Settlement>>,
    /// The estimate of a request's cost (`None`: the policy's cost).
    pub(crate) estimate: Option<Arc<EstimateFn>>,
}

impl Shared {
    pub(crate) fn new(limiter: Limiter) -> Self {
        Self {
            deciding: limiter.clone(),
            limiter,
            rendering: Rendering::default(),
            settlement: None,
            estimate: None,
        }
    }

    /// The policy counting `request`'s estimate, when its cost is settled
    /// after the response (`None`: it is not; the request is checked at
    /// the policy's cost).
    pub(crate) fn estimated<B>(
        &self,
        request: http::Request<B>,
    ) -> (http::Request<B>, Option<Arc<Policy>>) {
        if self.settlement.is_none() {
            return (request, None);
        }
        let (request, cost) = match &self.estimate {
            Some(estimate) => {
                let (parts, body) = request.into_parts();
                let cost = estimate(&parts);
                (http::Request::from_parts(parts, body), cost)
            }
            None => (request, None),
        };
        (request, self.policy_of(cost))
    }

    /// The policy counting an estimate of `cost` (`None`: the policy's).
    fn policy_of(&self, cost: Option<u64>) -> Option<Arc<Policy>> {
        let cost = cost.unwrap_or_else(|| self.limiter.policy().cost());
        match self.deciding.estimated(cost) {
            Ok(policy) => Some(policy),
            Err(error) => {
                tracing::debug!(%error, "rate limit: an estimate the policy cannot count; checking at its cost");
                self.deciding.estimated(self.limiter.policy().cost()).ok()
            }
        }
    }

    /// Make `deciding` follow `limiter` and the rejection again. (A layer
    /// settling costs gives units back after responses: a denial held in
    /// process could refuse what the store admits after another process's
    /// settlement, so it decides without the deny cache.)
    pub(crate) fn follow_limiter(&mut self) {
        self.deciding = if self.rendering.answers_at_once() && self.settlement.is_none() {
            self.limiter.clone()
        } else {
            self.limiter.clone().without_deny_cache()
        };
    }

    /// Put the rate-limit fields of `decision`, answered by `decided_by`, on
    /// `headers` ([`Rendering::set_headers`] for this layer's limiter).
    pub(crate) fn set_headers(
        &self,
        headers: &mut impl super::fields::Sink,
        decision: &Decision,
        decided_by: DecidedBy,
    ) {
        self.rendering
            .set_headers(headers, &self.limiter, decision, decided_by);
    }

    /// The response to a denied request ([`Rendering::denial`] for this
    /// layer's limiter).
    pub(crate) fn denial(
        &self,
        decision: &Decision,
        grpc: bool,
        decided_by: DecidedBy,
    ) -> Response<Bytes> {
        self.rendering
            .denial(&self.limiter, decision, grpc, decided_by)
    }
}

impl Rendering {
    /// Whether requests keep their key past the check (to check again after
    /// a delay, or to log a shadowed denial).
    pub(crate) fn keeps_keys(&self) -> bool {
        matches!(self.rejection, Rejection::Delay { .. } | Rejection::Shadow)
    }

    /// Whether denials are answered at once, so the deny cache may answer
    /// them (a delayed or shadowed denial is not final for the request).
    pub(crate) fn answers_at_once(&self) -> bool {
        matches!(self.rejection, Rejection::Reject | Rejection::Custom(_))
    }

    /// Put the rate-limit fields of `decision`, answered by `decided_by` for
    /// `limiter`, on `headers`, in the chosen style. They describe the limit
    /// enforced (the fallback's share during an outage), under the
    /// limiter's policy names.
    pub(crate) fn set_headers(
        &self,
        headers: &mut impl super::fields::Sink,
        limiter: &Limiter,
        decision: &Decision,
        decided_by: DecidedBy,
    ) {
        if matches!(self.headers, HeaderStyle::XRateLimit | HeaderStyle::Both) {
            super::fields::set_headers(headers, decision);
        }
        if matches!(self.headers, HeaderStyle::Ietf | HeaderStyle::Both) {
            super::fields::set_ietf_headers(
                headers,
                limiter.policy(),
                limiter.enforced_policy(decided_by),
                decision,
            );
        }
    }

    /// The response to a request whose `decision` by `limiter`, answered by
    /// `decided_by`, denies (a gRPC call when `grpc`).
    pub(crate) fn denial(
        &self,
        limiter: &Limiter,
        decision: &Decision,
        grpc: bool,
        decided_by: DecidedBy,
    ) -> Response<Bytes> {
        let policy = limiter.policy();
        let mut response = match &self.rejection {
            Rejection::Custom(respond) => {
                let mut response = respond(decision);
                let mut fields = http::HeaderMap::new();
                self.set_headers(&mut fields, limiter, decision, decided_by);
                fields.insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from(super::fields::retry_after_secs(decision)),
                );
                for (name, value) in &fields {
                    if !response.headers().contains_key(name) {
                        response.headers_mut().insert(name.clone(), value.clone());
                    }
                }
                return response;
            }
            _ if grpc => super::denial::grpc_too_many_requests(decision),
            _ if self.problem_json => super::denial::problem_json(decision, policy),
            _ => super::denial::too_many_requests(decision),
        };
        // The builders set the X-RateLimit fields; switch to the chosen style.
        if self.headers == HeaderStyle::Ietf {
            for name in [
                &super::fields::X_RATELIMIT_LIMIT,
                &super::fields::X_RATELIMIT_REMAINING,
                &super::fields::X_RATELIMIT_RESET,
            ] {
                response.headers_mut().remove(name);
            }
        }
        if self.headers != HeaderStyle::XRateLimit {
            super::fields::set_ietf_headers(
                response.headers_mut(),
                policy,
                limiter.enforced_policy(decided_by),
                decision,
            );
        }
        response
    }
}
