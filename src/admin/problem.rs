//! Errors of the admin routes as `application/problem+json` (RFC 9457).

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

/// The content type of every error answer.
const PROBLEM: &str = "application/problem+json";

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
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM));
        response
    }
}

/// Make every error answer a problem: those the routes give already are;
/// the others (an unknown method's 405, a body over the limit's 413, a
/// rejection of axum's) become one, with their headers (`Allow`) kept.
pub(crate) async fn every_error(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let response = next.run(request).await;
    let status = response.status();
    let problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t == PROBLEM);
    if !(status.is_client_error() || status.is_server_error()) || problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let detail = match status {
        // axum adds `Allow` after this, around each route.
        StatusCode::METHOD_NOT_ALLOWED => {
            format!("this route does not answer {method}: `Allow` lists those it answers")
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            format!("the body is larger than {} bytes", super::MAX_BODY)
        }
        // What axum said, when it said something short.
        _ => match axum::body::to_bytes(body, 1024).await {
            Ok(said) if !said.is_empty() => String::from_utf8_lossy(&said).into_owned(),
            _ => status
                .canonical_reason()
                .unwrap_or("error")
                .to_ascii_lowercase(),
        },
    };
    let mut answer = Problem::new(status, detail).into_response();
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    for (name, value) in &parts.headers {
        answer.headers_mut().append(name, value.clone());
    }
    answer
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
