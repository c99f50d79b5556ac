//! The hosts the admin router serves: the address it is bound to, and the
//! names the operator lists. A page whose host is anything else (a name
//! an attacker's DNS points at the admin address: DNS rebinding) reaches
//! nothing, token or not.

use std::net::{IpAddr, SocketAddr};

use http::uri::Authority;

use super::AdminError;

/// The ports a request without one in its authority went to: its
/// scheme's default (an `Origin`, a URI's authority), or either of HTTP's
/// and HTTPS's when the scheme is not known (a `Host` header: browsers
/// leave the default port out of it, and a proxy that ends TLS passes it
/// on as it came).
#[derive(Debug, Clone, Copy)]
pub(crate) enum DefaultPort {
    /// `http`: 80.
    Http,
    /// `https`: 443.
    Https,
    /// 80 or 443.
    Either,
}

impl DefaultPort {
    /// The default port of `scheme` (`http`, `https`), or either.
    pub(crate) fn of(scheme: Option<&str>) -> Self {
        match scheme {
            Some(s) if s.eq_ignore_ascii_case("http") => Self::Http,
            Some(s) if s.eq_ignore_ascii_case("https") => Self::Https,
            _ => Self::Either,
        }
    }

    fn includes(self, port: u16) -> bool {
        match self {
            Self::Http => port == 80,
            Self::Https => port == 443,
            Self::Either => port == 80 || port == 443,
        }
    }
}

/// The authorities (`host[:port]`) a request may name.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    bound: SocketAddr,
    /// Lowercase, each with the port it must come with (any port if none).
    names: Vec<(String, Option<u16>)>,
}

impl Hosts {
    /// The hosts of a router bound to `bound`: that IP address, or any IP
    /// address when it is unspecified (`0.0.0.0`, `[::]`), with any port;
    /// and `localhost` with the bound port when it takes loopback
    /// connections. An IP address in a `Host` header is what the browser
    /// connected to, so no DNS answer can put another site's page there;
    /// its port may be another than the bound one when a port is mapped
    /// (`docker -p 19000:9000`, a Kubernetes Service's port). A DNS name
    /// can point anywhere: it has to be listed
    /// ([`with_name`](Self::with_name)).
    pub(crate) fn bound_to(bound: SocketAddr) -> Result<Self, AdminError> {
        if bound.port() == 0 {
            return Err(AdminError::PortNotBound { addr: bound });
        }
        Ok(Self {
            bound,
            names: Vec::new(),
        })
    }

    /// Also serve `name` (`host` for any port, or `host:port`).
    pub(crate) fn with_name(&mut self, name: &str) -> Result<(), AdminError> {
        let bad = || AdminError::BadHostName {
            name: name.to_owned(),
        };
        let authority: Authority = name.parse().map_err(|_| bad())?;
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return Err(bad());
        }
        let port = port_of(&authority).ok_or_else(bad)?;
        self.names
            .push((authority.host().to_ascii_lowercase(), port));
        Ok(())
    }

    /// Whether a request that names `authority` (a `Host` header, the
    /// URI's authority, an `Origin`'s) is for this router; without a port,
    /// it went to `default`.
    pub(crate) fn serves(&self, authority: &Authority, default: DefaultPort) -> bool {
        if authority.as_str().contains('@') {
            return false;
        }
        // Not a port number (`:99999`): no port it could have gone to.
        let Some(port) = port_of(authority) else {
            return false;
        };
        let went_to = |wanted: u16| port.map_or(default.includes(wanted), |port| port == wanted);
        let host = authority.host().to_ascii_lowercase();
        let listed = self
            .names
            .iter()
            .any(|(name, listed)| *name == host && listed.is_none_or(went_to));
        let ip = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&host)
            .parse::<IpAddr>()
            .ok();
        let bound_ip = self.bound.ip().to_canonical();
        let address = match ip {
            Some(ip) => bound_ip.is_unspecified() || ip.to_canonical() == bound_ip,
            None => {
                host == "localhost"
                    && (bound_ip.is_loopback() || bound_ip.is_unspecified())
                    && went_to(self.bound.port())
            }
        };
        listed || address
    }

    /// How an operator makes a refused host served, for a refusal: never
    /// the bound address (the client has shown no token yet).
    pub(crate) fn how_to_serve() -> &'static str {
        "the admin router answers only at the IP addresses it is bound to and the host names \
         listed with `Admin::with_host_name` (the example server's `ADMIN_HOST_NAMES`); \
         if operators reach it by this name, list it there"
    }
}

