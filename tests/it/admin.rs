//! The admin router (feature `admin`) over a real Redis: every route behind
//! the token, bad input refused with nothing changed, key commands seen by
//! every process sharing the store, rule sets published to Redis and to a
//! file.

use axum::Router;
use axum::body::Body;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt as _;
use serde_json::Value;
use std::time::Duration;
use tower::ServiceExt as _;
use tower_redis_ratelimit::admin::{Admin, AdminError};
use tower_redis_ratelimit::rules::{RuleSet, Rules};

use tower_redis_ratelimit::{Limiter, MemoryStore, RedisStore};

use crate::support::RedisServer;

const TOKEN: &str = "an-admin-token-of-32-bytes-long!";

const RULES: &str = r#"
[[rules]]
name = "api"
key = "ip"
policy = "5/min"
algorithm = "fixed-window"
tiers = { pro = "50/min" }
"#;

/// One request to `router`: its status, content type and body (JSON when
/// it parses, else a string).
async fn send(
    router: &Router,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (StatusCode, String, Value) {
    let changes = method != Method::GET;
    let mut request = Request::builder().method(method).uri(path);
    if changes {
        request = request.header("content-type", "application/json");
    }
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    assert_eq!(response.headers()["cache-control"], "no-store");
    assert!(
        !response
            .headers()
            .contains_key("access-control-allow-origin")
            && !response.headers().contains_key("set-cookie"),
        "no CORS, no cookies: {:?}",
        response.headers()
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, content_type, body)
}

async fn redis_rules(server: &RedisServer) -> Rules {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    Rules::new(store, RuleSet::from_toml(RULES).unwrap()).without_deny_cache()
}

fn admin(rules: &Rules) -> Router {
    Admin::new(TOKEN).unwrap().with_rules(rules).into_router()
}

async fn remaining(router: &Router, path: &str) -> u64 {
    let (status, _, body) = send(router, Method::GET, path, Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["state"]["remaining"].as_u64().unwrap()
}

#[test]
fn a_short_token_is_refused_at_construction() {
    let error = Admin::new("only-15-bytes!!").unwrap_err();
    assert!(matches!(error, AdminError::TokenTooShort { len: 15 }));
    assert!(error.to_string().contains("at least 16"), "{error}");
}

#[tokio::test]
async fn every_route_needs_the_token() {
    let server = RedisServer::start();
    let rules = redis_rules(&server).await;
    let router = admin(&rules);
    let routes = [
        (Method::GET, "/api/rules", ""),
        (Method::PUT, "/api/rules", r#"{"text": ""}"#),
        (Method::GET, "/api/limits/api/keys/k", ""),
        (Method::POST, "/api/limits/api/keys/k/reset", ""),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            r#"{"seconds": 60}"#,
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/penalty",
            r#"{"units": 5}"#,
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/reward",
            r#"{"units": 1}"#,
        ),
        (Method::GET, "/api/limits/api/top", ""),
        (Method::GET, "/metrics", ""),
        (Method::GET, "/", ""),
        (Method::GET, "/console.js", ""),
        (Method::GET, "/no-such-route", ""),
        (Method::DELETE, "/api/rules", ""),
    ];
    for (method, path, body) in &routes {
        for token in [None, Some("a-wrong-token-of-32-bytes-long!!"), Some("x")] {
            let (status, content_type, answer) =
                send(&router, method.clone(), path, token, body).await;
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} {token:?}"
            );
            assert_eq!(content_type, "application/problem+json");
            assert!(
                !answer.to_string().contains(TOKEN),
                "the token never appears in an answer"
            );
        }
    }
    // Nothing was done without the token: the key is untouched (a peek
    // tells what one more request would leave).
    assert_eq!(remaining(&router, "/api/limits/api/keys/k").await, 4);
    for (method, path, body) in &routes {
        let (status, _, answer) = send(&router, method.clone(), path, Some(TOKEN), body).await;
        assert_ne!(
            status,
            StatusCode::UNAUTHORIZED,
            "{method} {path}: {answer}"
        );
    }
}

