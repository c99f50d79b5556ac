//! Attacks on the Redis work cut per decision: GCRA's binary TATs and
//! batched offsets, the sliding log Transaction's count-only reads with a
//! denial's entries read in its clean-up, and the window counters' routing
//! of keys found full straight to the script. Real redis-server processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::contention;
use crate::support::harness::{away_from_a_boundary, now_us};
use crate::support::proxy::{AfterDrop, FaultProxy, Match};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Decision, MemoryStore, Policy, RedisStore, Store};

const MS: Duration = Duration::from_millis(1);

fn gcra(text: &str) -> Policy {
    text.parse::<Policy>().unwrap().gcra().unwrap()
}

fn counter(algorithm: &str, text: &str) -> Policy {
    let policy: Policy = text.parse().unwrap();
    match algorithm {
        "fixed-window" => policy.fixed_window().unwrap(),
        "sliding-window" => policy.sliding_window().unwrap(),
        other => panic!("{other}"),
    }
}

async fn batched(server: &RedisServer, in_flight: usize) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_batches(in_flight)
        .with_timeout(Duration::from_secs(5))
}

/// All `checks` at once; the decisions in order.
async fn all_at_once(store: &RedisStore, checks: Vec<(String, Policy)>) -> Vec<Decision> {
    contention::all_at_once(store, checks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// How many of `n` checks of `key` under `policy`, all at once, are
/// admitted.
async fn admitted_at_once(store: &RedisStore, key: &str, policy: &Policy, n: usize) -> usize {
    let checks = (0..n).map(|_| (key.to_owned(), policy.clone())).collect();
    all_at_once(store, checks)
        .await
        .iter()
        .filter(|d| d.allowed())
        .count()
}

/// Several GCRA policies in the same batches (different maxes, two rates,
/// a cost above one, two costs on one key): each key admits exactly what
/// its policy allows, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gcra_mixed_policies_in_one_batch_are_exact() {
    let server = RedisServer::start();
    let store = batched(&server, 1).await;
    let a = gcra("7/60s");
    let b = gcra("3/60s, 20/10min");
    let c = gcra("12/60s").with_cost(5).unwrap();
    let d1 = gcra("10/60s");
    let d3 = gcra("10/60s").with_cost(3).unwrap();
    let mut checks = Vec::new();
    for i in 0..40 {
        checks.push(("a".to_string(), a.clone()));
        checks.push(("b".to_string(), b.clone()));
        checks.push(("c".to_string(), c.clone()));
        checks.push((
            "d".to_string(),
            if i % 2 == 0 { d1.clone() } else { d3.clone() },
        ));
    }
    let decisions = all_at_once(&store, checks).await;
    let admitted = |k: usize| {
        decisions
            .iter()
            .skip(k)
            .step_by(4)
            .filter(|d| d.allowed())
            .count()
    };
    assert_eq!(admitted(0), 7, "7/60s");
    assert_eq!(admitted(1), 3, "3/60s, 20/10min");
    assert_eq!(admitted(2), 2, "12/60s at cost 5");
    let units: usize = decisions
        .iter()
        .skip(3)
        .step_by(4)
        .enumerate()
        .filter(|(_, d)| d.allowed())
        .map(|(i, _)| if i % 2 == 0 { 1 } else { 3 })
        .sum();
    assert!(
        (8..=10).contains(&units),
        "10/60s at costs 1 and 3: {units} units"
    );
    // Every denial says nothing remains and a wait within the window.
    for d in decisions.iter().filter(|d| !d.allowed()) {
        assert!(d.retry_after() <= Duration::from_secs(600), "{d:?}");
        assert!(d.retry_after() > Duration::ZERO, "{d:?}");
    }
}

/// A max changed between checks (10/10s, then 5/10s, then 10/10s) on the
/// batched path decides as the memory store does on the same sequence.
#[tokio::test]
async fn gcra_changed_max_batched_matches_memory() {
    let server = RedisServer::start();
    let store = batched(&server, 2).await;
    let memory = MemoryStore::with_clock(ManualClock::new(Duration::from_secs(1_700_000_000)));
    let ten = gcra("10/10s");
    let five = gcra("5/10s");
    let three_cost = gcra("10/10s").with_cost(3).unwrap();
    let sequence: Vec<&Policy> = std::iter::repeat_n(&ten, 6)
        .chain(std::iter::repeat_n(&five, 3))
        .chain(std::iter::repeat_n(&ten, 2))
        .chain(std::iter::repeat_n(&three_cost, 2))
        .chain(std::iter::repeat_n(&ten, 3))
        .collect();
    let two_a = gcra("3/1s, 10/60s");
    let two_b = gcra("3/1s, 5/60s");
    let two: Vec<&Policy> = std::iter::repeat_n(&two_a, 4)
        .chain(std::iter::repeat_n(&two_b, 2))
        .chain(std::iter::repeat_n(&two_a, 2))
        .collect();
    let runs = sequence
        .into_iter()
        .map(|p| ("changed", p))
        .chain(two.into_iter().map(|p| ("changed-two", p)));
    for (i, (key, policy)) in runs.enumerate() {
        let r = store.check(key, policy).await.unwrap();
        let m = memory.check(key, policy).await.unwrap();
        assert_eq!(
            r.allowed(),
            m.allowed(),
            "step {i}: redis {r:?} memory {m:?}"
        );
        assert_eq!(
            r.remaining(),
            m.remaining(),
            "step {i}: redis {r:?} memory {m:?}"
        );
        let (ra, ma) = (r.retry_after(), m.retry_after());
        assert!(
            ra <= ma && ma - ra < Duration::from_millis(500),
            "step {i}: retry_after redis {ra:?} memory {ma:?}"
        );
    }
}

/// A penalty then a reward, then batched checks: the units the commands
/// moved are counted exactly.
#[tokio::test]
async fn gcra_penalty_and_reward_then_batched_checks() {
    let server = RedisServer::start();
    let store = batched(&server, 1).await;
    let policy = gcra("10/60s");
    store
        .command("pr", &policy, Command::Penalty(7))
        .await
        .unwrap();
    store
        .command("pr", &policy, Command::Reward(2))
        .await
        .unwrap();
    // 5 used: 5 admitted of 12 at once.
    assert_eq!(admitted_at_once(&store, "pr", &policy, 12).await, 5);
    store
        .command("pr", &policy, Command::Reward(3))
        .await
        .unwrap();
    assert_eq!(admitted_at_once(&store, "pr", &policy, 12).await, 3);
}

/// A TAT an earlier version wrote as text under another max (20) keeps its
/// units under the current max (10): 8 of 20 used → 8 of 10 used, 2 left.
#[tokio::test]
async fn gcra_text_tat_under_another_max_keeps_its_units() {
    let server = RedisServer::start();
    let store = batched(&server, 1).await;
    let policy = gcra("10/10s");
    let key = store.redis_key("gcra", "text20");
    // T was 0.5 s: 8 units = 4 s ahead.
    let tat = format!("{} 0.5 20", now_us() + 4_000_000);
    server.command(&["HSET", &key, "10000000", &tat]);
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += u32::from(store.check("text20", &policy).await.unwrap().allowed());
    }
    assert_eq!(admitted, 2);
    // Under a larger max (40, T 0.25 s), 8 of 40 used → 32 left.
    let key = store.redis_key("gcra", "text40");
    let tat = format!("{} 0.5 20", now_us() + 4_000_000);
    server.command(&["HSET", &key, "10000000", &tat]);
    let forty = gcra("40/10s");
    let d = store
        .command("text40", &forty, Command::Peek)
        .await
        .unwrap();
    assert!((31..=32).contains(&d.remaining()), "{d:?}");
    let mut admitted = 0;
    for _ in 0..40 {
        admitted += u32::from(store.check("text40", &forty).await.unwrap().allowed());
    }
    assert!((32..=33).contains(&admitted), "{admitted}");
}

