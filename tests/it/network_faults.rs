//! RedisStore under network faults: a fault-injecting TCP proxy
//! (`tests/support/proxy.rs`) between the store and a real redis-server
//! drops replies after Redis ran the command, stalls the link, cuts
//! connections mid-reply and refuses connections. Through it, for every
//! algorithm (both sliding-log executions) and every connection source
//! (`connect` pool, `from_pool`, `from_connection_manager`, cluster):
//!
//! 1. never over: admissions of one key stay within the limit whatever the
//!    fault schedule (concurrency: leases held at once);
//! 2. a lost reply counts at most once, and a client's first request is
//!    never denied because of itself;
//! 3. a denied client that waits its `retry_after` is admitted after the
//!    fault heals;
//!
//! then the regression tests of issue 12's defects 1, 2, 3, 9 and 10, and the
//! fault table of BENCHMARKS.md (run with `--nocapture` to print it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::faults::{
    self, Algo, Connections, FaultSpans, Loss, Rig, admitted, denied, each_algorithm, fault_seed,
    millis, random_fault, show,
};
use crate::support::harness::away_from_a_boundary;
use crate::support::proxy::{AfterDrop, Direction, FaultProxy, Match, ProxiedCluster};
use crate::support::rng::Rng;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{
    Decision, FailMode, Limiter, MemoryStore, Policy, RateLimitLayer, RedisStore, Store, key,
};

/// The store timeout of the store-level tests.
const TIMEOUT: Duration = Duration::from_millis(300);

/// A store of `source` on the Redis at `url`, with the timeout [`TIMEOUT`].
async fn open(source: Connections, url: &str) -> RedisStore {
    faults::open(source, url, TIMEOUT).await
}

