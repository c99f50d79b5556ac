//! One session of a [`PostgresStore`](super::PostgresStore) with the
//! database: its statements prepared once, and a mark that keeps a session
//! with a statement still running out of the pool.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, Statement};

use super::statements::Sql;
use super::tls::Tls;

/// A session of the store's pool.
///
/// Every statement runs through [`Session::run`], which marks the session
/// busy until the statement's answer is read. A decision dropped on its
/// timeout leaves the mark: the pool drops the session rather than lend it
/// with a statement queued on it (the next decision would wait behind the
/// lock that statement waits for), and the statement is cancelled on the
/// server.
pub(super) struct Session {
    client: Client,
    prepared: Prepared,
    busy: bool,
    cancel: CancelToken,
    tls: Tls,
}

/// The statements of a decision, prepared on the session.
struct Prepared {
    read: Statement,
    insert: Statement,
    update: Statement,
    delete: Statement,
}

/// A key's row as read: the database's time (µs since the epoch), and the
/// row's state and when it may be deleted, if there is a row.
pub(super) struct Row {
    pub(super) now: i64,
    pub(super) state: Option<(Vec<u8>, i64)>,
}

impl Session {
    /// A session on `client`, its statements prepared.
    pub(super) async fn new(
        client: Client,
        sql: &Sql,
        tls: Tls,
    ) -> Result<Self, tokio_postgres::Error> {
        use Type as T;
        let prepared = Prepared {
            read: client.prepare_typed(&sql.read, &[T::BYTEA]).await?,
            insert: client
                .prepare_typed(&sql.insert, &[T::BYTEA, T::BYTEA, T::INT8])
                .await?,
            update: client
                .prepare_typed(&sql.update, &[T::BYTEA, T::BYTEA, T::INT8, T::BYTEA])
                .await?,
            delete: client
                .prepare_typed(&sql.delete, &[T::BYTEA, T::BYTEA])
                .await?,
        };
        let cancel = client.cancel_token();
        Ok(Self {
            client,
            prepared,
            busy: false,
            cancel,
            tls,
        })
    }

    /// The row of `key`, and the database's time.
    pub(super) async fn read(&mut self, key: &[u8]) -> Result<Row, tokio_postgres::Error> {
        let statement = self.prepared.read.clone();
        let params: [&(dyn ToSql + Sync); 1] = [&key];
        let rows = self.run(|c| c.query(&statement, &params)).await?;
        let Some(row) = rows.first() else {
            return Ok(Row { now: 0, state: None });
        };
        let now: i64 = row.try_get(0)?;
        let state: Option<Vec<u8>> = row.try_get(1)?;
        let expires_at: Option<i64> = row.try_get(2)?;
        Ok(Row {
            now,
            state: state.zip(expires_at),
        })
    }

    /// Write `state` as the row of `key` if the row is still `old` (made,
    /// when `old` is `None`): whether it was.
    pub(super) async fn write(
        &mut self,
        key: &[u8],
        old: Option<&[u8]>,
        state: &[u8],
        expires_at: i64,
    ) -> Result<bool, tokio_postgres::Error> {
        let written = match old {
            None => {
                let statement = self.prepared.insert.clone();
                let params: [&(dyn ToSql + Sync); 3] = [&key, &state, &expires_at];
                self.run(|c| c.execute(&statement, &params)).await?
            }
            Some(old) => {
                let statement = self.prepared.update.clone();
                let params: [&(dyn ToSql + Sync); 4] = [&key, &state, &expires_at, &old];
                self.run(|c| c.execute(&statement, &params)).await?
            }
        };
        Ok(written == 1)
    }

    /// Delete the row of `key` if it is still `old`: whether it was.
    pub(super) async fn delete(
        &mut self,
        key: &[u8],
        old: &[u8],
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.delete.clone();
        let params: [&(dyn ToSql + Sync); 2] = [&key, &old];
        Ok(self.run(|c| c.execute(&statement, &params)).await? == 1)
    }

    /// Delete a bounded batch of rows expired by `micros`.
    pub(super) async fn clean_up(
        &mut self,
        sql: &Sql,
        micros: i64,
    ) -> Result<(), tokio_postgres::Error> {
        let cleanup = sql.cleanup.as_str();
        self.run(|c| async move {
            c.query_typed(cleanup, &[(&micros, Type::INT8)])
                .await
                .map(drop)
        })
        .await
    }

    /// `statement` run on the session, marked busy until it has answered.
    async fn run<'a, T, F>(
        &'a mut self,
        statement: impl FnOnce(&'a Client) -> F,
    ) -> Result<T, tokio_postgres::Error>
    where
        F: Future<Output = Result<T, tokio_postgres::Error>> + 'a,
    {
        self.busy = true;
        let busy = &mut self.busy;
        let answer = statement(&self.client).await;
        *busy = false;
        answer
    }

    /// Whether the pool must drop the session: a statement is still
    /// running on it, or its connection is closed.
    pub(super) fn is_broken(&self) -> bool {
        self.busy || self.client.is_closed()
    }
}

impl Drop for Session {
    /// A session dropped while its statement runs (a decision timed out):
    /// the statement is cancelled on the server, so that it stops waiting
    /// for a lock or holding one.
    fn drop(&mut self) {
        if self.busy
            && !self.client.is_closed()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (cancel, tls) = (self.cancel.clone(), self.tls.clone());
            runtime.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    cancel.cancel_query(tls),
                )
                .await;
            });
        }
    }
}

/// Opens the pool's sessions.
pub(super) struct Manager {
    pub(super) config: tokio_postgres::Config,
    pub(super) tls: Tls,
    pub(super) sql: Arc<Sql>,
}

impl Manager {
    /// A connection, its I/O driven by a task of its own.
    pub(super) async fn open(&self) -> Result<Client, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(self.tls.clone()).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Session;
    type Error = tokio_postgres::Error;

    async fn connect(&self) -> Result<Session, tokio_postgres::Error> {
        Session::new(self.open().await?, &self.sql, self.tls.clone()).await
    }

    async fn is_valid(&self, session: &mut Session) -> Result<(), tokio_postgres::Error> {
        session
            .run(|c| async move { c.simple_query("").await.map(drop) })
            .await
    }

    fn has_broken(&self, session: &mut Session) -> bool {
        session.is_broken()
    }
}
