//! Attacks on the window counters' batched checks sent as plain pipelined
//! commands (`src/store/redis/plain.rs`): per batch `TIME` and `MGET`s,
//! per check `INCRBY` + `PEXPIREAT`, decided in Rust after counting, a
//! denied (blocked, failed, misplaced) check's cost given back with
//! `DECRBY` + `PEXPIREAT` before it is answered.
//!
//! Against real redis-server processes (and the fault proxy), each test
//! states an invariant of the design (DESIGN.md §3–§4, the guide's
//! "Batches") and tries to break it: never more than `max` per window,
//! a denied request counts nothing, a lost reply counts at most once,
//! every count key expires, operator commands keep `MemoryStore`'s
//! semantics, and a batched decision is the single check's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::faults::{self, Connections, FaultSpans, Loss, SteppingClock, random_fault};
use crate::support::harness::{away_from_a_boundary, now_us};
use crate::support::proxy::{FaultProxy, Match};
use crate::support::rng::Rng;
use crate::support::window_counters::{FIXED, SLIDING, WINDOW_COUNTERS, policy, tag};
use crate::support::{RedisServer, start_of_a_second};
use tokio::task::JoinSet;
use tower_redis_ratelimit::clock::{ManualClock, SkewedClock, SystemClock};
use tower_redis_ratelimit::limiter::DecidedBy;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{
    Decision, Limiter, MemoryStore, Policy, RedisStore, Store, StoreError,
};

// ---------------------------------------------------------------------------
// Helpers.

fn now_duration() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

async fn connect(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2))
}

/// An integer reply (`:n`) of a raw command.
fn int_reply(reply: &str) -> i64 {
    reply
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap_or_else(|_| panic!("not an integer reply: {reply:?}"))
}

/// The value of a string key (`None`: no key).
fn get(server: &RedisServer, key: &str) -> Option<i64> {
    let reply = server.command(&["GET", key]);
    if reply.starts_with("$-1") {
        return None;
    }
    Some(reply.lines().nth(1).unwrap().parse().unwrap())
}

/// Every `rl:*` key that has no expiry (PTTL -1), with its value.
fn keys_without_ttl(server: &RedisServer) -> Vec<String> {
    server
        .keys("rl:*")
        .into_iter()
        .filter_map(|key| {
            let pttl = int_reply(&server.command(&["PTTL", &key]));
            (pttl == -1).then(|| {
                let value = server.command(&["GET", &key]).replace("\r\n", " ");
                format!("{key} (PTTL -1, GET {value})")
            })
        })
        .collect()
}

/// One admission as the test saw it: sent and answered (µs, this
/// machine's clock, which Redis runs on) and its cost.
#[derive(Debug, Clone, Copy)]
struct Admission {
    sent: u64,
    answered: u64,
    cost: u64,
}

/// The windows (of `window` µs, aligned to the epoch) in which the
/// admissions surely decided in them (sent and answered in the same
/// window) add up to more than `max`.
fn windows_over(admissions: &[Admission], window: u64, max: u64) -> Vec<String> {
    let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
    for a in admissions {
        if a.sent / window == a.answered / window {
            *per_window.entry(a.sent / window).or_default() += a.cost;
        }
    }
    per_window
        .into_iter()
        .filter(|&(_, units)| units > max)
        .map(|(index, units)| format!("window {index} of {window} µs: {units} units > max {max}"))
        .collect()
}

/// The most units any one window (surely) admitted.
fn fullest_window(admissions: &[Admission], window: u64) -> u64 {
    let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
    for a in admissions {
        if a.sent / window == a.answered / window {
            *per_window.entry(a.sent / window).or_default() += a.cost;
        }
    }
    per_window.into_values().max().unwrap_or(0)
}

fn show(outcome: &Result<Decision, StoreError>) -> String {
    faults::show(outcome)
}

// ---------------------------------------------------------------------------
// 1. Every count key expires: when the connection is cut mid-pipeline,
//    when a batch reaches Redis after its window ended, and after
//    give-backs of checks in windows that ended.

/// The count keys of `redis_key` without an expiry, or with a negative
/// value.
fn bad_counts(server: &RedisServer, redis_key: &str) -> Vec<String> {
    let mut bad: Vec<String> = keys_without_ttl(server)
        .into_iter()
        .filter(|k| k.contains(redis_key))
        .collect();
    for key in server.keys(&format!("{redis_key}:*")) {
        if let Some(value) = get(server, &key)
            && value < 0
        {
            bad.push(format!("{key} = {value}"));
        }
    }
    bad
}

