//! Operator commands ([`Store::command`]: peek, reset, block, penalty,
//! reward) on every algorithm (the sliding log in both executions) and every
//! store: MemoryStore on a manual clock, RedisStore on one server and on a
//! three-master Redis Cluster, with the same expectations. On Redis, a
//! second store on the same server (or cluster) must see what the first
//! one's commands did.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::RedisServer;
use crate::support::harness::away_from_a_boundary;
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Algorithm, Decision, MemoryStore, Policy, RedisStore, Store};

/// Every policy allows 3 per hour (the concurrency limit: 3 in flight, with
/// a lease of an hour): nothing refills during a test on real time.
const MAX: u64 = 3;
const WINDOW: Duration = Duration::from_secs(3600);
/// How long a test block lasts.
const BLOCK: Duration = Duration::from_millis(400);

#[derive(Debug, Clone, Copy)]
enum Variant {
    SlidingLog(Execution),
    FixedWindow,
    SlidingWindow,
    Gcra,
    Concurrency,
}

const VARIANTS: [Variant; 6] = [
    Variant::SlidingLog(Execution::Transaction),
    Variant::SlidingLog(Execution::Script),
    Variant::FixedWindow,
    Variant::SlidingWindow,
    Variant::Gcra,
    Variant::Concurrency,
];

impl Variant {
    fn policy(self) -> Policy {
        let base: Policy = "3/h".parse().unwrap();
        match self {
            Self::SlidingLog(execution) => base.with_execution(execution).unwrap(),
            Self::FixedWindow => base.with_algorithm(Algorithm::FixedWindow).unwrap(),
            Self::SlidingWindow => base.with_algorithm(Algorithm::SlidingWindow).unwrap(),
            Self::Gcra => base.with_algorithm(Algorithm::Gcra).unwrap(),
            Self::Concurrency => Policy::concurrency(MAX)
                .unwrap()
                .with_lease(WINDOW)
                .unwrap(),
        }
    }
}

/// The stores of one test: `a` runs the commands and checks; `b` is another
/// store on the same state (another process, on Redis).
enum Stores {
    Memory {
        store: MemoryStore,
        clock: ManualClock,
    },
    Redis {
        a: RedisStore,
        b: RedisStore,
        _server: Box<dyn std::any::Any + Send>,
    },
}

impl Stores {
    fn memory() -> Self {
        let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
        Self::Memory {
            store: MemoryStore::with_clock(clock.clone()),
            clock,
        }
    }

    async fn redis() -> Self {
        let server = RedisServer::start();
        Self::Redis {
            a: RedisStore::connect(&server.url()).await.unwrap(),
            b: RedisStore::connect(&server.url()).await.unwrap(),
            _server: Box::new(server),
        }
    }

    #[cfg(feature = "cluster")]
    async fn cluster() -> Self {
        let cluster = support::RedisCluster::start();
        Self::Redis {
            a: RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
            b: RedisStore::connect_cluster(&cluster.urls()).await.unwrap(),
            _server: Box::new(cluster),
        }
    }

    async fn check(&self, key: &str, policy: &Policy) -> Decision {
        match self {
            Self::Memory { store, .. } => store.check(key, policy).await.unwrap(),
            Self::Redis { a, .. } => a.check(key, policy).await.unwrap(),
        }
    }

    /// A check by the other store.
    async fn check_b(&self, key: &str, policy: &Policy) -> Decision {
        match self {
            Self::Memory { store, .. } => store.check(key, policy).await.unwrap(),
            Self::Redis { b, .. } => b.check(key, policy).await.unwrap(),
        }
    }

    async fn command(&self, key: &str, policy: &Policy, command: Command) -> Decision {
        match self {
            Self::Memory { store, .. } => store.command(key, policy, command).await.unwrap(),
            Self::Redis { a, .. } => a.command(key, policy, command).await.unwrap(),
        }
    }

    async fn advance(&self, d: Duration) {
        match self {
            Self::Memory { clock, .. } => clock.advance(d),
            Self::Redis { .. } => tokio::time::sleep(d + Duration::from_millis(40)).await,
        }
    }

