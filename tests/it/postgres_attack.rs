//! Attacks on `PostgresStore` that held: stale seen rows after another
//! store's commands, rows deleted under a guess, a state bigger than the
//! seen rows' bound, and the pool after restarts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::support::postgres::{PostgresServer, every_algorithm};
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
