//! Decisions through `PostgresStore`, to be set beside rate-limiter-flexible's
//! `RateLimiterPostgres` (`benches/postgres_peer.js`) on the same database:
//! decisions per second, WAL bytes per decision (how far the server's
//! write-ahead log moved) and the 99th percentile of a decision's latency,
//! with 1 and 50 checks in flight over 10,000 keys in turn (each
//! algorithm and setting its own keys, kept from round to round), a limit no key
//! reaches, a pool of 50; for the fixed window and GCRA, with
//! `synchronous_commit` on (the default) and off. Every key is checked once
//! before the measurements (its row exists, as in a service that has run a
//! while). With `synchronous_commit` on, also a store that keeps none of
//! the rows it saw (`unseen`): every key as if another process wrote it
//! last. Then the floor one at a time: a bare prepared `UPDATE` of the
//! same rows (`RESULT floor-1-<sync>`). Then exactness: a 100/min key hit
//! 1,000 times at 50 in flight.
//!
//! Run by `scripts/bench-postgres`, which starts a PostgreSQL server of its
//! own and alternates rounds of this bench and of the peer; by hand:
//!
//! ```sh
//! BENCH_DATABASE_URL="host=127.0.0.1 user=postgres dbname=postgres" \
//!   cargo bench --features postgres --bench postgres
//! ```
//!
//! Prints `RESULT crate-[unseen-]<algorithm>-<in flight>-<sync> <decisions/s>
//! <WAL bytes a decision> <p99 µs>` per measurement and `EXACT
//! crate-<algorithm> <admitted> <failed>`. Settings (environment):
//! `BENCH_SECONDS` (each measurement, default 5), `BENCH_KEYS` (distinct
//! keys, default 10,000).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tower_redis_ratelimit::store::DEFAULT_SEEN_BYTES;
use tower_redis_ratelimit::{Policy, PostgresStore, Store};

/// A limit no key of the run reaches: every check is admitted and writes.
const GENEROUS: &str = "1000000/min";

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds = Duration::from_secs_f64(var("BENCH_SECONDS").map_or(5.0, |v| v.parse().unwrap()));
    let keys: u64 = var("BENCH_KEYS").map_or(10_000, |v| v.parse().unwrap());
    let database_url =
        var("BENCH_DATABASE_URL").expect("set BENCH_DATABASE_URL (scripts/bench-postgres does)");
    let (stats, connection) = tokio_postgres::connect(&database_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let generous: Policy = GENEROUS.parse().unwrap();
    let algorithms = [
        ("fixed", generous.clone()),
        ("gcra", generous.gcra().unwrap()),
    ];
    for synchronous_commit in [true, false] {
        let sync = if synchronous_commit { "on" } else { "off" };
        let connect = |seen_bytes| {
            PostgresStore::builder(&database_url)
                .pool_size(50)
                .synchronous_commit(synchronous_commit)
                .seen_bytes(seen_bytes)
                .connect()
        };
        let store = connect(DEFAULT_SEEN_BYTES).await.unwrap();
        // Keys this process never saw: as if another process wrote each
        // since (a store that keeps no rows).
        let unseen = connect(0).await.unwrap();
        for (name, policy) in &algorithms {
            let prefix = format!("{name}-{sync}");
            // Every key checked once first, unmeasured: the rows exist, as
            // in a service that has run a while.
            measure(&store, policy, &prefix, 50, keys, Duration::ZERO).await;
            for in_flight in [1, 50] {
                let mut stores = vec![("", &store)];
                if synchronous_commit {
                    stores.push(("unseen-", &unseen));
                }
                for (kind, store) in stores {
                    let before = wal_position(&stats).await;
                    let (rate, p99, decisions) =
                        measure(store, policy, &prefix, in_flight, keys, seconds).await;
                    let wal = (wal_position(&stats).await - before) as f64 / decisions as f64;
                    println!(
                        "RESULT crate-{kind}{name}-{in_flight}-{sync} {rate:.0} {wal:.0} {}",
                        p99.as_micros()
                    );
                }
            }
        }
        // The floor one at a time: one prepared statement writing a row in
        // place and committing, from a bare tokio-postgres client, the
        // least any limiter on this table pays a decision.
        let before = wal_position(&stats).await;
        let (rate, p99, decisions) = floor(&database_url, sync, keys, seconds).await;
        let wal = (wal_position(&stats).await - before) as f64 / decisions as f64;
        println!(
            "RESULT floor-1-{sync} {rate:.0} {wal:.0} {}",
            p99.as_micros()
        );
        if synchronous_commit {
            let hundred: Policy = "100/min".parse().unwrap();
            for (name, policy) in [
                ("fixed", hundred.clone()),
                ("gcra", hundred.gcra().unwrap()),
            ] {
                let (admitted, failed) = exactness(&store, &policy, name).await;
                println!("EXACT crate-{name} {admitted} {failed}");
            }
        }
    }
}

