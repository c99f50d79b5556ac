//! Costs settled after the response (`Limiter::reserve`, `Reservation::settle`,
//! `RateLimitLayer::with_settlement`, rules' `settle`): an estimate admitted,
//! the real cost charged or given back exactly, in every process sharing
//! the store; debts waited out; what a response that reports nothing, a
//! cut stream or a failing store leaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use tower::ServiceExt;
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::limiter::{DecidedBy, LocalQuota, Settled};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::response::{ActualCost, BodyPart, Settlement};
use tower_redis_ratelimit::rules::{RuleSet, Rules, RulesLayer};
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{
    Algorithm, FailMode, LimitError, Limiter, MemoryStore, Policy, PolicyError, RateLimitLayer,
    RedisStore, key,
};

use crate::support::RedisServer;
use crate::support::units::{settles_to, units_left};

const USAGE: HeaderName = HeaderName::from_static("x-usage-tokens");

/// Two limiters of one limit, standing for two processes: on one
/// MemoryStore (a manual clock), or each with its own RedisStore (its own
/// connections) on one redis-server.
struct Processes {
    a: Limiter,
    b: Limiter,
    clock: Option<ManualClock>,
    _server: Option<Box<dyn std::any::Any + Send>>,
}

impl Processes {
    fn memory(policy: &Policy) -> Self {
        let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
        let store = MemoryStore::with_clock(clock.clone());
        Self {
            a: Limiter::new(store.clone(), policy.clone()).with_name("tokens"),
            b: Limiter::new(store, policy.clone()).with_name("tokens"),
            clock: Some(clock),
            _server: None,
        }
    }

    async fn redis(policy: &Policy) -> Self {
        let server = RedisServer::start();
        let a = RedisStore::connect(&server.url()).await.unwrap();
        let b = RedisStore::connect(&server.url()).await.unwrap();
        Self {
            a: Limiter::new(a, policy.clone()).with_name("tokens"),
            b: Limiter::new(b, policy.clone()).with_name("tokens"),
            clock: None,
            _server: Some(Box::new(server)),
        }
    }

    #[cfg(feature = "cluster")]
    async fn cluster(policy: &Policy) -> Self {
        let cluster = crate::support::RedisCluster::start();
        let a = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
        let b = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
        Self {
            a: Limiter::new(a, policy.clone()).with_name("tokens"),
            b: Limiter::new(b, policy.clone()).with_name("tokens"),
            clock: None,
            _server: Some(Box::new(cluster)),
        }
    }

    async fn advance(&self, by: Duration) {
        match &self.clock {
            Some(clock) => clock.advance(by),
            None => tokio::time::sleep(by).await,
        }
    }
}

/// Every algorithm a cost can be settled under, 1,000 units a day (no
/// count expires during a test; the fixed and sliding windows are aligned
/// to the UTC day, so a test that must stay in one waits out its end).
fn every_algorithm() -> Vec<Policy> {
    let base: Policy = "1000/86400s".parse().unwrap();
    vec![
        base.clone().with_execution(Execution::Transaction).unwrap(),
        base.clone().with_execution(Execution::Script).unwrap(),
        base.clone().fixed_window().unwrap(),
        base.clone().sliding_window().unwrap(),
        base.gcra().unwrap(),
    ]
}

/// Reserve in one process, settle up and down, read in the other: each
/// difference lands exactly, once.
async fn settles_exactly(p: Processes, policy: &Policy) {
    crate::support::harness::away_from_a_boundary(
        Duration::from_secs(86_400),
        Duration::from_secs(5),
    )
    .await;
    let what = format!("{} {}", policy.algorithm(), policy.execution());
    let r = p.a.reserve("customer", 100).await.unwrap();
    assert!(r.allowed(), "{what}");
    assert_eq!(r.estimate(), 100);
    assert_eq!(
        units_left(&p.b, "customer").await,
        900,
        "{what}: the estimate counted"
    );
    let settled = r.settle(40).await.unwrap();
    assert!(
        matches!(settled, Settled::GivenBack { units: 60, .. }),
        "{what}: {settled:?}"
    );
    assert_eq!(
        units_left(&p.b, "customer").await,
        960,
        "{what}: 60 given back"
    );

    let r = p.b.reserve("customer", 100).await.unwrap();
    let settled = r.settle(350).await.unwrap();
    assert!(
        matches!(settled, Settled::Charged { units: 250, .. }),
        "{what}: {settled:?}"
    );
    assert_eq!(
        units_left(&p.a, "customer").await,
        1000 - 40 - 350,
        "{what}"
    );

    let r = p.a.reserve("customer", 100).await.unwrap();
    assert_eq!(r.settle(100).await.unwrap(), Settled::AsEstimated);
    assert_eq!(
        units_left(&p.b, "customer").await,
        1000 - 40 - 350 - 100,
        "{what}"
    );
}