/// A window counter's key held full by the routing, then reset or
/// rewarded: the next checks are admitted exactly up to the max, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn window_counter_reset_or_reward_while_held_full_is_exact() {
    let server = RedisServer::start();
    let store = batched(&server, 2).await;
    for algorithm in ["fixed-window", "sliding-window"] {
        let policy = counter(algorithm, "5/4s");
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(2500)).await;
        let key = format!("held-{algorithm}");
        for i in 0..5 {
            assert!(
                store.check(&key, &policy).await.unwrap().allowed(),
                "{algorithm} {i}"
            );
        }
        for _ in 0..3 {
            assert!(
                !store.check(&key, &policy).await.unwrap().allowed(),
                "{algorithm}"
            );
        }
        store.command(&key, &policy, Command::Reset).await.unwrap();
        assert_eq!(
            admitted_at_once(&store, &key, &policy, 20).await,
            5,
            "{algorithm} after reset"
        );
        // Held full again; a reward of 2 lets exactly 2 in.
        assert!(!store.check(&key, &policy).await.unwrap().allowed());
        store
            .command(&key, &policy, Command::Reward(2))
            .await
            .unwrap();
        assert_eq!(
            admitted_at_once(&store, &key, &policy, 20).await,
            2,
            "{algorithm} after reward"
        );
        // Sequential: reset, then exactly 5 one by one, and the 6th denied.
        store.command(&key, &policy, Command::Reset).await.unwrap();
        for i in 0..5 {
            assert!(
                store.check(&key, &policy).await.unwrap().allowed(),
                "{algorithm} seq {i}"
            );
        }
        assert!(!store.check(&key, &policy).await.unwrap().allowed());
    }
}