/// The position of the server's write-ahead log (bytes).
async fn wal_position(client: &tokio_postgres::Client) -> i64 {
    let row = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint",
            &[],
        )
        .await
        .unwrap();
    row.get(0)
}

/// Checks of `keys` keys in turn, `in_flight` at a time, for `seconds`
/// (zero: one pass over the keys): decisions per second, the 99th
/// percentile of their latency, and how many there were.
async fn measure<S: Store + Clone>(
    store: &S,
    policy: &Policy,
    prefix: &str,
    in_flight: usize,
    keys: u64,
    seconds: Duration,
) -> (f64, Duration, usize) {
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let started = Instant::now();
    for _ in 0..in_flight {
        let (store, policy, prefix) = (store.clone(), policy.clone(), prefix.to_owned());
        let (next, stop) = (Arc::clone(&next), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if seconds.is_zero() && n >= keys {
                    break;
                }
                let n = n % keys;
                let key = format!("{prefix}-{n}");
                let asked = Instant::now();
                assert!(store.check(&key, &policy).await.unwrap().allowed());
                latencies.push(asked.elapsed());
            }
            latencies
        }));
    }
    if !seconds.is_zero() {
        tokio::time::sleep(seconds).await;
        stop.store(true, Ordering::Relaxed);
    }
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

/// `UPDATE … SET state = state` of the fixed window's rows in turn, one at
/// a time, for `seconds`, on a session of its own with
/// `synchronous_commit` as `sync` says: decisions per second, the 99th
/// percentile, how many.
async fn floor(url: &str, sync: &str, keys: u64, seconds: Duration) -> (f64, Duration, usize) {
    let mut config: tokio_postgres::Config = url.parse().unwrap();
    config.options(format!("-c synchronous_commit={sync}"));
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let update = client
        .prepare_typed(
            "UPDATE rate_limits SET state = state, expires_at = expires_at WHERE key = $1",
            &[tokio_postgres::types::Type::BYTEA],
        )
        .await
        .unwrap();
    let mut latencies = Vec::new();
    let started = Instant::now();
    let mut n = 0;
    while started.elapsed() < seconds {
        let key = format!("fixed-{sync}-{}", n % keys);
        n += 1;
        let asked = Instant::now();
        assert_eq!(
            client.execute(&update, &[&key.as_bytes()]).await.unwrap(),
            1
        );
        latencies.push(asked.elapsed());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    (
        latencies.len() as f64 / elapsed.as_secs_f64(),
        p99,
        latencies.len(),
    )
}

/// One key hit 1,000 times, 50 at a time: how many were admitted, and how
/// many failed (a store error or timeout).
async fn exactness(store: &PostgresStore, policy: &Policy, name: &str) -> (u64, u64) {
    let key = format!("exact-{name}-{}", std::process::id());
    let left = Arc::new(AtomicU64::new(1000));
    let (admitted, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (store, policy, key) = (store.clone(), policy.clone(), key.clone());
        let (left, admitted, failed) = (left.clone(), admitted.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            while left
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
            {
                match store.check(&key, &policy).await {
                    Ok(decision) if decision.allowed() => admitted.fetch_add(1, Ordering::Relaxed),
                    Ok(_) => 0,
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    (
        admitted.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    )
}
