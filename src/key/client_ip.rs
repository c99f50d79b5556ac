//! [`client_ip`]: the client's address behind trusted proxies.

use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use http::Request;
use http::header::{FORWARDED, HeaderName};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{KeyError, KeyExtractor, PeerIp, canonical_ip};

/// How many forwarding entries are examined at most, from the right: a
/// client cannot make the server walk a header of thousands of entries.
pub const MAX_HOPS: usize = 32;

/// The default prefix length IPv6 clients are grouped by: one /64 is one
/// subscriber, who can use any of its 2^64 addresses.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// The header your trusted proxies write the client's address into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (nginx, HAProxy, cloud load
    /// balancers). The default.
    #[default]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
    /// `X-Real-IP: client`, one address set by the last proxy. When the
    /// request holds several (a proxy that appends its line after the one
    /// the client sent, or an intermediary that joined them with commas),
    /// the **last** entry of the last line is read: the one the trusted
    /// proxy wrote. If that entry is not an address, the peer is the client;
    /// an earlier entry, which the client may have written, is never used.
    XRealIp,
}

/// The address of the client, read from a forwarding header only when the
/// connecting peer is a trusted proxy; see [`client_ip`].
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ProxyHeader,
    ipv6_prefix: u8,
}

/// The client's address behind trusted proxies.
///
/// With no trusted proxies (the default) this is the peer address, as
/// [`peer_ip`](super::peer_ip): headers are ignored, so a client cannot
/// choose its key. With trusted proxies, the chosen header is read only
/// when the connecting peer is one of them, and the client is the
/// rightmost address in the chain that is not a trusted proxy (every
/// trusted proxy appends what it saw; what is left of them came from the
/// client and is not believed). Several lines of the header are one list,
/// in order (the entries of the last line are the rightmost). A malformed
/// entry ends the walk: the last trusted address seen is then taken as the
/// client. With [`ProxyHeader::XRealIp`] the last entry is read (see there).
///
/// IPv4-mapped IPv6 addresses (`::ffff:10.0.0.5`, as a dual-stack listener
/// or proxy writes IPv4 peers) are their IPv4 address everywhere: the peer,
/// every entry of the header, the trusted proxies (`::ffff:10.0.0.0/104` is
/// `10.0.0.0/8`) and the key, so a client is one client however its address
/// is written. An IPv6 block of trusted proxies therefore never covers
/// IPv4 clients (`::/0` trusts every IPv6 address, no IPv4 one).
///
/// IPv6 clients are grouped by their /64 (see
/// [`ipv6_prefix`](ClientIp::ipv6_prefix)).
///
/// ```
/// use tower_redis_ratelimit::key::{self, ProxyHeader};
///
/// let behind_nginx = key::client_ip().trusting(["10.0.0.0/8", "fd00::/8"])?;
/// let behind_a_forwarded_proxy = key::client_ip()
///     .trusting(["192.0.2.10"])?
///     .header(ProxyHeader::Forwarded);
/// # Ok::<(), tower_redis_ratelimit::key::TrustError>(())
/// ```
pub fn client_ip() -> ClientIp {
    ClientIp {
        trusted: Vec::new(),
        header: ProxyHeader::default(),
        ipv6_prefix: DEFAULT_IPV6_PREFIX,
    }
}

/// A trusted-proxy entry that is neither an address nor a CIDR block, or an
/// IPv4-mapped block whose prefix reaches outside the IPv4-mapped addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trusted proxy {entry:?} {problem}")]
pub struct TrustError {
    entry: String,
    problem: String,
}

impl TrustError {
    fn not_an_address(entry: &str) -> Self {
        Self {
            entry: entry.to_owned(),
            problem: "is not an IP address or CIDR block (such as 10.0.0.0/8 or 2001:db8::/32)"
                .to_owned(),
        }
    }
}

