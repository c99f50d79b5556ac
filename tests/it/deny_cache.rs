//! The local deny cache against a real redis-server: a flood after a denial
//! costs Redis nothing until the denial ends, and never outlives it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::http::{PEER, ok_router, request, status};
use axum::Router;
use http::StatusCode;
use tower::ServiceExt;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Limiter, Policy, RateLimitLayer, RedisStore, key};

async fn app(server: &RedisServer, policy: Policy, cache: bool) -> Router {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut limiter = Limiter::new(store, policy);
    if !cache {
        limiter = limiter.without_deny_cache();
    }
    ok_router(RateLimitLayer::from_limiter(limiter, key::peer_ip()))
}

/// Redis calls deciding a check so far: each script, sliding-log
/// transaction, read of a sliding log found full and batch reads Redis's
/// clock once (`TIME`; a sliding-log denial's clean-up does not), and a
/// window counter's check counts (`INCRBY`).
fn calls(server: &RedisServer) -> u64 {
    server.calls("time") + server.calls("incrby")
}

#[tokio::test]
async fn a_flood_after_a_denial_costs_redis_nothing_until_it_ends() {
    let server = RedisServer::start();
    let policies = [
        "2/1s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(Execution::Script)
            .unwrap(),
        "2/1s".parse::<Policy>().unwrap().fixed_window().unwrap(),
        "2/1s".parse::<Policy>().unwrap().sliding_window().unwrap(),
        "2/1s".parse::<Policy>().unwrap().gcra().unwrap(),
    ];
    for policy in policies {
        let algorithm = policy.algorithm();
        let app = app(&server, policy, true).await;
        // Windows of wall-clock time: start just after one begins, so the
        // denial lasts well past the flood (Redis runs on this machine's clock).
        crate::support::start_of_a_second().await;
        // Fill the quota, then one denial from Redis.
        let mut denied_at = None;
        for _ in 0..3 {
            let started = Instant::now();
            if status(&app, request("/", PEER)).await == StatusCode::TOO_MANY_REQUESTS {
                denied_at = Some(started);
                break;
            }
        }
        let denied_at = denied_at.expect("the third request is denied");
        let before = calls(&server);
        let mut flood = 0;
        while denied_at.elapsed() < Duration::from_millis(300) {
            assert_eq!(
                status(&app, request("/", PEER)).await,
                StatusCode::TOO_MANY_REQUESTS,
                "{algorithm}"
            );
            flood += 1;
        }
        assert!(
            flood > 50,
            "{algorithm}: only {flood} requests in the flood"
        );
        assert_eq!(
            calls(&server),
            before,
            "{algorithm}: {flood} cached denials reached Redis"
        );
        // Until the denial runs out, answers come from the cache, which
        // holds a denial at most a second: Redis sees at most one request
        // per second of it (the sliding window's denial here ends just
        // after a second: one more denial from Redis), and the first
        // request it sees after the denial ends is admitted. The cache holds
        // a denial from when its check was sent, never past the denial's
        // end, so a request in the moment between (the time a check takes to
        // reach Redis) may be denied by Redis once more, just before the end.
        let mut denied_by_redis = Vec::new();
        let admitted_after = loop {
            assert!(
                denied_at.elapsed() < Duration::from_secs(3),
                "{algorithm}: never admitted again"
            );
            let calls_before = calls(&server);
            let status = status(&app, request("/", PEER)).await;
            if calls(&server) > calls_before {
                if status == StatusCode::OK {
                    break denied_at.elapsed();
                }
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
                denied_by_redis.push(denied_at.elapsed());
            } else {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{algorithm}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let mut previous = Duration::ZERO;
        for at in &denied_by_redis {
            let held_a_second = *at - previous >= Duration::from_millis(990);
            let at_the_end = admitted_after - *at <= Duration::from_millis(200);
            assert!(
                held_a_second || at_the_end,
                "{algorithm}: Redis asked again at {denied_by_redis:?} (admitted at \
                 {admitted_after:?}), more than once a second"
            );
            previous = *at;
        }
        assert!(
            denied_by_redis.len() <= 2,
            "{algorithm}: Redis denied at {denied_by_redis:?}"
        );
        assert!(calls(&server) > before, "{algorithm}");
        eprintln!("{algorithm}: {flood} cached denials, admitted again after {admitted_after:?}");
    }
}

/// Where a denial is not final, every request still asks Redis.
#[tokio::test]
async fn denials_that_are_not_final_are_not_cached() {
    let server = RedisServer::start();
    let cases = [
        ("transaction", "2/10s".parse::<Policy>().unwrap(), true),
        (
            "cache off",
            "2/10s"
                .parse::<Policy>()
                .unwrap()
                .with_execution(Execution::Script)
                .unwrap(),
            false,
        ),
        ("concurrency", Policy::concurrency(1).unwrap(), true),
    ];
    for (name, policy, cache) in cases {
        let concurrency = policy.algorithm() == tower_redis_ratelimit::Algorithm::Concurrency;
        let app = app(&server, policy, cache).await;
        let mut held = Vec::new();
        if concurrency {
            // Hold the only slot: a response whose body is not read yet.
            held.push(app.clone().oneshot(request("/", PEER)).await.unwrap());
        } else {
            status(&app, request("/", PEER)).await;
            status(&app, request("/", PEER)).await;
        }
        assert_eq!(
            status(&app, request("/", PEER)).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{name}"
        );
        let before = calls(&server);
        for _ in 0..20 {
            assert_eq!(
                status(&app, request("/", PEER)).await,
                StatusCode::TOO_MANY_REQUESTS,
                "{name}"
            );
        }
        assert_eq!(
            calls(&server) - before,
            20,
            "{name}: every request asked Redis"
        );
        drop(held);
    }
}
