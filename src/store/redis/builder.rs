//! [`RedisStoreBuilder`]: how a [`RedisStore`] connects (pool size, TLS
//! certificates, Redis Sentinel).

use std::fmt;

use bb8_redis::bb8;
#[cfg(any(feature = "tls", feature = "sentinel"))]
use redis::IntoConnectionInfo;
use redis::{ErrorKind, RedisError};

use super::RedisStore;
use super::call::within;
use super::connection::{Connections, TrackedManager};
use crate::store::StoreError;

/// How a [`RedisStore`] connects: the settings that must be known before
/// the first connection. Start from [`RedisStore::builder`]; the settings of
/// a connected store (prefix, timeout, batches) are its own `with_*`
/// methods.
///
/// ```no_run
/// use tower_redis_ratelimit::RedisStore;
///
/// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
/// let store = RedisStore::builder()
///     .pool_size(32)
///     .connect("redis://127.0.0.1:6379")
///     .await?
///     .with_prefix("myapp:rl");
/// # Ok(()) }
/// ```
///
/// With the `tls` feature, `rediss://` URLs connect over TLS (rustls):
/// the server's certificate is checked against the system's roots, or only
/// against [`root_certificate`][crate::store::RedisStoreBuilder::root_certificate]; a server whose
/// certificate does not match its host name, or is signed by no trusted
/// root, is refused. [`client_certificate`][crate::store::RedisStoreBuilder::client_certificate]
/// presents a certificate to a Redis that asks for one (mutual TLS,
/// `tls-auth-clients yes`).
#[cfg_attr(not(feature = "tls"), doc = links_without!("tls"))]
#[derive(Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    pool_size: u32,
    #[cfg(feature = "tls")]
    root_certificate: Option<Vec<u8>>,
    #[cfg(feature = "tls")]
    client_certificate: Option<redis::ClientTlsConfig>,
    #[cfg(feature = "sentinel")]
    sentinel_credentials: Option<(Option<String>, String)>,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            pool_size: RedisStore::DEFAULT_POOL_SIZE,
            #[cfg(feature = "tls")]
            root_certificate: None,
            #[cfg(feature = "tls")]
            client_certificate: None,
            #[cfg(feature = "sentinel")]
            sentinel_credentials: None,
        }
    }
}

impl fmt::Debug for RedisStoreBuilder {
    /// Whether certificates and credentials are set, never their contents.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("RedisStoreBuilder");
        out.field("pool_size", &self.pool_size);
        #[cfg(feature = "tls")]
        out.field("root_certificate", &self.root_certificate.is_some())
            .field("client_certificate", &self.client_certificate.is_some());
        #[cfg(feature = "sentinel")]
        out.field("sentinel_credentials", &self.sentinel_credentials.is_some());
        out.finish()
    }
}

