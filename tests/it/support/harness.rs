//! One store under test and how time moves for it, for conformance suites
//! that run the same cases on MemoryStore (manual clock, exact values) and
//! RedisStore (real redis-server, real time, margins); and moving to and
//! through wall-clock windows (multiples of the window since the epoch) on
//! either.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tower_redis_ratelimit::clock::{Clock, ManualClock};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Algorithm, Decision, MemoryStore, Policy, RedisStore, Store};

use super::RedisServer;

pub const MS: Duration = Duration::from_millis(1);

pub const US: Duration = Duration::from_micros(1);

/// How far past a window boundary the Redis harness lands, so the boundary
/// is behind us on Redis's clock too.
pub const MARGIN: Duration = Duration::from_millis(20);

/// One store under test, and how time moves for it.
pub enum Harness {
    Memory {
        store: MemoryStore,
        clock: ManualClock,
    },
    Redis {
        store: RedisStore,
        execution: Execution,
        /// The server (or cluster) the store uses, stopped on drop.
        _server: Box<dyn std::any::Any + Send + Sync>,
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

    /// RedisStore (`connect`'s pool) on a fresh server, connected as a user
    /// with the least privilege the store documents
    /// ([`RedisStore::acl_rules`]): every suite on this harness shows that
    /// those rules are enough.
    pub async fn redis(execution: Execution) -> Self {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.least_privileged_url("rl"))
            .await
            .expect("connecting to the test redis-server");
        Self::Redis {
            store,
            execution,
            _server: Box::new(server),
        }
    }

    /// RedisStore (`connect`'s pool) on a fresh server through a
    /// [`FaultProxy`](super::proxy::FaultProxy): the returned handle drops,
    /// cuts and stalls the store's traffic or refuses its connections.
    pub async fn redis_proxied(
        execution: Execution,
    ) -> (Self, std::sync::Arc<super::proxy::FaultProxy>) {
        let server = RedisServer::start();
        let proxy = std::sync::Arc::new(super::proxy::FaultProxy::start(server.port()));
        let store = RedisStore::connect(&proxy.url())
            .await
            .expect("connecting to the test redis-server through the fault proxy");
        let harness = Self::Redis {
            store,
            execution,
            // The proxy goes first, then the server.
            _server: Box::new((std::sync::Arc::clone(&proxy), server)),
        };
        (harness, proxy)
    }

    /// RedisStore over one multiplexed ConnectionManager instead of a pool.
    pub async fn redis_manager(execution: Execution) -> Self {
        let server = RedisServer::start();
        let manager = redis::Client::open(server.url())
            .unwrap()
            .get_connection_manager()
            .await
            .expect("connecting to the test redis-server");
        Self::Redis {
            store: RedisStore::from_connection_manager(manager),
            execution,
            _server: Box::new(server),
        }
    }

    /// RedisStore on a fresh three-master Redis Cluster.
    #[cfg(feature = "cluster")]
    pub async fn redis_cluster(execution: Execution) -> Self {
        let cluster = super::RedisCluster::start();
        let store = RedisStore::connect_cluster(&cluster.urls())
            .await
            .expect("connecting to the test Redis Cluster");
        Self::Redis {
            store,
            execution,
            _server: Box::new(cluster),
        }
    }

    /// A sliding-log policy of `text`, run with this harness's execution.
    pub fn policy(&self, text: &str) -> Policy {
        self.policy_of(text, Algorithm::SlidingLog)
    }

    /// A policy of `text` under `algorithm` (with this harness's execution
    /// when it is the sliding log: only it takes one).
    pub fn policy_of(&self, text: &str, algorithm: Algorithm) -> Policy {
        let policy = text
            .parse::<Policy>()
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap();
        match self {
            Self::Redis { execution, .. } if algorithm == Algorithm::SlidingLog => {
                policy.with_execution(*execution).unwrap()
            }
            _ => policy,
        }
    }

    pub async fn check(&self, key: &str, policy: &Policy) -> Decision {
        match self {
            Self::Memory { store, .. } => store.check(key, policy).await.unwrap(),
            Self::Redis { store, .. } => store.check(key, policy).await.unwrap(),
        }
    }

    /// Run an operator's command.
    pub async fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: tower_redis_ratelimit::store::Command,
    ) -> Decision {
        match self {
            Self::Memory { store, .. } => store.command(key, policy, command).await.unwrap(),
            Self::Redis { store, .. } => store.command(key, policy, command).await.unwrap(),
        }
    }

    /// Give back a concurrency lease.
    pub async fn release(
        &self,
        key: &str,
        policy: &Policy,
        lease: tower_redis_ratelimit::decision::Lease,
    ) {
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
            Self::Memory { clock, .. } => {
                Mark::Clock(tower_redis_ratelimit::clock::Clock::now(clock))
            }
            Self::Redis { .. } => Mark::Real(Instant::now()),
        }
    }

    pub fn since(&self, mark: Mark) -> Duration {
        match (self, mark) {
            (Self::Memory { clock, .. }, Mark::Clock(then)) => {
                tower_redis_ratelimit::clock::Clock::now(clock) - then
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

/// Move to the start of the next window of `window` (wall-clock windows:
/// multiples of `window` since the epoch) and return a mark at that start.
/// Exact on the manual clock; on real time, a little past it.
pub async fn align(h: &Harness, window: Duration) -> Mark {
    match h {
        Harness::Memory { clock, .. } => {
            let rem = micros(clock.now()) % micros(window);
            if rem != 0 {
                clock.advance(Duration::from_micros(micros(window) - rem));
            }
            Mark::Clock(clock.now())
        }
        Harness::Redis { .. } => {
            let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
            let w = micros(window);
            let boundary = (now / w + 1) * w;
            tokio::time::sleep(Duration::from_micros(boundary - now) + MARGIN).await;
            let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
            Mark::Real(Instant::now() - Duration::from_micros(now - boundary))
        }
    }
}

/// Let time pass until `offset` after `mark` (on real time, plus a margin
/// when `past` is set, so that instant is behind us on Redis's clock too).
pub async fn advance_to(h: &Harness, mark: Mark, offset: Duration, past: bool) {
    let target = match h {
        Harness::Redis { .. } if past => offset + MARGIN,
        _ => offset,
    };
    let elapsed = h.since(mark);
    assert!(
        elapsed <= target,
        "already {elapsed:?} past the mark, wanted {target:?}: the machine is too slow"
    );
    h.advance(target - elapsed).await;
}

/// Wait (on real time) until at least `room` is left before the next
/// boundary of `window`.
pub async fn away_from_a_boundary(window: Duration, room: Duration) {
    let now = micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
    let w = micros(window);
    let left = w - now % w;
    if left < micros(room) {
        tokio::time::sleep(Duration::from_micros(left) + MARGIN).await;
    }
}

pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap()
}

/// The system clock's time, µs since the epoch.
pub fn now_us() -> u64 {
    micros(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap(),
    )
}

/// Sleep until `margin` past the next multiple of `window` on this
/// machine's clock (Redis's, on the same machine).
pub async fn just_into_a_window(window: Duration, margin: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let w = window.as_micros();
    let boundary = (now.as_micros() / w + 1) * w;
    let until = Duration::from_micros(u64::try_from(boundary - now.as_micros()).unwrap());
    tokio::time::sleep(until + margin).await;
}
