//! What a check spends when its future is dropped (a timeout of the
//! caller's, a client that disconnects), for every algorithm and execution,
//! against a real redis-server behind the fault proxy (which holds a reply
//! back, so the future is dropped after Redis ran the command) and against
//! MemoryStore. The guide's page `cancellation` states these results.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_redis_ratelimit::limiter::LocalQuota;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Limiter, MemoryStore, Policy, RateLimitLayer, RedisStore, key};

use crate::support::RedisServer;
use crate::support::eventually::eventually;
use crate::support::http::request;
use crate::support::proxy::{FaultProxy, Match};

/// How long the proxy holds the reply: far longer than the test waits
/// before dropping the future, far shorter than the store's timeout.
const STALL: Duration = Duration::from_millis(600);

/// A store through a fault proxy, with a timeout the stalls stay within.
async fn proxied(batches: usize) -> (RedisServer, Arc<FaultProxy>, RedisStore) {
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5))
        .with_batches(batches);
    (server, proxy, store)
}

/// Load `limiter`'s script into Redis with a check of another key, so the
/// held reply is the script's run (not a `NOSCRIPT` refusal).
async fn load_script(limiter: &Limiter) {
    assert!(limiter.check("load-script").await.unwrap().allowed());
}

/// Poll `future` until the proxy's armed fault fired (Redis ran the
/// command and its reply is held), then drop it unanswered.
async fn drop_once_redis_ran_it<F: Future>(proxy: &FaultProxy, future: F) {
    let mut future = std::pin::pin!(future);
    let deadline = Instant::now() + Duration::from_secs(3);
    while proxy.armed() > 0 {
        assert!(Instant::now() < deadline, "the fault never fired");
        tokio::select! {
            _ = &mut future => panic!("answered although its reply is held"),
            () = tokio::time::sleep(Duration::from_millis(2)) => {}
        }
    }
    // A little longer, still unanswered: the reply is held for STALL.
    tokio::select! {
        _ = &mut future => panic!("answered although its reply is held"),
        () = tokio::time::sleep(Duration::from_millis(20)) => {}
    }
}

/// The units of `key` free now: what a peek would admit (a peek's
/// `remaining` is what would be left after admitting it).
async fn free(limiter: &Limiter, key: &str) -> u64 {
    let peek = limiter.peek(key).await.unwrap();
    if peek.allowed() {
        peek.remaining() + 1
    } else {
        0
    }
}

/// Wait until `key` has `expected` units free (clean-ups run in the
/// background), for at most 3 s.
async fn free_becomes(limiter: &Limiter, key: &str, expected: u64, what: &str) {
    let (within, step) = (Duration::from_secs(3), Duration::from_millis(10));
    let what = format!("{what}: units free");
    eventually(within, step, &what, expected, || free(limiter, key)).await;
}

/// After the held reply was delivered, `key` still has `expected` units
/// free: nothing took the count back out, nor counted it later.
async fn free_stays(limiter: &Limiter, key: &str, expected: u64, what: &str) {
    tokio::time::sleep(STALL + Duration::from_millis(200)).await;
    assert_eq!(free(limiter, key).await, expected, "{what}");
}

/// A sliding log of 5 an hour in the `Transaction` execution, named
/// `cancel`, over `store`.
fn transaction_limiter(store: RedisStore) -> Limiter {
    let policy = "5/h"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Transaction)
        .unwrap();
    Limiter::new(store, policy).with_name("cancel")
}

/// The sliding log's `Transaction` execution: a check dropped after Redis
/// ran its `MULTI`/`EXEC` counts nothing: its entries are taken back out
/// (a `ZREM` on the same connection, after the transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_check_counts_nothing() {
    let (_server, proxy, store) = proxied(0).await;
    let limiter = transaction_limiter(store);
    proxy.stall_next_reply(Match::command("EXEC").arg("cancel:log-tx"), STALL);
    drop_once_redis_ran_it(&proxy, limiter.check("log-tx")).await;
    free_becomes(&limiter, "log-tx", 5, "a dropped transaction check").await;
    free_stays(&limiter, "log-tx", 5, "a dropped transaction check").await;
}

