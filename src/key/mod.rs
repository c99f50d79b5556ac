//! Which key a request is counted under: any closure, or a ready extractor.
//!
//! A closure `Fn(&Request<B>) -> Option<K>` (with `K: Display`) is an
//! extractor. `None` lets the request through without limiting it (health
//! checks, internal callers).
//!
//! Two different clients never get one key from the built-in extractors or
//! their combinations ([`And`], [`Or`]): keys are the plain value where it
//! cannot be mistaken for another, and escaped or encoded where it could
//! (see [`header`], [`And`] and [`Or`]). IPv4-mapped IPv6 addresses are
//! their IPv4 address, so a client has one key however its address is
//! written.
//!
//! ```
//! use http::Request;
//! use tower_redis_ratelimit::key::{self, KeyExtractor};
//!
//! // Limit per API key, and do not limit the health check.
//! let by_api_key = |req: &Request<()>| {
//!     if req.uri().path() == "/health" {
//!         return None;
//!     }
//!     req.headers().get("x-api-key")?.to_str().ok().map(str::to_owned)
//! };
//! let req = Request::get("/items").header("x-api-key", "k-123").body(()).unwrap();
//! assert_eq!(by_api_key.extract(&req).unwrap().as_deref(), Some("k-123"));
//!
//! // The client's IP and the path, as in "127.0.0.1+/login".
//! let _per_ip_and_path = key::peer_ip().and(key::path());
//! ```

use std::fmt::{self, Display};
use std::net::{IpAddr, SocketAddr};

use http::Request;
use http::header::HeaderName;

mod client_ip;

pub use client_ip::{ClientIp, DEFAULT_IPV6_PREFIX, MAX_HOPS, ProxyHeader, TrustError, client_ip};

/// Picks the key of a request.
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The key of `request`; `Ok(None)` lets it through unlimited.
    ///
    /// # Errors
    /// The extractor cannot work with this server's set-up (for instance,
    /// the peer address is not recorded); the layer answers 500 rather than
    /// silently not limiting.
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError>;
}

impl<B, F, K> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> Option<K> + Send + Sync + 'static,
    K: Display,
{
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        Ok(self(request).map(|k| k.to_string()))
    }
}

/// An extractor that cannot work with this server's set-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{problem}: {fix}")]
pub struct KeyError {
    problem: &'static str,
    fix: &'static str,
}

impl KeyError {
    /// An error saying what is wrong and how to fix it.
    pub fn new(problem: &'static str, fix: &'static str) -> Self {
        Self { problem, fix }
    }
}

/// The IP address of the connecting peer.
///
/// Read from axum's `ConnectInfo<SocketAddr>` (serve the router with
/// `into_make_service_with_connect_info::<SocketAddr>()`), from tonic's
/// `TcpConnectInfo` (with the `tonic` feature; tonic servers record it
/// themselves), or from a plain `SocketAddr` request extension (for hyper
/// servers that insert one).
/// IPv4-mapped IPv6 addresses count as their IPv4 address; IPv6 clients are
/// grouped by their /64 (`2001:db8:1:2::/64`; see
/// [`ipv6_prefix`](PeerIp::ipv6_prefix)). Headers are never read, so a
/// client cannot choose its key; behind proxies use [`client_ip`].
///
/// Without the peer address the layer answers 500 with a message saying how
/// to fix the set-up; it does not let requests through unlimited.
pub fn peer_ip() -> PeerIp {
    PeerIp {
        ipv6_prefix: DEFAULT_IPV6_PREFIX,
    }
}

/// See [`peer_ip`].
#[derive(Debug, Clone, Copy)]
pub struct PeerIp {
    ipv6_prefix: u8,
}

impl PeerIp {
    /// Group IPv6 clients by this prefix length (default
    /// [`DEFAULT_IPV6_PREFIX`]; 128 counts each address on its own).
    #[must_use]
    pub fn ipv6_prefix(mut self, len: u8) -> Self {
        self.ipv6_prefix = len.min(128);
        self
    }

    fn addr<B>(request: &Request<B>) -> Option<SocketAddr> {
        #[cfg(feature = "axum")]
        if let Some(info) = request
            .extensions()
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(info.0);
        }
        #[cfg(feature = "tonic")]
        if let Some(addr) = request
            .extensions()
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|info| info.remote_addr())
        {
            return Some(addr);
        }
        request.extensions().get::<SocketAddr>().copied()
    }
}

