//! Rejection strategies, header styles and concurrency leases through an
//! axum Router.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::http::{PEER, get_root, header, request};
use axum::body::Body;
use axum::routing::get;
use axum::{Router, body::Bytes};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_redis_ratelimit::response::{HeaderStyle, Rejection};
use tower_redis_ratelimit::{Limiter, MemoryStore, Policy, RateLimitLayer, Store, key};

fn app<St: Store>(
    store: St,
    policy: Policy,
    configure: impl FnOnce(RateLimitLayer<key::PeerIp>) -> RateLimitLayer<key::PeerIp>,
) -> Router {
    let limiter = configure(RateLimitLayer::new(store, policy, key::peer_ip()));
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(limiter)
}

fn policy(text: &str) -> Policy {
    text.parse().unwrap()
}

#[tokio::test]
async fn shadow_mode_decides_but_never_blocks() {
    let app = app(MemoryStore::new(), policy("2/10s"), |l| {
        l.with_rejection(Rejection::Shadow)
    });
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let (res, body) = get_root(&app).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(body, "hello");
        remaining.push(header(&res, "x-ratelimit-remaining").unwrap().to_owned());
    }
    assert_eq!(remaining, ["1", "0", "0", "0", "0"]);
}

#[tokio::test]
async fn delay_shapes_requests_that_would_soon_be_admitted() {
    let shaped = app(MemoryStore::new(), policy("2/400ms"), |l| {
        l.with_rejection(Rejection::delay(Duration::from_secs(1)))
    });
    let started = Instant::now();
    for _ in 0..4 {
        let (res, _) = get_root(&shaped).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    // The third and fourth waited for the first two to leave the window.
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(390), "took {took:?}");

    let impatient = app(MemoryStore::new(), policy("2/10s"), |l| {
        l.with_rejection(Rejection::delay(Duration::from_millis(100)))
    });
    get_root(&impatient).await;
    get_root(&impatient).await;
    let started = Instant::now();
    let (res, _) = get_root(&impatient).await;
    assert_eq!(
        res.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a 10 s wait exceeds max_wait"
    );
    assert!(started.elapsed() < Duration::from_millis(100));
}

#[tokio::test]
async fn custom_rejection_builds_the_response() {
    let degrade = Rejection::custom(|decision| {
        let mut response = http::Response::new(Bytes::from(format!(
            "{{\"degraded\":true,\"limit\":{}}}",
            decision.limit()
        )));
        response
            .headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        response
    });
    let app = app(MemoryStore::new(), policy("1/10s"), |l| {
        l.with_rejection(degrade)
    });
    get_root(&app).await;
    let (res, body) = get_root(&app).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body, "{\"degraded\":true,\"limit\":1}");
    assert_eq!(header(&res, "retry-after"), Some("10"));
    assert_eq!(header(&res, "x-ratelimit-remaining"), Some("0"));
}

/// The names of the policies in a `RateLimit-Policy` value.
fn policy_names(field: &str) -> Vec<String> {
    field
        .split(", ")
        .map(|item| item.split(';').next().unwrap().trim_matches('"').to_owned())
        .collect()
}

/// A denial as problem+json follows draft-ietf-httpapi-ratelimit-headers
/// (section 5.1): the `quota-exceeded` problem type, with the violated
/// policies named as in `RateLimit-Policy`.
#[tokio::test]
async fn problem_json_denials() {
    let app = app(MemoryStore::new(), policy("1/10s, 5/min"), |l| {
        l.with_problem_json().with_headers(HeaderStyle::Both)
    });
    get_root(&app).await;
    let (res, body) = get_root(&app).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&res, "content-type"),
        Some("application/problem+json")
    );
    assert_eq!(header(&res, "retry-after"), Some("10"));
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(body["title"], "Quota Exceeded");
    assert_eq!(body["status"], 429);
    assert_eq!(body["violated-policies"], serde_json::json!(["1/10s"]));
    assert!(body.get("violated_policies").is_none(), "{body}");
    let names = policy_names(header(&res, "ratelimit-policy").unwrap());
    for violated in body["violated-policies"].as_array().unwrap() {
        assert!(
            names.iter().any(|n| n == violated.as_str().unwrap()),
            "{violated} is not a policy of {names:?}"
        );
    }
}

