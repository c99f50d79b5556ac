//! TLS (`tls` feature): `rediss://` through rustls with every connection
//! source (`connect`, a tracked pool, a ConnectionManager, the cluster),
//! custom root certificates and client certificates (mutual TLS), against
//! `redis-server --tls-port` with a CA generated in the test. A server whose
//! certificate does not match is refused, with an error that says why.
#![cfg(feature = "tls")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use crate::support::RedisServer;
use crate::support::tls::{Ca, TlsRedis};
use bb8_redis::bb8::Pool;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::TrackedManager;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

/// Every algorithm admits 3 of 4 checks of one key through `store`.
async fn limits_exactly(store: &RedisStore, key: &str) {
    // What is tested is that TLS is spoken, not the store's timeout: a
    // store's first check opens its connection, and a (mutual) TLS
    // handshake on a loaded two-core CI machine once took longer than the
    // default 250 ms (`Timeout(250ms)` from a tracked pool's first check).
    let store = &store
        .clone()
        .with_timeout(std::time::Duration::from_secs(5));
    let base: Policy = "3/60s".parse().unwrap();
    for (i, policy) in [
        base.clone().with_execution(Execution::Transaction).unwrap(),
        base.clone().with_execution(Execution::Script).unwrap(),
        base.clone().fixed_window().unwrap(),
        base.clone().sliding_window().unwrap(),
        base.clone().gcra().unwrap(),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("{key}-{i}");
        let mut admitted = 0;
        for _ in 0..4 {
            if store.check(&key, &policy).await.unwrap().allowed() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 3, "{policy:?}");
    }
}

