//! The responses the layer answers itself: a denial (429, problem+json,
//! gRPC `RESOURCE_EXHAUSTED`), a failed store (503, `UNAVAILABLE`), a key
//! that cannot be picked, a forbidden key.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use super::fields::{denies, format_bytes, number, policy_name, retry_after_secs, set_headers};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy};

/// The `type` of the problem+json denial: the "Quota Exceeded" problem type
/// of draft-ietf-httpapi-ratelimit-headers (section 5.1 from -09 on; the
/// registration of section 10.2.1 of -11 gives its title and status).
pub(crate) const PROBLEM_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The title the draft registers for [`PROBLEM_TYPE`].
const PROBLEM_TITLE: &str = "Quota Exceeded";

fn text(status: StatusCode, body: Bytes) -> Response<Bytes> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    // Room for the content type, the rate-limit fields and `Retry-After`
    // (an empty map would grow twice).
    response.headers_mut().reserve(8);
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// What the client ran into, for the text of a denial: `the limit is 3/s`,
/// `at most 10 requests may be in flight`, `this client is blocked`.
fn limit_phrase(decision: &Decision) -> String {
    if decision.blocked() {
        return "this client is blocked".to_owned();
    }
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
    let rate = decision.rate();
    // Formatted on the stack and copied once: one allocation.
    let body = match (decision.algorithm(), rate.max()) {
        _ if decision.blocked() => format_bytes(format_args!(
            "Too many requests: {}. Retry in {secs} s.\n",
            limit_phrase(decision)
        )),
        (Algorithm::Concurrency, _) => format_bytes(format_args!(
            "Too many requests: {}. Retry in {secs} s.\n",
            limit_phrase(decision)
        )),
        _ => format_bytes(format_args!(
            "Too many requests: the limit is {rate}. Retry in {secs} s.\n"
        )),
    };
    let mut response = text(StatusCode::TOO_MANY_REQUESTS, body);
    set_headers(response.headers_mut(), decision);
    response.headers_mut().insert(RETRY_AFTER, number(secs));
    response
}

/// `429 Too Many Requests` as an RFC 9457 `application/problem+json` document
/// of the "Quota Exceeded" problem type of draft-ietf-httpapi-ratelimit-headers
/// (section 5.1), with `Retry-After` and the rate-limit headers:
///
/// ```json
/// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
///  "title":"Quota Exceeded","status":429,
///  "detail":"Too many requests: the limit is 3/s. Retry in 1 s.",
///  "violated-policies":["3/s"],"retry_after":1}
/// ```
///
/// `violated-policies` (the draft's member) names the rates that deny the
/// request, as `RateLimit-Policy` names them (after `policy`, the layer's
/// policy); it is empty when only the policy's minimum spacing does.
/// `retry_after` (seconds, as `Retry-After`) is this crate's own member.
pub(crate) fn problem_json(decision: &Decision, policy: &Policy) -> Response<Bytes> {
    let secs = retry_after_secs(decision);
    let violated: Vec<String> = decision
        .rates()
        .iter()
        .filter(|status| denies(decision, status))
        .map(|status| policy_name(policy, decision.algorithm(), status.rate()))
        .collect();
    let phrase = match policy.min_spacing() {
        Some(spacing) if violated.is_empty() => {
            format!("requests must be at least {spacing:?} apart")
        }
        _ => limit_phrase(decision),
    };
    let body = serde_json::json!({
        "type": PROBLEM_TYPE,
        "title": PROBLEM_TITLE,
        "status": StatusCode::TOO_MANY_REQUESTS.as_u16(),
        "detail": format!("Too many requests: {phrase}. Retry in {secs} s."),
        // The draft's member: the policies whose quota was exceeded.
        "violated-policies": violated,
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
    headers.insert(RETRY_AFTER, number(secs));
    response
}

/// Whether `headers` are those of a gRPC request (`content-type:
/// application/grpc`, `application/grpc+proto`, ...).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// gRPC status codes the layer answers with.
pub(crate) mod grpc_status {
    /// The call was rate limited.
    pub(crate) const RESOURCE_EXHAUSTED: u16 = 8;
    /// The limiter's store is unavailable (fail mode closed).
    pub(crate) const UNAVAILABLE: u16 = 14;
    /// The limiter is misconfigured.
    pub(crate) const INTERNAL: u16 = 13;
    /// A rule lets only some keys call, and not this one.
    pub(crate) const PERMISSION_DENIED: u16 = 7;
}

/// A trailers-only gRPC response: HTTP 200, `content-type:
/// application/grpc`, `grpc-status` and `grpc-message` in the headers, and
/// no body, so the client reads it as the call's status.
pub(crate) fn grpc(status: u16, message: &str) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(status));
    // grpc-message is percent-encoded outside printable ASCII; ours is ASCII
    // text, with '%' the only character to escape.
    let message = message.replace('%', "%25");
    if let Ok(value) = HeaderValue::from_str(message.trim()) {
        headers.insert("grpc-message", value);
    }
    response
}

