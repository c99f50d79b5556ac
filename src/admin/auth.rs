//! The bearer token every admin route requires.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use http::{HeaderValue, StatusCode, header};
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

/// Answer 401 unless the request bears the token; mark every answer as
/// not to be stored or sniffed.
pub(crate) async fn require(
    State(token): State<Arc<Token>>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = if token.admits(request.headers().get(header::AUTHORIZATION)) {
        next.run(request).await
    } else {
        let mut denied = Problem::new(
            StatusCode::UNAUTHORIZED,
            "this needs the header `Authorization: Bearer <admin token>`",
        )
        .into_response();
        denied.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"ratelimit-admin\""),
        );
        denied
    };
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
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
    }
}
