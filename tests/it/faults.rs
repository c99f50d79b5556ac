//! Fault injection against real redis-server processes: Redis hung
//! (SIGSTOP), killed and restarted on the same port, scripts flushed, client
//! connections killed. Each fail mode does what it promises, nothing panics,
//! every request gets a response. Run with `--nocapture` for the figures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::http::{ok_router, request};
use axum::Router;
use axum::body::Body;
use http::StatusCode;
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{
    FailMode, Limiter, MemoryStore, Policy, RateLimitLayer, RedisStore, key,
};

const TIMEOUT: Duration = Duration::from_millis(100);
/// What a request may take beyond the store's timeout on a loaded machine.
const MARGIN: Duration = Duration::from_millis(400);

/// 20 requests a key for 10 s: a burst of 60 from 3 clients is over it.
fn policy() -> Policy {
    "20/10s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap()
}

async fn app(server: &RedisServer, mode: FailMode) -> Router {
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(TIMEOUT);
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, policy()).with_fail_mode(mode),
        key::peer_ip(),
    );
    ok_router(limiter)
}

/// What a burst of requests got.
#[derive(Debug, Default)]
struct Tally {
    sent: usize,
    answered: usize,
    admitted: usize,
    limited: usize,
    unavailable: usize,
    /// Admitted requests carrying rate-limit headers (decided by a store).
    with_headers: usize,
    worst: Duration,
}

impl Tally {
    /// Admitted beyond the policy: 20 per client.
    fn over_admitted(&self, clients: usize) -> usize {
        self.admitted.saturating_sub(20 * clients)
    }
}

/// `per_client` requests from each of `clients` clients, 20 at a time.
async fn burst(app: &Router, clients: u8, per_client: usize) -> Tally {
    let mut tally = Tally::default();
    let mut jobs = JoinSet::new();
    for i in 0..(usize::from(clients) * per_client) {
        let app = app.clone();
        let client = (i % usize::from(clients)) as u8 + 1;
        tally.sent += 1;
        jobs.spawn(async move {
            let started = Instant::now();
            let response = app
                .oneshot(request("/", &format!("203.0.113.{client}")))
                .await
                .unwrap();
            (response, started.elapsed())
        });
        if jobs.len() >= 20 {
            record(&mut tally, jobs.join_next().await.unwrap().unwrap());
        }
    }
    while let Some(done) = jobs.join_next().await {
        record(&mut tally, done.unwrap());
    }
    tally
}

fn record(tally: &mut Tally, (response, took): (http::Response<Body>, Duration)) {
    tally.answered += 1;
    tally.worst = tally.worst.max(took);
    match response.status() {
        StatusCode::OK => {
            tally.admitted += 1;
            tally.with_headers += usize::from(response.headers().contains_key("x-ratelimit-limit"));
        }
        StatusCode::TOO_MANY_REQUESTS => tally.limited += 1,
        StatusCode::SERVICE_UNAVAILABLE => tally.unavailable += 1,
        other => panic!("unexpected status {other}"),
    }
}

fn report(fault: &str, mode: &str, t: &Tally, clients: usize) {
    eprintln!(
        "{fault:<22} {mode:<9} sent {:>3}  answered {:>3}  admitted {:>3}  over-admitted {:>3}  429 {:>3}  503 {:>3}  worst {:>4} ms",
        t.sent,
        t.answered,
        t.admitted,
        t.over_admitted(clients),
        t.limited,
        t.unavailable,
        t.worst.as_millis()
    );
}

fn modes() -> [(&'static str, FailMode); 3] {
    [
        ("open", FailMode::Open),
        ("closed", FailMode::Closed),
        ("fallback", FailMode::fallback(MemoryStore::new(), 1)),
    ]
}

/// Redis hung: every request is answered within the timeout (plus a margin)
/// by the fail mode, and limiting resumes when Redis wakes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_hung() {
    for (name, mode) in modes() {
        let server = RedisServer::start();
        let app = app(&server, mode).await;
        server.signal("STOP");
        let t = burst(&app, 3, 40).await;
        server.signal("CONT");
        report("hung (SIGSTOP)", name, &t, 3);
        assert_eq!(t.answered, t.sent);
        assert!(t.worst <= TIMEOUT + MARGIN, "{name}: worst {:?}", t.worst);
        match name {
            "open" => assert_eq!(t.admitted, t.sent),
            "closed" => assert_eq!(t.unavailable, t.sent),
            _ => {
                // In process, the same policy: 20 per client, the rest 429.
                assert_eq!(t.admitted, 60, "{t:?}");
                assert_eq!(t.limited, 60, "{t:?}");
            }
        }
        // After the breaker's cooldown a probe reaches Redis and limiting
        // resumes: responses carry the store's headers again.
        let resumed = resumes(&app, &server).await;
        eprintln!(
            "{:<22} {name:<9} limiting resumed after {} ms",
            "",
            resumed.as_millis()
        );
    }
}