    /// How much less than expected a wait may be: what passed meanwhile.
    fn slack(&self) -> Duration {
        match self {
            Self::Memory { .. } => Duration::ZERO,
            Self::Redis { .. } => Duration::from_millis(150),
        }
    }
}

#[track_caller]
fn admitted(d: &Decision, remaining: u64, what: &str) {
    assert!(d.allowed(), "{what}: denied {d:?}");
    assert_eq!(d.remaining(), remaining, "{what}: {d:?}");
    assert_eq!(d.retry_after(), Duration::ZERO, "{what}");
}

#[track_caller]
fn denied(d: &Decision, what: &str) {
    assert!(!d.allowed(), "{what}: admitted {d:?}");
    assert_eq!(d.remaining(), 0, "{what}: {d:?}");
    assert!(d.retry_after() > Duration::ZERO, "{what}: {d:?}");
    assert!(d.retry_after() <= 2 * WINDOW, "{what}: {d:?}");
    assert!(
        d.lease().is_none(),
        "{what}: a denied request holds a lease"
    );
}

/// A denial by the block: for about `left`, with nothing remaining.
#[track_caller]
fn blocked(stores: &Stores, d: &Decision, left: Duration, what: &str) {
    denied(d, what);
    let after = d.retry_after();
    assert!(
        after <= left && after + stores.slack() >= left,
        "{what}: retry after {after:?}, expected {left:?}"
    );
    for rate in d.rates() {
        assert_eq!(rate.remaining(), 0, "{what}");
    }
}

/// Check `n` times, every one admitted.
async fn take(stores: &Stores, key: &str, policy: &Policy, n: u64) {
    for i in 0..n {
        let d = stores.check(key, policy).await;
        assert!(d.allowed(), "check {i} of {n}: {d:?}");
    }
}

async fn peek_consumes_nothing(stores: &Stores, policy: &Policy) {
    let key = "peek";
    for _ in 0..3 {
        let d = stores.command(key, policy, Command::Peek).await;
        admitted(&d, MAX - 1, "peek of a new key");
        assert!(d.lease().is_none(), "a peek takes no lease");
    }
    admitted(&stores.check(key, policy).await, MAX - 1, "first check");
    admitted(
        &stores.command(key, policy, Command::Peek).await,
        MAX - 2,
        "peek after one",
    );
    take(stores, key, policy, MAX - 1).await;
    let full = stores.command(key, policy, Command::Peek).await;
    denied(&full, "peek of an exhausted key");
    let again = stores.command(key, policy, Command::Peek).await;
    denied(&again, "second peek of an exhausted key");
    denied(&stores.check(key, policy).await, "check after the peeks");
}

async fn reset_restores_a_full_quota(stores: &Stores, policy: &Policy) {
    let key = "reset";
    take(stores, key, policy, MAX).await;
    denied(&stores.check(key, policy).await, "exhausted");
    let d = stores.command(key, policy, Command::Reset).await;
    admitted(&d, MAX - 1, "after the reset");
    take(stores, key, policy, MAX).await;
    denied(&stores.check(key, policy).await, "exhausted again");

    // A reset also lifts a block.
    stores.command(key, policy, Command::Block(WINDOW)).await;
    admitted(
        &stores.command(key, policy, Command::Reset).await,
        MAX - 1,
        "reset of a blocked key",
    );
    admitted(&stores.check(key, policy).await, MAX - 1, "check after");
}

