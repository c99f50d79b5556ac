//! [`OpenAi`]: the service of an [`OpenAiLayer`](super::OpenAiLayer).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::BytesMut;
use http::{Method, Request, Response};
use tower_service::Service;

use super::body::{RequestBody, ResponseBody};
use super::future::ResponseFuture;
use super::layer::Settings;
use super::request::Endpoint;

/// Limits an OpenAI-compatible service: see [`OpenAiLayer`](super::OpenAiLayer).
#[derive(Clone)]
pub struct OpenAi<S> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Settings>,
}

impl<S> OpenAi<S> {
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

impl<S: fmt::Debug> fmt::Debug for OpenAi<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAi")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for OpenAi<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone,
    ReqBody: http_body::Body<Data = bytes::Bytes>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let endpoint = (request.method() == Method::POST)
            .then(|| Endpoint::of(request.uri().path()))
            .flatten();
        let Some(endpoint) = endpoint else {
            return ResponseFuture::passing(inner.call(request.map(RequestBody::untouched)));
        };
        let (parts, body) = request.into_parts();
        ResponseFuture::reading(
            body,
            parts,
            inner,
            endpoint,
            BytesMut::new(),
            Arc::clone(&self.shared),
        )
    }
}