impl RedisStoreBuilder {
    /// The most connections the store's pool opens (default
    /// [`RedisStore::DEFAULT_POOL_SIZE`]). Checks are multiplexed: this is
    /// the number of sockets they are spread over, not a bound on checks in
    /// flight. `0` is refused by `connect`.
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections;
        self
    }

    /// Trust only this CA (PEM: one or more certificates) for `rediss://`
    /// servers, instead of the system's roots: e.g. a private CA that signs
    /// your Redis servers' certificates. Applies to the Redis nodes and, in
    /// a `rediss+sentinel://` deployment, the Sentinels.
    #[cfg(feature = "tls")]
    pub fn root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_certificate = Some(pem.into());
        self
    }

    /// Present this certificate (PEM) and its private key (PEM, PKCS#8 or
    /// RSA or SEC1) to `rediss://` servers that ask for one: mutual TLS.
    #[cfg(feature = "tls")]
    pub fn client_certificate(
        mut self,
        certificate_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.client_certificate = Some(redis::ClientTlsConfig {
            client_cert: certificate_pem.into(),
            client_key: key_pem.into(),
        });
        self
    }

    /// Authenticate to the Sentinels (not to Redis: the Redis primary's
    /// credentials come from the `redis+sentinel://` URL) with this user
    /// (`None`: the default user) and password, for Sentinels configured
    /// with `requirepass` or an ACL.
    #[cfg(feature = "sentinel")]
    pub fn sentinel_credentials(mut self, username: Option<&str>, password: &str) -> Self {
        self.sentinel_credentials = Some((username.map(str::to_owned), password.to_owned()));
        self
    }

    /// The certificates set on this builder, if any.
    #[cfg(feature = "tls")]
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        (self.root_certificate.is_some() || self.client_certificate.is_some()).then(|| {
            redis::TlsCertificates {
                client_tls: self.client_certificate.clone(),
                root_cert: self.root_certificate.clone(),
            }
        })
    }

    /// A client for one Redis, with this builder's certificates.
    fn client(&self, url: &str) -> Result<redis::Client, RedisError> {
        #[cfg(feature = "tls")]
        if let Some(certificates) = self.certificates() {
            let info = url.into_connection_info()?;
            if !matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. }) {
                return Err(config_error(
                    "TLS certificates are set but the URL is not rediss://",
                ));
            }
            return redis::Client::build_with_tls(info, certificates);
        }
        redis::Client::open(url)
    }

    /// Connect to the Redis at `url`, as [`RedisStore::connect`] does, with
    /// this builder's settings. URLs:
    /// - `redis://[user:password@]host:port[/db]`, `unix:///path/to.sock`;
    /// - `rediss://…`: TLS (`tls` feature);
    /// - `redis+sentinel://[user:password@]host[:port][,host[:port]…]/service[/db]`
    ///   (`sentinel` feature): the primary of `service`, as the Sentinels
    ///   at those addresses name it; see [`connect_sentinel`][crate::store::RedisStoreBuilder::connect_sentinel].
    ///   `rediss+sentinel://` speaks TLS to the Sentinels and to Redis.
    ///
    /// # Errors
    /// A malformed URL, a pool size of 0, TLS certificates with a URL that
    /// is not `rediss://`, a refused connection, a failed TLS handshake (a
    /// certificate that does not match), failed authentication, or no
    /// answer within [`RedisStore::CONNECT_TIMEOUT`].
    #[cfg_attr(not(feature = "sentinel"), doc = links_without!("sentinel"))]
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        #[cfg(feature = "tls")]
        if url.starts_with("rediss") {
            ensure_crypto_provider();
        }
        #[cfg(feature = "sentinel")]
        if let Some(sentinel) = sentinel_url(url) {
            return self.connect_sentinel_url(sentinel).await;
        }
        #[cfg(not(feature = "sentinel"))]
        if url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://") {
            return Err(config_error(
                "a redis+sentinel:// URL needs the crate's `sentinel` feature",
            )
            .into());
        }
        let manager = TrackedManager::from_client(self.client(url)?);
        self.pooled(manager).await
    }

    /// A pool of `manager`'s connections, opened and checked: one direct
    /// connection first, so a refused connection, a failed handshake or a
    /// wrong password is reported as such (the pool would only say it timed
    /// out); it then joins the pool.
    async fn pooled(self, manager: TrackedManager) -> Result<RedisStore, StoreError> {
        if self.pool_size == 0 {
            return Err(config_error("the pool size must be at least 1").into());
        }
        let mut conn = tokio::time::timeout(RedisStore::CONNECT_TIMEOUT, async {
            let mut conn = manager.open().await?;
            redis::cmd("PING").query_async::<()>(conn.conn()).await?;
            Ok::<_, StoreError>(conn)
        })
        .await
        .unwrap_or(Err(StoreError::Timeout(RedisStore::CONNECT_TIMEOUT)))?;
        let pool = bb8::Pool::builder()
            .max_size(self.pool_size)
            // Broken connections are dropped by the manager: no PING on
            // every checkout. The store's timeout bounds the wait.
            .test_on_check_out(false)
            .connection_timeout(RedisStore::CONNECT_TIMEOUT)
            .build_unchecked(manager);
        let store = RedisStore::from_tracked_pool(pool);
        within(store.timeout, store.clock.measure(conn.conn())).await?;
        if let Connections::Tracked(pool, _) = &store.connections {
            // Fails only when the pool is full, and it is empty.
            let _ = pool.add(conn);
        }
        Ok(store)
    }

    /// Connect to a Redis Cluster, as [`RedisStore::connect_cluster`] does,
    /// with this builder's certificates (`rediss://` seeds: TLS to every
    /// node). The pool size does not apply: the cluster client holds one
    /// multiplexed connection per node.
    ///
    /// # Errors
    /// As [`RedisStore::connect_cluster`], and TLS certificates with seeds
    /// that are not `rediss://`.
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster<T: AsRef<str>>(
        self,
        nodes: &[T],
    ) -> Result<RedisStore, StoreError> {
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        #[cfg(feature = "tls")]
        if nodes.iter().any(|node| node.starts_with("rediss://")) {
            ensure_crypto_provider();
        }
        #[allow(unused_mut)]
        let mut builder = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            // The store's timeout bounds every call (retries included).
            .connection_timeout(RedisStore::CONNECT_TIMEOUT)
            .overall_response_timeout(None)
            // The store retries what may be repeated (see connect_cluster).
            .retries(0);
        #[cfg(feature = "tls")]
        if let Some(certificates) = self.certificates() {
            if !nodes.iter().all(|node| node.starts_with("rediss://")) {
                return Err(config_error(
                    "TLS certificates are set but a cluster seed URL is not rediss://",
                )
                .into());
            }
            builder = builder.certs(certificates);
        }
        let client = builder.build()?;
        let conn = tokio::time::timeout(RedisStore::CONNECT_TIMEOUT, async {
            let mut conn = client.get_async_connection().await?;
            super::connection::ping_every_master(&mut conn).await?;
            Ok::<_, StoreError>(conn)
        })
        .await
        .unwrap_or(Err(StoreError::Timeout(RedisStore::CONNECT_TIMEOUT)))?;
        let mut measuring = conn.clone();
        let store = RedisStore::from_cluster_connection(conn);
        within(store.timeout, store.clock.measure(&mut measuring)).await?;
        Ok(store)
    }

    /// Connect to the primary of `service`, as the Sentinels at `sentinels`
    /// (`host:port` each, e.g. `["10.0.0.1:26379", "10.0.0.2:26379"]`; the
    /// port defaults to 26379) name it, as [`RedisStore::connect_sentinel`]
    /// does, with this builder's settings. For credentials, a database or
    /// TLS on the Redis side, use a `redis+sentinel://` URL with
    /// [`connect`](Self::connect).
    ///
    /// # Errors
    /// No Sentinel given, a malformed address, no Sentinel that knows a
    /// healthy primary for `service`, or the errors of
    /// [`connect`](Self::connect).
    #[cfg(feature = "sentinel")]
    pub async fn connect_sentinel<T: AsRef<str>>(
        self,
        sentinels: &[T],
        service: &str,
    ) -> Result<RedisStore, StoreError> {
        if service.is_empty() {
            return Err(config_error("the Sentinel service name is empty").into());
        }
        let parsed = ParsedSentinel {
            sentinels: sentinel_addrs(sentinels.iter().map(AsRef::as_ref), false)?,
            service: service.to_owned(),
            username: None,
            password: None,
            db: 0,
        };
        self.connect_parsed_sentinel(parsed, false).await
    }

    #[cfg(feature = "sentinel")]
    async fn connect_sentinel_url(self, url: SentinelUrl<'_>) -> Result<RedisStore, StoreError> {
        let parsed = parse_sentinel_url(url)?;
        self.connect_parsed_sentinel(parsed, url.tls).await
    }

    #[cfg(feature = "sentinel")]
    async fn connect_parsed_sentinel(
        self,
        parsed: ParsedSentinel,
        tls: bool,
    ) -> Result<RedisStore, StoreError> {
        #[cfg(feature = "tls")]
        if tls {
            ensure_crypto_provider();
        }
        #[cfg(feature = "tls")]
        if self.certificates().is_some() && !tls {
            return Err(config_error(
                "TLS certificates are set but the Sentinel connection is not TLS \
                 (TLS needs a rediss+sentinel:// URL, given to connect)",
            )
            .into());
        }
        // The Sentinels are asked one at a time, each through a client of
        // its own.
        let each = parsed
            .sentinels
            .iter()
            .map(|sentinel| self.sentinel_client(vec![sentinel.clone()], &parsed, tls))
            .collect::<Result<Vec<_>, _>>()?;
        let all = self.sentinel_client(parsed.sentinels.clone(), &parsed, tls)?;
        let manager = TrackedManager::from_sentinels(all, each, &parsed.service);
        self.pooled(manager).await
    }

    /// A client of `sentinels` for the service of `parsed`, with every
    /// setting of the URL and of this builder.
    #[cfg(feature = "sentinel")]
    fn sentinel_client(
        &self,
        sentinels: Vec<redis::ConnectionAddr>,
        parsed: &ParsedSentinel,
        tls: bool,
    ) -> Result<redis::sentinel::SentinelClient, RedisError> {
        use redis::sentinel::{SentinelClientBuilder, SentinelServerType};

        let mut builder =
            SentinelClientBuilder::new(sentinels, &parsed.service, SentinelServerType::Master)?;
        if tls {
            builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        }
        if let Some(username) = &parsed.username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = &parsed.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if parsed.db != 0 {
            builder = builder.set_client_to_redis_db(parsed.db);
        }
        if let Some((username, password)) = &self.sentinel_credentials {
            if let Some(username) = username {
                builder = builder.set_client_to_sentinel_username(username);
            }
            builder = builder.set_client_to_sentinel_password(password);
        }
        #[cfg(feature = "tls")]
        if let Some(certificates) = self.certificates() {
            builder = builder
                .set_client_to_redis_certificates(certificates.clone())
                .set_client_to_sentinel_certificates(certificates);
        }
        builder.build()
    }
}

