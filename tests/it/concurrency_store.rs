//! The concurrency limit on every store: MemoryStore on a manual clock
//! (exact values) and RedisStore's Lua script against a real redis-server
//! (real time, margins), plus Redis-only checks that no more than `max`
//! requests are ever in flight across independent stores. What it shares
//! with every algorithm (max admitted, denials that take nothing, an honest
//! `retry_after`, separate keys) is in conformance.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::contention::{admitted_under_contention, two_stores};
use crate::support::harness::{Harness, MS};
use crate::support::{RedisServer, zcard};
use tokio::sync::Barrier;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore, Store};

/// Every admitted request holds its own lease; `reset` is zero (a slot
/// frees when a request ends, which no clock says) and the wait of a denied
/// request is the soonest lease expiry, at most 1 s.
async fn leases_are_distinct_and_the_wait_is_capped(h: Harness) {
    let p = Policy::concurrency(3).unwrap();
    let mut leases = HashSet::new();
    for _ in 0..3 {
        let d = h.check("k", &p).await;
        assert!(d.allowed());
        assert_eq!(d.algorithm(), Algorithm::Concurrency);
        assert_eq!(d.reset(), Duration::ZERO);
        leases.insert(d.lease().expect("an admitted request holds a lease"));
    }
    assert_eq!(leases.len(), 3, "every lease is distinct");
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    // The soonest lease expires in about 60 s: the wait is capped at 1 s.
    assert_eq!(d.retry_after(), Duration::from_secs(1));
}

/// Giving a lease back lets the next request in; giving it back twice, or
/// giving back an unknown lease, frees nothing more.
async fn release_lets_the_next_in(h: Harness) {
    let p = Policy::concurrency(2).unwrap();
    let first = h.check("k", &p).await.lease().unwrap();
    let second = h.check("k", &p).await.lease().unwrap();
    assert!(!h.check("k", &p).await.allowed());
    h.release("k", &p, first).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed(), "the released slot is free again");
    assert_eq!(d.remaining(), 0);
    h.release("k", &p, first).await;
    assert!(
        !h.check("k", &p).await.allowed(),
        "a second release frees nothing"
    );
    h.release("k", &p, second).await;
    h.release("k", &p, d.lease().unwrap()).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 1, "every lease was given back");
}

/// A lease that is never given back (a crashed process) frees its slot once
/// the lease time has passed.
async fn lease_expires_without_release(h: Harness) {
    let p = Policy::concurrency(2)
        .unwrap()
        .with_lease(300 * MS)
        .unwrap();
    let t0 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    h.assert_near(
        d.retry_after(),
        (300 * MS).saturating_sub(h.since(t0)),
        "retry_after: the soonest expiry",
    );
    if let Harness::Memory { .. } = h {
        h.advance(299 * MS).await;
        assert!(!h.check("k", &p).await.allowed(), "not expired yet");
        h.advance(MS).await;
    } else {
        h.advance_past(300 * MS).await;
    }
    let d = h.check("k", &p).await;
    assert!(d.allowed(), "expired leases free their slots");
    assert_eq!(d.remaining(), 1, "both old leases expired");
}

support::every_store!([
    leases_are_distinct_and_the_wait_is_capped,
    release_lets_the_next_in,
    lease_expires_without_release,
]);

/// 500 simultaneous checks through two independent stores, nothing
/// released: exactly `max` get a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_grants_exactly_max_leases_under_contention() {
    let server = RedisServer::start();
    let policy = Policy::concurrency(10).unwrap();
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    assert_eq!(admitted, 10);
    assert_eq!(zcard(&server, "rl:conc:{hot}"), 10);
}