#[tokio::test]
async fn estimates_settle_exactly_in_memory() {
    for policy in every_algorithm() {
        settles_exactly(Processes::memory(&policy), &policy).await;
    }
}

#[tokio::test]
async fn estimates_settle_exactly_across_two_processes_on_redis() {
    for policy in every_algorithm() {
        settles_exactly(Processes::redis(&policy).await, &policy).await;
    }
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn estimates_settle_exactly_on_a_cluster() {
    let cluster = crate::support::RedisCluster::start();
    for policy in every_algorithm() {
        let a = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
        let b = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
        let name = format!("tokens-{}-{}", policy.algorithm(), policy.execution());
        let p = Processes {
            a: Limiter::new(a, policy.clone()).with_name(name.clone()),
            b: Limiter::new(b, policy.clone()).with_name(name),
            clock: None,
            _server: None,
        };
        settles_exactly(p, &policy).await;
    }
    let _ = Processes::cluster;
}

/// GCRA of 10/s (one unit every 100 ms, a burst of 10): a request
/// estimated at 1 that used 15 leaves the key 5 units in debt, so the
/// next request waits for those 5 and its own unit: 600 ms.
async fn debt_waits_exactly(p: Processes) {
    let r = p.a.reserve("k", 1).await.unwrap();
    let settled = r.settle(15).await.unwrap();
    let Settled::Charged {
        units: 14,
        decision,
    } = settled
    else {
        panic!("{settled:?}")
    };
    assert_eq!(decision.remaining(), 0);
    let started = Instant::now();
    let denied = p.b.check("k").await.unwrap();
    assert!(!denied.allowed());
    let wait = denied.retry_after();
    match &p.clock {
        Some(_) => assert_eq!(wait, Duration::from_millis(600)),
        None => assert!(
            wait <= Duration::from_millis(600) && wait >= Duration::from_millis(500),
            "{wait:?}"
        ),
    }
    // Just short of it: still denied; at it: admitted.
    p.advance(
        wait.saturating_sub(Duration::from_millis(if p.clock.is_some() {
            1
        } else {
            60
        })),
    )
    .await;
    assert!(
        !p.a.check("k").await.unwrap().allowed(),
        "{:?}",
        started.elapsed()
    );
    p.advance(Duration::from_millis(if p.clock.is_some() {
        1
    } else {
        90
    }))
    .await;
    assert!(
        p.b.check("k").await.unwrap().allowed(),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_over_run_leaves_a_debt_waited_out_exactly_in_memory() {
    let policy = "10/s".parse::<Policy>().unwrap().gcra().unwrap();
    debt_waits_exactly(Processes::memory(&policy)).await;
}

#[tokio::test]
async fn an_over_run_leaves_a_debt_waited_out_exactly_on_redis() {
    let policy = "10/s".parse::<Policy>().unwrap().gcra().unwrap();
    debt_waits_exactly(Processes::redis(&policy).await).await;
}

#[tokio::test]
async fn a_window_counter_keeps_what_its_ended_window_counted() {
    for policy in [
        "100/200ms"
            .parse::<Policy>()
            .unwrap()
            .fixed_window()
            .unwrap(),
        "100/200ms"
            .parse::<Policy>()
            .unwrap()
            .sliding_window()
            .unwrap(),
    ] {
        // Real time: whether the window ended is read on this process's
        // monotonic clock, as the store's reply placed it.
        let store = MemoryStore::new();
        let p = Processes {
            a: Limiter::new(store.clone(), policy.clone()),
            b: Limiter::new(store, policy.clone()),
            clock: None,
            _server: None,
        };
        let r = p.a.reserve("k", 50).await.unwrap();
        // Past the window that counted it and the next (the sliding
        // counter's previous window weighs in).
        p.advance(Duration::from_millis(450)).await;
        assert_eq!(r.settle(10).await.unwrap(), Settled::Kept { units: 40 });
        assert_eq!(units_left(&p.b, "k").await, 100, "{}", policy.algorithm());
    }
}

#[tokio::test]
async fn a_key_with_less_left_than_the_estimate_is_denied() {
    let policy = "100/min".parse::<Policy>().unwrap().gcra().unwrap();
    let p = Processes::memory(&policy);
    let r = p.a.reserve("k", 95).await.unwrap();
    r.settle(95).await.unwrap();
    let denied = p.a.reserve("k", 10).await.unwrap();
    assert!(!denied.allowed(), "5 left, estimate 10");
    assert_eq!(denied.settle(0).await.unwrap(), Settled::NotCounted);
    assert!(
        p.a.reserve("k", 5).await.unwrap().allowed(),
        "5 left, estimate 5"
    );
    // An estimate no rate could ever admit is lowered to the smallest max.
    let other = p.a.reserve("other", 1_000).await.unwrap();
    assert!(other.allowed());
    assert_eq!(other.estimate(), 100);
}

/// A reservation is checked in the store even when the limiter admits hot
/// keys from a local batch: its units are its own, given back exactly.
#[tokio::test]
async fn a_reservation_is_checked_in_the_store_beside_a_local_quota() {
    let policy: Policy = "100/86400s".parse().unwrap();
    let limiter = Limiter::new(MemoryStore::new(), policy)
        .with_local_quota(LocalQuota::new(10, Duration::from_secs(60)).unwrap())
        .unwrap();
    // A batch of 10 held locally.
    assert!(limiter.check("k").await.unwrap().allowed());
    let r = limiter.reserve("k", 1).await.unwrap();
    assert_eq!(r.verdict().decided_by(), DecidedBy::Store);
    assert!(matches!(
        r.settle(0).await.unwrap(),
        Settled::GivenBack { units: 1, .. }
    ));
    // The batch's 10 counted in the store, nothing of the reservation.
    assert_eq!(units_left(&limiter, "k").await, 90);
}

#[tokio::test]
async fn a_concurrency_limit_refuses_a_settled_cost() {
    let policy = Policy::concurrency(3).unwrap();
    let limiter = Limiter::new(MemoryStore::new(), policy.clone());
    let error = limiter.reserve("k", 1).await.unwrap_err();
    assert!(
        matches!(
            error,
            LimitError::Policy(PolicyError::Unsupported {
                algorithm: Algorithm::Concurrency,
                ..
            })
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("settled after the response"),
        "{error}"
    );
    let layer = RateLimitLayer::new(MemoryStore::new(), policy, key::global());
    assert!(layer.with_settlement(Settlement::new()).is_err());
}

// --- The layer -------------------------------------------------------------

/// A router limited by `layer` whose `/` answers with `usage` in the
/// header `x-usage-tokens` (none when `None`), and whose `/ext` puts
/// `ActualCost(usage)` in the response's extensions.
fn llm_router(layer: RateLimitLayer<key::Global>, usage: Option<u64>) -> Router {
    Router::new()
        .route(
            "/",
            get(move || async move {
                let mut response = Response::new(Body::from("answer"));
                if let Some(usage) = usage {
                    response
                        .headers_mut()
                        .insert(USAGE, http::HeaderValue::from(usage));
                }
                response
            }),
        )
        .route(
            "/ext",
            get(move || async move {
                let mut response = Response::new(Body::from("answer"));
                if let Some(usage) = usage {
                    response.extensions_mut().insert(ActualCost(usage));
                }
                response
            }),
        )
        .layer(layer)
}

/// `app`'s response to a GET of `path` with `headers`, its body unread.
async fn call(app: &Router, path: &str, headers: &[(&str, &str)]) -> Response<Body> {
    let mut request = Request::get(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    app.clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

/// 1,000 tokens a day under GCRA (nothing refills during a test), each
/// request estimated at 100.
fn tokens_policy() -> Policy {
    "1000/86400s"
        .parse::<Policy>()
        .unwrap()
        .gcra()
        .unwrap()
        .with_cost(100)
        .unwrap()
}

async fn get_path(app: &Router, path: &str) -> Response<Bytes> {
    let response = call(app, path, &[]).await;
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
}

fn tokens_layer(limiter: &Limiter, settlement: Settlement) -> RateLimitLayer<key::Global> {
    RateLimitLayer::from_limiter(limiter.clone(), key::global())
        .with_settlement(settlement)
        .unwrap()
}

async fn layer_settles_from_the_response(limiter: Limiter) {
    let policy_cost = limiter.policy().cost();
    // From the header, stripped: the client never sees it.
    let app = llm_router(
        tokens_layer(
            &limiter,
            Settlement::new().from_header(USAGE).strip_header(),
        ),
        Some(37),
    );
    let response = get_path(&app, "/").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get(&USAGE).is_none(), "stripped");
    // The fields show the estimate counted, in units.
    assert_eq!(
        response.headers()["x-ratelimit-remaining"],
        (1000 - policy_cost).to_string().as_str()
    );
    settles_to(&limiter, "global", 1000 - 37).await;

    // From the extension; the header kept when not stripped.
    let app = llm_router(
        tokens_layer(&limiter, Settlement::new().from_header(USAGE)),
        Some(3),
    );
    assert_eq!(get_path(&app, "/").await.headers()[&USAGE], "3");
    settles_to(&limiter, "global", 1000 - 37 - 3).await;
    get_path(&app, "/ext").await;
    settles_to(&limiter, "global", 1000 - 37 - 3 - 3).await;

    // A response that reports nothing: the estimate stands.
    let app = llm_router(
        tokens_layer(&limiter, Settlement::new().from_header(USAGE)),
        None,
    );
    get_path(&app, "/").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        units_left(&limiter, "global").await,
        1000 - 43 - policy_cost
    );
}

#[tokio::test]
async fn the_layer_settles_from_a_header_or_an_extension_in_memory() {
    let policy = tokens_policy();
    layer_settles_from_the_response(Limiter::new(MemoryStore::new(), policy)).await;
}

#[tokio::test]
async fn the_layer_settles_from_a_header_or_an_extension_on_redis() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = "1000/86400s"
        .parse::<Policy>()
        .unwrap()
        .with_cost(100)
        .unwrap();
    layer_settles_from_the_response(Limiter::new(store, policy)).await;
}

#[tokio::test]
async fn the_layer_estimates_from_the_request() {
    let limiter = Limiter::new(
        MemoryStore::new(),
        "1000/86400s".parse::<Policy>().unwrap().gcra().unwrap(),
    );
    let layer =
        tokens_layer(&limiter, Settlement::new().from_header(USAGE)).with_estimate(|parts| {
            parts
                .headers
                .get("x-max-tokens")?
                .to_str()
                .ok()?
                .parse()
                .ok()
        });
    let app = llm_router(layer, None);
    let response = call(&app, "/", &[("x-max-tokens", "250")]).await;
    assert_eq!(response.headers()["x-ratelimit-remaining"], "750");
    // Without the header: the policy's cost.
    let response = get_path(&app, "/").await;
    assert_eq!(response.headers()["x-ratelimit-remaining"], "749");
}

/// A body of `frames` data frames of 5 bytes each (then trailers, when
/// given), sent as the test feeds them.
fn streamed(frames: usize, trailers: Option<HeaderMap>, fail_after: Option<usize>) -> Body {
    let mut items: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = (0..frames)
        .map(|_| Ok(http_body::Frame::data(Bytes::from_static(b"token"))))
        .collect();
    if let Some(n) = fail_after {
        items.truncate(n);
        items.push(Err(std::io::Error::other("upstream broke")));
    }
    if let Some(trailers) = trailers {
        items.push(Ok(http_body::Frame::trailers(trailers)));
    }
    // One frame per poll, yielding between them, as a stream would.
    let stream = futures_util::stream::unfold(items.into_iter(), |mut items| async move {
        tokio::task::yield_now().await;
        items.next().map(|item| (item, items))
    });
    Body::new(StreamBody::new(stream))
}

/// One unit per data frame (a token per frame, as a streamed completion).
fn per_frame() -> Settlement {
    Settlement::new().from_body(|part| match part {
        BodyPart::Data(_) => Some(1),
        _ => None,
    })
}

fn stream_router(limiter: &Limiter, settlement: Settlement, body: fn() -> Body) -> Router {
    Router::new()
        .route("/", get(move || async move { Response::new(body()) }))
        .layer(tokens_layer(limiter, settlement))
}

#[tokio::test]
async fn a_streamed_body_is_settled_when_it_ends_fails_or_is_cut() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = tokens_policy();
    let limiter = Limiter::new(store, policy);

    // Read to the end: 20 frames, 20 units.
    let app = stream_router(&limiter, per_frame(), || streamed(20, None, None));
    let response = get_path(&app, "/").await;
    assert_eq!(response.body().len(), 100);
    settles_to(&limiter, "global", 980).await;

    // The client goes away after 5 frames: 5 charged.
    let response = call(&app, "/", &[]).await;
    let mut body = response.into_body();
    for _ in 0..5 {
        body.frame().await.unwrap().unwrap();
    }
    drop(body);
    settles_to(&limiter, "global", 975).await;

    // The upstream fails after 7 frames: what was streamed is charged.
    let app = stream_router(&limiter, per_frame(), || streamed(20, None, Some(7)));
    let response = call(&app, "/", &[]).await;
    assert!(response.into_body().collect().await.is_err());
    settles_to(&limiter, "global", 968).await;

    // Cut before any frame: nothing reported, the estimate stands.
    let response = call(&app, "/", &[]).await;
    drop(response);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(units_left(&limiter, "global").await, 868);
}

#[tokio::test]
async fn a_grpc_call_settles_from_its_trailing_metadata() {
    let limiter = Limiter::new(MemoryStore::new(), tokens_policy());
    let settlement = Settlement::new().from_header(USAGE).strip_header();
    let app = stream_router(&limiter, settlement, || {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        trailers.insert(USAGE, http::HeaderValue::from_static("42"));
        streamed(3, Some(trailers), None)
    });
    let response = call(&app, "/", &[("content-type", "application/grpc")]).await;
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert!(trailers.get(&USAGE).is_none(), "stripped from the trailers");
    settles_to(&limiter, "global", 958).await;
}

#[tokio::test]
async fn a_settlement_never_holds_the_response_when_redis_is_down() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(300));
    let policy = tokens_policy();
    let limiter = Limiter::new(store, policy);
    let admitted = limiter.reserve("k", 100).await.unwrap();
    assert!(admitted.allowed());
    server.kill();
    let started = Instant::now();
    let error = admitted.settle(150).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "{error}");

    // Over HTTP: the handler answers at once while Redis is down (the
    // check failed open: nothing to settle), and the response is not held.
    let app = llm_router(
        tokens_layer(&limiter, Settlement::new().from_header(USAGE)),
        Some(5),
    );
    let started = Instant::now();
    assert_eq!(get_path(&app, "/").await.status(), StatusCode::OK);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_request_the_fallback_admitted_is_settled_in_the_fallback() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(300));
    let fallback = MemoryStore::new();
    let policy = "1000/86400s".parse::<Policy>().unwrap().gcra().unwrap();
    let limiter = Limiter::new(store, policy.clone())
        .with_name("tokens")
        .with_fail_mode(FailMode::fallback(fallback.clone(), 1))
        .without_circuit_breaker();
    server.kill();
    let r = limiter.reserve("k", 100).await.unwrap();
    assert_eq!(r.verdict().decided_by(), DecidedBy::Fallback);
    assert!(matches!(
        r.settle(250).await.unwrap(),
        Settled::Charged { units: 150, .. }
    ));
    let peek = fallback.command_now("tokens:k", &policy, Command::Peek);
    assert_eq!(peek.remaining(), 1000 - 250 - 1);
}