/// Send a request now and then until one is decided by Redis again (its
/// key appears in Redis: the fallback's decisions carry headers too).
async fn resumes(app: &Router, server: &RedisServer) -> Duration {
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "limiting never resumed"
        );
        let response = app
            .clone()
            .oneshot(request("/", "203.0.113.99"))
            .await
            .unwrap();
        assert_ne!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        // The layer's name is part of the key: match any name.
        if !server
            .command(&["KEYS", "rl:log:*203.0.113.99}"])
            .starts_with("*0")
        {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Redis killed, then restarted empty on the same port: requests during the
/// outage are answered at once by the fail mode (no error leaks with Open or
/// Fallback), and limiting resumes on the new server without help.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted() {
    for (name, mode) in modes() {
        let mut server = RedisServer::start();
        let app = app(&server, mode).await;
        let before = burst(&app, 1, 10).await;
        assert_eq!(before.with_headers, 10);
        server.kill();
        let down = burst(&app, 3, 40).await;
        report("killed", name, &down, 3);
        assert_eq!(down.answered, down.sent);
        // A killed Redis refuses connections: every check fails at once,
        // not after the store's timeout.
        assert!(
            down.worst < Duration::from_millis(50),
            "{name}: worst {:?} while Redis refused connections",
            down.worst
        );
        if name != "closed" {
            assert_eq!(down.unavailable, 0, "{name}: an error leaked to a client");
        }
        server.restart();
        let resumed = resumes(&app, &server).await;
        let after = burst(&app, 3, 40).await;
        report("restarted", name, &after, 3);
        eprintln!(
            "{:<22} {name:<9} limiting resumed after {} ms",
            "",
            resumed.as_millis()
        );
        assert_eq!(after.unavailable, 0, "{name}");
        // The new Redis is empty: 20 per client, decided by Redis.
        assert_eq!(after.admitted, 60, "{name}: {after:?}");
        assert_eq!(after.with_headers, 60, "{name}: {after:?}");
    }
}

/// Scripts flushed and every client connection killed: no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_and_client_kill() {
    let server = RedisServer::start();
    let app = app(&server, FailMode::Closed).await;
    let first = burst(&app, 3, 10).await;
    assert_eq!(first.with_headers, 30);
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    let flushed = burst(&app, 3, 10).await;
    report("SCRIPT FLUSH", "closed", &flushed, 3);
    assert_eq!(flushed.unavailable, 0, "{flushed:?}");
    let killed = server.command(&["CLIENT", "KILL", "TYPE", "normal"]);
    assert!(killed.starts_with(':'), "{killed}");
    let after = burst(&app, 3, 10).await;
    report("CLIENT KILL", "closed", &after, 3);
    assert_eq!(after.unavailable, 0, "{after:?}");
    assert_eq!(
        first.admitted + flushed.admitted + after.admitted,
        60,
        "20 per client in all"
    );
}

/// While Redis is down, a concurrency lease granted by the fallback goes
/// back to the fallback, not to Redis: sequential requests never pile up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_concurrency_leases_are_released() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(TIMEOUT);
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, Policy::concurrency(2).unwrap())
            .with_fail_mode(FailMode::fallback(MemoryStore::new(), 1)),
        key::peer_ip(),
    );
    let app = ok_router(limiter);
    server.signal("STOP");
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let response = app
            .clone()
            .oneshot(request("/", "203.0.113.1"))
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
        // Read the body to the end: the request is over, its slot free.
        http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap();
    }
    server.signal("CONT");
    assert_eq!(statuses, [200; 6]);
}