/// 500 tasks through two independent stores each take a lease (retrying
/// until they get one), hold it a few milliseconds and give it back. The
/// number in flight, counted on this side, never exceeds `max`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_never_has_more_than_max_in_flight() {
    const MAX: usize = 10;
    const TASKS: usize = 500;
    let server = RedisServer::start();
    let stores = two_stores(&server).await;
    let policy = Arc::new(Policy::concurrency(MAX as u64).unwrap());
    let in_flight = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let denials = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(TASKS));
    let deadline = Instant::now() + Duration::from_secs(60);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(TASKS);
    for i in 0..TASKS {
        let store = stores[i % 2].clone();
        let policy = Arc::clone(&policy);
        let barrier = Arc::clone(&barrier);
        let in_flight = Arc::clone(&in_flight);
        let peak = Arc::clone(&peak);
        let denials = Arc::clone(&denials);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            loop {
                let d = store.check("hot", &policy).await.unwrap();
                if let Some(lease) = d.lease() {
                    assert!(d.allowed());
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(3 + (i % 5) as u64)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    store.release("hot", &policy, lease).await.unwrap();
                    return true;
                }
                assert!(!d.allowed());
                assert_eq!(d.remaining(), 0);
                assert!(d.retry_after() <= Duration::from_secs(1));
                denials.fetch_add(1, Ordering::Relaxed);
                if Instant::now() > deadline {
                    return false;
                }
                // Slots free far sooner than the 1 s retry_after suggests.
                tokio::time::sleep(Duration::from_millis(1 + (i % 3) as u64)).await;
            }
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    let peak = peak.load(Ordering::SeqCst);
    eprintln!(
        "concurrency {MAX}: {admitted} of {TASKS} tasks got a lease in {:?}, \
         peak in flight {peak}, {} denied attempts",
        started.elapsed(),
        denials.load(Ordering::Relaxed)
    );
    assert!(peak <= MAX, "peak in flight {peak} above {MAX}");
    assert!(peak >= 2, "the test never had two requests in flight");
    assert_eq!(admitted, TASKS, "every task got a lease in the end");
    assert_eq!(in_flight.load(Ordering::SeqCst), 0);
    assert_eq!(
        zcard(&server, "rl:conc:{hot}"),
        0,
        "every lease was given back"
    );
}

/// The sorted set holds one member per lease (32 hex digits) scored by its
/// expiry, and the key expires with its last lease.
#[tokio::test]
async fn redis_key_holds_leases_and_expires() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = Policy::concurrency(3)
        .unwrap()
        .with_lease(200 * MS)
        .unwrap();
    let d = store.check("k", &policy).await.unwrap();
    let lease = d.lease().unwrap();
    let key = store.redis_key("conc", "k");
    assert_eq!(key, "rl:conc:{k}");
    let member = format!("{:032x}", lease.id());
    let score = server.command(&["ZSCORE", &key, &member]);
    let score: f64 = score.lines().nth(1).unwrap().parse().unwrap();
    assert!(score > 1.0e15, "an expiry in µs since the epoch: {score}");
    let pttl: i64 = server
        .command(&["PTTL", &key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    assert!(pttl > 0 && pttl <= 200, "PTTL {pttl}");
    store.release("k", &policy, lease).await.unwrap();
    assert_eq!(zcard(&server, &key), 0);
    assert!(store.check("k", &policy).await.unwrap().allowed());
    tokio::time::sleep(250 * MS).await;
    assert!(server.command(&["EXISTS", &key]).starts_with(":0"));
    // A flushed script cache (a Redis restart, a failover) is reloaded.
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    assert!(store.check("k", &policy).await.unwrap().allowed());
}

/// A check that times out while Redis is hung leaves no lease behind when
/// Redis wakes up and runs it: nobody would ever release it.
#[tokio::test]
async fn a_timed_out_check_leaves_no_lease() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    let policy = Policy::concurrency(2).unwrap();
    // Load the script first, so the hung call is the EVALSHA itself.
    let first = store.check("k", &policy).await.unwrap();
    store
        .release("k", &policy, first.lease().unwrap())
        .await
        .unwrap();
    server.signal("STOP");
    assert!(store.check("k", &policy).await.is_err());
    server.signal("CONT");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(zcard(&server, "rl:conc:{k}"), 0);
}
