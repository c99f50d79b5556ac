//! The fixed window (`Algorithm::FixedWindow`) run against every store:
//! MemoryStore on a manual clock (exact values) and RedisStore's Lua script
//! against a real redis-server (real time, margins). Only what is its own:
//! wall-clock windows, 2× max across an edge, huge limits, its Redis key.
//! What every algorithm does is in conformance.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::contention::admitted_under_contention;
use crate::support::harness::{
    Harness, MARGIN, MS, US, advance_to, align, away_from_a_boundary, micros,
};
use crate::support::{RedisServer, differential};
use tower_redis_ratelimit::policy::{MAX_COST, MAX_MAX, MAX_WINDOW};
use tower_redis_ratelimit::{Algorithm, Policy, Rate, RedisStore, Store};

fn fixed(h: &Harness, text: &str) -> Policy {
    h.policy_of(text, Algorithm::FixedWindow)
}

/// `reset` and `retry_after` are the end of the window, whenever in it a
/// request comes; the next window starts from zero.
async fn reset_and_retry_after_are_the_window_end(h: Harness) {
    let p = fixed(&h, "3/1s");
    let start = align(&h, Duration::from_secs(1)).await;
    for remaining in [2, 1, 0] {
        let d = h.check("k", &p).await;
        assert!(d.allowed());
        assert_eq!(d.algorithm(), Algorithm::FixedWindow);
        assert_eq!((d.limit(), d.remaining()), (3, remaining));
        // Full again when the window ends.
        h.assert_near(
            d.reset(),
            Duration::from_secs(1).saturating_sub(h.since(start)),
            "reset",
        );
        assert_eq!(d.retry_after(), Duration::ZERO);
    }
    h.advance(300 * MS).await;
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!((d.limit(), d.remaining()), (3, 0));
    let left = Duration::from_secs(1).saturating_sub(h.since(start));
    h.assert_near(d.retry_after(), left, "retry_after");
    h.assert_near(d.reset(), left, "reset");
    if let Harness::Memory { .. } = h {
        assert_eq!(d.retry_after(), 700 * MS);
    }
    // Denied requests do not count: still denied, still remaining 0, and
    // the next window starts from zero.
    assert!(!h.check("k", &p).await.allowed());
    advance_to(&h, start, Duration::from_secs(1), true).await;
    assert_eq!(h.check("k", &p).await.remaining(), 2);
}

async fn admitted_again_at_the_window_boundary(h: Harness) {
    let p = fixed(&h, "3/1s");
    let start = align(&h, Duration::from_secs(1)).await;
    for _ in 0..3 {
        assert!(h.check("k", &p).await.allowed());
    }
    if let Harness::Memory { .. } = h {
        // The last microsecond of the window is still in it.
        advance_to(&h, start, Duration::from_secs(1) - US, false).await;
        let d = h.check("k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.retry_after(), US);
        assert_eq!(d.reset(), US);
    } else {
        advance_to(&h, start, 900 * MS, false).await;
        assert!(!h.check("k", &p).await.allowed());
    }
    advance_to(&h, start, Duration::from_secs(1), true).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed(), "a new window starts from zero");
    assert_eq!(d.remaining(), 2);
    h.assert_near(
        d.reset(),
        Duration::from_secs(2).saturating_sub(h.since(start)),
        "reset in the new window",
    );
}

/// The documented weakness: `max` at the very end of one window and `max`
/// at the very start of the next are all admitted, 2× max in far less than
/// one window.
async fn bursts_twice_max_across_an_edge(h: Harness) {
    let p = fixed(&h, "3/1s");
    let start = align(&h, Duration::from_secs(1)).await;
    let end_of_window = match h {
        Harness::Memory { .. } => Duration::from_secs(1) - US,
        Harness::Redis { .. } => 900 * MS,
    };
    advance_to(&h, start, end_of_window, false).await;
    let first = h.mark();
    let mut admitted = 0;
    for _ in 0..4 {
        admitted += usize::from(h.check("k", &p).await.allowed());
    }
    assert_eq!(admitted, 3, "max at the end of the first window");
    advance_to(&h, start, Duration::from_secs(1), true).await;
    for _ in 0..4 {
        admitted += usize::from(h.check("k", &p).await.allowed());
    }
    let span = h.since(first);
    assert_eq!(admitted, 6, "and max again at the start of the next");
    assert!(span < Duration::from_secs(1), "{span:?}");
    if let Harness::Memory { .. } = h {
        assert_eq!(span, US, "2× max within two microseconds");
    }
}

