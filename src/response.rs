//! What the layer writes: the rate-limit headers on every response of a
//! limited request, and the responses it answers itself.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use crate::decision::Decision;

/// `X-RateLimit-Limit`: the max of the rate reported.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: requests left in its window.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: whole seconds (rounded up) until its quota is full again.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The value of `Retry-After` for a denial: whole seconds, rounded up, at
/// least 1 — a client that waits that long and retries alone is admitted.
pub(crate) fn retry_after_secs(decision: &Decision) -> u64 {
    ceil_secs(decision.retry_after()).max(1)
}

pub(crate) fn set_headers(headers: &mut HeaderMap, decision: &Decision) {
    headers.insert(
        X_RATELIMIT_LIMIT.clone(),
        HeaderValue::from(decision.limit()),
    );
    headers.insert(
        X_RATELIMIT_REMAINING.clone(),
        HeaderValue::from(decision.remaining()),
    );
    headers.insert(
        X_RATELIMIT_RESET.clone(),
        HeaderValue::from(ceil_secs(decision.reset())),
    );
}

fn text(status: StatusCode, body: String) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// `429 Too Many Requests` with `Retry-After` and the rate-limit headers.
pub(crate) fn too_many_requests(decision: &Decision) -> Response<Bytes> {
    let secs = retry_after_secs(decision);
    let mut response = text(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "Too many requests: the limit is {}. Retry in {secs} s.\n",
            decision.rate()
        ),
    );
    set_headers(response.headers_mut(), decision);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// `503 Service Unavailable`: the store failed and the fail mode is closed.
pub(crate) fn store_unavailable() -> Response<Bytes> {
    text(
        StatusCode::SERVICE_UNAVAILABLE,
        "Service unavailable: the rate limiter cannot reach its store.\n".to_owned(),
    )
}

/// `500 Internal Server Error`: the key extractor cannot work here.
pub(crate) fn misconfigured(error: &crate::key::KeyError) -> Response<Bytes> {
    text(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("Rate limiter misconfigured: {error}\n"),
    )
}
