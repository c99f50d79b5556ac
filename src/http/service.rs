//! [`RateLimit`]: the tower service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::denial;
use super::future::ResponseFuture;
use super::settings::Shared;
use crate::key::KeyExtractor;
use crate::metrics::{Decider, Outcome};
use crate::policy::Policy;
use crate::store::Store;

/// Rate-limits the requests of `S`; built by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// An admitted request goes to `S` with its [`Decision`](crate::Decision)
/// as a request extension, and its response carries the rate-limit headers.
/// A denied one is answered `429 Too Many Requests` without reaching `S`.
pub struct RateLimit<S, K> {
    inner: S,
    shared: Arc<Shared>,
    key: Arc<K>,
}

impl<S, K> RateLimit<S, K> {
    /// Wrap `inner` (the same as `RateLimitLayer::new(store, policy, key).layer(inner)`).
    pub fn new<St: Store>(inner: S, store: St, policy: Policy, key: K) -> Self {
        Self::from_parts(
            inner,
            Arc::new(Shared::new(crate::limiter::Limiter::new(store, policy))),
            Arc::new(key),
        )
    }

    pub(crate) fn from_parts(inner: S, shared: Arc<Shared>, key: Arc<K>) -> Self {
        Self { inner, shared, key }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K> Clone for RateLimit<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            key: Arc::clone(&self.key),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for RateLimit<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limiter", &self.shared.limiter)
            .finish_non_exhaustive()
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor<ReqBody>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let limiter = &self.shared.limiter;
        match self.key.extract(&request) {
            Ok(Some(key)) if !limiter.is_allowed(&key) => {
                ResponseFuture::start(request, &mut self.inner, &self.shared, key)
            }
            Ok(_) => {
                crate::metrics::decision(limiter.name(), Outcome::Skipped, Decider::None);
                ResponseFuture::unlimited(self.inner.call(request), &self.shared)
            }
            Err(error) => {
                tracing::error!(%error, "rate limiter cannot pick a key; answering 500");
                let grpc = denial::is_grpc(request.headers());
                ResponseFuture::answered(denial::cannot_pick_key(&error, grpc))
            }
        }
    }
}
