//! Checks decided in batches (`RedisStore::with_batches`): many concurrent
//! checks of the window counters, GCRA and the sliding log's `Script`
//! execution in one `EVALSHA` (the window counters' in one pipeline of
//! plain commands), against a real
//! redis-server. Each test also shows that batches were formed (fewer
//! batches than checks), so it exercises the batches, not the single-check
//! path.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::harness::just_into_a_window;
use crate::support::proxy::{AfterDrop, FaultProxy, Match};
use crate::support::{RedisServer, contention, zcard};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

/// The batched algorithms.
fn policy(algorithm: &str, text: &str) -> Policy {
    let policy: Policy = text.parse().unwrap();
    match algorithm {
        "fixed-window" => policy.fixed_window().unwrap(),
        "sliding-window" => policy.sliding_window().unwrap(),
        "gcra" => policy.gcra().unwrap(),
        "sliding-log" => policy.with_execution(Execution::Script).unwrap(),
        other => panic!("{other}"),
    }
}

const BATCHED: [&str; 4] = ["fixed-window", "sliding-window", "gcra", "sliding-log"];

/// Batches sent so far: each reads Redis's clock once (`TIME`), a batch
/// script as a pipeline of plain commands.
fn batches(server: &RedisServer) -> u64 {
    server.calls("time")
}

/// A store with one batch in flight per algorithm: concurrent checks queue
/// behind it and go out together.
async fn one_batch_in_flight(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_batches(1)
        .with_timeout(Duration::from_secs(5))
}

