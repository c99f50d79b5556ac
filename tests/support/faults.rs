//! Pieces shared by the fault tests (tests/network_faults.rs,
//! tests/store_adversarial.rs, tests/redis_store.rs): how a store gets its
//! connections, how a check's outcome reads, a clock a test can step, a
//! seeded random fault on a [`FaultProxy`], and a task's panic message.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tower_redis_ratelimit::clock::{Clock, SystemClock};
use tower_redis_ratelimit::{Decision, Policy, RedisStore, Store, StoreError};

use super::proxy::{AfterDrop, Direction, FaultProxy, Match};
use super::rng::Rng;

/// Where a RedisStore gets its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `RedisStore::connect(url)`: the tracked bb8 pool.
    Pool,
    /// `RedisStore::from_pool`: a bb8-redis pool with bb8's defaults.
    Bb8,
    /// `RedisStore::from_connection_manager`: one multiplexed connection,
    /// redis-rs's default `ConnectionManagerConfig`.
    Manager,
    /// `RedisStore::from_connection_manager` with the configuration its
    /// rustdoc recommends: no retries, no response timeout of its own.
    ManagerNoRetries,
    /// `RedisStore::connect_cluster`: three masters, each behind a proxy.
    Cluster,
    /// `RedisStore::from_cluster_connection` of a client built with
    /// `.retries(0)`, as `connect_cluster`'s rustdoc suggests when a lost
    /// reply must not count twice.
    ClusterNoRetries,
}

impl Source {
    pub fn is_cluster(self) -> bool {
        matches!(self, Self::Cluster | Self::ClusterNoRetries)
    }
}

/// A store of `source` on the Redis at `url`, with the store timeout
/// `timeout` (a cluster source: `url` is its only seed node).
pub async fn open(source: Source, url: &str, timeout: Duration) -> RedisStore {
    let store = match source {
        Source::Pool => RedisStore::connect(url).await.unwrap(),
        Source::Bb8 => {
            let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
            let pool = bb8_redis::bb8::Pool::builder()
                .build(manager)
                .await
                .unwrap();
            RedisStore::from_pool(pool)
        }
        Source::Manager => {
            let manager = redis::Client::open(url)
                .unwrap()
                .get_connection_manager()
                .await
                .unwrap();
            RedisStore::from_connection_manager(manager)
        }
        Source::ManagerNoRetries => {
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_number_of_retries(0)
                .set_response_timeout(None);
            let manager = redis::Client::open(url)
                .unwrap()
                .get_connection_manager_with_config(config)
                .await
                .unwrap();
            RedisStore::from_connection_manager(manager)
        }
        Source::Cluster | Source::ClusterNoRetries => {
            return open_cluster(source, &[url.to_owned()], timeout).await;
        }
    };
    store.with_timeout(timeout)
}

/// A cluster store of `source` through the seed nodes `urls`, with the
/// store timeout `timeout`.
#[cfg(feature = "cluster")]
pub async fn open_cluster(source: Source, urls: &[String], timeout: Duration) -> RedisStore {
    let store = if source == Source::ClusterNoRetries {
        let conn = redis::cluster::ClusterClient::builder(urls.to_vec())
            .retries(0)
            .overall_response_timeout(None)
            .build()
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        RedisStore::from_cluster_connection(conn)
    } else {
        RedisStore::connect_cluster(urls).await.unwrap()
    };
    store.with_timeout(timeout)
}

#[cfg(not(feature = "cluster"))]
pub async fn open_cluster(_: Source, _: &[String], _: Duration) -> RedisStore {
    unreachable!("the cluster tests need the `cluster` feature")
}

/// One check of each policy on the key `warm-up` (its lease, if any,
/// released): scripts loaded, clock offset measured, connections open.
pub async fn warm(store: &RedisStore, policies: impl IntoIterator<Item = Policy>) {
    for policy in policies {
        let decision = store.check("warm-up", &policy).await.unwrap();
        if let Some(lease) = decision.lease() {
            store.release("warm-up", &policy, lease).await.unwrap();
        }
    }
}

