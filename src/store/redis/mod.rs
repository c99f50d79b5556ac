//! [`RedisStore`]: limits shared by every process through Redis.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bb8_redis::RedisConnectionManager;
use bb8_redis::bb8::Pool;

use crate::clock::{Clock, SystemClock};
use crate::decision::Decision;
use crate::decision::Lease;
use crate::policy::{Algorithm, Execution, Policy};
use crate::store::{Command, Store, StoreError, bounded_key};

mod acl;
mod batch;
mod builder;
mod call;
mod check;
mod cleanup;
mod clock_sync;
mod command;
mod connection;
mod denials;
mod errors;
mod eviction;
mod full_keys;
mod plain;
mod previous_counts;
mod reply;
// Its scripts are public only through `store::scripts` (`test-util`).
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
mod script;
#[cfg(feature = "sentinel")]
mod sentinel;
mod sliding_log;
mod window_counts;

pub use builder::RedisStoreBuilder;
pub use connection::{TrackedConnection, TrackedManager};
// The scripts as sent, for `store::scripts` (feature `test-util`).
#[cfg(feature = "test-util")]
pub use script::{
    CONCURRENCY_COMMAND_SCRIPT, CONCURRENCY_SCRIPT, FIXED_WINDOW_BATCH_SCRIPT,
    FIXED_WINDOW_COMMAND_SCRIPT, FIXED_WINDOW_SCRIPT, GCRA_BATCH_SCRIPT, GCRA_COMMAND_SCRIPT,
    GCRA_SCRIPT, SLIDING_LOG_BATCH_SCRIPT, SLIDING_LOG_COMMAND_SCRIPT, SLIDING_LOG_SCRIPT,
    SLIDING_WINDOW_BATCH_SCRIPT, SLIDING_WINDOW_COMMAND_SCRIPT, SLIDING_WINDOW_SCRIPT,
    decode_batched_reply,
};

use batch::Batchers;
use call::Call;
use clock_sync::ClockSync;
use connection::Connections;
use full_keys::FullKeys;