#[tokio::test]
async fn bad_input_is_a_clear_4xx_and_changes_nothing() {
    let server = RedisServer::start();
    let rules = redis_rules(&server).await;
    let router = admin(&rules);
    let limiter = rules.current().limiter("api", None).unwrap().clone();
    for _ in 0..2 {
        assert!(limiter.check("k").await.unwrap().allowed());
    }
    let key = "/api/limits/api/keys/k";
    assert_eq!(remaining(&router, key).await, 2);
    let long = format!("/api/limits/api/keys/{}", "x".repeat(129));
    let cases: &[(Method, &str, &str, StatusCode, &str)] = &[
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            "{seconds: 5",
            StatusCode::BAD_REQUEST,
            "not the JSON",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            "",
            StatusCode::BAD_REQUEST,
            "not the JSON",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            r#"{"seconds": -5}"#,
            StatusCode::BAD_REQUEST,
            "-5",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            r#"{"seconds": 1e30}"#,
            StatusCode::BAD_REQUEST,
            "not the JSON",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            r#"{"seconds": 999999999999}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "longer than the longest, 86400 s",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/block",
            r#"{"minutes": 5}"#,
            StatusCode::BAD_REQUEST,
            "minutes",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/penalty",
            r#"{"units": 0}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "units",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/reward",
            r#"{"units": 18446744073709551615}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "units",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/explode",
            "",
            StatusCode::NOT_FOUND,
            "no command",
        ),
        (
            Method::GET,
            "/api/limits/nope/keys/k",
            "",
            StatusCode::NOT_FOUND,
            "no rule or limiter named \"nope\"",
        ),
        (
            Method::POST,
            "/api/limits/nope/keys/k/reset",
            "",
            StatusCode::NOT_FOUND,
            "\"nope\"",
        ),
        (
            Method::GET,
            "/api/limits/api/keys/k?tier=gold",
            "",
            StatusCode::NOT_FOUND,
            "no tier \"gold\"",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/k/reset?tier=gold",
            "",
            StatusCode::NOT_FOUND,
            "no tier",
        ),
        (
            Method::GET,
            &long,
            "",
            StatusCode::UNPROCESSABLE_ENTITY,
            "at most 128",
        ),
        (
            Method::POST,
            "/api/limits/api/keys/%FF%FE/reset",
            "",
            StatusCode::BAD_REQUEST,
            "UTF-8",
        ),
        (
            Method::PUT,
            "/api/rules",
            "rules!",
            StatusCode::BAD_REQUEST,
            "not the JSON",
        ),
        (
            Method::PUT,
            "/api/rules",
            r#"{"text": "[[rules]]\nname = \"x\"\nkey = \"ip\"\npolicy = \"0/s\"\n"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            "rule set rejected",
        ),
    ];
    for (method, path, body, expected, says) in cases {
        let (status, content_type, answer) =
            send(&router, method.clone(), path, Some(TOKEN), body).await;
        assert_eq!(status, *expected, "{method} {path} {body}: {answer}");
        assert_eq!(content_type, "application/problem+json", "{path}");
        let detail = answer["detail"].as_str().unwrap();
        assert!(
            detail.contains(says),
            "{path} {body}: {detail:?} should say {says:?}"
        );
        assert_eq!(answer["status"], expected.as_u16());
    }
    // Nothing changed: the key's count, its block, the rules.
    assert_eq!(remaining(&router, key).await, 2);
    let (_, _, peeked) = send(&router, Method::GET, key, Some(TOKEN), "").await;
    assert_eq!(peeked["state"]["blocked"], false);
    assert_eq!(rules.current().set().rules().len(), 1);
    // A refused rule set names the rule and the field.
    let (_, _, answer) = send(
        &router,
        Method::PUT,
        "/api/rules",
        Some(TOKEN),
        r#"{"text": "[[rules]]\nname = \"x\"\nkey = \"ip\"\npolicy = \"0/s\"\n"}"#,
    )
    .await;
    assert!(
        answer["rule"].as_str().unwrap().contains("\"x\""),
        "{answer}"
    );
    assert_eq!(answer["field"], "policy", "{answer}");
}

