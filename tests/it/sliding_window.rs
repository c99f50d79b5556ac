//! The sliding window counter (`Algorithm::SlidingWindow`) run against
//! every store: MemoryStore on a manual clock (exact values) and RedisStore's
//! Lua script against a real redis-server (real time, margins); and its
//! documented error bound, measured on the manual clock. Only what is its
//! own: the previous window's weight, huge limits, the error bound, its
//! Redis key. What every algorithm does is in conformance.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::contention::admitted_under_contention;
use crate::support::harness::{
    Harness, MARGIN, MS, US, advance_to, align, away_from_a_boundary, micros,
};
use crate::support::rng::Rng;
use crate::support::{RedisServer, differential};
use tower_redis_ratelimit::policy::{MAX_COST, MAX_MAX, MAX_WINDOW};
use tower_redis_ratelimit::{Algorithm, Policy, Rate, RedisStore, Store};

fn sliding(h: &Harness, text: &str) -> Policy {
    h.policy_of(text, Algorithm::SlidingWindow)
}

/// At a window edge the previous window still weighs: `3/1s` filled at the
/// start of one window admits again a third into the next, not at its start.
async fn the_previous_window_weighs_across_the_edge(h: Harness) {
    let p = sliding(&h, "3/1s");
    let start = align(&h, Duration::from_secs(1)).await;
    for _ in 0..3 {
        assert!(h.check("k", &p).await.allowed());
    }
    advance_to(&h, start, Duration::from_secs(1), true).await;
    let d = h.check("k", &p).await;
    assert!(!d.allowed(), "a fixed window would admit here");
    h.assert_near(
        d.retry_after(),
        Duration::from_micros(1_333_334).saturating_sub(h.since(start)),
        "retry_after",
    );
    h.assert_near(
        d.reset(),
        Duration::from_secs(1).saturating_sub(h.since(start) - Duration::from_secs(1)),
        "reset: when the previous window has slid out",
    );
    if let Harness::Memory { .. } = h {
        assert_eq!(d.retry_after(), Duration::from_micros(333_334));
        advance_to(&h, start, Duration::from_micros(1_333_333), false).await;
        let d = h.check("k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.retry_after(), US);
    }
    advance_to(&h, start, Duration::from_micros(1_333_334), true).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    // 3 × (1 − 1/3) = 2 still weigh, and this one.
    assert_eq!(d.remaining(), 0);
    h.assert_near(
        d.reset(),
        Duration::from_secs(3).saturating_sub(h.since(start)),
        "reset",
    );
    // Two thirds in, one more fits.
    advance_to(&h, start, Duration::from_micros(1_666_667), true).await;
    assert!(h.check("k", &p).await.allowed());
    assert!(!h.check("k", &p).await.allowed());
}

/// The cost weighs in the wait: `5/1s` holding 4 (two of cost 2) admits
/// another 2 in the next window once a quarter of them slid out:
/// 4 × (1 − e) + 2 ≤ 5.
async fn the_cost_weighs_in_the_wait(h: Harness) {
    let p = sliding(&h, "5/1s").with_cost(2).unwrap();
    let start = align(&h, Duration::from_secs(1)).await;
    assert!(h.check("k", &p).await.allowed());
    assert!(h.check("k", &p).await.allowed());
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    h.assert_near(
        d.retry_after(),
        Duration::from_millis(1250).saturating_sub(h.since(start)),
        "retry_after of cost 2",
    );
}

/// The largest max, cost and window, and a short window whose weighted
/// products are far beyond 2^53: no overflow, sensible values.
async fn huge_limits(h: Harness) {
    let p = Policy::new([
        Rate::new(MAX_MAX, 200 * MS).unwrap(),
        Rate::new(MAX_COST, Duration::from_secs(1)).unwrap(),
        Rate::new(MAX_MAX, MAX_WINDOW).unwrap(),
    ])
    .unwrap()
    .sliding_window()
    .unwrap()
    .with_cost(MAX_COST)
    .unwrap();
    let start = align(&h, Duration::from_secs(1)).await;
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.rates()[0].remaining(), MAX_MAX - MAX_COST);
    assert_eq!(d.rates()[2].remaining(), MAX_MAX - MAX_COST);
    assert!(d.rates()[2].reset() <= 2 * MAX_WINDOW);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!(d.limit(), MAX_COST);
    assert_eq!(d.rates()[0].remaining(), MAX_MAX - MAX_COST);
    assert_eq!(d.rates()[0].wait(), Duration::ZERO);
    assert_eq!(d.rates()[2].remaining(), MAX_MAX - MAX_COST);
    // In the next 200 ms window the previous MAX_COST still weigh (all of
    // them at its start): remaining is max − MAX_COST × (w − e) / w.
    advance_to(&h, start, 200 * MS, true).await;
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    let remaining = d.rates()[0].remaining();
    assert!(
        (MAX_MAX - MAX_COST..MAX_MAX).contains(&remaining),
        "{remaining}"
    );
    if let Harness::Memory { .. } = h {
        assert_eq!(remaining, MAX_MAX - MAX_COST);
    }
}

