//! A cost header under rules and layers that settle from it: every rule
//! reading it is settled before it is stripped, it is stripped whatever
//! the verdict (a key on the `allow` list, a store down and failing open,
//! a request nothing limits), and a denial held in process never refuses
//! what a settlement gave back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use tower::ServiceExt;
use tower_redis_ratelimit::response::Settlement;
use tower_redis_ratelimit::rules::{RuleSet, Rules, RulesLayer};
use tower_redis_ratelimit::{FailMode, Limiter, Policy, RateLimitLayer, RedisStore, key};

use crate::support::RedisServer;
use crate::support::units::settles_to;

const USAGE: HeaderName = HeaderName::from_static("x-usage-tokens");

/// `GET /` answers with `x-usage-tokens: 20000` in its head; `GET /trailer`
/// streams two frames, then trailers holding it.
fn upstream() -> Router {
    Router::new()
        .route("/", get(|| async { ([(USAGE, "20000")], "the answer") }))
        .route(
            "/trailer",
            get(|| async {
                let mut trailers = HeaderMap::new();
                trailers.insert(USAGE, HeaderValue::from_static("20000"));
                let frames: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = vec![
                    Ok(http_body::Frame::data(Bytes::from_static(b"the "))),
                    Ok(http_body::Frame::data(Bytes::from_static(b"answer"))),
                    Ok(http_body::Frame::trailers(trailers)),
                ];
                Response::new(Body::new(StreamBody::new(futures_util::stream::iter(
                    frames,
                ))))
            }),
        )
}