/// Rate limits kept in Redis, shared by every process that uses the same
/// Redis and key prefix.
///
/// Keys are laid out as `{prefix}:{algorithm}:{{key}}`, e.g.
/// `rl:log:{5/10s:203.0.113.9}` (through a [`Limiter`](crate::Limiter),
/// `{key}` is `<name>:<key>`): the braces are a cluster hash tag, so every Redis
/// key of one limited key lands in one slot. A key longer than
/// [`MAX_RAW_KEY_LEN`](crate::store::MAX_RAW_KEY_LEN) bytes, or holding `{`, `}` or a leading `#`, is stored
/// as `#` and its SHA-1 instead, so a client-chosen key cannot break the
/// layout. Every Redis key expires on its own once its state no longer
/// matters (a GCRA key up to one longest window after its last TAT, so that
/// most checks need not set its expiry). A key an operator blocked ([`Command::Block`]) also has
/// `{prefix}:block:{{key}}` (the same hash tag) until the block ends; every
/// check reads it in the same script or transaction that decides.
///
/// Every call (pool checkout and commands together) is bounded by a timeout
/// ([`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)); on expiry the check fails with
/// [`StoreError::Timeout`] and the limiter applies its
/// [`FailMode`](crate::FailMode).
///
/// ```no_run
/// use tower_redis_ratelimit::RedisStore;
///
/// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?
///     .with_prefix("myapp:rl")
///     .with_timeout(std::time::Duration::from_millis(100));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connections: Connections,
    prefix: Arc<str>,
    timeout: Duration,
    clock: Arc<ClockSync>,
    ids: Arc<RequestIds>,
    /// Checks decided in batches (none for a cluster, or when turned off).
    batchers: Option<Arc<Batchers>>,
    /// The sliding log's keys its transaction found full: a check of one
    /// reads the log before it writes.
    full_logs: Arc<FullKeys>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("pool", &self.connections.state())
            .field("batched", &self.batchers.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// How long a check waits for Redis unless
    /// [`with_timeout`](Self::with_timeout) says otherwise (250 ms).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);
    /// How long [`connect`](Self::connect) waits for Redis (5 s).
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    /// The prefix of every Redis key unless
    /// [`with_prefix`](Self::with_prefix) says otherwise (`rl`).
    pub const DEFAULT_PREFIX: &'static str = "rl";
    /// The connections of the pool [`connect`](Self::connect) opens (16).
    pub const DEFAULT_POOL_SIZE: u32 = 16;
    /// How often the offset to Redis's clock is measured again unless
    /// [`with_clock_refresh`](Self::with_clock_refresh) says otherwise (30 s).
    pub const DEFAULT_CLOCK_REFRESH: Duration = Duration::from_secs(30);
    /// How many batches of checks of one algorithm are in flight at once
    /// unless [`with_batches`](Self::with_batches) says otherwise (2).
    pub const DEFAULT_BATCHES_IN_FLIGHT: usize = 2;

    /// Settings to connect with: pool size, TLS certificates, Sentinel
    /// credentials. [`connect`](Self::connect) is `builder().connect(url)`.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// Connect to the Redis at `url` (`redis://[user:password@]host:port[/db]`;
    /// `rediss://` with the `tls` feature; `redis+sentinel://` with the
    /// `sentinel` feature, see [`RedisStoreBuilder::connect`]) through a
    /// bb8 pool of at most [`DEFAULT_POOL_SIZE`](Self::DEFAULT_POOL_SIZE)
    /// connections, check that it answers, and measure the offset to its
    /// clock. [`builder`](Self::builder) sets the pool size and TLS
    /// certificates.
    ///
    /// # Errors
    /// A malformed URL, a refused connection, a failed TLS handshake or
    /// authentication, or a Redis that does not answer within
    /// [`CONNECT_TIMEOUT`](Self::CONNECT_TIMEOUT).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::builder().connect(url).await
    }

    /// Connect to the primary of `service` that the Redis Sentinels at
    /// `sentinels` (`host:port` each, the port defaulting to 26379) name,
    /// and follow it across failovers (`sentinel` feature): the first
    /// connection after a start or a failure asks the Sentinels for the
    /// current primary (in the order given, the first that `ROLE`
    /// confirms), and a connection that fails, or that a demoted primary
    /// answers with `READONLY`, is retired, so after Sentinel promotes a
    /// replica the next checks go to it, without a restart. A watch task
    /// retires the connections to a cut-off primary that comes back before
    /// the Sentinels demote it (see [`TrackedManager::from_sentinel`]).
    ///
    /// During a failover checks fail (until Sentinel has promoted a
    /// replica, a few seconds past its `down-after-milliseconds`), and each
    /// limiter applies its [`FailMode`](crate::FailMode). Counts written to
    /// the old primary after its last replication are lost with it: for at
    /// most one window, a key may admit up to that many more requests than
    /// its limit. The [deployments guide](crate::guide::deployments) says what
    /// is lost; BENCHMARKS.md has the measured figures.
    ///
    /// For credentials, a database or TLS on the Redis side, pass a
    /// `redis+sentinel://[user:password@]host[:port][,host[:port]…]/service[/db]`
    /// URL to [`connect`](Self::connect) (`rediss+sentinel://` for TLS).
    ///
    /// ```no_run
    /// use tower_redis_ratelimit::RedisStore;
    ///
    /// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
    /// let store = RedisStore::connect_sentinel(
    ///     &["10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"],
    ///     "mymaster",
    /// )
    /// .await?;
    /// // The same, as one URL:
    /// let store = RedisStore::connect(
    ///     "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/mymaster",
    /// )
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// No Sentinel given, a malformed address, no Sentinel that knows a
    /// healthy primary for `service`, or the errors of
    /// [`connect`](Self::connect).
    #[cfg(feature = "sentinel")]
    pub async fn connect_sentinel<T: AsRef<str>>(
        sentinels: &[T],
        service: &str,
    ) -> Result<Self, StoreError> {
        Self::builder().connect_sentinel(sentinels, service).await
    }

    /// Use a bb8-redis pool you already have; its settings apply. Keep bb8's
    /// default `test_on_check_out(true)`: it is what replaces a connection
    /// broken by a Redis restart in such a pool (at the cost of a `PING` per
    /// checkout; [`from_tracked_pool`](Self::from_tracked_pool) avoids it).
    /// Build it with `retry_connection(false)` for a check to fail at once
    /// (to the fail mode) while Redis refuses connections: by default bb8
    /// keeps retrying a refused connection, and the check then waits out
    /// the store's timeout.
    /// Nothing is sent until the first check, which also measures the offset
    /// to Redis's clock.
    pub fn from_pool(pool: Pool<RedisConnectionManager>) -> Self {
        Self::from_connections(Connections::Bb8Redis(pool, Arc::default()))
    }

    /// Use a bb8 pool of [`TrackedManager`] built with your own settings
    /// (size, timeouts). Such a pool needs no `PING` on checkout: a
    /// connection that fails is dropped and replaced.
    ///
    /// ```no_run
    /// use bb8_redis::bb8::Pool;
    /// use tower_redis_ratelimit::RedisStore;
    /// use tower_redis_ratelimit::store::TrackedManager;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let manager = TrackedManager::new("redis://127.0.0.1:6379")?;
    /// let pool = Pool::builder().max_size(32).test_on_check_out(false).build(manager).await?;
    /// let store = RedisStore::from_tracked_pool(pool);
    /// # Ok(()) }
    /// ```
    pub fn from_tracked_pool(pool: Pool<TrackedManager>) -> Self {
        Self::from_connections(Connections::Tracked(pool, Arc::default()))
    }

    /// Use one multiplexed [`redis::aio::ConnectionManager`]: every check is
    /// pipelined on a single connection, which reconnects by itself after a
    /// Redis restart. It fits a service that wants no pool (one connection
    /// carries thousands of requests in flight); a pool spreads load over
    /// several sockets and keeps a slow reply on one from delaying the rest.
    ///
    /// For a check to fail at once while Redis refuses connections, build
    /// the manager with
    /// [`ConnectionManagerConfig::set_number_of_retries(0)`](redis::aio::ConnectionManagerConfig::set_number_of_retries)
    /// and no response timeout of its own (the store's timeout bounds every
    /// call): it still reconnects at the next check. With redis-rs's default
    /// retries, a check waits for them, up to the store's timeout.
    ///
    /// ```no_run
    /// use tower_redis_ratelimit::RedisStore;
    ///
    /// # async fn run() -> Result<(), redis::RedisError> {
    /// let config = redis::aio::ConnectionManagerConfig::new()
    ///     .set_number_of_retries(0)
    ///     .set_response_timeout(None);
    /// let manager = redis::Client::open("redis://127.0.0.1:6379")?
    ///     .get_connection_manager_with_config(config)
    ///     .await?;
    /// let store = RedisStore::from_connection_manager(manager);
    /// # Ok(()) }
    /// ```
    pub fn from_connection_manager(manager: redis::aio::ConnectionManager) -> Self {
        Self::from_connections(Connections::Manager(manager))
    }

    /// Connect to a Redis Cluster through any of its nodes (`nodes` are
    /// seed URLs, e.g. `["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]`;
    /// the rest of the cluster is discovered from them), check that every
    /// master answers `PING`, and measure the offset to Redis's clock.
    ///
    /// Every algorithm and execution works on a cluster; the client is
    /// built with `.retries(0)` (the store resends only what Redis refused
    /// before running it). How checks are routed, why the nodes' clocks
    /// matter to the `Transaction` execution and why the retries are off:
    /// the [deployments guide](crate::guide::deployments#redis-cluster).
    ///
    /// ```no_run
    /// use tower_redis_ratelimit::RedisStore;
    ///
    /// # async fn run() -> Result<(), tower_redis_ratelimit::StoreError> {
    /// let store = RedisStore::connect_cluster(&[
    ///     "redis://127.0.0.1:7000",
    ///     "redis://127.0.0.1:7001",
    ///     "redis://127.0.0.1:7002",
    /// ])
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A malformed URL, no reachable node, a node that refuses the
    /// connection, or a cluster that does not answer within
    /// [`CONNECT_TIMEOUT`](Self::CONNECT_TIMEOUT).
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster<T: AsRef<str>>(nodes: &[T]) -> Result<Self, StoreError> {
        Self::builder().connect_cluster(nodes).await
    }

    /// Use a Redis Cluster connection you opened yourself (with your own
    /// [`ClusterClientBuilder`](redis::cluster::ClusterClientBuilder)
    /// settings: TLS, credentials, retries). Nothing is sent until the first
    /// check. See [`connect_cluster`](Self::connect_cluster) for how each
    /// algorithm runs on a cluster.
    ///
    /// Build the client with `.retries(0)`, as `connect_cluster` does, or
    /// a lost reply can count a check twice (the
    /// [deployments guide](crate::guide::deployments#redis-cluster) says why).
    #[cfg(feature = "cluster")]
    pub fn from_cluster_connection(conn: redis::cluster_async::ClusterConnection) -> Self {
        Self::from_connections(Connections::Cluster(conn))
    }

    fn from_connections(connections: Connections) -> Self {
        let batchers = (!connections.is_cluster())
            .then(|| Arc::new(Batchers::new(Self::DEFAULT_BATCHES_IN_FLIGHT)));
        Self {
            batchers,
            full_logs: Arc::new(FullKeys::new()),
            connections,
            prefix: Arc::from(Self::DEFAULT_PREFIX),
            timeout: Self::DEFAULT_TIMEOUT,
            clock: Arc::new(ClockSync::new(
                Arc::new(SystemClock::new()),
                Self::DEFAULT_CLOCK_REFRESH,
            )),
            ids: Arc::new(RequestIds::new()),
        }
    }

    /// Prefix every Redis key with `prefix` (default `rl`).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Arc::from(prefix.into());
        self
    }

    /// The smallest Redis ACL a store with key prefix `prefix` needs, as
    /// the rules of `ACL SETUSER` (after the user's name, `on` and its
    /// password): only the store's keys (`~{prefix}:*`) and only the
    /// commands it sends, directly or from its scripts, for every algorithm
    /// and execution, the operator commands and batches, on a single Redis,
    /// a Redis Cluster (`CLUSTER SLOTS`, `ASKING`) or behind Sentinel
    /// (`ROLE`). Create the user on every node: ACLs are not replicated.
    ///
    /// ```text
    /// ACL SETUSER ratelimit on >password <RedisStore::acl_rules("rl")>
    /// ```
    ///
    /// The tests run the conformance suite as such a user and show that
    /// Redis refuses it another command or a key outside the prefix.
    /// Rule sets in Redis (`rules::publish`, `Rules::follow_redis`) need
    /// more (their key, its channel, `SUBSCRIBE`, `EVAL`).
    pub fn acl_rules(prefix: &str) -> String {
        format!(
            "resetkeys ~{prefix}:* resetchannels -@all {}",
            acl::ACL_COMMANDS.join(" ")
        )
    }

    /// Decide concurrent checks of the fixed window, the sliding window,
    /// GCRA and the sliding log's `Script` execution in batches, with at
    /// most `in_flight` batches of one algorithm in
    /// flight at once ([`DEFAULT_BATCHES_IN_FLIGHT`](Self::DEFAULT_BATCHES_IN_FLIGHT)
    /// unless set; 0 turns batching off: one script per check).
    ///
    /// A check goes out at once while fewer batches are in flight;
    /// otherwise it waits for one to come back, and goes out with the
    /// checks queued meanwhile (128 at most per batch; the rest go in the
    /// next): GCRA's and the sliding log's in one `EVALSHA` that decides
    /// each in turn, atomically, on one reading of Redis's clock; the
    /// window counters' as plain
    /// commands in one pipeline (an `INCRBY` a rate, counted first and given
    /// back when denied; the guide's Redis page says what that means). A
    /// batch costs Redis a fraction of what its checks cost one by one (see
    /// BENCHMARKS.md): fewer batches in flight make larger batches, and less
    /// Redis work per check, for a little more latency under load. Each
    /// decision is the one the check would get alone (but for a reset or a
    /// reward racing a window counter's denied checks: the guide's Redis
    /// page). A check's own failure (its key holds something unreadable)
    /// fails that check alone. A failure of the call (a lost connection, a
    /// timeout) fails every check of the batch, each to its caller's fail
    /// mode, exactly as it would fail each of them sent alone: the checks
    /// Redis decided before the connection broke may have counted, and the
    /// batch is not sent again (that would count them twice), but for the
    /// sliding log's, sent again once as a single check is: each of its
    /// checks then finds its own entries, and counts once. Batches add
    /// `MGET`, `INCRBY` and `DECRBY` to the commands an ACL user needs.
    ///
    /// Not for a cluster (whose keys are spread over slots and nodes): its
    /// checks always go one by one, and this setting is ignored. The sliding
    /// log's `Transaction` execution and the concurrency limit are checked
    /// one by one.
    #[must_use]
    pub fn with_batches(mut self, in_flight: usize) -> Self {
        self.batchers = (!self.connections.is_cluster() && in_flight > 0)
            .then(|| Arc::new(Batchers::new(in_flight)));
        self
    }

    /// Bound every call (pool checkout and commands) by `timeout`.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Read local time from `clock` (the transaction execution corrects it to
    /// Redis's clock; the offset is measured again at the next check). For
    /// tests of clock skew (feature `test-util`).
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(ClockSync::new(Arc::new(clock), self.clock.refresh()));
        self
    }

    /// Measure the offset to Redis's clock again this often (default
    /// [`DEFAULT_CLOCK_REFRESH`](Self::DEFAULT_CLOCK_REFRESH)).
    #[must_use]
    pub fn with_clock_refresh(mut self, every: Duration) -> Self {
        self.clock = Arc::new(ClockSync::new(self.clock.local(), every));
        self
    }

    /// The Redis key that holds the state of `key` for `algorithm`
    /// (`"log"` for the sliding log).
    pub fn redis_key(&self, algorithm: &str, key: &str) -> String {
        redis_key(&self.prefix, algorithm, key)
    }

    /// Send `PING` and wait for the answer, within the timeout (on a
    /// cluster, every master listed by `CLUSTER SLOTS` must answer).
    ///
    /// # Errors
    /// Redis unreachable, or no answer within the timeout.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.call("ping")
            .run(|mut conn| async move {
                #[cfg(feature = "cluster")]
                if let Connections::Cluster(cluster) = &self.connections {
                    return connection::ping_every_master(&mut cluster.clone())
                        .await
                        .map_err(StoreError::from);
                }
                Ok(redis::cmd("PING").query_async::<()>(conn.get()).await?)
            })
            .await
    }

    /// A call on this store's connections, within its timeout.
    fn call<T>(&self, what: &'static str) -> Call<'_, T> {
        Call::new(&self.connections, self.timeout, what)
    }
}