async fn block_denies_until_it_ends(stores: &Stores, policy: &Policy) {
    let key = "block";
    take(stores, key, policy, 1).await;
    let d = stores.command(key, policy, Command::Block(BLOCK)).await;
    blocked(stores, &d, BLOCK, "the block's answer");
    // Quota is left, yet every request is denied, by either store.
    blocked(stores, &stores.check(key, policy).await, BLOCK, "a check");
    blocked(
        stores,
        &stores.check_b(key, policy).await,
        BLOCK,
        "the other store's check",
    );
    blocked(
        stores,
        &stores.command(key, policy, Command::Peek).await,
        BLOCK,
        "a peek",
    );
    stores.advance(BLOCK).await;
    // The counts were kept: one request counted before the block.
    admitted(&stores.check(key, policy).await, MAX - 2, "after the block");

    // Zero lifts a block; a new block replaces the old one.
    stores.command(key, policy, Command::Block(WINDOW)).await;
    denied(&stores.check_b(key, policy).await, "blocked for an hour");
    let shorter = stores.command(key, policy, Command::Block(BLOCK)).await;
    blocked(stores, &shorter, BLOCK, "a shorter block replaces it");
    let lifted = stores
        .command(key, policy, Command::Block(Duration::ZERO))
        .await;
    admitted(&lifted, MAX - 3, "lifted");
    admitted(
        &stores.check_b(key, policy).await,
        MAX - 3,
        "the other store, lifted",
    );
    // A block of another key changes nothing here.
    stores
        .command("other", policy, Command::Block(WINDOW))
        .await;
    denied(&stores.check(key, policy).await, "exhausted, not blocked");
    let exhausted = stores.check(key, policy).await;
    assert!(exhausted.retry_after() > BLOCK, "{exhausted:?}");
}

async fn penalty_beyond_max_makes_the_key_wait(stores: &Stores, policy: &Policy) {
    let key = "penalty";
    let d = stores.command(key, policy, Command::Penalty(MAX + 2)).await;
    denied(&d, "the penalty's answer");
    let check = stores.check_b(key, policy).await;
    denied(&check, "a check after the penalty");
    // The wait is the algorithm's, not a block's.
    let expected_at_least = match policy.algorithm() {
        // A slot frees when a lease expires (an hour), suggested at most 1 s.
        Algorithm::Concurrency => Duration::from_secs(1),
        // The next window (at most an hour away).
        Algorithm::FixedWindow => Duration::from_millis(1),
        // Five units of 20 minutes over the bucket: 3 intervals past it.
        Algorithm::Gcra => WINDOW - stores.slack(),
        // The newest entries leave in an hour; the counter's estimate
        // falls below the max within the next window.
        _ => WINDOW / 2,
    };
    assert!(
        check.retry_after() >= expected_at_least,
        "{:?} < {expected_at_least:?}",
        check.retry_after()
    );
    // A small penalty takes exactly its units.
    let small = "penalty-small";
    stores.command(small, policy, Command::Penalty(1)).await;
    admitted(
        &stores.check(small, policy).await,
        MAX - 2,
        "after a penalty of 1",
    );
    admitted(&stores.check(small, policy).await, MAX - 3, "the last unit");
    denied(&stores.check(small, policy).await, "the penalty took one");
}

async fn reward_returns_quota_never_below_empty(stores: &Stores, policy: &Policy) {
    // Quota given back after use.
    let key = "reward";
    take(stores, key, policy, MAX).await;
    denied(&stores.check(key, policy).await, "exhausted");
    let d = stores.command(key, policy, Command::Reward(1)).await;
    admitted(&d, 0, "one unit back, the last one");
    admitted(&stores.check_b(key, policy).await, 0, "the unit given back");
    denied(&stores.check(key, policy).await, "exhausted again");

    // Never below an empty state.
    let fresh = "reward-fresh";
    admitted(
        &stores.command(fresh, policy, Command::Reward(100)).await,
        MAX - 1,
        "a reward of a new key",
    );
    take(stores, fresh, policy, MAX).await;
    denied(&stores.check(fresh, policy).await, "no more than max");

    // A penalty beyond the max, rewarded back.
    let both = "reward-penalty";
    stores
        .command(both, policy, Command::Penalty(MAX + 2))
        .await;
    admitted(
        &stores.command(both, policy, Command::Reward(MAX + 2)).await,
        MAX - 1,
        "penalty rewarded",
    );
    take(stores, both, policy, MAX).await;
    denied(&stores.check(both, policy).await, "and no more");
}

async fn every_command(stores: Stores, variant: Variant) {
    let policy = variant.policy();
    // Shown with a failure: which variant it was.
    eprintln!("{variant:?}");
    if matches!(stores, Stores::Redis { .. }) {
        // Wall-clock windows: keep an hour's edge out of the test.
        away_from_a_boundary(WINDOW, Duration::from_secs(20)).await;
    }
    peek_consumes_nothing(&stores, &policy).await;
    reset_restores_a_full_quota(&stores, &policy).await;
    block_denies_until_it_ends(&stores, &policy).await;
    penalty_beyond_max_makes_the_key_wait(&stores, &policy).await;
    reward_returns_quota_never_below_empty(&stores, &policy).await;
}

