//! The circuit breaker through the layer, against a real redis-server:
//! configurations at the edges never panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::http::{PEER, request, status};
use axum::body::Body;
use http::{Request, StatusCode};
use tower_redis_ratelimit::limiter::CircuitBreaker;
use tower_redis_ratelimit::{FailMode, Limiter, Policy, RateLimitLayer, RedisStore, key};

/// `cooldown: Duration::MAX` ("never probe"): the first failure opens the
/// circuit for good — no panic, and the store is never asked again, even
/// once it is back.
#[tokio::test]
async fn a_cooldown_of_duration_max_opens_the_circuit_for_good() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, "100/s".parse::<Policy>().unwrap())
            .with_fail_mode(FailMode::Closed)
            .with_circuit_breaker(CircuitBreaker::new(1, Duration::MAX)),
        key::global(),
    );
    let service =
        tower::ServiceBuilder::new()
            .layer(limiter)
            .service_fn(|_req: Request<Body>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("ok")))
            });
    assert_eq!(status(&service, request("/", PEER)).await, StatusCode::OK);
    server.kill();
    let failed = tokio::spawn({
        let service = service.clone();
        async move { status(&service, request("/", PEER)).await }
    })
    .await;
    assert_eq!(
        failed.expect("the first failure panicked"),
        StatusCode::SERVICE_UNAVAILABLE
    );
    server.restart();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(
            status(&service, request("/", PEER)).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert!(
            started.elapsed() < Duration::from_millis(50),
            "answered after {:?}: the store was asked",
            started.elapsed()
        );
    }
    let checks: u64 = ["evalsha", "eval", "multi", "exec"]
        .iter()
        .map(|command| server.calls(command))
        .sum();
    assert_eq!(checks, 0, "the store was asked");
}
