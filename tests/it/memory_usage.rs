//! Redis memory per limited key for each algorithm, measured with
//! `MEMORY USAGE` on a real redis-server. Run with `--nocapture` to print
//! the table BENCHMARKS.md shows.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::RedisServer;
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore, Store};

/// Fill one key to `max` admitted requests under `policy` and return
/// `MEMORY USAGE` of its Redis key, in bytes.
async fn bytes_per_key(
    server: &RedisServer,
    store: &RedisStore,
    policy: &Policy,
    key: &str,
) -> u64 {
    let requests = if policy.algorithm() == Algorithm::Concurrency {
        policy.rates()[0].max()
    } else {
        policy.rates().iter().map(|r| r.max()).min().unwrap()
    };
    for _ in 0..requests {
        assert!(store.check(key, policy).await.unwrap().allowed());
    }
    let tag = match policy.algorithm() {
        Algorithm::SlidingLog => "log",
        Algorithm::FixedWindow => "fixed",
        Algorithm::SlidingWindow => "swc",
        Algorithm::Gcra => "gcra",
        _ => "conc",
    };
    let redis_key = store.redis_key(tag, key);
    let reply = server.command(&["MEMORY", "USAGE", &redis_key, "SAMPLES", "0"]);
    reply
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap_or_else(|_| panic!("MEMORY USAGE {redis_key}: {reply:?}"))
}

#[tokio::test]
async fn memory_per_key_for_each_algorithm() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let limits = [10u64, 100, 1_000];
    let mut table = Vec::new();
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
        Algorithm::Concurrency,
    ] {
        let mut row = Vec::new();
        for max in limits {
            let policy = if algorithm == Algorithm::Concurrency {
                Policy::concurrency(max).unwrap()
            } else {
                format!("{max}/h")
                    .parse::<Policy>()
                    .unwrap()
                    .with_algorithm(algorithm)
                    .unwrap()
            };
            let key = format!("203.0.113.9-{algorithm}-{max}");
            row.push(bytes_per_key(&server, &store, &policy, &key).await);
        }
        table.push((algorithm, row));
    }
    println!(
        "| algorithm | {} |",
        limits.map(|m| format!("max {m}")).join(" | ")
    );
    println!("|---|{}", "---|".repeat(limits.len()));
    for (algorithm, row) in &table {
        let cells: Vec<String> = row.iter().map(|b| format!("{b} B")).collect();
        println!("| {algorithm} | {} |", cells.join(" | "));
    }
    // The shapes the policies guide claims: the log and the leases grow with the
    // limit; the counters and GCRA do not.
    for (algorithm, row) in &table {
        match algorithm {
            Algorithm::SlidingLog | Algorithm::Concurrency => {
                assert!(
                    row[2] > 20 * row[0],
                    "{algorithm}: {row:?} should grow with max"
                );
            }
            _ => assert!(
                row[2] <= row[0] + 16,
                "{algorithm}: {row:?} should not grow with max"
            ),
        }
    }
}
