//! The upstream: every request passed to `UPSTREAM_URL` with the
//! gateway's own key, and its answer streamed back, cut when the upstream
//! stays silent longer than `UPSTREAM_TIMEOUT`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, Uri, header};
use http_body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Sleep;
use tower_redis_ratelimit::ai::Unanswered;

use crate::keys::HIERARCHY;

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// Where requests go, and how long the upstream may stay silent.
pub(crate) struct Upstream {
    base: String,
    key: Option<HeaderValue>,
    timeout: Duration,
    pub(crate) client: Client<Connector, Body>,
}

impl Upstream {
    /// The upstream at `base` (`http://` or `https://`, no trailing `/`).
    pub(crate) fn new(base: &str, key: Option<&str>, timeout: Duration) -> Result<Self, String> {
        let uri: Uri = base
            .parse()
            .map_err(|e| format!("{base:?} is not a URL: {e}"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(format!("{base:?} is not an http:// or https:// URL"));
        }
        let key = key
            .map(|key| HeaderValue::try_from(format!("Bearer {key}")))
            .transpose()
            .map_err(|_| "is not a valid header value".to_owned())?
            .map(|mut value| {
                value.set_sensitive(true);
                value
            });
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            key,
            timeout,
            client: client(),
        })
    }
}

/// A client of http:// and https:// (rustls, Mozilla's roots) URLs.
pub(crate) fn client() -> Client<Connector, Body> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(https)
}

/// The handler: `request` passed upstream, the answer streamed back.
pub(crate) async fn forward(State(upstream): State<Arc<Upstream>>, request: Request) -> Response {
    let (mut parts, body) = request.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = match format!("{}{path}", upstream.base).parse() {
        Ok(uri) => uri,
        Err(_) => return failed(StatusCode::BAD_REQUEST, "The request's path is not valid."),
    };
    let headers = &mut parts.headers;
    for name in HIERARCHY
        .iter()
        .chain([&header::HOST, &header::CONNECTION, &header::AUTHORIZATION])
    {
        headers.remove(name);
    }
    // Hop-by-hop headers, and those that pick which of the upstream
    // account's organisations or projects pays: the gateway's key decides.
    for name in [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "openai-organization",
        "openai-project",
    ] {
        headers.remove(name);
    }
    if let Some(key) = &upstream.key {
        headers.insert(header::AUTHORIZATION, key.clone());
    }
    let asked = upstream.client.request(Request::from_parts(parts, body));
    match tokio::time::timeout(upstream.timeout, asked).await {
        Ok(Ok(mut response)) => {
            // The upstream's own rate-limit fields would mix with the
            // gateway's (each client sees its budgets, not the account's).
            let upstream_fields: Vec<_> = response
                .headers()
                .keys()
                .filter(|name| name.as_str().starts_with("x-ratelimit-"))
                .cloned()
                .collect();
            for name in upstream_fields {
                response.headers_mut().remove(name);
            }
            response.map(|body| Body::new(Silence::new(body, upstream.timeout)))
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "the upstream cannot be reached");
            failed(StatusCode::BAD_GATEWAY, "The upstream cannot be reached.")
        }
        Err(_) => failed(
            StatusCode::GATEWAY_TIMEOUT,
            "The upstream did not answer in time.",
        ),
    }
}

/// The gateway's own answer when the upstream gave none: what the request
/// cost there is unknown, so the limits charge its estimate
/// ([`Unanswered`]).
fn failed(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"error": {
        "message": message, "type": "server_error", "param": null, "code": null,
    }});
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    response.extensions_mut().insert(Unanswered);
    response
}

/// An upstream body that fails once no frame has come for `timeout`.
struct Silence {
    body: hyper::body::Incoming,
    timeout: Duration,
    sleep: Pin<Box<Sleep>>,
}

impl Silence {
    fn new(body: hyper::body::Incoming, timeout: Duration) -> Self {
        Self {
            body,
            timeout,
            sleep: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl http_body::Body for Silence {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            let deadline = tokio::time::Instant::now() + self.timeout;
            self.sleep.as_mut().reset(deadline);
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err("the upstream stayed silent too long".into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}
