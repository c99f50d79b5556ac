//! The layer on an axum Router: headers, 429, unlimited routes, missing
//! ConnectInfo, fail modes, and a real socket.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::http::{header, raw_get, request, send};
use axum::body::Body;
use axum::routing::get;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::response::HeaderStyle;
use tower_redis_ratelimit::{
    Decision, FailMode, Limiter, MemoryStore, Policy, RateLimitLayer, RedisStore, Store, key,
};

fn app<St: Store>(store: St, policy: &str) -> Router {
    app_with(RateLimitLayer::new(
        store,
        policy.parse::<Policy>().unwrap(),
        key::peer_ip(),
    ))
}

fn app_with<K>(limiter: RateLimitLayer<K>) -> Router
where
    K: key::KeyExtractor<Body>,
{
    Router::new()
        .route("/", get(|| async { "hello" }))
        .route(
            "/remaining",
            get(|Extension(d): Extension<Decision>| async move { d.remaining().to_string() }),
        )
        .route_layer(limiter)
        .route("/health", get(|| async { "ok" }))
}

#[tokio::test]
async fn every_limited_response_carries_the_headers_and_the_429_says_when() {
    let app = app(MemoryStore::new(), "3/10s");
    for remaining in ["2", "1", "0"] {
        let (res, body) = send(&app, request("/", "198.51.100.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(body, "hello");
        assert_eq!(header(&res, "x-ratelimit-limit"), Some("3"));
        assert_eq!(header(&res, "x-ratelimit-remaining"), Some(remaining));
        assert_eq!(header(&res, "x-ratelimit-reset"), Some("10"));
    }
    let (res, body) = send(&app, request("/", "198.51.100.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("10"));
    assert_eq!(header(&res, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(
        header(&res, "content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert!(
        body.contains("Too many requests") && body.contains("10 s"),
        "{body}"
    );
    // Another client has its own budget.
    let (res, _) = send(&app, request("/", "198.51.100.2")).await;
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn health_is_not_limited() {
    let app = app(MemoryStore::new(), "1/10s");
    for _ in 0..20 {
        let (res, body) = send(&app, request("/health", "198.51.100.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(body, "ok");
        assert!(header(&res, "x-ratelimit-limit").is_none());
    }
}

#[tokio::test]
async fn a_key_closure_returning_none_passes_requests_through() {
    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        "1/10s".parse::<Policy>().unwrap(),
        |req: &Request<Body>| {
            req.headers()
                .get("x-internal")
                .is_none()
                .then_some("public")
        },
    );
    let app = app_with(limiter);
    let internal = || {
        let mut req = request("/", "198.51.100.1");
        req.headers_mut().insert("x-internal", "1".parse().unwrap());
        req
    };
    for _ in 0..5 {
        assert_eq!(send(&app, internal()).await.0.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&app, request("/", "198.51.100.1")).await.0.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, request("/", "198.51.100.1")).await.0.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn the_handler_sees_the_decision() {
    let app = app(MemoryStore::new(), "5/10s");
    let (_, body) = send(&app, request("/remaining", "198.51.100.1")).await;
    assert_eq!(body, "4");
}

#[tokio::test]
async fn forwarded_headers_cannot_choose_the_key() {
    let app = app(MemoryStore::new(), "2/10s");
    for (i, status) in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ]
    .into_iter()
    .enumerate()
    {
        let mut req = request("/", "198.51.100.1");
        let spoofed = format!("203.0.113.{i}");
        req.headers_mut()
            .insert("x-forwarded-for", spoofed.parse().unwrap());
        req.headers_mut()
            .insert("x-real-ip", spoofed.parse().unwrap());
        assert_eq!(send(&app, req).await.0.status(), status);
    }
}

#[tokio::test]
async fn missing_connect_info_is_a_500_that_says_how_to_fix_it() {
    let app = app(MemoryStore::new(), "5/10s");
    let req = Request::get("/").body(Body::empty()).unwrap();
    let (res, body) = send(&app, req).await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        body.contains("into_make_service_with_connect_info"),
        "{body}"
    );
    // Unlimited routes are unaffected.
    let (res, _) = send(&app, Request::get("/health").body(Body::empty()).unwrap()).await;
    assert_eq!(res.status(), StatusCode::OK);
}

/// A client that waits `Retry-After` and retries alone is admitted, with
/// Redis and both executions.
#[tokio::test]
async fn waiting_retry_after_is_enough() {
    let server = RedisServer::start();
    for execution in [Execution::Transaction, Execution::Script] {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let policy = "2/1500ms"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let app = app_with(RateLimitLayer::new(store, policy, key::peer_ip()));
        let peer = if execution == Execution::Script {
            "10.0.0.1"
        } else {
            "10.0.0.2"
        };
        assert_eq!(
            send(&app, request("/", peer)).await.0.status(),
            StatusCode::OK
        );
        assert_eq!(
            send(&app, request("/", peer)).await.0.status(),
            StatusCode::OK
        );
        let (res, _) = send(&app, request("/", peer)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let secs: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
        assert_eq!(secs, 2, "1.5 s rounds up to 2");
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let (res, _) = send(&app, request("/", peer)).await;
        assert_eq!(res.status(), StatusCode::OK, "{execution:?}");
    }
}

/// A burst right after the first admission is told to wait the window, not
/// a second more (the Transaction execution's clock padding once rounded
/// `Retry-After` up to 3 for `2/2s`), with Redis and both executions.
#[tokio::test]
async fn retry_after_of_a_burst_is_the_window() {
    let server = RedisServer::start();
    for (execution, peer) in [
        (Execution::Transaction, "10.0.0.3"),
        (Execution::Script, "10.0.0.4"),
    ] {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let policy = "2/2s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let app = app_with(RateLimitLayer::new(store, policy, key::peer_ip()));
        for _ in 0..2 {
            let (res, _) = send(&app, request("/", peer)).await;
            assert_eq!(res.status(), StatusCode::OK);
        }
        let (res, _) = send(&app, request("/", peer)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&res, "retry-after").unwrap(), "2", "{execution:?}");
        assert_eq!(
            header(&res, "x-ratelimit-reset").unwrap(),
            "2",
            "{execution:?}"
        );
    }
}

/// Redis hung: FailMode::Open admits without headers, FailMode::Closed
/// answers 503; both within the timeout plus a margin.
#[tokio::test]
async fn fail_modes_when_redis_hangs() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(150));
    let policy: Policy = "5/10s".parse().unwrap();
    let open = app_with(RateLimitLayer::new(
        store.clone(),
        policy.clone(),
        key::peer_ip(),
    ));
    let closed = app_with(RateLimitLayer::from_limiter(
        Limiter::new(store, policy).with_fail_mode(FailMode::Closed),
        key::peer_ip(),
    ));
    assert_eq!(
        send(&open, request("/", "10.0.0.1")).await.0.status(),
        StatusCode::OK
    );
    server.signal("STOP");
    for (app, expected) in [
        (&open, StatusCode::OK),
        (&closed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let started = Instant::now();
        let (res, _) = send(app, request("/", "10.0.0.1")).await;
        let took = started.elapsed();
        assert_eq!(res.status(), expected);
        assert!(header(&res, "x-ratelimit-limit").is_none());
        assert!(took < Duration::from_millis(650), "answered after {took:?}");
    }
    server.signal("CONT");
    // Limiting resumes once Redis answers again. (How many requests count by
    // then depends on what Redis ran after it woke: a timed-out script may
    // still count; a timed-out transaction's entry is taken back out.)
    let (res, _) = send(&closed, request("/", "10.0.0.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(header(&res, "x-ratelimit-remaining").is_some());
}

/// Under `FailMode::Fallback` the headers describe the limit the fallback
/// enforces (each rate's max divided among the instances), in both styles,
/// under the same policy names as when Redis answers.
#[tokio::test]
async fn fallback_headers_describe_the_limit_the_fallback_enforces() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, "8/10s, 40/min".parse::<Policy>().unwrap())
            .with_fail_mode(FailMode::fallback(MemoryStore::new(), 4)),
        key::peer_ip(),
    )
    .with_headers(HeaderStyle::Both)
    .with_problem_json();
    let app = app_with(limiter);
    let (res, _) = send(&app, request("/", "10.0.0.1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some(r#""8/10s";q=8;w=10, "40/min";q=40;w=60"#)
    );
    assert_eq!(header(&res, "x-ratelimit-limit"), Some("8"));

    server.kill();
    // This instance now allows a quarter: 2 per 10 s, 10 per minute.
    let fallback_policy = r#""8/10s";q=2;w=10, "40/min";q=10;w=60"#;
    for remaining in ["1", "0"] {
        let (res, _) = send(&app, request("/", "10.0.0.1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(&res, "ratelimit-policy"), Some(fallback_policy));
        assert_eq!(header(&res, "x-ratelimit-limit"), Some("2"));
        assert_eq!(header(&res, "x-ratelimit-remaining"), Some(remaining));
        let ratelimit = header(&res, "ratelimit").unwrap();
        assert!(
            ratelimit.starts_with(&format!(r#""8/10s";r={remaining};t="#)),
            "{ratelimit}"
        );
    }
    let (res, body) = send(&app, request("/", "10.0.0.1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "ratelimit-policy"), Some(fallback_policy));
    assert_eq!(header(&res, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&res, "x-ratelimit-remaining"), Some("0"));
    let ratelimit = header(&res, "ratelimit").unwrap();
    assert!(ratelimit.starts_with(r#""8/10s";r=0;t="#), "{ratelimit}");
    // The violated policy is named as in RateLimit-Policy.
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["violated-policies"], serde_json::json!(["8/10s"]));
}

/// The whole set-up of the quick start over a real socket: axum::serve with
/// ConnectInfo, a plain HTTP/1.1 client.
#[tokio::test]
async fn over_a_real_socket() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let app = app(store, "2/10s");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(raw_get(addr, "/").await);
    }
    assert!(statuses[0].starts_with("HTTP/1.1 200"), "{}", statuses[0]);
    assert!(
        statuses[0]
            .to_ascii_lowercase()
            .contains("x-ratelimit-remaining: 1")
    );
    assert!(statuses[2].starts_with("HTTP/1.1 429"), "{}", statuses[2]);
    // The 10 s window, plus up to twice the `Transaction` clock tolerance
    // (a few ms) near its end, rounded up to whole seconds.
    let denied = statuses[2].to_ascii_lowercase();
    assert!(
        denied.contains("retry-after: 10\r\n") || denied.contains("retry-after: 11\r\n"),
        "{denied}"
    );
    // The limit was counted under the peer address.
    let keys = server.command(&["KEYS", "rl:log:*"]);
    assert!(keys.contains("rl:log:{2/10s:127.0.0.1}"), "{keys}");
}