// --- Rules -----------------------------------------------------------------

fn settle_rules(extra: &str) -> Result<RuleSet, tower_redis_ratelimit::rules::RulesError> {
    RuleSet::from_toml(&format!(
        r#"
        [[rules]]
        name = "tokens-small"
        key = "global"
        policy = "1000/86400s"
        algorithm = "gcra"
        cost = 100
        settle = {{ header = "x-usage-tokens", strip = true }}
        {extra}

        [[rules]]
        name = "tokens-large"
        key = "global"
        policy = "5000/86400s"
        algorithm = "gcra"
        cost = 100
        settle = {{ header = "x-usage-tokens", strip = true }}
        "#
    ))
}

#[tokio::test]
async fn rules_settle_every_rule_from_one_stripped_header() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(store, settle_rules("refund = [\"5xx\"]").unwrap());
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                let mut response = Response::new(Body::from("answer"));
                response
                    .headers_mut()
                    .insert(USAGE, http::HeaderValue::from_static("321"));
                response
            }),
        )
        .route(
            "/broken",
            get(|| async { (StatusCode::BAD_GATEWAY, [(USAGE, "999")], "upstream down") }),
        )
        .layer(RulesLayer::new(rules.clone()));
    let response = get_path(&app, "/").await;
    assert!(response.headers().get(&USAGE).is_none());
    let active = rules.current();
    let small = active.limiter("tokens-small", None).unwrap().clone();
    let large = active.limiter("tokens-large", None).unwrap().clone();
    settles_to(&small, "global", 1000 - 321).await;
    settles_to(&large, "global", 5000 - 321).await;
    // A 502 the small rule refunds: its estimate given back whole, never
    // settled; the large rule (counting every outcome) settles it.
    get_path(&app, "/broken").await;
    settles_to(&large, "global", 5000 - 321 - 999).await;
    settles_to(&small, "global", 1000 - 321).await;
}