/// A `redis+sentinel://` or `rediss+sentinel://` URL, without its scheme.
#[cfg(feature = "sentinel")]
#[derive(Clone, Copy)]
struct SentinelUrl<'a> {
    tls: bool,
    rest: &'a str,
}

#[cfg(feature = "sentinel")]
fn sentinel_url(url: &str) -> Option<SentinelUrl<'_>> {
    if let Some(rest) = url.strip_prefix("redis+sentinel://") {
        Some(SentinelUrl { tls: false, rest })
    } else {
        url.strip_prefix("rediss+sentinel://")
            .map(|rest| SentinelUrl { tls: true, rest })
    }
}

/// What a Sentinel URL says.
#[cfg(feature = "sentinel")]
struct ParsedSentinel {
    sentinels: Vec<redis::ConnectionAddr>,
    service: String,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

/// The port a Sentinel listens on unless its address says otherwise.
#[cfg(feature = "sentinel")]
const SENTINEL_PORT: u16 = 26379;

/// The addresses of Sentinels given as `host[:port]` (IPv6 in brackets),
/// read by redis-rs's URL parser; the port defaults to 26379.
#[cfg(feature = "sentinel")]
fn sentinel_addrs<'a>(
    hosts: impl IntoIterator<Item = &'a str>,
    tls: bool,
) -> Result<Vec<redis::ConnectionAddr>, RedisError> {
    let scheme = if tls { "rediss" } else { "redis" };
    let mut addrs = Vec::new();
    for host in hosts {
        if host.is_empty() {
            return Err(config_error("a Sentinel address is empty"));
        }
        if host.contains(['/', '?', '#', '@']) {
            return Err(config_error(
                "a Sentinel address is host or host:port, nothing more",
            ));
        }
        // "h", "[::1]": no port; "h:1", "[::1]:1": a port.
        let has_port = match host.rsplit_once(']') {
            Some((_, after)) => after.starts_with(':'),
            None => host.contains(':'),
        };
        let url = if has_port {
            format!("{scheme}://{host}")
        } else {
            format!("{scheme}://{host}:{SENTINEL_PORT}")
        };
        addrs.push(url.into_connection_info()?.addr().clone());
    }
    if addrs.is_empty() {
        return Err(config_error("a Sentinel URL lists at least one host:port"));
    }
    Ok(addrs)
}

