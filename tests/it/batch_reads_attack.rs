//! Attacks on what the window counters' batches read instead of counting:
//! the sliding window's previous counts known in process
//! (`PreviousCounts`), and the keys found full, read in the batch's
//! transaction (`FullKeys`). Real redis-server processes; the exact
//! decisions come from `MemoryStore` on the same (system) clock, with
//! margins where time moves under them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::RedisServer;
use crate::support::contention;
use crate::support::faults::show_decision as show;
use crate::support::harness::{MS, away_from_a_boundary, just_into_a_window, now_us};
use crate::support::proxy::{AfterDrop, FaultProxy, Match};
use crate::support::window_counters::{FIXED, SLIDING, policy, tag};
use tower_redis_ratelimit::clock::{SkewedClock, SystemClock};
use tower_redis_ratelimit::policy::MAX_MAX;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{
    Algorithm, Decision, MemoryStore, Policy, Rate, RedisStore, Store, StoreError,
};

/// A batching store (the default) with a generous timeout.
async fn batched(url: &str) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5))
}

/// How far into its window of `window` this machine's clock is.
fn into_window(window: Duration) -> Duration {
    let w = u64::try_from(window.as_micros()).unwrap();
    Duration::from_micros(now_us() % w)
}

/// The differences between Redis's decision `r` and the exact one `m`
/// (allowed, blocked and remaining equal; retry_after and reset within
/// `tolerance`).
fn differences(step: &str, r: &Decision, m: &Decision, tolerance: Duration) -> Option<String> {
    let same = r.allowed() == m.allowed()
        && r.blocked() == m.blocked()
        && r.remaining() == m.remaining()
        && r.retry_after().abs_diff(m.retry_after()) <= tolerance
        && r.reset().abs_diff(m.reset()) <= tolerance;
    (!same).then(|| format!("{step}:\n  redis  {}\n  memory {}", show(r), show(m)))
}

/// One step of a sequence run on a Redis store and on the memory store.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// A check of the policy at this index.
    Check(usize),
    Command(usize, Command),
}

/// Run `ops` on `key` on both stores (the memory store on the system
/// clock), comparing every answer; the differences.
async fn run_both(
    redis: &RedisStore,
    memory: &MemoryStore,
    key: &str,
    policies: &[Policy],
    ops: &[Op],
    label: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let (r, m) = match *op {
            Op::Check(p) => (
                redis.check(key, &policies[p]).await.unwrap(),
                memory.check(key, &policies[p]).await.unwrap(),
            ),
            Op::Command(p, command) => (
                redis.command(key, &policies[p], command).await.unwrap(),
                memory.command(key, &policies[p], command).await.unwrap(),
            ),
        };
        let step = format!(
            "{label} step {i} {op:?} (cost {})",
            policy_of(op, policies).cost()
        );
        out.extend(differences(&step, &r, &m, 100 * MS));
    }
    out
}

fn policy_of<'a>(op: &Op, policies: &'a [Policy]) -> &'a Policy {
    match *op {
        Op::Check(p) | Op::Command(p, _) => &policies[p],
    }
}

// ---------------------------------------------------------------------------
// 1. A key found full is read in the transaction, and a check denied on the
//    counts read is answered there. Another store's denied cost, counted and
//    not yet given back, is in those counts.