/// `n` checks at once of `(key, policy)` pairs; whether each was
/// admitted, in order.
async fn all_at_once(
    store: &RedisStore,
    checks: Vec<(String, Policy)>,
) -> Vec<Result<bool, StoreError>> {
    contention::all_at_once(store, checks)
        .await
        .into_iter()
        .map(|decision| decision.map(|d| d.allowed()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_many_times_in_a_batch_admits_exactly_the_limit() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    for algorithm in BATCHED {
        let before = batches(&server);
        let limit = policy(algorithm, "37/60s");
        let checks = (0..300)
            .map(|_| (format!("hot-{algorithm}"), limit.clone()))
            .collect();
        let decisions = all_at_once(&store, checks).await;
        let admitted = decisions.iter().filter(|d| *d.as_ref().unwrap()).count();
        assert_eq!(admitted, 37, "{algorithm}");
        let calls = batches(&server) - before;
        assert!(
            calls < 150,
            "{algorithm}: 300 checks took {calls} batches: not batched"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policies_and_keys_mixed_in_batches_keep_their_own_limits() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    for algorithm in BATCHED {
        // Three policies (one with two rates, one with a cost) over six keys.
        let policies = [
            policy(algorithm, "5/60s"),
            policy(algorithm, "8/60s, 12/120s"),
            policy(algorithm, "9/60s").with_cost(3).unwrap(),
        ];
        let limits = [5, 8, 3];
        let mut checks = Vec::new();
        for _ in 0..40 {
            for (p, limit) in policies.iter().enumerate() {
                for k in 0..2 {
                    checks.push((format!("{algorithm}-{p}-{k}"), limit.clone()));
                }
            }
        }
        let before = batches(&server);
        let decisions = all_at_once(&store, checks.clone()).await;
        for (p, limit) in limits.iter().enumerate() {
            for k in 0..2 {
                let key = format!("{algorithm}-{p}-{k}");
                let admitted = checks
                    .iter()
                    .zip(&decisions)
                    .filter(|((name, _), d)| *name == key && *d.as_ref().unwrap())
                    .count();
                assert_eq!(admitted, *limit, "{key}");
            }
        }
        assert!(batches(&server) - before < 120, "{algorithm}: not batched");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_key_in_a_batch_is_denied_and_the_others_are_not() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    for algorithm in BATCHED {
        let limit = policy(algorithm, "100/60s");
        let blocked = format!("blocked-{algorithm}");
        store
            .command(&blocked, &limit, Command::Block(Duration::from_secs(30)))
            .await
            .unwrap();
        let mut checks = Vec::new();
        for i in 0..60 {
            checks.push((blocked.clone(), limit.clone()));
            checks.push((format!("free-{algorithm}-{i}"), limit.clone()));
        }
        let decisions = all_at_once(&store, checks.clone()).await;
        for ((key, _), decision) in checks.iter().zip(&decisions) {
            assert_eq!(*decision.as_ref().unwrap(), *key != blocked, "{key}");
        }
        let decision = store.check(&blocked, &limit).await.unwrap();
        assert!(decision.blocked(), "{algorithm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreadable_key_fails_only_its_own_check() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    let limit = policy("gcra", "100/60s");
    let broken = store.redis_key("gcra", "broken");
    server.command(&["HSET", &broken, "60000000", "not a TAT"]);
    // The stored form ('b' and four doubles: time, fraction, max, expiry)
    // holding what no check writes: a time that is not a number, an
    // infinite max or expiry, a fraction of 1.5, a max of 0.5.
    let corrupt = [
        [f64::NAN, 0.5, 100.0, 0.0],
        [1.8e15, 0.5, f64::INFINITY, 0.0],
        [1.8e15, 0.5, 100.0, f64::INFINITY],
        [1.8e15, 1.5, 100.0, 0.0],
        [1.8e15, 0.5, 0.5, 0.0],
    ];
    let mut conn = ::redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for (i, doubles) in corrupt.iter().enumerate() {
        let mut value = vec![b'b'];
        for double in doubles {
            value.extend(double.to_le_bytes());
        }
        let () = ::redis::cmd("HSET")
            .arg(store.redis_key("gcra", &format!("corrupt-{i}")))
            .arg("60000000")
            .arg(value)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let mut checks = Vec::new();
    for i in 0..80 {
        checks.push(("broken".to_owned(), limit.clone()));
        checks.push((format!("fine-{i}"), limit.clone()));
        checks.push((format!("corrupt-{}", i % corrupt.len()), limit.clone()));
    }
    let before = batches(&server);
    let decisions = all_at_once(&store, checks.clone()).await;
    for ((key, _), decision) in checks.iter().zip(&decisions) {
        if key == "broken" || key.starts_with("corrupt-") {
            let error = decision.as_ref().unwrap_err();
            assert!(
                matches!(error, StoreError::UnexpectedReply(what) if what.contains("unreadable TAT")),
                "{error}"
            );
        } else {
            assert!(*decision.as_ref().unwrap(), "{key}");
        }
    }
    assert!(batches(&server) - before < 180, "not batched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_off_sends_one_script_per_check() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_batches(0)
        .with_timeout(Duration::from_secs(5));
    let limit = policy("fixed-window", "1000/60s");
    // The first check loads the script (NOSCRIPT, SCRIPT LOAD, EVALSHA).
    assert!(store.check("warm", &limit).await.unwrap().allowed());
    let before = server.calls("evalsha");
    let checks = (0..100).map(|i| (format!("k{i}"), limit.clone())).collect();
    let decisions = all_at_once(&store, checks).await;
    assert!(decisions.iter().all(|d| *d.as_ref().unwrap()));
    assert_eq!(server.calls("evalsha") - before, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batched_decision_is_the_single_checks() {
    // The same sequence of checks, batched and one by one, on two servers:
    // the same admissions, and remaining counts that agree.
    let batched_server = RedisServer::start();
    let single_server = RedisServer::start();
    let batched = RedisStore::connect(&batched_server.url())
        .await
        .unwrap()
        .with_batches(1);
    let single = RedisStore::connect(&single_server.url())
        .await
        .unwrap()
        .with_batches(0);
    for algorithm in BATCHED {
        let limit = policy(algorithm, "6/60s, 9/120s");
        for i in 0..12 {
            let a = batched.check("seq", &limit).await.unwrap();
            let b = single.check("seq", &limit).await.unwrap();
            assert_eq!(a.allowed(), b.allowed(), "{algorithm} #{i}");
            for (x, y) in a.rates().iter().zip(b.rates()) {
                assert_eq!(x.remaining(), y.remaining(), "{algorithm} #{i}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_of_another_type_fails_only_its_own_check() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    for algorithm in BATCHED {
        let limit = policy(algorithm, "100/60s");
        let tag = match algorithm {
            "fixed-window" => "fixed",
            "sliding-window" => "swc",
            "sliding-log" => "log",
            _ => "gcra",
        };
        // Something else under the prefix: a string where a hash belongs,
        // or (the window counters' counts) a hash where an integer belongs,
        // in this minute's window and the next.
        let foreign = store.redis_key(tag, "foreign");
        if tag != "gcra" && tag != "log" {
            let minute = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs()
                / 60;
            for index in [minute, minute + 1] {
                let count = format!("{foreign}:60000000:{index}");
                server.command(&["HSET", &count, "not", "an integer"]);
            }
        } else {
            server.command(&["SET", &foreign, "not a hash"]);
        }
        let mut checks = Vec::new();
        for i in 0..60 {
            checks.push(("foreign".to_owned(), limit.clone()));
            checks.push((format!("{algorithm}-fine-{i}"), limit.clone()));
        }
        let before = batches(&server);
        let decisions = all_at_once(&store, checks.clone()).await;
        for ((key, _), decision) in checks.iter().zip(&decisions) {
            if key == "foreign" {
                let error = decision.as_ref().unwrap_err();
                assert!(error.to_string().contains("WRONGTYPE"), "{error}");
            } else {
                assert!(*decision.as_ref().unwrap(), "{algorithm} {key}");
            }
        }
        assert!(batches(&server) - before < 90, "{algorithm}: not batched");
        // Every other check counted exactly once (a peek answers as a
        // request would be: 100 - the one counted - its own).
        let fine = store
            .command(&format!("{algorithm}-fine-0"), &limit, Command::Peek)
            .await
            .unwrap();
        assert_eq!(fine.rates()[0].remaining(), 98, "{algorithm}");
    }
}

#[tokio::test]
async fn a_gcra_check_never_shortens_the_expiry_another_policy_needs() {
    // Two GCRA policies on one Redis key (the same name): a penalty under
    // the hour-long one sets the key's expiry an hour ahead, exactly (no
    // recorded expiry); a check under the one-second policy must not bring
    // it down to about a second, or the hour's debt would vanish with the
    // key. Batched and one by one.
    let server = RedisServer::start();
    for batches in [1, 0] {
        let store = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_batches(batches);
        let hourly = policy("gcra", "5/1h");
        let fast = policy("gcra", "10/1s");
        let key = format!("shared-{batches}");
        store
            .command(&key, &hourly, Command::Penalty(5))
            .await
            .unwrap();
        assert!(store.check(&key, &fast).await.unwrap().allowed());
        let redis_key = store.redis_key("gcra", &key);
        let pttl: i64 = server
            .command(&["PTTL", &redis_key])
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap();
        assert!(pttl > 3_500_000, "batches {batches}: PTTL {pttl} ms");
        // The hour's debt is still there.
        assert!(!store.check(&key, &hourly).await.unwrap().allowed());
    }
}

/// A policy of two rates whose second count is of another type: the check
/// fails, and the first rate's count keeps nothing of it, batched (plain
/// commands) and alone (the script counts first too), for both window
/// counters.
#[tokio::test]
async fn a_failing_rate_gives_back_what_the_others_counted() {
    let server = RedisServer::start();
    for batches in [2, 0] {
        let store = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_batches(batches);
        for (algorithm, tag) in [("fixed-window", "fixed"), ("sliding-window", "swc")] {
            let limit = policy(algorithm, "10/60s, 100/3600s");
            let key = format!("two-rates-{batches}");
            let hour = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs()
                / 3600;
            let name = store.redis_key(tag, &key);
            for index in [hour, hour + 1] {
                let count = format!("{name}:3600000000:{index}");
                server.command(&["HSET", &count, "not", "an integer"]);
            }
            let error = store.check(&key, &limit).await.unwrap_err();
            assert!(error.to_string().contains("WRONGTYPE"), "{error}");
            // The minute's count: nothing, or a count of zero.
            for count in server.keys(&format!("{name}:60000000:*")) {
                let value = server.command(&["GET", &count]);
                assert_eq!(
                    value.lines().nth(1),
                    Some("0"),
                    "{algorithm}, batches {batches}: {count} holds {value:?}"
                );
            }
        }
    }
}

/// The sliding window's previous count is read once per key and window
/// and held. A reset through the same store drops what it holds: the next
/// check is told the room the reset made. Another process's reset is seen
/// as exactly in what is admitted: a check denied on a count held goes to
/// the script, which reads the counts as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_previous_count_is_read_once_a_window_and_again_after_a_reset() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    let other = RedisStore::connect(&server.url()).await.unwrap();
    let p = policy("sliding-window", "10/2s");
    let window = Duration::from_secs(2);
    just_into_a_window(window, Duration::from_millis(50)).await;
    for key in ["a", "b"] {
        for _ in 0..6 {
            assert!(store.check(key, &p).await.unwrap().allowed());
        }
    }
    // The next window: 6 × (1 − elapsed) of the previous one still weigh.
    just_into_a_window(window, Duration::from_millis(50)).await;
    let reads = server.calls("mget");
    assert!(store.check("a", &p).await.unwrap().allowed());
    assert_eq!(
        server.calls("mget"),
        reads + 2,
        "the blocks and the previous count read"
    );
    assert!(store.check("a", &p).await.unwrap().allowed());
    assert_eq!(server.calls("mget"), reads + 3, "the previous count held");
    assert!(store.check("b", &p).await.unwrap().allowed());

    store.command("a", &p, Command::Reset).await.unwrap();
    let d = store.check("a", &p).await.unwrap();
    assert!(d.allowed());
    assert_eq!(d.remaining(), 9, "nothing weighs after the reset");

    other.command("b", &p, Command::Reset).await.unwrap();
    for i in 0..10 {
        assert!(
            store.check("b", &p).await.unwrap().allowed(),
            "check {i} after another store's reset"
        );
    }
    assert!(!store.check("b", &p).await.unwrap().allowed());
}

/// The sliding log's batch whose reply is lost (the connection closed
/// after Redis ran it) is sent again, and each of its checks, finding its
/// own entries, is admitted again without counting twice: exactly the
/// max is admitted, and the log holds exactly that many entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sliding_log_batch_sent_again_after_a_lost_reply_counts_each_check_once() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_batches(1)
        .with_timeout(Duration::from_secs(5));
    let limit = policy("sliding-log", "10/60s");
    // Loads the script.
    assert!(store.check("warm", &limit).await.unwrap().allowed());
    // A first batch, its reply stalled, holds the next checks in the queue:
    // they go out together, in the batch whose reply is lost.
    let gate = store.redis_key("log", "gate");
    let hot = store.redis_key("log", "hot");
    proxy.stall_next_reply(
        Match::command("EVALSHA").arg(&gate),
        Duration::from_millis(300),
    );
    proxy.drop_next_reply(Match::command("EVALSHA").arg(&hot), AfterDrop::Close);
    let first = {
        let (store, limit) = (store.clone(), limit.clone());
        tokio::spawn(async move { store.check("gate", &limit).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let checks = (0..20).map(|_| ("hot".to_owned(), limit.clone())).collect();
    let decisions = all_at_once(&store, checks).await;
    assert!(first.await.unwrap().unwrap().allowed());
    assert_eq!(proxy.armed(), 0, "the batch's reply was not dropped");
    let admitted = decisions.iter().filter(|d| *d.as_ref().unwrap()).count();
    assert_eq!(admitted, 10, "{decisions:?}");
    assert_eq!(zcard(&server, &hot), 10);
}

/// A sliding-log check admitted in a batch carries its entries: a refund
/// of it takes exactly them back out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sliding_log_check_admitted_in_a_batch_can_be_refunded() {
    let server = RedisServer::start();
    let store = one_batch_in_flight(&server).await;
    let limit = policy("sliding-log", "5/60s").with_cost(2).unwrap();
    let before = batches(&server);
    let checks = (0..6).map(|_| ("refunded".to_owned(), limit.clone()));
    let decisions = contention::all_at_once(&store, checks.collect()).await;
    assert!(batches(&server) - before < 6, "not batched");
    let admitted: Vec<_> = decisions
        .into_iter()
        .map(Result::unwrap)
        .filter(tower_redis_ratelimit::Decision::allowed)
        .collect();
    assert_eq!(admitted.len(), 2);
    let key = store.redis_key("log", "refunded");
    assert_eq!(zcard(&server, &key), 4);
    let id = admitted[0]
        .refund_id()
        .expect("an admission carries its entries");
    let after = store
        .command("refunded", &limit, Command::Refund { id, units: 2 })
        .await
        .unwrap();
    assert_eq!(zcard(&server, &key), 2);
    assert_eq!(after.rates()[0].remaining(), 1);
}
