//! Errors of the admin routes as `application/problem+json` (RFC 9457).

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

/// An error answer: its status, what was wrong, and the rule and field it
/// concerns when there is one.
#[derive(Debug)]
pub(crate) struct Problem {
    status: StatusCode,
    detail: String,
    extra: Map<String, Value>,
}

impl Problem {
    pub(crate) fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            status,
            detail: detail.into(),
            extra: Map::new(),
        }
    }

    /// 400: the request cannot be read.
    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, detail)
    }

    /// 422: read, but a value is out of bounds.
    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, detail)
    }

    /// Name a member of the problem (`rule`, `field`, ...).
    pub(crate) fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(name.to_owned(), value.into());
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = json!({
            "type": "about:blank",
            "title": self.status.canonical_reason().unwrap_or("error"),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Value::Object(members) = &mut body {
            members.extend(self.extra);
        }
        let mut response = (self.status, body.to_string()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

/// Any path the router does not serve.
pub(crate) async fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "no such admin route")
}

/// Read a JSON body into `T`, or say what is wrong with it.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    serde_json::from_slice(body).map_err(|error| {
        Problem::bad_request(format!("the body is not the JSON expected: {error}"))
    })
}