/// A denied gRPC call: `RESOURCE_EXHAUSTED`, with the rate-limit values and
/// the retry time (`retry-after`, seconds) as metadata.
pub(crate) fn grpc_too_many_requests(decision: &Decision) -> Response<Bytes> {
    let secs = retry_after_secs(decision);
    let message = match decision.algorithm() {
        _ if decision.blocked() => {
            format!("rate limited: this client is blocked; retry in {secs} s")
        }
        Algorithm::Concurrency => format!(
            "rate limited: at most {} calls may be in flight; retry in {secs} s",
            decision.limit()
        ),
        _ => format!(
            "rate limited: the limit is {}; retry in {secs} s",
            decision.rate()
        ),
    };
    let mut response = grpc(grpc_status::RESOURCE_EXHAUSTED, &message);
    set_headers(response.headers_mut(), decision);
    response.headers_mut().insert(RETRY_AFTER, number(secs));
    response
}

/// `503 Service Unavailable`: the store failed and the fail mode is closed.
pub(crate) fn store_unavailable() -> Response<Bytes> {
    text(
        StatusCode::SERVICE_UNAVAILABLE,
        Bytes::from_static(b"Service unavailable: the rate limiter cannot reach its store.\n"),
    )
}

/// The store failed under a closed fail mode: 503, or gRPC `UNAVAILABLE`.
pub(crate) fn unavailable(grpc: bool) -> Response<Bytes> {
    if grpc {
        return self::grpc(
            grpc_status::UNAVAILABLE,
            "rate limiter unavailable: its store does not answer",
        );
    }
    store_unavailable()
}

/// A key cannot be picked here: 500, or gRPC `INTERNAL`.
pub(crate) fn cannot_pick_key(error: &crate::key::KeyError, grpc: bool) -> Response<Bytes> {
    if grpc {
        return self::grpc(
            grpc_status::INTERNAL,
            &format!("rate limiter misconfigured: {error}"),
        );
    }
    misconfigured(error)
}

/// `403 Forbidden`: a rule lets only some keys call, and not this one.
pub(crate) fn forbidden() -> Response<Bytes> {
    text(
        StatusCode::FORBIDDEN,
        Bytes::from_static(b"Forbidden: this caller may not call this resource.\n"),
    )
}

