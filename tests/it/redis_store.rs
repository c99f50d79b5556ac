//! RedisStore against a real redis-server: concurrency across independent
//! stores, clock skew between app servers, key layout and expiry, script
//! reloads, timeouts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::{Duration, Instant};

use crate::support::contention::admitted_under_contention;
use crate::support::faults::SteppingClock;
use crate::support::{RedisServer, zcard};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_admits_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy = "100/60s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    assert_eq!(admitted, 100);
    // Every admitted request left exactly one entry: members never collide.
    assert_eq!(zcard(&server, "rl:log:{hot}"), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_never_admits_more_than_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy = "100/60s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Transaction)
        .unwrap();
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    eprintln!("transaction execution admitted {admitted} of 500 (limit 100)");
    assert!(admitted <= 100, "admitted {admitted}");
    assert!(admitted > 0);
    // Denied entries were taken back out; admitted ones all stayed.
    assert_eq!(zcard(&server, "rl:log:{hot}"), admitted);
}

/// App servers whose clocks are 5 s ahead and 5 s behind share one key; their
/// decisions are those of one correct clock.
#[tokio::test]
async fn skewed_app_clocks_change_no_decision() {
    let server = RedisServer::start();
    let (ahead, behind) =
        crate::support::contention::skewed_stores(&server, Duration::from_secs(5)).await;
    let policy: Policy = "3/1s".parse().unwrap();
    assert_eq!(policy.execution(), Execution::Transaction);

    let t0 = Instant::now();
    assert!(behind.check("k", &policy).await.unwrap().allowed());
    assert!(ahead.check("k", &policy).await.unwrap().allowed());
    assert!(behind.check("k", &policy).await.unwrap().allowed());
    // Without synchronisation the store 5 s ahead would see the entries of
    // the one behind as 10 s old and admit this request.
    let d = ahead.check("k", &policy).await.unwrap();
    assert!(
        !d.allowed(),
        "the clock ahead must see the entries of the clock behind"
    );
    let expected = Duration::from_secs(1) - t0.elapsed();
    assert!(
        d.retry_after().abs_diff(expected) < Duration::from_millis(100),
        "retry_after {:?}, expected about {expected:?}",
        d.retry_after()
    );
    let d2 = behind.check("k", &policy).await.unwrap();
    assert!(!d2.allowed());
    tokio::time::sleep(d.retry_after().max(d2.retry_after())).await;
    // The Transaction execution's waits are at most the window although its
    // entries may be dated up to twice its clock tolerance late: a retry
    // within those milliseconds of the window's end may meet one more
    // denial, of those milliseconds only (the guide's "executions").
    let mut retried = ahead.check("k", &policy).await.unwrap();
    if !retried.allowed() {
        assert!(
            retried.retry_after() <= Duration::from_millis(30),
            "one more denial, of the clock tolerance only: {retried:?}"
        );
        tokio::time::sleep(retried.retry_after()).await;
        retried = ahead.check("k", &policy).await.unwrap();
    }
    assert!(retried.allowed(), "{retried:?}");
}

#[tokio::test]
async fn keys_follow_the_layout_and_expire() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_prefix("app");
    for execution in [Execution::Transaction, Execution::Script] {
        let policy = "5/2s, 10/1500ms"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let key = format!("203.0.113.9-{execution:?}");
        store.check(&key, &policy).await.unwrap();
        let redis_key = format!("app:log:{{{key}}}");
        assert_eq!(store.redis_key("log", &key), redis_key);
        let ttl: i64 = server
            .command(&["PTTL", &redis_key])
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap();
        // The longest window, plus the transaction's twice 5 ms of clock
        // tolerance (and half a loopback round trip).
        assert!(ttl > 1_500 && ttl <= 2_020, "{execution:?}: PTTL {ttl}");
    }
    // A key that could break the layout is hashed into one hash tag.
    let policy: Policy = "5/2s".parse().unwrap();
    store.check("evil}{key", &policy).await.unwrap();
    let keys = server.command(&["KEYS", "app:log:{#*"]);
    assert!(keys.contains("app:log:{#"), "{keys}");
}

#[tokio::test]
async fn script_is_reloaded_after_script_flush() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = "2/10s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    assert!(store.check("k", &policy).await.unwrap().allowed());
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    assert!(store.check("k", &policy).await.unwrap().allowed());
    assert!(!store.check("k", &policy).await.unwrap().allowed());
}

/// Both executions keep the same sorted set: a deployment can switch.
#[tokio::test]
async fn executions_share_state() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let tx: Policy = "3/10s".parse().unwrap();
    let script = tx.clone().with_execution(Execution::Script).unwrap();
    assert!(store.check("k", &tx).await.unwrap().allowed());
    assert!(store.check("k", &script).await.unwrap().allowed());
    assert!(store.check("k", &tx).await.unwrap().allowed());
    assert!(!store.check("k", &script).await.unwrap().allowed());
    assert!(!store.check("k", &tx).await.unwrap().allowed());
}