support::every_store!([
    the_previous_window_weighs_across_the_edge,
    the_cost_weighs_in_the_wait,
    huge_limits,
]);

// ---------------------------------------------------------------------------
// The error bound, measured on the manual clock.

/// What a traffic pattern got through one `max/window` limit.
struct Run {
    max: u64,
    window: u64,
    /// Admitted requests, µs since the first window's start.
    admitted: Vec<u64>,
}

/// Offer one request at each of `offsets` (µs since the start of a window,
/// ascending) to a `max/window` sliding window counter on a manual clock.
async fn run(max: u64, window: Duration, offsets: impl IntoIterator<Item = u64>) -> Run {
    let h = Harness::memory();
    let p = sliding(&h, &format!("{max}/{}ms", window.as_millis()));
    let start = align(&h, window).await;
    let mut admitted = Vec::new();
    for offset in offsets {
        advance_to(&h, start, Duration::from_micros(offset), false).await;
        if h.check("k", &p).await.allowed() {
            admitted.push(offset);
        }
    }
    Run {
        max,
        window: micros(window),
        admitted,
    }
}

/// The worst rolling window of a run.
#[derive(Debug)]
struct Worst {
    /// The most requests admitted in any rolling window `[s, s + window)`.
    count: u64,
    /// Where that rolling window starts, µs since the first window's start.
    start: u64,
    /// The most admitted above `max` in a rolling window, as a fraction of
    /// `max`.
    excess: f64,
}

impl Run {
    /// Check every rolling window of the run against the documented bound
    /// and return the worst one among those starting at `from` µs or later.
    ///
    /// A rolling window `[s, s + w)` with `s` at `e` µs into fixed window
    /// `i` ends at `e` µs into window `i + 1`; the algorithm admits at most
    /// `max + previous × e / w` in it, where `previous` is what window `i`
    /// admitted. The count of a rolling window only changes where an
    /// admitted request enters or leaves it, so stepping `s` through every
    /// admitted request's time (and one µs after it) visits every count.
    fn check_bound(&self, from: u64) -> Worst {
        let (max, w) = (self.max, self.window);
        let in_window = |i: u64| self.admitted.iter().filter(|&&t| t / w == i).count() as u64;
        let mut worst = Worst {
            count: 0,
            start: 0,
            excess: -1.0,
        };
        let starts = self.admitted.iter().flat_map(|&t| [t, t + 1]);
        for s in starts {
            let count = self
                .admitted
                .iter()
                .filter(|&&t| t >= s && t < s + w)
                .count() as u64;
            let (i, e) = (s / w, s % w);
            let previous = in_window(i);
            assert!(
                u128::from(count) * u128::from(w)
                    <= u128::from(max) * u128::from(w) + u128::from(previous) * u128::from(e),
                "[{s}, {}) admitted {count}: above max {max} + previous {previous} × {e}/{w}",
                s + w
            );
            assert!(count < 2 * max, "{count} in [{s}, {})", s + w);
            if s >= from && count > worst.count {
                worst = Worst {
                    count,
                    start: s,
                    excess: (count as f64 - max as f64) / max as f64,
                };
            }
        }
        worst
    }
}

