//! [`PostgresStore`]: limits shared through PostgreSQL, each key's
//! [`KeyState`] a row written by compare-and-set.

mod builder;
mod busy;
mod seen;
mod session;
mod statements;
mod tls;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bb8::{Pool, PooledConnection, RunError};

use crate::clock::Clock;
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Policy};
use crate::store::{Command, KeyState, Store, StoreError, bounded_key};

pub use builder::PostgresStoreBuilder;
use busy::Busy;
use seen::{Seen, SeenRow};
use session::{Manager, Session};
use statements::{Sql, deletable_at};

/// The table [`PostgresStore::connect`] keeps the states in.
pub const DEFAULT_TABLE: &str = "rate_limits";

/// The longest one decision may take (a connection from the pool, reading
/// the key's row and writing it) before it fails with
/// [`StoreError::Timeout`]: the fail mode then decides.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// How many bytes of keys' rows a store keeps as it last saw them, unless
/// [`PostgresStoreBuilder::seen_bytes`] says otherwise: 8 MiB, about
/// 60,000 keys of one rate.
pub const DEFAULT_SEEN_BYTES: usize = 8 << 20;

/// Every how many decisions expired rows are deleted, a bounded batch of
/// them.
const CLEANUP_EVERY: u64 = 256;

/// Limits shared through PostgreSQL: every process of a deployment that
/// has a database and no Redis counts on one table (feature `postgres`).
///
/// One row per limited key holds its [`KeyState`] as bytes
/// ([`KeyState::to_bytes`]) and when it may be deleted. A decision reads
/// the key's row and the database's time in one prepared statement,
/// decides in Rust as every store does, and writes the new state back in
/// a second, only if the row still holds the state it read (else it reads
/// again): two processes checking one key at once take turns, and a
/// decision that changes nothing (a denial) writes nothing. A key this
/// process wrote last is decided on the row as it wrote it, at the
/// database's clock as its latest reading gives it, and written in one
/// round trip ([`PostgresStoreBuilder::seen_bytes`]). A decision that loses
/// three races to other writers takes the row's lock and waits its turn.
/// Each write commits alone: a connection lost before its commit counted
/// nothing. Expired rows are deleted in bounded batches as the store
/// writes. Every algorithm, several rates, costs, calendar quotas,
/// operator commands and concurrency slots work as in
/// [`MemoryStore`](crate::MemoryStore).
///
/// A row another session holds locked costs its own key alone: the
/// store's sessions give up on a lock after half the store's timeout
/// (PostgreSQL's `lock_timeout`) and on any statement after three
/// quarters of it (`statement_timeout`); such a key's check fails with
/// [`StoreError::KeyBusy`], which the circuit breaker does not count.
/// Locks met on three keys or more within twice the timeout (the table's:
/// an index built without `CONCURRENTLY` or a `LOCK TABLE … EXCLUSIVE`,
/// which stop writes), or by a read (`ALTER TABLE`, `LOCK TABLE`, which
/// stop reads too), fail as the store failing. A decision dropped
/// mid-statement (its timeout) cancels the statement on the server and
/// never returns its session to the pool.
///
/// TLS follows libpq's `sslmode` (`disable`, `prefer` by default,
/// `require`, `verify-ca`, `verify-full`) and `sslrootcert` (a PEM file of
/// roots) in the connection string, through rustls.
///
/// ```no_run
/// use tower_redis_ratelimit::{Limiter, Policy, PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://app@localhost/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem").await?;
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
    pool_size: u32,
    /// Sessions being opened now, by the pool or apart from it.
    opening: Arc<AtomicU32>,
    /// While a caller that found the pool empty opens a session itself.
    opening_ahead: AtomicBool,
    /// Keys whose rows were found locked lately.
    busy: Busy,
    /// The statements, written for the table.
    sql: Arc<Sql>,
    /// The clock decisions are taken on; `None`: the database's.
    clock: Option<Arc<dyn Clock>>,
    /// The rows and the database's clock as this process last saw them.
    seen: Seen,
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

