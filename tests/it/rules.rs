//! Limits as data, against a real redis-server: tiers per request, several
//! matching rules with no quota spent on a denial, cost per request,
//! counting by outcome with refunds, block after a breach, `only` lists,
//! counts across a reload, and rule sets from a watched file and from
//! Redis (a bad one rejected with the old one kept).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;
use crate::support::eventually::eventually;

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::http::{header, request, request_with, send};
use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use http::{Method, Request, StatusCode};
use tower_redis_ratelimit::rules::RulesLayer;
use tower_redis_ratelimit::rules::{self, Call, Tier};
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, RedisStore, Store, key};

/// The algorithms that count requests (concurrency counts requests in
/// flight, checked on its own below).
const COUNTING: [&str; 4] = ["sliding-log", "fixed-window", "sliding-window", "gcra"];

async fn rules_on(server: &RedisServer, text: &str) -> Rules {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    Rules::new(store, RuleSet::from_toml(text).unwrap()).without_deny_cache()
}

/// A router answering every path: `/login` answers 401 unless the header
/// `x-password` is `right`, `/fail` answers 500, the others 200.
fn app(layer: RulesLayer) -> Router {
    Router::new()
        .route(
            "/login",
            post(|req: Request<Body>| async move {
                if req
                    .headers()
                    .get("x-password")
                    .is_some_and(|v| v == "right")
                {
                    StatusCode::OK
                } else {
                    StatusCode::UNAUTHORIZED
                }
            }),
        )
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .fallback(|| async { "ok" })
        .layer(layer)
}

async fn status(app: &Router, req: Request<Body>) -> StatusCode {
    send(app, req).await.0.status()
}

fn post_login(peer: &str, password: &str) -> Request<Body> {
    let mut req = request_with("/login", peer, &[("x-password", password)]);
    *req.method_mut() = Method::POST;
    req
}

/// The units a rule has left for `key` (peeked: nothing counted; a peek
/// tells what a check at the rule's cost would leave).
async fn remaining(rules: &Rules, rule: &str, tier: Option<&str>, key: &str) -> u64 {
    let active = rules.current();
    let limiter = active.limiter(rule, tier).unwrap();
    let peeked = limiter.peek(key).await.unwrap();
    if peeked.allowed() {
        peeked.remaining() + limiter.policy().cost()
    } else {
        peeked.remaining()
    }
}

/// Window algorithms here count per hour; refunds are skipped once the
/// window that counted a request ended, so keep clear of the hour's end.
async fn clear_of_the_hour() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let into_hour = now.as_secs() % 3600;
    if into_hour > 3600 - 60 {
        tokio::time::sleep(Duration::from_secs(3600 - into_hour + 1)).await;
    }
}

