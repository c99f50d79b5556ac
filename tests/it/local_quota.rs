//! Local-first limiting of hot keys (`Limiter::with_local_quota`), against
//! a real redis-server with two limiters standing for two processes (each
//! its own store, connections and local units): admissions stay within the
//! stated bound, and a hot key costs Redis about one check per batch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::RedisServer;
use tower_redis_ratelimit::limiter::{DecidedBy, LocalQuota};
use tower_redis_ratelimit::{Algorithm, Limiter, Policy, RedisStore};

fn micros_now() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

/// Every Redis command run so far, those inside scripts included.
fn redis_calls(server: &RedisServer) -> u64 {
    server
        .command(&["INFO", "commandstats"])
        .lines()
        .filter_map(|line| line.split("calls=").nth(1))
        .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
        .sum()
}

async fn process(server: &RedisServer, policy: &Policy, quota: LocalQuota) -> Limiter {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    Limiter::new(store, policy.clone())
        .with_name("hot")
        .with_local_quota(quota)
        .unwrap()
}

/// `tasks` tasks per limiter checking `key` for `run`: when each admitted
/// check started and ended (µs since the epoch), and the decisions taken.
async fn flood(
    limiters: &[Limiter],
    key: &str,
    tasks: usize,
    run: Duration,
) -> (Vec<(u64, u64)>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for limiter in limiters {
        for _ in 0..tasks {
            let (limiter, stop, key) = (limiter.clone(), Arc::clone(&stop), key.to_owned());
            handles.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                let mut decisions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let started = micros_now();
                    let verdict = limiter.check(&key).await.unwrap();
                    decisions += 1;
                    if verdict.allowed() {
                        admitted.push((started, micros_now()));
                    } else {
                        // A client that was refused comes back a little later.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    tokio::task::yield_now().await;
                }
                (admitted, decisions)
            }));
        }
    }
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let mut admitted = Vec::new();
    let mut decisions = 0;
    for handle in handles {
        let (a, d) = handle.await.unwrap();
        admitted.extend(a);
        decisions += d;
    }
    admitted.sort_unstable();
    (admitted, decisions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admissions_stay_within_max_plus_instances_times_batch() {
    let server = RedisServer::start();
    const MAX: u64 = 100;
    const BATCH: u64 = 10;
    const INSTANCES: u64 = 2;
    const TASKS: usize = 4;
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
    ] {
        let policy = "100/s"
            .parse::<Policy>()
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap();
        let quota = LocalQuota::new(BATCH, Duration::from_millis(300)).unwrap();
        let limiters = [
            process(&server, &policy, quota).await,
            process(&server, &policy, quota).await,
        ];
        let key = format!("bound-{algorithm}");
        let (admitted, _) = flood(&limiters, &key, TASKS, Duration::from_millis(2_500)).await;
        let window = 1_000_000;
        // A check's admission is placed anywhere between its start and end
        // (the store counted it in between): count it in a window if its
        // span meets the window. That over-counts by at most the checks in
        // flight across one window edge (the tasks), a slack of TASKS per
        // process per edge.
        let slack = 2 * INSTANCES * TASKS as u64;
        let in_window = |from: u64| {
            admitted
                .iter()
                .filter(|(s, e)| *e >= from && *s < from + window)
                .count() as u64
        };
        // What the algorithm alone admits in one sliding window of its
        // length: the sliding log MAX; GCRA a burst of MAX, then MAX more
        // as it refills; the sliding window counter, weighing the previous
        // window's count as if spread evenly, up to twice MAX when it came
        // at the window's end. Plus, but for the fixed window (counted in
        // its aligned windows), the units the processes hold.
        let alone = match algorithm {
            Algorithm::Gcra | Algorithm::SlidingWindow => 2 * MAX - 1,
            _ => MAX,
        };
        let bound = if algorithm == Algorithm::FixedWindow {
            MAX
        } else {
            alone + INSTANCES * BATCH
        };
        let first = admitted.first().unwrap().0;
        let last = admitted.last().unwrap().1;
        let mut worst = 0;
        if algorithm == Algorithm::FixedWindow {
            // The fixed window's windows are aligned to the clock.
            let mut from = first / window * window;
            while from < last {
                worst = worst.max(in_window(from));
                from += window;
            }
        } else {
            for (start, _) in &admitted {
                if start + window <= last {
                    worst = worst.max(in_window(*start));
                }
            }
        }
        eprintln!(
            "{algorithm}: {} admitted in 2.5 s, at most {worst} in one window (bound {bound} + slack {slack})",
            admitted.len()
        );
        assert!(
            worst <= bound + slack,
            "{algorithm}: {worst} admitted in one window, bound {bound} (+{slack} for timing)"
        );
        // And the limit is used: not starved by units held elsewhere.
        assert!(
            admitted.len() as u64 >= 2 * MAX - INSTANCES * BATCH,
            "{algorithm}: only {} admitted",
            admitted.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_costs_redis_about_one_check_per_batch() {
    let server = RedisServer::start();
    let policy: Policy = "1000000/s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::Gcra)
        .unwrap();
    let quota = LocalQuota::new(200, Duration::from_secs(1)).unwrap();
    let limiters = [
        process(&server, &policy, quota).await,
        process(&server, &policy, quota).await,
    ];
    // Warm up: scripts loaded, connections open.
    for limiter in &limiters {
        let _ = limiter.check("warm").await.unwrap();
    }
    let before = redis_calls(&server);
    let (admitted, decisions) = flood(&limiters, "hot", 4, Duration::from_millis(1_500)).await;
    let calls = redis_calls(&server) - before - 1;
    let per_decision = calls as f64 / decisions as f64;
    eprintln!(
        "{decisions} decisions ({} admitted), {calls} Redis commands (inner calls included): {per_decision:.4} per decision",
        admitted.len()
    );
    assert_eq!(
        admitted.len() as u64,
        decisions,
        "far under the limit, everything is admitted"
    );
    assert!(
        decisions > 10_000,
        "too little load to measure: {decisions}"
    );
    assert!(
        per_decision <= 0.05,
        "{per_decision} Redis commands per decision"
    );
}

#[tokio::test]
async fn local_units_are_used_locally_and_a_key_near_its_limit_is_exact() {
    let server = RedisServer::start();
    let policy: Policy = "25/h".parse().unwrap();
    let quota = LocalQuota::new(10, Duration::from_secs(60)).unwrap();
    let limiter = process(&server, &policy, quota).await;
    let mut sources = Vec::new();
    // A check in Redis is a transaction counting the log (a denial's
    // clean-up, a second transaction, counts nothing).
    let mut checks = 0;
    for i in 0..25 {
        let before = server.calls("zcount");
        let verdict = limiter.check("k").await.unwrap();
        if i >= 20 {
            checks += server.calls("zcount") - before;
        }
        assert!(verdict.allowed());
        sources.push(verdict.decided_by());
    }
    // Two batches of 10 (1 from the store, 9 kept), then 5 one by one: the
    // store cannot give a whole batch.
    let from_store = sources.iter().filter(|s| **s == DecidedBy::Store).count();
    let local = sources
        .iter()
        .filter(|s| **s == DecidedBy::LocalQuota)
        .count();
    assert_eq!((from_store, local), (7, 18), "{sources:?}");
    let before = server.calls("zcount");
    let denied = limiter.check("k").await.unwrap();
    assert!(!denied.allowed());
    // Near the limit one check per request: a batch is asked for once
    // (the 21st), then not again while the store cannot give one.
    assert_eq!(
        checks + server.calls("zcount") - before,
        7,
        "checks in Redis for the last 6"
    );
    assert_eq!(limiter.peek("k").await.unwrap().remaining(), 0);
    // A concurrency policy has no local quota.
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let error = Limiter::new(store, Policy::concurrency(5).unwrap())
        .with_local_quota(quota)
        .unwrap_err();
    assert!(error.to_string().contains("local quota"), "{error}");
    assert!(LocalQuota::new(1, Duration::from_secs(1)).is_err());
    assert!(LocalQuota::new(5, Duration::ZERO).is_err());
}

/// Under the fixed window, units are used only in the window that counted
/// them: a batch taken just before a window's end is not used after it.
#[tokio::test]
async fn fixed_window_units_end_with_their_window() {
    let server = RedisServer::start();
    let policy = "1000/1s"
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::FixedWindow)
        .unwrap();
    let limiter = process(
        &server,
        &policy,
        LocalQuota::new(100, Duration::from_secs(10)).unwrap(),
    )
    .await;
    // 150 ms before a second ends (Redis's clock is this machine's).
    let into_second = micros_now() % 1_000_000;
    let until_edge = if into_second < 850_000 {
        850_000 - into_second
    } else {
        1_850_000 - into_second
    };
    tokio::time::sleep(Duration::from_micros(until_edge)).await;
    assert_eq!(
        limiter.check("k").await.unwrap().decided_by(),
        DecidedBy::Store,
        "the batch"
    );
    assert_eq!(
        limiter.check("k").await.unwrap().decided_by(),
        DecidedBy::LocalQuota
    );
    // 100 ms into the next window: the units are gone, a new batch is taken.
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        limiter.check("k").await.unwrap().decided_by(),
        DecidedBy::Store,
        "a unit of the last window was used"
    );
}

#[tokio::test]
async fn units_belong_to_one_name_and_a_block_drops_them() {
    let server = RedisServer::start();
    let policy: Policy = "100/h".parse().unwrap();
    let base = process(
        &server,
        &policy,
        LocalQuota::new(10, Duration::from_secs(60)).unwrap(),
    )
    .await;
    let (a, b) = (base.clone().with_name("a"), base.clone().with_name("b"));
    assert_eq!(a.check("k").await.unwrap().decided_by(), DecidedBy::Store);
    assert_eq!(
        a.check("k").await.unwrap().decided_by(),
        DecidedBy::LocalQuota
    );
    assert_eq!(
        b.check("k").await.unwrap().decided_by(),
        DecidedBy::Store,
        "b used a's units"
    );
    // A block reaches the units this process holds.
    a.block("k", Duration::from_secs(60)).await.unwrap();
    let blocked = a.check("k").await.unwrap();
    assert!(!blocked.allowed(), "{:?}", blocked.decided_by());
}

#[tokio::test]
async fn a_cost_counts_in_whole_requests_and_impossible_quotas_are_refused() {
    let server = RedisServer::start();
    // Cost 2, batches of 4 requests (8 units) under 10 per hour.
    let policy = "10/h".parse::<Policy>().unwrap().with_cost(2).unwrap();
    let limiter = process(
        &server,
        &policy,
        LocalQuota::new(4, Duration::from_secs(60)).unwrap(),
    )
    .await;
    let mut sources = Vec::new();
    for _ in 0..5 {
        let verdict = limiter.check("k").await.unwrap();
        assert!(verdict.allowed());
        sources.push(verdict.decided_by());
    }
    assert_eq!(
        sources,
        [
            DecidedBy::Store,
            DecidedBy::LocalQuota,
            DecidedBy::LocalQuota,
            DecidedBy::LocalQuota,
            DecidedBy::Store
        ]
    );
    assert!(
        !limiter.check("k").await.unwrap().allowed(),
        "10 units spent"
    );

    let quota = LocalQuota::new(5, Duration::from_secs(1)).unwrap();
    let store = || async { RedisStore::connect(&server.url()).await.unwrap() };
    // A batch that cannot hold two requests (3 per hour at a cost of 2).
    let small = "3/h".parse::<Policy>().unwrap().with_cost(2).unwrap();
    assert!(
        Limiter::new(store().await, small)
            .with_local_quota(quota)
            .is_err()
    );
    // Local units would not be spaced.
    let spaced = "10/s"
        .parse::<Policy>()
        .unwrap()
        .with_min_spacing(Duration::from_millis(50))
        .unwrap();
    let error = Limiter::new(store().await, spaced)
        .with_local_quota(quota)
        .unwrap_err();
    assert!(error.to_string().contains("spacing"), "{error}");
    assert!(LocalQuota::new(5, Duration::MAX).is_err());
}

/// While Redis is down, the fallback store is charged one request per
/// check, never a batch.
#[tokio::test]
async fn the_fallback_store_is_never_charged_a_batch() {
    let mut server = RedisServer::start();
    let policy: Policy = "20/h".parse().unwrap();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limiter = tower_redis_ratelimit::Limiter::new(store, policy)
        .with_fail_mode(tower_redis_ratelimit::FailMode::fallback(
            tower_redis_ratelimit::MemoryStore::new(),
            1,
        ))
        .with_local_quota(LocalQuota::new(5, Duration::from_secs(60)).unwrap())
        .unwrap();
    server.kill();
    let mut admitted = 0;
    for _ in 0..25 {
        let verdict = limiter.check("k").await.unwrap();
        if verdict.allowed() {
            assert_eq!(verdict.decided_by(), DecidedBy::Fallback);
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 20,
        "the fallback's own 20 per hour, one per check"
    );
}

/// A rule's `local_quota` applies to its checks, and goes and comes with
/// the rule set: replaced by a set without it, every check asks Redis.
#[tokio::test]
async fn a_rule_carries_its_local_quota_through_a_reload() {
    use tower_redis_ratelimit::rules::{Call, RuleSet, Rules};

    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let set = |quota: &str| {
        RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"all\"\nkey = \"global\"\npolicy = \"100000/h\"\n\
             algorithm = \"gcra\"\n{quota}"
        ))
        .unwrap()
    };
    let rules = Rules::new(store, set("local_quota = \"10/1m\"\n"));
    let checks = |n: usize| {
        let rules = rules.current();
        async move {
            let mut sources = Vec::new();
            for _ in 0..n {
                let check = rules
                    .check(&http::Method::GET, "/", None, |_| {
                        Ok::<_, ()>(Some(Call::new("k")))
                    })
                    .unwrap();
                let admission = check.await.unwrap();
                assert!(admission.allowed());
                sources.push(admission.shown().unwrap().3);
            }
            sources
        }
    };
    // Warm up (the script loaded), then count.
    checks(1).await;
    let before = server.calls("evalsha");
    let sources = checks(50).await;
    let asked = server.calls("evalsha") - before;
    let local = sources
        .iter()
        .filter(|s| **s == DecidedBy::LocalQuota)
        .count();
    // The warm-up's batch holds 9 more; then a batch of 10 per 10 checks.
    assert!((4..=6).contains(&asked), "{asked} checks in Redis for 50");
    assert!(local >= 44, "{local} of 50 admitted locally");

    rules.replace(set(""));
    let before = server.calls("evalsha");
    let sources = checks(20).await;
    assert_eq!(
        server.calls("evalsha") - before,
        20,
        "no local quota any more"
    );
    assert!(sources.iter().all(|s| *s == DecidedBy::Store));
}

