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

/// The address the routers of these tests say they are bound to, which
/// the requests name as their `Host` (served without a listener).
const ADDR: &str = "127.0.0.1:9000";

fn addr() -> std::net::SocketAddr {
    ADDR.parse().unwrap()
}

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
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", ADDR);
    if changes {
        request = request.header("content-type", "application/json");
    }
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let (status, headers, body) =
        answer(router, request.body(Body::from(body.to_owned())).unwrap()).await;
    let content_type = headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, content_type, body)
}

/// `request`'s answer from `router`: its status, headers and body (JSON
/// when it parses, else a string). Every answer is not to be stored and
/// allows no other origin.
async fn answer(router: &Router, request: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    assert_eq!(headers["cache-control"], "no-store");
    assert!(
        !headers.contains_key("access-control-allow-origin") && !headers.contains_key("set-cookie"),
        "no CORS, no cookies: {headers:?}"
    );
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

async fn redis_rules(server: &RedisServer) -> Rules {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    Rules::new(store, RuleSet::from_toml(RULES).unwrap()).without_deny_cache()
}

fn admin(rules: &Rules) -> Router {
    Admin::new(TOKEN, addr())
        .unwrap()
        .with_rules(rules)
        .into_router()
}

async fn remaining(router: &Router, path: &str) -> u64 {
    let (status, _, body) = send(router, Method::GET, path, Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["state"]["remaining"].as_u64().unwrap()
}

#[test]
fn a_short_or_weak_token_is_refused_at_construction() {
    let error = Admin::new("only-15-bytes!!", addr()).unwrap_err();
    assert!(matches!(error, AdminError::TokenTooShort { len: 15 }));
    assert!(error.to_string().contains("at least 16"), "{error}");
    for weak in [
        "aaaaaaaaaaaaaaaa",
        "passwordpassword",
        "admin-admin-admin-admin",
    ] {
        let error = Admin::new(weak, addr()).unwrap_err();
        assert!(
            matches!(error, AdminError::TokenRepetitive),
            "{weak}: {error:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains("openssl rand -hex 32") && !message.contains(weak),
            "{message}"
        );
    }
    // What `openssl rand -hex 8` prints: 64 random bits.
    for random in ["9f2c4e81a07b3d56", "e4a1977c05d2b8f3", "3850261947302815"] {
        assert!(Admin::new(random, addr()).is_ok(), "{random}");
    }
    // The port asked of `bind`, not the one bound.
    let error = Admin::new(TOKEN, "127.0.0.1:0".parse().unwrap()).unwrap_err();
    assert!(matches!(error, AdminError::PortNotBound { .. }), "{error}");
    assert!(error.to_string().contains("local_addr"), "{error}");
    let error = Admin::new(TOKEN, addr())
        .unwrap()
        .with_host_name("admin internal")
        .unwrap_err();
    assert!(matches!(error, AdminError::BadHostName { .. }), "{error}");
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
            "/api/limits/api/keys/%23not-a-hash",
            "",
            StatusCode::UNPROCESSABLE_ENTITY,
            "40 lowercase hex digits",
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
    let router = Admin::new(TOKEN, addr())
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

/// A rules file holding [`RULES`] in a directory of its own under the
/// temporary one (`name`), rules watching it every `every` (while the
/// watch is held), and an admin router publishing to it.
fn file_rules(
    name: &str,
    every: Duration,
) -> (
    std::path::PathBuf,
    Rules,
    tower_redis_ratelimit::rules::Watch,
    Router,
) {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    std::fs::write(&path, RULES).unwrap();
    let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("").unwrap());
    let watch = rules.watch_file(&path, every);
    let router = Admin::new(TOKEN, addr())
        .unwrap()
        .with_rules(&rules)
        .with_watch(&watch)
        .into_router();
    (path, rules, watch, router)
}

#[tokio::test]
async fn a_rule_set_published_to_a_file_source_is_written_and_followed() {
    let (path, rules, _watch, router) = file_rules("admin-rules", Duration::from_millis(50));
    let dir = path.parent().unwrap().to_owned();
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
    let coded = Admin::new(TOKEN, addr())
        .unwrap()
        .with_rules(&rules)
        .into_router();
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
    let router = Admin::new(TOKEN, addr())
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
            .header("host", ADDR)
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
        reset(&[json, ("origin", "https://evil.example")]).await,
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
    let router = Admin::new(TOKEN, addr())
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

/// A rule set published over a rules file only its owner may read (it
/// holds allow-listed keys) is never readable by anyone else, not even
/// while its temporary copy is written: a thread watches the directory
/// through many publications.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_rules_file_is_never_readable_beyond_its_mode() {
    use std::os::unix::fs::PermissionsExt as _;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (path, _rules, _watch, router) = file_rules("admin-rules-mode", Duration::from_secs(3600));
    let dir = path.parent().unwrap().to_owned();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // About a megabyte, so that each copy takes a while to write.
    let padding = format!("# {}\n", "allow-listed key ".repeat(60)).repeat(1_000);
    let body = serde_json::json!({ "text": format!("{padding}{RULES}") }).to_string();

    let done = std::sync::Arc::new(AtomicBool::new(false));
    let watcher = std::thread::spawn({
        let (dir, done) = (dir.clone(), done.clone());
        move || {
            let (mut seen, mut exposed) = (0, Vec::new());
            while !done.load(Ordering::Relaxed) {
                for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                    if entry.file_name() == "rules.toml" {
                        continue;
                    }
                    // Gone between listing and reading: renamed in place.
                    let Ok(meta) = entry.metadata() else { continue };
                    seen += 1;
                    let mode = meta.permissions().mode() & 0o777;
                    if mode & 0o077 != 0 {
                        exposed.push(format!("{:?} {mode:o}", entry.file_name()));
                    }
                }
            }
            (seen, exposed)
        }
    });
    for _ in 0..40 {
        let (status, _, answer) =
            send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
        if status != StatusCode::ACCEPTED {
            done.store(true, Ordering::Relaxed);
            panic!("{status}: {answer}");
        }
    }
    done.store(true, Ordering::Relaxed);
    let (seen, exposed) = watcher.join().unwrap();
    assert!(seen > 0, "the watcher saw no temporary file");
    assert!(
        exposed.is_empty(),
        "readable beyond 0600 {} times, first {:?}",
        exposed.len(),
        exposed.first()
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the file keeps its mode");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One raw HTTP/1.1 exchange with `addr`: `head` (request line and
/// headers, without the blank line), then `body`. The status and the body
/// (JSON when it parses).
async fn raw(addr: std::net::SocketAddr, head: &str, body: &str) -> (u16, Value) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .unwrap()
        .unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    if status >= 400 {
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/problem+json"),
            "{head}"
        );
    }
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())),
    )
}

