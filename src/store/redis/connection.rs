//! Where RedisStore's connections come from, and how a broken one leaves
//! the pool.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::Notify;

use bb8_redis::RedisConnectionManager;
use bb8_redis::bb8::{self, ManageConnection, Pool, RunError};
use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, Value};

use crate::store::StoreError;

#[cfg(feature = "sentinel")]
use super::sentinel::SentinelTarget;

/// A bb8 manager of multiplexed connections that knows when one is broken,
/// so pools built by [`RedisStore::connect`](super::RedisStore::connect)
/// need no `PING` on every checkout: connections carry a generation, and a
/// connection error marks the failed connection and every one opened
/// before it as stale (after a Redis restart or a `CLIENT KILL` they are
/// all dead). Stale connections are dropped at checkout instead of failing
/// one request each, and the pool opens fresh ones.
///
/// The connections are multiplexed: a [`RedisStore`](super::RedisStore)
/// holds one only while it takes a clone, so any number of checks share the
/// pool's sockets.
///
/// Connections have no response timeout of their own (redis-rs's default is
/// 500 ms): the store's timeout bounds every call.
#[derive(Clone)]
pub struct TrackedManager {
    target: Target,
    epoch: Arc<AtomicU64>,
}

/// Where a [`TrackedManager`] opens its connections.
#[derive(Clone)]
enum Target {
    /// One Redis (plain or TLS).
    Client(Box<redis::Client>),
    /// The primary that Redis Sentinel names at each new connection: after a
    /// failover, connections opened after the old primary's failed go to
    /// the new one.
    #[cfg(feature = "sentinel")]
    Sentinel(Arc<SentinelTarget>),
}

impl fmt::Debug for TrackedManager {
    /// The kind of target only: a connection address can hold credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match &self.target {
            Target::Client(_) => "redis",
            #[cfg(feature = "sentinel")]
            Target::Sentinel(_) => "sentinel",
        };
        f.debug_struct("TrackedManager")
            .field("target", &target)
            .finish_non_exhaustive()
    }
}

/// How RedisStore opens connections: no response timeout of redis-rs's own.
pub(super) fn connection_config() -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new().set_response_timeout(None)
}

impl TrackedManager {
    /// A manager for the Redis at `info` (`redis://`, `rediss://` with the
    /// `tls` feature, `unix://`).
    ///
    /// # Errors
    /// A malformed connection address.
    pub fn new<T: IntoConnectionInfo>(info: T) -> Result<Self, RedisError> {
        Ok(Self::from_client(redis::Client::open(
            info.into_connection_info()?,
        )?))
    }