#[test]
fn rules_validate_settle() {
    let rule = |fields: &str| {
        RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"r\"\nkey = \"global\"\npolicy = \"10/s\"\n{fields}\n"
        ))
    };
    let set = rule("settle = { header = \"x-usage-tokens\", strip = true, body = true }").unwrap();
    let settle = set.rules()[0].settle().unwrap();
    assert_eq!(settle.header().unwrap(), "x-usage-tokens");
    assert!(settle.strips_header() && settle.meters_body());
    for (fields, field, says) in [
        (
            "settle = { header = \"bad header\" }",
            "settle.header",
            "not a valid header name",
        ),
        ("settle = { strip = true }", "settle.strip", "names none"),
        ("settle = { heder = \"x\" }", "", "heder"),
        (
            "algorithm = \"concurrency\"\nsettle = {}",
            "settle",
            "concurrency limit counts requests in flight",
        ),
        (
            "local_quota = \"2/100ms\"\nsettle = {}",
            "settle",
            "local batch",
        ),
    ] {
        let error = rule(fields).unwrap_err().to_string();
        assert!(
            error.contains(field) && error.contains(says),
            "{fields}: {error}"
        );
    }
}

#[tokio::test]
async fn rules_meter_a_streamed_body_through_the_layer() {
    let rules = Rules::new(
        MemoryStore::new(),
        RuleSet::from_toml(
            r#"
            [[rules]]
            name = "stream"
            key = "global"
            policy = "1000/86400s"
            algorithm = "gcra"
            cost = 100
            settle = { body = true }
            "#,
        )
        .unwrap(),
    );
    let app = Router::new()
        .route(
            "/",
            get(|| async { Response::new(streamed(12, None, None)) }),
        )
        .layer(
            RulesLayer::new(rules.clone()).with_meter(|part| match part {
                BodyPart::Data(bytes) => Some(bytes.len() as u64),
                _ => None,
            }),
        );
    get_path(&app, "/").await;
    let limiter = rules.current().limiter("stream", None).unwrap().clone();
    settles_to(&limiter, "global", 1000 - 60).await;
}