/// A seed per test, different for every source and algorithm; `FAULT_SEED`
/// changes them all.
fn seed(source: Connections, algo: Algo) -> u64 {
    let base = fault_seed(0x5eed);
    let mut h = base ^ 0x9e37_79b9_7f4a_7c15;
    for b in format!("{source:?}/{algo:?}").bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

// ---------------------------------------------------------------------------
// Invariant 1: never over.

/// How long the checkers run.
const RUN: Duration = Duration::from_secs(2);

#[derive(Debug, Default)]
struct Count {
    admitted: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicU64,
    most_in_flight: AtomicU64,
}

/// Two stores, three checkers each, hammer one key for [`RUN`] while a
/// seeded random schedule of faults hits the proxies: drop a reply (close,
/// or hang a while), cut one mid-way, stall a request or a reply, stall a
/// direction of the link, refuse connections a while, cut them all. The
/// whole run lies inside one window of 60 s, so each algorithm has an exact
/// bound: `max` admissions (GCRA: plus what it refilled meanwhile);
/// concurrency: `max` leases held at once, as the checkers see them (a lease
/// counts from the moment its check returns until its release is sent: less
/// than Redis holds it).
async fn never_over(rig: Rig, algo: Algo) {
    let window = Duration::from_secs(60);
    // Concurrency: one slot, so any live lease lost lets a second in.
    let max = if algo == Algo::Concurrency { 1 } else { 5 };
    let policy = Arc::new(algo.policy(max, window));
    let key = "never-over";
    let redis_key = rig.store(0).redis_key(algo.tag(), key);
    let seed = seed(rig.source, algo);
    let rig = Arc::new(rig);
    // Fixed and sliding windows: all inside one window.
    away_from_a_boundary(window, RUN + Duration::from_secs(3)).await;
    let count = Arc::new(Count::default());
    let started = Instant::now();
    let deadline = started + RUN;
    let mut jobs = JoinSet::new();
    for s in 0..rig.stores.len() {
        for c in 0..3u64 {
            let (rig, policy, count) = (Arc::clone(&rig), Arc::clone(&policy), Arc::clone(&count));
            let mut rng = Rng::new(seed.wrapping_add(1 + s as u64 * 8 + c));
            jobs.spawn(async move {
                let store = rig.store(s);
                while Instant::now() < deadline {
                    match store.check(key, &policy).await {
                        Ok(d) if d.allowed() => {
                            count.admitted.fetch_add(1, Ordering::SeqCst);
                            if let Some(lease) = d.lease() {
                                let now = count.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                                count.most_in_flight.fetch_max(now, Ordering::SeqCst);
                                tokio::time::sleep(millis(&mut rng, 10, 80)).await;
                                count.in_flight.fetch_sub(1, Ordering::SeqCst);
                                let _ = store.release(key, &policy, lease).await;
                            }
                        }
                        Ok(_) => {
                            count.denied.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(_) => {
                            count.errors.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    tokio::time::sleep(millis(&mut rng, 5, 30)).await;
                }
            });
        }
    }
    let faults = {
        let rig = Arc::clone(&rig);
        let mut rng = Rng::new(seed);
        let redis_key = redis_key.clone();
        tokio::spawn(async move {
            const SPANS: FaultSpans = FaultSpans {
                hang: (100, 600),
                held: (50, 500),
                stall: (50, 400),
                refused: (50, 300),
            };
            let mut schedule = Vec::new();
            while Instant::now() + Duration::from_millis(200) < deadline {
                tokio::time::sleep(millis(&mut rng, 30, 150)).await;
                let proxies = rig.all_proxies();
                let proxy = proxies[rng.below(proxies.len() as u64) as usize];
                let target = match rng.below(3) {
                    0 => Match::any(),
                    1 => algo.decisive(&redis_key),
                    _ => Match::any().arg(&redis_key),
                };
                schedule.push(random_fault(proxy, target, &mut rng, &SPANS).await);
            }
            schedule
        })
    };
    while let Some(done) = jobs.join_next().await {
        done.unwrap();
    }
    let elapsed = started.elapsed();
    let schedule = faults.await.unwrap();
    let fired = rig.faults();
    for proxy in rig.all_proxies() {
        proxy.heal();
        proxy.accept();
    }
    let admitted = count.admitted.load(Ordering::SeqCst);
    let denied = count.denied.load(Ordering::SeqCst);
    let errors = count.errors.load(Ordering::SeqCst);
    let what = format!(
        "seed {seed:#x}: {admitted} admitted, {denied} denied, {errors} errors in {elapsed:?}; \
         {fired} faults fired (schedule {schedule:?})"
    );
    assert!(fired >= 5, "too few faults fired to mean anything: {what}");
    if algo == Algo::Concurrency {
        let most = count.most_in_flight.load(Ordering::SeqCst);
        assert!(
            most <= max,
            "{most} leases held at once with max {max}: {what}"
        );
        assert!(
            admitted > 0 && denied > 0,
            "the limit was never reached: {what}"
        );
    } else {
        // GCRA refills one request every window / max.
        let bound = if algo == Algo::Gcra {
            max + (elapsed.as_micros() / (window / max as u32).as_micros()) as u64
        } else {
            max
        };
        assert!(
            admitted <= bound,
            "over-admitted: {admitted} admissions of one key within one window, limit {bound}: {what}"
        );
        assert!(denied > 0, "the limit was never reached: {what}");
    }
}

// ---------------------------------------------------------------------------
// Invariant 2: a lost reply counts at most once.

/// The ways a check's reply is lost here.
const LOSSES: [Loss; 4] = [Loss::DropClose, Loss::DropHang, Loss::Cut, Loss::Late];

/// For each way of losing a reply, store A's first request of a fresh key
/// loses its reply, then store B (through a proxy of its own) asks.
/// - max 1 and max 2: A's request is not denied (nothing else counted);
/// - max 2: B's next request is admitted: the lost one took at most one
///   unit; and if A's was admitted, B's second is denied (A's counts).
async fn lost_reply(rig: Rig, algo: Algo) {
    let (a, b) = (rig.store(0), rig.store(1));
    let mut failures = Vec::new();
    for loss in LOSSES {
        for max in [1, 2] {
            rig.reset().await;
            let key = format!("lost-{loss:?}-{max}");
            let redis_key = a.redis_key(algo.tag(), &key);
            let policy = algo.policy(max, Duration::from_secs(60));
            let proxy = rig.proxy(0, &redis_key);
            loss.arm(proxy, algo.decisive(&redis_key), TIMEOUT);
            let first = a.check(&key, &policy).await;
            let case = format!("{loss:?}, max {max}: A's request {}", show(&first));
            if proxy.armed() != 0 {
                failures.push(format!("{case}: the fault never fired"));
                continue;
            }
            loss.settle().await;
            if denied(&first) {
                failures.push(format!(
                    "{case}: a client's first request was denied because of itself"
                ));
                continue;
            }
            if max == 1 {
                continue;
            }
            let second = b.check(&key, &policy).await;
            if !admitted(&second) {
                failures.push(format!(
                    "{case}; B's next request {}: the lost request took more than one unit of 2",
                    show(&second)
                ));
                continue;
            }
            if admitted(&first) {
                let third = b.check(&key, &policy).await;
                if !denied(&third) {
                    failures.push(format!(
                        "{case}; B's next two {} and {}: A's admitted request does not count",
                        show(&second),
                        show(&third)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

// ---------------------------------------------------------------------------
// Invariant 3: Retry-After stays honest.

/// Where the fault hits in [`retry_after_honest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hit {
    /// The denied request's reply is dropped (connection closed).
    DeniedReplyLost,
    /// The second admitted request's reply is dropped (connection closed).
    AdmittedReplyLost,
    /// The denied request reaches Redis after the client timed out.
    DeniedRequestLate,
}

/// With 2 per second (concurrency: 2 leases of 1 s, never released, as
/// from a crashed holder), store A sends three requests (two to take the
/// quota, one to be denied), one of them hit by a fault; once the fault
/// healed, store B takes what A's failed requests left of the quota until
/// it is denied with some `retry_after`, waits it (plus 50 ms) and must be
/// admitted.
async fn retry_after_honest(rig: Rig, algo: Algo) {
    let (a, b) = (rig.store(0), rig.store(1));
    let window = Duration::from_secs(1);
    let policy = algo.policy(2, window);
    let mut failures = Vec::new();
    for hit in [
        Hit::DeniedReplyLost,
        Hit::AdmittedReplyLost,
        Hit::DeniedRequestLate,
    ] {
        rig.reset().await;
        let key = format!("retry-{hit:?}");
        let redis_key = a.redis_key(algo.tag(), &key);
        let proxy = rig.proxy(0, &redis_key);
        if matches!(algo, Algo::FixedWindow | Algo::SlidingWindow) {
            away_from_a_boundary(window, Duration::from_millis(800)).await;
        }
        let mut seen = Vec::new();
        for i in 0..3 {
            match (hit, i) {
                (Hit::AdmittedReplyLost, 1) | (Hit::DeniedReplyLost, 2) => {
                    proxy.drop_next_reply(algo.decisive(&redis_key), AfterDrop::Close);
                }
                (Hit::DeniedRequestLate, 2) => proxy.stall_next_request(
                    algo.decisive(&redis_key),
                    TIMEOUT + Duration::from_millis(100),
                ),
                _ => {}
            }
            seen.push(show(&a.check(&key, &policy).await));
        }
        if hit == Hit::DeniedRequestLate {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let fired = proxy.armed() == 0;
        // A's requests that failed may not count: B takes what is left of
        // the quota, until denied.
        let mut taken = Vec::new();
        let denial = loop {
            let outcome = b.check(&key, &policy).await;
            taken.push(show(&outcome));
            if !admitted(&outcome) || taken.len() > 2 {
                break outcome;
            }
        };
        let case = format!(
            "{hit:?}: A's three requests {seen:?} (fault fired: {fired}), then B's {taken:?}"
        );
        let Ok(decision) = &denial else {
            failures.push(case);
            continue;
        };
        if !fired || decision.allowed() {
            failures.push(format!("{case}: expected a fault and a denial"));
            continue;
        }
        let wait = decision.retry_after();
        tokio::time::sleep(wait + Duration::from_millis(50)).await;
        let after = b.check(&key, &policy).await;
        if !admitted(&after) {
            failures.push(format!(
                "{case}; after waiting it (+ 50 ms) B's request {}",
                show(&after)
            ));
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

// ---------------------------------------------------------------------------
// Defect 10: a refused connection fails a check at once.

/// How long a check may take to fail while every connection is refused:
/// below the store timeouts of these tests (300 ms; the layer's, 250 ms),
/// so that a check that waits for a timeout is caught, while a loaded
/// machine (a request once took 53 ms with a build beside the tests) is
/// not mistaken for one.
const AT_ONCE: Duration = Duration::from_millis(150);

/// Redis (the proxy) refuses connections and every open one is cut: each
/// check fails, each within [`AT_ONCE`] rather than the store timeout; once
/// it accepts again, the store answers without help.
async fn refused_fails_at_once(source: Connections) {
    let rig = Rig::start(source, 1, TIMEOUT).await;
    let store = rig.store(0);
    let mut failures = Vec::new();
    for algo in [Algo::LogScript, Algo::FixedWindow] {
        let policy = algo.policy(100, Duration::from_secs(60));
        store.check("refused", &policy).await.unwrap();
        for proxy in rig.all_proxies() {
            proxy.refuse();
        }
        let mut took = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            let outcome = store.check("refused", &policy).await;
            took.push(started.elapsed());
            assert!(outcome.is_err(), "{algo:?}: admitted through a closed port");
        }
        if took.iter().any(|&t| t > AT_ONCE) {
            failures.push(format!(
                "{algo:?}: checks failed after {took:?} (store timeout {TIMEOUT:?}), not at once (< {AT_ONCE:?})"
            ));
        }
        for proxy in rig.all_proxies() {
            proxy.accept();
        }
        let back = Instant::now();
        while store.check("refused", &policy).await.is_err() {
            assert!(
                back.elapsed() < Duration::from_secs(5),
                "{source:?} {algo:?}: the store never answered again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(
        failures.is_empty(),
        "{source:?}:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// HTTP layer helpers (as tests/faults.rs builds its apps).

fn request(client: u8) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    let addr: SocketAddr = format!("203.0.113.{client}:1").parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(addr));
    req
}

fn app(store: RedisStore, policy: Policy, mode: FailMode) -> Router {
    let limiter = RateLimitLayer::from_limiter(
        Limiter::new(store, policy).with_fail_mode(mode),
        key::peer_ip(),
    );
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter)
}

// ---------------------------------------------------------------------------
// Defect 9: limiting resumes within the breaker's cooldown + 0.5 s of Redis
// accepting connections again.

/// The default breaker's cooldown.
const COOLDOWN: Duration = Duration::from_secs(1);

/// How the outage of [`resumes_after_outage`] is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// The proxy refuses connections, then accepts them again.
    Refused,
    /// redis-server killed, then restarted (empty) on the same port; no proxy.
    Restart,
}

/// Through the layer (FailMode::Closed, the default breaker, the default
/// store timeout): Redis goes away for 1.5 s while requests keep coming
/// (the breaker opens and probes), comes back; the first response decided
/// by Redis again (not a 503) must come within the cooldown + 0.5 s.
async fn resumes_after_outage(source: Connections, outage: Outage) {
    let policy: Policy = "1000/10s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    let mut server = None;
    let mut cluster = None;
    let mut proxy = None;
    let store = match (source, outage) {
        (Connections::Cluster | Connections::ClusterNoRetries, _) => {
            let c = tokio::task::spawn_blocking(ProxiedCluster::start)
                .await
                .unwrap();
            let store = faults::open_cluster(source, &c.urls(), TIMEOUT).await;
            cluster = Some(c);
            store
        }
        (_, Outage::Refused) => {
            let s = RedisServer::start();
            let p = FaultProxy::start(s.port());
            let store = open(source, &p.url()).await;
            server = Some(s);
            proxy = Some(p);
            store
        }
        (_, Outage::Restart) => {
            let s = RedisServer::start();
            let store = open(source, &s.url()).await;
            server = Some(s);
            store
        }
    };
    // The default timeout, as the issue measured it.
    let store = store.with_timeout(tower_redis_ratelimit::RedisStore::DEFAULT_TIMEOUT);
    let app = app(store, policy, FailMode::Closed);
    let status = |app: &Router| {
        let app = app.clone();
        async move { app.oneshot(request(1)).await.unwrap().status() }
    };
    assert_eq!(status(&app).await, StatusCode::OK);
    match outage {
        Outage::Refused => {
            if let Some(cluster) = &cluster {
                cluster.refuse();
            }
            if let Some(proxy) = &proxy {
                proxy.refuse();
            }
        }
        Outage::Restart => server.as_mut().unwrap().kill(),
    }
    let down = Instant::now();
    while down.elapsed() < Duration::from_millis(1500) {
        assert_eq!(status(&app).await, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    match outage {
        Outage::Refused => {
            if let Some(cluster) = &cluster {
                cluster.accept();
            }
            if let Some(proxy) = &proxy {
                proxy.accept();
            }
        }
        Outage::Restart => {
            let server = server.as_mut().unwrap();
            tokio::task::block_in_place(|| server.restart());
        }
    }
    let up = Instant::now();
    // 503s before the first decision, and those that took a while (probes
    // that waited for the store): (sent at, took) in ms.
    let mut unavailable = 0;
    let mut slow = Vec::new();
    let resumed = loop {
        let sent = up.elapsed();
        let s = status(&app).await;
        let took = up.elapsed() - sent;
        if s != StatusCode::SERVICE_UNAVAILABLE {
            break up.elapsed();
        }
        unavailable += 1;
        if took > Duration::from_millis(20) {
            slow.push((sent.as_millis(), took.as_millis()));
        }
        assert!(
            up.elapsed() < Duration::from_secs(6),
            "{source:?} {outage:?}: limiting never resumed: {unavailable} 503s; slow (sent at, took) ms: {slow:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    eprintln!(
        "{source:?} {outage:?}: limiting resumed {} ms after Redis accepted connections",
        resumed.as_millis()
    );
    assert!(
        resumed <= COOLDOWN + Duration::from_millis(500),
        "{source:?} {outage:?}: limiting resumed {resumed:?} after Redis accepted connections \
         again, more than the cooldown ({COOLDOWN:?}) + 0.5 s: {unavailable} requests (one every \
         25 ms) got 503 first; those that waited for the store (sent at, took) ms: {slow:?}"
    );
    drop(app);
}

/// Through the layer (FailMode::Open, the default breaker and store
/// timeout), while the proxy refuses connections for 2.5 s: no response
/// waits for the store timeout, neither the first requests of the outage
/// nor the breaker's probes.
async fn layer_answers_at_once_while_refused(source: Connections) {
    let rig = Rig::start(source, 1, TIMEOUT).await;
    let store = rig
        .store(0)
        .clone()
        .with_timeout(tower_redis_ratelimit::RedisStore::DEFAULT_TIMEOUT);
    let policy: Policy = "1000/10s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    let app = app(store, policy, FailMode::Open);
    assert_eq!(
        app.clone().oneshot(request(1)).await.unwrap().status(),
        StatusCode::OK
    );
    for proxy in rig.all_proxies() {
        proxy.refuse();
    }
    let down = Instant::now();
    let mut slow = Vec::new();
    let mut sent = 0;
    while down.elapsed() < Duration::from_millis(2500) {
        let at = down.elapsed();
        let started = Instant::now();
        let response = app.clone().oneshot(request(1)).await.unwrap();
        let took = started.elapsed();
        sent += 1;
        assert_eq!(response.status(), StatusCode::OK);
        if took > AT_ONCE {
            slow.push(format!("at {} ms: {} ms", at.as_millis(), took.as_millis()));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(
        slow.is_empty(),
        "{source:?}: {} of {sent} requests during the refusal waited for the store \
         (> {AT_ONCE:?}): {slow:?}",
        slow.len()
    );
}

// ---------------------------------------------------------------------------
// The matrix.

/// The invariants, for every algorithm, on each source.
macro_rules! invariants {
    ($($(#[$attr:meta])* $name:ident: $source:expr),+ $(,)?) => {
        $(
            $(#[$attr])*
            mod $name {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn never_over() {
                    each_algorithm($source, 2, TIMEOUT, crate::network_faults::never_over).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_lost_reply_counts_at_most_once() {
                    each_algorithm($source, 2, TIMEOUT, crate::network_faults::lost_reply).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn retry_after_stays_honest() {
                    each_algorithm($source, 2, TIMEOUT, crate::network_faults::retry_after_honest).await;
                }
            }
        )+
    };
}

/// Refused connections (defects 9 and 10), on each source.
macro_rules! refusals {
    ($($(#[$attr:meta])* $name:ident: $source:expr),+ $(,)?) => {
        $(
            $(#[$attr])*
            mod $name {
                use super::*;

                /// Defect 10.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_refused_connection_fails_the_check_at_once() {
                    crate::network_faults::refused_fails_at_once($source).await;
                }

                /// Defect 10, through the layer.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn the_layer_answers_at_once_while_redis_refuses() {
                    crate::network_faults::layer_answers_at_once_while_refused($source).await;
                }

                /// Defect 9.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn limiting_resumes_after_refused_connections() {
                    crate::network_faults::resumes_after_outage($source, Outage::Refused).await;
                }
            }
        )+
    };
}

mod invariants {
    use super::*;

    invariants! {
        pool: Connections::Pool,
        bb8: Connections::Bb8,
        manager: Connections::Manager,
        manager_no_retries: Connections::ManagerNoRetries,
        #[cfg(feature = "cluster")]
        cluster: Connections::Cluster,
    }

    /// The workaround `connect_cluster`'s rustdoc gives for lost replies.
    #[cfg(feature = "cluster")]
    mod cluster_no_retries {
        use super::*;

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_lost_reply_counts_at_most_once() {
            each_algorithm(
                Connections::ClusterNoRetries,
                2,
                TIMEOUT,
                crate::network_faults::lost_reply,
            )
            .await;
        }
    }
}

/// The ConnectionManager as its rustdoc says to build it for refusals to
/// fail at once (no retries); with redis-rs's defaults a check waits for
/// the manager's retries, up to the store timeout, as documented.
mod refusals {
    use super::*;

    refusals! {
        pool: Connections::Pool,
        bb8: Connections::Bb8,
        manager_no_retries: Connections::ManagerNoRetries,
        #[cfg(feature = "cluster")]
        cluster: Connections::Cluster,
    }
}

/// Defect 9 with a real restart (kill, then a fresh server on the port).
mod restart {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pool_resumes_after_a_redis_restart() {
        resumes_after_outage(Connections::Pool, Outage::Restart).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bb8_resumes_after_a_redis_restart() {
        resumes_after_outage(Connections::Bb8, Outage::Restart).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn manager_resumes_after_a_redis_restart() {
        resumes_after_outage(Connections::Manager, Outage::Restart).await;
    }
}

// ---------------------------------------------------------------------------
// Regression tests of issue 12's defects 1, 2 and 3.

/// Defect 1: `Transaction` stamps an entry with the time read before the
/// pipeline is sent, so a stall dates it in the past. With `1/1s`, Redis's
/// link stalled 400 ms (client → Redis) while store A checks, store B
/// checks 1.05 s after A started: A's entry landed at ≥ 0.4 s, B's at
/// 1.05 s, 0.65 s apart, so B must be denied. (`Script` is the control: it
/// stamps on Redis's clock.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_1_a_stalled_transaction_is_not_dated_in_the_past() {
    let mut failures = Vec::new();
    for execution in [Execution::Transaction, Execution::Script] {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let long = Duration::from_secs(1);
        let a = RedisStore::connect(&proxy.url())
            .await
            .unwrap()
            .with_timeout(long);
        let b = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_timeout(long);
        faults::warm_every_algorithm(&a).await;
        faults::warm_every_algorithm(&b).await;
        let policy = "1/1s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let started = Instant::now();
        proxy.stall(Direction::ToRedis, Duration::from_millis(400));
        let first = {
            let policy = policy.clone();
            tokio::spawn(async move { a.check("k", &policy).await })
        };
        tokio::time::sleep_until((started + Duration::from_millis(1050)).into()).await;
        let second = b.check("k", &policy).await;
        let first = first.await.unwrap();
        assert!(
            admitted(&first),
            "{execution:?}: A's request on a fresh key: {}",
            show(&first)
        );
        if admitted(&second) {
            failures.push(format!(
                "{execution:?}: A's request (stalled 400 ms on its way to Redis) and B's \
                 (1.05 s after A started) both admitted with 1/1s: they ran 0.65 s apart"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Defect 2: a reply dropped after Redis ran the check (the connection
/// closed) makes the store retry, and the retry writes a second entry:
/// `1/min` denies the client's only request. Both executions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_a_lost_reply_does_not_deny_the_only_request() {
    let mut failures = Vec::new();
    for execution in [Execution::Transaction, Execution::Script] {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let store = open(Connections::Pool, &proxy.url()).await;
        faults::warm_every_algorithm(&store).await;
        let policy = "1/min"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let algo = match execution {
            Execution::Transaction => Algo::LogTransaction,
            _ => Algo::LogScript,
        };
        let redis_key = store.redis_key("log", "client");
        proxy.drop_next_reply(algo.decisive(&redis_key), AfterDrop::Close);
        let outcome = store.check("client", &policy).await;
        assert_eq!(proxy.armed(), 0, "the reply was not dropped");
        // Let a clean-up the store spawned run.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let entries = support::zcard(&server, &redis_key);
        if denied(&outcome) || entries > 1 {
            failures.push(format!(
                "{execution:?}: the client's only request, its reply lost: {}; its log holds \
                 {entries} entries",
                show(&outcome)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A key the transaction found full is read before it is written; with
/// room again (a reward), the check goes on to the transaction, whose
/// reply is lost: sent again, it writes the same entries, and is admitted
/// (a read first on the second attempt would count its own entries and
/// deny it, leaving them counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_after_a_full_key_had_room_again_admits_once() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = open(Connections::Pool, &proxy.url()).await;
    let policy: Policy = "2/min".parse().unwrap();
    let redis_key = store.redis_key("log", "held");
    assert!(store.check("held", &policy).await.unwrap().allowed());
    assert!(store.check("held", &policy).await.unwrap().allowed());
    assert!(!store.check("held", &policy).await.unwrap().allowed());
    store
        .command("held", &policy, Command::Reward(1))
        .await
        .unwrap();
    proxy.drop_next_reply(Match::command("EXEC"), AfterDrop::Close);
    let outcome = store.check("held", &policy).await;
    assert_eq!(proxy.armed(), 0, "the reply was not dropped");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        outcome.as_ref().is_ok_and(Decision::allowed),
        "the only request with room, its reply lost: {}",
        show(&outcome)
    );
    assert_eq!(support::zcard(&server, &redis_key), 2);
}

/// Defect 2 through the layer (`Script`, `1/min`, the deny cache on): the
/// client's only request, its reply lost, is admitted (and no denial is
/// held in the deny cache for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_the_layer_admits_the_only_request_after_a_lost_reply() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = open(Connections::Pool, &proxy.url()).await;
    faults::warm_every_algorithm(&store).await;
    let policy = "1/min"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    let app = app(store, policy, FailMode::Closed);
    proxy.drop_next_reply(
        Match::command("EVALSHA").arg("203.0.113.1"),
        AfterDrop::Close,
    );
    let first = app.clone().oneshot(request(1)).await.unwrap().status();
    assert_eq!(proxy.armed(), 0, "the reply was not dropped");
    let before = proxy.commands("EVALSHA");
    let second = app.clone().oneshot(request(1)).await.unwrap().status();
    let asked = proxy.commands("EVALSHA") - before;
    assert_eq!(
        first,
        StatusCode::OK,
        "the client's only request, its reply lost, got {first}; its next got {second} \
         after {asked} EVALSHA (0: the deny cache answered, holding the false denial)"
    );
    assert_eq!(
        second,
        StatusCode::TOO_MANY_REQUESTS,
        "1/min: the second is over"
    );
}

/// Defect 3: `from_connection_manager` + concurrency, max 1: the lease
/// check's reply is lost (connection closed), the store retries on the
/// reconnected manager and is granted the same lease again, then the first
/// attempt's clean-up `ZREM`, sent on the reconnected clone, deletes that
/// live lease: another store is admitted, two in flight. It depends on the
/// order of the retry and the clean-up (3 of 5 runs), so it is run 15
/// times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_3_a_retried_lease_is_not_deleted_by_its_first_attempt() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let a = open(Connections::Manager, &proxy.url()).await;
    let b = open(Connections::Pool, &server.url()).await;
    faults::warm_every_algorithm(&a).await;
    faults::warm_every_algorithm(&b).await;
    let policy = Policy::concurrency(1).unwrap();
    let mut held = 0;
    let mut errors = Vec::new();
    let mut twice = Vec::new();
    for i in 0..15 {
        let key = format!("lease-{i}");
        let redis_key = a.redis_key("conc", &key);
        proxy.drop_next_reply(Algo::Concurrency.decisive(&redis_key), AfterDrop::Close);
        let first = a.check(&key, &policy).await;
        assert_eq!(proxy.armed(), 0, "run {i}: the reply was not dropped");
        let lease = match &first {
            Ok(d) if d.allowed() => d.lease().unwrap(),
            Ok(_) => panic!("run {i}: the only request for the slot was denied: {first:?}"),
            Err(e) => {
                errors.push(format!("run {i}: {e}"));
                continue;
            }
        };
        held += 1;
        // The first attempt's clean-up, if any, runs meanwhile.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = b.check(&key, &policy).await;
        if admitted(&second) {
            twice.push(i);
            b.release(&key, &policy, second.unwrap().lease().unwrap())
                .await
                .unwrap();
        }
        let _ = a.release(&key, &policy, lease).await;
    }
    assert!(
        held >= 5,
        "only {held} of 15 lost-reply checks were admitted after a retry: {errors:?}"
    );
    assert!(
        twice.is_empty(),
        "two requests in flight with max 1 in runs {twice:?} ({} of {held}): the retried check \
         was granted its lease again, then the first attempt's clean-up deleted it",
        twice.len()
    );
}

// ---------------------------------------------------------------------------
// The fault table (BENCHMARKS.md): network faults through the layer, per fail mode.

/// The store timeout of the fault table (as in tests/faults.rs).
const TABLE_TIMEOUT: Duration = Duration::from_millis(100);
/// What a request may take beyond the store's timeout on a loaded machine.
const TABLE_MARGIN: Duration = Duration::from_millis(400);
/// The table's policy: 20 requests a client for 10 s (3 clients, 40 each).
const PER_CLIENT: usize = 20;

/// A network fault of the table, applied while a burst goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetFault {
    /// A check's reply dropped after Redis ran it, the connection closed:
    /// one armed at a time, every 25 ms.
    DroppedReply,
    /// A check's reply dropped and its connection hung for 500 ms, then
    /// closed: one at a time, every 100 ms.
    DroppedReplyHang,
    /// The link frozen (both ways) for 50 ms, shorter than the timeout,
    /// every 150 ms.
    ShortStall,
    /// The link frozen for 250 ms, longer than the timeout, every 400 ms.
    LongStall,
    /// A check's reply cut half-way, the connection closed: one at a time,
    /// every 25 ms.
    CutMidReply,
    /// Connections refused (and the open ones cut) for the whole burst.
    Refused,
}

impl NetFault {
    fn label(self) -> &'static str {
        match self {
            Self::DroppedReply => "dropped reply, closed",
            Self::DroppedReplyHang => "dropped reply, hung",
            Self::ShortStall => "stall 50 ms",
            Self::LongStall => "stall 250 ms",
            Self::CutMidReply => "cut mid-reply",
            Self::Refused => "refused",
        }
    }

    /// Apply the fault to `proxy` until `done`.
    async fn drive(self, proxy: Arc<FaultProxy>, done: Arc<AtomicUsize>) {
        let ms = Duration::from_millis;
        while done.load(Ordering::SeqCst) == 0 {
            let pause = match self {
                Self::DroppedReply | Self::CutMidReply | Self::DroppedReplyHang => {
                    if proxy.armed() == 0 {
                        let target = Match::command("EVALSHA");
                        match self {
                            Self::DroppedReply => proxy.drop_next_reply(target, AfterDrop::Close),
                            Self::CutMidReply => proxy.cut_next_reply(target),
                            _ => proxy.drop_next_reply(target, AfterDrop::HangFor(ms(500))),
                        }
                    }
                    if self == Self::DroppedReplyHang {
                        ms(100)
                    } else {
                        ms(25)
                    }
                }
                Self::ShortStall => {
                    proxy.freeze(ms(50));
                    ms(150)
                }
                Self::LongStall => {
                    proxy.freeze(ms(250));
                    ms(400)
                }
                Self::Refused => ms(25),
            };
            tokio::time::sleep(pause).await;
        }
    }
}

/// What a burst of requests got.
#[derive(Debug, Default)]
struct Tally {
    sent: usize,
    answered: usize,
    admitted: usize,
    /// Per client (1 to 3).
    admitted_by: [usize; 4],
    /// Admitted with rate-limit headers (decided by a store, Redis or the
    /// fallback), per client.
    decided_by: [usize; 4],
    limited: usize,
    unavailable: usize,
    /// Answered 503, per client.
    unavailable_by: [usize; 4],
    worst: Duration,
}

impl Tally {
    fn over_admitted(&self, clients: usize) -> usize {
        self.admitted.saturating_sub(PER_CLIENT * clients)
    }
}

/// `per_client` requests from each of `clients` clients, one every 10 ms
/// (1.2 s for 120: longer than the breaker's cooldown), at most 20 in
/// flight.
async fn paced_burst(app: &Router, clients: u8, per_client: usize) -> Tally {
    let mut tally = Tally::default();
    let mut jobs = JoinSet::new();
    for i in 0..(usize::from(clients) * per_client) {
        let app = app.clone();
        let client = (i % usize::from(clients)) as u8 + 1;
        tally.sent += 1;
        jobs.spawn(async move {
            let started = Instant::now();
            let response = app.oneshot(request(client)).await.unwrap();
            (client, response, started.elapsed())
        });
        if jobs.len() >= 20 {
            record(&mut tally, jobs.join_next().await.unwrap().unwrap());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while let Some(done) = jobs.join_next().await {
        record(&mut tally, done.unwrap());
    }
    tally
}

fn record(tally: &mut Tally, (client, response, took): (u8, http::Response<Body>, Duration)) {
    tally.answered += 1;
    tally.worst = tally.worst.max(took);
    match response.status() {
        StatusCode::OK => {
            tally.admitted += 1;
            tally.admitted_by[usize::from(client)] += 1;
            if response.headers().contains_key("x-ratelimit-limit") {
                tally.decided_by[usize::from(client)] += 1;
            }
        }
        StatusCode::TOO_MANY_REQUESTS => tally.limited += 1,
        StatusCode::SERVICE_UNAVAILABLE => {
            tally.unavailable += 1;
            tally.unavailable_by[usize::from(client)] += 1;
        }
        other => panic!("unexpected status {other}"),
    }
}

/// One line of the table, in tests/faults.rs's format.
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

/// Each fail mode under `fault`: 3 clients × 40 requests (policy 20 per
/// 10 s, `Script`) through the layer while the fault hits the proxy. Every
/// request is answered within the timeout + margin, and admissions stay
/// within what the fail mode promises: `Closed` admits only what Redis
/// decided (≤ 20 a client); `Open` admits every request the store could not
/// decide, but of those Redis decided at most 20 a client; `Fallback` (one
/// instance) adds at most the in-process quota: ≤ 40 a client.
async fn fault_row(fault: NetFault) {
    let modes = [
        ("open", FailMode::Open),
        ("closed", FailMode::Closed),
        ("fallback", FailMode::fallback(MemoryStore::new(), 1)),
    ];
    for (name, mode) in modes {
        let server = RedisServer::start();
        let proxy = Arc::new(FaultProxy::start(server.port()));
        let store = RedisStore::connect(&proxy.url())
            .await
            .unwrap()
            .with_timeout(TABLE_TIMEOUT);
        let policy = "20/10s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(Execution::Script)
            .unwrap();
        let app = app(store, policy, mode);
        if fault == NetFault::Refused {
            proxy.refuse();
        }
        let done = Arc::new(AtomicUsize::new(0));
        let driver = tokio::spawn(fault.drive(Arc::clone(&proxy), Arc::clone(&done)));
        let t = paced_burst(&app, 3, 40).await;
        done.store(1, Ordering::SeqCst);
        driver.await.unwrap();
        let faults = proxy.stats().faults();
        proxy.heal();
        proxy.accept();
        report(fault.label(), name, &t, 3);
        assert!(faults > 0, "{name}: no fault fired");
        assert_eq!(t.answered, t.sent, "{name}: {t:?}");
        assert!(
            t.worst <= TABLE_TIMEOUT + TABLE_MARGIN,
            "{name}: worst {:?}",
            t.worst
        );
        match fault {
            // Connections refused fail every check at once.
            NetFault::Refused => assert!(
                t.worst < Duration::from_millis(50),
                "{name}: worst {:?} while refused",
                t.worst
            ),
            // A lost or cut reply is retried on a fresh connection at once.
            NetFault::DroppedReply | NetFault::CutMidReply => assert!(
                t.worst < TABLE_TIMEOUT,
                "{name}: worst {:?}: a lost reply waited",
                t.worst
            ),
            _ => {}
        }
        for client in 1..=3 {
            let (admitted, decided) = (t.admitted_by[client], t.decided_by[client]);
            // Where Redis answers between the faults, no client loses quota
            // to a lost reply counted twice: it is denied only once 20 of
            // its requests were admitted (or failed, and counted at most
            // once).
            if matches!(
                fault,
                NetFault::DroppedReply | NetFault::CutMidReply | NetFault::ShortStall
            ) {
                let spent = admitted + t.unavailable_by[client];
                assert!(
                    spent >= PER_CLIENT,
                    "{name}: client {client}: denied after {admitted} admitted and {} failed: \
                     quota lost to a reply counted twice: {t:?}",
                    t.unavailable_by[client]
                );
            }
            match name {
                "closed" => assert!(
                    admitted == decided && admitted <= PER_CLIENT,
                    "{name}: client {client}: {admitted} admitted, {decided} by Redis: {t:?}"
                ),
                "open" => assert!(
                    decided <= PER_CLIENT,
                    "{name}: client {client}: Redis admitted {decided}: {t:?}"
                ),
                _ => assert!(
                    admitted <= 2 * PER_CLIENT,
                    "{name}: client {client}: {admitted} admitted: {t:?}"
                ),
            }
        }
    }
}

mod fault_table {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_reply() {
        fault_row(NetFault::DroppedReply).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_reply_hung_connection() {
        fault_row(NetFault::DroppedReplyHang).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stall_shorter_than_the_timeout() {
        fault_row(NetFault::ShortStall).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stall_longer_than_the_timeout() {
        fault_row(NetFault::LongStall).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cut_mid_reply() {
        fault_row(NetFault::CutMidReply).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused() {
        fault_row(NetFault::Refused).await;
    }
}

// ---------------------------------------------------------------------------
// The proxy's own tests.

mod proxy_itself {
    use super::*;

    async fn conn(proxy: &FaultProxy) -> redis::aio::MultiplexedConnection {
        redis::Client::open(proxy.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_forwards_and_counts() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let mut c = conn(&proxy).await;
        let () = redis::cmd("SET")
            .arg("k")
            .arg("v")
            .query_async(&mut c)
            .await
            .unwrap();
        let v: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(v, "v");
        let stats = proxy.stats();
        assert_eq!(stats.accepted, 1);
        assert!(
            stats.bytes_to_redis > 0 && stats.bytes_to_client > 0,
            "{stats:?}"
        );
        assert_eq!(proxy.commands("set"), 1);
        assert_eq!(stats.faults(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_drops_a_targeted_reply_after_redis_ran_it() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let mut c = conn(&proxy).await;
        proxy.drop_next_reply(Match::command("INCR").arg("counter"), AfterDrop::Close);
        // Not targeted: answered.
        let () = redis::cmd("SET")
            .arg("other")
            .arg("1")
            .query_async(&mut c)
            .await
            .unwrap();
        let lost = redis::cmd("INCR")
            .arg("counter")
            .query_async::<i64>(&mut c)
            .await;
        assert!(lost.is_err(), "{lost:?}");
        assert_eq!(proxy.armed(), 0);
        assert_eq!(proxy.stats().replies_dropped, 1);
        assert_eq!(
            server.command(&["GET", "counter"]),
            "$1\r\n1\r\n",
            "Redis ran it"
        );
        // Hang: the client times out, Redis ran it.
        let client = redis::Client::open(proxy.url()).unwrap();
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_millis(200)));
        let mut c = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap();
        proxy.drop_next_reply(Match::command("INCR"), AfterDrop::Hang);
        let started = Instant::now();
        let lost = redis::cmd("INCR")
            .arg("counter")
            .query_async::<i64>(&mut c)
            .await;
        assert!(lost.unwrap_err().is_timeout());
        assert!(started.elapsed() >= Duration::from_millis(190));
        assert_eq!(server.command(&["GET", "counter"]), "$1\r\n2\r\n");
        // Every later reply on that connection is lost too.
        let lost = redis::cmd("PING").query_async::<String>(&mut c).await;
        assert!(lost.unwrap_err().is_timeout());
        assert_eq!(proxy.stats().open, 1);
        proxy.cut_all();
        assert_eq!(proxy.stats().open, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_targets_the_exec_of_a_transaction_on_a_key() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let mut c = conn(&proxy).await;
        proxy.cut_next_reply(Match::command("EXEC").arg("tx-key"));
        let mut other = redis::pipe();
        other
            .atomic()
            .cmd("INCR")
            .arg("elsewhere")
            .cmd("INCR")
            .arg("elsewhere");
        let (a, b): (i64, i64) = other.query_async(&mut c).await.unwrap();
        assert_eq!((a, b), (1, 2));
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("INCR")
            .arg("tx-key")
            .cmd("INCR")
            .arg("tx-key");
        let cut = pipe.query_async::<(i64, i64)>(&mut c).await;
        assert!(cut.is_err(), "{cut:?}");
        assert_eq!(proxy.stats().replies_cut, 1);
        assert_eq!(server.command(&["GET", "tx-key"]), "$1\r\n2\r\n");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_stalls_each_direction_and_delivers_in_order() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let mut c = conn(&proxy).await;
        // Towards Redis: the command runs late.
        proxy.stall_next_request(Match::command("INCR"), Duration::from_millis(300));
        let started = Instant::now();
        let probe = {
            let port = server.port();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                support::raw_command(port, &["GET", "n"])
            })
        };
        let n: i64 = redis::cmd("INCR")
            .arg("n")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(n, 1);
        assert!(started.elapsed() >= Duration::from_millis(290));
        assert_eq!(probe.await.unwrap(), "$-1\r\n", "not run 150 ms in");
        // Towards the client: run at once, heard late.
        proxy.stall(Direction::ToClient, Duration::from_millis(300));
        let started = Instant::now();
        let probe = {
            let port = server.port();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(150)).await;
                support::raw_command(port, &["GET", "n"])
            })
        };
        let mut pipe = redis::pipe();
        pipe.cmd("INCR").arg("n").cmd("INCR").arg("n");
        let (a, b): (i64, i64) = pipe.query_async(&mut c).await.unwrap();
        assert_eq!((a, b), (2, 3));
        assert!(started.elapsed() >= Duration::from_millis(290));
        assert_eq!(probe.await.unwrap(), "$1\r\n3\r\n", "run 150 ms in");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxy_refuses_then_accepts_on_the_same_port() {
        let server = RedisServer::start();
        let proxy = FaultProxy::start(server.port());
        let mut c = conn(&proxy).await;
        proxy.refuse();
        let refused = std::net::TcpStream::connect(("127.0.0.1", proxy.port()));
        assert_eq!(
            refused.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        let cut = redis::cmd("PING").query_async::<String>(&mut c).await;
        assert!(cut.is_err(), "the open connection was cut: {cut:?}");
        assert!(!proxy.accepting());
        proxy.accept();
        let mut c = conn(&proxy).await;
        let pong: String = redis::cmd("PING").query_async(&mut c).await.unwrap();
        assert_eq!(pong, "PONG");
        let stats = proxy.stats();
        assert_eq!((stats.refusals, stats.accepted), (1, 2), "{stats:?}");
    }

    #[cfg(feature = "cluster")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn proxied_cluster_sends_clients_through_the_proxies() {
        let started = Instant::now();
        let cluster = support::proxy::ProxiedCluster::start();
        eprintln!("proxied cluster up in {:?}", started.elapsed());
        let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
        let mut c = client.get_async_connection().await.unwrap();
        for i in 0..30 {
            let key = format!("k{i}");
            let () = redis::cmd("SET")
                .arg(&key)
                .arg(i)
                .query_async(&mut c)
                .await
                .unwrap();
        }
        for proxy in cluster.proxies() {
            assert!(
                proxy.commands("SET") > 0,
                "every node is reached through its proxy"
            );
        }
        let key = "k7";
        let proxy = cluster.proxy_of(key);
        let before = proxy.commands("GET");
        let v: i64 = redis::cmd("GET")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(v, 7);
        assert_eq!(proxy.commands("GET"), before + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_harness_over_a_proxy() {
        let (h, proxy) = support::harness::Harness::redis_proxied(Execution::Script).await;
        let policy = h.policy("1/min");
        proxy.drop_next_reply(Match::command("EVALSHA"), AfterDrop::Close);
        assert!(h.check("k", &policy).await.allowed());
        assert_eq!(proxy.stats().replies_dropped, 1);
        assert!(!h.check("k", &policy).await.allowed());
    }
}
