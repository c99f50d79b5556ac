//! One session of a [`PostgresStore`](super::PostgresStore) with the
//! database: its statements prepared once, and a mark that keeps a session
//! with a statement still running out of the pool.

use std::sync::Arc;
use std::time::Duration;

use std::pin::Pin;
use std::task::Poll;

use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, Connection, Socket, Statement};

use super::statements::Sql;
use super::tls::Tls;

/// A session of the store's pool.
///
/// Every statement runs through [`Link::run`], which marks the session
/// busy until the statement's answer is read. A decision dropped on its
/// timeout leaves the mark: the pool drops the session rather than lend it
/// with a statement queued on it (the next decision would wait behind the
/// lock that statement waits for), and the statement is cancelled on the
/// server.
pub(super) struct Session {
    link: Link,
    prepared: Prepared,
}

/// A connection, its I/O driven by the task that runs a statement on it
/// (no task of its own: a round trip wakes one task, not two).
pub(super) struct Link {
    client: Client,
    /// `None` once it ended (closed, failed, or told by the server that
    /// the session is over): dropped, so that a statement sent to it fails
    /// as closed.
    connection: Option<Connection<Socket, <Tls as MakeTlsConnect<Socket>>::Stream>>,
    busy: bool,
    cancel: CancelToken,
    tls: Tls,
}

impl Link {
    /// A connection to the database of `config`.
    pub(super) async fn open(
        config: &tokio_postgres::Config,
        tls: &Tls,
    ) -> Result<Self, tokio_postgres::Error> {
        let (client, connection) = config.connect(tls.clone()).await?;
        let cancel = client.cancel_token();
        Ok(Self {
            client,
            connection: Some(connection),
            busy: false,
            cancel,
            tls: tls.clone(),
        })
    }

    /// `statement` run on the connection, the session marked busy until
    /// it has answered. The connection's I/O is driven meanwhile; once it
    /// ends, the statement fails as closed.
    pub(super) async fn run<'a, T, F>(
        &'a mut self,
        statement: impl FnOnce(&'a Client) -> F,
    ) -> Result<T, tokio_postgres::Error>
    where
        F: Future<Output = Result<T, tokio_postgres::Error>> + 'a,
    {
        let Self {
            client,
            connection,
            busy,
            ..
        } = self;
        *busy = true;
        let mut statement = std::pin::pin!(statement(client));
        let answer = std::future::poll_fn(|cx| {
            if let Poll::Ready(answer) = statement.as_mut().poll(cx) {
                return Poll::Ready(answer);
            }
            if let Some(open) = connection
                && Pin::new(open).poll(cx).is_ready()
            {
                *connection = None;
            }
            // What the connection read may have answered the statement (or
            // its end failed it).
            statement.as_mut().poll(cx)
        })
        .await;
        *busy = false;
        // An error that ends the session (the server's FATAL, as when an
        // operator terminates it; a broken connection) leaves it unusable,
        // though its connection has not been read to its end yet.
        if let Err(error) = &answer
            && error
                .as_db_error()
                .is_none_or(|db| matches!(db.severity(), "FATAL" | "PANIC"))
        {
            *connection = None;
        }
        answer
    }

    /// Whether the pool must drop the session: a statement is still
    /// running on it, or its connection ended.
    fn is_broken(&self) -> bool {
        self.busy || self.connection.is_none() || self.client.is_closed()
    }
}

impl Drop for Link {
    /// A session dropped while its statement runs (a decision timed out):
    /// the statement is cancelled on the server, so that it stops waiting
    /// for a lock or holding one.
    fn drop(&mut self) {
        if self.busy
            && self.connection.is_some()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (cancel, tls) = (self.cancel.clone(), self.tls.clone());
            runtime.spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), cancel.cancel_query(tls)).await;
            });
        }
    }
}

/// The statements of a decision, prepared on the session.
struct Prepared {
    read: Statement,
    insert: Statement,
    update: Statement,
    delete: Statement,
}

/// A key's row as read: the database's time (µs since the epoch), and the
/// row's state and when it may be deleted (µs), if there is a row.
pub(super) struct Row {
    pub(super) now: i64,
    pub(super) state: Option<(Vec<u8>, i64)>,
}

