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