/// `[user:password@]host[:port][,host[:port]…]/service[/db]`, each part
/// read by redis-rs's own URL parser (percent-decoding, IPv6 in brackets).
/// A Sentinel's port defaults to 26379. Query parameters are refused
/// rather than ignored.
#[cfg(feature = "sentinel")]
fn parse_sentinel_url(url: SentinelUrl<'_>) -> Result<ParsedSentinel, RedisError> {
    if url.rest.contains(['?', '#']) {
        return Err(config_error(
            "a Sentinel URL takes no query parameters or fragment (?…, #…)",
        ));
    }
    let (authority, path) = url.rest.split_once('/').unwrap_or((url.rest, ""));
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let mut parts = path.split('/').filter(|part| !part.is_empty());
    let service = parts
        .next()
        .ok_or_else(|| config_error("a Sentinel URL names its service: .../service[/db]"))?
        .to_owned();
    let db = parts.next().unwrap_or("0");
    if parts.next().is_some() {
        return Err(config_error(
            "a Sentinel URL's path is /service or /service/db",
        ));
    }
    if hosts.is_empty() {
        return Err(config_error("a Sentinel URL lists at least one host:port"));
    }
    let sentinels = sentinel_addrs(hosts.split(','), url.tls)?;
    // The credentials and the database, decoded as redis-rs decodes them
    // (on a placeholder host).
    let scheme = if url.tls { "rediss" } else { "redis" };
    let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    let node = format!("{scheme}://{userinfo}localhost/{db}").into_connection_info()?;
    let settings = node.redis_settings();
    Ok(ParsedSentinel {
        sentinels,
        service,
        username: settings.username().map(str::to_owned),
        password: settings.password().map(str::to_owned),
        db: settings.db(),
    })
}

/// Make rustls's `ring` provider the process's default unless the
/// application installed one: redis-rs builds its TLS configurations with
/// the process default, and rustls cannot pick one by itself when both of
/// its providers are compiled in (another crate enabling `aws-lc-rs`).
/// Called only for TLS URLs, so that a store without TLS leaves the
/// process default to the application.
#[cfg(feature = "tls")]
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn config_error(message: &'static str) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, message))
}

#[cfg(test)]
mod tests;