/// DNS rebinding: a page of the attacker's name, which their DNS points
/// at the admin address, runs in a browser that adds the token (as the
/// console needs). Its requests name the attacker's host, in `Host` and
/// `Origin`, and say they are same-origin: the router serves only the
/// hosts of its address and refuses them, and nothing changes.
#[tokio::test]
async fn a_rebound_host_reaches_nothing() {
    let server = RedisServer::start();
    let rules = redis_rules(&server).await;
    let dir = std::env::temp_dir().join(format!("admin-rebind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.toml");
    std::fs::write(&path, RULES).unwrap();
    let watch = rules.watch_file(&path, Duration::from_secs(3600));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Admin::new(TOKEN, addr)
        .unwrap()
        .with_rules(&rules)
        .with_watch(&watch)
        .into_router();
    tokio::spawn(std::future::IntoFuture::into_future(axum::serve(
        listener, router,
    )));
    let port = addr.port();
    let attacker = format!("rebind.attacker.example:{port}");
    let headers = |host: &str, origin: &str| {
        format!(
            "Host: {host}\r\nOrigin: http://{origin}\r\nSec-Fetch-Site: same-origin\r\n\
             Content-Type: application/json\r\nAuthorization: Bearer {TOKEN}"
        )
    };
    let block = "POST /api/limits/api/keys/victim/block HTTP/1.1";
    let publish = "PUT /api/rules HTTP/1.1";
    let seconds = r#"{"seconds": 600}"#;
    let no_rules = r#"{"text": "", "confirm_empty": true}"#;

    for (request, body) in [(block, seconds), (publish, no_rules)] {
        let (status, refused) = raw(
            addr,
            &format!("{request}\r\n{}", headers(&attacker, &attacker)),
            body,
        )
        .await;
        assert_eq!(status, 403, "{request}: {refused}");
        assert_eq!(refused["host"], attacker.as_str(), "{refused}");
        let detail = refused["detail"].as_str().unwrap();
        assert!(
            detail.contains(&attacker) && detail.contains("with_host_name"),
            "{detail}"
        );
        // Not a word of the address it is bound to: the client has shown
        // no token.
        assert!(!detail.contains("127.0.0.1"), "{detail}");
        // The right Host, the attacker's Origin.
        let ours = addr.to_string();
        let (status, refused) = raw(
            addr,
            &format!("{request}\r\n{}", headers(&ours, &attacker)),
            body,
        )
        .await;
        assert_eq!(status, 403, "{request}: {refused}");
        assert_eq!(
            refused["origin"],
            format!("http://{attacker}").as_str(),
            "{refused}"
        );
        // An absolute URI of the attacker's host, whatever the Host says.
        let (path, version) = request
            .split_once(' ')
            .map(|(method, rest)| (method, rest.rsplit_once(' ').unwrap()))
            .map(|(method, (path, version))| (format!("{method} http://{attacker}{path}"), version))
            .unwrap();
        let (status, refused) = raw(
            addr,
            &format!("{path} {version}\r\n{}", headers(&ours, &ours)),
            body,
        )
        .await;
        assert_eq!(status, 403, "{request} (absolute): {refused}");
    }
    // No Host at all (HTTP/1.0).
    let (status, refused) = raw(
        addr,
        &format!(
            "POST /api/limits/api/keys/victim/block HTTP/1.0\r\n\
             Content-Type: application/json\r\nAuthorization: Bearer {TOKEN}"
        ),
        seconds,
    )
    .await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["detail"].as_str().unwrap().contains("Host"),
        "{refused}"
    );

    // Nothing changed.
    let limiter = rules.current().limiter("api", None).unwrap().clone();
    assert!(!limiter.peek("victim").await.unwrap().blocked());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), RULES);

    // The router's own hosts: its address, and localhost (a loopback bind).
    for host in [addr.to_string(), format!("localhost:{port}")] {
        let (status, blocked) = raw(
            addr,
            &format!("{block}\r\n{}", headers(&host, &host)),
            seconds,
        )
        .await;
        assert_eq!(status, 200, "{host}: {blocked}");
    }
    assert!(limiter.peek("victim").await.unwrap().blocked());

    // A name the operator lists is served too.
    let named = Admin::new(TOKEN, addr)
        .unwrap()
        .with_host_name("admin.internal")
        .unwrap()
        .with_rules(&rules)
        .into_router();
    let peek = |host: &'static str| {
        Request::get("/api/limits/api/keys/victim")
            .header("host", host)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        answer(&named, peek("admin.internal")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        answer(&named, peek("admin.internal:8443")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        answer(&named, peek("admin.internal.attacker.example"))
            .await
            .0,
        StatusCode::FORBIDDEN
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A port-mapped deployment (`docker -p 19000:9000`, a Kubernetes
/// Service's port): the browser names the IP address with the mapped port,
/// in `Host` and in the console's `Origin`, and is served; a name listed
/// with HTTPS's port is served as browsers send it, without a port (`Host`)
/// or with `https://` (`Origin`).
#[tokio::test]
async fn a_mapped_port_and_a_default_port_are_served() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limiter = Limiter::new(MemoryStore::new(), "5/min".parse().unwrap()).with_name("api");
    let router = Admin::new(TOKEN, addr)
        .unwrap()
        .with_host_name("admin.internal:443")
        .unwrap()
        .with_limiter(limiter.clone())
        .into_router();
    tokio::spawn(std::future::IntoFuture::into_future(axum::serve(
        listener, router,
    )));
    let block = |host: &str, origin: &str| {
        format!(
            "POST /api/limits/api/keys/{host}/block HTTP/1.1\r\nHost: {host}\r\n\
             Origin: {origin}\r\nSec-Fetch-Site: same-origin\r\n\
             Content-Type: application/json\r\nAuthorization: Bearer {TOKEN}"
        )
    };
    let seconds = r#"{"seconds": 600}"#;
    let mapped_port = addr.port().wrapping_add(10_000).max(1);
    let mapped = format!("127.0.0.1:{mapped_port}");
    for (host, origin) in [
        (mapped.as_str(), format!("http://{mapped}")),
        ("admin.internal", "https://admin.internal".to_owned()),
        ("admin.internal:443", "https://admin.internal".to_owned()),
    ] {
        let (status, answer) = raw(addr, &block(host, &origin), seconds).await;
        assert_eq!(status, 200, "{host} from {origin}: {answer}");
        assert!(limiter.peek(host).await.unwrap().blocked(), "{host}");
    }
    for (host, origin) in [
        // A name with a mapped port: only listed names are served.
        (
            format!("localhost:{mapped_port}"),
            format!("http://localhost:{mapped_port}"),
        ),
        // The listed name over plain HTTP: port 80.
        (
            "admin.internal".to_owned(),
            "http://admin.internal".to_owned(),
        ),
        (
            "admin.internal:80".to_owned(),
            "https://admin.internal".to_owned(),
        ),
    ] {
        let (status, answer) = raw(addr, &block(&host, &origin), seconds).await;
        assert_eq!(status, 403, "{host} from {origin}: {answer}");
    }
}

/// A rules file of another owner and group (`0640 root:ops`) published
/// through the router keeps them: the process's own group never gets to
/// read it. Giving a file away takes root; elsewhere only the part of the
/// rule a process can test runs (the group's bits are dropped when the
/// group cannot be given: `rules_file`'s unit test).
#[cfg(unix)]
#[tokio::test]
async fn a_published_rules_file_keeps_its_owner_and_group() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    let (path, _rules, _watch, router) = file_rules("admin-rules-owner", Duration::from_secs(3600));
    let dir = path.parent().unwrap().to_owned();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    // Another owner and group than the process's (as root); the process's
    // otherwise.
    let (uid, gid) = (54_321, 54_322);
    let root = std::os::unix::fs::chown(&path, Some(uid), Some(gid)).is_ok();
    let before = std::fs::metadata(&path).unwrap();
    let body = serde_json::json!({ "text": format!("# published\n{RULES}") }).to_string();
    let (status, _, answer) = send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    let after = std::fs::metadata(&path).unwrap();
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .starts_with("# published")
    );
    assert_ne!(after.ino(), before.ino(), "replaced, not written in place");
    assert_eq!(after.permissions().mode() & 0o777, 0o640);
    assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()));
    if root {
        assert_eq!((after.uid(), after.gid()), (uid, gid));
    } else {
        eprintln!("not root: the file's owner and group are the process's");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every error is `application/problem+json`: those of the routes, and
/// those axum gives (an unknown method, a body over the limit).
#[tokio::test]
async fn every_error_is_a_problem() {
    let server = RedisServer::start();
    let rules = redis_rules(&server).await;
    let router = admin(&rules);
    let request = |method: Method, path: &str, headers: &[(&str, &str)], body: Vec<u8>| {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", ADDR);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(Body::from(body)).unwrap()
    };
    let bearer = format!("Bearer {TOKEN}");
    let token = ("authorization", bearer.as_str());
    let json = ("content-type", "application/json");
    let too_large = {
        let text = "#".repeat(2 << 20);
        serde_json::json!({ "text": text }).to_string().into_bytes()
    };
    let cases = [
        (
            request(Method::GET, "/no-such-route", &[token], vec![]),
            StatusCode::NOT_FOUND,
            "no such admin route",
        ),
        (
            request(Method::DELETE, "/api/rules", &[token, json], vec![]),
            StatusCode::METHOD_NOT_ALLOWED,
            "does not answer DELETE",
        ),
        (
            request(
                Method::GET,
                "/api/limits/api/keys/k/reset",
                &[token],
                vec![],
            ),
            StatusCode::METHOD_NOT_ALLOWED,
            "does not answer GET",
        ),
        (
            request(Method::PUT, "/api/rules", &[token, json], too_large),
            StatusCode::PAYLOAD_TOO_LARGE,
            "larger than 2097152 bytes",
        ),
        (
            request(Method::PUT, "/api/rules", &[token, json], b"{text".to_vec()),
            StatusCode::BAD_REQUEST,
            "not the JSON",
        ),
        (
            request(
                Method::PUT,
                "/api/rules",
                &[token, ("content-type", "text/plain")],
                b"{}".to_vec(),
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Type: application/json",
        ),
        (
            request(Method::GET, "/api/rules", &[], vec![]),
            StatusCode::UNAUTHORIZED,
            "Authorization",
        ),
        (
            request(
                Method::GET,
                "/api/rules",
                &[token, ("origin", "https://evil.example")],
                vec![],
            ),
            StatusCode::FORBIDDEN,
            "evil.example",
        ),
        (
            request(Method::GET, "/api/limits/nope/top", &[token], vec![]),
            StatusCode::NOT_FOUND,
            "nope",
        ),
    ];
    for (request, expected, says) in cases {
        let what = format!("{} {}", request.method(), request.uri());
        let (status, headers, body) = answer(&router, request).await;
        assert_eq!(status, expected, "{what}: {body}");
        assert_eq!(
            headers["content-type"], "application/problem+json",
            "{what}"
        );
        assert_eq!(body["status"], expected.as_u16(), "{what}: {body}");
        let detail = body["detail"].as_str().unwrap();
        assert!(
            detail.contains(says),
            "{what}: {detail:?} should say {says:?}"
        );
        if status == StatusCode::METHOD_NOT_ALLOWED {
            let allow = headers["allow"].to_str().unwrap();
            assert!(
                allow.contains("POST") || allow.contains("PUT"),
                "{what}: {allow}"
            );
        }
    }
}

/// A rule set of no rules lifts every limit at once: it is published only
/// when the request says so.
#[tokio::test]
async fn an_empty_rule_set_is_published_only_when_confirmed() {
    let (path, _rules, _watch, router) = file_rules("admin-empty", Duration::from_secs(3600));
    let dir = path.parent().unwrap().to_owned();
    for body in [
        r#"{"text": ""}"#,
        r##"{"text": "# no rules yet\n"}"##,
        r#"{"text": "rules = []"}"#,
        r#"{"text": "", "confirm_empty": false}"#,
    ] {
        let (status, _, refused) =
            send(&router, Method::PUT, "/api/rules", Some(TOKEN), body).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {refused}"
        );
        assert_eq!(refused["field"], "confirm_empty", "{refused}");
        assert!(
            refused["detail"]
                .as_str()
                .unwrap()
                .contains(r#""confirm_empty": true"#),
            "{refused}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), RULES, "{body}");
    }
    let (status, _, refused) = send(
        &router,
        Method::PUT,
        "/api/rules",
        Some(TOKEN),
        r#"{"text": "", "confirm_empty": "yes"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    // Confirmed, but naming no rules: the watch would never apply it.
    for text in ["# every limit lifted\n", "version = 3\n"] {
        let body = serde_json::json!({ "text": text, "confirm_empty": true }).to_string();
        let (status, _, refused) =
            send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{text:?}: {refused}"
        );
        assert_eq!(refused["field"], "text", "{refused}");
        let detail = refused["detail"].as_str().unwrap();
        assert!(detail.contains("add `rules = []`"), "{detail}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), RULES, "{text:?}");
    }
    // A confirmed empty text is written out as no rules: the watch never
    // applies an empty file (a truncating save caught half way).
    let (status, _, published) = send(
        &router,
        Method::PUT,
        "/api/rules",
        Some(TOKEN),
        r#"{"text": "", "confirm_empty": true}"#,
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{published}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "rules = []");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A confirmed empty publish the router accepts takes effect: the limits
/// are lifted, the text's version kept.
#[tokio::test]
async fn a_confirmed_empty_rule_set_is_put_in_force() {
    let (path, rules, _watch, router) =
        file_rules("admin-empty-applied", Duration::from_millis(50));
    let dir = path.parent().unwrap().to_owned();
    until("the file's rules in force", || {
        rules.current().set().rules().len() == 1
    })
    .await;
    let (status, _, published) = send(
        &router,
        Method::PUT,
        "/api/rules",
        Some(TOKEN),
        r#"{"text": "version = 3\nrules = []\n", "confirm_empty": true}"#,
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{published}");
    until("every limit lifted", || {
        rules.current().set().rules().is_empty()
    })
    .await;
    assert_eq!(rules.current().set().version(), Some(3));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Wait until `done`, at most 5 s (a watch reads its file every 50 ms).
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "not yet: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A flooder whose key is 200 KB long: the top keys show it by its hash
/// (`#` and 40 hex digits), and that form steers it: peek, block (its next
/// request is denied as blocked), reset (admitted again). The info log of a
/// key command shows the key hashed, never the key; `/top` stays small.
#[tokio::test]
async fn a_long_key_is_shown_and_steered_by_its_hash() {
    let logs = crate::support::logs::Logs::capture(tracing::Level::INFO);

    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = Limiter::new(store, "1/h".parse().unwrap()).with_name("flood");
    let router = Admin::new(TOKEN, addr())
        .unwrap()
        .with_limiter(limiter.clone())
        .into_router();
    let flooder = format!("sk-{}", "x".repeat(200_000));
    assert!(limiter.check(&flooder).await.unwrap().allowed());
    for _ in 0..5 {
        assert!(!limiter.check(&flooder).await.unwrap().allowed());
    }
    let (status, _, top) = send(
        &router,
        Method::GET,
        "/api/limits/flood/top",
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{top}");
    assert!(
        top.to_string().len() < 1_000,
        "{} bytes",
        top.to_string().len()
    );
    let shown = top["keys"][0]["key"].as_str().unwrap().to_owned();
    assert_eq!(shown.len(), 41, "{shown}");
    assert!(shown.starts_with('#'));
    let path = |command: &str| format!("/api/limits/flood/keys/%23{}{command}", &shown[1..]);

    let (status, _, peek) = send(&router, Method::GET, &path(""), Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK, "{peek}");
    assert_eq!(peek["state"]["allowed"], false, "{peek}");
    assert_eq!(peek["key"], shown.as_str(), "{peek}");
    // Steered by the key itself (as long as a URI can be), the answer
    // holds the key as held: its hash, not the 60 KB of the path.
    let sent = format!("sk-{}", "y".repeat(60_000));
    let (status, _, peek) = send(
        &router,
        Method::GET,
        &format!("/api/limits/flood/keys/{sent}"),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{peek}");
    let held = peek["key"].as_str().unwrap();
    assert!(held.len() == 41 && held.starts_with('#'), "{held}");
    assert!(
        peek.to_string().len() < 1_000,
        "{} bytes",
        peek.to_string().len()
    );
    let (status, _, _) = send(&router, Method::POST, &path("/reset"), Some(TOKEN), "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        limiter.check(&flooder).await.unwrap().allowed(),
        "reset by its hash"
    );
    let (status, _, _) = send(
        &router,
        Method::POST,
        &path("/block"),
        Some(TOKEN),
        r#"{"seconds": 600}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let verdict = limiter.check(&flooder).await.unwrap();
    assert!(
        !verdict.allowed() && verdict.decision().unwrap().blocked(),
        "blocked by its hash"
    );

    let logs = logs.text();
    assert!(logs.contains("admin: key command"), "{logs}");
    assert!(
        !logs.contains("xxxxxxxxxx") && !logs.contains(&shown[1..]),
        "{logs}"
    );
}

/// A text that expands past the bound (YAML aliases) is refused as any
/// that does not validate, naming the bound; the file is unchanged.
#[cfg(feature = "envoy")]
#[tokio::test]
async fn a_rule_set_that_expands_past_the_bound_is_refused() {
    let dir = std::env::temp_dir().join(format!("admin-expanding-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rules.yaml");
    let yaml = "domain: edge\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    std::fs::write(&path, yaml).unwrap();
    let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("").unwrap());
    let watch = rules.watch_file(&path, Duration::from_secs(3600));
    let router = Admin::new(TOKEN, addr())
        .unwrap()
        .with_rules(&rules)
        .with_watch(&watch)
        .into_router();
    // An anchor of 1,000 descriptors aliased 1,000 times.
    let mut text = String::from("domain: edge\ndescriptors:\n  - key: a\n    descriptors: &d\n");
    for i in 0..1000 {
        text += &format!("      - {{key: k, value: v{i}}}\n");
    }
    for i in 0..1000 {
        text += &format!("  - {{key: b{i}, descriptors: *d}}\n");
    }
    let body = serde_json::json!({ "text": text }).to_string();
    let (status, _, refused) = send(&router, Method::PUT, "/api/rules", Some(TOKEN), &body).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
    let detail = refused["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!(
            "{} values",
            tower_redis_ratelimit::rules::MAX_VALUES
        )),
        "{detail}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), yaml);
    std::fs::remove_dir_all(&dir).unwrap();
}
