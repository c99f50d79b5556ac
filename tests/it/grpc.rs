//! The layer on a real tonic server (tonic-health), called by a real tonic
//! client over loopback, sharing one Redis budget with an axum HTTP route.
#![cfg(feature = "tonic")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use crate::support::RedisServer;
use crate::support::http::{ok_router, raw_get};
use tonic::Code;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower_redis_ratelimit::rules::RulesLayer;
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{Limiter, Policy, RateLimitLayer, RedisStore, key};

/// The health service's name, for `set_serving`.
type HealthService =
    tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>;

/// A health service behind `layer`, on a free loopback port (a macro: the
/// health service's type cannot be named).
macro_rules! serve_health {
    ($layer:expr) => {{
        let layer = $layer;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_serving::<HealthService>().await;
        tokio::spawn(async move {
            Server::builder()
                .layer(layer)
                .add_service(health)
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        addr
    }};
}

/// A health service behind `limiter`, on a free loopback port.
async fn grpc_server<K>(limiter: RateLimitLayer<K>) -> SocketAddr
where
    K: tower_redis_ratelimit::key::KeyExtractor<tonic::body::Body>,
{
    serve_health!(limiter)
}

/// A health service behind `rules`, on a free loopback port.
async fn rules_grpc_server(rules: RulesLayer) -> SocketAddr {
    serve_health!(rules)
}

async fn client(addr: SocketAddr) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

fn check() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

#[tokio::test]
async fn calls_are_limited_with_resource_exhausted_and_retry_metadata() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, "3/10s".parse::<Policy>().unwrap()).with_name("grpc"),
        key::peer_ip(),
    );
    let addr = grpc_server(limiter).await;
    let mut client = client(addr).await;
    for remaining in ["2", "1", "0"] {
        let response = client.check(check()).await.unwrap();
        assert_eq!(response.metadata().get("x-ratelimit-limit").unwrap(), "3");
        assert_eq!(
            response.metadata().get("x-ratelimit-remaining").unwrap(),
            remaining
        );
    }
    let status = client.check(check()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // The 10 s window, plus up to twice the `Transaction` clock tolerance
    // (a few ms) near its end, rounded up to whole seconds.
    let retry = status
        .metadata()
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(matches!(retry, "10" | "11"), "retry-after {retry}");
    assert!(
        status.message().contains(&format!("retry in {retry} s")),
        "{}",
        status.message()
    );
    assert_eq!(status.metadata().get("x-ratelimit-remaining").unwrap(), "0");
    // The key is the peer address, read from tonic's TcpConnectInfo.
    let keys = server.command(&["KEYS", "rl:log:*"]);
    assert!(keys.contains("rl:log:{grpc:127.0.0.1}"), "{keys}");
}

/// A gRPC service and an axum route limited under the same name and key
/// share one budget in Redis.
#[tokio::test]
async fn grpc_and_http_share_one_budget() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "3/10s".parse().unwrap();
    let grpc_addr = grpc_server(RateLimitLayer::from_limiter(
        Limiter::new(store.clone(), policy.clone()).with_name("api"),
        key::global(),
    ))
    .await;
    let app = ok_router(RateLimitLayer::from_limiter(
        Limiter::new(store, policy).with_name("api"),
        key::global(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let mut grpc = client(grpc_addr).await;
    grpc.check(check()).await.unwrap();
    assert!(raw_get(http_addr, "/").await.starts_with("HTTP/1.1 200"));
    grpc.check(check()).await.unwrap();
    // The budget of 3 is spent, by both together.
    assert!(raw_get(http_addr, "/").await.starts_with("HTTP/1.1 429"));
    let status = grpc.check(check()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn rules_limit_a_grpc_method_and_refuse_callers_outside_an_only_list() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = RuleSet::from_toml(
        r#"
        [[rules]]
        name = "health"
        grpc = "/grpc.health.v1.Health/Check"
        key = "ip"
        policy = "2/h"

        [[rules]]
        name = "watch"
        grpc = "/grpc.health.v1.Health/Watch"
        key = "header:x-app"
        policy = "10/h"
        only = ["monitor"]
        "#,
    )
    .unwrap();
    let addr = rules_grpc_server(RulesLayer::new(Rules::new(store, rules))).await;
    let mut client = client(addr).await;
    for remaining in ["1", "0"] {
        let response = client.check(check()).await.unwrap();
        assert_eq!(response.metadata().get("x-ratelimit-limit").unwrap(), "2");
        assert_eq!(
            response.metadata().get("x-ratelimit-remaining").unwrap(),
            remaining
        );
    }
    let status = client.check(check()).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Watch lets only the "monitor" app call.
    let status = client.watch(check()).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let mut request = tonic::Request::new(check());
    request
        .metadata_mut()
        .insert("x-app", "monitor".parse().unwrap());
    assert!(client.watch(request).await.is_ok());
}