/// The worst case of the documentation: the previous window's traffic all
/// in its very last microsecond, then a client asking as fast as it can.
#[tokio::test]
async fn error_bound_with_the_previous_window_all_at_its_end() {
    let (max, w) = (100, Duration::from_secs(1));
    let wu = micros(w);
    // max + 1 requests in the last µs of window 0, then one every 100 µs
    // through windows 1 to 3.
    let burst = std::iter::repeat_n(wu - 1, 101);
    let hammer = (wu..4 * wu).step_by(100);
    let run = run(max, w, burst.chain(hammer)).await;
    assert_eq!(
        run.admitted.iter().filter(|&&t| t == wu - 1).count(),
        100,
        "the burst fills window 0"
    );
    let worst = run.check_bound(0);
    eprintln!(
        "previous window at its end, {max}/1s hammered every 100 µs: worst rolling window \
         [{} µs, +1 s) admitted {} ({:+.1}% over max); {} admitted in 4 windows",
        worst.start,
        worst.count,
        100.0 * worst.excess,
        run.admitted.len()
    );
    // max at the end of window 0, then window 1 admits up to
    // max × e / w by e µs in: 100 + 99 in [w − 1 µs, 2w − 1 µs).
    assert_eq!(worst.count, 2 * max - 1);
    assert_eq!(worst.start, wu - 1);
}

/// Bursts of max at the very end of every other window.
#[tokio::test]
async fn error_bound_with_bursts_at_window_ends() {
    let (max, w) = (50, Duration::from_millis(100));
    let wu = micros(w);
    let mut offsets = Vec::new();
    for i in 0..20 {
        // A burst at the end of window i, a stream through window i + 1.
        let end = (2 * i + 1) * wu - 1;
        offsets.extend(std::iter::repeat_n(end, max as usize + 1));
        offsets.extend((end + 1..end + 1 + wu).step_by(37));
    }
    let run = run(max, w, offsets).await;
    let worst = run.check_bound(0);
    eprintln!(
        "bursts of {max} at every other window end, then a stream: worst rolling window \
         admitted {} ({:+.1}% over max)",
        worst.count,
        100.0 * worst.excess
    );
    assert_eq!(worst.count, 2 * max - 1);
}

/// Traffic spread evenly at `factor_percent` % of the limit's rate over 10
/// windows: the worst rolling window overall, the worst from the third
/// window on (once the first window's start-up burst has slid out), and how
/// many were admitted of how many offered.
async fn evenly_spread(factor_percent: u64) -> (Worst, Worst, usize, usize) {
    let (max, w) = (100, Duration::from_secs(1));
    let wu = micros(w);
    // One request every w / (max × factor), starting at an arbitrary point
    // of a window.
    let gap = wu * 100 / (max * factor_percent);
    let offsets: Vec<u64> = (0..)
        .map(|j| 123_457 + j * gap)
        .take_while(|&t| t < 10 * wu)
        .collect();
    let offered = offsets.len();
    let run = run(max, w, offsets).await;
    (
        run.check_bound(0),
        run.check_bound(2 * wu),
        run.admitted.len(),
        offered,
    )
}

#[tokio::test]
async fn error_bound_with_evenly_spread_traffic() {
    for factor in [50, 100, 101, 150, 200, 1000] {
        let (worst, steady, admitted, offered) = evenly_spread(factor).await;
        eprintln!(
            "even traffic at {factor}% of 100/1s: worst rolling window admitted {} \
             ({:+.1}% over max), {} once steady ({:+.1}%); {admitted} of {offered} admitted",
            worst.count,
            100.0 * worst.excess,
            steady.count,
            100.0 * steady.excess,
        );
        if factor <= 100 {
            // Admitted traffic that is itself evenly spread: never above max.
            assert!(worst.count <= 100, "{factor}%: {worst:?}");
        } else {
            // Overload makes the admitted traffic uneven; the first window
            // admits max at once, 123 ms in, and the next window still
            // admits its share of 100 × 0.123 in the rolling window.
            assert!(worst.count <= 113, "{factor}%: {worst:?}");
            assert!(steady.count <= 100, "{factor}%: {steady:?}");
        }
    }
}

/// Bursty pseudo-random traffic: the bound holds for every rolling window.
#[tokio::test]
async fn error_bound_with_random_traffic() {
    let (max, w) = (20, Duration::from_millis(100));
    let wu = micros(w);
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut t = 0;
    let mut offsets = Vec::new();
    while t < 200 * wu {
        // Quiet spells and bursts.
        t += match rng.next() % 10 {
            0 => rng.next() % wu,
            1..=3 => 0,
            _ => rng.next() % (wu / 50),
        };
        offsets.push(t);
    }
    let run = run(max, w, offsets).await;
    let worst = run.check_bound(0);
    eprintln!(
        "random bursty traffic on {max}/100ms: worst rolling window admitted {} ({:+.1}% over \
         max); {} admitted",
        worst.count,
        100.0 * worst.excess,
        run.admitted.len()
    );
}