/// Keys flipping between full and room (another policy with a larger max
/// on the same key; a smaller one denying first): never more than a
/// policy's max admitted under concurrency.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn window_counter_two_maxes_on_one_key_never_over_admit() {
    let server = RedisServer::start();
    let store = batched(&server, 3).await;
    for algorithm in ["fixed-window", "sliding-window"] {
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(2500)).await;
        let small = counter(algorithm, "4/4s");
        let large = counter(algorithm, "9/4s");
        let key = format!("flip-{algorithm}");
        // Fill to the small max: the small policy holds the key full.
        assert_eq!(
            admitted_at_once(&store, &key, &small, 12).await,
            4,
            "{algorithm}"
        );
        // Mixed: the large policy has 5 more; the small none.
        let checks = (0..60)
            .map(|i| {
                (
                    key.clone(),
                    if i % 2 == 0 {
                        large.clone()
                    } else {
                        small.clone()
                    },
                )
            })
            .collect();
        let decisions = all_at_once(&store, checks).await;
        let large_in = decisions.iter().step_by(2).filter(|d| d.allowed()).count();
        let small_in = decisions
            .iter()
            .skip(1)
            .step_by(2)
            .filter(|d| d.allowed())
            .count();
        assert_eq!((large_in, small_in), (5, 0), "{algorithm}");
    }
}

/// Sliding log Transaction, cost 3 racing near the max: never more than
/// the max, and the denied requests' entries come out (the units left are
/// then admitted exactly).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sliding_log_cost_three_racing_near_the_max() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5));
    let one: Policy = "10/20s".parse().unwrap();
    let three = one.clone().with_cost(3).unwrap();
    for filled in [7u64, 9] {
        let key = format!("log-{filled}");
        for _ in 0..filled {
            assert!(store.check(&key, &one).await.unwrap().allowed());
        }
        let decisions = all_at_once(
            &store,
            (0..20).map(|_| (key.clone(), three.clone())).collect(),
        )
        .await;
        let won = decisions.iter().filter(|d| d.allowed()).count() as u64;
        assert!(
            filled + 3 * won <= 10,
            "{filled} filled, {won} of cost 3 admitted"
        );
        for d in decisions.iter().filter(|d| !d.allowed()) {
            assert!(
                d.retry_after() <= Duration::from_secs(20) + 50 * MS,
                "{d:?}"
            );
            assert!(d.retry_after() > Duration::from_secs(15), "{d:?}");
        }
        tokio::time::sleep(200 * MS).await;
        let mut more = 0;
        for _ in 0..12 {
            more += u64::from(store.check(&key, &one).await.unwrap().allowed());
        }
        assert_eq!(
            filled + 3 * won + more,
            10,
            "{filled} filled, {won} won, {more} after"
        );
    }
}

