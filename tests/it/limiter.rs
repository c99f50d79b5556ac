//! The engine without HTTP: `Limiter` against MemoryStore (manual clock)
//! and a real redis-server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::support::RedisServer;
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::limiter::DecidedBy;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{
    FailMode, LimitError, Limiter, MemoryStore, Policy, PolicyError, RedisStore, StoreError,
};

fn policy(text: &str) -> Policy {
    text.parse().unwrap()
}

async fn redis_limiter(server: &RedisServer, policy: Policy) -> Limiter {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    Limiter::new(store, policy)
}

#[tokio::test]
async fn check_counts_and_denies_with_a_decision() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let limiter = Limiter::new(MemoryStore::with_clock(clock.clone()), policy("2/s"));
    for _ in 0..2 {
        let verdict = limiter.check("k").await.unwrap();
        assert!(verdict.allowed());
        assert_eq!(verdict.decided_by(), DecidedBy::Store);
        assert_eq!(verdict.retry_after(), Duration::ZERO);
    }
    let denied = limiter.check("k").await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.decision().unwrap().remaining(), 0);
    assert!(denied.retry_after() > Duration::ZERO);
    assert!(
        limiter.check("other").await.unwrap().allowed(),
        "keys are separate"
    );
    clock.advance(denied.retry_after());
    assert!(limiter.check("k").await.unwrap().allowed());
}

#[tokio::test]
async fn check_n_counts_the_cost_and_rejects_an_impossible_one() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let limiter = Limiter::new(MemoryStore::with_clock(clock), policy("5/s"));
    let verdict = limiter.check_n("k", 3).await.unwrap();
    assert_eq!(verdict.decision().unwrap().remaining(), 2);
    assert!(
        !limiter.check_n("k", 3).await.unwrap().allowed(),
        "3 more do not fit"
    );
    assert!(
        limiter.check_n("k", 2).await.unwrap().allowed(),
        "2 more do"
    );
    match limiter.check_n("k", 6).await {
        Err(LimitError::Policy(PolicyError::CostAboveMax { cost: 6, .. })) => {}
        other => panic!("a cost above the max is an error naming it: {other:?}"),
    }
}

#[tokio::test]
async fn allowed_keys_are_never_limited() {
    let limiter = Limiter::new(MemoryStore::new(), policy("1/min")).with_allowed_keys(["ops"]);
    for _ in 0..3 {
        let verdict = limiter.check("ops").await.unwrap();
        assert!(verdict.allowed());
        assert_eq!(verdict.decided_by(), DecidedBy::AllowedKey);
        assert!(verdict.decision().is_none());
    }
}

/// `until_ready` sleeps a denial out and is then admitted; a denial longer
/// than `max_wait` is an error at once, without sleeping.
#[tokio::test]
async fn until_ready_waits_within_max_wait_only() {
    let server = RedisServer::start();
    for execution in [Execution::Transaction, Execution::Script] {
        let limiter = redis_limiter(
            &server,
            policy("2/300ms").with_execution(execution).unwrap(),
        )
        .await;
        let key = format!("until-ready-{execution}");
        assert!(limiter.check(&key).await.unwrap().allowed());
        assert!(limiter.check(&key).await.unwrap().allowed());

        let started = Instant::now();
        match limiter.until_ready(&key, Duration::from_millis(50)).await {
            Err(LimitError::Limited(decision)) => {
                assert!(decision.retry_after() > Duration::from_millis(50))
            }
            other => panic!("{execution}: a wait beyond max_wait fails: {other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "{execution}: no sleep before giving up: {:?}",
            started.elapsed()
        );

        let started = Instant::now();
        let verdict = limiter
            .until_ready(&key, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(verdict.allowed());
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(150) && waited < Duration::from_millis(1_500),
            "{execution}: waited the window out: {waited:?}"
        );
    }
}

/// Concurrency: `acquire` returns a permit holding a slot; dropping it (or
/// releasing it) frees the slot, in process and in Redis.
#[tokio::test]
async fn acquire_holds_a_slot_until_the_permit_is_dropped() {
    let server = RedisServer::start();
    let memory = Limiter::new(MemoryStore::new(), Policy::concurrency(2).unwrap());
    let redis = redis_limiter(&server, Policy::concurrency(2).unwrap()).await;
    for (store, limiter) in [("memory", memory), ("redis", redis)] {
        let first = limiter.acquire("job", Duration::ZERO).await.unwrap();
        let second = limiter.acquire("job", Duration::ZERO).await.unwrap();
        assert!(
            first.lease().is_some() && second.lease().is_some(),
            "{store}"
        );
        match limiter.acquire("job", Duration::ZERO).await {
            Err(LimitError::Limited(_)) => {}
            other => panic!("{store}: a third slot is refused: {other:?}"),
        }
        drop(first);
        // Redis releases in a task: wait for the slot rather than assume it.
        let third = limiter
            .acquire("job", Duration::from_secs(2))
            .await
            .unwrap_or_else(|e| panic!("{store}: the dropped slot is free again: {e}"));
        second.release().await.unwrap();
        let fourth = limiter.acquire("job", Duration::ZERO).await.unwrap();
        drop((third, fourth));
    }
}

/// Every fail mode, with the store down (a killed redis-server).
#[tokio::test]
async fn fail_modes_answer_when_the_store_is_down() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_millis(100));
    server.kill();
    let base = Limiter::new(store, policy("1/min")).without_circuit_breaker();

    let open = base.clone().with_fail_mode(FailMode::Open);
    let verdict = open.check("k").await.unwrap();
    assert!(verdict.allowed());
    assert_eq!(verdict.decided_by(), DecidedBy::FailOpen);
    assert!(verdict.decision().is_none());

    let closed = base.clone().with_fail_mode(FailMode::Closed);
    match closed.check("k").await {
        Err(LimitError::Store(_)) => {}
        other => panic!("closed fails: {other:?}"),
    }

    let fallback = base.with_fail_mode(FailMode::fallback(MemoryStore::new(), 1));
    let first = fallback.check("k").await.unwrap();
    assert!(first.allowed());
    assert_eq!(first.decided_by(), DecidedBy::Fallback);
    let second = fallback.check("k").await.unwrap();
    assert!(!second.allowed(), "the fallback limits");
    assert_eq!(second.decided_by(), DecidedBy::Fallback);

    // Operator commands report the failure: no fail mode for them.
    assert!(matches!(
        fallback.peek("k").await,
        Err(StoreError::Backend { .. } | StoreError::Timeout(_) | StoreError::PoolTimeout)
    ));
}