impl PostgresStore {
    /// Connect to the database at `url` (`postgres://user:password@host/db`,
    /// or key=value settings), keeping the states in [`DEFAULT_TABLE`],
    /// made when missing.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    /// A builder for a store with other settings.
    pub fn builder(url: &str) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(url)
    }

    /// Run `f` on the state of `key` at the decision's time and write the
    /// state it leaves, within the store's timeout.
    async fn update<T>(
        &self,
        key: &str,
        f: impl FnMut(&mut KeyState, Duration) -> T,
    ) -> Result<T, StoreError> {
        let timeout = self.inner.timeout;
        let (out, now) = match tokio::time::timeout(timeout, self.decide(key, f)).await {
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
        // Within the store's timeout, as a decision: a session that does
        // not answer is dropped (and its statement cancelled), not held.
        let _ = tokio::time::timeout(self.inner.timeout, async {
            if let Ok(mut session) = self.session().await {
                let _ = session.clean_up(&self.inner.sql, micros).await;
            }
        })
        .await;
    }

    /// `f` run on the state of `key`, its outcome written if the row is
    /// still as `f` saw it: the outcome, and the decision's time.
    async fn decide<T>(
        &self,
        key: &str,
        mut f: impl FnMut(&mut KeyState, Duration) -> T,
    ) -> Result<(T, Duration), StoreError> {
        let key = bounded_key(key);
        let key = key.as_bytes();
        let outcome = self.decide_on(key, &mut f).await;
        if outcome.is_err() {
            self.inner.seen.saw(key, None);
        }
        outcome
    }

    async fn decide_on<T>(
        &self,
        key: &[u8],
        f: &mut impl FnMut(&mut KeyState, Duration) -> T,
    ) -> Result<(T, Duration), StoreError> {
        let seen = &self.inner.seen;
        let mut session = self.session().await?;
        // The row to decide on and the time, and whether the row is as
        // read (else as this process last saw it, to be written only if it
        // is still so).
        let mut basis = match seen.row(key) {
            Some(row) if seen.guessing() => self.estimated_now().map(|now| (Some(row), now, false)),
            _ => None,
        };
        let mut lost = 0;
        loop {
            let (row, now, read) = match basis.take() {
                Some(basis) => basis,
                // Lost to other writers too often: the row's lock, taken
                // in turn, decides who writes next.
                None if lost >= LOST_RACES_BEFORE_LOCKING => {
                    return self.decide_locked(&mut session, key, f).await;
                }
                None => {
                    let row = self.read(&mut session, key, false).await?;
                    (row.state, self.now_of(row.now), true)
                }
            };
            let (mut state, old) = self.state_of(row, now)?;
            let before = state.to_bytes();
            let out = f(&mut state, now);
            match self
                .write(&mut session, key, old, &before, &state, now)
                .await
            {
                Ok(Written::Done) => {
                    if !read {
                        seen.guessed(true);
                    }
                    return Ok((out, now));
                }
                // Nothing changed on a row only seen: the row is read, and
                // the decision taken again on it.
                Ok(Written::Unchanged) if !read => {}
                Ok(Written::Unchanged) => return Ok((out, now)),
                // Another process changed the row since it was read or
                // seen: decide again on the row as it is, read.
                Ok(Written::Lost) => {
                    if read {
                        lost += 1;
                    } else {
                        seen.guessed(false);
                    }
                }
                Err(error) => return Err(self.failure(key, error, true)),
            }
        }
    }

    /// `f` run on the state of `key` in a transaction holding its row's
    /// lock: for a key other processes write as fast as this one, where
    /// compare-and-set would lose race after race.
    async fn decide_locked<T>(
        &self,
        session: &mut Session,
        key: &[u8],
        f: &mut impl FnMut(&mut KeyState, Duration) -> T,
    ) -> Result<(T, Duration), StoreError> {
        session
            .simple("BEGIN")
            .await
            .map_err(|e| self.failure(key, e, false))?;
        let decided = async {
            loop {
                let row = self.read(session, key, true).await?;
                let now = self.now_of(row.now);
                let (mut state, old) = self.state_of(row.state, now)?;
                let before = state.to_bytes();
                let out = f(&mut state, now);
                let written = self.write(session, key, old, &before, &state, now).await;
                match written.map_err(|e| self.failure(key, e, true))? {
                    Written::Done | Written::Unchanged => return Ok((out, now)),
                    // A new key made by another process meanwhile: its row
                    // is locked at the next read.
                    Written::Lost => {}
                }
            }
        }
        .await;
        let end = if decided.is_ok() {
            "COMMIT"
        } else {
            "ROLLBACK"
        };
        session
            .simple(end)
            .await
            .map_err(|e| self.failure(key, e, true))?;
        decided
    }

    /// The row of `key` read on `session` (`locked`: its lock taken, which
    /// may wait for another session's, as a write does), seen.
    async fn read(
        &self,
        session: &mut Session,
        key: &[u8],
        locked: bool,
    ) -> Result<session::Row, StoreError> {
        let row = session
            .read(key, locked)
            .await
            .map_err(|e| self.failure(key, e, locked))?
            .ok_or_else(|| {
                StoreError::UnexpectedReply("PostgresStore: the read returned no row".to_owned())
            })?;
        self.inner
            .seen
            .saw(key, row.state.as_ref().map(|(s, d)| (s.as_slice(), *d)));
        Ok(row)
    }

    /// Write `state`, which `f` left from `before`, over the row `old` of
    /// `key` (none: no row), unless nothing changed.
    async fn write(
        &self,
        session: &mut Session,
        key: &[u8],
        old: Option<SeenRow>,
        before: &[u8],
        state: &KeyState,
        now: Duration,
    ) -> Result<Written, tokio_postgres::Error> {
        let seen = &self.inner.seen;
        let expires_at = state.expires_at();
        if expires_at <= now {
            // A state that no longer matters: no row.
            let Some((old, _)) = old else {
                return Ok(Written::Unchanged);
            };
            if !session.delete(key, &old).await? {
                return Ok(Written::Lost);
            }
            seen.saw(key, None);
            return Ok(Written::Done);
        }
        let after = state.to_bytes();
        if after == before {
            return Ok(Written::Unchanged);
        }
        let micros = i64::try_from(expires_at.as_micros()).unwrap_or(i64::MAX);
        let deletable = deletable_at(micros);
        let written = match &old {
            None => session.insert(key, &after, deletable).await?,
            Some((old, _)) => session.update(key, old, &after, deletable).await?,
        };
        if !written {
            return Ok(Written::Lost);
        }
        seen.saw(key, Some((&after, deletable)));
        Ok(Written::Done)
    }

    /// The store's error for `error` of a statement on `key`. A lock given
    /// up on is [`StoreError::KeyBusy`] when it is a row's (`row`: the
    /// statement writes a row) and few keys are busy at once; a read that
    /// waits for a lock, or locks on many keys at once, is the table's
    /// (`CREATE INDEX`, `ALTER TABLE`, `LOCK`): a failure of the store.
    fn failure(&self, key: &[u8], error: tokio_postgres::Error, row: bool) -> StoreError {
        let busy = error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE);
        if busy && row && !self.inner.busy.many(key) {
            return StoreError::KeyBusy(Box::new(error));
        }
        StoreError::backend("postgres", error)
    }

    /// The decision's time from the database's reading `micros` (µs), on
    /// the store's clock when it has one.
    fn now_of(&self, micros: i64) -> Duration {
        self.inner.seen.read_clock(micros);
        match &self.inner.clock {
            Some(clock) => clock.now(),
            None => Duration::from_micros(u64::try_from(micros).unwrap_or(0)),
        }
    }

    /// The decision's time without asking the database: the store's clock,
    /// or the database's estimated from its latest reading.
    fn estimated_now(&self) -> Option<Duration> {
        match &self.inner.clock {
            Some(clock) => Some(clock.now()),
            None => self.inner.seen.clock(),
        }
    }

    /// The state a read row holds at `now` (a fresh one once expired), and
    /// the row's bytes as read, to write over.
    fn state_of(
        &self,
        row: Option<SeenRow>,
        now: Duration,
    ) -> Result<(KeyState, Option<SeenRow>), StoreError> {
        let Some((bytes, deletable_at)) = row else {
            return Ok((KeyState::new(), None));
        };
        let deletable = u128::try_from(deletable_at).unwrap_or(0) <= now.as_micros();
        let state = if deletable || bytes.is_empty() {
            KeyState::new()
        } else {
            let state =
                KeyState::from_bytes(&bytes).map_err(|e| StoreError::backend("postgres", e))?;
            if state.expires_at() <= now {
                KeyState::new()
            } else {
                state
            }
        };
        Ok((state, Some((bytes, deletable_at))))
    }

    /// A session from the pool whose connection is open as far as it
    /// knows: those a server closed while they sat in the pool (a restart,
    /// a terminated backend) are dropped, as many as the pool holds.
    async fn session(&self) -> Result<PooledConnection<'_, Manager>, StoreError> {
        for _ in 0..=self.inner.pool_size {
            let mut session = self.pooled().await?;
            if session.is_open() {
                return Ok(session);
            }
        }
        Err(StoreError::UnexpectedReply(
            "PostgresStore: every session of the pool was closed by the server".to_owned(),
        ))
    }

    /// A session from the pool. With none idle, room for more than the
    /// sessions open and being opened, and no other caller opening one,
    /// one is opened here first and put in the pool: a database that
    /// refuses connections fails the decision at once, with its error (the
    /// pool would wait out its timeout, and tell only that). Every other
    /// caller waits for the pool, which opens at most as many as it has
    /// room for.
    async fn pooled(&self) -> Result<PooledConnection<'_, Manager>, StoreError> {
        let inner = &*self.inner;
        let state = inner.pool.state();
        let opening = inner.opening.load(Ordering::Acquire);
        if state.idle_connections == 0
            && state.connections + opening < inner.pool_size
            && inner
                .opening_ahead
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            // Given back however the open ends, a drop on the timeout too.
            struct Ahead<'a>(&'a AtomicBool);
            impl Drop for Ahead<'_> {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let ahead = Ahead(&inner.opening_ahead);
            let opened = inner.pool.dedicated_connection().await;
            drop(ahead);
            // A full pool (the pool's own session came first) drops it.
            let _ = inner.pool.add(opened.map_err(postgres)?);
        }
        inner.pool.get().await.map_err(pool_error)
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

/// What a decision's write found.
enum Written {
    /// The row was written as the decision left it (or deleted).
    Done,
    /// The decision changed nothing: nothing to write.
    Unchanged,
    /// The row was not as the decision saw it: another process wrote it.
    Lost,
}

/// How many races to other writers a decision loses before it takes its
/// row's lock and waits its turn.
const LOST_RACES_BEFORE_LOCKING: u32 = 3;

/// A failure of the database.
fn postgres(error: tokio_postgres::Error) -> StoreError {
    StoreError::backend("postgres", error)
}

fn pool_error(error: RunError<tokio_postgres::Error>) -> StoreError {
    match error {
        RunError::User(error) => postgres(error),
        RunError::TimedOut => StoreError::PoolTimeout,
    }
}