#[tokio::test]
async fn ietf_fields_and_both_styles() {
    let ietf = app(MemoryStore::new(), policy("2/s, 20/min"), |l| {
        l.with_headers(HeaderStyle::Ietf)
    });
    let (res, _) = get_root(&ietf).await;
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"2/s\";q=2;w=1, \"20/min\";q=20;w=60")
    );
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"2/s\";r=1;t=1, \"20/min\";r=19;t=60")
    );
    assert!(header(&res, "x-ratelimit-limit").is_none());
    get_root(&ietf).await;
    let (denied, _) = get_root(&ietf).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(denied.headers().get("x-ratelimit-limit").is_none());
    let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
    // Retry-After is never earlier than the t of the denying rate.
    let limit = header(&denied, "ratelimit").unwrap();
    let t: u64 = limit
        .split(", ")
        .next()
        .and_then(|item| item.split(";t=").nth(1))
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= t, "Retry-After {retry} < t {t} in {limit}");

    let both = app(MemoryStore::new(), policy("2/s"), |l| {
        l.with_headers(HeaderStyle::Both)
    });
    let (res, _) = get_root(&both).await;
    assert!(header(&res, "x-ratelimit-limit").is_some());
    assert!(header(&res, "ratelimit").is_some());
}

/// A concurrency limit of 2 with handlers held open by a semaphore.
fn concurrency_app(gate: Arc<Semaphore>) -> Router {
    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        Policy::concurrency(2).unwrap(),
        key::peer_ip(),
    );
    Router::new()
        .route(
            "/",
            get(move || {
                let gate = Arc::clone(&gate);
                async move {
                    let _permit = gate.acquire().await.unwrap();
                    "done"
                }
            }),
        )
        .route(
            "/panic",
            get(|| async {
                let crash = true;
                if crash {
                    panic!("handler panicked");
                }
                "unreachable"
            }),
        )
        .layer(limiter)
}

#[tokio::test]
async fn concurrency_leases_are_released_when_responses_end() {
    let gate = Arc::new(Semaphore::new(0));
    let app = concurrency_app(Arc::clone(&gate));
    // Two requests in flight, held by the gate.
    let first = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    let second = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (denied, body) = get_root(&app).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body.contains("in flight"), "{body}");
    assert_eq!(header(&denied, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&denied, "retry-after"), Some("1"));

    // The first finishes and its body is read to the end: its slot is free.
    gate.add_permits(1);
    let response = first.await.unwrap().unwrap();
    assert_eq!(response.headers()["x-ratelimit-remaining"], "1");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "done");
    gate.add_permits(1);
    let third = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    // The second finishes; its body is dropped unread: its slot is free too.
    drop(second.await.unwrap().unwrap());
    gate.add_permits(1);
    assert_eq!(third.await.unwrap().unwrap().status(), StatusCode::OK);
    // Both slots free again: two more in flight fit.
    gate.add_permits(2);
    let (a, _) = get_root(&app).await;
    let (b, _) = get_root(&app).await;
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
}

#[tokio::test]
async fn concurrency_leases_survive_panics_and_disconnects() {
    let gate = Arc::new(Semaphore::new(0));
    let app = concurrency_app(Arc::clone(&gate));
    // A handler that panics gives its slot back.
    for _ in 0..3 {
        let crashed = tokio::spawn(app.clone().oneshot(request("/panic", PEER))).await;
        assert!(crashed.unwrap_err().is_panic());
    }
    // A client that goes away (the response future dropped) gives it back.
    for _ in 0..3 {
        let waiting = tokio::spawn(app.clone().oneshot(request("/", PEER)));
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
    }
    // Releases are spawned: give them a moment, then both slots are free.
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.add_permits(2);
    let (a, _) = get_root(&app).await;
    let (b, _) = get_root(&app).await;
    assert_eq!((a.status(), b.status()), (StatusCode::OK, StatusCode::OK));
    let held = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    let held2 = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (c, _) = get_root(&app).await;
    assert_eq!(
        c.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the limit still holds"
    );
    gate.add_permits(2);
    held.await.unwrap().unwrap();
    held2.await.unwrap().unwrap();
}