impl Store for RedisStore {
    /// Final for the algorithms where other clients can only push a key's
    /// admission later: the sliding log in `Script` execution, the fixed and
    /// sliding windows, GCRA. Not for the `Transaction` execution (a retry
    /// time may come from another client's denied entry, removed a moment
    /// later) nor the concurrency limit (any release frees a slot).
    fn denials_are_final(&self, policy: &Policy) -> bool {
        match policy.algorithm() {
            Algorithm::SlidingLog => policy.execution() == Execution::Script,
            Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::Gcra => true,
            _ => false,
        }
    }

    /// One script per command, atomic on the key's node, with every
    /// Redis key of the limited key (its state and its block) in one slot.
    /// A peek, a reset or a block is sent again after a lost reply; a
    /// penalty or a reward only when Redis refused it before running it.
    async fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> Result<Decision, StoreError> {
        self.run_command(key, policy, command).await
    }

    async fn share_denials(
        &self,
        limit: &str,
        counts: Vec<(String, u64)>,
    ) -> Result<(), StoreError> {
        self.add_denials(limit, counts).await
    }

    async fn shared_denials(&self, limit: &str) -> Result<Option<Vec<(String, u64)>>, StoreError> {
        self.read_denials(limit).await.map(Some)
    }

    async fn release(&self, key: &str, policy: &Policy, lease: Lease) -> Result<(), StoreError> {
        if policy.algorithm() != Algorithm::Concurrency {
            return Ok(());
        }
        self.release_lease(key, policy, lease).await
    }