/// `net` with IPv4-mapped blocks (`::ffff:10.0.0.0/104`) as IPv4 blocks
/// (`10.0.0.0/8`), truncated to its network.
fn canonical_net(entry: &str, net: IpNet) -> Result<IpNet, TrustError> {
    let IpNet::V6(v6) = net else {
        return Ok(net.trunc());
    };
    let Some(v4) = v6.addr().to_ipv4_mapped() else {
        return Ok(net.trunc());
    };
    match v6.prefix_len().checked_sub(96) {
        Some(len) => Ipv4Net::new(v4, len)
            .map(|n| IpNet::V4(n.trunc()))
            .map_err(|_| TrustError::not_an_address(entry)),
        // `::ffff:10.0.0.0/8` would trust `::/8`: surely not what was meant.
        None => Err(TrustError {
            entry: entry.to_owned(),
            problem: format!(
                "is an IPv4-mapped address with a prefix shorter than 96, which reaches outside \
                 the IPv4-mapped block: write the IPv4 block ({v4}/{len}) or add 96 to the \
                 prefix (::ffff:{v4}/{mapped})",
                len = v6.prefix_len().min(32),
                mapped = v6.prefix_len().min(32) + 96,
            ),
        }),
    }
}

impl ClientIp {
    /// Trust these proxies: addresses (`10.0.0.7`) or CIDR blocks
    /// (`10.0.0.0/8`, `fd00::/8`), added to those already trusted.
    /// IPv4-mapped entries are their IPv4 address or block
    /// (`::ffff:10.0.0.0/104` is `10.0.0.0/8`).
    ///
    /// # Errors
    /// An entry that is neither, or an IPv4-mapped block with a prefix
    /// under 96 (`::ffff:10.0.0.0/8`, which would trust `::/8`), named in
    /// the error.
    pub fn trusting<S: AsRef<str>>(
        mut self,
        proxies: impl IntoIterator<Item = S>,
    ) -> Result<Self, TrustError> {
        for entry in proxies {
            let entry = entry.as_ref().trim();
            let net = IpNet::from_str(entry)
                .or_else(|_| IpAddr::from_str(entry).map(IpNet::from))
                .map_err(|_| TrustError::not_an_address(entry))?;
            self.trusted.push(canonical_net(entry, net)?);
        }
        Ok(self)
    }

    /// Read the client's address from `header` (default
    /// [`ProxyHeader::XForwardedFor`]). Choose the one your proxies set: a
    /// header they pass through untouched can be forged by the client.
    #[must_use]
    pub fn header(mut self, header: ProxyHeader) -> Self {
        self.header = header;
        self
    }

    /// Group IPv6 clients by this prefix length (default
    /// [`DEFAULT_IPV6_PREFIX`]; 128 counts each address on its own).
    /// Lengths above 128 count as 128.
    #[must_use]
    pub fn ipv6_prefix(mut self, len: u8) -> Self {
        self.ipv6_prefix = len.min(128);
        self
    }

    /// Whether `ip` (canonical: IPv4-mapped addresses as IPv4, as the
    /// trusted blocks are) is a trusted proxy.
    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// The client's address for a request from `peer`.
    fn resolve<B>(&self, request: &Request<B>, peer: IpAddr) -> IpAddr {
        if !self.is_trusted(peer) {
            return peer;
        }
        let headers = request.headers();
        match self.header {
            // The last entry of the last line: the one the trusted proxy
            // wrote, whatever the client sent before it.
            ProxyHeader::XRealIp => headers
                .get_all(&X_REAL_IP)
                .iter()
                .next_back()
                .and_then(|v| v.as_bytes().rsplit(|&b| b == b',').next())
                .and_then(|entry| std::str::from_utf8(entry).ok())
                .and_then(parse_address)
                .unwrap_or(peer),
            ProxyHeader::XForwardedFor | ProxyHeader::Forwarded => {
                let name = if self.header == ProxyHeader::Forwarded {
                    &FORWARDED
                } else {
                    &X_FORWARDED_FOR
                };
                // Every value of the header, in order; entries right to left,
                // each decoded on its own: a client's undecodable bytes end
                // the walk where they are, not for the whole line its proxy
                // appended the real address to.
                let values: Vec<&[u8]> =
                    headers.get_all(name).iter().map(|v| v.as_bytes()).collect();
                let entries = values.iter().rev().flat_map(|v| v.rsplit(|&b| b == b','));
                let mut client = peer;
                for entry in entries.take(MAX_HOPS) {
                    let entry = std::str::from_utf8(entry).ok();
                    let address = if self.header == ProxyHeader::Forwarded {
                        entry.and_then(forwarded_for).and_then(parse_address)
                    } else {
                        entry.and_then(parse_address)
                    };
                    let Some(address) = address else {
                        break;
                    };
                    client = address;
                    if !self.is_trusted(address) {
                        break;
                    }
                }
                client
            }
        }
    }
}

