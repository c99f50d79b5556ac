//! [`PostgresStore`]: limits shared through PostgreSQL, each key's
//! [`KeyState`] a row updated in one transaction per decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bb8_postgres::PostgresConnectionManager;
use bb8_postgres::bb8::{Pool, PooledConnection, RunError};
use tokio_postgres::NoTls;
use tokio_postgres::types::{ToSql, Type};

use crate::clock::Clock;
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Policy};
use crate::store::{Command, KeyState, Store, StoreError, bounded_key};

/// The table [`PostgresStore::connect`] keeps the states in.
pub const DEFAULT_TABLE: &str = "rate_limits";

/// The longest one decision may take (a connection from the pool, the
/// transaction and its commit) before it fails with
/// [`StoreError::Timeout`]: the fail mode then decides.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// Every how many writes expired rows are deleted, a bounded batch of them.
const CLEANUP_EVERY: u64 = 256;
/// At most this many expired rows deleted at once.
const CLEANUP_BATCH: u32 = 256;

type Manager = PostgresConnectionManager<NoTls>;

/// Limits shared through PostgreSQL: every process of a deployment that
/// has a database and no Redis counts on one table (feature `postgres`).
///
/// One row per limited key holds its [`KeyState`] as bytes
/// ([`KeyState::to_bytes`]) and when it stops mattering. A decision is one
/// transaction: the key's row is locked (made, for a new key), read,
/// decided on the database's clock, and written back; two processes
/// checking one key at once take turns. A connection lost mid-transaction
/// rolls it back: the request was not counted. Expired rows are deleted in
/// bounded batches as the store writes. Every algorithm, several rates,
/// costs, calendar quotas, operator commands and concurrency slots work
/// as in [`MemoryStore`](crate::MemoryStore).
///
/// ```no_run
/// use tower_redis_ratelimit::{Limiter, Policy, PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://app@localhost/app").await?;
/// let limiter = Limiter::new(store, "100/min".parse::<Policy>()?);
/// assert!(limiter.check("tenant-42").await?.allowed());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool<Manager>,
    /// Where the pool connects, for the connections opened apart from it
    /// ([`PostgresStore::connection`]).
    config: tokio_postgres::Config,
    pool_size: u32,
    /// The statements, written for the table.
    sql: Sql,
    /// The clock decisions are taken on; `None`: the database's.
    clock: Option<Arc<dyn Clock>>,
    timeout: Duration,
    writes: AtomicU64,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.sql.table)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// The statements of one table.
struct Sql {
    table: String,
    /// Lock (or make) a key's row; its state, expiry and the database's
    /// time (µs), read after the lock is held.
    lock: String,
    write: String,
    delete: String,
    cleanup: String,
}

impl Sql {
    fn new(table: &str) -> Self {
        Self {
            table: table.to_owned(),
            lock: format!(
                "INSERT INTO \"{table}\" AS t (key, state, expires_at) VALUES ($1, ''::bytea, 0) \
                 ON CONFLICT (key) DO UPDATE SET expires_at = t.expires_at \
                 RETURNING state, expires_at, \
                 (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
            ),
            write: format!("UPDATE \"{table}\" SET state = $2, expires_at = $3 WHERE key = $1"),
            delete: format!("DELETE FROM \"{table}\" WHERE key = $1"),
            cleanup: format!(
                "DELETE FROM \"{table}\" WHERE key IN (SELECT key FROM \"{table}\" \
                 WHERE expires_at <= $1 LIMIT {CLEANUP_BATCH} FOR UPDATE SKIP LOCKED)"
            ),
        }
    }

    /// The statements that make the table and its index.
    fn schema(&self) -> String {
        let table = &self.table;
        // The key as bytes: any key a client sends (a NUL, any encoding).
        format!(
            "CREATE TABLE IF NOT EXISTS \"{table}\" (key bytea PRIMARY KEY, \
             state bytea NOT NULL, expires_at bigint NOT NULL); \
             CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON \"{table}\" (expires_at)"
        )
    }
}

/// Builds a [`PostgresStore`] with settings other than the defaults.
#[must_use]
pub struct PostgresStoreBuilder {
    url: String,
    table: String,
    pool_size: u32,
    timeout: Duration,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for PostgresStoreBuilder {
    // Not the URL: it may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    /// The table the states are kept in (made when missing): a plain SQL
    /// name, letters, digits and `_`, not starting with a digit, at most 52
    /// bytes (its index adds `_expires_at`). [`DEFAULT_TABLE`]
    /// by default.
    pub fn table(mut self, table: &str) -> Self {
        table.clone_into(&mut self.table);
        self
    }

    /// Connections in the pool (10 by default).
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections.max(1);
        self
    }

