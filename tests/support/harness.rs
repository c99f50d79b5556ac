//! One store under test and how time moves for it, for conformance suites
//! that run the same cases on MemoryStore (manual clock, exact values) and
//! RedisStore (real redis-server, real time, margins).

use std::time::{Duration, Instant};

use tower_redis_ratelimit::{
    Decision, Execution, ManualClock, MemoryStore, Policy, RedisStore, Store,
};

use super::RedisServer;

pub const MS: Duration = Duration::from_millis(1);

/// One store under test, and how time moves for it.
pub enum Harness {
    Memory {
        store: MemoryStore,
        clock: ManualClock,
    },
    Redis {
        store: RedisStore,
        execution: Execution,
        _server: RedisServer,
    },
}

/// A point in the harness's time.
#[derive(Clone, Copy)]
pub enum Mark {
    Clock(Duration),
    Real(Instant),
}

impl Harness {
    pub fn memory() -> Self {
        let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
        Self::Memory {
            store: MemoryStore::with_clock(clock.clone()),
            clock,
        }
    }

    pub async fn redis(execution: Execution) -> Self {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url())
            .await
            .expect("connecting to the test redis-server");
        Self::Redis {
            store,
            execution,
            _server: server,
        }
    }

    pub fn policy(&self, text: &str) -> Policy {
        let policy: Policy = text.parse().unwrap();
        match self {
            Self::Memory { .. } => policy,
            Self::Redis { execution, .. } => policy.with_execution(*execution),
        }
    }

    pub async fn check(&self, key: &str, policy: &Policy) -> Decision {
        match self {
            Self::Memory { store, .. } => store.check(key, policy).await.unwrap(),
            Self::Redis { store, .. } => store.check(key, policy).await.unwrap(),
        }
    }

    /// Give back a concurrency lease.
    pub async fn release(&self, key: &str, policy: &Policy, lease: tower_redis_ratelimit::Lease) {
        match self {
            Self::Memory { store, .. } => store.release(key, policy, lease).await.unwrap(),
            Self::Redis { store, .. } => store.release(key, policy, lease).await.unwrap(),
        }
    }

    /// Let `d` pass.
    pub async fn advance(&self, d: Duration) {
        match self {
            Self::Memory { clock, .. } => clock.advance(d),
            Self::Redis { .. } => tokio::time::sleep(d).await,
        }
    }

    /// Let `d` pass, plus a margin on real time so the edge is behind us.
    pub async fn advance_past(&self, d: Duration) {
        match self {
            Self::Memory { .. } => self.advance(d).await,
            Self::Redis { .. } => self.advance(d + 30 * MS).await,
        }
    }

    pub fn mark(&self) -> Mark {
        match self {
            Self::Memory { clock, .. } => Mark::Clock(tower_redis_ratelimit::Clock::now(clock)),
            Self::Redis { .. } => Mark::Real(Instant::now()),
        }
    }

    pub fn since(&self, mark: Mark) -> Duration {
        match (self, mark) {
            (Self::Memory { clock, .. }, Mark::Clock(then)) => {
                tower_redis_ratelimit::Clock::now(clock) - then
            }
            (_, Mark::Real(then)) => then.elapsed(),
            _ => unreachable!(),
        }
    }

    /// How far a measured duration may be from the expected one: nothing on
    /// the manual clock; round trips and scheduling on real time.
    pub fn tolerance(&self) -> Duration {
        match self {
            Self::Memory { .. } => Duration::ZERO,
            Self::Redis { .. } => 100 * MS,
        }
    }

    #[track_caller]
    pub fn assert_near(&self, actual: Duration, expected: Duration, what: &str) {
        let diff = actual.abs_diff(expected);
        assert!(
            diff <= self.tolerance(),
            "{what}: got {actual:?}, expected {expected:?} ± {:?}",
            self.tolerance()
        );
    }
}