async fn send(
    app: &Router,
    path: &str,
    api_key: Option<&str>,
) -> (StatusCode, HeaderMap, HeaderMap) {
    let mut request = Request::get(path);
    if let Some(api_key) = api_key {
        request = request.header("x-api-key", api_key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (parts.status, parts.headers, trailers)
}

/// A daily and a monthly budget of tokens settled from one stripped
/// header; the monthly rule also asks for the body meter.
fn daily_and_monthly(extra: &str) -> RuleSet {
    RuleSet::from_toml(&format!(
        r#"
        [[rules]]
        name = "tokens-daily"
        key = "header:x-api-key"
        policy = "100000/86400s"
        algorithm = "gcra"
        cost = 500
        settle = {{ header = "x-usage-tokens", strip = true }}
        {extra}

        [[rules]]
        name = "tokens-monthly"
        key = "header:x-api-key"
        policy = "1000000/2592000s"
        algorithm = "gcra"
        cost = 500
        settle = {{ header = "x-usage-tokens", strip = true, body = true }}
        {extra}
        "#
    ))
    .unwrap()
}

#[tokio::test]
async fn every_rule_reading_one_stripped_header_is_settled_from_it() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(store, daily_and_monthly(""));
    // No body meter: the monthly rule's `body = true` adds nothing, and
    // the header settles it all the same.
    let app = upstream().layer(RulesLayer::new(rules.clone()));
    let active = rules.current();
    let daily = active.limiter("tokens-daily", None).unwrap().clone();
    let monthly = active.limiter("tokens-monthly", None).unwrap().clone();

    let (status, headers, _) = send(&app, "/", Some("alice")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get(&USAGE).is_none(), "stripped: {headers:?}");
    settles_to(&daily, "alice", 100_000 - 20_000).await;
    settles_to(&monthly, "alice", 1_000_000 - 20_000).await;

    // From the trailers too: both read them before either strips.
    let (_, _, trailers) = send(&app, "/trailer", Some("bob")).await;
    assert!(trailers.get(&USAGE).is_none(), "stripped: {trailers:?}");
    settles_to(&daily, "bob", 100_000 - 20_000).await;
    settles_to(&monthly, "bob", 1_000_000 - 20_000).await;
}

#[tokio::test]
async fn a_stripped_header_never_reaches_a_client_no_check_counted() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let rules = Rules::new(store, daily_and_monthly(r#"allow = ["internal-batch"]"#))
        .with_fail_mode(FailMode::Open);
    let app = upstream().layer(RulesLayer::new(rules));

    // A key on the `allow` list: no rule checks it.
    for path in ["/", "/trailer"] {
        let (status, headers, trailers) = send(&app, path, Some("internal-batch")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(headers.get(&USAGE).is_none(), "{path}: {headers:?}");
        assert!(trailers.get(&USAGE).is_none(), "{path}: {trailers:?}");
    }
    // The store down, failing open: admitted, counted nowhere.
    server.kill();
    for path in ["/", "/trailer"] {
        let (status, headers, trailers) = send(&app, path, Some("alice")).await;
        assert_eq!(status, StatusCode::OK, "{path}: failed open");
        assert!(headers.get(&USAGE).is_none(), "{path}: {headers:?}");
        assert!(trailers.get(&USAGE).is_none(), "{path}: {trailers:?}");
    }
}

#[tokio::test]
async fn a_layer_strips_its_cost_header_whatever_the_verdict() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let policy = "100000/86400s"
        .parse::<Policy>()
        .unwrap()
        .gcra()
        .unwrap()
        .with_cost(500)
        .unwrap();
    let limiter = Limiter::new(store, policy)
        .with_fail_mode(FailMode::Open)
        .with_allowed_keys(["internal-batch"]);
    // A request without the header is not limited (the key is `None`).
    let layer = RateLimitLayer::from_limiter(limiter, key::header("x-api-key"))
        .with_settlement(Settlement::new().from_header(USAGE).strip_header())
        .unwrap();
    let app = upstream().layer(layer);
    let mut cases = vec![("an allowed key", Some("internal-batch")), ("no key", None)];
    for (what, api_key) in &cases {
        for path in ["/", "/trailer"] {
            let (_, headers, trailers) = send(&app, path, *api_key).await;
            assert!(headers.get(&USAGE).is_none(), "{what} {path}: {headers:?}");
            assert!(
                trailers.get(&USAGE).is_none(),
                "{what} {path}: {trailers:?}"
            );
        }
    }
    server.kill();
    cases.push(("failed open", Some("alice")));
    for (what, api_key) in &cases {
        for path in ["/", "/trailer"] {
            let (status, headers, trailers) = send(&app, path, *api_key).await;
            assert_eq!(status, StatusCode::OK, "{what}");
            assert!(headers.get(&USAGE).is_none(), "{what} {path}: {headers:?}");
            assert!(
                trailers.get(&USAGE).is_none(),
                "{what} {path}: {trailers:?}"
            );
        }
    }
}

/// Two processes on one Redis: A admits a request against its estimate;
/// B is denied meanwhile (its deny cache could hold the denial); A's
/// answer then settles for much less, giving units back; B must admit at
/// once, as the store would: a denial held in process never refuses what
/// the store admits.
#[tokio::test]
async fn a_settlement_giving_units_back_is_seen_by_every_process_at_once() {
    let server = RedisServer::start();
    let rules_text = r#"
        [[rules]]
        name = "tokens"
        key = "header:x-api-key"
        policy = "1000/86400s"
        algorithm = "gcra"
        cost = 600
        settle = { header = "x-usage-tokens", strip = true }
    "#;
    let process = || async {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        Rules::new(store, RuleSet::from_toml(rules_text).unwrap())
    };
    let (a, b) = (process().await, process().await);
    let a_limiter = a.current().limiter("tokens", None).unwrap().clone();
    // A's upstream says it is called, and answers once told to, having
    // used 10 tokens.
    let (called, answer) = (
        std::sync::Arc::new(tokio::sync::Notify::new()),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let (says, told) = (
        std::sync::Arc::clone(&called),
        std::sync::Arc::clone(&answer),
    );
    let app_a = Router::new()
        .route(
            "/",
            get(move || async move {
                says.notify_one();
                told.notified().await;
                ([(USAGE, "10")], "short answer")
            }),
        )
        .layer(RulesLayer::new(a));
    let app_b = Router::new()
        .route("/", get(|| async { "answer" }))
        .layer(RulesLayer::new(b));

    let in_flight = tokio::spawn(async move { send(&app_a, "/", Some("alice")).await.0 });
    // A admitted, its 600 counted: 400 left, short of B's estimate.
    called.notified().await;
    assert_eq!(
        send(&app_b, "/", Some("alice")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    answer.notify_one();
    assert_eq!(in_flight.await.unwrap(), StatusCode::OK);
    settles_to(&a_limiter, "alice", 1000 - 10).await;
    assert_eq!(
        send(&app_b, "/", Some("alice")).await.0,
        StatusCode::OK,
        "B refused what the store admits: a denial held in process outlived the settlement"
    );
}

/// A header of the connection, or one framing the body, never carries a
/// cost to a settlement: refused where it is configured, naming it.
#[test]
fn a_cost_header_that_can_never_settle_is_refused() {
    for header in [
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "upgrade",
        "te",
        "trailer",
        "Proxy-Connection",
    ] {
        let error = RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"r\"\nkey = \"global\"\npolicy = \"10/s\"\n\
             settle = {{ header = \"{header}\" }}\n"
        ))
        .unwrap_err();
        assert_eq!(error.field(), "settle.header", "{header}: {error}");
        assert!(
            error.to_string().contains(&header.to_ascii_lowercase())
                && error.to_string().contains("can never settle"),
            "{header}: {error}"
        );
        let layer = RateLimitLayer::new(
            tower_redis_ratelimit::MemoryStore::new(),
            "10/s".parse::<Policy>().unwrap(),
            key::global(),
        )
        .with_settlement(Settlement::new().from_header(HeaderName::try_from(header).unwrap()));
        let Err(error) = layer else {
            panic!("{header}: accepted")
        };
        let error = error.to_string();
        assert!(error.contains("can never settle"), "{header}: {error}");
    }
    // A header of the upstream's own is fine.
    RuleSet::from_toml(
        "[[rules]]\nname = \"r\"\nkey = \"global\"\npolicy = \"10/s\"\n\
         settle = { header = \"x-usage-tokens\" }\n",
    )
    .unwrap();
}