/// A denial whose store says it is final is held in the deny cache: the
/// next check of the key is answered without Redis, until an operator
/// resets the key in this process.
#[tokio::test]
async fn the_deny_cache_answers_until_a_reset() {
    let server = RedisServer::start();
    let limiter = redis_limiter(&server, policy("1/min").gcra().unwrap()).await;
    assert!(limiter.check("k").await.unwrap().allowed());
    let denied = limiter.check("k").await.unwrap();
    assert_eq!(
        (denied.allowed(), denied.decided_by()),
        (false, DecidedBy::Store)
    );
    let calls = server.calls("evalsha");
    let cached = limiter.check("k").await.unwrap();
    assert_eq!(
        (cached.allowed(), cached.decided_by()),
        (false, DecidedBy::DenyCache)
    );
    assert_eq!(server.calls("evalsha"), calls, "no round trip");

    limiter.reset("k").await.unwrap();
    let after = limiter.check("k").await.unwrap();
    assert_eq!(
        (after.allowed(), after.decided_by()),
        (true, DecidedBy::Store)
    );
}

/// Operator commands through the engine, shared by every process: a block
/// set by one limiter denies the key in another (its own store and
/// connections), and a reset there lifts it.
#[tokio::test]
async fn operator_commands_are_shared_through_redis() {
    let server = RedisServer::start();
    let one = redis_limiter(&server, policy("5/min")).await;
    let two = redis_limiter(&server, policy("5/min")).await;
    assert!(two.check("tenant").await.unwrap().allowed());

    // Peek is a dry run: the decision a check would get now (admitted,
    // leaving 3), counting nothing.
    let peeked = one.peek("tenant").await.unwrap();
    assert!(peeked.allowed());
    assert_eq!(peeked.remaining(), 3, "peek sees the other's check");
    assert_eq!(
        one.peek("tenant").await.unwrap().remaining(),
        3,
        "and consumes nothing"
    );

    one.block("tenant", Duration::from_secs(30)).await.unwrap();
    let blocked = two.check("tenant").await.unwrap();
    assert!(!blocked.allowed(), "blocked in the other process");
    assert!(blocked.retry_after() > Duration::from_secs(25));

    two.reset("tenant").await.unwrap();
    assert!(one.check("tenant").await.unwrap().allowed());

    let penalised = one.penalty("tenant", 4).await.unwrap();
    assert_eq!(penalised.remaining(), 0);
    assert!(!two.check("tenant").await.unwrap().allowed());
    let rewarded = two.reward("tenant", 2).await.unwrap();
    assert!(rewarded.allowed());
    assert_eq!(rewarded.remaining(), 1, "3 counted: a check would leave 1");
    assert!(one.check("tenant").await.unwrap().allowed());
}
