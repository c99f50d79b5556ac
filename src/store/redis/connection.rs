//! Where RedisStore's connections come from, and how a broken one leaves
//! the pool.

use std::fmt;

use bb8_redis::RedisConnectionManager;
use bb8_redis::bb8::{self, ManageConnection, Pool, PooledConnection, RunError};
use redis::aio::MultiplexedConnection;
use redis::{IntoConnectionInfo, RedisError};

use crate::store::StoreError;

/// A bb8 manager of multiplexed connections that knows when one is broken,
/// so pools built by [`RedisStore::connect`](super::RedisStore::connect)
/// need no `PING` on every checkout: a connection that fails with a
/// connection error is dropped when it returns to the pool, and the next
/// checkout opens a fresh one (after a Redis restart, for instance).
#[derive(Debug, Clone)]
pub struct TrackedManager {
    inner: RedisConnectionManager,
}

impl TrackedManager {
    /// A manager for the Redis at `info`.
    ///
    /// # Errors
    /// A malformed connection address.
    pub fn new<T: IntoConnectionInfo>(info: T) -> Result<Self, RedisError> {
        Ok(Self {
            inner: RedisConnectionManager::new(info)?,
        })
    }
}

/// A pooled multiplexed connection and whether it has failed.
pub struct TrackedConnection {
    conn: MultiplexedConnection,
    broken: bool,
}

impl TrackedConnection {
    pub(super) fn new(conn: MultiplexedConnection) -> Self {
        Self {
            conn,
            broken: false,
        }
    }
}

impl fmt::Debug for TrackedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedConnection")
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl ManageConnection for TrackedManager {
    type Connection = TrackedConnection;
    type Error = RedisError;

    async fn connect(&self) -> Result<Self::Connection, Self::Error> {
        self.inner.connect().await.map(TrackedConnection::new)
    }

    async fn is_valid(&self, conn: &mut Self::Connection) -> Result<(), Self::Error> {
        self.inner.is_valid(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Self::Connection) -> bool {
        conn.broken
    }
}

/// The pool behind a RedisStore.
#[derive(Clone)]
pub(super) enum Source {
    /// Built by `connect`: broken connections are dropped, no checkout PING.
    Tracked(Pool<TrackedManager>),
    /// A bb8-redis pool passed to `from_pool`: its own settings apply (bb8
    /// tests connections on checkout by default, which is what replaces a
    /// broken one there).
    Bb8Redis(Pool<RedisConnectionManager>),
}

impl Source {
    pub(super) async fn get(&self) -> Result<Conn<'_>, StoreError> {
        match self {
            Self::Tracked(pool) => pool.get().await.map(Conn::Tracked).map_err(run_error),
            Self::Bb8Redis(pool) => pool.get().await.map(Conn::Bb8Redis).map_err(run_error),
        }
    }

    pub(super) fn state(&self) -> bb8::State {
        match self {
            Self::Tracked(pool) => pool.state(),
            Self::Bb8Redis(pool) => pool.state(),
        }
    }
}

fn run_error(error: RunError<RedisError>) -> StoreError {
    match error {
        RunError::User(error) => StoreError::Redis(error),
        RunError::TimedOut => StoreError::PoolTimeout,
    }
}

/// A connection checked out of a [`Source`].
pub(super) enum Conn<'a> {
    Tracked(PooledConnection<'a, TrackedManager>),
    Bb8Redis(PooledConnection<'a, RedisConnectionManager>),
}

impl Conn<'_> {
    pub(super) fn get(&mut self) -> &mut MultiplexedConnection {
        match self {
            Self::Tracked(conn) => &mut conn.conn,
            Self::Bb8Redis(conn) => conn,
        }
    }

    /// Drop this connection instead of returning it to the pool, if the
    /// pool lets us.
    pub(super) fn mark_broken(&mut self) {
        if let Self::Tracked(conn) = self {
            conn.broken = true;
        }
    }
}

/// Whether `error` means the connection itself is unusable.
pub(super) fn is_connection_error(error: &StoreError) -> bool {
    match error {
        StoreError::Redis(e) => {
            e.is_io_error()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
                || e.is_unrecoverable_error()
        }
        _ => false,
    }
}