/// Units a process took and nobody used go back to the store when their
/// batch expires: two processes (each its own store and units) with
/// batches of 5, a limit of 10 a day, and a light client alternating
/// between them, a request every 400 ms (past each batch's 150 ms), is
/// admitted ten times, as without a local quota. Before, each process's
/// batch held its unused units for the whole day and the third request was
/// denied for hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_units_go_back_so_a_light_client_gets_its_whole_limit() {
    use tower_redis_ratelimit::policy::Execution;
    // The fixed and sliding windows of a day are aligned to the UTC day.
    crate::support::harness::away_from_a_boundary(
        Duration::from_secs(86_400),
        Duration::from_secs(30),
    )
    .await;
    let server = RedisServer::start();
    let base: Policy = "10/86400s".parse().unwrap();
    let policies = [
        base.clone().with_execution(Execution::Transaction).unwrap(),
        base.clone().with_execution(Execution::Script).unwrap(),
        base.clone().fixed_window().unwrap(),
        base.clone().sliding_window().unwrap(),
        base.gcra().unwrap(),
    ];
    let quota: LocalQuota = "5/150ms".parse().unwrap();
    let memory = tower_redis_ratelimit::MemoryStore::new();
    let mut runs = Vec::new();
    for (n, policy) in policies.into_iter().enumerate() {
        // The two executions of the sliding log share its counts.
        let key = format!("light-{n}");
        let in_redis = [
            process(&server, &policy, quota).await,
            process(&server, &policy, quota).await,
        ];
        let in_memory = [0, 1].map(|_| {
            Limiter::new(memory.clone(), policy.clone())
                .with_name("hot")
                .with_local_quota(quota)
                .unwrap()
        });
        for (store, processes) in [("redis", in_redis), ("memory", in_memory)] {
            let what = format!("{store} {}", policy.algorithm());
            let key = key.clone();
            runs.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                for i in 0..12 {
                    let verdict = processes[i % 2].check(&key).await.unwrap();
                    admitted.push(verdict.allowed());
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                (what, admitted)
            }));
        }
    }
    let expected: Vec<bool> = (0..12).map(|i| i < 10).collect();
    let mut wrong = Vec::new();
    for run in runs {
        let (what, admitted) = run.await.unwrap();
        if admitted != expected {
            wrong.push(format!("{what}: {admitted:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "admitted, not ten then denied: {wrong:#?}"
    );
}