/// A hung Redis (SIGSTOP) costs a request the timeout, not more.
#[tokio::test]
async fn a_hung_redis_times_out() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let policy: Policy = "5/1s".parse().unwrap();
    store.check("k", &policy).await.unwrap();
    server.signal("STOP");
    for execution in [Execution::Transaction, Execution::Script] {
        let started = Instant::now();
        let result = store
            .check("k", &policy.clone().with_execution(execution).unwrap())
            .await;
        let took = started.elapsed();
        assert!(matches!(result, Err(StoreError::Timeout(_))), "{result:?}");
        assert!(
            took < Duration::from_millis(700),
            "{execution:?} took {took:?}"
        );
    }
    server.signal("CONT");
}

#[tokio::test]
async fn connect_fails_clearly_when_redis_is_unreachable() {
    // A port nobody listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let error = RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    let message = error.to_string().to_lowercase();
    assert!(
        message.contains("refused"),
        "the cause is reported: {message}"
    );
    let bad = RedisStore::connect("not a url").await.unwrap_err();
    assert!(
        bad.backend_error::<redis::RedisError>().is_some(),
        "{bad:?}"
    );
}

#[tokio::test]
async fn connect_reports_a_wrong_password() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let port = server.port();
    let error = RedisStore::connect(&format!("redis://:wrong@127.0.0.1:{port}"))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.to_lowercase().contains("pass"), "{error}");
    let store = RedisStore::connect(&format!("redis://:s3cret@127.0.0.1:{port}"))
        .await
        .unwrap();
    let policy: Policy = "1/1s".parse().unwrap();
    assert!(store.check("k", &policy).await.unwrap().allowed());
}

/// A check is one round trip: no PING on checkout, one EXEC or EVALSHA.
#[tokio::test]
async fn one_round_trip_per_check() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let pings_at_start = server.calls("ping");
    let tx: Policy = "1000/10s".parse().unwrap();
    let script = tx.clone().with_execution(Execution::Script).unwrap();
    for _ in 0..20 {
        assert!(store.check("a", &tx).await.unwrap().allowed());
        assert!(store.check("b", &script).await.unwrap().allowed());
    }
    assert_eq!(server.calls("ping"), pings_at_start, "no PING per checkout");
    assert_eq!(server.calls("exec"), 20);
    // EVALSHA, plus one failed EVALSHA and SCRIPT LOAD the first time.
    assert!(server.calls("evalsha") <= 21, "{}", server.calls("evalsha"));
}

/// A transaction's denial, once its key is known full, is one round trip
/// that only reads: no entry written, none taken back out. The decisions
/// are those of the writing transaction: the same waits, and an admission
/// as soon as the log has room again (here after a reward).
#[tokio::test]
async fn a_known_full_log_denies_on_a_read_alone() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "2/60s".parse().unwrap();
    assert!(store.check("full", &policy).await.unwrap().allowed());
    assert!(store.check("full", &policy).await.unwrap().allowed());
    // The first denial writes and takes back out: it finds the key full.
    let first = store.check("full", &policy).await.unwrap();
    assert!(!first.allowed());
    let (zadds, zrems, execs, counts) = (
        server.calls("zadd"),
        server.calls("zrem"),
        server.calls("exec"),
        server.calls("zcount"),
    );
    for _ in 0..5 {
        let denied = store.check("full", &policy).await.unwrap();
        assert!(!denied.allowed());
        assert_eq!(denied.remaining(), 0);
        let drift = first.retry_after().saturating_sub(denied.retry_after());
        assert!(drift < Duration::from_secs(1), "{denied:?} after {first:?}");
        assert!(denied.reset() <= Duration::from_secs(60));
    }
    assert_eq!(server.calls("zadd"), zadds, "a denial of a full key wrote");
    assert_eq!(server.calls("zrem"), zrems, "a denial of a full key wrote");
    assert_eq!(
        server.calls("exec"),
        execs,
        "a denial of a full key is no transaction"
    );
    assert_eq!(server.calls("zcount"), counts + 5, "one count a denial");
    assert_eq!(zcard(&server, "rl:log:{full}"), 2);
    // Room again: the check reads, finds it, and writes.
    store
        .command(
            "full",
            &policy,
            tower_redis_ratelimit::store::Command::Reward(1),
        )
        .await
        .unwrap();
    assert!(store.check("full", &policy).await.unwrap().allowed());
    assert_eq!(zcard(&server, "rl:log:{full}"), 2);
    assert!(!store.check("full", &policy).await.unwrap().allowed());
    // A block read with the log: blocked, still nothing written.
    store
        .command(
            "full",
            &policy,
            tower_redis_ratelimit::store::Command::Block(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    let zadds = server.calls("zadd");
    let blocked = store.check("full", &policy).await.unwrap();
    assert!(blocked.blocked(), "{blocked:?}");
    assert!(blocked.retry_after() > Duration::from_secs(29));
    assert_eq!(
        server.calls("zadd"),
        zadds,
        "a blocked check of a full key wrote"
    );
}

/// After Redis is killed and restarted on the same port, checks work again
/// without help.
#[tokio::test]
async fn reconnects_after_a_redis_restart() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    for execution in [Execution::Transaction, Execution::Script] {
        let policy = "100/10s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap();
        store.check("k", &policy).await.unwrap();
        server.restart();
        for i in 0..5 {
            let result = store.check("k", &policy).await;
            assert!(
                result.is_ok(),
                "{execution:?} check {i} after restart: {result:?}"
            );
        }
        // The restarted Redis is empty: only the new checks count.
        assert_eq!(
            store.check("k", &policy).await.unwrap().remaining(),
            100 - 6,
            "{execution:?}"
        );
    }
}