impl<B> KeyExtractor<B> for PeerIp {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        match Self::addr(request) {
            Some(addr) => Ok(Some(client_ip::group(
                canonical_ip(addr.ip()),
                self.ipv6_prefix,
            ))),
            None => Err(KeyError::new(
                "key::peer_ip() found no peer address in the request",
                "serve the axum Router with `into_make_service_with_connect_info::<SocketAddr>()` \
                 (or insert the peer's SocketAddr as a request extension)",
            )),
        }
    }
}

fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// The value of a request header, for clients that identify themselves (an
/// API key, a tenant id).
///
/// A request without the header is **not limited** (the extractor returns
/// `None`); to limit such requests by address instead, write
/// `key::header("x-api-key").or(key::peer_ip())` ([`Or`] keeps the two
/// kinds of key apart).
///
/// A value of visible ASCII (spaces and tabs included) is the key as it is.
/// Any other value is `hex:` and its bytes in hex (`a\xffb` is
/// `hex:61ff62`), and so is a value that starts with `hex:` itself (the
/// text `hex:61ff62` is `hex:6865783a363166663632`), so two different values
/// never share a key: a client cannot send the spelling of another
/// client's encoded value and spend its quota. Only the first line of the
/// header is read.
///
/// # Panics
/// If `name` is not a valid header name: this runs at start-up, with a
/// name from the program, never from a request.
pub fn header(name: &str) -> Header {
    match Header::new(name) {
        Ok(header) => header,
        Err(_) => panic!("key::header({name:?}): not a valid HTTP header name"),
    }
}

/// See [`header`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

impl Header {
    /// The extractor of header `name`, for names read from configuration.
    ///
    /// # Errors
    /// `name` is not a valid HTTP header name.
    pub fn new(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        Ok(Self {
            name: HeaderName::try_from(name)?,
        })
    }

    /// The header read.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl<B> KeyExtractor<B> for Header {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        let Some(value) = request.headers().get(&self.name) else {
            return Ok(None);
        };
        Ok(Some(match value.to_str() {
            // Text that could be read as an encoding is encoded too.
            Ok(text) if !text.starts_with(HEX_MARKER) => {
                let mut key = String::with_capacity(text.len() + NAMESPACE_ROOM);
                key.push_str(text);
                key
            }
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let mut hex =
                    String::with_capacity(HEX_MARKER.len() + value.len() * 2 + NAMESPACE_ROOM);
                hex.push_str(HEX_MARKER);
                for b in value.as_bytes() {
                    hex.push(char::from(HEX[usize::from(b >> 4)]));
                    hex.push(char::from(HEX[usize::from(b & 0xf)]));
                }
                hex
            }
        }))
    }
}

/// What starts the key of a header value that is written in hex.
const HEX_MARKER: &str = "hex:";

/// One key for every request: a limit on the whole service.
pub fn global() -> Global {
    Global { _priv: () }
}

/// See [`global`].
#[derive(Debug, Clone, Copy)]
pub struct Global {
    _priv: (),
}

impl<B> KeyExtractor<B> for Global {
    fn extract(&self, _: &Request<B>) -> Result<Option<String>, KeyError> {
        Ok(Some("global".to_owned()))
    }
}

/// The request path (without the query), to combine with a client key:
/// `key::peer_ip().and(key::path())`.
pub fn path() -> Path {
    Path { _priv: () }
}

/// See [`path`].
#[derive(Debug, Clone, Copy)]
pub struct Path {
    _priv: (),
}

impl<B> KeyExtractor<B> for Path {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        Ok(Some(request.uri().path().to_owned()))
    }
}

/// Both keys joined with `+` (`"203.0.113.9+/login"`); `None` if either is.
/// A `+` or `%` inside a part is escaped, so two different pairs never give
/// the same key.
#[derive(Debug, Clone)]
pub struct And<A, C> {
    first: A,
    second: C,
}

/// The first key if there is one, else the second, marked with a leading
/// `+` (`"+203.0.113.9"`). The first key's `+` and `%` are escaped, so the
/// two can never be equal: a client cannot send a header equal to another
/// client's address and spend that address's quota.
#[derive(Debug, Clone)]
pub struct Or<A, C> {
    first: A,
    second: C,
}

impl<B, A: KeyExtractor<B>, C: KeyExtractor<B>> KeyExtractor<B> for And<A, C> {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        let Some(a) = self.first.extract(request)? else {
            return Ok(None);
        };
        let Some(c) = self.second.extract(request)? else {
            return Ok(None);
        };
        Ok(Some(format!("{}+{}", Escaped(&a), Escaped(&c))))
    }
}

