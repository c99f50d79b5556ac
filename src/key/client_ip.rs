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
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn req(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut builder = Request::get("/");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let mut request = builder.body(()).unwrap();
        request
            .extensions_mut()
            .insert(peer.parse::<SocketAddr>().unwrap());
        request
    }

    fn key(extractor: &ClientIp, peer: &str, headers: &[(&str, &str)]) -> String {
        extractor.extract(&req(peer, headers)).unwrap().unwrap()
    }

    #[test]
    fn without_trusted_proxies_headers_are_ignored() {
        let untrusting = client_ip();
        let spoofed = [
            ("x-forwarded-for", "1.1.1.1"),
            ("forwarded", "for=2.2.2.2"),
            ("x-real-ip", "3.3.3.3"),
        ];
        assert_eq!(key(&untrusting, "198.51.100.7:1", &spoofed), "198.51.100.7");
    }

    #[test]
    fn the_rightmost_untrusted_address_wins() {
        let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
        let xff = [("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.1.1.1")];
        assert_eq!(key(&behind, "10.0.0.2:1", &xff), "203.0.113.9");
        // A peer outside the trusted set is the client, whatever it sends.
        assert_eq!(key(&behind, "198.51.100.7:1", &xff), "198.51.100.7");
        // Several header lines count as one list, in order.
        let split = [
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "203.0.113.9, 10.1.1.1"),
        ];
        assert_eq!(key(&behind, "10.0.0.2:1", &split), "203.0.113.9");
        // Every entry trusted: the leftmost one is the client.
        let internal = [("x-forwarded-for", "10.9.9.9, 10.1.1.1")];
        assert_eq!(key(&behind, "10.0.0.2:1", &internal), "10.9.9.9");
        // No header: the proxy itself.
        assert_eq!(key(&behind, "10.0.0.2:1", &[]), "10.0.0.2");
    }

    #[test]
    fn forwarded_and_x_real_ip() {
        let fwd = client_ip()
            .trusting(["10.0.0.0/8"])
            .unwrap()
            .header(ProxyHeader::Forwarded);
        let headers = [(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https, for=10.0.0.9;by=10.0.0.1",
        )];
        assert_eq!(key(&fwd, "10.0.0.2:1", &headers), "2001:db8:cafe::/64");
        // The X-Forwarded-For a client sends is not read by this extractor.
        let forged = [
            ("x-forwarded-for", "1.1.1.1"),
            ("forwarded", "for=203.0.113.5"),
        ];
        assert_eq!(key(&fwd, "10.0.0.2:1", &forged), "203.0.113.5");
        let real = client_ip()
            .trusting(["10.0.0.2"])
            .unwrap()
            .header(ProxyHeader::XRealIp);
        assert_eq!(
            key(&real, "10.0.0.2:1", &[("x-real-ip", "203.0.113.5")]),
            "203.0.113.5"
        );
        assert_eq!(
            key(&real, "10.0.0.3:1", &[("x-real-ip", "203.0.113.5")]),
            "10.0.0.3"
        );
        assert_eq!(
            key(&real, "10.0.0.2:1", &[("x-real-ip", "garbage")]),
            "10.0.0.2"
        );
    }

    #[test]
    fn hostile_values_never_panic_and_never_pick_the_key() {
        let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
        let huge = vec!["7.7.7.7"; 5_000].join(", ") + ", 10.1.1.1";
        let cases: Vec<(String, &str)> = vec![
            ("garbage, 10.1.1.1".into(), "10.1.1.1"),
            ("203.0.113.9, garbage".into(), "10.0.0.2"),
            (huge, "7.7.7.7"),
            ("[fe80::1%25eth0]:80, 10.1.1.1".into(), "fe80::/64"),
            ("fe80::1%eth0, 10.1.1.1".into(), "fe80::/64"),
            ("203.0.113.9:8080".into(), "203.0.113.9"),
            ("[2001:db8::1]:443".into(), "2001:db8::/64"),
            (",,,".into(), "10.0.0.2"),
            ("\"\"".into(), "10.0.0.2"),
            ("999.1.1.1".into(), "10.0.0.2"),
            (format!("{}, 10.1.1.1", "9".repeat(10_000)), "10.1.1.1"),
        ];
        for (value, expected) in cases {
            let headers = [("x-forwarded-for", value.as_str())];
            assert_eq!(
                key(&behind, "10.0.0.2:1", &headers),
                expected,
                "{value:.60}"
            );
        }
        // Bytes that are not text in the client's part of the line do not
        // hide the address its proxy appended.
        let mut raw = req("10.0.0.2:1", &[]);
        raw.headers_mut().insert(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.9").unwrap(),
        );
        assert_eq!(
            behind.extract(&raw).unwrap().as_deref(),
            Some("203.0.113.9")
        );
        // 5,000 trusted hops: only MAX_HOPS are walked; the client is not believed.
        let trusted_chain = vec!["10.5.5.5"; 5_000].join(", ");
        let headers = [("x-forwarded-for", trusted_chain.as_str())];
        assert_eq!(key(&behind, "10.0.0.2:1", &headers), "10.5.5.5");
    }

    #[test]
    fn ipv6_clients_are_grouped() {
        let direct = client_ip();
        assert_eq!(
            key(&direct, "[2001:db8:1:2:3:4:5:6]:1", &[]),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            key(
                &direct.clone().ipv6_prefix(48),
                "[2001:db8:1:2:3:4:5:6]:1",
                &[]
            ),
            "2001:db8:1::/48"
        );
        assert_eq!(
            key(&direct.ipv6_prefix(128), "[2001:db8:1:2:3:4:5:6]:1", &[]),
            "2001:db8:1:2:3:4:5:6"
        );
        assert_eq!(
            key(&client_ip(), "[::ffff:198.51.100.7]:1", &[]),
            "198.51.100.7"
        );
    }

    #[test]
    fn ipv4_mapped_hops_peers_and_cidrs_count_as_ipv4() {
        let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
        // A dual-stack proxy writes its IPv4 hop IPv4-mapped.
        let mapped_hop = [("x-forwarded-for", "203.0.113.9, ::ffff:10.0.0.5")];
        assert_eq!(key(&behind, "10.0.0.2:1", &mapped_hop), "203.0.113.9");
        let bracketed = [("x-forwarded-for", "203.0.113.9, [::ffff:10.0.0.5]:443")];
        assert_eq!(key(&behind, "10.0.0.2:1", &bracketed), "203.0.113.9");
        // A dual-stack listener gives the peer IPv4-mapped.
        let plain = [("x-forwarded-for", "203.0.113.9")];
        assert_eq!(key(&behind, "[::ffff:10.0.0.2]:1", &plain), "203.0.113.9");
        assert_eq!(
            key(&behind, "[::ffff:10.0.0.2]:1", &mapped_hop),
            "203.0.113.9"
        );
        // The client seen IPv4-mapped is the same client, with the same key.
        let mapped_client = [("x-forwarded-for", "::ffff:203.0.113.9, 10.0.0.5")];
        assert_eq!(key(&behind, "10.0.0.2:1", &mapped_client), "203.0.113.9");
        // Forwarded and X-Real-IP too.
        let fwd = behind.clone().header(ProxyHeader::Forwarded);
        let headers = [("forwarded", "for=203.0.113.9, for=\"[::ffff:10.0.0.5]\"")];
        assert_eq!(key(&fwd, "[::ffff:10.0.0.2]:1", &headers), "203.0.113.9");
        let real = behind.header(ProxyHeader::XRealIp);
        let headers = [("x-real-ip", "::ffff:203.0.113.9")];
        assert_eq!(key(&real, "[::ffff:10.0.0.2]:1", &headers), "203.0.113.9");
        // Trusted proxies written IPv4-mapped match both forms.
        for trusted in ["::ffff:10.0.0.0/104", "::ffff:10.0.0.2", "::ffff:a00:0/104"] {
            let mapped = client_ip().trusting([trusted]).unwrap();
            for peer in ["10.0.0.2:1", "[::ffff:10.0.0.2]:1"] {
                assert_eq!(
                    key(&mapped, peer, &plain),
                    "203.0.113.9",
                    "{trusted} {peer}"
                );
            }
        }
        let mapped = client_ip().trusting(["::ffff:10.0.0.0/104"]).unwrap();
        assert_eq!(key(&mapped, "10.0.0.2:1", &mapped_hop), "203.0.113.9");
        // Outside the mapped block: not trusted.
        assert_eq!(key(&mapped, "11.0.0.2:1", &plain), "11.0.0.2");
        // An IPv4-mapped address with a prefix reaching outside the mapped
        // block is a mistake (it would trust ::/8): named, not guessed.
        let err = client_ip().trusting(["::ffff:10.0.0.0/8"]).unwrap_err();
        assert!(err.to_string().contains("\"::ffff:10.0.0.0/8\""), "{err}");
        assert!(err.to_string().contains("(10.0.0.0/8)"), "{err}");
        assert!(err.to_string().contains("(::ffff:10.0.0.0/104)"), "{err}");
        // An IPv6 block never covers IPv4 peers, however they are written.
        let v6_only = client_ip().trusting(["::/0"]).unwrap();
        assert_eq!(key(&v6_only, "10.0.0.2:1", &plain), "10.0.0.2");
        assert_eq!(key(&v6_only, "[::ffff:10.0.0.2]:1", &plain), "10.0.0.2");
        assert_eq!(key(&v6_only, "[2001:db8::1]:1", &plain), "203.0.113.9");
    }

    #[test]
    fn x_real_ip_is_the_last_entry_the_trusted_proxy_wrote() {
        let real = client_ip()
            .trusting(["10.0.0.2"])
            .unwrap()
            .header(ProxyHeader::XRealIp);
        // A proxy that appends its line after the client's own.
        let appended = [("x-real-ip", "6.6.6.6"), ("x-real-ip", "203.0.113.5")];
        assert_eq!(key(&real, "10.0.0.2:1", &appended), "203.0.113.5");
        // The same lines combined into one, as an intermediary may.
        let combined = [("x-real-ip", "6.6.6.6, 203.0.113.5")];
        assert_eq!(key(&real, "10.0.0.2:1", &combined), "203.0.113.5");
        // A malformed last entry never falls back to the client's.
        let broken = [("x-real-ip", "6.6.6.6"), ("x-real-ip", "garbage")];
        assert_eq!(key(&real, "10.0.0.2:1", &broken), "10.0.0.2");
        let empty_last = [("x-real-ip", "6.6.6.6, ")];
        assert_eq!(key(&real, "10.0.0.2:1", &empty_last), "10.0.0.2");
        let mut raw = req("10.0.0.2:1", &[("x-real-ip", "6.6.6.6")]);
        raw.headers_mut().append(
            "x-real-ip",
            http::HeaderValue::from_bytes(b"\xff203.0.113.5").unwrap(),
        );
        assert_eq!(real.extract(&raw).unwrap().as_deref(), Some("10.0.0.2"));
    }

    #[test]
    fn forwarded_lines_are_one_list_in_order() {
        let fwd = client_ip()
            .trusting(["10.0.0.0/8"])
            .unwrap()
            .header(ProxyHeader::Forwarded);
        let lines = [
            ("forwarded", "for=6.6.6.6"),
            ("forwarded", "for=203.0.113.9;proto=https"),
            ("forwarded", "for=10.0.0.7, for=10.0.0.8"),
        ];
        assert_eq!(key(&fwd, "10.0.0.2:1", &lines), "203.0.113.9");
        // A malformed entry in a later line ends the walk there.
        let broken = [
            ("forwarded", "for=6.6.6.6"),
            ("forwarded", "for=_hidden, for=10.0.0.7"),
        ];
        assert_eq!(key(&fwd, "10.0.0.2:1", &broken), "10.0.0.7");
        let xff = client_ip().trusting(["10.0.0.0/8"]).unwrap();
        let lines = [
            ("x-forwarded-for", "6.6.6.6"),
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-for", "10.0.0.7"),
        ];
        assert_eq!(key(&xff, "10.0.0.2:1", &lines), "203.0.113.9");
    }

    #[test]
    fn bad_trusted_entries_are_named() {
        let err = client_ip()
            .trusting(["10.0.0.0/8", "ten.0.0.0/8"])
            .unwrap_err();
        assert!(err.to_string().contains("\"ten.0.0.0/8\""), "{err}");
        assert!(client_ip().trusting(["10.0.0.0/33"]).is_err());
        assert!(
            client_ip()
                .trusting(["::1", "2001:db8::/32", " 10.0.0.1 "])
                .is_ok()
        );
    }
}
