//! Pieces shared by the fault tests (tests/network_faults.rs,
//! tests/command_faults.rs, tests/store_adversarial.rs, tests/redis_store.rs):
//! how a store gets its connections, the matrix of algorithms and the rig of
//! proxied Redis a scenario runs on, how a check's outcome reads, a clock a
//! test can step, a seeded random fault on a [`FaultProxy`], and a task's
//! panic message.

use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tower_redis_ratelimit::clock::{Clock, SystemClock};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Algorithm, Decision, Policy, Rate, RedisStore, Store, StoreError};

use super::RedisServer;
use super::proxy::{AfterDrop, Direction, FaultProxy, Match, ProxiedCluster};
use super::rng::Rng;

/// Where a RedisStore gets its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connections {
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

impl Connections {
    pub fn is_cluster(self) -> bool {
        matches!(self, Self::Cluster | Self::ClusterNoRetries)
    }
}

/// A store of `source` on the Redis at `url`, with the store timeout
/// `timeout` (a cluster source: `url` is its only seed node).
pub async fn open(source: Connections, url: &str, timeout: Duration) -> RedisStore {
    let store = match source {
        Connections::Pool => RedisStore::connect(url).await.unwrap(),
        Connections::Bb8 => {
            let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
            // As `RedisStore::from_pool` advises: a refused connection
            // fails the check at once instead of being retried until the
            // store's timeout.
            let pool = bb8_redis::bb8::Pool::builder()
                .retry_connection(false)
                .build(manager)
                .await
                .unwrap();
            RedisStore::from_pool(pool)
        }
        Connections::Manager => {
            let manager = redis::Client::open(url)
                .unwrap()
                .get_connection_manager()
                .await
                .unwrap();
            RedisStore::from_connection_manager(manager)
        }
        Connections::ManagerNoRetries => {
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
        Connections::Cluster | Connections::ClusterNoRetries => {
            return open_cluster(source, &[url.to_owned()], timeout).await;
        }
    };
    store.with_timeout(timeout)
}

/// A cluster store of `source` through the seed nodes `urls`, with the
/// store timeout `timeout`.
#[cfg(feature = "cluster")]
pub async fn open_cluster(source: Connections, urls: &[String], timeout: Duration) -> RedisStore {
    let store = if source == Connections::ClusterNoRetries {
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
pub async fn open_cluster(_: Connections, _: &[String], _: Duration) -> RedisStore {
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

// ---------------------------------------------------------------------------
// The matrix: algorithms, and the rig a scenario runs on.

/// An algorithm, and for the sliding log its execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    LogTransaction,
    LogScript,
    FixedWindow,
    SlidingWindow,
    Gcra,
    Concurrency,
}

impl Algo {
    pub const ALL: [Self; 6] = [
        Self::LogTransaction,
        Self::LogScript,
        Self::FixedWindow,
        Self::SlidingWindow,
        Self::Gcra,
        Self::Concurrency,
    ];

    /// `max` per `window` (concurrency: `max` in flight, leases of `window`).
    pub fn policy(self, max: u64, window: Duration) -> Policy {
        let rate = Policy::new([Rate::new(max, window).unwrap()]).unwrap();
        match self {
            Self::LogTransaction => rate.with_execution(Execution::Transaction).unwrap(),
            Self::LogScript => rate.with_execution(Execution::Script).unwrap(),
            Self::FixedWindow => rate.with_algorithm(Algorithm::FixedWindow).unwrap(),
            Self::SlidingWindow => rate.with_algorithm(Algorithm::SlidingWindow).unwrap(),
            Self::Gcra => rate.with_algorithm(Algorithm::Gcra).unwrap(),
            Self::Concurrency => Policy::concurrency(max)
                .unwrap()
                .with_lease(window)
                .unwrap(),
        }
    }

    /// The algorithm's part of its Redis keys.
    pub fn tag(self) -> &'static str {
        match self {
            Self::LogTransaction | Self::LogScript => "log",
            Self::FixedWindow => "fixed",
            Self::SlidingWindow => "swc",
            Self::Gcra => "gcra",
            Self::Concurrency => "conc",
        }
    }

    /// The request whose reply carries the decision for `redis_key`: the
    /// `EXEC` of the transaction, the script's `EVALSHA`, or the first
    /// command naming a window counter's count (in a batch of plain
    /// commands, the fixed window's `INCRBY` or the sliding window's `MGET`
    /// of the previous counts, sent together; alone, the script's
    /// `EVALSHA`).
    pub fn decisive(self, redis_key: &str) -> Match {
        match self {
            Self::LogTransaction => Match::command("EXEC").arg(redis_key),
            Self::FixedWindow | Self::SlidingWindow => Match::any().arg(redis_key),
            _ => Match::command("EVALSHA").arg(redis_key),
        }
    }
}

/// One test's Redis (a server, or a proxied cluster), the proxies in front
/// of it and the stores that use them. Dropped in that order: stores, then
/// proxies, then servers.
pub struct Rig {
    pub source: Connections,
    /// The store timeout of every store.
    pub timeout: Duration,
    pub stores: Vec<RedisStore>,
    /// Single server: one proxy per store.
    proxies: Vec<FaultProxy>,
    server: Option<RedisServer>,
    cluster: Option<ProxiedCluster>,
    /// Keys whose checks reach every node (one per node on a cluster).
    reset_keys: Vec<String>,
}

impl Rig {
    /// A Redis of `source`'s kind and `stores` stores on it, each through a
    /// proxy of its own (on a cluster, all through the nodes' proxies), with
    /// the store timeout `timeout`; every script loaded and the clock
    /// offset measured.
    pub async fn start(source: Connections, stores: usize, timeout: Duration) -> Self {
        let mut rig = Self {
            source,
            timeout,
            stores: Vec::new(),
            proxies: Vec::new(),
            server: None,
            cluster: None,
            reset_keys: vec!["reset".to_owned()],
        };
        if source.is_cluster() {
            let cluster = tokio::task::spawn_blocking(ProxiedCluster::start)
                .await
                .unwrap();
            for _ in 0..stores {
                let store = open_cluster(source, &cluster.urls(), timeout).await;
                rig.stores.push(store);
            }
            // A key on each node.
            rig.reset_keys.clear();
            for proxy in cluster.proxies() {
                let key = (0..)
                    .map(|i| format!("reset-{i}"))
                    .find(|key| {
                        let redis_key = rig.stores[0].redis_key("log", key);
                        cluster.proxy_of(&redis_key).port() == proxy.port()
                    })
                    .unwrap();
                rig.reset_keys.push(key);
            }
            rig.cluster = Some(cluster);
        } else {
            let server = tokio::task::spawn_blocking(RedisServer::start)
                .await
                .unwrap();
            for _ in 0..stores {
                let proxy = FaultProxy::start(server.port());
                rig.stores.push(open(source, &proxy.url(), timeout).await);
                rig.proxies.push(proxy);
            }
            rig.server = Some(server);
        }
        for store in &rig.stores {
            warm_every_algorithm(store).await;
        }
        rig
    }

    pub fn store(&self, i: usize) -> &RedisStore {
        &self.stores[i]
    }

    /// The proxy store `i`'s requests of `redis_key` go through.
    pub fn proxy(&self, i: usize, redis_key: &str) -> &FaultProxy {
        match &self.cluster {
            Some(cluster) => cluster.proxy_of(redis_key),
            None => &self.proxies[i],
        }
    }

    pub fn all_proxies(&self) -> Vec<&FaultProxy> {
        match &self.cluster {
            Some(cluster) => cluster.proxies().iter().collect(),
            None => self.proxies.iter().collect(),
        }
    }

    /// Faults over: every proxy healed and accepting, every connection cut,
    /// and every store answering again on every node (a check after a cut
    /// may fail once or twice: on a cluster, redis-rs sends the next command
    /// to a random node and a transaction does not follow the `MOVED`).
    pub async fn reset(&self) {
        for proxy in self.all_proxies() {
            proxy.heal();
            proxy.accept();
            proxy.cut_all();
        }
        let policy = Algo::LogTransaction.policy(1_000_000, Duration::from_secs(1));
        // Twice, 50 ms apart: a ConnectionManager that reconnected after the
        // cut may replace its new connection once more when the old one's
        // disconnection notice comes in late.
        for _ in 0..2 {
            for (i, store) in self.stores.iter().enumerate() {
                for key in &self.reset_keys {
                    let mut tries = 0;
                    while store.check(key, &policy).await.is_err() {
                        tries += 1;
                        assert!(
                            tries < 100,
                            "{:?}: store {i} does not answer after its connections were cut",
                            self.source
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Faults seen by every proxy.
    pub fn faults(&self) -> u64 {
        self.all_proxies().iter().map(|p| p.stats().faults()).sum()
    }
}

/// One check of every algorithm: scripts loaded, clock offset measured,
/// connections open.
pub async fn warm_every_algorithm(store: &RedisStore) {
    let policies = Algo::ALL.map(|algo| algo.policy(1_000_000, Duration::from_secs(60)));
    warm(store, policies).await;
}

/// Run `scenario` for every algorithm, each on a rig of its own (stores
/// of timeout `timeout`), all at
/// once; then fail with every algorithm's failure, if any.
pub async fn each_algorithm<F, Fut>(
    source: Connections,
    stores: usize,
    timeout: Duration,
    scenario: F,
) where
    F: Fn(Rig, Algo) -> Fut + Copy + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut jobs = JoinSet::new();
    let mut names = std::collections::HashMap::new();
    for algo in Algo::ALL {
        let handle = jobs.spawn(async move {
            let rig = Rig::start(source, stores, timeout).await;
            scenario(rig, algo).await;
        });
        names.insert(handle.id(), algo);
    }
    let mut failures = Vec::new();
    while let Some(done) = jobs.join_next_with_id().await {
        if let Err(error) = done {
            let algo = names[&error.id()];
            let message = match error.try_into_panic() {
                Ok(panic) => panic_message(panic),
                Err(error) => error.to_string(),
            };
            failures.push(format!("{algo:?}: {message}"));
        }
    }
    failures.sort();
    assert!(
        failures.is_empty(),
        "{source:?}: {} of {} algorithms failed:\n{}",
        failures.len(),
        Algo::ALL.len(),
        failures.join("\n")
    );
}

/// How a request's reply is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Redis runs it; the reply is dropped and the connection closed.
    DropClose,
    /// Redis runs it; the reply is dropped and the connection hangs (the
    /// client times out).
    DropHang,
    /// Redis runs it; half the reply arrives, then the connection closes.
    Cut,
    /// The request reaches Redis only after the client timed out.
    Late,
    /// Redis runs it on time; the reply reaches the client only after it
    /// timed out.
    Stalled,
}

impl Loss {
    /// Lose the reply of the next request `target` matches on `proxy`;
    /// `timeout`: the store timeout, which a late request or a stalled
    /// reply misses by 200 ms.
    pub fn arm(self, proxy: &FaultProxy, target: Match, timeout: Duration) {
        let late = timeout + Duration::from_millis(200);
        match self {
            Self::DropClose => proxy.drop_next_reply(target, AfterDrop::Close),
            Self::DropHang => proxy.drop_next_reply(target, AfterDrop::Hang),
            Self::Cut => proxy.cut_next_reply(target),
            Self::Late => proxy.stall_next_request(target, late),
            Self::Stalled => proxy.stall_next_reply(target, late),
        }
    }

    /// Wait until the lost request has surely reached Redis.
    pub async fn settle(self) {
        if self == Self::Late {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Whether the client sees its connection fail (not only a timeout), so
    /// a store can send the request again within its timeout.
    pub fn fails_the_connection(self) -> bool {
        matches!(self, Self::DropClose | Self::Cut)
    }
}

/// A decision whole (what it allows, its block, remaining, waits), for
/// messages.
pub fn show_decision(d: &Decision) -> String {
    format!(
        "allowed {} blocked {} remaining {} retry_after {:?} reset {:?}",
        d.allowed(),
        d.blocked(),
        d.remaining(),
        d.retry_after(),
        d.reset()
    )
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