impl ClientIp {
    /// Whether any proxy is trusted.
    pub(crate) fn trusts_any(&self) -> bool {
        !self.trusted.is_empty()
    }

    /// Whether `request` comes straight from a trusted proxy (never, with
    /// none configured): only then may headers a proxy sets be believed.
    pub(crate) fn peer_is_trusted<B>(&self, request: &Request<B>) -> bool {
        !self.trusted.is_empty()
            && PeerIp::addr(request).is_some_and(|a| self.is_trusted(canonical_ip(a.ip())))
    }
}

impl<B> KeyExtractor<B> for ClientIp {
    fn extract(&self, request: &Request<B>) -> Result<Option<String>, KeyError> {
        let Some(peer) = PeerIp::addr(request).map(|a| canonical_ip(a.ip())) else {
            return Err(KeyError::new(
                "key::client_ip() found no peer address in the request",
                "serve the axum Router with `into_make_service_with_connect_info::<SocketAddr>()` \
                 (or insert the peer's SocketAddr as a request extension)",
            ));
        };
        // `resolve` gives canonical addresses: the peer, or a parsed entry.
        let client = self.resolve(request, peer);
        Ok(Some(group(client, self.ipv6_prefix)))
    }
}

/// The key of an address: IPv4 as is; IPv6 as its network of `prefix` bits
/// (`2001:db8:1:2::/64`), or the address itself at 128.
pub(crate) fn group(ip: IpAddr, prefix: u8) -> String {
    match ip {
        IpAddr::V6(v6) if prefix < 128 => match Ipv6Net::new(v6, prefix) {
            Ok(net) => text(net.trunc()),
            Err(_) => text(v6),
        },
        other => text(other),
    }
}

/// `value` written into a string sized for the longest address and prefix
/// (`to_string` grows it as it writes, reallocating), with room for the
/// layer's namespace.
fn text(value: impl std::fmt::Display) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(43 + super::NAMESPACE_ROOM);
    // Writing to a `String` fails only if `value`'s `Display` does, which
    // addresses' never do.
    let _ = write!(out, "{value}");
    out
}

/// One address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`,
/// `[2001:db8::1]:443`, `fe80::1%eth0`, optionally quoted; IPv4-mapped
/// addresses as their IPv4 address.
fn parse_address(text: &str) -> Option<IpAddr> {
    parse_any_address(text).map(canonical_ip)
}

fn parse_any_address(text: &str) -> Option<IpAddr> {
    let text = text.trim().trim_matches('"');
    if text.is_empty() || text.len() > 64 {
        return None;
    }
    if let Some(rest) = text.strip_prefix('[') {
        let inside = rest.split(']').next()?;
        return parse_v6(inside).map(IpAddr::V6);
    }
    if let Ok(ip) = IpAddr::from_str(text) {
        return Some(ip);
    }
    if let Some(v6) = parse_v6(text) {
        return Some(IpAddr::V6(v6));
    }
    // IPv4 with a port.
    let (host, port) = text.rsplit_once(':')?;
    if port.bytes().all(|b| b.is_ascii_digit()) && !host.contains(':') {
        return IpAddr::from_str(host).ok();
    }
    None
}

/// An IPv6 address, without a zone (`%eth0`).
fn parse_v6(text: &str) -> Option<Ipv6Addr> {
    let without_zone = text.split('%').next()?;
    Ipv6Addr::from_str(without_zone).ok()
}

/// The `for=` value of one RFC 7239 element (`for=1.2.3.4;proto=https`).
fn forwarded_for(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("for")
            .then_some(value.trim())
    })
}

#[cfg(test)]
mod tests;
