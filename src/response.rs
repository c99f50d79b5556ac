//! What the layer writes: the rate-limit headers on every response of a
//! limited request, and the responses it answers itself.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use sfv::{Integer, KeyRef, ListSerializer, StringRef, key_ref, string_ref};

use crate::decision::{Decision, RateStatus};
use crate::policy::{Algorithm, Policy, Rate};

/// `X-RateLimit-Limit`: the max of the rate reported.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: requests left in its window.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: whole seconds (rounded up) until its quota is full again.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-11): one quota
/// policy per rate, named after the rate: `"3/s";q=3;w=1, "20/min";q=20;w=60`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11): the state of every
/// rate for this request, `r` requests remaining and `t` seconds (rounded up)
/// until the rate resets or, for a rate that denied the request, until it
/// admits it again: `"3/s";r=2;t=1, "20/min";r=19;t=60`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// `RateLimit-Policy` parameters: the quota, its unit and its window.
const Q: &KeyRef = key_ref("q");
const QU: &KeyRef = key_ref("qu");
const W: &KeyRef = key_ref("w");
/// `RateLimit` parameters: remaining quota, seconds until reset.
const R: &KeyRef = key_ref("r");
const T: &KeyRef = key_ref("t");
/// The quota unit of a concurrency limit (the draft's default unit,
/// `requests`, is left implicit).
const CONCURRENT_REQUESTS: &StringRef = string_ref("concurrent-requests");

/// The `type` of the problem+json denial. RFC 9457 allows `about:blank`, but a
/// URI of its own lets a client tell this 429 from any other; it points at
/// the crate docs, whose "Rate limited" section explains the denial.
pub(crate) const PROBLEM_TYPE: &str =
    "https://docs.rs/tower-redis-ratelimit/latest/tower_redis_ratelimit/#rate-limited";

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

/// A structured-field Integer; values beyond its range (15 digits, above
/// any window or count this crate reports in practice) are capped.
fn sf_integer(n: u64) -> Integer {
    Integer::try_from(n).unwrap_or(Integer::MAX)
}

/// The name of a rate in the IETF fields and in `violated_policies`: its
/// text form, `"3/s"`, `"20/min"` (unique within a policy: windows are).
fn rate_name(rate: Rate) -> String {
    rate.to_string()
}

/// Whether this rate is one that keeps the request out.
fn denies(decision: &Decision, status: &RateStatus) -> bool {
    !decision.allowed() && !status.wait().is_zero()
}

/// `t` of one rate: for a rate that denies the request, the seconds until it
/// admits it (rounded up, so never later than `Retry-After`); otherwise the
/// seconds until its quota is full again.
fn ietf_reset_secs(decision: &Decision, status: &RateStatus) -> u64 {
    if denies(decision, status) {
        ceil_secs(status.wait())
    } else {
        ceil_secs(status.reset())
    }
}

/// The value of `RateLimit-Policy`; `None` only for a policy without rates or
/// a name that is not a structured-field String (neither can happen).
fn ratelimit_policy_value(policy: &Policy, algorithm: Algorithm) -> Option<String> {
    let mut list = ListSerializer::new();
    for &rate in policy.rates() {
        let name = rate_name(rate);
        let item = list
            .bare_item(StringRef::from_str(&name).ok()?)
            .parameter(Q, sf_integer(rate.max()));
        if algorithm == Algorithm::Concurrency {
            // A concurrency limit has no window: the rate's window is the
            // lease of a crashed process's slot, not a quota period.
            let _ = item.parameter(QU, CONCURRENT_REQUESTS);
        } else {
            let _ = item.parameter(W, sf_integer(ceil_secs(rate.window()).max(1)));
        }
    }
    list.finish()
}

/// The value of `RateLimit`; `None` as for [`ratelimit_policy_value`].
fn ratelimit_value(decision: &Decision) -> Option<String> {
    let mut list = ListSerializer::new();
    for status in decision.rates() {
        let name = rate_name(status.rate());
        let item = list
            .bare_item(StringRef::from_str(&name).ok()?)
            .parameter(R, sf_integer(status.remaining()));
        if decision.algorithm() != Algorithm::Concurrency {
            let _ = item.parameter(T, sf_integer(ietf_reset_secs(decision, status)));
        }
    }
    list.finish()
}

/// Set `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11)
/// for `decision`, taken under `policy`: one list member per rate, in the
/// policy's order, serialised as RFC 9651 structured fields.
// Wired into the layer by the next change.
#[allow(dead_code)]
pub(crate) fn set_ietf_headers(headers: &mut HeaderMap, policy: &Policy, decision: &Decision) {
    let fields = [
        (
            &RATELIMIT_POLICY,
            ratelimit_policy_value(policy, decision.algorithm()),
        ),
        (&RATELIMIT, ratelimit_value(decision)),
    ];
    for (name, value) in fields {
        if let Some(value) = value.and_then(|v| HeaderValue::try_from(v).ok()) {
            headers.insert(name.clone(), value);
        }
    }
}

/// What the client ran into, for the text of a denial: `the limit is 3/s`,
/// `at most 10 requests may be in flight`.
fn limit_phrase(decision: &Decision) -> String {
    let rate = decision.rate();
    match (decision.algorithm(), rate.max()) {
        (Algorithm::Concurrency, 1) => "at most 1 request may be in flight".to_owned(),
        (Algorithm::Concurrency, max) => format!("at most {max} requests may be in flight"),
        _ => format!("the limit is {rate}"),
    }
}

/// `429 Too Many Requests` with `Retry-After` and the rate-limit headers.
pub(crate) fn too_many_requests(decision: &Decision) -> Response<Bytes> {
    let secs = retry_after_secs(decision);
    let mut response = text(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "Too many requests: {}. Retry in {secs} s.\n",
            limit_phrase(decision)
        ),
    );
    set_headers(response.headers_mut(), decision);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// `429 Too Many Requests` as an RFC 9457 `application/problem+json` document,
/// with `Retry-After` and the rate-limit headers:
///
/// ```json
/// {"type":"https://docs.rs/tower-redis-ratelimit/latest/tower_redis_ratelimit/#rate-limited",
///  "title":"Too Many Requests","status":429,
///  "detail":"Too many requests: the limit is 3/s. Retry in 1 s.",
///  "violated_policies":["3/s"],"retry_after":1}
/// ```
///
/// `violated_policies` names the rates that deny the request, as in
/// `RateLimit-Policy`; it is empty when only the policy's minimum spacing does.
// Wired into the layer by the next change.
#[allow(dead_code)]
pub(crate) fn problem_json(decision: &Decision, policy: &Policy) -> Response<Bytes> {
    let secs = retry_after_secs(decision);
    let violated: Vec<String> = decision
        .rates()
        .iter()
        .filter(|status| denies(decision, status))
        .map(|status| rate_name(status.rate()))
        .collect();
    let phrase = match policy.min_spacing() {
        Some(spacing) if violated.is_empty() => {
            format!("requests must be at least {spacing:?} apart")
        }
        _ => limit_phrase(decision),
    };
    let body = serde_json::json!({
        "type": PROBLEM_TYPE,
        "title": "Too Many Requests",
        "status": StatusCode::TOO_MANY_REQUESTS.as_u16(),
        "detail": format!("Too many requests: {phrase}. Retry in {secs} s."),
        "violated_policies": violated,
        "retry_after": secs,
    });
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    set_headers(headers, decision);
    headers.insert(RETRY_AFTER, HeaderValue::from(secs));
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