/// The same through Redis, where a release finishes in a spawned task.
#[tokio::test]
async fn concurrency_leases_through_redis() {
    let server = support::RedisServer::start();
    let store = tower_redis_ratelimit::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let gate = Arc::new(Semaphore::new(0));
    let held = Arc::clone(&gate);
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, Policy::concurrency(1).unwrap()).with_name("api"),
        key::peer_ip(),
    );
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let gate = Arc::clone(&held);
                async move {
                    let _permit = gate.acquire().await.unwrap();
                    "done"
                }
            }),
        )
        .layer(limiter);
    let first = tokio::spawn(app.clone().oneshot(request("/", PEER)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (denied, _) = get_root(&app).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        server
            .command(&["ZCARD", &format!("rl:conc:{{api:{PEER}}}")])
            .trim(),
        ":1"
    );
    gate.add_permits(1);
    let response = first.await.unwrap().unwrap();
    response.into_body().collect().await.unwrap();
    // The release reaches Redis shortly after the body ended.
    let deadline = Instant::now() + Duration::from_secs(2);
    while server
        .command(&["ZCARD", &format!("rl:conc:{{api:{PEER}}}")])
        .trim()
        != ":0"
    {
        assert!(Instant::now() < deadline, "the lease was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.add_permits(1);
    let (res, body) = get_root(&app).await;
    assert_eq!((res.status(), body.as_str()), (StatusCode::OK, "done"));
}

/// A response body holding a Redis lease, dropped on a thread with no tokio
/// runtime, does not panic (the lease then expires on its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_dropped_outside_a_runtime_does_not_panic() {
    let server = support::RedisServer::start();
    let store = tower_redis_ratelimit::RedisStore::connect(&server.url())
        .await
        .unwrap();
    let limiter = RateLimitLayer::new(store, Policy::concurrency(1).unwrap(), key::peer_ip());
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter);
    let response = app.oneshot(request("/", PEER)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body();
    let dropped = std::thread::spawn(move || drop(body)).join();
    assert!(dropped.is_ok(), "dropping the body panicked");
}

/// The layer with `Rejection::delay(2 s)` and `1/600ms` per `x-client`.
fn delaying_limiter() -> RateLimitLayer<impl key::KeyExtractor<Body>> {
    RateLimitLayer::new(
        MemoryStore::new(),
        policy("1/600ms"),
        |req: &Request<Body>| {
            req.headers()
                .get("x-client")
                .map(|v| v.to_str().unwrap().to_owned())
        },
    )
    .with_rejection(Rejection::delay(Duration::from_secs(2)))
}

async fn hello(_req: Request<Body>) -> Result<Response<Body>, std::convert::Infallible> {
    Ok(Response::new(Body::from("ok")))
}

/// While client a's second request sleeps its turn, client b's first
/// request (its own quota) is answered at once.
async fn an_admitted_request_does_not_queue_behind_a_delayed_one<S>(service: S)
where
    S: tower::Service<
            Request<Body>,
            Response = Response<tower_redis_ratelimit::response::ResponseBody<Body>>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug + Send,
{
    let client = |name: &str| {
        Request::get("/")
            .header("x-client", name)
            .body(Body::empty())
            .unwrap()
    };
    let first = service.clone().oneshot(client("a")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Client a's second request waits about 600 ms for its turn.
    let started = Instant::now();
    let delayed = tokio::spawn(service.clone().oneshot(client("a")));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let other = Instant::now();
    let response =
        tokio::time::timeout(Duration::from_secs(3), service.clone().oneshot(client("b")))
            .await
            .expect("client b never answered")
            .unwrap();
    let took = other.elapsed();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        took < Duration::from_millis(300),
        "an admitted request waited {took:?} behind a delayed one"
    );
    let delayed = delayed.await.unwrap().unwrap();
    assert_eq!(delayed.status(), StatusCode::OK);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(500),
        "the delayed request was not delayed ({waited:?})"
    );
}

/// A request delayed by `Rejection::Delay` does not hold the inner
/// service's readiness while it sleeps: with a `ConcurrencyLimit` of 1
/// inside the layer, another client's admitted request goes through at once
/// instead of queueing behind the sleeper.
#[tokio::test]
async fn a_delayed_request_does_not_hold_a_concurrency_limit_permit() {
    let service = tower::ServiceBuilder::new()
        .layer(delaying_limiter())
        .concurrency_limit(1)
        .service_fn(hello);
    an_admitted_request_does_not_queue_behind_a_delayed_one(service).await;
}

/// The same with a `Buffer` of one slot inside the layer.
#[tokio::test]
async fn a_delayed_request_does_not_hold_a_buffer_slot() {
    let service = tower::ServiceBuilder::new()
        .layer(delaying_limiter())
        .buffer(1)
        .service_fn(hello);
    an_admitted_request_does_not_queue_behind_a_delayed_one(service).await;
}