    /// The longest one decision may take ([`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Decide on `clock` rather than on the database's clock: for tests (a
    /// [`ManualClock`](crate::clock::ManualClock)). Every process sharing
    /// the table must then read one time.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Connect, and make the table when it is missing.
    pub async fn connect(self) -> Result<PostgresStore, StoreError> {
        let plain = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
        let table = &self.table;
        if table.is_empty()
            || table.len() > 52
            || table.as_bytes()[0].is_ascii_digit()
            || !table.bytes().all(plain)
        {
            return Err(StoreError::UnexpectedReply(format!(
                "PostgresStore: the table name {table:?} is not a plain SQL name \
                 (letters, digits and _, at most 52 bytes, not starting with a digit)"
            )));
        }
        let config: tokio_postgres::Config = self.url.parse().map_err(postgres)?;
        // No test query at each checkout (a round trip more per decision):
        // a connection the server closed is known closed, and dropped.
        let pool = Pool::builder()
            .max_size(self.pool_size)
            .test_on_check_out(false)
            .connection_timeout(self.timeout)
            .build(Manager::new(config.clone(), NoTls))
            .await
            .map_err(postgres)?;
        let sql = Sql::new(table);
        // The first connection opened here: a wrong address, user or
        // password is told as the database says it.
        let conn = open(&config).await?;
        // Made only when missing: a user with no right to create tables
        // uses a table made for it.
        let quoted = format!("\"{table}\"");
        let found = conn
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&quoted])
            .await
            .map_err(postgres)?;
        if !found.get::<_, bool>(0) {
            conn.batch_execute(&sql.schema()).await.map_err(postgres)?;
        }
        // Into the pool, as its first connection.
        let _ = pool.add(conn);
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                config,
                pool_size: self.pool_size,
                sql,
                clock: self.clock,
                timeout: self.timeout,
                writes: AtomicU64::new(0),
            }),
        })
    }
}

