//! [`RateLimitLayer`]: the layer and its builder.

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::service::RateLimit;
use super::settings::{HeaderStyle, Rejection, Shared};
use super::settlement::Settlement;
use crate::limiter::Limiter;
use crate::policy::{Policy, PolicyError};
use crate::store::Store;

/// Rate-limits every request of the wrapped service under the key its
/// extractor picks, against a [`Policy`] kept in a [`Store`].
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};
///
/// let limiter = RateLimitLayer::new(MemoryStore::new(), "3/s, 20/min".parse::<Policy>()?, key::peer_ip());
/// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(limiter);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
pub struct RateLimitLayer<K> {
    shared: Arc<Shared>,
    key: Arc<K>,
}

impl<K> RateLimitLayer<K> {
    /// Limit requests by the key `key` picks, to `policy`, in `store`
    /// (a [`Limiter`] with its defaults; see [`from_limiter`](Self::from_limiter)).
    pub fn new<St: Store>(store: St, policy: Policy, key: K) -> Self {
        Self::from_limiter(Limiter::new(store, policy), key)
    }

    /// Limit requests by the key `key` picks, with `limiter` and its
    /// settings (name, fail mode, circuit breaker, deny cache, allowed keys,
    /// local quota): the layer renders its verdicts. Clones of the limiter
    /// (for operator commands, or to limit work that is not a request) share
    /// its counts, breaker and deny cache.
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
            shared: Arc::new(Shared::new(limiter)),
            key: Arc::new(key),
        }
    }

    /// The engine deciding for this layer: use a clone for operator
    /// commands ([`Limiter::peek`], [`Limiter::block`], ...) on the keys the
    /// layer counts.
    pub fn limiter(&self) -> &Limiter {
        &self.shared.limiter
    }

    /// What to do with denied requests (default [`Rejection::Reject`]).
    #[must_use]
    pub fn with_rejection(self, rejection: Rejection) -> Self {
        self.map(|s| s.rendering.rejection = rejection)
    }

    /// Which rate-limit fields responses carry (default
    /// [`HeaderStyle::XRateLimit`]).
    #[must_use]
    pub fn with_headers(self, style: HeaderStyle) -> Self {
        self.map(|s| s.rendering.headers = style)
    }

    /// Answer denials with an RFC 9457 `application/problem+json` body
    /// instead of plain text: the "Quota Exceeded" problem type of
    /// draft-ietf-httpapi-ratelimit-headers (`type`
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded`,
    /// `title` `Quota Exceeded`, `status` 429), its `violated-policies`
    /// (the rates that deny the request, named as in `RateLimit-Policy`),
    /// a `detail` with the retry time, and `retry_after` in seconds.
    #[must_use]
    pub fn with_problem_json(self) -> Self {
        self.map(|s| s.rendering.problem_json = true)
    }

    /// Admit each request against an estimate of its cost and settle the
    /// real cost after the response, from where `settlement` says (an
    /// LLM's tokens, a metered API's units): the difference is charged
    /// (even past the max: the key then waits until the excess drained)
    /// or given back, atomically in the store, in a task (the response
    /// never waits for it). The estimate is the policy's cost unless
    /// [`with_estimate`](Self::with_estimate) says otherwise. The
    /// [Budgets](crate::guide::budgets) guide says what is decided when.
    ///
    /// ```
    /// use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};
    /// use tower_redis_ratelimit::response::Settlement;
    ///
    /// let tokens = RateLimitLayer::new(
    ///     MemoryStore::new(),
    ///     "100000/min".parse::<Policy>()?.gcra()?.with_cost(2000)?,
    ///     key::header("x-api-key"),
    /// )
    /// .with_settlement(Settlement::new().from_header(http::HeaderName::from_static("x-usage-tokens")))?;
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A concurrency limit: its slot is a request in flight, not a cost;
    /// a cost header that never carries a cost (a hop-by-hop field such as
    /// `connection`, or one framing the body: `content-length`,
    /// `transfer-encoding`).
    pub fn with_settlement(self, settlement: Settlement) -> Result<Self, PolicyError> {
        crate::limiter::settleable(self.policy())?;
        settlement.usable()?;
        Ok(self.map(|s| s.settlement = Some(Arc::new(settlement))))
    }

    /// The estimate of a request's cost, from its parts (`None`: the
    /// policy's cost), for a layer that [settles](Self::with_settlement)
    /// the real cost after the response. An estimate above the largest
    /// cost the policy counts ([`Policy::max_cost`]) is lowered to it (the
    /// settlement charges the rest).
    #[must_use]
    pub fn with_estimate(
        self,
        estimate: impl Fn(&http::request::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.map(|s| s.estimate = Some(Arc::new(estimate)))
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
        shared.follow_limiter();
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
            .field("rejection", &self.shared.rendering.rejection)
            .field("headers", &self.shared.rendering.headers)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_parts(inner, Arc::clone(&self.shared), Arc::clone(&self.key))
    }
}