#[tokio::test]
async fn the_tier_is_picked_per_request_from_the_rules_or_a_closure() {
    let server = RedisServer::start();
    let text = r#"
        tier = "header:x-plan"
        [[rules]]
        name = "api"
        path = "/api/{*rest}"
        key = "ip"
        policy = "2/h"
        tiers = { pro = "4/h" }
    "#;
    // The plan header is believed from the proxies the layer trusts.
    let behind_proxies = || key::client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let app = app(RulesLayer::new(rules_on(&server, text).await).with_client_ip(behind_proxies()));
    let from = |peer, plan: Option<&str>| {
        let headers: Vec<(&str, &str)> = plan.map(|p| ("x-plan", p)).into_iter().collect();
        request_with("/api/items", peer, &headers)
    };
    // No plan, and an unknown plan: the default, 2 per hour.
    for plan in [None, Some("gold")] {
        let peer = if plan.is_none() {
            "10.0.0.1"
        } else {
            "10.0.0.2"
        };
        let (first, _) = send(&app, from(peer, plan)).await;
        assert_eq!(header(&first, "x-ratelimit-limit"), Some("2"));
        assert_eq!(status(&app, from(peer, plan)).await, StatusCode::OK);
        assert_eq!(
            status(&app, from(peer, plan)).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    // Pro: 4 per hour.
    for i in 0..4 {
        let (response, _) = send(&app, from("10.0.0.3", Some("pro"))).await;
        assert_eq!(response.status(), StatusCode::OK, "pro request {i}");
        assert_eq!(header(&response, "x-ratelimit-limit"), Some("4"));
    }
    assert_eq!(
        status(&app, from("10.0.0.3", Some("pro"))).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Paths the rule does not match are not limited.
    for _ in 0..5 {
        assert_eq!(
            status(&app, request("/other", "10.0.0.1")).await,
            StatusCode::OK
        );
    }

    // From any other peer, the header is not read: a client cannot pick
    // its own plan.
    for _ in 0..2 {
        assert_eq!(
            status(&app, from("192.0.2.7", Some("pro"))).await,
            StatusCode::OK
        );
    }
    let (denied, _) = send(&app, from("192.0.2.7", Some("pro"))).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "x-ratelimit-limit"), Some("2"));
    let unproxied = self::app(RulesLayer::new(rules_on(&server, text).await));
    let (response, _) = send(&unproxied, from("10.0.0.9", Some("pro"))).await;
    assert_eq!(
        header(&response, "x-ratelimit-limit"),
        Some("2"),
        "no trusted proxies: never read"
    );

    // A closure overrides the rule set's source (here: from the Tier
    // extension an auth middleware would insert).
    let layer = RulesLayer::new(rules_on(&server, text).await)
        .with_tier(|_, extensions| extensions.get::<Tier>().map(|t| t.0.to_uppercase()));
    let app = self::app(layer);
    let mut req = request_with("/api/x", "10.0.0.4", &[("x-plan", "pro")]);
    req.extensions_mut().insert(Tier("free".to_owned()));
    let (response, _) = send(&app, req).await;
    assert_eq!(
        header(&response, "x-ratelimit-limit"),
        Some("2"),
        "the header is not read"
    );

    // `tier = "extension"` reads the Tier extension.
    let ext = text.replace("header:x-plan", "extension");
    let app = self::app(RulesLayer::new(rules_on(&server, &ext).await));
    let mut req = request("/api/x", "10.0.0.5");
    req.extensions_mut().insert(Tier("pro".to_owned()));
    let (response, _) = send(&app, req).await;
    assert_eq!(header(&response, "x-ratelimit-limit"), Some("4"));
}

#[tokio::test]
async fn a_denial_by_one_rule_spends_no_other_rules_quota() {
    clear_of_the_hour().await;
    let server = RedisServer::start();
    for algorithm in COUNTING {
        let text = format!(
            r#"
            [[rules]]
            name = "global"
            key = "global"
            policy = "5/h"
            algorithm = "{algorithm}"

            [[rules]]
            name = "per-ip"
            key = "ip"
            policy = "1/h"
            algorithm = "{algorithm}"
            "#
        );
        let rules = rules_on(&server, &text).await;
        let app = app(RulesLayer::new(rules.clone()));
        server.command(&["FLUSHALL"]);
        assert_eq!(
            status(&app, request("/", "10.0.0.1")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        for _ in 0..10 {
            let (response, _) = send(&app, request("/", "10.0.0.1")).await;
            assert_eq!(
                response.status(),
                StatusCode::TOO_MANY_REQUESTS,
                "{algorithm}"
            );
            // The response shows the rule that denied.
            assert_eq!(
                header(&response, "x-ratelimit-limit"),
                Some("1"),
                "{algorithm}"
            );
        }
        assert_eq!(
            remaining(&rules, "global", None, "global").await,
            4,
            "{algorithm}: the denials spent the global quota"
        );
        // The other 4 units are there for other clients.
        for peer in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"] {
            assert_eq!(
                status(&app, request("/", peer)).await,
                StatusCode::OK,
                "{algorithm} {peer}"
            );
        }
        assert_eq!(
            status(&app, request("/", "10.0.0.6")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        // A denial by the global rule gives back the per-ip unit.
        assert_eq!(
            remaining(&rules, "per-ip", None, "10.0.0.6").await,
            1,
            "{algorithm}"
        );
    }

    // A concurrency rule's slot is given back too.
    let rules = rules_on(
        &server,
        r#"
        [[rules]]
        name = "in-flight"
        key = "global"
        policy = "3/1m"   # 3 in flight, each lease at most a minute
        algorithm = "concurrency"

        [[rules]]
        name = "per-ip"
        key = "ip"
        policy = "1/h"
        "#,
    )
    .await;
    server.command(&["FLUSHALL"]);
    let app = app(RulesLayer::new(rules.clone()));
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    for _ in 0..5 {
        assert_eq!(
            status(&app, request("/", "10.0.0.1")).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(remaining(&rules, "in-flight", None, "global").await, 3);
}

#[tokio::test]
async fn a_denied_key_in_the_deny_cache_touches_no_other_rule() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    // The deny cache answers where a denial is final: not for the sliding
    // log's default (MULTI) execution.
    let text = "[[rules]]\nname = \"global\"\nkey = \"global\"\npolicy = \"100/h\"\nalgorithm = \"gcra\"\n\
                [[rules]]\nname = \"per-ip\"\nkey = \"ip\"\npolicy = \"1/h\"\nalgorithm = \"fixed-window\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap());
    let app = app(RulesLayer::new(rules.clone()));
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    assert_eq!(
        status(&app, request("/", "10.0.0.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let calls = server.calls("evalsha");
    for _ in 0..20 {
        assert_eq!(
            status(&app, request("/", "10.0.0.1")).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(
        server.calls("evalsha"),
        calls,
        "a cached denial asked Redis"
    );
    assert_eq!(remaining(&rules, "global", None, "global").await, 99);
}

#[tokio::test]
async fn a_request_costs_what_the_rule_or_the_cost_closure_says() {
    clear_of_the_hour().await;
    let server = RedisServer::start();
    for algorithm in COUNTING {
        server.command(&["FLUSHALL"]);
        let text = format!(
            "[[rules]]\nname = \"upload\"\nkey = \"ip\"\npolicy = \"10/h\"\nalgorithm = \"{algorithm}\"\n\
             [[rules]]\nname = \"report\"\npath = \"/report\"\nkey = \"ip\"\npolicy = \"10/h\"\ncost = 3\nalgorithm = \"{algorithm}\"\n"
        );
        let rules = rules_on(&server, &text).await;
        let layer = RulesLayer::new(rules.clone()).with_cost(|rule, headers| {
            (rule.name() == "upload")
                .then(|| headers.get("x-cost")?.to_str().ok()?.parse().ok())
                .flatten()
        });
        let app = self::app(layer);
        let costing = |n: &str| request_with("/upload", "10.0.0.1", &[("x-cost", n)]);
        assert_eq!(
            status(&app, costing("4")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "upload", None, "10.0.0.1").await,
            6,
            "{algorithm}"
        );
        assert_eq!(
            status(&app, costing("7")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "upload", None, "10.0.0.1").await,
            6,
            "{algorithm}: a denial counted"
        );
        // A cost of 0 is not counted; no header: the rule's cost (1).
        assert_eq!(
            status(&app, costing("0")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        assert_eq!(
            status(&app, request("/upload", "10.0.0.1")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "upload", None, "10.0.0.1").await,
            5,
            "{algorithm}"
        );
        // A cost above the max is lowered to the max: admitted on a fresh key.
        assert_eq!(
            status(
                &app,
                request_with("/upload", "10.0.0.2", &[("x-cost", "1000")])
            )
            .await,
            StatusCode::OK,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "upload", None, "10.0.0.2").await,
            0,
            "{algorithm}"
        );
        // The rule's own cost: 3 of 10 per report (both rules match /report).
        for _ in 0..3 {
            assert_eq!(
                status(&app, request("/report", "10.0.0.3")).await,
                StatusCode::OK,
                "{algorithm}"
            );
        }
        assert_eq!(
            status(&app, request("/report", "10.0.0.3")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "report", None, "10.0.0.3").await,
            1,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "upload", None, "10.0.0.3").await,
            7,
            "{algorithm}: the denied report's unit was not given back"
        );
    }
}

/// Wait until `rule` has `expected` left for `key` (refunds run in a task
/// after the response).
async fn wait_for_remaining(rules: &Rules, rule: &str, key: &str, expected: u64, what: &str) {
    let (within, step) = (Duration::from_secs(2), Duration::from_millis(10));
    let what = format!("{what}: left");
    eventually(within, step, &what, expected, || {
        remaining(rules, rule, None, key)
    })
    .await;
}

#[tokio::test]
async fn only_the_outcomes_a_rule_counts_are_counted() {
    clear_of_the_hour().await;
    let server = RedisServer::start();
    for algorithm in COUNTING {
        server.command(&["FLUSHALL"]);
        let text = format!(
            "[[rules]]\nname = \"login\"\nmethods = [\"POST\"]\npath = \"/login\"\nkey = \"ip\"\n\
             policy = \"3/h\"\nalgorithm = \"{algorithm}\"\ncount = [\"4xx\"]\n\
             [[rules]]\nname = \"fail\"\npath = \"/fail\"\nkey = \"ip\"\n\
             policy = \"2/h\"\nalgorithm = \"{algorithm}\"\nrefund = [\"5xx\"]\n"
        );
        let rules = rules_on(&server, &text).await;
        let app = app(RulesLayer::new(rules.clone()));
        // Successful logins are refunded: any number of them.
        for i in 0..6 {
            assert_eq!(
                status(&app, post_login("10.0.0.1", "right")).await,
                StatusCode::OK,
                "{algorithm} login {i}"
            );
            wait_for_remaining(&rules, "login", "10.0.0.1", 3, algorithm).await;
        }
        // Failed ones count: 3, then denied.
        for _ in 0..3 {
            assert_eq!(
                status(&app, post_login("10.0.0.1", "wrong")).await,
                StatusCode::UNAUTHORIZED,
                "{algorithm}"
            );
        }
        assert_eq!(
            status(&app, post_login("10.0.0.1", "right")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        assert_eq!(
            remaining(&rules, "login", None, "10.0.0.1").await,
            0,
            "{algorithm}"
        );
        // Responses refunded by `refund = ["5xx"]`.
        for _ in 0..5 {
            assert_eq!(
                status(&app, request("/fail", "10.0.0.2")).await,
                StatusCode::INTERNAL_SERVER_ERROR,
                "{algorithm}"
            );
            wait_for_remaining(&rules, "fail", "10.0.0.2", 2, algorithm).await;
        }
    }
}

/// When the block a breach calls for cannot be written (here a Redis user
/// may read block keys but not write them), the request is denied as by
/// the rate alone: its answer claims no block, and nothing holds the key
/// past the rate's own window. (The sliding log's `Transaction` execution,
/// whose checks read the block key without a script: Redis refuses this
/// user every script that names a block key, the block's included.)
#[tokio::test]
async fn a_block_that_cannot_be_written_is_not_announced() {
    let server = RedisServer::start();
    server.command(&[
        "ACL",
        "SETUSER",
        "noblock",
        "on",
        ">pw",
        "%RW~rl:log:*",
        "%R~rl:block:*",
        "+@all",
    ]);
    let store = RedisStore::connect(&format!("redis://noblock:pw@127.0.0.1:{}", server.port()))
        .await
        .unwrap();
    let text = "[[rules]]\nname = \"burst\"\nkey = \"ip\"\npolicy = \"2/s\"\nblock = \"1h\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap()).without_deny_cache();
    let one = app(RulesLayer::new(rules.clone()));
    for _ in 0..2 {
        assert_eq!(status(&one, request("/", "10.0.0.1")).await, StatusCode::OK);
    }
    let (denied, _) = send(&one, request("/", "10.0.0.1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&denied, "retry-after"),
        Some("1"),
        "the rate's wait, not the hour's block"
    );
    // The store holds no block: after the window the key is admitted.
    assert_eq!(
        server.command(&["EXISTS", "rl:block:{burst:10.0.0.1}"]),
        ":0\r\n"
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(status(&one, request("/", "10.0.0.1")).await, StatusCode::OK);
}

#[tokio::test]
async fn a_breach_blocks_the_key_in_every_process() {
    let server = RedisServer::start();
    for algorithm in COUNTING {
        server.command(&["FLUSHALL"]);
        let text = format!(
            "[[rules]]\nname = \"burst\"\nkey = \"ip\"\npolicy = \"2/s\"\nalgorithm = \"{algorithm}\"\nblock = \"3s\"\n"
        );
        let one = app(RulesLayer::new(rules_on(&server, &text).await));
        let other = rules_on(&server, &text).await;
        let other_app = app(RulesLayer::new(other.clone()));
        // The burst in one second of the fixed window.
        support::start_of_a_second().await;
        let start = Instant::now();
        assert_eq!(
            status(&one, request("/", "10.0.0.1")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        assert_eq!(
            status(&one, request("/", "10.0.0.1")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        let (denied, _) = send(&one, request("/", "10.0.0.1")).await;
        assert_eq!(
            denied.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        assert_eq!(
            header(&denied, "retry-after"),
            Some("3"),
            "{algorithm}: the block's length"
        );
        // Past the rate's window, the key is still blocked, here and in
        // another process.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let peeked = other
            .current()
            .limiter("burst", None)
            .unwrap()
            .peek("10.0.0.1")
            .await
            .unwrap();
        assert!(peeked.blocked(), "{algorithm}: {peeked:?}");
        assert_eq!(
            status(&other_app, request("/", "10.0.0.1")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        assert_eq!(
            status(&one, request("/", "10.0.0.1")).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{algorithm}"
        );
        // Another key is not blocked.
        assert_eq!(
            status(&other_app, request("/", "10.0.0.2")).await,
            StatusCode::OK,
            "{algorithm}"
        );
        // Once the block ends, the key is admitted again.
        let ends = start + Duration::from_millis(3300);
        tokio::time::sleep(ends.saturating_duration_since(Instant::now())).await;
        assert_eq!(
            status(&other_app, request("/", "10.0.0.1")).await,
            StatusCode::OK,
            "{algorithm}"
        );
    }
}

#[tokio::test]
async fn an_only_list_refuses_every_other_caller_and_an_allow_list_is_unlimited() {
    let server = RedisServer::start();
    let rules = rules_on(
        &server,
        r#"
        [[rules]]
        name = "partners"
        path = "/partners/{*rest}"
        key = "header:x-api-key"
        policy = "1/h"
        only = ["partner-a", "partner-b"]
        allow = ["partner-b"]
        "#,
    )
    .await;
    let app = app(RulesLayer::new(rules));
    let with_key = |key: &str| request_with("/partners/x", "10.0.0.1", &[("x-api-key", key)]);
    assert_eq!(status(&app, with_key("partner-a")).await, StatusCode::OK);
    assert_eq!(
        status(&app, with_key("partner-a")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..5 {
        assert_eq!(
            status(&app, with_key("partner-b")).await,
            StatusCode::OK,
            "allowed: unlimited"
        );
    }
    assert_eq!(
        status(&app, with_key("stranger")).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        status(&app, request("/partners/x", "10.0.0.1")).await,
        StatusCode::FORBIDDEN,
        "no key at all"
    );
    // Other paths are not this rule's.
    assert_eq!(
        status(&app, request("/public", "10.0.0.1")).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn counts_survive_a_reload_that_keeps_a_rules_name() {
    let server = RedisServer::start();
    let before = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"3/h\"\n\
                  [[rules]]\nname = \"login\"\nkey = \"ip\"\npolicy = \"3/h\"\npath = \"/signin\"\n";
    let rules = rules_on(&server, before).await;
    let app = app(RulesLayer::new(rules.clone()));
    for _ in 0..2 {
        assert_eq!(
            status(&app, request("/signin", "10.0.0.1")).await,
            StatusCode::OK
        );
    }
    assert_eq!(remaining(&rules, "api", None, "10.0.0.1").await, 1);
    assert_eq!(remaining(&rules, "login", None, "10.0.0.1").await, 1);
    let after = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"3/h\"\n\
                 [[rules]]\nname = \"login\"\nkey = \"ip\"\npolicy = \"5/h\"\npath = \"/signin\"\n";
    rules.replace(RuleSet::from_toml(after).unwrap());
    assert_eq!(
        remaining(&rules, "api", None, "10.0.0.1").await,
        1,
        "unchanged: kept"
    );
    assert_eq!(
        remaining(&rules, "login", None, "10.0.0.1").await,
        3,
        "a changed max applies to the same count"
    );
    assert_eq!(
        status(&app, request("/signin", "10.0.0.1")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, request("/signin", "10.0.0.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn rules_in_redis_are_followed_and_a_bad_set_keeps_the_old_one() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let first = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"1/h\"\n";
    assert_eq!(
        rules::publish(&mut connection, "rl:rules", first)
            .await
            .unwrap(),
        1
    );

    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(store, RuleSet::from_toml("").unwrap());
    let watch = rules
        .follow_redis(client.clone(), "rl:rules", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(watch.status().version >= 1);
    let app = app(RulesLayer::new(rules.clone()));
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    assert_eq!(
        status(&app, request("/", "10.0.0.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );

    // A new version reaches the follower through pub/sub (the backstop
    // check is 30 s away).
    let second = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"3/h\"\n";
    let published = Instant::now();
    assert_eq!(
        rules::publish(&mut connection, "rl:rules", second)
            .await
            .unwrap(),
        2
    );
    while watch.status().version != 2 {
        assert!(
            published.elapsed() < Duration::from_secs(1),
            "not followed within 1 s: {:?}",
            watch.status()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);

    // publish() refuses a bad set and writes nothing.
    let bad = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"3 per hour\"\n";
    let error = rules::publish(&mut connection, "rl:rules", bad)
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("rule \"api\" (#1), field policy"),
        "{error}"
    );
    let version: u64 = redis::cmd("HGET")
        .arg("rl:rules")
        .arg("version")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(version, 2);

    // A bad set written around publish() is rejected by the follower,
    // named, and the rules in force stay.
    server.command(&["HSET", "rl:rules", "rules", bad, "version", "3"]);
    server.command(&["PUBLISH", "rl:rules", "3"]);
    let written = Instant::now();
    while watch.status().error.is_none() {
        assert!(
            written.elapsed() < Duration::from_secs(1),
            "no error recorded"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let status_now = watch.status();
    assert_eq!(status_now.version, 2, "{status_now:?}");
    assert!(
        status_now
            .error
            .as_deref()
            .unwrap()
            .contains("field policy"),
        "{status_now:?}"
    );
    assert_eq!(
        rules.current().set().rules()[0].policy(None).to_string(),
        "3/h"
    );
    // 3 per hour, two spent (the count carried over from 1/h): one more,
    // then denied.
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    assert_eq!(
        status(&app, request("/", "10.0.0.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );

    // A missed message is caught by the periodic check.
    let fast = rules
        .follow_redis(client.clone(), "rl:rules", Duration::from_millis(200))
        .await;
    assert!(
        fast.is_err(),
        "the bad set in Redis is refused at the start"
    );
    server.command(&["HSET", "rl:rules", "rules", first, "version", "4"]);
    let follower = Rules::new(
        RedisStore::connect(&server.url()).await.unwrap(),
        RuleSet::from_toml(second).unwrap(),
    );
    let watch = follower
        .follow_redis(client.clone(), "rl:rules", Duration::from_millis(200))
        .await
        .unwrap();
    server.command(&["HSET", "rl:rules", "rules", second, "version", "5"]);
    let written = Instant::now();
    while watch.status().version != 5 {
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "not caught by the check: {:?}",
            watch.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        follower.current().set().rules()[0].policy(None).to_string(),
        "3/h"
    );
}

#[tokio::test]
async fn a_watched_file_is_followed_and_a_bad_one_keeps_the_old_rules() {
    let server = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("rules-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    std::fs::write(
        &path,
        "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"1/h\"\n",
    )
    .unwrap();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(store, RuleSet::from_file(&path).unwrap());
    let watch = rules.watch_file(&path, Duration::from_millis(50));
    std::fs::write(
        &path,
        "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"7/h\"\n",
    )
    .unwrap();
    let written = Instant::now();
    while rules.current().set().rules()[0].policy(None).to_string() != "7/h" {
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "{:?}",
            watch.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(watch.status().version >= 1);
    std::fs::write(
        &path,
        "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"7/h\"\nalgorithm = \"leaky\"\n",
    )
    .unwrap();
    let written = Instant::now();
    while watch.status().error.is_none() {
        assert!(written.elapsed() < Duration::from_secs(2));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        watch.status().error.unwrap().contains("field algorithm"),
        "{:?}",
        watch.status()
    );
    assert_eq!(
        rules.current().set().rules()[0].policy(None).to_string(),
        "7/h"
    );
    assert_eq!(
        rules.current().set().rules()[0].policy(None).algorithm(),
        Algorithm::SlidingLog
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A save that truncates a watched file (an editor, `>` in a shell) leaves
/// it empty for a moment: the rules in force stay, and the status says
/// why; an explicitly empty set (`rules = []`) lifts them.
#[tokio::test]
async fn an_emptied_rules_file_keeps_the_rules_until_it_says_rules_are_none() {
    let dir = std::env::temp_dir().join(format!("rules-empty-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    let api = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"1/h\"\n";
    std::fs::write(&path, api).unwrap();
    let rules = Rules::new(MemoryStore::new(), RuleSet::from_file(&path).unwrap());
    let watch = rules.watch_file(&path, Duration::from_millis(20));
    // Each emptied text, then the rules back (the warning is lifted).
    for emptied in ["", "\n  \n", "# being written\n", "version = 3\n"] {
        std::fs::write(&path, emptied).unwrap();
        let written = Instant::now();
        while !watch
            .status()
            .error
            .is_some_and(|e| e.contains("names no rules"))
        {
            assert!(
                written.elapsed() < Duration::from_secs(2),
                "{:?}",
                watch.status()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Several turns of the watch later, still in force.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(rules.current().set().rules().len(), 1, "{emptied:?}");
        assert!(watch.status().error.unwrap().contains("rules = []"));
        std::fs::write(&path, api).unwrap();
        let written = Instant::now();
        while watch.status().error.is_some() {
            assert!(
                written.elapsed() < Duration::from_secs(2),
                "the warning stays after the rules came back: {:?}",
                watch.status()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    std::fs::write(&path, "rules = []\n").unwrap();
    let written = Instant::now();
    while !rules.current().set().rules().is_empty() {
        assert!(
            written.elapsed() < Duration::from_secs(2),
            "{:?}",
            watch.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(watch.status().error, None);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_engine_limits_work_that_is_not_a_request() {
    let server = RedisServer::start();
    let rules = rules_on(&server, "[[rules]]\nname = \"jobs\"\ngrpc = \"/jobs.Queue/*\"\nkey = \"global\"\npolicy = \"2/h\"\n").await;
    let check = || {
        rules
            .current()
            .check(&Method::POST, "/jobs.Queue/Run", None, |_| {
                Ok::<_, std::convert::Infallible>(Some(Call::new("tenant-1")))
            })
            .unwrap()
    };
    assert!(check().await.unwrap().allowed());
    assert!(check().await.unwrap().allowed());
    let denied = check().await.unwrap();
    assert!(!denied.allowed());
    let (rule, _, decision, _) = denied.shown().unwrap();
    assert_eq!((rule, decision.remaining()), ("jobs", 0));
}

#[tokio::test]
async fn requests_without_a_key_header_count_together() {
    let server = RedisServer::start();
    let rules = rules_on(
        &server,
        "[[rules]]\nname = \"reports\"\nkey = \"header:x-api-key\"\npolicy = \"2/h\"\n",
    )
    .await;
    let app = app(RulesLayer::new(rules));
    // Leaving the header out does not get around the rule: every request
    // without it shares one budget, apart from any key's.
    for peer in ["10.0.0.1", "10.0.0.2"] {
        assert_eq!(status(&app, request("/", peer)).await, StatusCode::OK);
    }
    assert_eq!(
        status(&app, request("/", "10.0.0.3")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A key spelled like the missing marker is a key of its own.
    for _ in 0..2 {
        assert_eq!(
            status(
                &app,
                request_with("/", "10.0.0.1", &[("x-api-key", "hex:")])
            )
            .await,
            StatusCode::OK
        );
    }
    assert_eq!(
        status(&app, request_with("/", "10.0.0.1", &[("x-api-key", "k")])).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_cost_is_bounded_by_the_policy_and_ignored_by_a_concurrency_rule() {
    let server = RedisServer::start();
    let rules = rules_on(
        &server,
        "[[rules]]\nname = \"bytes\"\nkey = \"ip\"\npolicy = \"1000000/1000d\"\nalgorithm = \"gcra\"\n\
         [[rules]]\nname = \"slots\"\nkey = \"ip\"\npolicy = \"2/1m\"\nalgorithm = \"concurrency\"\n",
    )
    .await;
    // The cost closure answers for every rule: a content length past
    // MAX_COST counts whole under GCRA (MAX_COST bounds the sliding log
    // alone), one past the max is lowered to it; neither reaches the
    // concurrency rule.
    let layer = RulesLayer::new(rules.clone())
        .with_cost(|_, headers| headers.get("content-length")?.to_str().ok()?.parse().ok());
    let app = app(layer);
    let (response, body) = send(
        &app,
        request_with("/", "10.0.0.1", &[("content-length", "0"), ("x-size", "1")]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
    let big = request_with("/", "10.0.0.1", &[("content-length", "20000")]);
    let (response, body) = send(&app, big).await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
    assert_eq!(
        remaining(&rules, "bytes", None, "10.0.0.1").await,
        1_000_000 - 20_000,
        "counted whole"
    );
    let huge = request_with("/", "10.0.0.2", &[("content-length", "20000000")]);
    let (response, body) = send(&app, huge).await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
    assert_eq!(
        remaining(&rules, "bytes", None, "10.0.0.2").await,
        0,
        "lowered to the max"
    );
    // The concurrency slots were held one per request and given back.
    assert_eq!(remaining(&rules, "slots", None, "10.0.0.1").await, 2);
}

#[tokio::test]
async fn a_breach_blocks_with_the_deny_cache_on() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let text = "[[rules]]\nname = \"burst\"\nkey = \"ip\"\npolicy = \"1/s\"\nalgorithm = \"fixed-window\"\nblock = \"2s\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap());
    let app = app(RulesLayer::new(rules.clone()));
    // Both requests in one second of the fixed window.
    support::start_of_a_second().await;
    let start = Instant::now();
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    let (denied, _) = send(&app, request("/", "10.0.0.1")).await;
    assert_eq!(header(&denied, "retry-after"), Some("2"));
    // The cached denial ends with the rate's window; the block holds on.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (denied, _) = send(&app, request("/", "10.0.0.1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "retry-after"), Some("1"));
    tokio::time::sleep(
        (start + Duration::from_millis(2300)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
}

/// A refund gives back the refunded request's own entries: after a later
/// request was admitted, the log keeps the later one's entry (a reward
/// would remove the newest, the later one's, and the log would forget its
/// unit when the refunded one's entry expires).
#[tokio::test]
async fn a_sliding_log_refund_removes_the_requests_own_entries() {
    let server = RedisServer::start();
    // In memory, on a manual clock.
    let clock = tower_redis_ratelimit::clock::ManualClock::new(Duration::from_secs(1_000));
    let memory = MemoryStore::with_clock(clock.clone());
    let policy: Policy = "2/3s".parse().unwrap();
    let first = memory.check("k", &policy).await.unwrap();
    clock.advance(Duration::from_secs(1));
    assert!(memory.check("k", &policy).await.unwrap().allowed());
    let id = first
        .refund_id()
        .expect("an admitted sliding-log check names its entries");
    memory
        .command("k", &policy, Command::Refund { id, units: 1 })
        .await
        .unwrap();
    clock.advance(Duration::from_millis(2_500));
    // The first entry would have aged out by now; the second is still in.
    assert_eq!(
        memory
            .command("k", &policy, Command::Peek)
            .await
            .unwrap()
            .remaining(),
        0
    );

    // In Redis, in both executions.
    for execution in ["transaction", "script"] {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let policy: Policy = "2/2s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution.parse().unwrap())
            .unwrap();
        let key = format!("refund-{execution}");
        let started = Instant::now();
        let first = store.check(&key, &policy).await.unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(
            store.check(&key, &policy).await.unwrap().allowed(),
            "{execution}"
        );
        let id = first.refund_id().unwrap();
        store
            .command(&key, &policy, Command::Refund { id, units: 1 })
            .await
            .unwrap();
        // Refunding it again changes nothing.
        store
            .command(&key, &policy, Command::Refund { id, units: 1 })
            .await
            .unwrap();
        tokio::time::sleep(
            (started + Duration::from_millis(2_300)).saturating_duration_since(Instant::now()),
        )
        .await;
        let peeked = store.command(&key, &policy, Command::Peek).await.unwrap();
        assert_eq!(
            peeked.remaining(),
            0,
            "{execution}: the later request's entry was removed"
        );
        // A refund of a cost of 3 removes its three entries.
        let policy3 = "5/h"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution.parse().unwrap())
            .unwrap()
            .with_cost(3)
            .unwrap();
        let key3 = format!("cost-{execution}");
        let check = store.check(&key3, &policy3).await.unwrap();
        let base = "5/h"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution.parse().unwrap())
            .unwrap();
        store
            .command(
                &key3,
                &base,
                Command::Refund {
                    id: check.refund_id().unwrap(),
                    units: 3,
                },
            )
            .await
            .unwrap();
        assert_eq!(
            store
                .command(&key3, &base, Command::Peek)
                .await
                .unwrap()
                .remaining(),
            4,
            "{execution}"
        );
    }
}

/// On a 3-master cluster, the rules' keys live in different slots: each is
/// decided atomically on its own node, and a denial by one still spends no
/// other's quota.
#[cfg(feature = "cluster")]
#[tokio::test]
async fn on_a_cluster_a_denial_spends_no_other_rules_quota() {
    let cluster = support::RedisCluster::start();
    let store = RedisStore::connect_cluster(&cluster.urls()).await.unwrap();
    let text = "[[rules]]\nname = \"global\"\nkey = \"global\"\npolicy = \"5/h\"\n\
                [[rules]]\nname = \"per-ip\"\nkey = \"ip\"\npolicy = \"1/h\"\nalgorithm = \"gcra\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap()).without_deny_cache();
    let app = app(RulesLayer::new(rules.clone()));
    assert_eq!(status(&app, request("/", "10.0.0.1")).await, StatusCode::OK);
    for _ in 0..5 {
        assert_eq!(
            status(&app, request("/", "10.0.0.1")).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(remaining(&rules, "global", None, "global").await, 4);
    for peer in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"] {
        assert_eq!(
            status(&app, request("/", peer)).await,
            StatusCode::OK,
            "{peer}"
        );
    }
    assert_eq!(
        status(&app, request("/", "10.0.0.6")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A concurrency refund frees the refunded request's own slot, not the
/// oldest one.
#[tokio::test]
async fn a_concurrency_refund_frees_the_requests_own_slot() {
    let server = RedisServer::start();
    let redis = RedisStore::connect(&server.url()).await.unwrap();
    let memory = MemoryStore::new();
    let policy = Policy::concurrency(3).unwrap();
    async fn scenario<S: Store>(store: &S, policy: &Policy, what: &str) {
        let older = store.check("k", policy).await.unwrap().lease().unwrap();
        let newer = store.check("k", policy).await.unwrap().refund_id().unwrap();
        store
            .command(
                "k",
                policy,
                Command::Refund {
                    id: newer,
                    units: 1,
                },
            )
            .await
            .unwrap();
        store.release("k", policy, older).await.unwrap();
        // Both slots are free: a check would leave 2 of 3.
        assert_eq!(
            store
                .command("k", policy, Command::Peek)
                .await
                .unwrap()
                .remaining(),
            2,
            "{what}"
        );
    }
    scenario(&memory, &policy, "memory").await;
    scenario(&redis, &policy, "redis").await;
}

/// A rule counting by outcome keeps no denial in process: once another
/// process's refund gives a unit back, the next request is admitted (a
/// cached denial would refuse it until the window ends).
#[tokio::test]
async fn a_rule_counting_by_outcome_is_not_answered_by_the_deny_cache() {
    let server = RedisServer::start();
    let text = "[[rules]]\nname = \"login\"\nkey = \"ip\"\npolicy = \"1/h\"\nalgorithm = \"fixed-window\"\ncount = [\"4xx\"]\n";
    let process = || async {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        Rules::new(store, RuleSet::from_toml(text).unwrap())
    };
    let (a, b) = (process().await, process().await);
    let check = |rules: &Rules| {
        rules
            .current()
            .check(&Method::POST, "/login", None, |_| {
                Ok::<_, std::convert::Infallible>(Some(Call::new("10.0.0.1")))
            })
            .unwrap()
    };
    clear_of_the_hour().await;
    let first = check(&a).await.unwrap();
    assert!(first.allowed());
    assert!(
        !check(&b).await.unwrap().allowed(),
        "the unit is taken until the outcome"
    );
    drop(first.settle(Some(200)));
    wait_for_remaining(&a, "login", "10.0.0.1", 1, "refunded").await;
    assert!(
        check(&b).await.unwrap().allowed(),
        "a cached denial refused it"
    );
}

/// A rule set reading the tier from a header, served by a layer that
/// trusts no proxy, never reads the header (a client would pick its own
/// plan): the layer says so, once, naming the fix; not when a proxy is
/// trusted.
#[tokio::test]
async fn a_tier_header_no_proxy_can_set_is_warned_about() {
    let logs = crate::support::logs::Logs::capture(tracing::Level::WARN);
    let set = RuleSet::from_toml(
        "tier = \"header:x-plan\"\n[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"10/min\"\ntiers = { pro = \"100/min\" }\n",
    )
    .unwrap();
    let rules = Rules::new(MemoryStore::new(), set);
    let _app: Router = Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/other", get(|| async { "other" }))
        .layer(RulesLayer::new(rules.clone()));
    let warned = logs.text();
    assert_eq!(warned.matches("trusts no proxy").count(), 1, "{warned}");
    assert!(
        warned.contains("x-plan") && warned.contains("with_client_ip"),
        "{warned}"
    );

    let logs = crate::support::logs::Logs::capture(tracing::Level::WARN);
    let trusting = key::client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let _app: Router = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RulesLayer::new(rules).with_client_ip(trusting));
    assert!(!logs.text().contains("trusts no proxy"), "{}", logs.text());
}