/// Every algorithm decided by a script (the sliding log's `Script`
/// execution, both windows, GCRA), sent alone or in a batch (the fixed
/// window counters' batches: plain commands): a check dropped after Redis ran it
/// counts once, as an admission nobody heard of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_script_check_that_redis_ran_counts_once() {
    let base: Policy = "5/h".parse().unwrap();
    let policies = [
        (
            "log-script",
            base.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("fixed", base.clone().fixed_window().unwrap()),
        ("sliding", base.clone().sliding_window().unwrap()),
        ("gcra", base.clone().gcra().unwrap()),
    ];
    for batches in [0, 2] {
        let (_server, proxy, store) = proxied(batches).await;
        for (name, policy) in &policies {
            let key = format!("{name}-{batches}");
            let limiter = Limiter::new(store.clone(), policy.clone()).with_name("cancel");
            load_script(&limiter).await;
            // The window counters' batches are plain commands: the
            // count's `INCRBY`.
            let decisive = if (*name == "fixed" || *name == "sliding") && batches > 0 {
                Match::command("INCRBY")
            } else {
                Match::command("EVALSHA")
            };
            proxy.stall_next_reply(decisive.arg(format!("cancel:{key}")), STALL);
            drop_once_redis_ran_it(&proxy, limiter.check(&key)).await;
            let what = format!("{name}, batches {batches}");
            free_stays(&limiter, &key, 4, &what).await;
        }
    }
}

/// A batched check dropped while it waits for its batch (the one batch in
/// flight has its reply held) is never sent: it counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_check_dropped_before_its_batch_went_counts_nothing() {
    let (_server, proxy, store) = proxied(1).await;
    let policy = "5/h".parse::<Policy>().unwrap().gcra().unwrap();
    let limiter = Limiter::new(store, policy).with_name("cancel");
    load_script(&limiter).await;
    proxy.stall_next_reply(Match::command("EVALSHA").arg("cancel:queued"), STALL);
    let first = tokio::spawn({
        let limiter = limiter.clone();
        async move { limiter.check("queued").await.unwrap().allowed() }
    });
    let deadline = Instant::now() + Duration::from_secs(3);
    while proxy.armed() > 0 {
        assert!(Instant::now() < deadline, "the fault never fired");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Queued behind the held batch, then given up.
    let gave_up = tokio::time::timeout(Duration::from_millis(50), limiter.check("queued")).await;
    assert!(gave_up.is_err(), "answered while the only batch is held");
    assert!(first.await.unwrap(), "the first check is admitted");
    free_stays(&limiter, "queued", 4, "a check dropped in the queue").await;
}

/// The concurrency limit: a check dropped after Redis took its lease gives
/// the lease back; an admitted verdict, or its permit, gives its slot back
/// when dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_concurrency_check_or_permit_holds_no_slot() {
    let (_server, proxy, store) = proxied(0).await;
    let limiter = Limiter::new(store, Policy::concurrency(2).unwrap()).with_name("cancel");
    drop(limiter.check("load-script").await.unwrap());
    proxy.stall_next_reply(Match::command("EVALSHA").arg("cancel:slots"), STALL);
    drop_once_redis_ran_it(&proxy, limiter.check("slots")).await;
    free_becomes(&limiter, "slots", 2, "a dropped concurrency check").await;

    let verdict = limiter.check("slots").await.unwrap();
    let permit = limiter
        .acquire("slots", Duration::from_secs(1))
        .await
        .unwrap();
    free_becomes(&limiter, "slots", 0, "a verdict and a permit held").await;
    drop(verdict);
    free_becomes(&limiter, "slots", 1, "a verdict dropped").await;
    drop(permit);
    free_becomes(&limiter, "slots", 2, "a permit dropped").await;
}

/// MemoryStore decides when the check starts: `check_owned` has its
/// verdict before it is polled, so dropping it unpolled still counts a
/// rate; a concurrency verdict dropped with it frees its slot at once.
#[tokio::test]
async fn memory_store_decides_at_once() {
    let limiter = Limiter::new(MemoryStore::new(), "5/h".parse::<Policy>().unwrap());
    drop(limiter.check_owned("k".to_owned()));
    assert_eq!(free(&limiter, "k").await, 4);
    // An async check not yet polled has done nothing.
    drop(limiter.check("k"));
    assert_eq!(free(&limiter, "k").await, 4);

    let slots = Limiter::new(MemoryStore::new(), Policy::concurrency(1).unwrap());
    drop(slots.check_owned("k".to_owned()));
    assert_eq!(free(&slots, "k").await, 1);
}

