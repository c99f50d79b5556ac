//! [`PostgresStoreBuilder`]: a [`PostgresStore`]'s settings, and the
//! connecting that makes it (the table made when missing, the first
//! session, the pool).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::time::Duration;

use bb8::Pool;

use super::busy::Busy;
use super::seen::Seen;
use super::session::{Link, Manager, Session};
use super::statements::Sql;
use super::{
    DEFAULT_SEEN_BYTES, DEFAULT_TABLE, DEFAULT_TIMEOUT, Inner, PostgresStore, postgres, tls,
};
use crate::clock::Clock;
use crate::store::StoreError;

/// Builds a [`PostgresStore`] with settings other than the defaults.
#[must_use]
pub struct PostgresStoreBuilder {
    url: String,
    table: String,
    pool_size: u32,
    timeout: Duration,
    synchronous_commit: Option<bool>,
    seen_bytes: usize,
    clock: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for PostgresStoreBuilder {
    // Not the URL: it may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("synchronous_commit", &self.synchronous_commit)
            .field("seen_bytes", &self.seen_bytes)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    /// The defaults, connecting to `url`.
    pub(super) fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            pool_size: 10,
            timeout: DEFAULT_TIMEOUT,
            synchronous_commit: None,
            seen_bytes: DEFAULT_SEEN_BYTES,
            clock: None,
        }
    }

    /// The table the states are kept in (made when missing): a plain SQL
    /// name, letters, digits and `_`, not starting with a digit, at most 52
    /// bytes (its index adds `_expires_at`). [`DEFAULT_TABLE`]
    /// by default.
    pub fn table(mut self, table: &str) -> Self {
        table.clone_into(&mut self.table);
        self
    }

    /// Connections in the pool (10 by default). However many callers find
    /// the pool empty at once, at most this many connections and one more
    /// are opened.
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections.max(1);
        self
    }

    /// The longest one decision may take ([`DEFAULT_TIMEOUT`]). The
    /// sessions' `lock_timeout` is half of it, their `statement_timeout`
    /// three quarters.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Whether a write waits until PostgreSQL has it on disk (`true`) or
    /// only in memory (`false`): the sessions' `synchronous_commit`, `on`
    /// or `off`. Unset, the server's or the user's setting holds (`on`
    /// unless changed). Off, a crash of PostgreSQL (not of this process)
    /// may lose the counts of the last few hundred milliseconds (at most
    /// three times the server's `wal_writer_delay`, 200 ms by default), as
    /// Redis with `appendfsync everysec` may lose the last second; nothing
    /// is ever counted twice or corrupted. BENCHMARKS.md gives the speed of
    /// both.
    pub fn synchronous_commit(mut self, on: bool) -> Self {
        self.synchronous_commit = Some(on);
        self
    }

    /// How many bytes of keys' rows this process keeps as it last saw them
    /// ([`DEFAULT_SEEN_BYTES`]; 0 keeps none). A decision on a key kept is
    /// written in one round trip when no other process wrote the key
    /// since, and in three otherwise (the write that finds the row
    /// changed, a read and a write); a key not kept takes two, a read and
    /// a write. While more than a quarter of these guesses miss, the store
    /// reads first. Each key costs its bytes, its state's and about 128
    /// more.
    pub fn seen_bytes(mut self, bytes: usize) -> Self {
        self.seen_bytes = bytes;
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
        let (mut config, tls) = tls::configure(&self.url)?;
        config.options(session_options(
            config.get_options(),
            self.timeout,
            self.synchronous_commit,
        ));
        let sql = Arc::new(Sql::new(table));
        let opening = Arc::new(AtomicU32::new(0));
        let manager = Manager {
            config,
            tls: tls.clone(),
            sql: Arc::clone(&sql),
            opening: Arc::clone(&opening),
        };
        // The first connection opened here: a wrong address, user or
        // password is told as the database says it.
        let mut link = Link::open(&manager.config, &tls).await.map_err(postgres)?;
        // Made only when missing: a user with no right to create tables
        // uses a table made for it.
        let quoted = format!("\"{table}\"");
        let found = link
            .run(|c| async move {
                let row = c
                    .query_one("SELECT to_regclass($1) IS NOT NULL", &[&quoted])
                    .await?;
                row.try_get::<_, bool>(0)
            })
            .await
            .map_err(postgres)?;
        if !found {
            let schema = sql.schema();
            link.run(|c| c.batch_execute(&schema))
                .await
                .map_err(postgres)?;
        }
        let first = Session::new(link, &sql).await.map_err(postgres)?;
        // No test query at each checkout (a round trip more per decision):
        // a connection the server closed is known closed, and dropped.
        // The session used last first: one decision at a time keeps one
        // backend busy (its caches warm, no other process woken), rather
        // than wake each of the pool's backends in turn.
        let pool = Pool::builder()
            .max_size(self.pool_size)
            .queue_strategy(bb8::QueueStrategy::Lifo)
            .test_on_check_out(false)
            .retry_connection(false)
            .connection_timeout(self.timeout)
            .build_unchecked(manager);
        // Into the pool, as its first connection.
        let _ = pool.add(first);
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                pool_size: self.pool_size,
                opening,
                opening_ahead: AtomicBool::new(false),
                busy: Busy::new(self.timeout.saturating_mul(2)),
                sql,
                clock: self.clock,
                seen: Seen::new(self.seen_bytes),
                timeout: self.timeout,
                writes: AtomicU64::new(0),
            }),
        })
    }
}

/// The sessions' settings (the startup packet's `options`, after any the
/// connection string gives): `lock_timeout` half the store's timeout,
/// `statement_timeout` three quarters, so that PostgreSQL gives up on a
/// stuck row before the store gives up on the decision; and
/// `synchronous_commit`.
fn session_options(
    given: Option<&str>,
    timeout: Duration,
    synchronous_commit: Option<bool>,
) -> String {
    // Whole milliseconds, at least 1 (0 would mean none); past PostgreSQL's
    // range, none.
    let millis = |d: Duration| match u32::try_from(d.as_millis().max(1)) {
        Ok(ms) if ms <= i32::MAX as u32 => ms,
        _ => 0,
    };
    let mut options = given.map(str::to_owned).unwrap_or_default();
    if !options.is_empty() {
        options.push(' ');
    }
    options.push_str(&format!(
        "-c lock_timeout={} -c statement_timeout={}",
        millis(timeout / 2),
        millis(timeout / 4 * 3),
    ));
    match synchronous_commit {
        Some(true) => options.push_str(" -c synchronous_commit=on"),
        Some(false) => options.push_str(" -c synchronous_commit=off"),
        None => {}
    }
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_give_up_on_a_lock_before_the_store_gives_up_on_the_decision() {
        assert_eq!(
            session_options(None, Duration::from_secs(1), None),
            "-c lock_timeout=500 -c statement_timeout=750"
        );
        assert_eq!(
            session_options(
                Some("-c search_path=app"),
                Duration::from_millis(200),
                Some(false)
            ),
            "-c search_path=app -c lock_timeout=100 -c statement_timeout=150 \
             -c synchronous_commit=off"
        );
        // Past PostgreSQL's range: no bound (0), rather than a wrong one.
        assert_eq!(
            session_options(None, Duration::MAX, Some(true)),
            "-c lock_timeout=0 -c statement_timeout=0 -c synchronous_commit=on"
        );
    }
}