/// Sliding log Transaction: a lone client waiting exactly the reported
/// retry_after is admitted (short window), for costs 1 and 2.
#[tokio::test]
async fn sliding_log_waiting_the_retry_after_is_enough() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    for (text, cost, fits) in [("3/300ms", 1u64, 3), ("5/300ms", 2, 2)] {
        let policy = text.parse::<Policy>().unwrap().with_cost(cost).unwrap();
        for round in 0..3 {
            let key = format!("retry-{cost}-{round}");
            let mut n = 0;
            let denied = loop {
                let d = store.check(&key, &policy).await.unwrap();
                if !d.allowed() {
                    break d;
                }
                n += 1;
                assert!(n <= fits, "{text} round {round}: {n} admitted");
                tokio::time::sleep(20 * MS).await;
            };
            let wait = denied.retry_after();
            assert!(
                wait > Duration::ZERO && wait <= 300 * MS,
                "{text} round {round}: retry_after {wait:?} after {n} admitted"
            );
            tokio::time::sleep(wait).await;
            let d = store.check(&key, &policy).await.unwrap();
            assert!(
                d.allowed(),
                "{text} round {round}: waited {wait:?}, still {d:?}"
            );
            // Full again at once: the wait is until the second request's
            // entries leave (about 20 ms later), never 0 and never the
            // window.
            let again = store.check(&key, &policy).await.unwrap();
            assert!(!again.allowed(), "{text} round {round}: {again:?}");
            let wait = again.retry_after();
            assert!(
                wait > MS && wait < 300 * MS,
                "{text} round {round}: second wait {wait:?}"
            );
            tokio::time::sleep(wait).await;
            let d = store.check(&key, &policy).await.unwrap();
            assert!(
                d.allowed(),
                "{text} round {round}: waited {wait:?} again, still {d:?}"
            );
        }
    }
}

async fn proxied(timeout: Duration) -> (RedisServer, Arc<FaultProxy>, RedisStore) {
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(timeout);
    (server, proxy, store)
}

/// The denial's clean-up transaction (the only one reading ZREVRANGE for a
/// one-rate policy) dropped or stalled: the decision returns within the
/// store's timeout, denied, waiting at most the window; later its entries
/// still come out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_cleanup_fault_keeps_the_timeout_and_the_window() {
    let timeout = 300 * MS;
    let (server, proxy, store) = proxied(timeout).await;
    let policy: Policy = "2/2s".parse().unwrap();
    let window = Duration::from_secs(2);
    for (fault, key) in [("drop", "f-drop"), ("stall", "f-stall"), ("cut", "f-cut")] {
        assert!(store.check(key, &policy).await.unwrap().allowed());
        assert!(store.check(key, &policy).await.unwrap().allowed());
        let target = Match::command("ZREVRANGE").arg(key);
        match fault {
            "drop" => proxy.drop_next_reply(target, AfterDrop::Hang),
            "stall" => proxy.stall_next_reply(target, Duration::from_secs(2)),
            _ => proxy.cut_next_reply(target),
        }
        let started = Instant::now();
        let d = store.check(key, &policy).await.unwrap();
        let took = started.elapsed();
        assert!(!d.allowed(), "{fault}: {d:?}");
        assert!(took <= timeout + 300 * MS, "{fault}: took {took:?}");
        assert!(
            d.retry_after() <= window,
            "{fault}: retry_after {:?}",
            d.retry_after()
        );
        assert!(d.reset() <= window, "{fault}: reset {:?}", d.reset());
        assert!(
            d.retry_after() >= window - 200 * MS,
            "{fault}: retry_after {:?}",
            d.retry_after()
        );
        proxy.cut_all();
        // The denied entry comes out in the background: two entries left.
        let redis_key = store.redis_key("log", key);
        let mut card = String::new();
        for _ in 0..50 {
            card = server.command(&["ZCARD", &redis_key]);
            if card.contains(":2") {
                break;
            }
            tokio::time::sleep(50 * MS).await;
        }
        assert!(card.contains(":2"), "{fault}: ZCARD {card} of {redis_key}");
    }
}

