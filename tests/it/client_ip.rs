//! Client addresses behind trusted proxies and allowed keys, through an axum
//! Router.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::http::{ok_router, request, request_with, status};
use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_redis_ratelimit::{Limiter, MemoryStore, Policy, RateLimitLayer, key};

/// A GET of `/` from `peer` carrying `X-Forwarded-For: forwarded_for`.
fn forwarded(peer: &str, forwarded_for: &str) -> Request<Body> {
    request_with("/", peer, &[("x-forwarded-for", forwarded_for)])
}

#[tokio::test]
async fn clients_behind_a_trusted_proxy_have_their_own_budgets() {
    let extractor = key::client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        "1/10s".parse::<Policy>().unwrap(),
        extractor,
    );
    let app = ok_router(limiter);
    let proxy = "10.0.0.2:5000";
    // Two clients through the same proxy: one request each is admitted.
    assert_eq!(
        status(&app, forwarded(proxy, "203.0.113.1")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, forwarded(proxy, "203.0.113.2")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, forwarded(proxy, "203.0.113.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A client that prepends a fake address to the header is still itself.
    assert_eq!(
        status(&app, forwarded(proxy, "198.51.100.50, 203.0.113.2")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A client connecting directly cannot pose as someone else.
    let direct = "198.51.100.9:4000";
    assert_eq!(
        status(&app, forwarded(direct, "203.0.113.77")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, forwarded(direct, "203.0.113.78")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn ipv6_clients_share_their_64() {
    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        "2/10s".parse::<Policy>().unwrap(),
        key::peer_ip(),
    );
    let app = ok_router(limiter);
    // One subscriber rotating through addresses of its /64.
    assert_eq!(
        status(&app, request("/", "[2001:db8:1:2::a]:1")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, request("/", "[2001:db8:1:2::b]:1")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, request("/", "[2001:db8:1:2:ffff::c]:1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another /64 has its own budget.
    assert_eq!(
        status(&app, request("/", "[2001:db8:1:3::a]:1")).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn allowed_keys_are_never_limited() {
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(MemoryStore::new(), "1/10s".parse::<Policy>().unwrap())
            .with_allowed_keys(["10.0.0.5"]),
        key::peer_ip(),
    );
    let app = ok_router(limiter);
    for _ in 0..5 {
        let response = app
            .clone()
            .oneshot(request("/", "10.0.0.5:1"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.headers().get("x-ratelimit-limit").is_none());
    }
    assert_eq!(
        status(&app, request("/", "10.0.0.6:1")).await,
        StatusCode::OK
    );
    assert_eq!(
        status(&app, request("/", "10.0.0.6:1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

fn one_per_10s<K: key::KeyExtractor<Body>>(extractor: K) -> Router {
    let limiter = RateLimitLayer::new(
        MemoryStore::new(),
        "1/10s".parse::<Policy>().unwrap(),
        extractor,
    );
    ok_router(limiter)
}

/// A dual-stack proxy: its listener gives IPv4 peers IPv4-mapped, and it
/// writes its own IPv4 hops IPv4-mapped. Each client keeps its own budget,
/// and a client is one client however its address is written.
#[tokio::test]
async fn clients_behind_a_dual_stack_proxy_have_their_own_budgets() {
    for trusted in ["10.0.0.0/8", "::ffff:10.0.0.0/104"] {
        let app = one_per_10s(key::client_ip().trusting([trusted]).unwrap());
        let via = |client: &str| {
            let chain = format!("{client}, ::ffff:10.0.0.5");
            request_with(
                "/",
                "[::ffff:10.0.0.2]:5000",
                &[("x-forwarded-for", &chain)],
            )
        };
        assert_eq!(
            status(&app, via("203.0.113.1")).await,
            StatusCode::OK,
            "{trusted}"
        );
        assert_eq!(
            status(&app, via("203.0.113.2")).await,
            StatusCode::OK,
            "{trusted}: the second client got the proxy's key"
        );
        // The first client again, written IPv4-mapped, through an IPv4 peer.
        let again = request_with(
            "/",
            "10.0.0.3:5000",
            &[("x-forwarded-for", "::ffff:203.0.113.1")],
        );
        assert_eq!(
            status(&app, again).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{trusted}"
        );
    }
}

/// A proxy that appends its X-Real-IP line after the one the client sent:
/// the client cannot pick its key.
#[tokio::test]
async fn a_client_s_own_x_real_ip_line_is_not_believed() {
    let app = one_per_10s(
        key::client_ip()
            .trusting(["10.0.0.2"])
            .unwrap()
            .header(key::ProxyHeader::XRealIp),
    );
    let from = |forged: &str, real: &str| {
        request_with(
            "/",
            "10.0.0.2:5000",
            &[("x-real-ip", forged), ("x-real-ip", real)],
        )
    };
    assert_eq!(
        status(&app, from("198.51.100.1", "203.0.113.1")).await,
        StatusCode::OK
    );
    // The same client, claiming another address each time: still itself.
    assert_eq!(
        status(&app, from("198.51.100.2", "203.0.113.1")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another client, claiming the first one's address: its own budget.
    assert_eq!(
        status(&app, from("203.0.113.1", "203.0.113.2")).await,
        StatusCode::OK
    );
}