/// The port `authority` names: `Some(None)` if none, `None` if what
/// follows its host is no port number (`:99999`, `:`).
fn port_of(authority: &Authority) -> Option<Option<u16>> {
    match authority.port_u16() {
        Some(port) => Some(Some(port)),
        None if authority.as_str().len() == authority.host().len() => Some(None),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serves(hosts: &Hosts, authority: &str) -> bool {
        hosts.serves(&authority.parse().unwrap(), DefaultPort::Either)
    }

    #[test]
    fn a_specific_address_serves_itself_and_listed_names() {
        let mut hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        assert!(serves(&hosts, "10.0.0.7:9000"));
        for other in [
            "10.0.0.8:9000",
            "localhost:9000",
            "rebind.attacker.example:9000",
            "admin.internal:9000",
            "user@10.0.0.7:9000",
        ] {
            assert!(!serves(&hosts, other), "{other}");
        }
        hosts.with_name("Admin.Internal").unwrap();
        hosts.with_name("ops.example:8443").unwrap();
        assert!(serves(&hosts, "admin.internal:9000"));
        assert!(serves(&hosts, "ADMIN.internal"));
        assert!(serves(&hosts, "admin.internal:443"));
        assert!(serves(&hosts, "ops.example:8443"));
        assert!(!serves(&hosts, "ops.example"));
        assert!(!serves(&hosts, "ops.example:9000"));
        assert!(!serves(&hosts, "admin.internal.attacker.example:9000"));
    }

    #[test]
    fn loopback_and_unspecified_binds() {
        let loopback = Hosts::bound_to("127.0.0.1:9000".parse().unwrap()).unwrap();
        assert!(serves(&loopback, "127.0.0.1:9000"));
        assert!(serves(&loopback, "localhost:9000"));
        assert!(!serves(&loopback, "localhost:9001"));
        assert!(!serves(&loopback, "127.0.0.2:9000"));
        assert!(!serves(&loopback, "[::1]:9000"));
        let v6 = Hosts::bound_to("[::1]:80".parse().unwrap()).unwrap();
        assert!(serves(&v6, "[::1]:80"));
        assert!(serves(&v6, "[::1]"));
        assert!(serves(&v6, "localhost"));
        let any = Hosts::bound_to("0.0.0.0:9000".parse().unwrap()).unwrap();
        assert!(serves(&any, "10.1.2.3:9000"));
        assert!(serves(&any, "[fd00::7]:9000"));
        assert!(serves(&any, "localhost:9000"));
        assert!(!serves(&any, "rebind.attacker.example:9000"));
        // A decimal or hexadecimal spelling is no address here: refused.
        assert!(!serves(&any, "2130706433:9000"));
        let any_v6 = Hosts::bound_to("[::]:9000".parse().unwrap()).unwrap();
        assert!(serves(&any_v6, "192.0.2.1:9000"));
    }

    /// A port-mapped deployment (`docker -p 19000:9000`, a Kubernetes
    /// Service's port) reaches the router at another port than the one it
    /// is bound to: an IP address, which no DNS answer can rebind, is
    /// served with any port; a name only with its own.
    #[test]
    fn an_ip_address_is_served_with_any_port() {
        let specific = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        for served in [
            "10.0.0.7:19000",
            "10.0.0.7",
            "10.0.0.7:80",
            "[::ffff:10.0.0.7]:1",
        ] {
            assert!(serves(&specific, served), "{served}");
        }
        for refused in [
            "10.0.0.8:9000",
            "10.0.0.8:19000",
            "rebind.attacker.example:19000",
        ] {
            assert!(!serves(&specific, refused), "{refused}");
        }
        let any = Hosts::bound_to("0.0.0.0:9000".parse().unwrap()).unwrap();
        for served in ["192.168.1.5:19000", "[fd00::7]:30080", "10.96.0.12"] {
            assert!(serves(&any, served), "{served}");
        }
        assert!(!serves(&any, "rebind.attacker.example:19000"));
        // `localhost` is a name: served with the bound port only.
        let loopback = Hosts::bound_to("127.0.0.1:9000".parse().unwrap()).unwrap();
        assert!(serves(&loopback, "127.0.0.1:19000"));
        assert!(!serves(&loopback, "localhost:19000"));
        // A port that is no port names nothing.
        assert!(!serves(&specific, "10.0.0.7:99999"));
    }

    /// Browsers leave a scheme's default port out of `Host`: a name listed
    /// with port 443 or 80 is served without one.
    #[test]
    fn a_name_listed_with_a_default_port_is_served_without_one() {
        let mut hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        hosts.with_name("admin.internal:443").unwrap();
        hosts.with_name("ops.example:80").unwrap();
        hosts.with_name("other.example:8443").unwrap();
        for served in [
            "admin.internal",
            "admin.internal:443",
            "ops.example",
            "ops.example:80",
        ] {
            assert!(serves(&hosts, served), "{served}");
        }
        for refused in [
            "admin.internal:80",
            "ops.example:443",
            "other.example",
            "admin.internal:99999",
        ] {
            assert!(!serves(&hosts, refused), "{refused}");
        }
    }

    #[test]
    fn a_port_not_bound_yet_or_a_bad_name_is_refused() {
        assert!(matches!(
            Hosts::bound_to("127.0.0.1:0".parse().unwrap()),
            Err(AdminError::PortNotBound { .. })
        ));
        let mut hosts = Hosts::bound_to("127.0.0.1:9000".parse().unwrap()).unwrap();
        for bad in [
            "",
            "a b",
            "user@host",
            "host/path",
            ":80",
            "host:99999",
            "host:",
        ] {
            assert!(
                matches!(hosts.with_name(bad), Err(AdminError::BadHostName { .. })),
                "{bad:?}"
            );
        }
    }
}
