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
    // The window counters keep an integer per rate and window under the
    // key's name (`{name}:{window}:{index}`); the others one key.
    let keys = match policy.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingWindow => server.keys(&format!("{redis_key}:*")),
        _ => vec![redis_key],
    };
    assert!(!keys.is_empty(), "no key of {key}");
    keys.iter()
        .map(|redis_key| {
            let reply = server.command(&["MEMORY", "USAGE", redis_key, "SAMPLES", "0"]);
            reply
                .trim()
                .trim_start_matches(':')
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("MEMORY USAGE {redis_key}: {reply:?}"))
        })
        .sum()
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

/// Keys of 200 KB each, denied: the most denied keys hold each as `#` and
/// 40 hex digits (the form the admin API steers), in process and in the
/// set Redis shares between processes, so their bytes do not grow with
/// what clients send.
#[tokio::test]
async fn long_keys_reach_the_top_keys_by_their_hash() {
    use tower_redis_ratelimit::{Limiter, MemoryStore};
    let server = RedisServer::start();
    let redis = RedisStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "1/1h".parse().unwrap();
    let long = "k".repeat(200_000);
    for (what, limiter) in [
        ("memory", Limiter::new(MemoryStore::new(), policy.clone())),
        ("redis", Limiter::new(redis, policy.clone())),
    ] {
        let limiter = limiter.with_name("flood");
        // Watched from now on, as an admin router does.
        assert!(limiter.most_denied().await.unwrap().is_empty());
        for i in 0..40 {
            let key = format!("{i}{long}");
            assert!(limiter.check(&key).await.unwrap().allowed());
            for _ in 0..=i % 3 {
                assert!(!limiter.check(&key).await.unwrap().allowed());
            }
        }
        let top = limiter.most_denied().await.unwrap();
        assert!(!top.is_empty() && top.len() <= 32, "{what}: {}", top.len());
        for (key, _) in &top {
            assert_eq!(key.len(), 41, "{what}: {}…", &key[..key.len().min(50)]);
            assert!(key.starts_with('#'), "{what}");
        }
    }
    // Redis's set of this minute's denials: 40 members of 41 bytes.
    let sets = server.command(&["KEYS", "rl:denied:*"]);
    let set = sets
        .lines()
        .find(|l| l.starts_with("rl:denied:"))
        .unwrap_or_else(|| panic!("no denials set: {sets:?}"));
    let members = server.command(&["ZRANGE", set, "0", "-1"]);
    let longest = members
        .lines()
        .filter(|l| !l.starts_with('*') && !l.starts_with('$'))
        .map(str::len)
        .max()
        .unwrap();
    assert_eq!(longest, 41, "{members}");
    let bytes: u64 = server
        .command(&["MEMORY", "USAGE", set, "SAMPLES", "0"])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    // 128 members at most, each at most 128 bytes: well under 64 KiB
    // (the flood before held 7.6 MB).
    assert!(bytes < 64 * 1024, "{bytes} bytes");
}
