//! The bearer token every admin route requires, and the refusal of
//! requests for another host or from another site's page.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::uri::Authority;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use subtle::ConstantTimeEq as _;

use super::hosts::{DefaultPort, Hosts};
use super::{AdminError, MIN_DISTINCT_CHARACTERS, MIN_TOKEN_BITS, MIN_TOKEN_LEN};
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
        if repetitive(token.as_bytes()) {
            return Err(AdminError::TokenRepetitive);
        }
        let bits = estimated_bits(token.as_bytes());
        // A small tolerance: 16 hexadecimal digits carry 64 bits exactly,
        // which the product of floats may miss by a rounding.
        if bits + 1e-9 < f64::from(MIN_TOKEN_BITS) {
            return Err(AdminError::TokenTooWeak {
                // Truncated: at most 63 here.
                bits: bits as u32,
            });
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

/// What a token carries if its characters were drawn at random from its
/// alphabet, in bits: its length times log2 of the alphabet's size. The
/// alphabet is inferred from the classes of characters present: 16 for
/// hexadecimal digits of one case (digits alone included: a random hex
/// token may hold no letter), otherwise the sum of the classes present,
/// digits 10, lowercase 26, uppercase 26, other printable ASCII 32.
fn estimated_bits(token: &[u8]) -> f64 {
    let has = |class: fn(&u8) -> bool| token.iter().any(class);
    let all = |class: fn(&u8) -> bool| token.iter().all(class);
    let alphabet = if all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        || all(|b| matches!(b, b'0'..=b'9' | b'A'..=b'F'))
    {
        16
    } else {
        [
            (has(u8::is_ascii_digit), 10),
            (has(u8::is_ascii_lowercase), 26),
            (has(u8::is_ascii_uppercase), 26),
            (
                has(|b| b.is_ascii_graphic() && !b.is_ascii_alphanumeric()),
                32,
            ),
        ]
        .iter()
        .filter(|(present, _)| *present)
        .map(|(_, size)| size)
        .sum()
    };
    token.len() as f64 * f64::from(alphabet).log2()
}

/// Whether a token repeats itself whatever its alphabet: fewer than
/// [`MIN_DISTINCT_CHARACTERS`] different characters, or a shorter string
/// repeated, give or take one character (`passwordpassword`,
/// `admin-admin-admin-admin`, `adminadminadmin1`, `changeme-changeme`).
/// Random tokens are this by chance with a negligible probability: 16
/// random hexadecimal digits about once in 10⁸.
fn repetitive(token: &[u8]) -> bool {
    let mut seen = [false; 256];
    for &byte in token {
        seen[usize::from(byte)] = true;
    }
    if seen.iter().filter(|&&s| s).count() < MIN_DISTINCT_CHARACTERS {
        return true;
    }
    let len = token.len();
    [
        token,
        token.get(1..).unwrap_or_default(),
        token.get(..len.saturating_sub(1)).unwrap_or_default(),
    ]
    .iter()
    .any(|part| repeated(part))
}

/// Whether `text` is a shorter string written at least twice, the last
/// copy possibly one character short: it has a period `p` (each character
/// equal to the one `p` before it) with `2p <= len + 1`.
fn repeated(text: &[u8]) -> bool {
    (1..=text.len().div_ceil(2)).any(|p| (p..text.len()).all(|i| text[i] == text[i - p]))
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

/// What every request must pass: the hosts served and the token.
#[derive(Debug)]
pub(crate) struct Gate {
    pub(crate) token: Token,
    pub(crate) hosts: Hosts,
}

/// Answer 400 or 403 to a request for a host this router does not serve,
/// 401 unless the request bears the token, 403 to a request from another
/// site's page, 415 to a change whose body is not declared JSON; mark
/// every answer as not to be stored or sniffed.
pub(crate) async fn require(
    State(gate): State<Arc<Gate>>,
    request: Request,
    next: Next,
) -> Response {
    let refused = if let Some(refused) = wrong_host(request.uri(), request.headers(), &gate.hosts) {
        Some(refused.into_response())
    } else if !gate
        .token
        .admits(request.headers().get(header::AUTHORIZATION))
    {
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
        cross_site(request.method(), request.headers(), &gate.hosts)
            .map(IntoResponse::into_response)
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

/// Why a request is not for this router: it names no host, or one the
/// router does not serve (in its `Host`, or its URI's authority, as HTTP/2
/// sends it). A page of a name an attacker's DNS points at the admin
/// address (DNS rebinding) sends that name.
fn wrong_host(uri: &Uri, headers: &HeaderMap, hosts: &Hosts) -> Option<Problem> {
    let mut named = headers.get_all(header::HOST).iter();
    let host = named.next();
    if named.next().is_some() {
        return Some(Problem::bad_request("the request has more than one `Host`"));
    }
    if uri.authority().is_none() && host.is_none() {
        return Some(Problem::bad_request(
            "the request names no host: it needs a `Host` header",
        ));
    }
    if let Some(authority) = uri.authority()
        && !hosts.serves(authority, DefaultPort::of(uri.scheme_str()))
    {
        return Some(not_served(
            "authority",
            "host",
            authority.as_str().as_bytes(),
        ));
    }
    let host = host?;
    match Authority::try_from(host.as_bytes()) {
        Ok(authority) if hosts.serves(&authority, DefaultPort::Either) => None,
        _ => Some(not_served("`Host`", "host", host.as_bytes())),
    }
}

/// 403: the request's `what` (`Host`, its authority, its `Origin`) is
/// `value`, which this router does not serve; `member` names it in the
/// problem.
fn not_served(what: &str, member: &str, value: &[u8]) -> Problem {
    let value = String::from_utf8_lossy(value);
    Problem::new(
        StatusCode::FORBIDDEN,
        format!(
            "this admin router does not serve {value:?} (the request's {what}): {}",
            Hosts::how_to_serve()
        ),
    )
    .with(member, value.into_owned())
}

/// Why a request that bears the token is still refused: a browser that
/// adds the token to every request to the admin address (as the console
/// needs) would add it to another site's requests too. Such a request says
/// where it comes from (`Sec-Fetch-Site`, an `Origin` of a host this router
/// does not serve); and a change must declare a JSON body, which a page of
/// another origin cannot send without a CORS preflight, which this router
/// never answers.
fn cross_site(method: &Method, headers: &HeaderMap, hosts: &Hosts) -> Option<Problem> {
    if let Some(site) = headers.get("sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        return Some(Problem::new(
            StatusCode::FORBIDDEN,
            "a request from another site's page is refused (`Sec-Fetch-Site`)",
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        // Without a port, an origin is of its scheme's default one.
        let origin_bytes = origin.as_bytes();
        let authority = origin_bytes
            .strip_prefix(b"http://")
            .map(|authority| (authority, DefaultPort::Http))
            .or_else(|| {
                origin_bytes
                    .strip_prefix(b"https://")
                    .map(|authority| (authority, DefaultPort::Https))
            })
            .and_then(|(authority, default)| {
                Authority::try_from(authority)
                    .ok()
                    .map(|authority| (authority, default))
            });
        if !authority.is_some_and(|(authority, default)| hosts.serves(&authority, default)) {
            return Some(not_served("`Origin`", "origin", origin_bytes));
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
    fn a_token_too_easy_to_guess_is_refused() {
        for weak in [
            // Too few different characters.
            "aaaaaaaaaaaaaaaa",
            "abababababababababababababababab",
            "aabbccaabbccaabbccab",
            // A shorter string repeated (give or take a character).
            "passwordpassword",
            "admin-admin-admin-admin",
            "adminadminadmin1",
            "1234567812345678",
            "changeme-changeme",
            "xyzabcxyzabcxyzabc",
        ] {
            let error = Token::new(weak.to_owned()).unwrap_err();
            assert!(
                matches!(error, AdminError::TokenRepetitive),
                "{weak}: {error:?}"
            );
            let message = error.to_string();
            assert!(message.contains("openssl rand -hex 32"), "{message}");
            assert!(!message.contains(weak), "{message}");
        }
        // 16 hexadecimal digits: 64 bits.
        assert!(Token::new("0123456789abcdef".to_owned()).is_ok());
        assert!(Token::new("0123456789ABCDEF".to_owned()).is_ok());
        assert!(Token::new("correct-horse-battery-staple".to_owned()).is_ok());
        // What `openssl rand -hex 8`, `-hex 32` and `head -c 32 /dev/urandom
        // | base64` print.
        assert!(Token::new("9f2c4e81a07b3d56".to_owned()).is_ok());
        assert!(
            Token::new(
                "3f9c1be07a5d48e2c6f1a0b9d7e4c3a25b8f0e1d6c9a7b3e4f2d1c0b9a8e7f6d".to_owned()
            )
            .is_ok()
        );
        assert!(Token::new("q3v2Jk9Zx0LmN4pR7sT1uW8yB6cD5eF+gH/iA2oQ=".to_owned()).is_ok());
    }

    /// Length times log2 of the alphabet inferred from the classes present.
    #[test]
    fn bits_are_the_length_times_the_alphabet_of_the_classes_present() {
        let bits = |token: &str| estimated_bits(token.as_bytes());
        assert!((bits("0123456789abcdef") - 64.0).abs() < 1e-9);
        assert!((bits("0123456789ABCDEF") - 64.0).abs() < 1e-9);
        // Digits alone: as hexadecimal (a random hex token may draw no
        // letter).
        assert!((bits("8275019364829105") - 64.0).abs() < 1e-9);
        // Mixed-case hex, or letters past f: the sum of the classes.
        let lower = 26_f64.log2();
        assert!((bits("abcdefgh") - 8.0 * lower).abs() < 1e-9);
        assert!((bits("0a1B") - 4.0 * 62_f64.log2()).abs() < 1e-9);
        assert!((bits("a-B1") - 4.0 * 94_f64.log2()).abs() < 1e-9);
        assert!((bits("ab-") - 3.0 * 58_f64.log2()).abs() < 1e-9);
        // Too short for its alphabet: refused as such (8 hex digits: 32).
        assert!(bits("9f2c4e81") < f64::from(MIN_TOKEN_BITS));
    }

    /// `openssl rand -hex 8` prints 16 hexadecimal digits, 64 random bits:
    /// never refused, whichever digits it drew (16 digits of 0-9 only
    /// included); nor 20 or 32 of them.
    #[test]
    fn random_hexadecimal_tokens_are_never_refused() {
        // SplitMix64: a different, reproducible sequence each run of it.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let hex = b"0123456789abcdef";
        for len in [16, 20, 32] {
            for _ in 0..10_000 {
                let token: String = (0..len)
                    .map(|_| char::from(hex[(next() % 16) as usize]))
                    .collect();
                let upper = token.to_ascii_uppercase();
                assert!(Token::new(token.clone()).is_ok(), "{token}");
                assert!(Token::new(upper.clone()).is_ok(), "{upper}");
            }
        }
    }

    #[test]
    fn hosts_not_served_are_refused() {
        let hosts = Hosts::bound_to("127.0.0.1:9000".parse().unwrap()).unwrap();
        let refused = |uri: &str, host: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(host) = host {
                headers.insert(header::HOST, HeaderValue::from_static(host));
            }
            wrong_host(&uri.parse().unwrap(), &headers, &hosts).map(|p| format!("{p:?}"))
        };
        assert_eq!(refused("/api/rules", Some("127.0.0.1:9000")), None);
        assert_eq!(refused("/api/rules", Some("localhost:9000")), None);
        // HTTP/2: the URI's authority.
        assert_eq!(refused("http://127.0.0.1:9000/api/rules", None), None);
        let rebound = refused("/api/rules", Some("rebind.attacker.example:9000")).unwrap();
        assert!(rebound.contains("403") && rebound.contains("rebind.attacker.example:9000"));
        assert!(rebound.contains("with_host_name"), "{rebound}");
        assert!(
            refused(
                "http://rebind.attacker.example:9000/",
                Some("127.0.0.1:9000")
            )
            .is_some()
        );
        assert!(refused("/", None).unwrap().contains("400"));
        assert!(refused("/", Some("not a host")).is_some());
        let mut two = HeaderMap::new();
        two.append(header::HOST, HeaderValue::from_static("127.0.0.1:9000"));
        two.append(header::HOST, HeaderValue::from_static("evil.example"));
        assert!(wrong_host(&"/".parse().unwrap(), &two, &hosts).is_some());
    }

    /// An `Origin` without a port is of its scheme's default port (443 for
    /// `https`, 80 for `http`), as a listed name's port says.
    #[test]
    fn an_origin_without_a_port_is_of_its_schemes_default_port() {
        let mut hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        hosts.with_name("admin.internal:443").unwrap();
        hosts.with_name("ops.example:80").unwrap();
        let json = ("content-type", HeaderValue::from_static("application/json"));
        let refused = |origin: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(json.0, json.1.clone());
            headers.insert(header::ORIGIN, HeaderValue::from_static(origin));
            cross_site(&Method::POST, &headers, &hosts).is_some()
        };
        assert!(!refused("https://admin.internal"));
        assert!(!refused("https://admin.internal:443"));
        assert!(!refused("http://ops.example"));
        assert!(refused("http://admin.internal"));
        assert!(refused("https://ops.example"));
        assert!(refused("https://evil.example"));
        // An IP address, with any port (a mapped one): the console's own
        // requests through `docker -p 19000:9000`.
        assert!(!refused("http://10.0.0.7:19000"));
        assert!(refused("http://10.0.0.8:9000"));
    }

    /// The refusal of a host names the host and how to serve it, never the
    /// address the router is bound to: the client has no token yet.
    #[test]
    fn a_refused_host_is_told_how_to_serve_it_not_the_bound_address() {
        let hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            header::HOST,
            HeaderValue::from_static("admin.internal:19000"),
        );
        let refused = format!(
            "{:?}",
            wrong_host(&"/".parse().unwrap(), &headers, &hosts).unwrap()
        );
        assert!(refused.contains("admin.internal:19000"), "{refused}");
        assert!(refused.contains("with_host_name"), "{refused}");
        assert!(refused.contains("ADMIN_HOST_NAMES"), "{refused}");
        assert!(!refused.contains("10.0.0.7"), "{refused}");
    }

    #[test]
    fn requests_from_other_sites_and_changes_without_json_are_refused() {
        let hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        let json = ("content-type", "application/json");
        let refused = |method: Method, pairs: &[(&'static str, &'static str)]| {
            cross_site(&method, &headers(pairs), &hosts).map(|p| format!("{p:?}"))
        };
        assert_eq!(refused(Method::GET, &[]), None);
        assert_eq!(refused(Method::POST, &[json]), None);
        assert_eq!(
            refused(
                Method::POST,
                &[("content-type", "application/json; charset=utf-8")]
            ),
            None
        );
        assert_eq!(
            refused(Method::POST, &[json, ("sec-fetch-site", "same-origin")]),
            None
        );
        assert_eq!(
            refused(Method::POST, &[json, ("origin", "http://10.0.0.7:9000")]),
            None
        );
        for pairs in [
            &[][..],
            &[("content-type", "text/plain")],
            &[json, ("sec-fetch-site", "cross-site")],
            &[json, ("sec-fetch-site", "same-site")],
            &[json, ("origin", "https://evil.example")],
            &[json, ("origin", "http://rebind.attacker.example:9000")],
            &[json, ("origin", "http://10.0.0.8:9000")],
            &[json, ("origin", "null")],
            &[json, ("origin", "http://10.0.0.7:9000/path")],
        ] {
            assert!(refused(Method::POST, pairs).is_some(), "{pairs:?}");
        }
        assert!(refused(Method::GET, &[("origin", "https://evil.example")]).is_some());
    }
}
