//! Answers in OpenAI's error format: `{"error": {"message", "type",
//! "param", "code"}}`, so that OpenAI's SDKs raise the error they would
//! raise for OpenAI's own, and retry what waiting cures.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

/// An error answer: `status`, and the error's `message`, `kind` (its
/// `type`) and `code`.
pub(crate) fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<Bytes> {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    });
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A request over a rate: `429 rate_limit_exceeded`, with how long to wait
/// in `retry-after` (whole seconds, rounded up) and `retry-after-ms`,
/// which OpenAI's SDKs wait before retrying.
pub(crate) fn over_rate(what: &str, limit: &str, wait: Duration) -> Response<Bytes> {
    let whole =
        |unit: u128| u64::try_from(wait.as_nanos().div_ceil(unit).max(1)).unwrap_or(u64::MAX);
    let (seconds, millis) = (whole(1_000_000_000), whole(1_000_000));
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        &format!(
            "Rate limit reached for {what} ({limit}). Please try again in {}.",
            super::headers::duration(wait)
        ),
        what,
        Some("rate_limit_exceeded"),
    );
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    headers.insert("retry-after-ms", HeaderValue::from(millis));
    response
}

/// A request over a spent budget: `429 insufficient_quota`, which waiting
/// a moment does not cure: `x-should-retry: false` tells OpenAI's SDKs not
/// to retry (they retry every other 429). `resets` says when the budget
/// does.
pub(crate) fn over_budget(limit: &str, resets: Duration) -> Response<Bytes> {
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        &format!(
            "You exceeded your current quota ({limit}); it renews in {}.",
            super::headers::duration(resets)
        ),
        "insufficient_quota",
        Some("insufficient_quota"),
    );
    response
        .headers_mut()
        .insert("x-should-retry", HeaderValue::from_static("false"));
    response
}

/// The answer to a request `admission` refused (or that the store could
/// not decide), in OpenAI's format, with its rate-limit fields.
pub(crate) fn refusal(
    admission: &crate::rules::Admission,
    active: &crate::rules::ActiveRules,
) -> Response<Bytes> {
    use crate::rules::Unit;
    if let Some(rule) = admission.forbidden_by() {
        tracing::debug!(rule, "ai: key not on the rule's `only` list; answering 403");
        return error(
            StatusCode::FORBIDDEN,
            "This key may not call this endpoint.",
            "invalid_request_error",
            Some("permission_denied"),
        );
    }
    let Some((rule, _, decision, _)) = admission.shown() else {
        return unavailable();
    };
    let unit = unit_of(active, rule);
    let rate = decision.rate();
    let mut response = if unit == Unit::Money || super::headers::is_budget(&rate) {
        let limit = match (unit, active.set().catalog()) {
            (Unit::Money, Some(catalog)) => {
                format!("{}/{}", catalog.amount(rate.max()), window_of(&rate))
            }
            _ => format!("{} {unit}/{}", rate.max(), window_of(&rate)),
        };
        over_budget(&limit, decision.reset())
    } else {
        let what = if unit == Unit::Tokens {
            "tokens"
        } else {
            "requests"
        };
        over_rate(
            what,
            &format!("{} {what}/{}", rate.max(), window_of(&rate)),
            decision.retry_after(),
        )
    };
    super::headers::set(response.headers_mut(), decisions(admission, active));
    response
}

/// The store could not decide (under a closed fail mode): `503`.
pub(crate) fn unavailable() -> Response<Bytes> {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "The rate limiter cannot reach its store.",
        "server_error",
        Some("service_unavailable"),
    )
}

/// Each checked rule's unit and decision.
pub(crate) fn decisions<'a>(
    admission: &'a crate::rules::Admission,
    active: &'a crate::rules::ActiveRules,
) -> impl Iterator<Item = (crate::rules::Unit, &'a crate::decision::Decision)> {
    admission
        .decisions()
        .filter_map(move |(rule, decision)| Some((unit_of(active, rule), decision?)))
}

fn unit_of(active: &crate::rules::ActiveRules, rule: &str) -> crate::rules::Unit {
    active
        .rule(rule)
        .map(crate::rules::Rule::unit)
        .unwrap_or_default()
}

/// A rate's window as its policy wrote it (`month`, `60s`).
fn window_of(rate: &crate::policy::Rate) -> String {
    let text = rate.to_string();
    text.split_once('/')
        .map_or(text.clone(), |(_, w)| w.to_owned())
}
