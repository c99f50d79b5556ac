//! The layer on a real tonic server (tonic-health), called by a real tonic
//! client over loopback, sharing one Redis budget with an axum HTTP route;
//! costs settled from a server stream's trailing metadata or messages.
#![cfg(feature = "tonic")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::http::{ok_router, raw_get};
use crate::support::units::settles_to;
use futures_util::StreamExt as _;
use tonic::metadata::MetadataMap;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower_redis_ratelimit::response::{BodyPart, Settlement};
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

// --- Costs settled from a call --------------------------------------------

/// A health service whose `Watch` streams answers — `ready` of them at
/// once, then `paced` one at a time — and ends with `end`: a status
/// whose metadata goes to the trailers, or none (a bare `grpc-status: 0`).
#[derive(Clone)]
struct Metered {
    ready: usize,
    paced: usize,
    end: Option<Status>,
}

/// `status` with `usage-tokens: tokens` in its metadata. A tonic service
/// cannot add trailing metadata to a stream that simply ends (tonic writes
/// a bare `grpc-status: 0`): it ends the stream with `Err` of a status
/// whose code is `Ok`, and tonic writes that status, metadata included,
/// as the trailers (`grpc-status: 0`: the client sees a stream that
/// succeeded).
fn with_usage(code: Code, tokens: u64) -> Status {
    let mut metadata = MetadataMap::new();
    metadata.insert("usage-tokens", tokens.into());
    Status::with_metadata(code, "", metadata)
}

#[tonic::async_trait]
impl Health for Metered {
    async fn check(
        &self,
        _: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        Ok(Response::new(HealthCheckResponse::default()))
    }

    type WatchStream = tonic::codegen::BoxStream<HealthCheckResponse>;

    async fn watch(
        &self,
        _: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let ready = futures_util::stream::iter((0..self.ready).map(|_| Ok(Default::default())));
        let paced = futures_util::stream::unfold(self.paced, |left| async move {
            if left == 0 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            Some((Ok(HealthCheckResponse::default()), left - 1))
        });
        let end = futures_util::stream::iter(self.end.clone().map(Err));
        Ok(Response::new(Box::pin(ready.chain(paced).chain(end))))
    }
}

/// `service` behind `layer` on a free loopback port.
async fn metered_server(layer: RateLimitLayer<key::Global>, service: Metered) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        Server::builder()
            .layer(layer)
            .add_service(HealthServer::new(service))
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

/// A limiter of 1,000 units a day (GCRA: nothing refills within a test)
/// estimating each call at 100, on a fresh Redis.
async fn tokens(server: &RedisServer) -> Limiter {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = "1000/86400s"
        .parse::<Policy>()
        .unwrap()
        .gcra()
        .unwrap()
        .with_cost(100)
        .unwrap();
    Limiter::new(store, policy).with_name("tokens")
}

/// The messages of a watch, and its trailing metadata (or its status, if
/// it failed).
async fn watch_to_the_end(addr: SocketAddr) -> (usize, Result<Option<MetadataMap>, Status>) {
    let mut stream = client(addr)
        .await
        .watch(check())
        .await
        .unwrap()
        .into_inner();
    let mut messages = 0;
    loop {
        match stream.message().await {
            Ok(Some(_)) => messages += 1,
            Ok(None) => return (messages, stream.trailers().await),
            Err(status) => return (messages, Err(status)),
        }
    }
}

#[tokio::test]
async fn a_server_stream_settles_from_its_trailing_metadata() {
    let server = RedisServer::start();
    let limiter = tokens(&server).await;
    let usage = http::HeaderName::from_static("usage-tokens");
    let layer = RateLimitLayer::from_limiter(limiter.clone(), key::global())
        .with_settlement(Settlement::new().from_header(usage).strip_header())
        .unwrap();

    // A stream that succeeds, its usage in the trailing metadata.
    let service = Metered {
        ready: 0,
        paced: 3,
        end: Some(with_usage(Code::Ok, 42)),
    };
    let addr = metered_server(layer.clone(), service).await;
    let (messages, trailers) = watch_to_the_end(addr).await;
    assert_eq!(messages, 3);
    let trailers = trailers.expect("the stream succeeded").unwrap();
    assert!(
        trailers.get("usage-tokens").is_none(),
        "stripped: {trailers:?}"
    );
    settles_to(&limiter, "global", 1000 - 42).await;

    // A stream that fails after 2 answers, its usage in the status's
    // metadata (the trailers too): charged as well.
    let service = Metered {
        ready: 0,
        paced: 2,
        end: Some(with_usage(Code::Unavailable, 7)),
    };
    let addr = metered_server(layer.clone(), service).await;
    let (messages, status) = watch_to_the_end(addr).await;
    assert_eq!(messages, 2);
    let status = status.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.metadata().get("usage-tokens").is_none(), "stripped");
    settles_to(&limiter, "global", 1000 - 42 - 7).await;

    // A stream that reports nothing: the estimate stands.
    let service = Metered {
        ready: 0,
        paced: 2,
        end: None,
    };
    let addr = metered_server(layer, service).await;
    assert_eq!(watch_to_the_end(addr).await.0, 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    settles_to(&limiter, "global", 1000 - 49 - 100).await;
}

/// A gRPC message on the wire: a flag byte, a 4-byte big-endian length,
/// the payload. Under tonic a data frame of the response body is what its
/// encoder yields: every message ready when it was polled (up to 32 KiB),
/// each whole, so one frame may hold several messages (never part of
/// one). A meter of messages reads the prefixes.
fn messages_in(part: BodyPart<'_>) -> Option<u64> {
    let BodyPart::Data(mut frame) = part else {
        return None;
    };
    let mut messages = 0;
    while let Some(prefix) = frame.get(..5) {
        let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
        frame = frame.get(5 + length as usize..).unwrap_or_default();
        messages += 1;
    }
    Some(messages)
}

#[tokio::test]
async fn a_server_stream_settles_from_its_messages_when_it_ends() {
    let server = RedisServer::start();
    let limiter = tokens(&server).await;
    let frames = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&frames);
    let settlement = Settlement::new().from_body(move |part| {
        if matches!(part, BodyPart::Data(_)) {
            counted.fetch_add(1, Ordering::Relaxed);
        }
        messages_in(part)
    });
    let layer = RateLimitLayer::from_limiter(limiter.clone(), key::global())
        .with_settlement(settlement)
        .unwrap();
    // 10 answers ready at once, then 5 paced: 15 messages.
    let service = Metered {
        ready: 10,
        paced: 5,
        end: None,
    };
    let addr = metered_server(layer, service).await;
    let (messages, trailers) = watch_to_the_end(addr).await;
    assert_eq!(messages, 15);
    assert!(trailers.is_ok());
    settles_to(&limiter, "global", 1000 - 15).await;
    // Fewer frames than messages: the ready ones shared frames, so a
    // meter counting frames would have charged less.
    let frames = frames.load(Ordering::Relaxed);
    assert!(frames < 15, "{frames} data frames for 15 messages");
    eprintln!("15 messages in {frames} data frames");
}
