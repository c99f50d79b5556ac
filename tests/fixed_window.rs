//! The fixed window ([`Algorithm::FixedWindow`]) run against every store:
//! MemoryStore on a manual clock (exact values) and RedisStore's Lua script
//! against a real redis-server (real time, margins).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::RedisServer;
use support::harness::{Harness, MS, Mark};
use tokio::sync::Barrier;
use tower_redis_ratelimit::policy::{MAX_COST, MAX_MAX, MAX_WINDOW};
use tower_redis_ratelimit::{
    Algorithm, Clock, Execution, Policy, PolicyError, Rate, RedisStore, Store,
};

const US: Duration = Duration::from_micros(1);

/// How far past a window boundary the Redis harness lands, so the boundary
/// is behind us on Redis's clock too.
const MARGIN: Duration = Duration::from_millis(20);

/// Move to the start of the next window of `window` (wall-clock windows:
/// multiples of `window` since the epoch) and return a mark at that start.
/// Exact on the manual clock; on real time, a little past it.
async fn align(h: &Harness, window: Duration) -> Mark {
    match h {
        Harness::Memory { clock, .. } => {
            let rem = micros(clock.now()) % micros(window);
            if rem != 0 {
                clock.advance(Duration::from_micros(micros(window) - rem));
            }
            Mark::Clock(clock.now())
        }
        Harness::Redis { .. } => {
            let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
            let w = micros(window);
            let boundary = (now / w + 1) * w;
            tokio::time::sleep(Duration::from_micros(boundary - now) + MARGIN).await;
            let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
            Mark::Real(Instant::now() - Duration::from_micros(now - boundary))
        }
    }
}

/// Let time pass until `offset` after `mark` (on real time, plus a margin
/// when `past` is set, so that instant is behind us on Redis's clock too).
async fn advance_to(h: &Harness, mark: Mark, offset: Duration, past: bool) {
    let target = match h {
        Harness::Redis { .. } if past => offset + MARGIN,
        _ => offset,
    };
    let elapsed = h.since(mark);
    assert!(
        elapsed <= target,
        "already {elapsed:?} past the mark, wanted {target:?}: the machine is too slow"
    );
    h.advance(target - elapsed).await;
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap()
}

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

macro_rules! suite {
    ($backend:ident, $make:expr) => {
        mod $backend {
            use super::*;

            suite!(@cases $make;
                admits_max_then_denies,
                admitted_again_at_the_window_boundary,
                bursts_twice_max_across_an_edge,
                multi_rate_is_all_or_nothing,
                cost_with_several_rates,
                cost,
                retry_after_is_honest,
                keys_are_independent,
                huge_limits,
            );
        }
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                super::$case($make).await;
            }
        )*
    };
}

suite!(memory, Harness::memory());
suite!(redis, Harness::redis(Execution::Script).await);

/// Wait until at least `room` is left before the next boundary of `window`.
async fn away_from_a_boundary(window: Duration, room: Duration) {
    let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
    let w = micros(window);
    let left = w - now % w;
    if left < micros(room) {
        tokio::time::sleep(Duration::from_micros(left) + MARGIN).await;
    }
}

async fn admitted_under_contention(server: &RedisServer, policy: Policy, total: usize) -> usize {
    let stores = [
        RedisStore::connect(&server.url()).await.unwrap(),
        RedisStore::connect(&server.url()).await.unwrap(),
    ];
    let policy = Arc::new(policy);
    let barrier = Arc::new(Barrier::new(total));
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let store = stores[i % 2].clone();
        let policy = Arc::clone(&policy);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            // A generous timeout: this test is about counting, not speed.
            let store = store.with_timeout(Duration::from_secs(10));
            store.check("hot", &policy).await.unwrap().allowed()
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admits_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy: Policy = "100/60s".parse::<Policy>().unwrap().fixed_window().unwrap();
    // A burst that straddled a minute boundary would rightly get 2× max.
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
    let admitted = admitted_under_contention(&server, policy, 500).await;
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
    let mismatches = differential::run(
        &server,
        include_str!("../src/store/redis/scripts/fixed_window.lua"),
        Policy::fixed_window,
        u128::MAX,
    )
    .await;
    assert_eq!(mismatches, 0);
}

/// Random policies and times, decided by a Lua script on a fixed `TIME` and
/// by the memory store on the same microsecond.
mod differential {
    use super::*;

    /// A small random generator (xorshift), deterministic across runs.
    pub(super) struct Rng(u64);