    /// A manager for the Redis a [`redis::Client`] you built points to: e.g.
    /// one from [`Client::build_with_tls`][redis::Client::build_with_tls]
    /// with your own root or client certificates (`tls` feature).
    #[cfg_attr(not(feature = "tls"), doc = links_without!("tls"))]
    #[must_use]
    pub fn from_client(client: redis::Client) -> Self {
        Self {
            target: Target::Client(Box::new(client)),
            epoch: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A manager whose connections go to the primary Redis Sentinel names
    /// (`sentinel` feature). Build the client with
    /// [`SentinelServerType::Master`](redis::sentinel::SentinelServerType):
    /// checks write. After a failover, the connections to the old primary
    /// fail (or are refused writes, `READONLY`), the pool drops them, and
    /// the next connection asks the Sentinels again (in the order the
    /// client lists them; the first primary that `ROLE` confirms), so the
    /// connections go to the primary Sentinel promoted.
    ///
    /// `service` is the name the client was built with. Every half second
    /// a task (started with the first connection) asks a Sentinel which
    /// primary it names for `service`; when that is not the one in use and
    /// the connections' own question agrees, the connections opened before
    /// are retired, so that a primary that was cut off and comes back does
    /// not take checks (that its demotion would discard) until the
    /// Sentinels demote it.
    ///
    /// With a client of your own, both questions go through it as
    /// redis-rs asks them: an unreachable first Sentinel is waited out at
    /// every lookup, and the watch may stay with a Sentinel that does not
    /// answer. [`RedisStore::connect_sentinel`](super::RedisStore::connect_sentinel)
    /// and `redis+sentinel://` URLs ask one Sentinel at a time instead,
    /// beginning with the one that answered last.
    #[cfg(feature = "sentinel")]
    #[must_use]
    pub fn from_sentinel(client: redis::sentinel::SentinelClient, service: &str) -> Self {
        Self::from_sentinels(client, Vec::new(), service)
    }

    /// [`from_sentinel`](Self::from_sentinel), with one client per
    /// Sentinel besides (each built like `all`, with that Sentinel alone),
    /// asked one at a time (see [`SentinelTarget`]).
    #[cfg(feature = "sentinel")]
    pub(super) fn from_sentinels(
        all: redis::sentinel::SentinelClient,
        each: Vec<redis::sentinel::SentinelClient>,
        service: &str,
    ) -> Self {
        Self {
            target: Target::Sentinel(Arc::new(SentinelTarget::new(all, each, service))),
            epoch: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Open one connection to the target (the current primary, for
    /// Sentinel). It belongs to the epoch in which it was asked for: if a
    /// connection failed meanwhile, it is stale already.
    pub(super) async fn open(&self) -> Result<TrackedConnection, RedisError> {
        let generation = self.epoch.load(Ordering::Acquire);
        let conn = match &self.target {
            Target::Client(client) => {
                client
                    .get_multiplexed_async_connection_with_config(&connection_config())
                    .await?
            }
            #[cfg(feature = "sentinel")]
            Target::Sentinel(target) => target.open(generation, &self.epoch).await?,
        };
        Ok(TrackedConnection {
            conn,
            generation,
            epoch: Arc::clone(&self.epoch),
        })
    }
}

/// A pooled multiplexed connection and whether it has failed.
pub struct TrackedConnection {
    conn: MultiplexedConnection,
    generation: u64,
    epoch: Arc<AtomicU64>,
}

impl TrackedConnection {
    /// Opened before the last connection error.
    fn stale(&self) -> bool {
        self.generation < self.epoch.load(Ordering::Acquire)
    }

    /// The connection itself.
    pub(super) fn conn(&mut self) -> &mut MultiplexedConnection {
        &mut self.conn
    }
}

impl fmt::Debug for TrackedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedConnection")
            .field("stale", &self.stale())
            .finish_non_exhaustive()
    }
}

impl ManageConnection for TrackedManager {
    type Connection = TrackedConnection;
    type Error = RedisError;

    async fn connect(&self) -> Result<Self::Connection, Self::Error> {
        self.open().await
    }

    async fn is_valid(&self, conn: &mut Self::Connection) -> Result<(), Self::Error> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Self::Connection) -> bool {
        conn.stale()
    }
}

/// A connection the algorithms run on: one of a pool's multiplexed
/// connections, or a [`ConnectionManager`]. Cloning shares it (commands sent
/// on a clone follow those sent on the original).
#[derive(Clone)]
pub(super) enum AnyConn {
    Multiplexed(MultiplexedConnection),
    Manager(ConnectionManager),
    /// A Redis Cluster connection: each command goes to the node that owns
    /// its key's slot.
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for AnyConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Multiplexed(conn) => conn.req_packed_command(cmd),
            Self::Manager(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Multiplexed(conn) => conn.req_packed_commands(pipeline, offset, count),
            Self::Manager(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Multiplexed(conn) => conn.get_db(),
            Self::Manager(conn) => conn.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => conn.get_db(),
        }
    }
}

/// Where a RedisStore's connections come from: a pool, one
/// self-reconnecting connection, or a cluster connection.
#[derive(Clone)]
pub(super) enum Connections {
    /// Built by `connect`: broken connections are dropped, no checkout PING.
    Tracked(Pool<TrackedManager>, Arc<Refusals>),
    /// A bb8-redis pool passed to `from_pool`: its own settings apply (bb8
    /// tests connections on checkout by default, which is what replaces a
    /// broken one there).
    Bb8Redis(Pool<RedisConnectionManager>, Arc<Refusals>),
    /// One multiplexed connection that reconnects by itself.
    Manager(ConnectionManager),
    /// A Redis Cluster connection (one multiplexed connection per node,
    /// reconnecting and following slot moves by itself).
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Connections {
    /// A connection for one check. Pooled connections are multiplexed: the
    /// check runs on a clone, and the pooled connection goes back at once,
    /// so checks in flight are not bounded by the pool size (bb8 hands a
    /// returned connection to whoever asks next, not to the oldest waiter:
    /// holding connections for a whole check starved the waiters of a busy
    /// pool until they timed out). The pool's size is the number of sockets
    /// the checks are spread over.
    pub(super) async fn get(&self) -> Result<Conn, StoreError> {
        match self {
            Self::Tracked(pool, refusals) => {
                // Skip connections opened before the last connection error:
                // at most every idle one, then a fresh one.
                for _ in 0..pool.state().connections {
                    let conn = refusals.get(pool).await?;
                    if !conn.stale() {
                        return Ok(Conn::tracked(&conn));
                    }
                    // Dropped as it goes back (`has_broken`).
                }
                let conn = refusals.get(pool).await?;
                Ok(Conn::tracked(&conn))
            }
            Self::Bb8Redis(pool, refusals) => {
                let conn = refusals.get(pool).await?;
                Ok(Conn {
                    any: AnyConn::Multiplexed((*conn).clone()),
                    failure: None,
                })
            }
            Self::Manager(manager) => Ok(Conn {
                any: AnyConn::Manager(manager.clone()),
                failure: None,
            }),
            #[cfg(feature = "cluster")]
            Self::Cluster(conn) => Ok(Conn {
                any: AnyConn::Cluster(conn.clone()),
                failure: None,
            }),
        }
    }

    /// Whether this is a Redis Cluster connection (keys on several nodes).
    pub(super) fn is_cluster(&self) -> bool {
        match self {
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => true,
            _ => false,
        }
    }

    /// The pool's state, if there is a pool.
    pub(super) fn state(&self) -> Option<bb8::State> {
        match self {
            Self::Tracked(pool, _) => Some(pool.state()),
            Self::Bb8Redis(pool, _) => Some(pool.state()),
            Self::Manager(_) => None,
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => None,
        }
    }
}

/// How long a pool checkout may take before the store asks whether Redis
/// refuses connections: a pool with a connection to hand answers in
/// microseconds.
const CHECKOUT_GRACE: Duration = Duration::from_millis(5);

/// Finds out at once that Redis refuses connections. A bb8 pool that has no
/// working connection waits for a new one until its connection timeout
/// (bb8 retries refused connections with a back-off, and hands the error
/// only to its error sink), so every check would wait the store's whole
/// timeout, and after a restart the first check would wait for the
/// back-off. A checkout that is not served within [`CHECKOUT_GRACE`] while
/// the pool holds no connection at all starts one connection attempt of its
/// own, outside the pool, in a task of its own (one at a time per store,
/// finished whatever its callers do): refused, the check and every checkout
/// waiting meanwhile fail at once; accepted, the connection joins the pool.
#[derive(Debug, Default)]
pub(super) struct Refusals {
    running: AtomicBool,
    done: Notify,
    /// The last attempt's failure, for the checkouts that waited on it.
    last: Mutex<Option<(std::io::ErrorKind, String)>>,
}

impl Refusals {
    /// A connection from `pool`, or the error of a refused connection.
    async fn get<'a, M>(
        self: &Arc<Self>,
        pool: &'a Pool<M>,
    ) -> Result<bb8::PooledConnection<'a, M>, StoreError>
    where
        M: ManageConnection<Error = RedisError>,
    {
        let checkout = pool.get();
        tokio::pin!(checkout);
        // Usually served at the first poll: no timer for that.
        let first = std::future::poll_fn(|cx| Poll::Ready(checkout.as_mut().poll(cx))).await;
        if let Poll::Ready(conn) = first {
            return conn.map_err(run_error);
        }
        loop {
            tokio::select! {
                biased;
                conn = &mut checkout => return conn.map_err(run_error),
                () = tokio::time::sleep(CHECKOUT_GRACE) => {}
            }
            // A pool that holds connections serves this checkout soon (or
            // finds them broken, and then holds none).
            if pool.state().connections == 0 {
                break;
            }
        }
        tokio::select! {
            biased;
            conn = &mut checkout => conn.map_err(run_error),
            refused = self.attempt(pool) => match refused {
                Some(error) => Err(error),
                None => checkout.await.map_err(run_error),
            },
        }
    }

    /// Wait for a connection attempt beside the pool (starting one unless
    /// one is under way): its error if it failed, `None` if it succeeded
    /// (the connection joined the pool, or was dropped if the pool is full).
    async fn attempt<M>(self: &Arc<Self>, pool: &Pool<M>) -> Option<StoreError>
    where
        M: ManageConnection<Error = RedisError>,
    {
        let done = self.done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        if !self.running.swap(true, Ordering::AcqRel) {
            let this = Arc::clone(self);
            let pool = pool.clone();
            tokio::spawn(async move {
                // A Redis that accepts but does not answer must not hold
                // the attempt (and every later one) for ever.
                let limit = CONNECT_ATTEMPT_LIMIT;
                let outcome = tokio::time::timeout(limit, pool.dedicated_connection()).await;
                let failure = match outcome {
                    Ok(Ok(conn)) => {
                        // Full, or broken: the connection is dropped.
                        let _ = pool.add(conn);
                        None
                    }
                    Ok(Err(error)) => {
                        let kind = if error.is_connection_refusal() {
                            std::io::ErrorKind::ConnectionRefused
                        } else {
                            std::io::ErrorKind::Other
                        };
                        Some((kind, error.to_string()))
                    }
                    Err(_) => Some((
                        std::io::ErrorKind::TimedOut,
                        format!("no redis connection within {limit:?}"),
                    )),
                };
                *this.last.lock().unwrap_or_else(PoisonError::into_inner) = failure;
                this.running.store(false, Ordering::Release);
                this.done.notify_waiters();
            });
        }
        done.await;
        let last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        last.as_ref().map(|(kind, text)| {
            StoreError::from(RedisError::from(std::io::Error::new(*kind, text.clone())))
        })
    }
}

/// The longest a connection attempt beside the pool may take.
const CONNECT_ATTEMPT_LIMIT: Duration = Duration::from_secs(5);

fn run_error(error: RunError<RedisError>) -> StoreError {
    match error {
        RunError::User(error) => StoreError::from(error),
        RunError::TimedOut => StoreError::PoolTimeout,
    }
}

/// A connection taken from [`Connections`] for one call. Cloning shares
/// it, and how to retire it.
#[derive(Clone)]
pub(super) struct Conn {
    any: AnyConn,
    /// How to retire a pooled [`TrackedConnection`] that failed: its
    /// generation, and the epoch that makes it stale.
    failure: Option<(u64, Arc<AtomicU64>)>,
}

impl Conn {
    fn tracked(conn: &TrackedConnection) -> Self {
        Self {
            any: AnyConn::Multiplexed(conn.conn.clone()),
            failure: Some((conn.generation, Arc::clone(&conn.epoch))),
        }
    }

    pub(super) fn get(&mut self) -> &mut AnyConn {
        &mut self.any
    }

    /// This connection failed: the pool drops it, and every connection
    /// opened before it, at their next checkout. (A plain bb8-redis pool
    /// finds out with its checkout `PING`; a ConnectionManager or a cluster
    /// connection reconnects by itself.)
    pub(super) fn mark_broken(&mut self) {
        if let Some((generation, epoch)) = &self.failure {
            epoch.fetch_max(generation + 1, Ordering::AcqRel);
        }
    }
}

/// `PING` every master of the cluster by address (the masters `CLUSTER
/// SLOTS` lists). redis-rs's own routing of `PING` goes to the masters it
/// holds a connection to, and drops a dead one from that set: a ping routed
/// that way stays green while a master's slots are unserved.
#[cfg(feature = "cluster")]
pub(super) async fn ping_every_master(
    conn: &mut redis::cluster_async::ClusterConnection,
) -> Result<(), RedisError> {
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

    let ranges: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut masters = std::collections::BTreeSet::new();
    for range in ranges {
        // [start, end, [host, port, id, ...], replicas...]
        if let Value::Array(parts) = range
            && let Some(Value::Array(master)) = parts.get(2)
            && let [host, port, ..] = master.as_slice()
        {
            let host: String = redis::from_redis_value_ref(host)?;
            let port: u16 = redis::from_redis_value_ref(port)?;
            masters.insert((host, port));
        }
    }
    if masters.is_empty() {
        return Err(RedisError::from((
            redis::ErrorKind::Client,
            "CLUSTER SLOTS lists no master",
        )));
    }
    for (host, port) in masters {
        conn.route_command(
            redis::cmd("PING"),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port }),
        )
        .await?;
    }
    Ok(())
}