/// Store B holds a key full (8 of 10 counted, a cost-3 check denied). Store
/// A, which never found it full, counts a cost-3 check (8 + 3 > 10):
/// denied, its cost given back one round trip later (held here on its way
/// to Redis for 800 ms). Meanwhile B's cost-1 check (8 + 1 ≤ 10) sees A's
/// cost still counted: as the guide says, it may be denied (the script
/// would read the same counts; this was so before checks of keys held full
/// were read). Once A's cost is given back, B's checks are admitted, and
/// the window admits exactly its max: never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_check_amid_another_stores_denied_cost_admits_exactly_the_max_after() {
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let a = batched(&proxy.url()).await;
    let b = batched(&server.url()).await;
    let mut failures = Vec::new();
    for algorithm in [FIXED, SLIDING] {
        let one = policy(algorithm, "10/4s");
        let three = one.clone().with_cost(3).unwrap();
        assert!(b.denials_are_final(&one));
        just_into_a_window(Duration::from_secs(4), 50 * MS).await;
        let key = format!("inflight-{algorithm}");
        for i in 0..8 {
            assert!(
                b.check(&key, &one).await.unwrap().allowed(),
                "{algorithm} {i}"
            );
        }
        // B finds it full for a cost of 3: B's checks of it are read now.
        assert!(!b.check(&key, &three).await.unwrap().allowed());
        // A's give-back (the first script A sends of this key) is held.
        proxy.stall_next_request(Match::command("EVALSHA").arg(&key), 800 * MS);
        let pending = {
            let (a, key, three) = (a.clone(), key.clone(), three.clone());
            tokio::spawn(async move { a.check(&key, &three).await })
        };
        tokio::time::sleep(250 * MS).await;
        let count_key = format!(
            "{}:4000000:{}",
            b.redis_key(tag(algorithm), &key),
            now_us() / 4_000_000
        );
        let raw = server.command(&["GET", &count_key]);
        let d = b.check(&key, &one).await.unwrap();
        let answered = Instant::now();
        let late = pending.await.unwrap().unwrap();
        assert!(
            !late.allowed(),
            "{algorithm}: A's 8 + 3 > 10: {}",
            show(&late)
        );
        let mut next_admitted = false;
        if !d.allowed() {
            let next = b.check(&key, &one).await.unwrap();
            next_admitted = next.allowed();
            if !next_admitted {
                failures.push(format!(
                    "{algorithm}: 8 of 10 admitted, B's cost-1 check denied ({}) while A's \
                     denied cost-3 check was counted and not yet given back (raw count {}); \
                     {:?} later, after the give-back, still denied: {}",
                    show(&d),
                    raw.lines().last().unwrap_or_default(),
                    answered.elapsed(),
                    show(&next)
                ));
            }
        }
        // Whatever happened, the window admits exactly its max.
        let mut after = Vec::new();
        for _ in 0..5 {
            after.push(b.check(&key, &one).await.unwrap());
        }
        let more = after.iter().filter(|d| d.allowed()).count() as u64;
        let total = 8 + u64::from(d.allowed()) + u64::from(next_admitted) + more;
        if total != 10 {
            failures.push(format!(
                "{algorithm}: the window admitted {total} of 10; B's check during the \
                 give-back: {}; A's: {}; then: {}",
                show(&d),
                show(&late),
                after.iter().map(show).collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The same race without a fault: store A floods a key 8/10 full with
/// cost-3 checks (each counted, denied, given back), store B (which holds
/// the key full) sends cost-1 checks meanwhile. The exact algorithm admits
/// exactly two of B's checks; B's denials are final by its word, so once a
/// B check was denied with retry_after t, no B check may be admitted
/// before t.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_denials_amid_another_stores_denied_costs_are_final() {
    let server = RedisServer::start();
    let a = batched(&server.url()).await;
    let b = batched(&server.url()).await;
    let mut failures = Vec::new();
    for algorithm in [FIXED, SLIDING] {
        let one = policy(algorithm, "10/4s");
        let three = one.clone().with_cost(3).unwrap();
        just_into_a_window(Duration::from_secs(4), 50 * MS).await;
        let key = format!("flood-{algorithm}");
        for _ in 0..8 {
            assert!(b.check(&key, &one).await.unwrap().allowed());
        }
        assert!(!b.check(&key, &three).await.unwrap().allowed());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flooders: Vec<_> = (0..6)
            .map(|_| {
                let (a, key, three, stop) =
                    (a.clone(), key.clone(), three.clone(), Arc::clone(&stop));
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        assert!(!a.check(&key, &three).await.unwrap().allowed());
                    }
                })
            })
            .collect();
        tokio::time::sleep(50 * MS).await;
        let mut admitted = 0;
        let mut denied_until: Option<(Instant, String)> = None;
        let started = Instant::now();
        while admitted < 2 && started.elapsed() < Duration::from_millis(1500) {
            let asked = Instant::now();
            let d = b.check(&key, &one).await.unwrap();
            if d.allowed() {
                admitted += 1;
                if let Some((until, what)) = &denied_until
                    && asked < *until
                {
                    failures.push(format!(
                        "{algorithm}: a B check was denied ({what}), final by the store's \
                         word, yet a B check asked {:?} before that denial ended was admitted",
                        *until - asked
                    ));
                    denied_until = None;
                }
            } else if denied_until.is_none() {
                denied_until = Some((Instant::now() + d.retry_after(), show(&d)));
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for f in flooders {
            f.await.unwrap();
        }
        assert!(admitted <= 2, "{algorithm}: {admitted} admitted of 2 left");
        if admitted < 2 {
            failures.push(format!(
                "{algorithm}: 8 of 10 used, only {admitted} of B's cost-1 checks admitted in \
                 1.5 s amid A's denied cost-3 checks"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 2. The sliding window's previous counts held in process.

/// A process whose clock is windows away from Redis's (its batches place
/// their windows on Redis's clock, measured): its own reset must drop the
/// previous count it holds of the key, so the next check is told the room
/// the reset made (9 of 10 after one check), as with an honest clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn own_reset_drops_the_held_previous_count_whatever_the_local_clock() {
    let server = RedisServer::start();
    let policy = policy(SLIDING, "10/2s");
    let window = Duration::from_secs(2);
    let mut failures = Vec::new();
    for (label, skew) in [
        ("honest", None),
        ("ahead", Some(true)),
        ("behind", Some(false)),
    ] {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let store = match skew {
            None => store,
            Some(true) => store.with_clock(SkewedClock::ahead(SystemClock::new(), 5 * window / 2)),
            Some(false) => {
                store.with_clock(SkewedClock::behind(SystemClock::new(), 5 * window / 2))
            }
        }
        .with_timeout(Duration::from_secs(5));
        // Two batches measure Redis's clock.
        for _ in 0..2 {
            store
                .check(&format!("warm-{label}"), &policy)
                .await
                .unwrap();
        }
        let key = format!("own-reset-{label}");
        just_into_a_window(window, 30 * MS).await;
        for _ in 0..6 {
            assert!(
                store.check(&key, &policy).await.unwrap().allowed(),
                "{label}"
            );
        }
        just_into_a_window(window, 30 * MS).await;
        // Read (6 × ~0.98 weigh) and held.
        let d = store.check(&key, &policy).await.unwrap();
        assert!(d.allowed() && d.remaining() == 3, "{label}: {}", show(&d));
        store.command(&key, &policy, Command::Reset).await.unwrap();
        let d = store.check(&key, &policy).await.unwrap();
        assert!(d.allowed(), "{label}: {}", show(&d));
        if d.remaining() != 9 {
            failures.push(format!(
                "{label}: after its own reset, the check is told {} remaining, the truth is 9 \
                 (the previous count held survived the reset)",
                d.remaining()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Another store's reward and reset of a key whose previous count this
/// store holds: every check admitted or denied exactly as the memory store
/// decides, and `remaining` never above the exact one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_stores_reward_and_reset_never_change_a_decision_nor_raise_remaining() {
    let server = RedisServer::start();
    let a = batched(&server.url()).await;
    let b = batched(&server.url()).await;
    let memory = MemoryStore::new();
    let policy = policy(SLIDING, "10/4s");
    let window = Duration::from_secs(4);
    let key = "others-commands";
    let mut failures = Vec::new();
    just_into_a_window(window, 30 * MS).await;
    for _ in 0..7 {
        assert!(a.check(key, &policy).await.unwrap().allowed());
        assert!(memory.check(key, &policy).await.unwrap().allowed());
    }
    just_into_a_window(window, 30 * MS).await;
    let step = |what: String, r: &Decision, m: &Decision, failures: &mut Vec<String>| {
        if r.allowed() != m.allowed() || r.remaining() > m.remaining() {
            failures.push(format!(
                "{what}:\n  redis  {}\n  memory {}",
                show(r),
                show(m)
            ));
        }
    };
    // Held: 7.
    let r = a.check(key, &policy).await.unwrap();
    let m = memory.check(key, &policy).await.unwrap();
    step("first check".into(), &r, &m, &mut failures);
    for (round, command) in [Command::Reward(4), Command::Reset, Command::Reward(3)]
        .into_iter()
        .enumerate()
    {
        b.command(key, &policy, command).await.unwrap();
        memory.command(key, &policy, command).await.unwrap();
        for i in 0..12 {
            let r = a.check(key, &policy).await.unwrap();
            let m = memory.check(key, &policy).await.unwrap();
            step(
                format!("after B's {command:?} (round {round}), check {i}"),
                &r,
                &m,
                &mut failures,
            );
        }
        // The weights (7 × (1 − elapsed / 4 s)) in the same integers.
        assert!(
            into_window(window) < Duration::from_millis(520),
            "too slow: the weights moved"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A held previous count never outlives its window: the window after the
/// next reads the count of the window that became previous (a 1 s window:
/// 6 in the first, 2 in the second, then the third weighs the 2 only).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_previous_count_is_not_used_after_the_window_rolls() {
    let server = RedisServer::start();
    let store = batched(&server.url()).await;
    let memory = MemoryStore::new();
    let policy = policy(SLIDING, "10/1s");
    let window = Duration::from_secs(1);
    let mut failures = Vec::new();
    for round in 0..3 {
        let key = format!("roll-{round}");
        just_into_a_window(window, 30 * MS).await;
        for _ in 0..6 {
            assert!(store.check(&key, &policy).await.unwrap().allowed());
            assert!(memory.check(&key, &policy).await.unwrap().allowed());
        }
        just_into_a_window(window, 30 * MS).await;
        for _ in 0..2 {
            let r = store.check(&key, &policy).await.unwrap();
            let m = memory.check(&key, &policy).await.unwrap();
            failures.extend(differences(
                &format!("round {round} second window"),
                &r,
                &m,
                50 * MS,
            ));
        }
        just_into_a_window(window, 30 * MS).await;
        for i in 0..10 {
            let r = store.check(&key, &policy).await.unwrap();
            let m = memory.check(&key, &policy).await.unwrap();
            failures.extend(differences(
                &format!("round {round} third window check {i}"),
                &r,
                &m,
                50 * MS,
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 3. Sequences against the memory store: costs per check, several rates,
//    blocks, resets, rewards, penalties, the read path.

fn sequence_ops() -> Vec<Op> {
    use Op::{Check, Command as C};
    vec![
        Check(0),
        Check(1),
        Check(0),
        Check(1), // likely denied: held full
        Check(0),
        Check(0),
        Check(1),
        Check(2),
        C(0, Command::Reward(2)),
        Check(1),
        Check(0),
        Check(0),
        Check(2),
        C(0, Command::Penalty(1)),
        Check(0),
        C(0, Command::Block(Duration::from_secs(30))),
        Check(0),
        Check(1),
        C(0, Command::Block(Duration::ZERO)),
        Check(0),
        Check(1),
        C(0, Command::Reset),
        Check(1),
        Check(1),
        Check(0),
        Check(2),
        Check(0),
        Check(0),
        C(1, Command::Reward(1)),
        Check(0),
        Check(0),
        C(0, Command::Peek),
    ]
}

/// Fixed window, "3/2s, 5/4s" at costs 1, 2 and 3, and a calendar day with
/// costs: every decision (allowed, remaining, retry_after, reset) is the
/// memory store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fixed_window_sequences_match_the_memory_store() {
    let server = RedisServer::start();
    let redis = batched(&server.url()).await;
    let memory = MemoryStore::new();
    let mut failures = Vec::new();
    for (i, text) in ["3/2s, 5/4s", "5/4s", "4/2s, 9/day"]
        .into_iter()
        .enumerate()
    {
        let base = policy(FIXED, text);
        let policies = [
            base.clone(),
            base.clone().with_cost(2).unwrap(),
            base.clone().with_cost(3).unwrap(),
        ];
        just_into_a_window(Duration::from_secs(4), 50 * MS).await;
        let key = format!("seq-fixed-{i}");
        failures.extend(run_both(&redis, &memory, &key, &policies, &sequence_ops(), text).await);
        assert!(into_window(Duration::from_secs(4)) < Duration::from_millis(1500));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sliding window, "6/2s, 10/4s" at costs 1, 2 and 3, with both previous
/// windows counted (4 units, early in the second half of a 4 s window),
/// run early in the next window (the weights stay in the same integers
/// for the 400 ms the sequence may take): every decision is the memory
/// store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sliding_window_sequences_match_the_memory_store() {
    let server = RedisServer::start();
    let redis = batched(&server.url()).await;
    let memory = MemoryStore::new();
    let mut failures = Vec::new();
    for (i, text) in ["6/2s, 10/4s", "10/4s"].into_iter().enumerate() {
        let base = policy(SLIDING, text);
        let policies = [
            base.clone(),
            base.clone().with_cost(2).unwrap(),
            base.clone().with_cost(3).unwrap(),
        ];
        // A run slowed down past the 400 ms (a loaded machine) is run
        // again on another key: the weights may have moved under it.
        let mut attempt = 0;
        loop {
            let key = format!("seq-sliding-{i}-{attempt}");
            // Into the second half of a 4 s window.
            just_into_a_window(Duration::from_secs(4), Duration::ZERO).await;
            tokio::time::sleep(Duration::from_millis(2050)).await;
            for _ in 0..4 {
                assert!(redis.check(&key, &policies[0]).await.unwrap().allowed());
                assert!(memory.check(&key, &policies[0]).await.unwrap().allowed());
            }
            just_into_a_window(Duration::from_secs(4), 30 * MS).await;
            let found = run_both(&redis, &memory, &key, &policies, &sequence_ops(), text).await;
            if into_window(Duration::from_secs(4)) < Duration::from_millis(420) {
                failures.extend(found);
                break;
            }
            attempt += 1;
            assert!(attempt < 3, "too slow three times: the weights moved");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Maxes at MAX_MAX (2^53) and costs of 2^52: the batched checks (counted
/// and read) decide as the memory store does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn maxes_near_max_max_match_the_memory_store() {
    let server = RedisServer::start();
    let redis = batched(&server.url()).await;
    let memory = MemoryStore::new();
    let mut failures = Vec::new();
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let base = Policy::new([Rate::new(MAX_MAX, Duration::from_secs(4)).unwrap()])
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap();
        let policies = [
            base.clone().with_cost(1 << 52).unwrap(),
            base.clone(),
            base.clone().with_cost(MAX_MAX).unwrap(),
        ];
        use Op::{Check, Command as C};
        let ops = [
            Check(0),
            Check(0),
            Check(0),
            Check(1),
            C(0, Command::Reward(1 << 52)),
            Check(1),
            Check(0),
            Check(1),
            C(0, Command::Reward(u64::MAX)),
            Check(2),
            Check(1),
            C(0, Command::Reset),
            C(0, Command::Penalty(u64::MAX)),
            Check(1),
            Check(2),
            C(0, Command::Reward(3)),
            Check(1),
            Check(1),
            Check(1),
            Check(1),
        ];
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(2500)).await;
        let key = format!("huge-{algorithm:?}");
        failures.extend(
            run_both(
                &redis,
                &memory,
                &key,
                &policies,
                &ops,
                &format!("{algorithm:?}"),
            )
            .await,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// 4. Contention, two stores, several rates and costs: never over a max.

/// Two stores (each holding the key full once it finds it full), costs 1
/// and 3, two rates: under bursts, no rate admits more than its max; the
/// units left are then admitted exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_bursts_with_costs_never_exceed_a_max() {
    let server = RedisServer::start();
    let stores = [batched(&server.url()).await, batched(&server.url()).await];
    for algorithm in [FIXED, SLIDING] {
        let one = policy(algorithm, "9/2s, 12/4s");
        let three = one.clone().with_cost(3).unwrap();
        just_into_a_window(Duration::from_secs(4), 30 * MS).await;
        let key = format!("burst-{algorithm}");
        let mut units = 0u64;
        for burst in 0..3 {
            let mut tasks = Vec::new();
            for (s, store) in stores.iter().enumerate() {
                let checks = (0..24)
                    .map(|i| {
                        (
                            key.clone(),
                            if (i + s) % 3 == 0 {
                                three.clone()
                            } else {
                                one.clone()
                            },
                        )
                    })
                    .collect::<Vec<_>>();
                let store = store.clone();
                tasks.push(tokio::spawn(async move {
                    let costs: Vec<u64> = checks.iter().map(|(_, p)| p.cost()).collect();
                    let decisions = contention::all_at_once(&store, checks).await;
                    decisions
                        .into_iter()
                        .zip(costs)
                        .filter(|(d, _)| d.as_ref().unwrap().allowed())
                        .map(|(_, c)| c)
                        .sum::<u64>()
                }));
            }
            for t in tasks {
                units += t.await.unwrap();
            }
            assert!(
                units <= 9,
                "{algorithm}: burst {burst}: {units} units admitted of 9/2s"
            );
        }
        // The rest, one unit at a time, up to exactly 9.
        for _ in 0..12 {
            units += u64::from(stores[0].check(&key, &one).await.unwrap().allowed());
        }
        assert!(
            into_window(Duration::from_secs(4)) < Duration::from_millis(1900),
            "too slow"
        );
        assert_eq!(
            units, 9,
            "{algorithm}: the 2 s window admitted {units} units of 9"
        );
    }
}

// ---------------------------------------------------------------------------
// 5. Keys of another type, network faults.

/// A key found full whose count is then replaced by a hash: its read check
/// goes to the script and fails (that check alone); the other keys of the
/// same batches are decided as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_count_of_another_type_fails_only_its_own_read_check() {
    let server = RedisServer::start();
    let store = batched(&server.url()).await;
    for algorithm in [FIXED, SLIDING] {
        let policy = policy(algorithm, "3/4s");
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(2500)).await;
        let bad = format!("typed-{algorithm}");
        for _ in 0..3 {
            assert!(store.check(&bad, &policy).await.unwrap().allowed());
        }
        assert!(!store.check(&bad, &policy).await.unwrap().allowed());
        let count_key = format!(
            "{}:4000000:{}",
            store.redis_key(tag(algorithm), &bad),
            now_us() / 4_000_000
        );
        server.command(&["DEL", &count_key]);
        server.command(&["HSET", &count_key, "f", "1"]);
        let mut checks = vec![(bad.clone(), policy.clone())];
        for i in 0..6 {
            checks.push((format!("good-{algorithm}-{}", i % 2), policy.clone()));
        }
        let answers = contention::all_at_once(&store, checks).await;
        assert!(
            matches!(
                answers[0],
                Err(StoreError::UnexpectedReply(_)) | Err(StoreError::Backend { .. })
            ),
            "{algorithm}: {:?}",
            answers[0].as_ref().map(show)
        );
        let admitted = answers[1..]
            .iter()
            .filter(|a| a.as_ref().unwrap().allowed())
            .count();
        assert_eq!(admitted, 6, "{algorithm}: 3 each of two good keys");
        let d = store
            .check(&format!("good-{algorithm}-0"), &policy)
            .await
            .unwrap();
        assert!(!d.allowed(), "{algorithm}");
    }
}

/// A denied check's give-back that runs but whose reply is lost: the
/// connection closed (the check is answered, denied, within the timeout)
/// or hanging past the timeout (denied, or a timeout: never admitted).
/// Either way the give-back ran once: exactly the room left is admitted
/// after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_give_back_reply_answers_in_time_and_counts_once() {
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let timeout = 600 * MS;
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(timeout);
    let mut failures = Vec::new();
    for algorithm in [FIXED, SLIDING] {
        for (fault, after_drop) in [("close", AfterDrop::Close), ("hang", AfterDrop::Hang)] {
            let one = policy(algorithm, "10/4s");
            let three = one.clone().with_cost(3).unwrap();
            away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(3000)).await;
            // A denial first, so that Redis has the give-back script: the
            // faulty give-back runs (only its reply is lost).
            let warm = format!("warm-{algorithm}-{fault}");
            for _ in 0..4 {
                store.check(&warm, &three).await.unwrap();
            }
            let key = format!("lost-{algorithm}-{fault}");
            for _ in 0..8 {
                assert!(store.check(&key, &one).await.unwrap().allowed());
            }
            proxy.drop_next_reply(Match::command("EVALSHA").arg(&key), after_drop);
            let started = Instant::now();
            let d = store.check(&key, &three).await;
            let took = started.elapsed();
            assert!(
                took <= timeout + 300 * MS,
                "{algorithm} {fault}: took {took:?}"
            );
            match (&d, fault) {
                // (Decided on counts that still hold its cost: its wait may
                // be longer than the exact one, at most two windows.)
                (Ok(d), _) if !d.allowed() && d.retry_after() <= Duration::from_secs(8) => {}
                (Err(StoreError::Timeout(_)), "hang") => {}
                (other, _) => failures.push(format!(
                    "{algorithm} {fault}: a cost-3 check counted over the max (8 + 3 > 10), \
                     its give-back's reply lost: answered {:?} after {took:?}",
                    other.as_ref().map(show)
                )),
            }
            proxy.cut_all();
            // The connections cut are found broken (nothing sent on them).
            for _ in 0..10 {
                if store.ping().await.is_ok() {
                    break;
                }
            }
            let count_key = format!(
                "{}:4000000:{}",
                store.redis_key(tag(algorithm), &key),
                now_us() / 4_000_000
            );
            let raw = server.command(&["GET", &count_key]);
            let mut after = Vec::new();
            for _ in 0..5 {
                after.push(store.check(&key, &one).await);
            }
            let more = after
                .iter()
                .filter(|d| d.as_ref().is_ok_and(Decision::allowed))
                .count();
            if more != 2 {
                failures.push(format!(
                    "{algorithm} {fault}: 8 + {more} of 10 admitted; the cost-3 check: {:?}; \
                     raw count then {}; then {:?}",
                    d.as_ref().map(show),
                    raw.lines().last().unwrap_or_default(),
                    after
                        .iter()
                        .map(|d| d.as_ref().map(show))
                        .collect::<Vec<_>>()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The reply of a read check's transaction cut: the check fails (or is
/// answered), nothing is counted, and the key still admits exactly what a
/// reward gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_read_transaction_counts_nothing() {
    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    for algorithm in [FIXED, SLIDING] {
        let policy = policy(algorithm, "4/4s");
        away_from_a_boundary(Duration::from_secs(4), Duration::from_millis(3000)).await;
        let key = format!("cut-{algorithm}");
        for _ in 0..4 {
            assert!(store.check(&key, &policy).await.unwrap().allowed());
        }
        assert!(!store.check(&key, &policy).await.unwrap().allowed());
        // Read now: the transaction is an MGET of its count, no INCRBY.
        proxy.cut_next_reply(Match::command("EXEC").arg(&key));
        let d = store.check(&key, &policy).await;
        if let Ok(d) = &d {
            assert!(!d.allowed(), "{algorithm}: {}", show(d));
        }
        store
            .command(&key, &policy, Command::Reward(2))
            .await
            .unwrap();
        let mut more = 0;
        for _ in 0..4 {
            more += u64::from(store.check(&key, &policy).await.unwrap().allowed());
        }
        assert_eq!(more, 2, "{algorithm}: a reward of 2 on a full key");
    }
}