/// Checks cancelled at any point (timeouts, dropped futures) leave no entry
/// of a request that was not admitted: a client is never locked out by its
/// abandoned attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_checks_leave_no_entries_behind() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "2/60s".parse().unwrap();
    assert!(store.check("k", &policy).await.unwrap().allowed());
    assert!(store.check("k", &policy).await.unwrap().allowed());
    let mut cancelled = 0;
    for i in 0..400u64 {
        let budget = Duration::from_micros(50 + (i * 37) % 1_500);
        match tokio::time::timeout(budget, store.check("k", &policy)).await {
            Ok(decision) => assert!(!decision.unwrap().allowed()),
            Err(_) => cancelled += 1,
        }
    }
    assert!(
        cancelled > 0,
        "no check was cancelled; the test proves nothing"
    );
    // Let the spawned clean-ups finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        zcard(&server, "rl:log:{k}"),
        2,
        "{cancelled} cancelled checks"
    );
}

/// A slow Redis (busy for 0.8 s) within the store's timeout is waited for:
/// no hidden shorter timeout, no retry, each request counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_is_waited_for_and_counts_once() {
    let server = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(3));
    for policy in [
        "100/min".parse::<Policy>().unwrap().fixed_window().unwrap(),
        "100/min".parse::<Policy>().unwrap().gcra().unwrap(),
        "100/min"
            .parse::<Policy>()
            .unwrap()
            .with_execution(Execution::Script)
            .unwrap(),
    ] {
        let key = format!("slow-{}", policy.algorithm());
        let port = server.port();
        let sleeper = std::thread::spawn(move || {
            let reply = support::raw_command(port, &["DEBUG", "SLEEP", "0.8"]);
            assert!(reply.starts_with("+OK"), "{reply}");
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let decision = store.check(&key, &policy).await.unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(500),
            "it waited for Redis"
        );
        assert_eq!(
            decision.remaining(),
            99,
            "{}: counted once",
            policy.algorithm()
        );
        sleeper.join().unwrap();
    }
}

/// A store over a ConnectionManager reconnects by itself after Redis is
/// restarted on the same port.
#[tokio::test]
async fn a_connection_manager_reconnects_after_a_restart() {
    let mut server = RedisServer::start();
    let manager = redis::Client::open(server.url())
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    let store =
        RedisStore::from_connection_manager(manager).with_timeout(Duration::from_millis(500));
    let policy = "100/10s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap();
    store.check("k", &policy).await.unwrap();
    server.restart();
    let started = Instant::now();
    let mut failures = 0;
    while store.check("k", &policy).await.is_err() {
        failures += 1;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never reconnected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "reconnected after {:?} and {failures} failed checks",
        started.elapsed()
    );
    for _ in 0..5 {
        store.check("k", &policy).await.unwrap();
    }
}

/// Far more checks in flight than the pool has connections all get their
/// answer: none waits for a connection until the store's timeout. (Holding
/// a pooled connection for a whole check starved the waiters: with 64
/// tasks on 16 connections, about 48 timed out every 250 ms.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_checks_in_flight_than_pooled_connections_all_answer() {
    let server = RedisServer::start();
    let store = std::sync::Arc::new(RedisStore::connect(&server.url()).await.unwrap());
    let policies: Vec<Policy> = vec![
        "1000000/s".parse().unwrap(),
        "1000000/s".parse::<Policy>().unwrap().gcra().unwrap(),
    ];
    for policy in policies {
        let deadline = Instant::now() + Duration::from_secs(1);
        let tasks: Vec<_> = (0..64)
            .map(|task| {
                let (store, policy) = (store.clone(), policy.clone());
                tokio::spawn(async move {
                    let (mut ok, mut failed) = (0u32, Vec::new());
                    let mut i = 0;
                    while Instant::now() < deadline {
                        match store.check(&format!("k{task}:{i}"), &policy).await {
                            Ok(decision) if decision.allowed() => ok += 1,
                            Ok(decision) => failed.push(format!("denied: {decision:?}")),
                            Err(error) => failed.push(error.to_string()),
                        }
                        i += 1;
                    }
                    (ok, failed)
                })
            })
            .collect();
        let mut total = 0;
        for task in tasks {
            let (ok, failed) = task.await.unwrap();
            assert!(
                failed.is_empty(),
                "{} failed checks, first: {}",
                failed.len(),
                failed[0]
            );
            assert!(ok > 0, "a task made no check in 1 s");
            total += ok;
        }
        assert!(total > 64, "{total}");
    }
}

