//! The SQL of one table: its schema and the statements of a decision.

/// How long a row is kept once its state has expired (µs): five minutes.
/// A key used again meanwhile writes its row in place, where a row deleted
/// and made again would cost a delete, an insert and their index entries.
pub(super) const KEPT_EXPIRED: i64 = 5 * 60_000_000;

/// How far a row's deletion time is rounded up (µs): to the minute. The
/// indexed column then changes about once a minute of a key's use, not at
/// every write, so most writes update the row in place (PostgreSQL's
/// heap-only updates: no index entry, less WAL).
pub(super) const DELETE_GRANULE: i64 = 60_000_000;

/// The statements of one table.
pub(super) struct Sql {
    pub(super) table: String,
    /// The database's time (µs since the epoch) and the row of `$1`, if any.
    pub(super) read: String,
    /// As `read`, the row locked until the transaction ends.
    pub(super) read_locked: String,
    /// Make the row of `$1` unless there is one.
    pub(super) insert: String,
    /// Write the row of `$1` if its state is still `$4`.
    pub(super) update: String,
    /// Delete the row of `$1` if its state is still `$2`.
    pub(super) delete: String,
    /// Delete a bounded batch of rows expired by `$1`, skipping rows in use.
    pub(super) cleanup: String,
}

/// At most this many expired rows deleted at once.
const CLEANUP_BATCH: u32 = 256;

impl Sql {
    pub(super) fn new(table: &str) -> Self {
        Self {
            table: table.to_owned(),
            read: format!(
                "SELECT n.now, t.state, t.expires_at FROM \
                 (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now) n \
                 LEFT JOIN \"{table}\" t ON t.key = $1"
            ),
            read_locked: format!(
                "SELECT n.now, t.state, t.expires_at FROM \
                 (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now) n \
                 LEFT JOIN LATERAL (SELECT state, expires_at FROM \"{table}\" \
                 WHERE key = $1 FOR UPDATE) t ON true"
            ),
            insert: format!(
                "INSERT INTO \"{table}\" (key, state, expires_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (key) DO NOTHING"
            ),
            update: format!(
                "UPDATE \"{table}\" SET state = $2, expires_at = $3 WHERE key = $1 AND state = $4"
            ),
            delete: format!("DELETE FROM \"{table}\" WHERE key = $1 AND state = $2"),
            cleanup: format!(
                "DELETE FROM \"{table}\" WHERE key IN (SELECT key FROM \"{table}\" \
                 WHERE expires_at <= $1 LIMIT {CLEANUP_BATCH} FOR UPDATE SKIP LOCKED)"
            ),
        }
    }

    /// The statements that make the table and its index.
    pub(super) fn schema(&self) -> String {
        let table = &self.table;
        // The key as bytes: any key a client sends (a NUL, any encoding).
        // Room left in each page for a row's next version beside it.
        format!(
            "CREATE TABLE IF NOT EXISTS \"{table}\" (key bytea PRIMARY KEY, \
             state bytea NOT NULL, expires_at bigint NOT NULL) WITH (fillfactor = 80); \
             CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON \"{table}\" (expires_at)"
        )
    }
}

/// When a row whose state expires at `micros` may be deleted:
/// [`KEPT_EXPIRED`] later, rounded up to the next [`DELETE_GRANULE`].
pub(super) fn deletable_at(micros: i64) -> i64 {
    micros
        .saturating_add(KEPT_EXPIRED)
        .div_euclid(DELETE_GRANULE)
        .saturating_add(1)
        .saturating_mul(DELETE_GRANULE)
}