    /// One `EVALSHA` (or, for the sliding log's `Transaction` execution,
    /// one `MULTI`/`EXEC`, after a pipeline of reads for a key found full)
    /// per check, or a place in a batch of checks
    /// ([`with_batches`](RedisStore::with_batches)).
    async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
        match self.batcher(policy) {
            Some(batcher) => self.check_in_batch(batcher, key, policy).await,
            None => self.check_alone(key, policy).await,
        }
    }
}

/// The part of a block's Redis key that names it (`{prefix}:block:{key}`).
pub(super) const BLOCK_TAG: &str = "block";

/// `{prefix}:{algorithm}:{key}` with `key` in a hash tag, hashed when needed.
pub(crate) fn redis_key(prefix: &str, algorithm: &str, key: &str) -> String {
    let key = bounded_key(key);
    let mut out = String::with_capacity(prefix.len() + algorithm.len() + key.len() + 4);
    out.push_str(prefix);
    out.push(':');
    out.push_str(algorithm);
    out.push_str(":{");
    out.push_str(&key);
    out.push('}');
    out
}

/// Request ids unique across processes: a random per-store part and a counter.
#[derive(Debug)]
struct RequestIds {
    base: u64,
    next: AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        let base = RandomState::new().hash_one((std::process::id(), SystemClock::new().now()));
        Self {
            base,
            next: AtomicU64::new(0),
        }
    }

    /// A new id.
    fn next(&self) -> Lease {
        let id =
            (u128::from(self.base) << 64) | u128::from(self.next.fetch_add(1, Ordering::Relaxed));
        Lease::new(id)
    }
}