impl<B, A: KeyExtractor<B>, C: KeyExtractor<B>> KeyExtractor<B> for Or<A, C> {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        match self.first.extract(request)? {
            // Nothing to escape, as in most keys: the key as it is.
            Some(key) if !key.contains(['%', '+']) => Ok(Some(key)),
            Some(key) => Ok(Some(Escaped(&key).to_string())),
            None => Ok(self
                .second
                .extract(request)?
                .map(|key| format!("+{}", Escaped(&key)))),
        }
    }
}

/// Spare room the built-in extractors leave in a key for the layer's
/// `{name}:` namespace, so that prefixing it needs no second allocation.
pub(crate) const NAMESPACE_ROOM: usize = 32;

/// Keys joined as [`And`] joins two: `a+b+c`, each part escaped, so two
/// different lists never give one key.
pub(crate) fn joined(parts: &[String]) -> String {
    use fmt::Write as _;
    if let [one] = parts {
        return one.clone();
    }
    let mut key = String::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            key.push('+');
        }
        // Writing to a `String` never fails.
        let _ = write!(key, "{}", Escaped(part));
    }
    key
}

impl Header {
    pub(crate) fn from_name(name: HeaderName) -> Self {
        Self { name }
    }
}

/// `%` and `+` percent-escaped.
struct Escaped<'a>(&'a str);

impl Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(['%', '+']) {
            f.write_str(&rest[..at])?;
            f.write_str(if rest.as_bytes()[at] == b'%' {
                "%25"
            } else {
                "%2B"
            })?;
            rest = &rest[at + 1..];
        }
        f.write_str(rest)
    }
}

macro_rules! combinators {
    ($($ty:ident $(<$($g:ident),*>)?),*) => {$(
        impl$(<$($g),*>)? $ty$(<$($g),*>)? {
            /// This key and `other`'s, joined: see [`And`].
            #[must_use]
            pub fn and<E>(self, other: E) -> And<Self, E> {
                And { first: self, second: other }
            }

            /// This key, or `other`'s when this one has none: see [`Or`].
            #[must_use]
            pub fn or<E>(self, other: E) -> Or<Self, E> {
                Or { first: self, second: other }
            }
        }
    )*};
}

combinators!(PeerIp, ClientIp, Header, Global, Path, And<A, C>, Or<A, C>);

/// Combine any two extractors (closures included): see [`And`].
pub fn and<A, C>(first: A, second: C) -> And<A, C> {
    And { first, second }
}

/// Fall back from one extractor to another (closures included): see [`Or`].
pub fn or<A, C>(first: A, second: C) -> Or<A, C> {
    Or { first, second }
}

/// A key in logs: the first 12 hex digits of the SHA-1 of its store key
/// (`{name}:{key}` with the key as the limiter holds it, a long one
/// hashed; or `{key}` alone with no name), the same in every
/// process and whoever logs it, so events of one client can be followed
/// without logging its address or API key. Computed only when an event is
/// written.
pub(crate) struct KeyHash<'a> {
    /// The limiter's name, when `key` is not namespaced yet.
    pub(crate) name: Option<&'a str>,
    pub(crate) key: &'a str,
    /// Whether `key` is as the limiter holds it already (a long one
    /// hashed), not as extracted.
    pub(crate) held: bool,
}

impl<'a> KeyHash<'a> {
    /// The hash of a store key (already `{name}:{key}`).
    pub(crate) fn stored(key: &'a str) -> Self {
        Self {
            name: None,
            key,
            held: true,
        }
    }

    /// The hash of `key` (as extracted) as the limiter `name` stores it.
    pub(crate) fn of(name: &'a str, key: &'a str) -> Self {
        Self {
            name: Some(name),
            key,
            held: false,
        }
    }

    /// The hash of `key`, as the limiter `name` holds it (a long key by
    /// its hash already), as the limiter `name` stores it.
    pub(crate) fn held(name: &'a str, key: &'a str) -> Self {
        Self {
            name: Some(name),
            key,
            held: true,
        }
    }
}

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sha = sha1_smol::Sha1::new();
        match self.name {
            // As the limiter holds it: a long key by its hash.
            Some(name) => {
                sha.update(name.as_bytes());
                sha.update(b":");
                if self.held {
                    sha.update(self.key.as_bytes());
                } else {
                    sha.update(crate::store::bounded_key(self.key).as_bytes());
                }
            }
            None => sha.update(self.key.as_bytes()),
        }
        let digest = sha.digest().to_string();
        f.write_str(&digest[..12])
    }
}

#[cfg(test)]
mod tests;
