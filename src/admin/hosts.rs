//! The hosts the admin router serves: the address it is bound to, and the
//! names the operator lists. A page whose host is anything else (a name
//! an attacker's DNS points at the admin address: DNS rebinding) reaches
//! nothing, token or not.

use std::net::{IpAddr, SocketAddr};

use http::uri::Authority;

use super::AdminError;

/// The authorities (`host[:port]`) a request may name.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    bound: SocketAddr,
    /// Lowercase, each with the port it must come with (any port if none).
    names: Vec<(String, Option<u16>)>,
}

impl Hosts {
    /// The hosts of a router bound to `bound`: that address with its
    /// port; any IP address with that port when it is unspecified
    /// (`0.0.0.0`, `[::]`); and `localhost` with that port when it takes
    /// loopback connections. A DNS name can point anywhere: it has to be
    /// listed ([`with_name`](Self::with_name)). An IP address in a `Host`
    /// header is what the browser connected to, so no DNS answer can put
    /// another site's page there.
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
        self.names
            .push((authority.host().to_ascii_lowercase(), authority.port_u16()));
        Ok(())
    }

    /// Whether a request that names `authority` (a `Host` header, the
    /// URI's authority, an `Origin`'s) is for this router.
    pub(crate) fn serves(&self, authority: &Authority) -> bool {
        if authority.as_str().contains('@') {
            return false;
        }
        let host = authority.host().to_ascii_lowercase();
        let port = authority.port_u16();
        let listed = self
            .names
            .iter()
            .any(|(name, listed)| *name == host && (listed.is_none() || *listed == port));
        // Without a port, the request went to HTTP's 80.
        let bound_port = port.unwrap_or(80) == self.bound.port();
        let ip = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&host)
            .parse::<IpAddr>()
            .ok();
        let bound_ip = self.bound.ip().to_canonical();
        let address = match ip {
            Some(ip) => bound_ip.is_unspecified() || ip.to_canonical() == bound_ip,
            None => host == "localhost" && (bound_ip.is_loopback() || bound_ip.is_unspecified()),
        };
        listed || (bound_port && address)
    }

    /// How an operator makes `authority` served, for a refusal.
    pub(crate) fn how_to_serve(&self) -> String {
        format!(
            "the admin router answers only at the address it is bound to ({}) and the host \
             names given to `Admin::with_host_name`; if operators reach it by this name, list it there",
            self.bound
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serves(hosts: &Hosts, authority: &str) -> bool {
        hosts.serves(&authority.parse().unwrap())
    }

    #[test]
    fn a_specific_address_serves_itself_and_listed_names() {
        let mut hosts = Hosts::bound_to("10.0.0.7:9000".parse().unwrap()).unwrap();
        assert!(serves(&hosts, "10.0.0.7:9000"));
        for other in [
            "10.0.0.7:9001",
            "10.0.0.7",
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
        let v6 = Hosts::bound_to("[::1]:80".parse().unwrap()).unwrap();
        assert!(serves(&v6, "[::1]:80"));
        assert!(serves(&v6, "[::1]"));
        assert!(serves(&v6, "localhost"));
        let any = Hosts::bound_to("0.0.0.0:9000".parse().unwrap()).unwrap();
        assert!(serves(&any, "10.1.2.3:9000"));
        assert!(serves(&any, "[fd00::7]:9000"));
        assert!(serves(&any, "localhost:9000"));
        assert!(!serves(&any, "10.1.2.3:9001"));
        assert!(!serves(&any, "rebind.attacker.example:9000"));
        // A decimal or hexadecimal spelling is no address here: refused.
        assert!(!serves(&any, "2130706433:9000"));
        let any_v6 = Hosts::bound_to("[::]:9000".parse().unwrap()).unwrap();
        assert!(serves(&any_v6, "192.0.2.1:9000"));
    }

    #[test]
    fn a_port_not_bound_yet_or_a_bad_name_is_refused() {
        assert!(matches!(
            Hosts::bound_to("127.0.0.1:0".parse().unwrap()),
            Err(AdminError::PortNotBound { .. })
        ));
        let mut hosts = Hosts::bound_to("127.0.0.1:9000".parse().unwrap()).unwrap();
        for bad in ["", "a b", "user@host", "host/path", ":80"] {
            assert!(
                matches!(hosts.with_name(bad), Err(AdminError::BadHostName { .. })),
                "{bad:?}"
            );
        }
    }
}