/// The batch's pipeline reaches Redis up to the count's `INCRBY` (held),
/// its `SET … NX` run, then the connection is cut (a TCP reset between two segments of one
/// pipeline): no count is left without an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_keeps_its_expiry_when_the_link_is_cut_mid_pipeline() {
    let server = RedisServer::start();
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        for held in ["INCRBY"] {
            let proxy = FaultProxy::start(server.port());
            let store = RedisStore::connect(&proxy.url())
                .await
                .unwrap()
                .with_timeout(Duration::from_millis(300));
            let limit = policy(algorithm, "5/2s, 7/4s");
            assert!(store.check("warm", &limit).await.unwrap().allowed());
            let key = format!("cut-{algorithm}-{held}");
            let redis_key = store.redis_key(tag(algorithm), &key);
            // Everything before the first count's INCRBY (its SET) reaches
            // Redis; the rest is held, then the connection is cut.
            proxy.stall_next_request(Match::command(held).arg(&redis_key), Duration::from_secs(5));
            let target = 0;
            let outcome = store.check(&key, &limit).await;
            assert!(
                proxy.armed() <= target,
                "{algorithm} {held}: the fault did not fire"
            );
            proxy.cut_all();
            tokio::time::sleep(Duration::from_millis(100)).await;
            let bad = bad_counts(&server, &redis_key);
            if !bad.is_empty() {
                failures.push(format!(
                    "{algorithm}, cut at {held}: the check ({}) left {bad:?}",
                    show(&outcome)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A batch held on its way to Redis past the store's timeout (the client
/// gave up: nobody will give anything back) and past its window's end:
/// its count's `SET … PXAT … NX` names an expiry already past, which
/// Redis does not keep, and the `INCRBY` after it makes the count afresh.
/// The count must still expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_reaches_redis_after_its_window_ended_leaves_no_count_without_expiry() {
    let server = RedisServer::start();
    let mut failures = Vec::new();
    // The fixed window's count expires at its window's end, the sliding
    // window's one window later: the request is held past that.
    for (algorithm, held) in [(FIXED, 500u64), (SLIDING, 1_500)] {
        let proxy = FaultProxy::start(server.port());
        let store = RedisStore::connect(&proxy.url())
            .await
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        let limit = policy(algorithm, "5/1s");
        assert!(store.check("warm", &limit).await.unwrap().allowed());
        let key = format!("late-{algorithm}");
        let redis_key = store.redis_key(tag(algorithm), &key);
        start_of_a_second().await;
        // 800 ms into the second.
        tokio::time::sleep(Duration::from_millis(750)).await;
        proxy.stall_next_request(
            Match::command("INCRBY").arg(&redis_key),
            Duration::from_millis(held),
        );
        let outcome = store.check(&key, &limit).await;
        assert_eq!(proxy.armed(), 0, "{algorithm}: the fault did not fire");
        // The held commands land.
        tokio::time::sleep(Duration::from_millis(held + 200)).await;
        let bad = bad_counts(&server, &redis_key);
        if !bad.is_empty() {
            failures.push(format!(
                "{algorithm}: a batch held {held} ms on its way (the check: {}) left counts \
                 that never expire: {bad:?}",
                show(&outcome)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A denied check whose give-back reaches Redis after its window's count
/// expired (its reply was held, within the timeout): nothing is left, no
/// negative count, no count without expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_after_its_window_ended_leaves_nothing_behind() {
    let server = RedisServer::start();
    let mut failures = Vec::new();
    for (algorithm, held) in [(FIXED, 350u64), (SLIDING, 1_450)] {
        let proxy = FaultProxy::start(server.port());
        let store = RedisStore::connect(&proxy.url())
            .await
            .unwrap()
            .with_timeout(Duration::from_secs(3));
        let limit = policy(algorithm, "2/1s");
        assert!(store.check("warm", &limit).await.unwrap().allowed());
        let key = format!("late-give-back-{algorithm}");
        let redis_key = store.redis_key(tag(algorithm), &key);
        start_of_a_second().await;
        for _ in 0..2 {
            assert!(store.check(&key, &limit).await.unwrap().allowed());
        }
        let ms = now_duration().subsec_millis();
        tokio::time::sleep(Duration::from_millis(u64::from(800u32.saturating_sub(ms)))).await;
        // The batch's transaction: its reply (the `EXEC`'s) held.
        proxy.stall_next_reply(
            Match::command("EXEC").arg(&redis_key),
            Duration::from_millis(held),
        );
        let outcome = store.check(&key, &limit).await;
        assert_eq!(proxy.armed(), 0, "{algorithm}: the fault did not fire");
        // Denied in the transaction; decided again by the script once given
        // back, in the next window by then: admitted or denied, both right.
        assert!(outcome.is_ok(), "{algorithm}: {}", show(&outcome));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let bad = bad_counts(&server, &redis_key);
        if !bad.is_empty() {
            failures.push(format!(
                "{algorithm}: the denied check ({}) left {bad:?}",
                show(&outcome)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Floods of denied checks (a blocked key; a key whose minute is spent,
/// so each second's count holds only denied costs) from three batching
/// stores: the give-backs bring the counts back to zero, over and over,
/// while other batches make and add to the same counts. No count may be
/// left without an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_denied_batched_checks_leave_no_count_without_expiry() {
    let server = RedisServer::start();
    // One batch in flight per store: large batches, whose pipelines Redis
    // reads in several parts, between which other clients' commands run.
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(connect(&server).await.with_batches(1));
    }
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        let spent = policy(algorithm, "2/60s, 100/1s");
        let free = policy(algorithm, "100/1s");
        let long = "k".repeat(90);
        let (spent_key, blocked_key) = (
            format!("spent-{algorithm}-{long}"),
            format!("blocked-{algorithm}-{long}"),
        );
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(4)).await;
        for _ in 0..2 {
            assert!(stores[0].check(&spent_key, &spent).await.unwrap().allowed());
        }
        stores[0]
            .command(&blocked_key, &free, Command::Block(Duration::from_secs(60)))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_millis(1_500);
        let mut jobs = JoinSet::new();
        for store in &stores {
            for t in 0..48 {
                let (store, spent, free) = (store.clone(), spent.clone(), free.clone());
                let (spent_key, blocked_key) = (spent_key.clone(), blocked_key.clone());
                jobs.spawn(async move {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        let d = if t % 2 == 0 {
                            store.check(&spent_key, &spent).await.unwrap()
                        } else {
                            store.check(&blocked_key, &free).await.unwrap()
                        };
                        assert!(!d.allowed());
                        n += 1;
                    }
                    n
                });
            }
        }
        let mut checks = 0;
        while let Some(done) = jobs.join_next().await {
            checks += done.unwrap();
        }
        let bad = keys_without_ttl(&server);
        if !bad.is_empty() {
            failures.push(format!(
                "{algorithm}: after {checks} denied checks, {} counts never expire: {:?}",
                bad.len(),
                &bad[..bad.len().min(4)]
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A batch whose pipeline is split on its way (a stall within the
/// timeout between its count's `SET … NX` and its `INCRBY`, as a pipeline
/// larger than a TCP segment is split on a real network), while meanwhile
/// the count goes: an operator's reset, or another process's denied check
/// whose give-back brings the count to zero (the give-back script deletes
/// it). The `INCRBY` then makes the count afresh, without expiry, and the
/// check is admitted: nothing takes it back. No count may be left without
/// an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_deleted_between_a_batchs_set_and_incrby_still_expires() {
    let server = RedisServer::start();
    let direct = connect(&server).await;
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        for meanwhile in ["reset", "give-back"] {
            let proxy = FaultProxy::start(server.port());
            let store = RedisStore::connect(&proxy.url())
                .await
                .unwrap()
                .with_timeout(Duration::from_secs(1));
            let one = policy(algorithm, "20/1s, 10/60s");
            let three = one.clone().with_cost(3).unwrap();
            assert!(store.check("warm", &one).await.unwrap().allowed());
            away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(4)).await;
            let key = format!("split-{algorithm}-{meanwhile}");
            let redis_key = store.redis_key(tag(algorithm), &key);
            // The minute at 9 of 10; then a second of its own.
            for _ in 0..9 {
                assert!(direct.check(&key, &one).await.unwrap().allowed());
            }
            start_of_a_second().await;
            proxy.stall_next_request(
                Match::command("INCRBY").arg(&redis_key),
                Duration::from_millis(200),
            );
            let check = {
                let (store, key, one) = (store.clone(), key.clone(), one.clone());
                tokio::spawn(async move { store.check(&key, &one).await })
            };
            let deadline = Instant::now() + Duration::from_millis(150);
            while proxy.armed() > 0 {
                assert!(
                    Instant::now() < deadline,
                    "{algorithm}: the batch never came"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let other = if meanwhile == "reset" {
                direct.command(&key, &one, Command::Reset).await.unwrap()
            } else {
                // Denied by the minute (9 + 3 > 10): its second's count
                // goes 0 → 3 → given back, deleted.
                direct.check(&key, &three).await.unwrap()
            };
            let outcome = check.await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let bad = bad_counts(&server, &redis_key);
            if !bad.is_empty() {
                failures.push(format!(
                    "{algorithm}, {meanwhile} (answered {}) while the batch was split: the \
                     check ({}) left counts that never expire: {bad:?}",
                    if other.allowed() { "allowed" } else { "denied" },
                    show(&outcome)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 2. An operator's reset or reward while denied checks' costs are out.
//    With plain batches a give-back landing after a reset takes the denied
//    cost off the new count (the inexactness the guide states); with every
//    check a script the bound holds, as the control below shows.

/// Twelve checkers on three stores flood a full key with denied checks
/// while an operator resets (or rewards more than the count) the key every
/// 25 ms, with `batches` in flight: after each reset the key starts from
/// nothing, at most `max` more admissions until the next.
async fn operator_command_during_denials_in(
    algorithm: &str,
    command: Command,
    batches: usize,
) -> Option<String> {
    let server = RedisServer::start();
    let max = 10;
    let limit = Arc::new(policy(algorithm, &format!("{max}/30s")));
    away_from_a_boundary(Duration::from_secs(30), Duration::from_secs(6)).await;
    let key = format!("race-{algorithm}");
    let operator = connect(&server).await.with_batches(0);
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(connect(&server).await.with_batches(batches));
    }
    let admitted = Arc::new(AtomicU64::new(0));
    let denied = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut jobs = JoinSet::new();
    for store in &stores {
        for _ in 0..4 {
            let (store, key, limit) = (store.clone(), key.clone(), Arc::clone(&limit));
            let (admitted, denied, stop) = (
                Arc::clone(&admitted),
                Arc::clone(&denied),
                Arc::clone(&stop),
            );
            jobs.spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    match store.check(&key, &limit).await {
                        Ok(d) if d.allowed() => admitted.fetch_add(1, Ordering::SeqCst),
                        Ok(_) => denied.fetch_add(1, Ordering::SeqCst),
                        Err(e) => panic!("no fault, yet {e}"),
                    };
                }
            });
        }
    }
    let mut epochs = 1u64;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        operator.command(&key, &limit, command).await.unwrap();
        epochs += 1;
    }
    stop.store(true, Ordering::SeqCst);
    while let Some(done) = jobs.join_next().await {
        done.unwrap();
    }
    let admitted = admitted.load(Ordering::SeqCst);
    let denied = denied.load(Ordering::SeqCst);
    let counts: Vec<String> = server
        .keys(&format!("{}*", operator.redis_key(tag(algorithm), &key)))
        .into_iter()
        .map(|k| format!("{k}={:?}", get(&server, &k)))
        .collect();
    (admitted > max * epochs).then(|| {
        format!(
            "{algorithm}, {command:?} every 25 ms: {admitted} admitted ({denied} denied) over \
             {epochs} counts that each start empty: at most {} allowed; counts now {counts:?}",
            max * epochs
        )
    })
}

/// The control: the same race with every check one script (no batches)
/// keeps the bound, so the excess above is the plain batches' own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_reset_or_reward_amid_denied_script_checks_admits_at_most_max() {
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        for command in [Command::Reset, Command::Reward(1_000)] {
            failures.extend(operator_command_during_denials_in(algorithm, command, 0).await);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 3. A denial is final (`Store::denials_are_final`): no request of the key
//    is admitted before its `retry_after`, whatever other clients do.

/// One batch holds a cost-3 check (denied: 8 + 3 > 10) and, after it, a
/// cost-1 check of the same key. If the store denies the cost-1 check, it
/// says its denial is final until `retry_after`: then no request of the
/// key may be admitted before that. (A current-thread runtime: both tasks
/// queue their checks before the batch's task runs, so they share a batch.)
#[tokio::test]
async fn a_batched_denial_is_final_until_its_retry_after() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let mut failures = Vec::new();
    for (algorithm, text) in [(FIXED, "10/60s"), (SLIDING, "10/60s"), (FIXED, "10/day")] {
        let one = policy(algorithm, text);
        let three = one.clone().with_cost(3).unwrap();
        let algorithm = format!("{algorithm} {text}");
        assert!(store.denials_are_final(&one), "{algorithm}");
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(3)).await;
        away_from_a_boundary(Duration::from_secs(86_400), Duration::from_secs(3)).await;
        for round in 0..3 {
            let key = format!("final-{algorithm}-{round}").replace(['/', ' '], "-");
            for _ in 0..8 {
                assert!(store.check(&key, &one).await.unwrap().allowed());
            }
            let a = {
                let (store, key, three) = (store.clone(), key.clone(), three.clone());
                tokio::spawn(async move { store.check(&key, &three).await })
            };
            let b = {
                let (store, key, one) = (store.clone(), key.clone(), one.clone());
                tokio::spawn(async move { store.check(&key, &one).await })
            };
            let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
            let answered = Instant::now();
            assert!(!a.allowed(), "{algorithm}: 8 + 3 > 10");
            if b.allowed() {
                continue;
            }
            let c = store.check(&key, &one).await.unwrap();
            if c.allowed() && answered.elapsed() < b.retry_after() {
                failures.push(format!(
                    "{algorithm} round {round}: a cost-1 check (8 of 10 counted) was denied \
                     with retry_after {:?} (remaining {}), final by the store's word, yet the \
                     next check, {:?} later, was admitted",
                    b.retry_after(),
                    b.remaining(),
                    answered.elapsed()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same through a `Limiter` with its deny cache (on by default): a
/// cached denial must never refuse a check the store would admit
/// (DESIGN §4).
#[tokio::test]
async fn the_deny_cache_never_refuses_what_the_batched_store_admits() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        let limiter = Limiter::new(store.clone(), policy(algorithm, "10/60s"))
            .with_name(format!("deny-cache-{algorithm}"));
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(3)).await;
        let key = "client";
        for _ in 0..8 {
            assert!(limiter.check(key).await.unwrap().allowed());
        }
        let a = {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check_n(key, 3).await })
        };
        let b = {
            let limiter = limiter.clone();
            tokio::spawn(async move { limiter.check(key).await })
        };
        let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
        assert!(!a.allowed(), "{algorithm}: 8 + 3 > 10");
        if b.allowed() {
            continue;
        }
        let peek = limiter.peek(key).await.unwrap();
        let next = limiter.check(key).await.unwrap();
        if peek.allowed() && !next.allowed() {
            failures.push(format!(
                "{algorithm}: the store would admit a check (peek: allowed, remaining {}), \
                 but the limiter denied it, decided by {:?} (retry after {:?})",
                peek.remaining(),
                next.decided_by(),
                next.retry_after()
            ));
        }
        assert_ne!(next.decided_by(), DecidedBy::FailOpen);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 4. Never more than max per window: many stores, costs, several rates,
//    skewed and stepping clocks, across window boundaries.

/// Stores of one key: honest ones, one 1.3 s ahead, one 0.7 s behind, one
/// whose clock jumps around (0.6 s ahead, behind, right) every few
/// milliseconds, so many of its batches are placed in the wrong window
/// and decided again by the script; costs 1 and 3; rates of 1 s and 2 s
/// and a minute (which never rolls during the run: it counts every unit).
/// For 3 s, over several window boundaries: no window (of each rate)
/// admits more than its max, and the minute's count is exactly the units
/// admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_over_max_with_skewed_stores_costs_and_rates_across_boundaries() {
    let server = RedisServer::start();
    let stepping = SteppingClock::new();
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        let mut stores = Vec::new();
        for batches in [1, 2] {
            stores.push(connect(&server).await.with_batches(batches));
        }
        stores.push(connect(&server).await.with_clock(SkewedClock::ahead(
            SystemClock::new(),
            Duration::from_millis(1_300),
        )));
        stores.push(connect(&server).await.with_clock(SkewedClock::behind(
            SystemClock::new(),
            Duration::from_millis(700),
        )));
        stores.push(connect(&server).await.with_clock(stepping.clone()));
        let text = "4/1s, 9/2s, 1000/60s";
        let one = policy(algorithm, text);
        let three = one.clone().with_cost(3).unwrap();
        let policies = Arc::new([one.clone(), three]);
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
        let key = format!("skewed-{algorithm}");
        let stop = Arc::new(AtomicBool::new(false));
        let stepper = {
            let (stepping, stop) = (stepping.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    match i % 3 {
                        0 => stepping.step(Duration::from_millis(600), true),
                        1 => stepping.step(Duration::from_millis(600), false),
                        _ => stepping.step(Duration::ZERO, true),
                    }
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(4)).await;
                }
                stepping.step(Duration::ZERO, true);
            })
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut jobs = JoinSet::new();
        for (s, store) in stores.iter().enumerate() {
            for t in 0..3u64 {
                let (store, key, policies) = (store.clone(), key.clone(), Arc::clone(&policies));
                let mut rng = Rng::new(0x9e37 + s as u64 * 17 + t);
                jobs.spawn(async move {
                    let mut seen = Vec::new();
                    let mut errors = Vec::new();
                    while Instant::now() < deadline {
                        let p = &policies[usize::from(rng.below(4) == 0)];
                        let sent = now_us();
                        match store.check(&key, p).await {
                            Ok(d) if d.allowed() => seen.push(Admission {
                                sent,
                                answered: now_us(),
                                cost: p.cost(),
                            }),
                            Ok(_) => {}
                            Err(e) => errors.push(format!("store {s}: {e}")),
                        }
                        tokio::time::sleep(Duration::from_micros(rng.below(3_000))).await;
                    }
                    (seen, errors)
                });
            }
        }
        let mut admissions = Vec::new();
        let mut errors = Vec::new();
        while let Some(done) = jobs.join_next().await {
            let (seen, errs) = done.unwrap();
            admissions.extend(seen);
            errors.extend(errs);
        }
        stop.store(true, Ordering::SeqCst);
        stepper.await.unwrap();
        assert!(errors.is_empty(), "{algorithm}: no fault, yet {errors:?}");
        for (window, max) in [(1_000_000, 4), (2_000_000, 9)] {
            for over in windows_over(&admissions, window, max) {
                failures.push(format!("{algorithm}: {over}"));
            }
        }
        assert!(
            fullest_window(&admissions, 1_000_000) >= 3,
            "{algorithm}: the windows never filled: the test shows nothing"
        );
        // The minute's count: exactly the units admitted.
        let units: u64 = admissions.iter().map(|a| a.cost).sum();
        let minute = stores[0].redis_key(tag(algorithm), &key);
        let index = now_us() / 60_000_000;
        let counted = get(&server, &format!("{minute}:60000000:{index}")).unwrap_or(0);
        if counted != i64::try_from(units).unwrap() {
            failures.push(format!(
                "{algorithm}: {units} units admitted, the minute's count says {counted}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A calendar quota ("50/day"), costs 1 and 7, an honest store beside
/// one 2 s ahead and one 2 s behind, every store batching: the day's
/// count admits at most 50 units, fills to exactly 50, and its raw count
/// is exactly the units admitted (denials counted nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_day_admits_exactly_its_max_across_skewed_batching_stores() {
    let server = RedisServer::start();
    away_from_a_boundary(Duration::from_secs(86_400), Duration::from_secs(10)).await;
    let stores = [
        connect(&server).await,
        connect(&server).await.with_clock(SkewedClock::ahead(
            SystemClock::new(),
            Duration::from_secs(2),
        )),
        connect(&server).await.with_clock(SkewedClock::behind(
            SystemClock::new(),
            Duration::from_secs(2),
        )),
    ];
    let one: Policy = "50/day".parse().unwrap();
    let seven = one.clone().with_cost(7).unwrap();
    let policies = Arc::new([one, seven]);
    let units = Arc::new(AtomicU64::new(0));
    let mut jobs = JoinSet::new();
    for (s, store) in stores.iter().enumerate() {
        for t in 0..4u64 {
            let (store, policies, units) =
                (store.clone(), Arc::clone(&policies), Arc::clone(&units));
            jobs.spawn(async move {
                for i in 0..20u64 {
                    let p = &policies[usize::from((i + t + s as u64).is_multiple_of(3))];
                    let d = store.check("day", p).await.unwrap();
                    if d.allowed() {
                        units.fetch_add(p.cost(), Ordering::SeqCst);
                    }
                }
            });
        }
    }
    while let Some(done) = jobs.join_next().await {
        done.unwrap();
    }
    let units = units.load(Ordering::SeqCst);
    let counts: Vec<(String, Option<i64>)> = server
        .keys(&format!("{}:*", stores[0].redis_key("fixed", "day")))
        .into_iter()
        .map(|k| {
            let v = get(&server, &k);
            (k, v)
        })
        .collect();
    assert!(
        units <= 50,
        "{units} units admitted of 50 a day; counts {counts:?}"
    );
    assert_eq!(units, 50, "the day never filled; counts {counts:?}");
    assert_eq!(counts.len(), 1, "one count for the day: {counts:?}");
    assert_eq!(
        counts[0].1,
        Some(50),
        "the raw count is the units admitted: {counts:?}"
    );
}

// ---------------------------------------------------------------------------
// 5. A denied request counts nothing when no fault happens.

/// Bursts of concurrent checks (costs 1, 3 and 5, two rates) from three
/// stores on one key, many denied: once they are answered, every rate's
/// raw count is exactly the units admitted, and a peek agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_burst_with_denials_the_counts_are_exactly_the_admitted_units() {
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for batches in [1, 2, 4] {
        stores.push(connect(&server).await.with_batches(batches));
    }
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        away_from_a_boundary(Duration::from_secs(30), Duration::from_secs(4)).await;
        let text = "23/30s, 40/60s";
        let base = policy(algorithm, text);
        let policies = Arc::new([
            base.clone(),
            base.clone().with_cost(3).unwrap(),
            base.clone().with_cost(5).unwrap(),
        ]);
        let key = format!("burst-{algorithm}");
        let units = Arc::new(AtomicU64::new(0));
        let denials = Arc::new(AtomicU64::new(0));
        for burst in 0..3u64 {
            let mut jobs = JoinSet::new();
            let barrier = Arc::new(tokio::sync::Barrier::new(stores.len() * 6));
            for (s, store) in stores.iter().enumerate() {
                for t in 0..6u64 {
                    let (store, key, policies) =
                        (store.clone(), key.clone(), Arc::clone(&policies));
                    let (units, denials, barrier) = (
                        Arc::clone(&units),
                        Arc::clone(&denials),
                        Arc::clone(&barrier),
                    );
                    jobs.spawn(async move {
                        barrier.wait().await;
                        for i in 0..4u64 {
                            let p = &policies[((burst + s as u64 + t + i) % 3) as usize];
                            let d = store.check(&key, p).await.unwrap();
                            if d.allowed() {
                                units.fetch_add(p.cost(), Ordering::SeqCst);
                            } else {
                                denials.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    });
                }
            }
            while let Some(done) = jobs.join_next().await {
                done.unwrap();
            }
            let units = units.load(Ordering::SeqCst);
            let redis_key = stores[0].redis_key(tag(algorithm), &key);
            for (window, max) in [(30_000_000u64, 23u64), (60_000_000, 40)] {
                let count = get(
                    &server,
                    &format!("{redis_key}:{window}:{}", now_us() / window),
                )
                .unwrap_or(0);
                if count != i64::try_from(units).unwrap() {
                    failures.push(format!(
                        "{algorithm} burst {burst}: {units} units admitted ({} denials so far), \
                         the {window} µs count is {count}",
                        denials.load(Ordering::SeqCst)
                    ));
                }
                assert!(units <= max, "{algorithm}: {units} > {max}");
            }
            // A peek answers as a cost-1 request would be.
            let peek = stores[0].command(&key, &base, Command::Peek).await.unwrap();
            let fits = units < 23;
            for (status, max) in peek.rates().iter().zip([23u64, 40]) {
                let expected = max - units - u64::from(fits);
                if status.remaining() != expected {
                    failures.push(format!(
                        "{algorithm} burst {burst}: peek's remaining {} of {max}, expected \
                         {expected} ({units} units admitted)",
                        status.remaining()
                    ));
                }
            }
        }
        assert!(
            denials.load(Ordering::SeqCst) > 0,
            "{algorithm}: no denial: the test shows nothing"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 6. Faults during batches.

/// Two stores, each through its proxy, three checkers each, costs 1 and
/// 2, two rates, hammer one key for 2 s while a seeded schedule of faults
/// (lost replies, cuts mid-reply, stalls past the timeout, refused
/// connections, every connection cut) hits the proxies. Then: never more
/// than max, a lost reply counted at most once (count ≤ admitted + failed
/// checks' units), and every count key expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_during_batches_never_over_counted_at_most_once_and_expiring() {
    let timeout = Duration::from_millis(300);
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        let server = RedisServer::start();
        let proxies = [
            FaultProxy::start(server.port()),
            FaultProxy::start(server.port()),
        ];
        let mut stores = Vec::new();
        for proxy in &proxies {
            stores.push(faults::open(Connections::Pool, &proxy.url(), timeout).await);
        }
        let base = policy(algorithm, "6/30s, 9/60s");
        for store in &stores {
            assert!(store.check("warm", &base).await.unwrap().allowed());
        }
        let policies = Arc::new([base.clone(), base.clone().with_cost(2).unwrap()]);
        let key = format!("faults-{algorithm}");
        let redis_key = stores[0].redis_key(tag(algorithm), &key);
        away_from_a_boundary(Duration::from_secs(30), Duration::from_secs(6)).await;
        let deadline = Instant::now() + Duration::from_secs(2);
        let admitted = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let mut jobs = JoinSet::new();
        for (s, store) in stores.iter().enumerate() {
            for c in 0..3u64 {
                let (store, key, policies) = (store.clone(), key.clone(), Arc::clone(&policies));
                let (admitted, failed) = (Arc::clone(&admitted), Arc::clone(&failed));
                let mut rng = Rng::new(0xfa17 + s as u64 * 8 + c);
                jobs.spawn(async move {
                    while Instant::now() < deadline {
                        let p = &policies[usize::from(rng.below(3) == 0)];
                        match store.check(&key, p).await {
                            Ok(d) if d.allowed() => {
                                admitted.fetch_add(p.cost(), Ordering::SeqCst);
                            }
                            Ok(_) => {}
                            Err(_) => {
                                failed.fetch_add(p.cost(), Ordering::SeqCst);
                            }
                        }
                        tokio::time::sleep(faults::millis(&mut rng, 3, 20)).await;
                    }
                });
            }
        }
        let mut rng = Rng::new(faults::fault_seed(0xbad5eed));
        let spans = FaultSpans {
            hang: (100, 500),
            held: (50, 500),
            stall: (50, 400),
            refused: (50, 300),
        };
        let mut fired = 0;
        while Instant::now() + Duration::from_millis(200) < deadline {
            let proxy = &proxies[rng.below(2) as usize];
            random_fault(proxy, Match::any().arg(&redis_key), &mut rng, &spans).await;
            fired += 1;
            tokio::time::sleep(faults::millis(&mut rng, 40, 160)).await;
        }
        while let Some(done) = jobs.join_next().await {
            done.unwrap();
        }
        for proxy in &proxies {
            proxy.heal();
            proxy.accept();
        }
        // Held requests land.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let admitted = admitted.load(Ordering::SeqCst);
        let failed = failed.load(Ordering::SeqCst);
        if admitted > 6 {
            failures.push(format!("{algorithm}: {admitted} units admitted of 6"));
        }
        let count = get(
            &server,
            &format!("{redis_key}:30000000:{}", now_us() / 30_000_000),
        )
        .unwrap_or(0);
        let count = u64::try_from(count).unwrap_or(0);
        if count < admitted || count > admitted + failed {
            failures.push(format!(
                "{algorithm}: count {count}, {admitted} units admitted, {failed} failed: a lost \
                 reply counts at most once and an admission exactly once"
            ));
        }
        let bad = keys_without_ttl(&server);
        if !bad.is_empty() {
            failures.push(format!("{algorithm}: keys without expiry {bad:?}"));
        }
        assert!(fired > 3, "{algorithm}: only {fired} faults");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each way of losing a batch's reply (dropped and closed, dropped and
/// hung, cut mid-reply, late request, stalled reply), for an admitted and
/// a denied check of cost 3: the count grows by 0 or 3 (at most once), by
/// 3 when the check says admitted, by 0 when it says denied, and every key
/// expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_batch_reply_counts_at_most_once() {
    let timeout = Duration::from_millis(300);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = faults::open(Connections::Pool, &proxy.url(), timeout).await;
    let mut failures = Vec::new();
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(8)).await;
    for algorithm in WINDOW_COUNTERS {
        let one = policy(algorithm, "10/60s");
        let three = one.clone().with_cost(3).unwrap();
        assert!(store.check("warm", &one).await.unwrap().allowed());
        for loss in [
            Loss::DropClose,
            Loss::DropHang,
            Loss::Cut,
            Loss::Late,
            Loss::Stalled,
        ] {
            for before in [0u64, 8] {
                let key = format!("lost-{algorithm}-{loss:?}-{before}");
                let redis_key = store.redis_key(tag(algorithm), &key);
                let count_key = format!("{redis_key}:60000000:{}", now_us() / 60_000_000);
                // (A connection cut by the last fault fails a check or two.)
                let mut tries = 0;
                while get(&server, &count_key).unwrap_or(0) < i64::try_from(before).unwrap() {
                    tries += 1;
                    assert!(
                        tries < 50,
                        "{algorithm} {loss:?}: the store does not answer"
                    );
                    if store.check(&key, &one).await.is_err() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                let before = u64::try_from(get(&server, &count_key).unwrap_or(0)).unwrap();
                loss.arm(&proxy, Match::any().arg(&redis_key), timeout);
                let outcome = store.check(&key, &three).await;
                assert_eq!(
                    proxy.armed(),
                    0,
                    "{algorithm} {loss:?}: the fault did not fire"
                );
                loss.settle().await;
                proxy.heal();
                proxy.cut_all();
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Connections again (the cut ones fail a check or two).
                let mut tries = 0;
                while store.check("warm", &one).await.is_err() {
                    tries += 1;
                    assert!(
                        tries < 50,
                        "{algorithm} {loss:?}: the store does not answer"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let count = u64::try_from(get(&server, &count_key).unwrap_or(0)).unwrap();
                let ok = match &outcome {
                    Ok(d) if d.allowed() => count == before + 3,
                    Ok(_) => count == before,
                    Err(_) => count == before || count == before + 3,
                };
                if !ok {
                    failures.push(format!(
                        "{algorithm} {loss:?}, {before} counted: the check ({}) left the count \
                         at {count}",
                        show(&outcome)
                    ));
                }
            }
        }
    }
    let bad = keys_without_ttl(&server);
    assert!(bad.is_empty(), "keys without expiry {bad:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Refused connections: a batched check fails at once (not after the
/// timeout) and counts nothing; once Redis accepts again, checks go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_fails_a_batched_check_at_once_and_counts_nothing() {
    let timeout = Duration::from_secs(1);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = faults::open(Connections::Pool, &proxy.url(), timeout).await;
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
    for algorithm in WINDOW_COUNTERS {
        let limit = policy(algorithm, "10/60s");
        let key = format!("refused-{algorithm}");
        assert!(store.check(&key, &limit).await.unwrap().allowed());
        proxy.refuse();
        let started = Instant::now();
        let outcome = store.check(&key, &limit).await;
        assert!(outcome.is_err(), "{algorithm}: {}", show(&outcome));
        assert!(
            started.elapsed() < timeout / 2,
            "{algorithm}: a refused connection took {:?}",
            started.elapsed()
        );
        proxy.accept();
        let mut d = store.check(&key, &limit).await;
        for _ in 0..20 {
            if d.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            d = store.check(&key, &limit).await;
        }
        // One admitted before, the one just now: 10 - 2.
        assert_eq!(d.unwrap().remaining(), 8, "{algorithm}");
    }
}

// ---------------------------------------------------------------------------
// 7. Operator commands between batched checks: MemoryStore's semantics.

/// A seeded sequence of checks (costs 1 and 3) and operator commands
/// (peek, reset, block, unblock, penalty, reward), the same on MemoryStore
/// (a manual clock set to this machine's time before each step), on a
/// batching RedisStore and on one checking alone: the same admissions,
/// blocks and remaining counts, resets and waits within the time between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_between_batched_checks_keep_memory_semantics() {
    let server = RedisServer::start();
    let batched = connect(&server).await;
    let alone = connect(&server).await.with_batches(0);
    let clock = ManualClock::new(now_duration());
    let memory = MemoryStore::with_clock(clock.clone());
    let mut failures = Vec::new();
    for algorithm in WINDOW_COUNTERS {
        let one = policy(algorithm, "10/30s, 25/60s");
        let three = one.clone().with_cost(3).unwrap();
        for seed in 1..=4u64 {
            away_from_a_boundary(Duration::from_secs(30), Duration::from_secs(3)).await;
            let mut rng = Rng::new(seed * 0x2545_f491);
            let key = format!("ops-{algorithm}-{seed}");
            let (kb, ka) = (format!("{key}-b"), format!("{key}-a"));
            let mut log = Vec::new();
            // The longest a step took: a block or a window's state set at
            // one step carries the time between the three stores' decisions
            // of that step into every later one.
            let mut slowest = Duration::ZERO;
            for step in 0..40 {
                let op = rng.below(12);
                let units = 1 + rng.below(7);
                let what = match op {
                    0 => "peek".to_owned(),
                    1 => "reset".to_owned(),
                    2 => "block 30s".to_owned(),
                    3 => "unblock".to_owned(),
                    4 => format!("penalty {units}"),
                    5 | 6 => format!("reward {units}"),
                    7..=8 => "check cost 3".to_owned(),
                    _ => "check".to_owned(),
                };
                log.push(what.clone());
                let command = match op {
                    0 => Some(Command::Peek),
                    1 => Some(Command::Reset),
                    2 => Some(Command::Block(Duration::from_secs(30))),
                    3 => Some(Command::Block(Duration::ZERO)),
                    4 => Some(Command::Penalty(units)),
                    5 | 6 => Some(Command::Reward(units)),
                    _ => None,
                };
                let p = if (7..=8).contains(&op) { &three } else { &one };
                let started = Instant::now();
                clock.set(now_duration());
                let (m, b, a) = match command {
                    Some(command) => (
                        memory.command(&key, p, command).await,
                        batched.command(&kb, p, command).await,
                        alone.command(&ka, p, command).await,
                    ),
                    None => (
                        memory.check(&key, p).await,
                        batched.check(&kb, p).await,
                        alone.check(&ka, p).await,
                    ),
                };
                slowest = slowest.max(started.elapsed());
                let slack = slowest + Duration::from_millis(5);
                let (m, b, a) = (m.unwrap(), b.unwrap(), a.unwrap());
                for (who, d) in [("batched", &b), ("alone", &a)] {
                    if let Some(diff) = differs(&m, d, slack) {
                        failures.push(format!(
                            "{algorithm} seed {seed} step {step} ({what}), {who} vs memory: \
                             {diff}; steps {log:?}"
                        ));
                    }
                }
                if failures.len() > 6 {
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// How `d` differs from `expected`: admission, block, each rate's
/// remaining; its reset and wait by more than `slack`.
fn differs(expected: &Decision, d: &Decision, slack: Duration) -> Option<String> {
    if expected.allowed() != d.allowed() || expected.blocked() != d.blocked() {
        return Some(format!(
            "allowed {} blocked {} (expected allowed {} blocked {})",
            d.allowed(),
            d.blocked(),
            expected.allowed(),
            expected.blocked()
        ));
    }
    for (i, (x, y)) in expected.rates().iter().zip(d.rates()).enumerate() {
        if x.remaining() != y.remaining() {
            return Some(format!(
                "rate {i}: remaining {} (expected {})",
                y.remaining(),
                x.remaining()
            ));
        }
        if x.reset().abs_diff(y.reset()) > slack {
            return Some(format!(
                "rate {i}: reset {:?} (expected {:?})",
                y.reset(),
                x.reset()
            ));
        }
        if x.wait().abs_diff(y.wait()) > slack {
            return Some(format!(
                "rate {i}: wait {:?} (expected {:?})",
                y.wait(),
                x.wait()
            ));
        }
    }
    if expected.retry_after().abs_diff(d.retry_after()) > slack {
        return Some(format!(
            "retry after {:?} (expected {:?})",
            d.retry_after(),
            expected.retry_after()
        ));
    }
    None
}

// ---------------------------------------------------------------------------
// 8. The same decision batched as alone, for random policies.

/// A random window-counter policy (cost included) and each rate's window
/// (µs) and max.
fn random_policy(rng: &mut Rng) -> (Policy, Vec<(u64, u64)>) {
    let sliding = rng.below(2) == 0;
    let mut choices: Vec<(&str, u64)> = vec![
        ("1s", 1_000_000),
        ("2s", 2_000_000),
        ("3s", 3_000_000),
        ("5s", 5_000_000),
        ("60s", 60_000_000),
    ];
    if !sliding {
        choices.push(("day", 86_400_000_000));
    }
    let n = 1 + rng.below(3) as usize;
    let mut picked = Vec::new();
    while picked.len() < n {
        let c = choices[rng.below(choices.len() as u64) as usize];
        if !picked.iter().any(|(name, _): &(&str, u64)| *name == c.0) {
            picked.push(c);
        }
    }
    let mut rates = Vec::new();
    let mut text = Vec::new();
    for (name, micros) in &picked {
        let max = 2 + rng.below(11);
        rates.push((*micros, max));
        text.push(format!("{max}/{name}"));
    }
    let text = text.join(", ");
    let policy = if sliding {
        policy(SLIDING, &text)
    } else {
        policy(FIXED, &text)
    };
    let smallest = rates.iter().map(|r| r.1).min().unwrap();
    let cost = 1 + rng.below(smallest.min(4));
    (policy.with_cost(cost).unwrap(), rates)
}

/// Random policies (fixed or sliding window, one to three rates of 1 s to
/// a day, random maxes and costs), each checked in the same sequence on a
/// batching store and on one checking alone (one script per check), on
/// two keys of one Redis, with pauses that cross windows: the same
/// admissions and remaining counts, each rate's raw counts equal after
/// every step, reset, wait and retry-after within the time between the
/// two checks. (A step close to a window boundary, or where the sliding
/// window's previous count would weigh differently between the two checks,
/// is moved past it or compared loosely.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_decision_is_the_single_checks_for_random_policies() {
    let server = RedisServer::start();
    let batched = connect(&server).await;
    let alone = connect(&server).await.with_batches(0);
    let mut rng = Rng::new(faults::fault_seed(0x00c0_ffee));
    let mut failures = Vec::new();
    let mut loose = 0;
    let mut compared = 0;
    for p in 0..8 {
        let (base, rates) = random_policy(&mut rng);
        let sliding = base.algorithm() == tower_redis_ratelimit::Algorithm::SlidingWindow;
        let one = base.clone().with_cost(1).unwrap();
        let (kb, ka) = (format!("parity-{p}-b"), format!("parity-{p}-a"));
        let t = tag(if sliding { SLIDING } else { FIXED });
        let (rb, ra) = (batched.redis_key(t, &kb), alone.redis_key(t, &ka));
        'steps: for step in 0..12 {
            // Not within 8 ms of a boundary of any rate.
            loop {
                let now = now_us();
                let near = rates.iter().map(|(w, _)| w - now % w).min().unwrap();
                if near > 8_000 {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(near + 3_000)).await;
            }
            let policy = if rng.below(2) == 0 { &base } else { &one };
            let t0 = now_us();
            // Each sliding rate's previous count (equal on both keys, as
            // checked below after each step).
            let previous: Vec<i64> = rates
                .iter()
                .map(|(w, _)| get(&server, &format!("{rb}:{w}:{}", t0 / w - 1)).unwrap_or(0))
                .collect();
            let first_batched = rng.below(2) == 0;
            let (b, a) = if first_batched {
                let b = batched.check(&kb, policy).await.unwrap();
                (b, alone.check(&ka, policy).await.unwrap())
            } else {
                let a = alone.check(&ka, policy).await.unwrap();
                (batched.check(&kb, policy).await.unwrap(), a)
            };
            let t1 = now_us();
            let crossed = rates.iter().any(|(w, _)| t0 / w != t1 / w);
            // The sliding window's weight of the previous count:
            // ceil(prev × (w − elapsed) / w) the same over the interval.
            let stable = !sliding
                || rates.iter().zip(&previous).all(|((w, _), &prev)| {
                    let weight = |t: u64| {
                        let elapsed = u128::from(t % w);
                        let prev = u128::try_from(prev.max(0)).unwrap();
                        (prev * (u128::from(*w) - elapsed)).div_ceil(u128::from(*w))
                    };
                    t0 / w == (t1 + 2_000) / w
                        && weight(t0.saturating_sub(2_000)) == weight(t1 + 2_000)
                });
            if crossed || !stable {
                loose += 1;
                if a.allowed() != b.allowed() {
                    // The two keys went apart on time alone: next policy.
                    break 'steps;
                }
                continue;
            }
            compared += 1;
            let slack = Duration::from_micros(t1 - t0) + Duration::from_millis(3);
            if let Some(diff) = differs(&a, &b, slack) {
                failures.push(format!(
                    "policy {p} ({:?}, cost {}), step {step}, batched vs alone: {diff}",
                    base.rates()
                        .iter()
                        .map(|r| format!("{}/{:?}", r.max(), r.window()))
                        .collect::<Vec<_>>(),
                    policy.cost()
                ));
            }
            // The raw counts: equal on both keys, rate by rate.
            for (w, _) in &rates {
                let index = t1 / w;
                for i in [index, index.saturating_sub(1)] {
                    let (x, y) = (
                        get(&server, &format!("{rb}:{w}:{i}")).unwrap_or(0),
                        get(&server, &format!("{ra}:{w}:{i}")).unwrap_or(0),
                    );
                    if *w != 86_400_000_000 && x != y {
                        failures.push(format!(
                            "policy {p} step {step}: the {w} µs count {i}: batched {x}, alone {y}"
                        ));
                    }
                }
            }
            if failures.len() > 6 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.below(120))).await;
        }
    }
    eprintln!("parity: {compared} steps compared exactly, {loose} loosely");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        loose < 40 && compared > 50,
        "{compared} steps compared, {loose} loosely: the test shows little"
    );
}
