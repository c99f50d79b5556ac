//! The fixed window ([`Algorithm::FixedWindow`]) run against every store:
//! MemoryStore on a manual clock (exact values) and RedisStore's Lua script
//! against a real redis-server (real time, margins).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::contention::admitted_under_contention;
use support::harness::{Harness, MARGIN, MS, US, advance_to, align, away_from_a_boundary, micros};
use support::{RedisServer, differential};
use tower_redis_ratelimit::{Algorithm, Execution, Policy, Rate, RedisStore, Store};
use tower_redis_ratelimit::{MAX_COST, MAX_MAX, MAX_WINDOW};

fn fixed(h: &Harness, text: &str) -> Policy {
    h.policy(text).fixed_window().unwrap()
}

async fn admits_max_then_denies(h: Harness) {
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

/// `2c/200ms, 3c/1s` with cost `c`: a request denied by one rate does not
/// count in the other.
async fn several_rates(h: Harness, cost: u64) {
    let p = fixed(&h, &format!("{}/200ms, {}/1s", 2 * cost, 3 * cost))
        .with_cost(cost)
        .unwrap();
    let start = align(&h, Duration::from_secs(1)).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!((d.limit(), d.remaining()), (2 * cost, cost));
    let d = h.check("k", &p).await;
    assert_eq!((d.limit(), d.remaining()), (2 * cost, 0));
    for _ in 0..3 {
        let d = h.check("k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.limit(), 2 * cost, "denied by the short rate");
        h.assert_near(
            d.retry_after(),
            (200 * MS).saturating_sub(h.since(start)),
            "short retry_after",
        );
        let [short, long] = d.rates() else {
            panic!("two rates")
        };
        assert_eq!(short.remaining(), 0);
        assert!(!short.wait().is_zero());
        assert_eq!(long.remaining(), cost, "the denied request did not count");
        assert_eq!(long.wait(), Duration::ZERO, "the long rate admits it");
    }
    advance_to(&h, start, 200 * MS, true).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!((d.limit(), d.remaining()), (3 * cost, 0));
    assert_eq!(d.rates()[0].remaining(), cost);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), 3 * cost, "denied by the long rate");
    assert_eq!(
        d.rates()[0].remaining(),
        cost,
        "the request denied by the long rate did not count in the short one"
    );
    assert_eq!(d.rates()[0].wait(), Duration::ZERO);
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(start)),
        "long retry_after",
    );
    advance_to(&h, start, Duration::from_secs(1), true).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.rates()[1].remaining(), 2 * cost);
}

async fn multi_rate_is_all_or_nothing(h: Harness) {
    several_rates(h, 1).await;
}

async fn cost_with_several_rates(h: Harness) {
    several_rates(h, 2).await;
}

async fn cost(h: Harness) {
    let p = fixed(&h, "5/1s").with_cost(2).unwrap();
    let start = align(&h, Duration::from_secs(1)).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 3);
    assert_eq!(h.check("k", &p).await.remaining(), 1);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.remaining(), 1);
    h.assert_near(
        d.retry_after(),
        Duration::from_secs(1).saturating_sub(h.since(start)),
        "cost retry_after",
    );
    // One unit is still free for a cheaper request of the same window.
    let cheap = fixed(&h, "5/1s");
    let d = h.check("k", &cheap).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 0);
    assert!(!h.check("k", &cheap).await.allowed());
}

async fn retry_after_is_honest(h: Harness) {
    let p = fixed(&h, "2/1s");
    let start = align(&h, Duration::from_secs(1)).await;
    advance_to(&h, start, 400 * MS, false).await;
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    let denied = h.check("k", &p).await;
    assert!(!denied.allowed());
    let wait = denied.retry_after();
    h.assert_near(wait, 600 * MS, "retry_after");
    if let Harness::Memory { .. } = h {
        // Exact: one microsecond early is still too early.
        h.advance(wait - US).await;
        let d = h.check("k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.retry_after(), US);
        h.advance(US).await;
    } else {
        h.advance(wait).await;
    }
    assert!(
        h.check("k", &p).await.allowed(),
        "waiting retry_after must be enough"
    );
}

async fn keys_are_independent(h: Harness) {
    let p = fixed(&h, "1/1s");
    align(&h, Duration::from_secs(1)).await;
    assert!(h.check("a", &p).await.allowed());
    assert!(!h.check("a", &p).await.allowed());
    assert!(h.check("b", &p).await.allowed());
    assert!(h.check("a b {c}", &p).await.allowed());
    assert!(!h.check("a b {c}", &p).await.allowed());
}

/// The largest max, cost and window: no overflow, exact counts.
async fn huge_limits(h: Harness) {
    let rate = Rate::new(MAX_MAX, MAX_WINDOW).unwrap();
    let p = Policy::new([Rate::new(MAX_COST, 1000 * MS).unwrap(), rate])
        .unwrap()
        .with_execution(Execution::Script)
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

support::suite! {
    cases: [
        admits_max_then_denies,
        admitted_again_at_the_window_boundary,
        bursts_twice_max_across_an_edge,
        multi_rate_is_all_or_nothing,
        cost_with_several_rates,
        cost,
        retry_after_is_honest,
        keys_are_independent,
        huge_limits,
    ],
    memory: Harness::memory(),
    redis: Harness::redis(Execution::Script).await,
    manager: Harness::redis_manager(Execution::Script).await,
    #[cfg(feature = "cluster")]
    cluster: Harness::redis_cluster(Execution::Script).await,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admits_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy: Policy = "100/60s".parse::<Policy>().unwrap().fixed_window().unwrap();
    // A burst that straddled a minute boundary would rightly get 2× max.
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    assert_eq!(admitted, 100);
    let stored = server.command(&["HGET", "rl:fixed:{hot}", "60000000"]);
    assert!(stored.trim().ends_with(":100"), "{stored:?}");
}

#[tokio::test]
async fn the_key_expires_when_the_longest_window_ends() {
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
    let key = "rl:fixed:{k}";
    let pttl: u64 = server
        .command(&["PTTL", key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    // Until the end of the 1 s window, not of the 200 ms one.
    assert!(
        pttl > 200 && Duration::from_millis(pttl) <= left + 2 * MS,
        "PTTL {pttl} ms, window ends in {left:?}"
    );
    // A denied request writes nothing, nor does it move the expiry.
    assert!(store.check("k", &p).await.unwrap().allowed());
    assert!(!store.check("k", &p).await.unwrap().allowed());
    tokio::time::sleep(left + MARGIN).await;
    assert_eq!(server.command(&["EXISTS", key]).trim(), ":0");
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