/// The largest max, cost and window: no overflow, exact counts.
async fn huge_limits(h: Harness) {
    let rate = Rate::new(MAX_MAX, MAX_WINDOW).unwrap();
    let p = Policy::new([Rate::new(MAX_COST, 1000 * MS).unwrap(), rate])
        .unwrap()
        .fixed_window()
        .unwrap()
        .with_cost(MAX_COST)
        .unwrap();
    align(&h, Duration::from_secs(1)).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.rates()[1].remaining(), MAX_MAX - MAX_COST);
    assert!(d.rates()[1].reset() <= MAX_WINDOW);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.rates()[0].remaining(), 0);
    assert_eq!(d.rates()[1].remaining(), MAX_MAX - MAX_COST);
    assert_eq!(d.rates()[1].wait(), Duration::ZERO);
}

support::every_store!([
    reset_and_retry_after_are_the_window_end,
    admitted_again_at_the_window_boundary,
    bursts_twice_max_across_an_edge,
    huge_limits,
]);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admits_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy: Policy = "100/60s".parse::<Policy>().unwrap().fixed_window().unwrap();
    // A burst that straddled a minute boundary would rightly get 2× max.
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    assert_eq!(admitted, 100);
    // One integer a window: `{name}:{window µs}:{window index}`.
    let keys = server.keys("rl:fixed:{hot}:60000000:*");
    let [key] = keys.as_slice() else {
        panic!("{keys:?}")
    };
    assert_eq!(server.command(&["GET", key]).lines().nth(1), Some("100"));
}

#[tokio::test]
async fn each_count_expires_when_its_window_ends() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let p: Policy = "2/200ms, 5/1s"
        .parse::<Policy>()
        .unwrap()
        .fixed_window()
        .unwrap();
    away_from_a_boundary(Duration::from_secs(1), 300 * MS).await;
    let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
    let left = Duration::from_micros(1_000_000 - now % 1_000_000);
    assert!(store.check("k", &p).await.unwrap().allowed());
    let pttl = |key: &str| -> u64 {
        server
            .command(&["PTTL", key])
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap()
    };
    let second = format!("rl:fixed:{{k}}:1000000:{}", now / 1_000_000);
    let short = server.keys("rl:fixed:{k}:200000:*");
    // Each count until the end of its own window.
    assert!(
        Duration::from_millis(pttl(&second)) <= left + 2 * MS && pttl(&second) > 200,
        "PTTL {} ms, window ends in {left:?}",
        pttl(&second)
    );
    assert!(pttl(&short[0]) <= 200, "{short:?}");
    // A denied request writes nothing, nor does it move the expiry.
    assert!(store.check("k", &p).await.unwrap().allowed());
    let before = server.command(&["GET", &second]);
    assert!(!store.check("k", &p).await.unwrap().allowed());
    assert_eq!(server.command(&["GET", &second]), before);
    assert!(Duration::from_millis(pttl(&second)) <= left + 2 * MS);
    tokio::time::sleep(left + MARGIN).await;
    assert_eq!(server.command(&["EXISTS", &second]).trim(), ":0");
}

#[tokio::test]
async fn the_script_is_loaded_again_after_a_flush() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let p: Policy = "100/1s".parse::<Policy>().unwrap().fixed_window().unwrap();
    assert!(store.check("k", &p).await.unwrap().allowed());
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    assert!(store.check("k", &p).await.unwrap().allowed());
}

/// The script, with Redis's `TIME` replaced by a time the test sets, against
/// the memory store on a manual clock at the same microsecond: the same
/// decisions and the same values, on random policies, costs and times that
/// often land on window edges and one microsecond before them.
#[tokio::test]
async fn the_script_matches_the_memory_store_to_the_microsecond() {
    let server = RedisServer::start();
    let setup = differential::Setup {
        commands: false,
        ..differential::Setup::new(Algorithm::FixedWindow, 0x2545_f491_4f6c_dd1d)
    };
    let mismatches = differential::run(&server, setup).await;
    assert_eq!(mismatches, 0);
}
