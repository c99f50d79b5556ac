//! A throwaway certificate authority and `redis-server`s that speak TLS,
//! for the `tls` feature's tests. Keys are generated in the test (rcgen)
//! and written to the server's own directory only.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use super::RedisServer;

/// A certificate authority made for one test.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct Pair {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { issuer }
    }

    /// The CA's certificate (what a client trusts).
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for `names` (host names or IP addresses). It
    /// serves as a client certificate too: Redis presents it to the other
    /// cluster nodes and to its primary.
    pub fn server(&self, names: &[&str]) -> Pair {
        self.issue(
            names,
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )
    }

    /// A client certificate (mutual TLS).
    pub fn client(&self, name: &str) -> Pair {
        self.issue(&[name], vec![ExtendedKeyUsagePurpose::ClientAuth])
    }

    fn issue(&self, names: &[&str], usages: Vec<ExtendedKeyUsagePurpose>) -> Pair {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names.clone()).unwrap();
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        params.extended_key_usages = usages;
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pair {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

/// Write `contents` to `dir/name` and return the path.
fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// The `redis-server` arguments that make it serve TLS on `tls_port` with
/// `server` (files written to `dir`), trusting `ca` for client
/// certificates, which it requires when `auth_clients`.
pub fn tls_args(
    dir: &Path,
    tls_port: u16,
    ca: &Ca,
    server: &Pair,
    auth_clients: bool,
) -> Vec<String> {
    let cert = write(dir, "server.crt", &server.cert);
    let key = write(dir, "server.key", &server.key);
    let ca_file = write(dir, "ca.crt", &ca.pem());
    vec![
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        cert.display().to_string(),
        "--tls-key-file".into(),
        key.display().to_string(),
        "--tls-ca-cert-file".into(),
        ca_file.display().to_string(),
        "--tls-auth-clients".into(),
        if auth_clients { "yes" } else { "no" }.into(),
    ]
}

/// A `redis-server` with a TLS port beside its plain one (the plain one is
/// the tests' back door: readiness, `INFO`, `ACL SETUSER`).
pub struct TlsRedis {
    pub server: RedisServer,
    pub tls_port: u16,
    _dir: tempdir::Dir,
}

impl TlsRedis {
    /// Serve TLS with a certificate for `names`, signed by `ca`.
    pub fn start(ca: &Ca, names: &[&str], auth_clients: bool) -> Self {
        let dir = tempdir::Dir::new("tls");
        let pair = ca.server(names);
        let (server, tls_port) = RedisServer::start_with_port(|tls_port| {
            tls_args(dir.path(), tls_port, ca, &pair, auth_clients)
        });
        Self {
            server,
            tls_port,
            _dir: dir,
        }
    }

    /// `rediss://host:tls_port`.
    pub fn url(&self, host: &str) -> String {
        format!("rediss://{host}:{}", self.tls_port)
    }

    /// How many TLS connections the server has accepted
    /// (`INFO stats`: `total_connections_received` counts both ports, so
    /// this reads the clients' `laddr` ports instead).
    pub fn tls_clients(&self) -> usize {
        let list = self.server.command(&["CLIENT", "LIST"]);
        let port = format!(":{} ", self.tls_port);
        list.lines()
            .filter(|line| {
                line.split(' ')
                    .find_map(|field| field.strip_prefix("laddr="))
                    .is_some_and(|laddr| format!("{laddr} ").contains(&port))
            })
            .count()
    }
}

/// A temporary directory removed on drop.
pub mod tempdir {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(name: &str) -> Self {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("trr-{name}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