    impl Rng {
        pub(super) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        pub(super) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    const WINDOWS_US: [u64; 9] = [
        1_000,
        7_000,
        100_000,
        1_000_000,
        3_000_000,
        60_000_000,
        3_600_000_000,
        86_400_000_000,
        316_224_000_000_000,
    ];

    fn random_policy(
        rng: &mut Rng,
        algorithm: fn(Policy) -> Result<Policy, PolicyError>,
        limit: u128,
    ) -> Policy {
        loop {
            let n = 1 + rng.below(3) as usize;
            let mut rates = Vec::new();
            for _ in 0..n {
                let window = WINDOWS_US[rng.below(WINDOWS_US.len() as u64) as usize];
                let max = match rng.below(4) {
                    0 => 1,
                    1 | 2 => 1 + rng.below(10),
                    _ => 1 + rng.below(MAX_MAX),
                };
                if u128::from(max) * u128::from(window) > limit {
                    continue;
                }
                rates.push(Rate::new(max, Duration::from_micros(window)).unwrap());
            }
            rates.sort_by_key(Rate::window);
            rates.dedup_by_key(|r| r.window());
            let Ok(policy) = Policy::new(rates) else {
                continue;
            };
            let smallest = policy.rates().iter().map(Rate::max).min().unwrap();
            let cost = match rng.below(3) {
                0 => 1 + rng.below(smallest.min(MAX_COST)),
                _ => 1,
            };
            return algorithm(policy.with_cost(cost).unwrap()).unwrap();
        }
    }

    /// The next time to check at: often a window edge of one of the rates,
    /// or one microsecond before it.
    fn next_time(rng: &mut Rng, policy: &Policy, now: u64) -> u64 {
        let rates = policy.rates();
        let w = micros(rates[rng.below(rates.len() as u64) as usize].window());
        let edge = (now / w + 1 + rng.below(2)) * w;
        match rng.below(8) {
            0 => now,
            1 => now + 1,
            2 => edge,
            3 => edge - 1,
            4 => now + rng.below(w),
            5 => now + rng.below(w / 3 + 1),
            6 => edge + rng.below(w),
            _ => now + rng.below(micros(policy.longest_window()) * 3),
        }
    }

    /// How many checks differed (each is printed).
    pub(super) async fn run(
        server: &RedisServer,
        source: &str,
        algorithm: fn(Policy) -> Result<Policy, PolicyError>,
        limit: u128,
    ) -> usize {
        let fake = "local t = redis.call('HMGET', 'fake-time', 's', 'us')";
        assert!(source.contains("local t = redis.call('TIME')"));
        let script = ::redis::Script::new(&source.replace("local t = redis.call('TIME')", fake));
        let client = ::redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut mismatches = 0;
        let (mut checks, mut denied) = (0, 0);
        for round in 0..300 {
            let policy = random_policy(&mut rng, algorithm, limit);
            let Harness::Memory { store, clock } = Harness::memory() else {
                unreachable!()
            };
            let key = format!("k{round}");
            // In the future (2033 on), so keys do not expire on Redis's real
            // clock; below 2^53 µs, where Redis's doubles are exact.
            let mut now = 2_000_000_000_000_000 + rng.below(1 << 40);
            for _ in 0..40 {
                now = next_time(&mut rng, &policy, now);
                if now >= 8_000_000_000_000_000 {
                    break;
                }
                ::redis::cmd("HSET")
                    .arg("fake-time")
                    .arg("s")
                    .arg(now / 1_000_000)
                    .arg("us")
                    .arg(now % 1_000_000)
                    .exec_async(&mut conn)
                    .await
                    .unwrap();
                let mut invocation = script.key(&key);
                invocation.arg(policy.cost());
                for rate in policy.rates() {
                    invocation.arg(rate.max()).arg(micros(rate.window()));
                }
                let reply: Vec<u64> = invocation.invoke_async(&mut conn).await.unwrap();
                clock.set(Duration::from_micros(now));
                let d = store.check("k", &policy).await.unwrap();
                let mut expected = vec![u64::from(d.allowed())];
                for rate in d.rates() {
                    expected.extend([rate.remaining(), micros(rate.reset()), micros(rate.wait())]);
                }
                checks += 1;
                denied += usize::from(!d.allowed());
                if reply != expected {
                    mismatches += 1;
                    eprintln!(
                        "{policy} cost {} at {now}: script {reply:?}, memory {expected:?}",
                        policy.cost()
                    );
                }
            }
        }
        eprintln!("{checks} checks ({denied} denied), {mismatches} differ");
        assert!(
            denied > checks / 10 && denied < checks * 9 / 10,
            "{denied} of {checks} denied"
        );
        mismatches
    }
}