#[cfg(test)]
mod tests {
    use super::reply::member;
    use super::*;

    #[test]
    fn keys_are_hash_tagged_and_hashed_when_unsafe() {
        assert_eq!(
            redis_key("rl", "log", "203.0.113.9"),
            "rl:log:{203.0.113.9}"
        );
        let braces = redis_key("rl", "log", "a{b}c");
        assert!(
            braces.starts_with("rl:log:{#") && braces.ends_with('}'),
            "{braces}"
        );
        assert_eq!(braces.matches('{').count(), 1);
        let long = "x".repeat(crate::store::MAX_RAW_KEY_LEN + 1);
        assert_eq!(redis_key("rl", "log", &long).len(), "rl:log:{#}".len() + 40);
        assert_ne!(redis_key("rl", "log", "#abc"), "rl:log:{#abc}");
        // Stable across processes: a fixed hash, not a seeded one.
        assert_eq!(redis_key("rl", "log", "{"), redis_key("rl", "log", "{"));
        assert_eq!(
            redis_key("p", "log", "{"),
            format!("p:log:{{#{}}}", sha1_smol::Sha1::from("{").digest())
        );
    }

    #[test]
    fn request_ids_are_unique() {
        let a = RequestIds::new();
        let b = RequestIds::new();
        let ids: std::collections::HashSet<String> = (0..1000)
            .flat_map(|_| [member(a.next()), member(b.next())])
            .collect();
        assert_eq!(ids.len(), 2000);
    }
}