/// Sliding log Transaction: a denial's wait comes from the entry of
/// reverse rank max − cost, read in its clean-up: for each cost, the time
/// until enough of the oldest entries have left, and waiting it is enough.
#[tokio::test]
async fn sliding_log_denial_wait_follows_the_cost() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let one: Policy = "10/1s".parse().unwrap();
    let key = "ranks";
    // Each group's entries are stamped between its start and its end.
    let t0 = Instant::now();
    for _ in 0..6 {
        assert!(store.check(key, &one).await.unwrap().allowed());
    }
    let t0_end = Instant::now();
    tokio::time::sleep(400 * MS).await;
    let t1 = Instant::now();
    for _ in 0..4 {
        assert!(store.check(key, &one).await.unwrap().allowed());
    }
    let t1_end = Instant::now();
    // When a group's entry leaves, seen from a check asked at `asked` and
    // answered at `answered`: between these (with the clock padding and
    // a margin).
    let leaves = |(start, end): (Instant, Instant), asked: Instant, answered: Instant| {
        let second = Duration::from_secs(1);
        (
            (start + second).saturating_duration_since(answered),
            (end + second).saturating_duration_since(asked) + 40 * MS,
        )
    };
    // Costs 1, 3 and 5 wait for the oldest six (at t0) to leave enough;
    // cost 7 for one of the four at t1.
    for (cost, group) in [
        (1u64, (t0, t0_end)),
        (3, (t0, t0_end)),
        (5, (t0, t0_end)),
        (7, (t1, t1_end)),
    ] {
        let policy = one.clone().with_cost(cost).unwrap();
        let asked = Instant::now();
        let d = store.check(key, &policy).await.unwrap();
        let (low, high) = leaves(group, asked, Instant::now());
        assert!(!d.allowed(), "cost {cost}: {d:?}");
        let got = d.retry_after();
        assert!(
            got >= low && got <= high,
            "cost {cost}: retry_after {got:?}, the blocker leaves in {low:?} to {high:?}"
        );
    }
    // The reset: when the newest entry (at t1) leaves.
    let asked = Instant::now();
    let d = store.check(key, &one).await.unwrap();
    let (low, high) = leaves((t1, t1_end), asked, Instant::now());
    assert!(
        d.reset() >= low && d.reset() <= high,
        "reset {:?}, the newest entry leaves in {low:?} to {high:?}",
        d.reset()
    );
    // Waiting the reported wait (below the window: not capped) is enough.
    let five = one.clone().with_cost(5).unwrap();
    let d = store.check(key, &five).await.unwrap();
    assert!(
        !d.allowed() && d.retry_after() < Duration::from_secs(1),
        "{d:?}"
    );
    tokio::time::sleep(d.retry_after()).await;
    let after = store.check(key, &five).await.unwrap();
    assert!(after.allowed(), "waited {:?}: {after:?}", d.retry_after());
}

