//! What the layer logs: decisions at debug with the key hashed, never raw.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::http::{ok_router, request};
use tower::ServiceExt;
use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};

#[tokio::test]
async fn decisions_are_logged_with_the_key_hashed() {
    let _alone = crate::alone().await;
    let logs = crate::support::logs::Logs::capture(tracing::Level::DEBUG);

    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        "1/10s".parse::<Policy>().unwrap(),
        key::peer_ip(),
    );
    let app = ok_router(limiter);
    for _ in 0..3 {
        app.clone()
            .oneshot(request("/", "203.0.113.77"))
            .await
            .unwrap();
    }
    let logs = logs.text();
    assert!(logs.contains("rate limit: admitted"), "{logs}");
    assert!(logs.contains("rate limit: denied"), "{logs}");
    assert!(
        !logs.contains("203.0.113.77"),
        "the raw key was logged:\n{logs}"
    );
    // The hash of the store key ("1/10s:203.0.113.77"), the same every time.
    let hash = &sha1_hex("1/10s:203.0.113.77")[..12];
    assert_eq!(logs.matches(&format!("key={hash}")).count(), 3, "{logs}");
}

fn sha1_hex(text: &str) -> String {
    // Computed here independently, with the same crate's SHA-1.
    sha1_smol::Sha1::from(text.as_bytes()).digest().to_string()
}

/// A rule settling from the body under a layer with no body meter says
/// so once, at start: its body would settle nothing, silently.
#[tokio::test]
async fn a_rule_settling_from_a_body_nobody_meters_is_warned_of_once() {
    use tower_redis_ratelimit::rules::{RuleSet, Rules, RulesLayer};
    let _alone = crate::alone().await;
    let logs = crate::support::logs::Logs::capture(tracing::Level::WARN);
    let rules = Rules::new(
        MemoryStore::new(),
        RuleSet::from_toml(
            "[[rules]]\nname = \"tokens\"\nkey = \"global\"\npolicy = \"1000/min\"\n\
             algorithm = \"gcra\"\ncost = 10\nsettle = { body = true }\n",
        )
        .unwrap(),
    );
    let layer = RulesLayer::new(rules.clone());
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..3 {
        app.clone()
            .oneshot(request("/", "203.0.113.77"))
            .await
            .unwrap();
    }
    let text = logs.text();
    assert_eq!(text.matches("no body meter").count(), 1, "{text}");
    // With a meter, nothing is said.
    let logs = crate::support::logs::Logs::capture(tracing::Level::WARN);
    let _metered = axum::Router::<()>::new()
        .route("/", axum::routing::get(|| async { "ok" }))
        .layer(RulesLayer::new(rules).with_meter(|_| Some(1)));
    assert!(!logs.text().contains("no body meter"), "{}", logs.text());
}
