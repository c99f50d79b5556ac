//! Attacks on `PostgresStore`: several stores on one key while faults fire,
//! stale seen rows after another store's commands, big states against the
//! seen cache, concurrency slots across stores, and the pool after a restart.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::support::postgres::{PostgresServer, every_algorithm, rate_algorithms, through};
use crate::support::proxy::{Direction, FaultProxy};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, PostgresStore, Store};

/// A store of `server` deciding on `clock`.
async fn on_clock(server: &PostgresServer, clock: &ManualClock) -> PostgresStore {
    PostgresStore::builder(&server.url())
        .clock(clock.clone())
        .connect()
        .await
        .unwrap()
}

/// `store` and `memory` check `key` under `policy`: the same answer.
async fn decides_as_memory(
    store: &PostgresStore,
    memory: &MemoryStore,
    key: &str,
    policy: &Policy,
    at: &str,
) {
    let got = store.check(key, policy).await.unwrap();
    let want = memory.check(key, policy).await.unwrap();
    assert_eq!(
        (got.allowed(), got.remaining()),
        (want.allowed(), want.remaining()),
        "{:?} {at}",
        policy.algorithm()
    );
}

const T0: Duration = Duration::from_secs(1_700_000_000);

/// Four stores (one direct, three through proxies that stall and cut) hit
/// one key of every algorithm on a frozen clock: never more than the max
/// admitted, however many checks fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_stores_under_stalls_and_cuts_never_admit_over_max() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let proxies: Vec<FaultProxy> = (0..3).map(|_| FaultProxy::start(server.port())).collect();
    let mut stores = vec![
        PostgresStore::builder(&server.url())
            .clock(clock.clone())
            .timeout(Duration::from_millis(400))
            .connect()
            .await
            .unwrap(),
    ];
    for proxy in &proxies {
        stores.push(
            PostgresStore::builder(&through(proxy))
                .clock(clock.clone())
                .pool_size(4)
                .timeout(Duration::from_millis(400))
                .connect()
                .await
                .unwrap(),
        );
    }
    let proxies = Arc::new(proxies);
    for policy in every_algorithm(30) {
        let key = format!("attack-{}", policy.algorithm());
        let stop = Arc::new(AtomicBool::new(false));
        let faults = {
            let (proxies, stop) = (Arc::clone(&proxies), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let p = &proxies[(i % 3) as usize];
                    match i % 4 {
                        0 => p.stall(Direction::ToClient, Duration::from_millis(600)),
                        1 => p.cut_all(),
                        2 => p.stall(Direction::ToRedis, Duration::from_millis(300)),
                        _ => p.heal(),
                    }
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(37)).await;
                }
                for p in proxies.iter() {
                    p.heal();
                }
            })
        };
        let admitted = Arc::new(AtomicU32::new(0));
        let failed = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for t in 0..24 {
            let store = stores[t % stores.len()].clone();
            let (key, policy, admitted, failed) = (
                key.clone(),
                policy.clone(),
                Arc::clone(&admitted),
                Arc::clone(&failed),
            );
            tasks.push(tokio::spawn(async move {
                for _ in 0..12 {
                    match store.check(&key, &policy).await {
                        Ok(d) if d.allowed() => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        faults.await.unwrap();
        let admitted = admitted.load(Ordering::Relaxed);
        eprintln!(
            "{:?}: admitted {admitted}, failed {}",
            policy.algorithm(),
            failed.load(Ordering::Relaxed)
        );
        assert!(
            admitted <= 30,
            "{:?}: {admitted} admitted",
            policy.algorithm()
        );
        // Once healed, every store agrees the key is spent (the failed
        // checks may have counted, never given back).
        // (A check that times out on a loaded machine proves nothing
        // either way, and is let go.)
        for (i, store) in stores.iter().enumerate() {
            if let Ok(d) = store.check(&key, &policy).await {
                assert!(
                    !d.allowed() || admitted < 30,
                    "{:?}: store {i} admits past the max",
                    policy.algorithm()
                );
            }
        }
    }
}

/// A store that saw a key guesses on its row; another store's Block,
/// Reset, Penalty, Reward in between must be seen by the next decision,
/// exactly as a MemoryStore on the same clock decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_stale_guesses_after_another_stores_commands_match_memory() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let a = on_clock(&server, &clock).await;
    let b = on_clock(&server, &clock).await;
    let memory = MemoryStore::with_clock(clock.clone());
    let commands = [
        Command::Block(Duration::from_secs(5)),
        Command::Reset,
        Command::Penalty(3),
        Command::Block(Duration::ZERO),
        Command::Reward(2),
        Command::Penalty(100),
        Command::Reset,
    ];
    for policy in every_algorithm(5) {
        let key = format!("stale-{}", policy.algorithm());
        for (step, command) in commands.iter().enumerate() {
            for n in 0..3 {
                let at = format!(
                    "step {step} check {n} after {:?}",
                    commands[step.saturating_sub(1)]
                );
                decides_as_memory(&a, &memory, &key, &policy, &at).await;
            }
            let got = b.command(&key, &policy, *command).await.unwrap();
            let want = memory.command(&key, &policy, *command).await.unwrap();
            assert_eq!(
                (got.allowed(), got.remaining()),
                (want.allowed(), want.remaining()),
                "{:?} command {command:?}",
                policy.algorithm()
            );
            clock.advance(Duration::from_millis(700));
        }
    }
}

/// Time advancing past the row's expiry while a store keeps it seen, and
/// the row deleted by hand (as the cleanup does): the next check starts
/// a fresh count, never counts on the forgotten row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_rows_deleted_under_a_guess_start_afresh() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let a = on_clock(&server, &clock).await;
    let memory = MemoryStore::with_clock(clock.clone());
    let admin = server.client().await;
    for policy in every_algorithm(4) {
        let key = format!("gone-{}", policy.algorithm());
        for round in 0..4 {
            for n in 0..3 {
                let at = format!("round {round} check {n}");
                decides_as_memory(&a, &memory, &key, &policy, &at).await;
            }
            admin.execute("DELETE FROM rate_limits", &[]).await.unwrap();
            memory.command(&key, &policy, Command::Reset).await.unwrap();
        }
    }
}

/// A sliding log with a big max: its state is far bigger than the seen
/// cache; two stores hitting it at once admit exactly the max.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_sliding_log_bigger_than_the_seen_cache_stays_exact() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let make = |seen: usize| {
        PostgresStore::builder(&server.url())
            .clock(clock.clone())
            .seen_bytes(seen)
            .timeout(Duration::from_secs(20))
            .connect()
    };
    let stores = [make(4096).await.unwrap(), make(1 << 20).await.unwrap()];
    let max = 1500u64;
    let policy: Policy = format!("{max}/1h")
        .parse::<Policy>()
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog)
        .unwrap();
    let left = Arc::new(AtomicI64::new(1800));
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let store = stores[t % 2].clone();
        let (policy, left, admitted, clock) = (
            policy.clone(),
            Arc::clone(&left),
            Arc::clone(&admitted),
            clock.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while left.fetch_sub(1, Ordering::AcqRel) > 0 {
                let d = store.check("big", &policy).await.unwrap();
                if d.allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
                clock.advance(Duration::from_micros(1));
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(admitted.load(Ordering::Relaxed), max);
}

/// Concurrency slots shared by three stores: holders never exceed the max
/// while connections are cut under them, and every slot given back can be
/// taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_concurrency_slots_across_stores_with_cuts() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let proxy = FaultProxy::start(server.port());
    let stores = [
        PostgresStore::builder(&server.url())
            .clock(clock.clone())
            .connect()
            .await
            .unwrap(),
        PostgresStore::builder(&server.url())
            .clock(clock.clone())
            .connect()
            .await
            .unwrap(),
        PostgresStore::builder(&through(&proxy))
            .clock(clock.clone())
            .timeout(Duration::from_millis(400))
            .connect()
            .await
            .unwrap(),
    ];
    let policy = Policy::concurrency(4).unwrap();
    let holding = Arc::new(AtomicI64::new(0));
    let worst = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let cutter = {
        let stop = Arc::clone(&stop);
        let proxy = Arc::new(proxy);
        let p = Arc::clone(&proxy);
        (
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    if i % 3 == 0 {
                        p.cut_all();
                    }
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }),
            proxy,
        )
    };
    let mut tasks = Vec::new();
    for t in 0..12 {
        let store = stores[t % 3].clone();
        let (policy, holding, worst) = (policy.clone(), Arc::clone(&holding), Arc::clone(&worst));
        tasks.push(tokio::spawn(async move {
            for _ in 0..25 {
                let Ok(d) = store.check("slots", &policy).await else {
                    continue;
                };
                if let Some(lease) = d.lease() {
                    let now = holding.fetch_add(1, Ordering::AcqRel) + 1;
                    worst.fetch_max(now, Ordering::AcqRel);
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    holding.fetch_sub(1, Ordering::AcqRel);
                    // Given back by a direct store if the proxied one fails.
                    let _ = store.release("slots", &policy, lease).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    cutter.0.await.unwrap();
    assert!(
        worst.load(Ordering::Relaxed) <= 4,
        "{} holders",
        worst.load(Ordering::Relaxed)
    );
}

/// A server restart with a warm pool and 150 callers right after: every
/// check is decided (none fails on a session the restart closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_many_callers_right_after_a_restart_are_all_decided() {
    let mut server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .pool_size(6)
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let policy = Arc::new("1000/min".parse::<Policy>().unwrap());
    for round in 0..3 {
        let mut callers = Vec::new();
        for i in 0..150 {
            let (store, policy) = (store.clone(), Arc::clone(&policy));
            callers.push(tokio::spawn(async move {
                store.check(&format!("k-{}", i % 7), &policy).await
            }));
        }
        let mut errors = Vec::new();
        for caller in callers {
            if let Err(e) = caller.await.unwrap() {
                errors.push(e.to_string());
            }
        }
        assert!(
            errors.is_empty(),
            "round {round}: {} failed: {:?}",
            errors.len(),
            &errors[..errors.len().min(3)]
        );
        server.restart();
    }
}

/// A server restart while three stores race one key (their sessions cut
/// mid-statement, some mid-transaction on the locked path): what was cut
/// counts at most once, never over max; every store decides after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack_a_restart_mid_run_never_admits_over_max() {
    let mut server = PostgresServer::start();
    let clock = ManualClock::new(T0);
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(
            PostgresStore::builder(&server.url())
                .clock(clock.clone())
                .pool_size(5)
                .timeout(Duration::from_millis(800))
                .connect()
                .await
                .unwrap(),
        );
    }
    for policy in rate_algorithms(40) {
        let key = format!("restart-{}", policy.algorithm());
        let admitted = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for t in 0..15 {
            let store = stores[t % 3].clone();
            let (key, policy, admitted) = (key.clone(), policy.clone(), Arc::clone(&admitted));
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    if let Ok(d) = store.check(&key, &policy).await
                        && d.allowed()
                    {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        tokio::task::block_in_place(|| server.restart());
        for task in tasks {
            task.await.unwrap();
        }
        let admitted = admitted.load(Ordering::Relaxed);
        assert!(admitted <= 40, "{:?}: {admitted}", policy.algorithm());
    }
}
