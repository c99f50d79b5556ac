//! Keys never merge two clients or two limits: a header value cannot take
//! another value's encoded key, and layers whose policies count differently
//! never share a counter by default — through `MemoryStore` and a real
//! `RedisStore`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use crate::support::RedisServer;
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{HeaderValue, Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{
    Algorithm, MemoryStore, Policy, RateLimitLayer, RedisStore, Store, key,
};

async fn status(app: &Router, req: Request<Body>) -> StatusCode {
    app.clone().oneshot(req).await.unwrap().status()
}

fn with_api_key(value: &[u8]) -> Request<Body> {
    Request::get("/")
        .header("x-api-key", HeaderValue::from_bytes(value).unwrap())
        .body(Body::empty())
        .unwrap()
}

fn plain() -> Request<Body> {
    Request::get("/").body(Body::empty()).unwrap()
}

fn router(layer: RateLimitLayer<impl key::KeyExtractor<Body>>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// A client whose API key is not text spends its quota; another client who
/// sends the text of that key's encoding still has its own.
async fn header_values_keep_their_own_budgets<St: Store>(store: St) {
    let app = router(RateLimitLayer::new(
        store,
        "1/10s".parse::<Policy>().unwrap(),
        key::header("x-api-key"),
    ));
    assert_eq!(status(&app, with_api_key(b"a\xffb")).await, StatusCode::OK);
    assert_eq!(
        status(&app, with_api_key(b"a\xffb")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&app, with_api_key(b"hex:61ff62")).await,
        StatusCode::OK,
        "a plain value spent the quota of the binary value it spells"
    );
    assert_eq!(
        status(&app, with_api_key(b"hex:61ff62")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn header_values_keep_their_own_budgets_in_memory() {
    header_values_keep_their_own_budgets(MemoryStore::new()).await;
}

#[tokio::test]
async fn header_values_keep_their_own_budgets_in_redis() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    header_values_keep_their_own_budgets(store).await;
}

fn two_per_min() -> Policy {
    "2/min".parse().unwrap()
}

/// `"2/min"`, `"2/min"` costing 2 and `"2/min"` spaced 10 s apart, on one
/// store and one key, with default names: each keeps its own counter.
async fn policies_that_count_differently_keep_apart<St: Store + Clone>(store: St) -> Vec<String> {
    let plain_layer = RateLimitLayer::new(store.clone(), two_per_min(), key::global());
    let costly = RateLimitLayer::new(
        store.clone(),
        two_per_min().with_cost(2).unwrap(),
        key::global(),
    );
    let spaced = RateLimitLayer::new(
        store,
        two_per_min()
            .with_min_spacing(Duration::from_secs(10))
            .unwrap(),
        key::global(),
    );
    let names = vec![
        plain_layer.name().to_owned(),
        costly.name().to_owned(),
        spaced.name().to_owned(),
    ];
    let (plain_app, costly_app, spaced_app) = (router(plain_layer), router(costly), router(spaced));
    // Each layer's first requests fit its own limit; a shared counter would
    // deny them (the spaced one's entry leaves one unit, the costly one
    // takes both, ...).
    assert_eq!(
        status(&spaced_app, plain()).await,
        StatusCode::OK,
        "{names:?}"
    );
    assert_eq!(
        status(&costly_app, plain()).await,
        StatusCode::OK,
        "{names:?}: the costly layer shared the spaced one's counter"
    );
    for _ in 0..2 {
        assert_eq!(
            status(&plain_app, plain()).await,
            StatusCode::OK,
            "{names:?}: the plain layer shared another's counter"
        );
    }
    // And each still holds its own limit.
    assert_eq!(
        status(&spaced_app, plain()).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&costly_app, plain()).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&plain_app, plain()).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    names
}

#[tokio::test]
async fn default_names_keep_policies_apart_in_memory() {
    policies_that_count_differently_keep_apart(MemoryStore::new()).await;
}

#[tokio::test]
async fn default_names_keep_policies_apart_in_redis() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let names = policies_that_count_differently_keep_apart(store).await;
    let keys = server.command(&["KEYS", "rl:log:*"]);
    for name in &names {
        assert!(
            keys.contains(&format!("rl:log:{{{name}:global}}")),
            "{name} not in {keys}"
        );
    }
    assert!(keys.starts_with("*3\r\n"), "three keys, not {keys}");
}

/// Every setting that changes what is stored or how gives another default
/// name; the plain policies keep the names (and Redis keys) they had.
#[test]
fn default_names_are_distinct_and_readable() {
    let p = |text: &str| text.parse::<Policy>().unwrap();
    let spaced = |policy: Policy, d: Duration| policy.with_min_spacing(d).unwrap();
    let cases: Vec<(&str, Policy)> = vec![
        ("2/min", p("2/min")),
        ("3/s,20/min", p("3/s, 20/min")),
        ("cost 2", p("2/min").with_cost(2).unwrap()),
        ("spacing 10s", spaced(p("2/min"), Duration::from_secs(10))),
        (
            "spacing 10ms",
            spaced(p("2/min"), Duration::from_millis(10)),
        ),
        (
            "spacing 1500us",
            spaced(p("2/min"), Duration::from_micros(1500)),
        ),
        (
            "cost 2 spacing 10s",
            spaced(p("2/min"), Duration::from_secs(10))
                .with_cost(2)
                .unwrap(),
        ),
        (
            "script",
            p("2/min").with_execution(Execution::Script).unwrap(),
        ),
        (
            "script cost 2",
            p("2/min")
                .with_execution(Execution::Script)
                .unwrap()
                .with_cost(2)
                .unwrap(),
        ),
        ("fixed", p("2/min").fixed_window().unwrap()),
        (
            "fixed cost 2",
            p("2/min").fixed_window().unwrap().with_cost(2).unwrap(),
        ),
        ("sliding window", p("2/min").sliding_window().unwrap()),
        ("gcra", p("2/min").gcra().unwrap()),
        ("concurrency", Policy::concurrency(2).unwrap()),
        ("two rates", p("2/min, 10/h")),
    ];
    // Names must differ within one algorithm: the stores keep each
    // algorithm's state apart (its own Redis key, its own map).
    let mut seen: HashMap<(Algorithm, String), &str> = HashMap::new();
    for (label, policy) in &cases {
        let layer = RateLimitLayer::new(MemoryStore::new(), policy.clone(), key::global());
        let name = layer.name().to_owned();
        assert!(
            !name.contains([':', '{', '}', ' ']),
            "{label}: {name:?} holds a separator"
        );
        if let Some(other) = seen.insert((policy.algorithm(), name.clone()), label) {
            panic!("{label} and {other} share the default name {name:?}");
        }
    }
    let name = |policy: Policy| {
        RateLimitLayer::new(MemoryStore::new(), policy, key::global())
            .name()
            .to_owned()
    };
    // Unchanged for the plain policy.
    assert_eq!(name(p("2/min")), "2/min");
    assert_eq!(name(p("3/s, 20/min")), "3/s,20/min");
    // The others, as `with_name` documents them.
    assert_eq!(name(p("2/min").with_cost(2).unwrap()), "2/min;cost=2");
    assert_eq!(
        name(spaced(p("2/min"), Duration::from_secs(10))),
        "2/min;spacing=10s"
    );
    assert_eq!(
        name(spaced(p("2/min"), Duration::from_micros(1500))),
        "2/min;spacing=1500us"
    );
    assert_eq!(
        name(p("2/min").with_execution(Execution::Script).unwrap()),
        "2/min;script"
    );
    // The algorithm is not in the name: both stores keep each algorithm's
    // state apart already (`rl:gcra:…`, one map per algorithm), and the
    // other algorithms' keys stay what they were before names grew.
    assert_eq!(name(p("2/min").gcra().unwrap()), "2/min");
    assert_eq!(name(Policy::concurrency(2).unwrap()), "2/min");
    assert_eq!(
        name(
            spaced(p("3/s, 20/min"), Duration::from_millis(250))
                .with_cost(2)
                .unwrap()
                .with_execution(Execution::Script)
                .unwrap()
        ),
        "3/s,20/min;cost=2;spacing=250ms;script"
    );
    assert_eq!(
        name(p("2/min").fixed_window().unwrap().with_cost(2).unwrap()),
        "2/min;cost=2"
    );
    // Only the sliding log runs in more than one way: another algorithm
    // refuses an execution rather than keep one it ignores.
    assert!(
        p("2/min")
            .gcra()
            .unwrap()
            .with_execution(Execution::Script)
            .is_err()
    );
    assert_eq!(
        name(p("2/min").with_algorithm(Algorithm::SlidingLog).unwrap()),
        "2/min"
    );
}