/// A check's outcome, for messages.
pub fn show(outcome: &Result<Decision, StoreError>) -> String {
    match outcome {
        Ok(d) if d.allowed() => "admitted".to_owned(),
        Ok(d) => format!("denied (retry after {:?})", d.retry_after()),
        Err(e) => format!("error ({e})"),
    }
}

pub fn admitted(outcome: &Result<Decision, StoreError>) -> bool {
    matches!(outcome, Ok(d) if d.allowed())
}

pub fn denied(outcome: &Result<Decision, StoreError>) -> bool {
    matches!(outcome, Ok(d) if !d.allowed())
}

/// The system clock shifted by a step the test sets (µs, either sign): a
/// wall clock that NTP stepped, or an offset to Redis that went stale.
#[derive(Debug, Clone)]
pub struct SteppingClock {
    inner: SystemClock,
    step: Arc<AtomicI64>,
}

impl SteppingClock {
    pub fn new() -> Self {
        Self {
            inner: SystemClock::new(),
            step: Arc::default(),
        }
    }

    /// From now on, read `by` ahead of the system clock (`ahead`) or behind
    /// it; `Duration::ZERO`: the system clock again.
    pub fn step(&self, by: Duration, ahead: bool) {
        let micros = i64::try_from(by.as_micros()).unwrap();
        self.step
            .store(if ahead { micros } else { -micros }, Ordering::SeqCst);
    }
}

impl Clock for SteppingClock {
    fn now(&self) -> Duration {
        let now = self.inner.now();
        let step = self.step.load(Ordering::SeqCst);
        if step >= 0 {
            now + Duration::from_micros(step.unsigned_abs())
        } else {
            now - Duration::from_micros(step.unsigned_abs())
        }
    }
}

/// The seed of a randomised fault test: `FAULT_SEED` if set (and a
/// number), else `default`.
pub fn fault_seed(default: u64) -> u64 {
    std::env::var("FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A random duration of `from` ms up to (not including) `to` ms.
pub fn millis(rng: &mut Rng, from: u64, to: u64) -> Duration {
    Duration::from_millis(from + rng.below(to - from))
}

/// The ranges, in ms (`from`, `to`, as [`millis`] takes them), of the
/// durations a [`random_fault`] picks.
#[derive(Debug, Clone, Copy)]
pub struct FaultSpans {
    /// How long a connection whose reply was dropped hangs before it closes.
    pub hang: (u64, u64),
    /// How long a targeted request or reply is held.
    pub held: (u64, u64),
    /// How long a whole direction of the link stalls.
    pub stall: (u64, u64),
    /// How long connections are refused.
    pub refused: (u64, u64),
}

/// One of nine faults, picked by `rng`, on `proxy` (`target`: the frame a
/// one-shot fault fires on): a reply dropped and the connection closed, or
/// hung a while; a reply cut mid-way; a request or a reply held; either
/// direction of the link stalled; connections refused a while (awaited
/// here); every connection cut. Returns which (0 to 8, in that order).
pub async fn random_fault(
    proxy: &FaultProxy,
    target: Match,
    rng: &mut Rng,
    spans: &FaultSpans,
) -> u64 {
    let span = |rng: &mut Rng, (from, to): (u64, u64)| millis(rng, from, to);
    let fault = rng.below(9);
    match fault {
        0 => proxy.drop_next_reply(target, AfterDrop::Close),
        1 => proxy.drop_next_reply(target, AfterDrop::HangFor(span(rng, spans.hang))),
        2 => proxy.cut_next_reply(target),
        3 => proxy.stall_next_request(target, span(rng, spans.held)),
        4 => proxy.stall_next_reply(target, span(rng, spans.held)),
        5 => proxy.stall(Direction::ToRedis, span(rng, spans.stall)),
        6 => proxy.stall(Direction::ToClient, span(rng, spans.stall)),
        7 => {
            proxy.refuse();
            tokio::time::sleep(span(rng, spans.refused)).await;
            proxy.accept();
        }
        _ => proxy.cut_all(),
    }
    fault
}

/// The message of a panic caught from a task (`JoinError::into_panic`):
/// its `String` or `&str` payload, else empty.
pub fn panic_message(panic: Box<dyn Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}