/// Two processes' rules over one Redis: a command through the admin router
/// of one is seen by the other's checks.
#[tokio::test]
async fn key_commands_reach_every_process_sharing_the_store() {
    let server = RedisServer::start();
    let one = redis_rules(&server).await;
    let other = redis_rules(&server).await;
    let router = admin(&one);
    let there = other.current().limiter("api", None).unwrap().clone();
    let post = |command: &'static str, body: &'static str| {
        let router = router.clone();
        async move {
            let path = format!("/api/limits/api/keys/203.0.113.9/{command}");
            let (status, _, answer) = send(&router, Method::POST, &path, Some(TOKEN), body).await;
            assert_eq!(status, StatusCode::OK, "{command}: {answer}");
            answer
        }
    };

    let blocked = post("block", r#"{"seconds": 60}"#).await;
    assert_eq!(blocked["state"]["blocked"], true, "{blocked}");
    let denied = there.check("203.0.113.9").await.unwrap();
    assert!(!denied.allowed(), "blocked in the other process");
    assert!(denied.retry_after() > Duration::from_secs(55));

    post("reset", "").await;
    assert!(there.check("203.0.113.9").await.unwrap().allowed());

    // 1 used; a penalty of 3 leaves 1, a reward of 2 gives back 2.
    let after = post("penalty", r#"{"units": 3}"#).await;
    assert_eq!(after["state"]["remaining"], 0, "{after}");
    assert_eq!(
        there
            .check("203.0.113.9")
            .await
            .unwrap()
            .decision()
            .unwrap()
            .remaining(),
        0
    );
    let after = post("reward", r#"{"units": 2}"#).await;
    assert_eq!(after["state"]["remaining"], 1, "{after}");

    // A tier shares the rule's count: pro's 50 on the 3 used.
    let pro = remaining(&router, "/api/limits/api/keys/203.0.113.9?tier=pro").await;
    assert_eq!(pro, 46);
}

#[tokio::test]
async fn a_rule_set_published_through_the_router_reaches_every_follower() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    tower_redis_ratelimit::rules::publish(&mut connection, "rl:rules", RULES)
        .await
        .unwrap();
    let start = |client: redis::Client| {
        let url = server.url();
        async move {
            let store = RedisStore::connect(&url).await.unwrap();
            let rules = Rules::new(store, RuleSet::from_toml("").unwrap());
            let watch = rules
                .follow_redis(client, "rl:rules", Duration::from_secs(30))
                .await
                .unwrap();
            (rules, watch)
        }
    };
    let (one, one_watch) = start(client.clone()).await;
    let (other, _other_watch) = start(client.clone()).await;
    let router = Admin::new(TOKEN)
        .unwrap()
        .with_rules(&one)
        .with_watch(&one_watch)
        .into_router();

    let (status, _, shown) = send(&router, Method::GET, "/api/rules", Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(shown["source"], "redis rl:rules", "{shown}");
    assert_eq!(shown["watch"]["version"], 1);
    assert_eq!(shown["watch"]["text"], RULES);
    assert!(shown["watch"]["loaded_at_ms"].as_u64().unwrap() > 1_700_000_000_000);
    assert_eq!(shown["rules"]["rules"][0]["name"], "api");
    assert_eq!(shown["rules"]["rules"][0]["policy"], "5/min");
    assert_eq!(shown["rules"]["rules"][0]["tiers"]["pro"], "50/min");

    let text = RULES.replace("5/min", "7/min");
    let body = serde_json::json!({ "text": text }).to_string();
    let (status, _, published) = send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
    assert_eq!(status, StatusCode::OK, "{published}");
    assert_eq!(published["version"], 2);
    // Both processes follow it (pub/sub: within a round trip; allow 5 s).
    for rules in [&one, &other] {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while rules.current().set().rules()[0].policy(None).to_string() != "7/min" {
            assert!(
                std::time::Instant::now() < deadline,
                "the new set did not arrive"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // A set written to Redis by hand that does not validate is rejected
    // by the watch, shown with its error; the rules in force stay.
    let bad = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"many\"\n";
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg("rl:rules")
        .arg("rules")
        .arg(bad)
        .ignore()
        .cmd("HINCRBY")
        .arg("rl:rules")
        .arg("version")
        .arg(1)
        .ignore()
        .cmd("PUBLISH")
        .arg("rl:rules")
        .arg(3)
        .ignore()
        .query_async(&mut connection)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let shown = loop {
        let (_, _, shown) = send(&router, Method::GET, "/api/rules", Some(TOKEN), "").await;
        if !shown["watch"]["rejected"].is_null() {
            break shown;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the bad set was not seen: {shown}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(shown["watch"]["rejected"]["text"], bad);
    assert!(
        shown["watch"]["error"].as_str().unwrap().contains("policy"),
        "{shown}"
    );
    assert_eq!(
        shown["rules"]["rules"][0]["policy"], "7/min",
        "the good set stays"
    );
    assert_eq!(shown["watch"]["version"], 2);
}

#[tokio::test]
async fn a_rule_set_published_to_a_file_source_is_written_and_followed() {
    let dir = std::env::temp_dir().join(format!("admin-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    std::fs::write(&path, RULES).unwrap();
    let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("").unwrap());
    let watch = rules.watch_file(&path, Duration::from_millis(50));
    let router = Admin::new(TOKEN)
        .unwrap()
        .with_rules(&rules)
        .with_watch(&watch)
        .into_router();
    let text = RULES.replace("5/min", "9/min");
    let body = serde_json::json!({ "text": text }).to_string();
    let (status, _, answer) = send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, _, shown) = send(&router, Method::GET, "/api/rules", Some(TOKEN), "").await;
        if shown["rules"]["rules"][0]["policy"] == "9/min" {
            assert_eq!(shown["watch"]["text"], text.as_str());
            assert!(
                shown["source"].as_str().unwrap().starts_with("file "),
                "{shown}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not followed: {shown}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Rules from code accept none.
    let coded = Admin::new(TOKEN).unwrap().with_rules(&rules).into_router();
    let (status, _, answer) = send(&coded, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A named limiter (no rules) is operated under its name; it has no tiers.
#[tokio::test]
async fn a_limiter_is_operated_under_its_name() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = Limiter::new(store, "2/min".parse().unwrap()).with_name("login");
    let router = Admin::new(TOKEN)
        .unwrap()
        .with_limiter(limiter.clone())
        .into_router();
    assert!(limiter.check("u").await.unwrap().allowed());
    assert_eq!(remaining(&router, "/api/limits/login/keys/u").await, 0);
    let (status, _, _) = send(
        &router,
        Method::GET,
        "/api/limits/login/keys/u?tier=pro",
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, _, shown) = send(&router, Method::GET, "/api/rules", Some(TOKEN), "").await;
    assert_eq!(shown["limiters"][0]["name"], "login", "{shown}");
    assert_eq!(shown["limiters"][0]["policy"], "2/min");
}

/// The most denied keys add up over every process sharing Redis, and the
/// flooding client comes first.
#[tokio::test]
async fn the_top_limited_keys_add_up_across_processes() {
    let server = RedisServer::start();
    let one = redis_rules(&server).await;
    let other = redis_rules(&server).await;
    // Each process operates its rules with an admin router of its own.
    let router = admin(&one);
    let _theirs = admin(&other);
    let here = one.current().limiter("api", None).unwrap().clone();
    let there = other.current().limiter("api", None).unwrap().clone();
    // 5/min: each key's 6th request on is denied.
    for _ in 0..30 {
        let _ = here.check("198.51.100.1").await.unwrap();
    }
    for _ in 0..20 {
        let _ = there.check("198.51.100.1").await.unwrap();
        let _ = there.check("198.51.100.2").await.unwrap();
    }
    // The other process shares at most once a second, in the background;
    // its admin router's read shares what it has not yet.
    there.most_denied().await.unwrap();

    let (status, _, top) = send(&router, Method::GET, "/api/limits/api/top", Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK, "{top}");
    let keys = top["keys"].as_array().unwrap();
    assert_eq!(keys[0]["key"], "198.51.100.1", "{top}");
    // 25 denied here, 20 there (the count is shared: its 5 were used
    // here); Space-Saving is exact below 32 keys.
    assert_eq!(keys[0]["denials"], 45, "{top}");
    assert_eq!(keys[1]["key"], "198.51.100.2", "{top}");
    assert_eq!(keys[1]["denials"], 15, "{top}");
    // Bounded in Redis: a flood of 300 distinct keys keeps one sorted set
    // per limiter and minute, of at most 128 keys, living three minutes.
    for i in 0..300 {
        let key = format!("10.1.{}.{}", i / 250, i % 250);
        for _ in 0..6 {
            let _ = here.check(&key).await.unwrap();
        }
        if i % 20 == 0 {
            here.most_denied().await.unwrap();
        }
    }
    here.most_denied().await.unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let sets: Vec<String> = redis::cmd("KEYS")
        .arg("rl:denied:*")
        .query_async(&mut redis)
        .await
        .unwrap();
    // The limiter's minute, maybe the one before (a minute may turn).
    assert!(!sets.is_empty() && sets.len() <= 2, "{sets:?}");
    let mut most = 0;
    for set in &sets {
        let held: usize = redis::cmd("ZCARD")
            .arg(set)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(held <= 128, "{set}: {held} keys");
        most = most.max(held);
        let ttl: i64 = redis::cmd("PTTL")
            .arg(set)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(0 < ttl && ttl <= 180_000, "{set}: {ttl} ms");
    }
    assert!(most >= 100, "the flood's keys were shared: {most}");
}

/// A request another site's page makes, token or not, is refused and
/// changes nothing; so is a change without a JSON content type.
#[tokio::test]
async fn requests_from_other_sites_are_refused() {
    let server = RedisServer::start();
    let rules = redis_rules(&server).await;
    let router = admin(&rules);
    let limiter = rules.current().limiter("api", None).unwrap().clone();
    limiter.block("k", Duration::from_secs(60)).await.unwrap();
    let reset = |headers: &[(&'static str, &'static str)]| {
        let mut request = Request::post("/api/limits/api/keys/k/reset")
            .header("authorization", format!("Bearer {TOKEN}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let router = router.clone();
        let request = request.body(Body::empty()).unwrap();
        async move { router.oneshot(request).await.unwrap().status() }
    };
    let json = ("content-type", "application/json");
    assert_eq!(
        reset(&[json, ("sec-fetch-site", "cross-site")]).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        reset(&[json, ("origin", "https://evil.example"), ("host", "admin")]).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        reset(&[("content-type", "text/plain")]).await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    assert_eq!(reset(&[]).await, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(limiter.peek("k").await.unwrap().blocked(), "still blocked");
    assert_eq!(
        reset(&[json, ("sec-fetch-site", "same-origin")]).await,
        StatusCode::OK
    );
    assert!(!limiter.peek("k").await.unwrap().blocked());
}

#[tokio::test]
async fn without_a_shared_store_the_top_is_this_processs_own() {
    let limiter = Limiter::new(MemoryStore::new(), "1/min".parse().unwrap()).with_name("login");
    let router = Admin::new(TOKEN)
        .unwrap()
        .with_limiter(limiter.clone())
        .into_router();
    for _ in 0..4 {
        let _ = limiter.check("alice").await.unwrap();
    }
    let (_, _, top) = send(
        &router,
        Method::GET,
        "/api/limits/login/top",
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(top["keys"][0]["key"], "alice", "{top}");
    assert_eq!(top["keys"][0]["denials"], 3, "{top}");
}