fn error_text(result: Result<RedisStore, StoreError>) -> String {
    match result {
        Ok(_) => panic!("connected, but the connection should have been refused"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn rediss_connects_with_a_custom_root_and_limits() {
    let ca = Ca::new("test CA");
    let redis = TlsRedis::start(&ca, &["localhost", "127.0.0.1"], false);
    for host in ["localhost", "127.0.0.1"] {
        let store = RedisStore::builder()
            .root_certificate(ca.pem())
            .connect(&redis.url(host))
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        store.ping().await.unwrap();
        limits_exactly(&store, host).await;
        assert!(redis.tls_clients() >= 1, "no client on the TLS port");
    }
}

#[tokio::test]
async fn a_server_certificate_that_does_not_match_is_refused() {
    let ca = Ca::new("test CA");
    // Issued for another host.
    let redis = TlsRedis::start(&ca, &["redis.other.example"], false);
    let error = error_text(
        RedisStore::builder()
            .root_certificate(ca.pem())
            .connect(&redis.url("127.0.0.1"))
            .await,
    );
    assert!(
        error.contains("certificate not valid for name \"127.0.0.1\""),
        "{error}"
    );

    // Signed by a CA the client does not trust (the system's roots, or
    // another test CA).
    let redis = TlsRedis::start(&ca, &["localhost"], false);
    let error = error_text(RedisStore::connect(&redis.url("localhost")).await);
    assert!(
        error.contains("certificate") && error.contains("UnknownIssuer"),
        "{error}"
    );
    let other = Ca::new("another CA");
    let error = error_text(
        RedisStore::builder()
            .root_certificate(other.pem())
            .connect(&redis.url("localhost"))
            .await,
    );
    assert!(error.contains("UnknownIssuer"), "{error}");
    // Nothing was counted through any of them.
    assert_eq!(redis.server.command(&["DBSIZE"]).trim(), ":0");
}

#[tokio::test]
async fn mutual_tls_needs_the_client_certificate() {
    let ca = Ca::new("test CA");
    let redis = TlsRedis::start(&ca, &["localhost"], true);
    // Redis asks for a client certificate: without one the handshake
    // fails with the server's alert (TLS 1.3: at the first read).
    let without = RedisStore::builder()
        .root_certificate(ca.pem())
        .connect(&redis.url("localhost"))
        .await;
    let without = error_text(without);
    assert!(without.contains("CertificateRequired"), "{without}");

    // A client certificate from another CA is refused too.
    let stranger = Ca::new("stranger").client("app");
    let refused = RedisStore::builder()
        .root_certificate(ca.pem())
        .client_certificate(stranger.cert, stranger.key)
        .connect(&redis.url("localhost"))
        .await;
    let refused = error_text(refused);
    assert!(refused.contains("UnknownCA"), "{refused}");

    let client = ca.client("app");
    let store = RedisStore::builder()
        .root_certificate(ca.pem())
        .client_certificate(client.cert, client.key)
        .connect(&redis.url("localhost"))
        .await
        .unwrap();
    limits_exactly(&store, "mtls").await;
}

#[tokio::test]
async fn certificates_with_a_plain_url_are_a_configuration_error() {
    let ca = Ca::new("test CA");
    let plain = RedisServer::start();
    let error = error_text(
        RedisStore::builder()
            .root_certificate(ca.pem())
            .connect(&plain.url())
            .await,
    );
    assert!(error.contains("not rediss://"), "{error}");
    let error = error_text(
        RedisStore::builder()
            .pool_size(0)
            .connect(&plain.url())
            .await,
    );
    assert!(error.contains("pool size"), "{error}");
}

#[tokio::test]
async fn a_tracked_pool_and_a_connection_manager_speak_tls() {
    let ca = Ca::new("test CA");
    let client_pair = ca.client("app");
    let redis = TlsRedis::start(&ca, &["localhost"], true);
    let certificates = redis::TlsCertificates {
        client_tls: Some(redis::ClientTlsConfig {
            client_cert: client_pair.cert.into_bytes(),
            client_key: client_pair.key.into_bytes(),
        }),
        root_cert: Some(ca.pem().into_bytes()),
    };
    let client = redis::Client::build_with_tls(redis.url("localhost"), certificates).unwrap();

    let pool = Pool::builder()
        .max_size(4)
        .test_on_check_out(false)
        .build(TrackedManager::from_client(client.clone()))
        .await
        .unwrap();
    let store = RedisStore::from_tracked_pool(pool);
    limits_exactly(&store, "pool").await;

    let config = redis::aio::ConnectionManagerConfig::new()
        .set_number_of_retries(0)
        .set_response_timeout(None);
    let manager = client
        .get_connection_manager_with_config(config)
        .await
        .unwrap();
    let store = RedisStore::from_connection_manager(manager);
    limits_exactly(&store, "manager").await;
}

/// A cluster of three TLS-only nodes (`--port 0`, TLS between the nodes
/// too), joined at their TLS ports.
#[cfg(feature = "cluster")]
#[tokio::test]
async fn the_cluster_speaks_tls() {
    use support::tls::tls_args;

    let ca = Ca::new("test CA");
    let dir = support::tls::tempdir::Dir::new("tls-cluster");
    let server_pair = ca.server(&["localhost", "127.0.0.1"]);
    let mut nodes = Vec::new();
    let mut tls_ports = Vec::new();
    for i in 0..3 {
        let node_dir = dir.path().join(format!("node{i}"));
        std::fs::create_dir_all(&node_dir).unwrap();
        let (node, tls_port) = RedisServer::start_with_port(|tls_port| {
            let mut args = tls_args(&node_dir, tls_port, &ca, &server_pair, false);
            args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
            args.extend(support::CLUSTER_NODE_ARGS.map(String::from));
            args
        });
        nodes.push(node);
        tls_ports.push(tls_port);
    }
    // The nodes' plain ports answer CLUSTER INFO; they meet each other
    // through their TLS ports.
    support::create_cluster(&tls_ports, "TLS cluster", &nodes, |_| true);
    let urls: Vec<String> = tls_ports
        .iter()
        .map(|p| format!("rediss://127.0.0.1:{p}"))
        .collect();
    let store = RedisStore::builder()
        .root_certificate(ca.pem())
        .connect_cluster(&urls)
        .await
        .unwrap();
    store.ping().await.unwrap();
    // Keys on every node (these twelve hash to all three).
    for i in 0..12 {
        limits_exactly(&store, &format!("cluster-{i}")).await;
    }
    let populated = nodes
        .iter()
        .filter(|node| node.command(&["DBSIZE"]).trim() != ":0")
        .count();
    assert_eq!(populated, 3, "keys landed on {populated} node(s)");

    // Certificates with a plain seed are refused.
    let plain: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let error = error_text(
        RedisStore::builder()
            .root_certificate(ca.pem())
            .connect_cluster(&plain)
            .await,
    );
    assert!(error.contains("not rediss://"), "{error}");
}
