//! The `metrics` feature, read back as Prometheus scrapes it: the admin
//! router's `GET /metrics`, parsed by a Prometheus text-format parser.
#![cfg(feature = "admin")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use crate::support::RedisServer;
use crate::support::http::{PEER, request};
use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::Request;
use http_body_util::BodyExt as _;
use metrics_exporter_prometheus::PrometheusHandle;
use prometheus_parse::{Sample, Scrape, Value};
use tower::ServiceExt;
use tower_redis_ratelimit::admin::{Admin, prometheus_builder};
use tower_redis_ratelimit::limiter::{CircuitBreaker, LocalQuota};
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{FailMode, Limiter, MemoryStore, Policy, RateLimitLayer, RedisStore};

const TOKEN: &str = "a-metrics-token-of-enough-bytes";

/// The process's recorder, installed by the first test that needs it.
fn recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| prometheus_builder().install_recorder().unwrap())
        .clone()
}

/// `GET /metrics` through the admin router, parsed.
async fn scrape(handle: PrometheusHandle) -> Vec<Sample> {
    let admin = Admin::new(TOKEN, "127.0.0.1:9000".parse().unwrap())
        .unwrap()
        .with_metrics(handle)
        .into_router();
    let response = admin
        .oneshot(
            Request::get("/metrics")
                .header("host", "127.0.0.1:9000")
                .header("authorization", format!("Bearer {TOKEN}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    Scrape::parse(lines).unwrap().samples
}

/// The counter `name` of `rule`, by (outcome, source).
fn decisions(samples: &[Sample], rule: &str) -> HashMap<(String, String), f64> {
    samples
        .iter()
        .filter(|s| s.metric == "ratelimit_decisions_total" && s.labels.get("rule") == Some(rule))
        .map(|s| {
            let Value::Counter(n) = s.value else {
                panic!("{s:?} is not a counter")
            };
            (
                (
                    s.labels.get("outcome").unwrap().to_owned(),
                    s.labels.get("source").unwrap().to_owned(),
                ),
                n,
            )
        })
        .collect()
}

fn count(map: &HashMap<(String, String), f64>, outcome: &str, source: &str) -> f64 {
    map.get(&(outcome.to_owned(), source.to_owned()))
        .copied()
        .unwrap_or(0.0)
}

#[tokio::test]
async fn decisions_by_outcome_and_source_and_store_latency_are_scraped() {
    let _alone = crate::alone().await;
    let handle = recorder();
    let rule = "metrics-test-api";

    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    // The fixed window's denials are final: the deny cache holds them.
    // (An hour's window: no window edge is crossed during the test.)
    let policy = "2/h".parse::<Policy>().unwrap().fixed_window().unwrap();
    let limiter = Limiter::new(store, policy)
        .with_name(rule)
        .with_circuit_breaker(CircuitBreaker::new(2, Duration::from_secs(60)));
    let layer = RateLimitLayer::from_limiter(limiter.clone(), |req: &Request<Body>| {
        (req.uri().path() != "/health").then_some("client")
    });
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/health", get(|| async { "ok" }))
        .layer(layer);
    // 2 admitted by the store, 1 denied by it, then 2 denied by the deny cache.
    for _ in 0..5 {
        app.clone().oneshot(request("/", PEER)).await.unwrap();
    }
    app.clone().oneshot(request("/health", PEER)).await.unwrap();
    // An operator's block: denied as blocked.
    limiter
        .block("other", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(!limiter.check("other").await.unwrap().allowed());
    // Redis stopped: store errors admitted by FailMode::Open; after two
    // the breaker opens.
    server.signal("STOP");
    for key in ["a", "b", "c"] {
        assert!(limiter.check(key).await.unwrap().allowed());
    }

    let samples = scrape(handle.clone()).await;
    server.signal("CONT");
    let by = decisions(&samples, rule);
    assert_eq!(count(&by, "admitted", "store"), 2.0, "{by:?}");
    assert_eq!(count(&by, "denied", "store"), 1.0, "{by:?}");
    assert_eq!(count(&by, "denied", "deny_cache"), 2.0, "{by:?}");
    assert_eq!(count(&by, "skipped", "none"), 1.0, "{by:?}");
    assert_eq!(count(&by, "blocked", "store"), 1.0, "{by:?}");
    assert_eq!(count(&by, "failed_open", "none"), 3.0, "{by:?}");
    let breaker = samples
        .iter()
        .find(|s| {
            s.metric == "ratelimit_circuit_breaker_open" && s.labels.get("rule") == Some(rule)
        })
        .expect("the breaker gauge");
    assert!(
        matches!(breaker.value, Value::Gauge(v) if v == 1.0),
        "{breaker:?}"
    );
    // The store latency histogram: one observation per store call that
    // answered or failed (the third failure was not asked: circuit open).
    let latency = samples
        .iter()
        .find(|s| {
            s.metric == "ratelimit_store_duration_seconds"
                && s.labels.get("rule") == Some(rule)
                && matches!(s.value, Value::Histogram(_))
        })
        .expect("the store latency histogram");
    let Value::Histogram(buckets) = &latency.value else {
        unreachable!()
    };
    let total = buckets.iter().map(|b| b.count).fold(0.0, f64::max);
    assert_eq!(total, 6.0, "{buckets:?}");
}

#[tokio::test]
async fn local_quota_fallback_and_rule_sets_are_scraped() {
    let _alone = crate::alone().await;
    let handle = recorder();

    // A local quota: the first check takes a batch from the store, the
    // next are admitted in process.
    let local = Limiter::new(MemoryStore::new(), "100/min".parse::<Policy>().unwrap())
        .with_name("metrics-test-local")
        .with_local_quota(LocalQuota::new(10, Duration::from_secs(5)).unwrap())
        .unwrap();
    for _ in 0..5 {
        assert!(local.check("hot").await.unwrap().allowed());
    }
    // A local quota's refused batch: the request it was asked for is
    // counted once. 6 an hour, batches of 5: the first request takes a
    // batch (1 + 4 held), the 6th finds the batch refused and is checked
    // alone, the 7th is denied: 7 requests, 7 counted.
    let refused = Limiter::new(
        MemoryStore::new(),
        "6/h".parse::<Policy>().unwrap().gcra().unwrap(),
    )
    .with_name("metrics-test-refused")
    .with_local_quota(LocalQuota::new(5, Duration::from_secs(60)).unwrap())
    .unwrap();
    let admitted = {
        let mut admitted = 0;
        for _ in 0..7 {
            admitted += usize::from(refused.check("hot").await.unwrap().allowed());
        }
        admitted
    };
    assert_eq!(admitted, 6);

    // A fallback: Redis stopped, limited in process.
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    let fallback = Limiter::new(store, "1/min".parse::<Policy>().unwrap())
        .with_name("metrics-test-fallback")
        .with_fail_mode(FailMode::fallback(MemoryStore::new(), 1));
    server.signal("STOP");
    assert!(fallback.check("k").await.unwrap().allowed());
    assert!(!fallback.check("k").await.unwrap().allowed());
    server.signal("CONT");

    // A watched rules file: one set loaded, one rejected.
    let dir = std::env::temp_dir().join(format!("metrics-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    std::fs::write(
        &path,
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\n",
    )
    .unwrap();
    let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("").unwrap());
    let watch = rules.watch_file(&path, Duration::from_millis(20));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while watch.status().version < 1 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::write(
        &path,
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"0/s\"\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while watch.status().rejected.is_none() {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let samples = scrape(handle).await;
    let by = decisions(&samples, "metrics-test-local");
    assert_eq!(count(&by, "admitted", "store"), 1.0, "{by:?}");
    assert_eq!(count(&by, "admitted", "local_quota"), 4.0, "{by:?}");
    let by = decisions(&samples, "metrics-test-refused");
    assert_eq!(
        by.values().sum::<f64>(),
        7.0,
        "one count per request: {by:?}"
    );
    assert_eq!(count(&by, "admitted", "local_quota"), 4.0, "{by:?}");
    assert_eq!(
        count(&by, "admitted", "store") + count(&by, "admitted", "local_quota"),
        6.0,
        "{by:?}"
    );
    let by = decisions(&samples, "metrics-test-fallback");
    assert_eq!(count(&by, "admitted", "fallback"), 1.0, "{by:?}");
    assert_eq!(count(&by, "denied", "fallback"), 1.0, "{by:?}");
    let sets = |result: &str| {
        samples
            .iter()
            .find(|s| {
                s.metric == "ratelimit_rule_sets_total" && s.labels.get("result") == Some(result)
            })
            .map(|s| match s.value {
                Value::Counter(n) => n,
                _ => panic!("{s:?}"),
            })
            .unwrap_or(0.0)
    };
    assert!(sets("loaded") >= 1.0 && sets("rejected") >= 1.0);
    std::fs::remove_dir_all(&dir).unwrap();
}
