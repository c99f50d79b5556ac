//! The bearer token every admin route requires, and the refusal of
//! requests another site's page could make.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use subtle::ConstantTimeEq as _;

use super::{AdminError, MIN_TOKEN_LEN};
use crate::admin::problem::Problem;

/// The admin token: never shown by `Debug`, compared in constant time.
pub(crate) struct Token(String);

impl Token {
    pub(crate) fn new(token: String) -> Result<Self, AdminError> {
        if token.len() < MIN_TOKEN_LEN {
            return Err(AdminError::TokenTooShort { len: token.len() });
        }
        // What a header can carry as is: no space, no control character (a
        // newline from a secret file would make every request a 401).
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(AdminError::TokenNotPrintable);
        }
        Ok(Self(token))
    }

    /// Whether `header` is `Bearer <this token>` (the scheme in any case).
    /// The comparison takes the same time wherever the bytes differ; only
    /// the length of what was sent can be learned.
    fn admits(&self, header: Option<&HeaderValue>) -> bool {
        let Some(header) = header else { return false };
        let header = header.as_bytes();
        let Some((scheme, token)) = header.split_at_checked(7) else {
            return false;
        };
        scheme.eq_ignore_ascii_case(b"bearer ") && bool::from(token.ct_eq(self.0.as_bytes()))
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Answer 401 unless the request bears the token, 403 to a request from
/// another site's page, 415 to a change whose body is not declared JSON;
/// mark every answer as not to be stored or sniffed.
pub(crate) async fn require(
    State(token): State<Arc<Token>>,
    request: Request,
    next: Next,
) -> Response {
    let refused = if !token.admits(request.headers().get(header::AUTHORIZATION)) {
        let mut denied = Problem::new(
            StatusCode::UNAUTHORIZED,
            "this needs the header `Authorization: Bearer <admin token>`",
        )
        .into_response();
        denied.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"ratelimit-admin\""),
        );
        Some(denied)
    } else {
        cross_site(request.method(), request.headers()).map(IntoResponse::into_response)
    };
    let mut response = match refused {
        Some(refused) => refused,
        None => next.run(request).await,
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// Why a request that bears the token is still refused: a browser that
/// adds the token to every request to the admin address (as the console
/// needs) would add it to another site's requests too. Such a request says
/// where it comes from (`Sec-Fetch-Site`, `Origin`); and a change must
/// declare a JSON body, which a page of another origin cannot send without
/// a CORS preflight, which this router never answers.
fn cross_site(method: &Method, headers: &HeaderMap) -> Option<Problem> {
    let from_elsewhere = || {
        Problem::new(
            StatusCode::FORBIDDEN,
            "a request from another site's page is refused",
        )
    };
    if let Some(site) = headers.get("sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        return Some(from_elsewhere());
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).map(HeaderValue::as_bytes);
        let origin_host = origin
            .as_bytes()
            .strip_prefix(b"http://")
            .or_else(|| origin.as_bytes().strip_prefix(b"https://"));
        if host.is_none() || origin_host != host {
            return Some(from_elsewhere());
        }
    }
    let changes = !matches!(*method, Method::GET | Method::HEAD);
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
    if changes && !json {
        return Some(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a change needs `Content-Type: application/json` (with or without a body)",
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_token_itself_is_admitted() {
        let token = Token::new("0123456789abcdef".to_owned()).unwrap();
        let admits = |v: &str| token.admits(Some(&HeaderValue::from_str(v).unwrap()));
        assert!(admits("Bearer 0123456789abcdef"));
        assert!(admits("bearer 0123456789abcdef"));
        assert!(!admits("Bearer 0123456789abcdeF"));
        assert!(!admits("Bearer 0123456789abcde"));
        assert!(!admits("Bearer 0123456789abcdef0"));
        assert!(!admits("Basic 0123456789abcdef"));
        assert!(!admits("0123456789abcdef"));
        assert!(!admits(""));
        assert!(!token.admits(None));
        assert_eq!(format!("{token:?}"), "Token(..)");
        assert!(matches!(
            Token::new("short".to_owned()),
            Err(AdminError::TokenTooShort { len: 5 })
        ));
        assert!(matches!(
            Token::new("0123456789abcdef\n".to_owned()),
            Err(AdminError::TokenNotPrintable)
        ));
    }

    #[test]
    fn requests_from_other_sites_and_changes_without_json_are_refused() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        let json = ("content-type", "application/json");
        let host = ("host", "10.0.0.7:9000");
        let refused = |method: Method, pairs: &[(&'static str, &'static str)]| {
            cross_site(&method, &headers(pairs)).map(|p| format!("{p:?}"))
        };
        assert_eq!(refused(Method::GET, &[host]), None);
        assert_eq!(refused(Method::POST, &[host, json]), None);
        assert_eq!(
            refused(
                Method::POST,
                &[host, ("content-type", "application/json; charset=utf-8")]
            ),
            None
        );
        assert_eq!(
            refused(
                Method::POST,
                &[host, json, ("sec-fetch-site", "same-origin")]
            ),
            None
        );
        assert_eq!(
            refused(
                Method::POST,
                &[host, json, ("origin", "http://10.0.0.7:9000")]
            ),
            None
        );
        for pairs in [
            &[host][..],
            &[host, ("content-type", "text/plain")],
            &[host, json, ("sec-fetch-site", "cross-site")],
            &[host, json, ("sec-fetch-site", "same-site")],
            &[host, json, ("origin", "https://evil.example")],
            &[host, json, ("origin", "null")],
        ] {
            assert!(refused(Method::POST, pairs).is_some(), "{pairs:?}");
        }
        assert!(refused(Method::GET, &[host, ("origin", "https://evil.example")]).is_some());
    }
}