/// `500 Internal Server Error`: the key extractor cannot work here.
pub(crate) fn misconfigured(error: &crate::key::KeyError) -> Response<Bytes> {
    text(
        StatusCode::INTERNAL_SERVER_ERROR,
        Bytes::from(format!("Rate limiter misconfigured: {error}\n")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::fields::set_ietf_headers;
    use std::time::Duration;

    use crate::decision::DecisionBuilder;

    use crate::http::fields::tests::{decision, header, ietf, ms, status, two_rates_deny};
    use crate::http::fields::{
        RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
    };
    #[test]
    fn grpc_denials_are_trailers_only_resource_exhausted() {
        let (_, d) = two_rates_deny();
        let response = grpc_too_many_requests(&d);
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.body().is_empty());
        let h = response.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(
            h["grpc-message"],
            "rate limited: the limit is 20/min; retry in 31 s"
        );
        assert_eq!(h["retry-after"], "31");
        assert_eq!(h["x-ratelimit-limit"], "20");
        let mut grpc_request = HeaderMap::new();
        grpc_request.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert!(is_grpc(&grpc_request));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn a_fallback_share_keeps_the_policy_names_with_its_own_quotas() {
        let named: Policy = "8/10s, 40/min".parse().unwrap();
        let enforced = named.shared_by(4);
        let d = decision(
            false,
            Algorithm::SlidingLog,
            &[
                status("2/10s", 0, ms(9_000), ms(4_000)),
                status("10/min", 8, ms(50_000), Duration::ZERO),
            ],
        );
        let mut headers = HeaderMap::new();
        set_ietf_headers(&mut headers, &named, &enforced, &d);
        assert_eq!(
            header(&headers, &RATELIMIT_POLICY),
            r#""8/10s";q=2;w=10, "40/min";q=10;w=60"#
        );
        assert_eq!(
            header(&headers, &RATELIMIT),
            r#""8/10s";r=0;t=4, "40/min";r=8;t=50"#
        );
        let body: serde_json::Value =
            serde_json::from_slice(problem_json(&d, &named).body()).unwrap();
        assert_eq!(body["violated-policies"], serde_json::json!(["8/10s"]));
        // X-RateLimit-Limit is the max of the enforced rate.
        let plain = too_many_requests(&d);
        assert_eq!(header(plain.headers(), &X_RATELIMIT_LIMIT), "2");
    }

    #[test]
    fn a_denying_rate_reports_its_wait_which_retry_after_covers() {
        let (policy, d) = two_rates_deny();
        let (_, ratelimit) = ietf(&policy, &d);
        assert_eq!(
            ratelimit,
            r#""3/s";r=0;t=1, "20/min";r=0;t=31, "100/h";r=50;t=3001"#
        );
        let response = too_many_requests(&d);
        assert_eq!(header(response.headers(), &RETRY_AFTER), "31");
        assert_eq!(retry_after_secs(&d), 31);
    }

    fn body_text(response: &Response<Bytes>) -> &str {
        std::str::from_utf8(response.body()).unwrap()
    }

    #[test]
    fn too_many_requests_names_the_limit() {
        let d = decision(
            false,
            Algorithm::SlidingLog,
            &[status("3/s", 0, ms(900), ms(400))],
        );
        let response = too_many_requests(&d);
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            body_text(&response),
            "Too many requests: the limit is 3/s. Retry in 1 s.\n"
        );
        assert_eq!(header(response.headers(), &RETRY_AFTER), "1");
        assert_eq!(header(response.headers(), &X_RATELIMIT_LIMIT), "3");
    }

    #[test]
    fn a_blocked_key_is_told_it_is_blocked() {
        let policy: Policy = "5/min".parse().unwrap();
        let d = crate::algorithm::blocked(&policy, 900_000_000);
        assert_eq!(
            body_text(&too_many_requests(&d)),
            "Too many requests: this client is blocked. Retry in 900 s.\n"
        );
        let problem = problem_json(&d, &policy);
        let problem = body_text(&problem);
        assert!(problem.contains("this client is blocked"), "{problem}");
    }

    #[test]
    fn too_many_requests_of_a_concurrency_limit_counts_requests_in_flight() {
        let d = decision(
            false,
            Algorithm::Concurrency,
            &[status("10/min", 0, Duration::ZERO, ms(250))],
        );
        assert_eq!(
            body_text(&too_many_requests(&d)),
            "Too many requests: at most 10 requests may be in flight. Retry in 1 s.\n"
        );
        let one = decision(
            false,
            Algorithm::Concurrency,
            &[status("1/30s", 0, Duration::ZERO, ms(1000))],
        );
        assert_eq!(
            body_text(&too_many_requests(&one)),
            "Too many requests: at most 1 request may be in flight. Retry in 1 s.\n"
        );
    }

    #[test]
    fn problem_json_is_an_rfc_9457_document() {
        let (policy, d) = two_rates_deny();
        let response = problem_json(&d, &policy);
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let headers = response.headers();
        assert_eq!(header(headers, &CONTENT_TYPE), "application/problem+json");
        assert_eq!(header(headers, &RETRY_AFTER), "31");
        assert_eq!(header(headers, &X_RATELIMIT_LIMIT), "20");
        assert_eq!(header(headers, &X_RATELIMIT_REMAINING), "0");
        assert_eq!(header(headers, &X_RATELIMIT_RESET), "60");

        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Quota Exceeded",
                "status": 429,
                "detail": "Too many requests: the limit is 20/min. Retry in 31 s.",
                "violated-policies": ["3/s", "20/min"],
                "retry_after": 31,
            })
        );
    }

    #[test]
    fn problem_json_of_a_spacing_denial_names_the_spacing() {
        let policy: Policy = "3/s"
            .parse::<Policy>()
            .unwrap()
            .with_min_spacing(ms(100))
            .unwrap();
        let mut b = DecisionBuilder::new(false);
        b.rate(status("3/s", 2, ms(500), Duration::ZERO));
        b.wait(crate::decision::Micros(70_000));
        let d = b.build().unwrap();
        let response = problem_json(&d, &policy);
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["violated-policies"], serde_json::json!([]));
        assert_eq!(body["retry_after"], 1);
        assert_eq!(
            body["detail"],
            "Too many requests: requests must be at least 100ms apart. Retry in 1 s."
        );
        assert_eq!(header(response.headers(), &RETRY_AFTER), "1");
    }

    #[test]
    fn problem_json_of_a_concurrency_limit() {
        let policy = Policy::concurrency(2).unwrap();
        let d = decision(
            false,
            Algorithm::Concurrency,
            &[status("2/min", 0, Duration::ZERO, ms(1000))],
        );
        let body: serde_json::Value =
            serde_json::from_slice(problem_json(&d, &policy).body()).unwrap();
        assert_eq!(
            body["violated-policies"],
            serde_json::json!(["concurrency"])
        );
        assert_eq!(
            body["detail"],
            "Too many requests: at most 2 requests may be in flight. Retry in 1 s."
        );
    }
}