/// A key reset while a denial's clean-up transaction is held on its way
/// to Redis: the clean-up's reads find the log empty, and the denial
/// waits the padding alone; waiting it, the whole max is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_reset_before_the_cleanup_reads_waits_the_padding() {
    let (server, proxy, store) = proxied(Duration::from_secs(3)).await;
    let policy: Policy = "2/2s".parse().unwrap();
    let key = "reset-mid";
    assert!(store.check(key, &policy).await.unwrap().allowed());
    assert!(store.check(key, &policy).await.unwrap().allowed());
    proxy.stall_next_request(Match::command("ZREM").arg(key), 400 * MS);
    let denied = {
        let store = store.clone();
        let policy = policy.clone();
        tokio::spawn(async move { store.check(key, &policy).await.unwrap() })
    };
    tokio::time::sleep(150 * MS).await;
    let redis_key = store.redis_key("log", key);
    server.command(&["DEL", &redis_key]);
    let d = denied.await.unwrap();
    assert!(!d.allowed(), "{d:?}");
    assert!(d.retry_after() <= 50 * MS, "the log was emptied: {d:?}");
    assert!(d.reset() <= 50 * MS, "the log was emptied: {d:?}");
    tokio::time::sleep(d.retry_after()).await;
    assert!(store.check(key, &policy).await.unwrap().allowed());
    assert!(store.check(key, &policy).await.unwrap().allowed());
    assert!(!store.check(key, &policy).await.unwrap().allowed());
}

/// GCRA: a one-rate policy and a two-rate policy sharing a field on one
/// key, in the same batches: the shared rate is never over-admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gcra_one_and_two_rate_policies_share_a_field_exactly() {
    let server = RedisServer::start();
    let store = batched(&server, 2).await;
    let single = gcra("10/60s");
    let double = gcra("10/60s, 4/1h");
    let checks = (0..60)
        .map(|i| {
            (
                "shared".to_string(),
                if i % 3 == 0 {
                    double.clone()
                } else {
                    single.clone()
                },
            )
        })
        .collect();
    let decisions = all_at_once(&store, checks).await;
    let by_double = decisions.iter().step_by(3).filter(|d| d.allowed()).count();
    let total = decisions.iter().filter(|d| d.allowed()).count();
    assert_eq!(total, 10, "the shared 10/60s");
    assert!(by_double <= 4, "4/1h: {by_double}");
    // Both fields are binary values, the key expires.
    let key = store.redis_key("gcra", "shared");
    let pttl = server.command(&["PTTL", &key]);
    let pttl: i64 = pttl.trim().trim_start_matches(':').parse().unwrap();
    assert!(pttl > 60_000, "PTTL {pttl}");
}

/// A key held full by the routing (window counters) or denied (GCRA),
/// then blocked, then unblocked, then reset: each step's decisions on the
/// batched path are exact (blocked while the block lasts, full after it,
/// the whole max after the reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_full_then_blocked_unblocked_and_reset() {
    let server = RedisServer::start();
    let store = batched(&server, 2).await;
    for algorithm in ["fixed-window", "sliding-window", "gcra"] {
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(2500)).await;
        let policy = match algorithm {
            "gcra" => gcra("5/60s"),
            other => counter(other, "5/4s"),
        };
        let key = format!("blk-{algorithm}");
        assert_eq!(
            admitted_at_once(&store, &key, &policy, 12).await,
            5,
            "{algorithm}"
        );
        store
            .command(&key, &policy, Command::Block(Duration::from_secs(30)))
            .await
            .unwrap();
        let d = store.check(&key, &policy).await.unwrap();
        assert!(!d.allowed() && d.blocked(), "{algorithm}: {d:?}");
        store
            .command(&key, &policy, Command::Block(Duration::ZERO))
            .await
            .unwrap();
        let d = store.check(&key, &policy).await.unwrap();
        assert!(
            !d.allowed() && !d.blocked(),
            "{algorithm}: still full, {d:?}"
        );
        store.command(&key, &policy, Command::Reset).await.unwrap();
        let decisions = all_at_once(
            &store,
            (0..12).map(|_| (key.clone(), policy.clone())).collect(),
        )
        .await;
        assert_eq!(
            decisions.iter().filter(|d| d.allowed()).count(),
            5,
            "{algorithm} after reset"
        );
        let d = decisions.iter().find(|d| !d.allowed()).unwrap();
        assert!(
            d.retry_after() > Duration::ZERO && d.remaining() == 0,
            "{algorithm}: {d:?}"
        );
    }
}