/// A local quota's batch taken by a check dropped before its answer: under
/// a script (here GCRA) the batch is spent, nobody holds its units; under
/// the sliding log's `Transaction` it is taken back out like any dropped
/// transaction check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_quota_batch_of_a_dropped_check() {
    let (_server, proxy, store) = proxied(0).await;
    let cases = [
        (
            "gcra",
            "100/h".parse::<Policy>().unwrap().gcra().unwrap(),
            "EVALSHA",
            90,
        ),
        (
            "log-tx",
            "100/h"
                .parse::<Policy>()
                .unwrap()
                .with_execution(Execution::Transaction)
                .unwrap(),
            "EXEC",
            100,
        ),
    ];
    for (name, policy, command, left) in cases {
        let limiter = Limiter::new(store.clone(), policy)
            .with_name("cancel")
            .with_local_quota(LocalQuota::new(10, Duration::from_secs(60)).unwrap())
            .unwrap();
        let key = format!("quota-{name}");
        load_script(&limiter).await;
        proxy.stall_next_reply(Match::command(command).arg(format!("cancel:{key}")), STALL);
        drop_once_redis_ran_it(&proxy, limiter.check(&key)).await;
        free_becomes(&limiter, &key, left, name).await;
        free_stays(&limiter, &key, left, name).await;
    }
}

/// A body that sends one frame and then never ends.
struct Endless(bool);

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.0 {
            return Poll::Pending;
        }
        self.0 = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"first")))))
    }
}

/// Through the layer: a response body dropped mid-stream gives its
/// concurrency slot back; so does a request whose client goes away while
/// the handler runs. A rate counted for that request stays counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_releases_a_slot_when_the_body_or_request_is_dropped() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let slots = Limiter::new(store.clone(), Policy::concurrency(1).unwrap()).with_name("slots");
    let streaming = Router::new()
        .route("/", get(|| async { Body::new(Endless(false)) }))
        .layer(RateLimitLayer::from_limiter(slots.clone(), key::global()));
    let response = streaming
        .oneshot(request("/", "203.0.113.9"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "first");
    free_becomes(&slots, "global", 0, "a body streaming").await;
    drop(body);
    free_becomes(&slots, "global", 1, "a body dropped mid-stream").await;

    let rate = Limiter::new(store, "5/h".parse::<Policy>().unwrap()).with_name("rate");
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let started = Arc::clone(&started);
        move || async move {
            started.notify_one();
            std::future::pending::<&'static str>().await
        }
    };
    let hanging = Router::new()
        .route("/", get(handler))
        .layer(RateLimitLayer::from_limiter(rate.clone(), key::global()))
        .layer(RateLimitLayer::from_limiter(slots.clone(), key::global()));
    let client = tokio::spawn(hanging.oneshot(request("/", "203.0.113.9")));
    // Both layers admitted it: the handler runs.
    tokio::time::timeout(Duration::from_secs(3), started.notified())
        .await
        .expect("the handler never ran");
    assert_eq!(free(&slots, "global").await, 0, "a request in its handler");
    client.abort();
    free_becomes(&slots, "global", 1, "a request whose client went away").await;
    assert_eq!(free(&rate, "global").await, 4, "the rate counted it");
}

/// Through the layer: a request whose client goes away while its check
/// waits for Redis spends what the engine's dropped check spends (here a
/// transaction: nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_drops_a_waiting_check_with_its_request() {
    let (_server, proxy, store) = proxied(0).await;
    let limiter = transaction_limiter(store);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::from_limiter(limiter.clone(), key::global()));
    proxy.stall_next_reply(Match::command("EXEC").arg("cancel:global"), STALL);
    drop_once_redis_ran_it(&proxy, app.oneshot(request("/", "203.0.113.9"))).await;
    free_becomes(&limiter, "global", 5, "a request dropped while checking").await;
    free_stays(&limiter, "global", 5, "a request dropped while checking").await;
}
