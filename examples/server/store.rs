//! Connecting to Redis as `REDIS_URL` and its companions say, or to
//! PostgreSQL as `DATABASE_URL` says.

use tower_redis_ratelimit::RedisStore;

use crate::settings::{BadSetting, var};

pub(crate) async fn connect_redis(url: &str) -> Result<RedisStore, BadSetting> {
    let batches = batches()?;
    let store = redis_builder()?.connect(url).await.map_err(|error| {
        let hint = if url.starts_with("rediss") && !cfg!(feature = "tls") {
            " (TLS needs the tls feature: cargo run --example server --features tls)"
        } else {
            ""
        };
        let url = without_password(url);
        BadSetting::new(
            "REDIS_URL",
            format!("cannot use Redis at {url}: {error}{hint}"),
        )
    })?;
    Ok(store.with_batches(batches))
}

/// The store of the Redis Cluster whose seed nodes `REDIS_CLUSTER` lists.
#[cfg(feature = "cluster")]
pub(crate) async fn connect_redis_cluster(nodes: &[String]) -> Result<RedisStore, BadSetting> {
    let batches = batches()?;
    let store = redis_builder()?
        .connect_cluster(nodes)
        .await
        .map_err(|error| {
            BadSetting::new(
                "REDIS_CLUSTER",
                format!(
                    "cannot use the Redis Cluster at {}: {error}",
                    cluster_nodes(nodes)
                ),
            )
        })?;
    Ok(store.with_batches(batches))
}

/// `BATCHES`: how many batches of commands may be in flight at once.
fn batches() -> Result<usize, BadSetting> {
    match var("BATCHES")? {
        None => Ok(RedisStore::DEFAULT_BATCHES_IN_FLIGHT),
        Some(text) => text.trim().parse().map_err(|_| {
            BadSetting::new("BATCHES", format!("{text:?} is not a number of batches"))
        }),
    }
}

/// A cluster's seed nodes, for logs: comma-separated, without passwords.
pub(crate) fn cluster_nodes(nodes: &[String]) -> String {
    nodes
        .iter()
        .map(|node| without_password(node))
        .collect::<Vec<_>>()
        .join(",")
}

/// The store of `DATABASE_URL`, its table made when missing.
#[cfg(feature = "postgres")]
pub(crate) async fn connect_postgres(
    url: &str,
) -> Result<tower_redis_ratelimit::PostgresStore, BadSetting> {
    tower_redis_ratelimit::PostgresStore::connect(url)
        .await
        // Not the URL: it may hold a password.
        .map_err(|error| BadSetting::new("DATABASE_URL", format!("cannot use PostgreSQL: {error}")))
}

/// A client for the rule set's Redis (`RULES=redis`), with the TLS
/// certificates of `REDIS_CA_CERT`, `REDIS_CLIENT_CERT`, `REDIS_CLIENT_KEY`.
pub(crate) fn rules_client(url: &str) -> Result<redis::Client, BadSetting> {
    if url.contains("+sentinel://") {
        return Err(BadSetting::new(
            "RULES",
            "`redis` with a Sentinel URL is not supported (the rule set's pub/sub would not follow a failover): use a rules file",
        ));
    }
    #[cfg(feature = "tls")]
    if url.starts_with("rediss://") {
        let read = |name: &'static str| -> Result<Option<Vec<u8>>, BadSetting> {
            var(name)?
                .map(|path| {
                    std::fs::read(&path)
                        .map_err(|error| BadSetting::new(name, format!("{path}: {error}")))
                })
                .transpose()
        };
        let client_tls = match (read("REDIS_CLIENT_CERT")?, read("REDIS_CLIENT_KEY")?) {
            (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
            _ => None,
        };
        let certificates = redis::TlsCertificates {
            client_tls,
            root_cert: read("REDIS_CA_CERT")?,
        };
        return redis::Client::build_with_tls(url, certificates)
            .map_err(|error| BadSetting::new("REDIS_URL", error));
    }
    redis::Client::open(url).map_err(|error| BadSetting::new("REDIS_URL", error))
}

/// The connection settings: TLS certificates from `REDIS_CA_CERT`,
/// `REDIS_CLIENT_CERT` and `REDIS_CLIENT_KEY` (PEM files).
pub(crate) fn redis_builder() -> Result<tower_redis_ratelimit::store::RedisStoreBuilder, BadSetting>
{
    #[allow(unused_mut)]
    let mut builder = RedisStore::builder();
    let ca = var("REDIS_CA_CERT")?;
    let client = (var("REDIS_CLIENT_CERT")?, var("REDIS_CLIENT_KEY")?);
    #[cfg(feature = "tls")]
    {
        let read = |name: &'static str, path: &str| {
            std::fs::read(path).map_err(|error| BadSetting::new(name, format!("{path}: {error}")))
        };
        if let Some(path) = ca {
            builder = builder.root_certificate(read("REDIS_CA_CERT", &path)?);
        }
        match client {
            (Some(cert), Some(key)) => {
                builder = builder.client_certificate(
                    read("REDIS_CLIENT_CERT", &cert)?,
                    read("REDIS_CLIENT_KEY", &key)?,
                );
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(BadSetting::new(
                    "REDIS_CLIENT_KEY",
                    "REDIS_CLIENT_CERT needs its key",
                ));
            }
            (None, Some(_)) => {
                return Err(BadSetting::new(
                    "REDIS_CLIENT_CERT",
                    "REDIS_CLIENT_KEY needs its certificate",
                ));
            }
        }
    }
    #[cfg(not(feature = "tls"))]
    if ca.is_some() || client.0.is_some() || client.1.is_some() {
        return Err(BadSetting::new(
            "REDIS_CA_CERT",
            "TLS certificates need the tls feature: cargo run --example server --features tls",
        ));
    }
    Ok(builder)
}

/// `url` without the password, for logs: `redis://user:secret@host` →
/// `redis://user@host`.
pub(crate) fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((user_info, host)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match user_info.split_once(':') {
        Some(("", _)) => format!("{scheme}://{host}"),
        Some((user, _)) => format!("{scheme}://{user}@{host}"),
        None => url.to_owned(),
    }
}