impl Session {
    /// A session on `link`, its statements prepared.
    pub(super) async fn new(mut link: Link, sql: &Sql) -> Result<Self, tokio_postgres::Error> {
        use Type as T;
        let prepared = Prepared {
            read: link
                .run(|c| c.prepare_typed(&sql.read, &[T::BYTEA]))
                .await?,
            insert: link
                .run(|c| c.prepare_typed(&sql.insert, &[T::BYTEA, T::BYTEA, T::INT8]))
                .await?,
            update: link
                .run(|c| c.prepare_typed(&sql.update, &[T::BYTEA, T::BYTEA, T::INT8, T::BYTEA]))
                .await?,
            delete: link
                .run(|c| c.prepare_typed(&sql.delete, &[T::BYTEA, T::BYTEA]))
                .await?,
        };
        Ok(Self { link, prepared })
    }

    /// The row of `key`, and the database's time.
    pub(super) async fn read(&mut self, key: &[u8]) -> Result<Row, tokio_postgres::Error> {
        let statement = self.prepared.read.clone();
        let params: [&(dyn ToSql + Sync); 1] = [&key];
        let rows = self.link.run(|c| c.query(&statement, &params)).await?;
        match rows.first() {
            Some(row) => {
                let now: i64 = row.try_get(0)?;
                let state: Option<Vec<u8>> = row.try_get(1)?;
                let deletable_at: Option<i64> = row.try_get(2)?;
                Ok(Row {
                    now,
                    state: state.zip(deletable_at),
                })
            }
            None => Ok(Row {
                now: 0,
                state: None,
            }),
        }
    }

    /// Make the row of `key` unless there is one: whether it was made.
    pub(super) async fn insert(
        &mut self,
        key: &[u8],
        state: &[u8],
        deletable_at: i64,
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.insert.clone();
        let params: [&(dyn ToSql + Sync); 3] = [&key, &state, &deletable_at];
        Ok(self.link.run(|c| c.execute(&statement, &params)).await? == 1)
    }

    /// Write `state` as the row of `key` if the row is still `old`:
    /// whether it was.
    pub(super) async fn update(
        &mut self,
        key: &[u8],
        old: &[u8],
        state: &[u8],
        deletable_at: i64,
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.update.clone();
        let params: [&(dyn ToSql + Sync); 4] = [&key, &state, &deletable_at, &old];
        Ok(self.link.run(|c| c.execute(&statement, &params)).await? == 1)
    }

    /// Delete the row of `key` if it is still `old`: whether it was.
    pub(super) async fn delete(
        &mut self,
        key: &[u8],
        old: &[u8],
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.delete.clone();
        let params: [&(dyn ToSql + Sync); 2] = [&key, &old];
        Ok(self.link.run(|c| c.execute(&statement, &params)).await? == 1)
    }

    /// Delete a bounded batch of rows expired by `micros`.
    pub(super) async fn clean_up(
        &mut self,
        sql: &Sql,
        micros: i64,
    ) -> Result<(), tokio_postgres::Error> {
        let cleanup = sql.cleanup.as_str();
        self.link
            .run(|c| async move {
                c.query_typed(cleanup, &[(&micros, Type::INT8)])
                    .await
                    .map(drop)
            })
            .await
    }

    /// Whether the pool must drop the session.
    pub(super) fn is_broken(&self) -> bool {
        self.link.is_broken()
    }
}

/// Opens the pool's sessions.
pub(super) struct Manager {
    pub(super) config: tokio_postgres::Config,
    pub(super) tls: Tls,
    pub(super) sql: Arc<Sql>,
}

impl bb8::ManageConnection for Manager {
    type Connection = Session;
    type Error = tokio_postgres::Error;

    async fn connect(&self) -> Result<Session, tokio_postgres::Error> {
        Session::new(Link::open(&self.config, &self.tls).await?, &self.sql).await
    }

    async fn is_valid(&self, session: &mut Session) -> Result<(), tokio_postgres::Error> {
        session
            .link
            .run(|c| async move { c.simple_query("").await.map(drop) })
            .await
    }

    fn has_broken(&self, session: &mut Session) -> bool {
        session.is_broken()
    }
}