impl PostgresStore {
    /// Connect to the database at `url` (`postgres://user:password@host/db`,
    /// or key=value settings), keeping the states in [`DEFAULT_TABLE`],
    /// made when missing.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    /// A builder for a store with other settings.
    pub fn builder(url: &str) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            pool_size: 10,
            timeout: DEFAULT_TIMEOUT,
            clock: None,
        }
    }

    /// Run `f` on the state of `key` at the decision's time, in one
    /// transaction holding the key's row, within the store's timeout.
    async fn update<T>(
        &self,
        key: &str,
        f: impl FnOnce(&mut KeyState, Duration) -> T,
    ) -> Result<T, StoreError> {
        let timeout = self.inner.timeout;
        let (out, now) = match tokio::time::timeout(timeout, self.transaction(key, f)).await {
            Ok(outcome) => outcome?,
            Err(_) => return Err(StoreError::Timeout(timeout)),
        };
        let writes = self.inner.writes.fetch_add(1, Ordering::Relaxed);
        if writes % CLEANUP_EVERY == CLEANUP_EVERY - 1 {
            // Apart from the decision, which is already counted: neither
            // its time nor its outcome.
            tokio::spawn(self.clone().clean_up(now));
        }
        Ok(out)
    }

    /// Delete a bounded batch of rows expired by `now`, skipping rows in
    /// use. Best effort: rows a failed cleanup leaves go with the next.
    async fn clean_up(self, now: Duration) {
        let micros = i64::try_from(now.as_micros()).unwrap_or(i64::MAX);
        if let Ok(conn) = self.inner.pool.get().await {
            let sql = &self.inner.sql.cleanup;
            let _ = conn.query_typed(sql, &[(&micros, Type::INT8)]).await;
        }
    }

    /// `f` run on the state of `key` in one transaction holding its row:
    /// its outcome, and the decision's time.
    async fn transaction<T>(
        &self,
        key: &str,
        f: impl FnOnce(&mut KeyState, Duration) -> T,
    ) -> Result<(T, Duration), StoreError> {
        let key = bounded_key(key);
        let key: &str = &key;
        let mut conn = self.connection().await?;
        match conn.transaction().await {
            Ok(tx) => return self.decide_in(tx, key, f).await,
            Err(error) if error.is_closed() => {}
            Err(error) => return Err(postgres(error)),
        }
        // Closed by the server since it was last used (a restart, a
        // terminated backend), before anything was sent: dropped, and the
        // transaction begun on another.
        drop(conn);
        let mut conn = self.connection().await?;
        let tx = conn.transaction().await.map_err(postgres)?;
        self.decide_in(tx, key, f).await
    }

    /// A connection from the pool. With none idle and room for more, one
    /// is opened here first and put in the pool: a database that refuses
    /// connections fails the decision at once, with its error (the pool
    /// would wait out its timeout, and tell only that).
    async fn connection(&self) -> Result<PooledConnection<'_, Manager>, StoreError> {
        let inner = &*self.inner;
        let state = inner.pool.state();
        if state.idle_connections == 0 && state.connections < inner.pool_size {
            // A full pool (another caller's connection came first) drops it.
            let _ = inner.pool.add(open(&inner.config).await?);
        }
        inner.pool.get().await.map_err(pool_error)
    }

    /// `f` run on the state of `key` in `tx`, committed.
    async fn decide_in<T>(
        &self,
        tx: tokio_postgres::Transaction<'_>,
        key: &str,
        f: impl FnOnce(&mut KeyState, Duration) -> T,
    ) -> Result<(T, Duration), StoreError> {
        let (mut state, now) = self.lock(&tx, key).await?;
        let out = f(&mut state, now);
        self.write(&tx, key, &state, now).await?;
        tx.commit().await.map_err(postgres)?;
        Ok((out, now))
    }

    /// Lock (or make) the row of `key` in `tx`: its state (a fresh one
    /// once expired) and the decision's time, read once the lock is held.
    async fn lock(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        key: &str,
    ) -> Result<(KeyState, Duration), StoreError> {
        let inner = &*self.inner;
        let rows = tx
            .query_typed(
                &inner.sql.lock,
                &[(&key.as_bytes() as &(dyn ToSql + Sync), Type::BYTEA)],
            )
            .await
            .map_err(postgres)?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::UnexpectedReply("no row locked".to_owned()))?;
        let bytes: &[u8] = row.try_get(0).map_err(postgres)?;
        let expires_at: i64 = row.try_get(1).map_err(postgres)?;
        let db_now: i64 = row.try_get(2).map_err(postgres)?;
        let now = match &inner.clock {
            Some(clock) => clock.now(),
            None => Duration::from_micros(u64::try_from(db_now).unwrap_or(0)),
        };
        let expired = u128::try_from(expires_at).unwrap_or(0) <= now.as_micros();
        let state = if bytes.is_empty() || expired {
            KeyState::new()
        } else {
            KeyState::from_bytes(bytes).map_err(|e| StoreError::backend("postgres", e))?
        };
        Ok((state, now))
    }

    /// Write `state` to the row of `key` in `tx`; a state that no longer
    /// matters deletes the row.
    async fn write(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        key: &str,
        state: &KeyState,
        now: Duration,
    ) -> Result<(), StoreError> {
        let sql = &self.inner.sql;
        let key = key.as_bytes();
        let key = &key as &(dyn ToSql + Sync);
        let expires_at = state.expires_at();
        let written = if expires_at <= now {
            tx.query_typed(&sql.delete, &[(key, Type::BYTEA)]).await
        } else {
            let micros = i64::try_from(expires_at.as_micros()).unwrap_or(i64::MAX);
            let bytes = state.to_bytes();
            let params = [
                (key, Type::BYTEA),
                (&bytes, Type::BYTEA),
                (&micros, Type::INT8),
            ];
            tx.query_typed(&sql.write, &params).await
        };
        written.map(drop).map_err(postgres)
    }
}

impl Store for PostgresStore {
    async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
        self.update(key, |state, now| state.check(now, policy))
            .await
    }

    fn denials_are_final(&self, policy: &Policy) -> bool {
        policy.algorithm() != Algorithm::Concurrency
    }

    async fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> Result<Decision, StoreError> {
        self.update(key, |state, now| state.command(now, policy, command))
            .await
    }

    async fn release(&self, key: &str, _: &Policy, lease: Lease) -> Result<(), StoreError> {
        self.update(key, |state, _| state.release(lease)).await
    }
}

/// A connection to the database of `config`, its I/O driven by a task of
/// its own.
async fn open(config: &tokio_postgres::Config) -> Result<tokio_postgres::Client, StoreError> {
    let (client, connection) = config.connect(NoTls).await.map_err(postgres)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn postgres(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::backend("postgres", error)
}

fn pool_error(error: RunError<tokio_postgres::Error>) -> StoreError {
    match error {
        RunError::User(error) => postgres(error),
        RunError::TimedOut => StoreError::PoolTimeout,
    }
}
