//! The `metrics` feature: decision counters and store latency, read back
//! through metrics-util's debugging recorder.
#![cfg(feature = "metrics")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use crate::support::RedisServer;
use crate::support::http::{PEER, request};
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::Request;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::ServiceExt;
use tower_redis_ratelimit::{Limiter, Policy, RateLimitLayer, RedisStore};

/// The limiter's name, found in no other test.
const NAME: &str = "metrics-test-api";

#[tokio::test]
async fn decisions_and_store_latency_are_counted_per_policy() {
    let _alone = crate::alone().await;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, "2/10s".parse::<Policy>().unwrap())
            .with_name(NAME)
            .without_deny_cache(),
        |req: &Request<Body>| (req.uri().path() != "/health").then_some("client"),
    );
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/health", get(|| async { "ok" }))
        .layer(limiter);
    for _ in 0..5 {
        app.clone().oneshot(request("/", PEER)).await.unwrap();
    }
    app.clone().oneshot(request("/health", PEER)).await.unwrap();
    // Redis stopped: two store errors (timeouts), admitted by FailMode::Open.
    server.signal("STOP");
    for _ in 0..2 {
        app.clone().oneshot(request("/", PEER)).await.unwrap();
    }
    server.signal("CONT");

    let mut counters = HashMap::new();
    let mut latencies = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: HashMap<String, String> = key
            .key()
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        // One recorder for the whole test binary: other tests' limiters
        // report to it too, under their own names.
        if labels.get("policy").map(String::as_str) != Some(NAME) {
            continue;
        }
        match (key.key().name(), value) {
            ("ratelimit_decisions_total", DebugValue::Counter(n)) => {
                counters.insert(labels["outcome"].clone(), n);
            }
            ("ratelimit_store_seconds", DebugValue::Histogram(values)) => latencies += values.len(),
            (name, value) => panic!("unexpected metric {name}: {value:?}"),
        }
    }
    assert_eq!(counters.get("allowed"), Some(&2), "{counters:?}");
    assert_eq!(counters.get("limited"), Some(&3), "{counters:?}");
    assert_eq!(counters.get("skipped"), Some(&1), "{counters:?}");
    assert_eq!(counters.get("store_error"), Some(&2), "{counters:?}");
    assert_eq!(latencies, 7, "one latency per store call");
}