/// An app clock that steps after its offset to Redis was measured (the
/// offset is measured again only every 30 s) changes no `Transaction`
/// decision: stepped ahead, the store would count from the future and drop
/// live entries; stepped behind, it would date its entries in the past so
/// that another store drops them early. Each transaction's own Redis `TIME`
/// catches both.
#[tokio::test]
async fn a_clock_stepped_after_measuring_changes_no_decision() {
    let server = RedisServer::start();
    for step in [3_i64, -3] {
        let clock = SteppingClock::new();
        let stepping = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_clock(clock.clone());
        let other = RedisStore::connect(&server.url()).await.unwrap();
        let policy: Policy = "1/2s".parse().unwrap();
        let key = format!("stepped{step}");
        assert!(stepping.check(&key, &policy).await.unwrap().allowed());
        // The first check after the step sees it (and measures the offset
        // again): once on a fresh key, once on the key with an entry.
        let stepped = |step: i64| {
            clock.step(Duration::from_secs(step.unsigned_abs()), step >= 0);
        };
        let fresh = format!("{key}-fresh");
        stepped(step);
        // Stepped behind by more than the window, the entry was dated
        // outside it until restamped: the admission is not safe to give,
        // and the check fails instead (its entry taken out).
        let first = stepping.check(&fresh, &policy).await;
        let first_admitted = match &first {
            Ok(decision) => decision.allowed(),
            Err(StoreError::Timeout(_)) if step < 0 => false,
            Err(error) => panic!("step {step} s: {error}"),
        };
        if !first_admitted {
            // Let the background clean-up run.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let second = other.check(&fresh, &policy).await.unwrap().allowed();
        assert!(
            first_admitted != second,
            "step {step} s: stepped store {first:?}, other store admitted: {second}: \
             exactly one must be admitted"
        );
        // Back to the clock the offset was measured on (a step the other
        // way): the first check may fail as above, the next is synced.
        stepped(0);
        let _ = stepping.check(&format!("{key}-sync"), &policy).await;
        assert!(
            stepping
                .check(&format!("{key}-synced"), &policy)
                .await
                .unwrap()
                .allowed()
        );
        stepped(step);
        assert!(
            !stepping.check(&key, &policy).await.unwrap().allowed(),
            "step {step} s: the stepped store admitted a second request within 2 s"
        );
        assert!(
            !other.check(&key, &policy).await.unwrap().allowed(),
            "step {step} s: the other store admitted a second request within 2 s"
        );
    }
}

/// A primary demoted by a failover answers writes with `READONLY` — a
/// script or command as such, a `MULTI` transaction as `EXECABORT` around
/// it. Under every algorithm the store retires the connection that got it,
/// so the next check opens a new one (to the new primary, behind Sentinel)
/// instead of asking the replica again. Here `REPLICAOF` a port nothing
/// listens on demotes the server, and `REPLICAOF NO ONE` gives it back.
#[tokio::test]
async fn a_readonly_answer_retires_the_connection_under_every_algorithm() {
    let server = RedisServer::start();
    let nowhere = support::free_port().to_string();
    for (name, policy) in support::every_algorithm() {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let key = format!("readonly-{name}");
        assert!(
            store.check(&key, &policy).await.unwrap().allowed(),
            "{name}"
        );
        let before = support::client_ids(&server);

        let reply = server.command(&["REPLICAOF", "127.0.0.1", &nowhere]);
        assert!(reply.starts_with("+OK"), "REPLICAOF: {reply}");
        let error = store.check(&key, &policy).await.unwrap_err();
        eprintln!("{name} on a replica: {error}");
        let reply = server.command(&["REPLICAOF", "NO", "ONE"]);
        assert!(reply.starts_with("+OK"), "REPLICAOF NO ONE: {reply}");

        assert!(
            store.check(&key, &policy).await.unwrap().allowed(),
            "{name}"
        );
        // The connection that met the replica is gone (closed when the
        // pool dropped it), not kept for the next check.
        support::wait_until_retired(&server, &before, name).await;
    }
}
