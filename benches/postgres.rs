//! Decisions through `PostgresStore` beside `RedisStore` on the same
//! machine: decisions per second and the 99th percentile of a decision's
//! latency, with 1 and 50 checks in flight, and the database's work per
//! decision: write transactions (transaction ids handed out) and WAL bytes
//! (how far its write-ahead log moved).
//!
//! Run by `scripts/bench-postgres`, which starts a redis-server and a
//! PostgreSQL server of its own; by hand:
//!
//! ```sh
//! BENCH_REDIS_URL=redis://127.0.0.1:6379 \
//! BENCH_DATABASE_URL="host=127.0.0.1 user=postgres dbname=postgres" \
//!   cargo bench --features postgres --bench postgres
//! ```
//!
//! Every measurement prints one line `RESULT <name> <value>`. Settings
//! (environment): `BENCH_SECONDS` (each measurement, default 5),
//! `BENCH_KEYS` (distinct keys, default 10,000).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tower_redis_ratelimit::{Policy, PostgresStore, RedisStore, Store};

/// A limit no key of the run reaches: every check is admitted and writes.
const GENEROUS: &str = "1000000/s";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds = Duration::from_secs_f64(var("BENCH_SECONDS").map_or(5.0, |v| v.parse().unwrap()));
    let keys: u64 = var("BENCH_KEYS").map_or(10_000, |v| v.parse().unwrap());
    let redis_url =
        var("BENCH_REDIS_URL").expect("set BENCH_REDIS_URL (scripts/bench-postgres does)");
    let database_url =
        var("BENCH_DATABASE_URL").expect("set BENCH_DATABASE_URL (scripts/bench-postgres does)");
    let policy = GENEROUS.parse::<Policy>().unwrap().gcra().unwrap();
    let redis = RedisStore::connect(&redis_url).await.unwrap();
    let postgres = PostgresStore::builder(&database_url)
        .pool_size(50)
        .connect()
        .await
        .unwrap();
    let (stats, connection) = tokio_postgres::connect(&database_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    for in_flight in [1, 50] {
        let (rate, p99, _) = measure(&redis, &policy, in_flight, keys, seconds).await;
        println!("RESULT redis-{in_flight}-decisions-per-s {rate:.0}");
        println!("RESULT redis-{in_flight}-p99-us {}", p99.as_micros());
        let before = database_work(&stats).await;
        let (rate, p99, decisions) = measure(&postgres, &policy, in_flight, keys, seconds).await;
        let after = database_work(&stats).await;
        println!("RESULT postgres-{in_flight}-decisions-per-s {rate:.0}");
        println!("RESULT postgres-{in_flight}-p99-us {}", p99.as_micros());
        let per = |a: i64, b: i64| (a - b) as f64 / decisions as f64;
        println!(
            "RESULT postgres-{in_flight}-transactions-per-decision {:.2}",
            per(after.0, before.0)
        );
        println!(
            "RESULT postgres-{in_flight}-wal-bytes-per-decision {:.0}",
            per(after.1, before.1)
        );
    }
}

/// Write transactions of the server so far (transaction ids handed out)
/// and WAL bytes written (the position of its write-ahead log).
async fn database_work(client: &tokio_postgres::Client) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT txid_snapshot_xmax(txid_current_snapshot())::bigint, \
             pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Checks of `keys` keys in turn, `in_flight` at a time, for `seconds`:
/// decisions per second, the 99th percentile of their latency, and how
/// many there were.
async fn measure<S: Store + Clone>(
    store: &S,
    policy: &Policy,
    in_flight: usize,
    keys: u64,
    seconds: Duration,
) -> (f64, Duration, usize) {
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let started = Instant::now();
    for _ in 0..in_flight {
        let (store, policy) = (store.clone(), policy.clone());
        let (next, stop) = (Arc::clone(&next), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let key = format!("bench-{}", next.fetch_add(1, Ordering::Relaxed) % keys);
                let asked = Instant::now();
                assert!(store.check(&key, &policy).await.unwrap().allowed());
                latencies.push(asked.elapsed());
            }
            latencies
        }));
    }
    tokio::time::sleep(seconds).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    let count = latencies.len();
    (count as f64 / elapsed.as_secs_f64(), p99, count)
}