#[tokio::test]
async fn memory_store() {
    for variant in VARIANTS {
        every_command(Stores::memory(), variant).await;
    }
}

#[tokio::test]
async fn redis_store() {
    for variant in VARIANTS {
        every_command(Stores::redis().await, variant).await;
    }
}

#[cfg(feature = "cluster")]
#[tokio::test]
async fn redis_cluster() {
    for variant in VARIANTS {
        every_command(Stores::cluster().await, variant).await;
    }
}

/// Concurrency: a reward frees the oldest leases, a penalty's slots are
/// anonymous (nobody releases them; they expire after the lease time).
#[tokio::test]
async fn concurrency_reward_frees_the_oldest_leases() {
    for stores in [Stores::memory(), Stores::redis().await] {
        let policy = Policy::concurrency(2)
            .unwrap()
            .with_lease(Duration::from_secs(1))
            .unwrap();
        let first = stores.check("k", &policy).await;
        stores.advance(Duration::from_millis(100)).await;
        let second = stores.check("k", &policy).await;
        assert!(first.allowed() && second.allowed());
        denied(&stores.check("k", &policy).await, "two in flight");
        stores.command("k", &policy, Command::Reward(1)).await;
        let third = stores.check("k", &policy).await;
        assert!(third.allowed(), "the oldest lease was freed");
        // Releasing the freed lease frees nothing more.
        release(&stores, "k", &policy, first.lease().unwrap()).await;
        denied(&stores.check("k", &policy).await, "still two in flight");
        release(&stores, "k", &policy, second.lease().unwrap()).await;
        assert!(stores.check("k", &policy).await.allowed());

        // Anonymous slots of a penalty expire with the lease time.
        stores.command("p", &policy, Command::Penalty(5)).await;
        denied(&stores.check("p", &policy).await, "both slots taken");
        stores.advance(Duration::from_secs(1)).await;
        assert!(stores.check("p", &policy).await.allowed(), "expired");
    }
}

async fn release(
    stores: &Stores,
    key: &str,
    policy: &Policy,
    lease: tower_redis_ratelimit::decision::Lease,
) {
    match stores {
        Stores::Memory { store, .. } => store.release(key, policy, lease).await,
        Stores::Redis { a, .. } => a.release(key, policy, lease).await,
    }
    .unwrap();
}

/// A penalty far past the max, on algorithms that keep one entry per unit,
/// takes at most MAX_COST entries: a huge one neither fills memory nor
/// stalls Redis in one long script (it once wrote `max` entries, up to 2^53).
#[tokio::test]
async fn a_huge_penalty_is_capped_where_each_unit_takes_memory() {
    let server = RedisServer::start();
    // The bound under test is the 2 s below, not the default 250 ms timeout,
    // which a loaded machine can exceed writing 10,000 entries.
    let redis = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    let memory = MemoryStore::new();
    for policy in [
        "1000000000/h".parse::<Policy>().unwrap(),
        Policy::concurrency(1_000_000_000).unwrap(),
    ] {
        let what = policy.algorithm();
        let started = std::time::Instant::now();
        let after = redis
            .command("huge", &policy, Command::Penalty(u64::MAX))
            .await
            .unwrap();
        assert!(after.allowed(), "{what}: 10,000 of a billion taken");
        let prefix = if what == Algorithm::Concurrency {
            "conc"
        } else {
            "log"
        };
        let stored = support::zcard(&server, &redis.redis_key(prefix, "huge"));
        assert_eq!(
            stored as u64,
            tower_redis_ratelimit::policy::MAX_COST,
            "{what}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{what}: {:?}",
            started.elapsed()
        );
        let memory_after = memory
            .command("huge", &policy, Command::Penalty(u64::MAX))
            .await
            .unwrap();
        assert_eq!(memory_after.remaining(), after.remaining(), "{what}");
    }
}