// ---------------------------------------------------------------------------
// Redis only.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn never_admits_more_than_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy: Policy = "100/60s"
        .parse::<Policy>()
        .unwrap()
        .sliding_window()
        .unwrap();
    // Across a window edge the previous window's weight slides out and one
    // or two more may rightly be admitted: keep the burst inside a window.
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    eprintln!("sliding window counter admitted {admitted} of 500 (limit 100)");
    assert!(admitted <= 100, "admitted {admitted}");
    // With no previous window the counter is exact.
    assert_eq!(admitted, 100);
    // One integer a window: `{name}:{window µs}:{window index}`.
    let keys = server.keys("rl:swc:{hot}:60000000:*");
    let [key] = keys.as_slice() else {
        panic!("{keys:?}")
    };
    assert_eq!(server.command(&["GET", key]).lines().nth(1), Some("100"));
}

#[tokio::test]
async fn a_count_expires_when_both_windows_slid_out() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let p: Policy = "2/100ms, 5/500ms"
        .parse::<Policy>()
        .unwrap()
        .sliding_window()
        .unwrap();
    away_from_a_boundary(500 * MS, 200 * MS).await;
    let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
    let left = Duration::from_micros(500_000 - now % 500_000);
    assert!(store.check("k", &p).await.unwrap().allowed());
    // The 500 ms window's count: `{name}:{window µs}:{window index}`.
    let key = &format!("rl:swc:{{k}}:500000:{}", now / 500_000);
    let pttl: u64 = server
        .command(&["PTTL", key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    // Until the end of the 500 ms window after this one.
    assert!(
        Duration::from_millis(pttl) > left + 400 * MS
            && Duration::from_millis(pttl) <= left + 502 * MS,
        "PTTL {pttl} ms, window ends in {left:?}"
    );
    tokio::time::sleep(left + 300 * MS).await;
    assert_eq!(
        server.command(&["EXISTS", key]).trim(),
        ":1",
        "still weighs"
    );
    tokio::time::sleep(200 * MS + MARGIN).await;
    assert_eq!(server.command(&["EXISTS", key]).trim(), ":0");
}

#[tokio::test]
async fn the_script_is_loaded_again_after_a_flush() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let p: Policy = "100/1s"
        .parse::<Policy>()
        .unwrap()
        .sliding_window()
        .unwrap();
    assert!(store.check("k", &p).await.unwrap().allowed());
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    assert!(store.check("k", &p).await.unwrap().allowed());
}

/// The script, with Redis's `TIME` replaced by a time the test sets, against
/// the memory store on a manual clock at the same microsecond: the same
/// decisions and the same values while `max × window ≤ 2^53` (where Redis's
/// doubles are exact), on random policies, costs and times that often land
/// on window edges and one microsecond before them.
#[tokio::test]
async fn the_script_matches_the_memory_store_to_the_microsecond() {
    let server = RedisServer::start();
    let setup = differential::Setup {
        limit: 1 << 53,
        commands: false,
        ..differential::Setup::new(Algorithm::SlidingWindow, 0x2545_f491_4f6c_dd1d)
    };
    let mismatches = differential::run(&server, setup).await;
    assert_eq!(mismatches, 0);
}

/// Beyond `max × window = 2^53` Redis's doubles round the weighted products
/// (for example `10^7/day`): measure how often that changes anything on
/// random times.
#[tokio::test]
async fn the_script_stays_close_to_the_memory_store_beyond_2_pow_53() {
    let server = RedisServer::start();
    let setup = differential::Setup {
        limit: u128::MAX,
        commands: false,
        ..differential::Setup::new(Algorithm::SlidingWindow, 0x2545_f491_4f6c_dd1d)
    };
    let mismatches = differential::run(&server, setup).await;
    eprintln!("{mismatches} checks differ with products beyond 2^53");
    // Only a check on the very microsecond of a boundary can differ; the
    // counts of a test are far too small to put one there often.
    assert!(mismatches <= 10, "{mismatches}");
}
