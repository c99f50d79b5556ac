//! One session of a [`PostgresStore`](super::PostgresStore) with the
//! database: its statements prepared once, and a mark that keeps a session
//! with a statement still running out of the pool.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio_postgres::error::Severity;
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

type Driven = Connection<Socket, <Tls as MakeTlsConnect<Socket>>::Stream>;

/// A connection, its I/O driven by the task that runs a statement on it
/// (no task of its own: a round trip wakes one task, not two).
pub(super) struct Link {
    client: Client,
    /// `None` once it ended (closed, failed, or told by the server that
    /// the session is over): dropped, so that a statement sent to it fails
    /// as closed.
    connection: Option<Driven>,
    /// Why the connection ended, when it said: told rather than "closed".
    ended_with: Option<tokio_postgres::Error>,
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
            ended_with: None,
            busy: false,
            cancel,
            tls: tls.clone(),
        })
    }

    /// Whether the connection is open, as far as what it has received
    /// tells (a server that closed it while it sat in the pool, after a
    /// restart or a terminated backend, has said so by now): read without
    /// waiting, before anything is sent on it.
    pub(super) fn is_open(&mut self) -> bool {
        let mut context = Context::from_waker(Waker::noop());
        self.drive(&mut context);
        self.connection.is_some() && !self.client.is_closed()
    }

    /// Poll the connection: what it has to send goes out, what it received
    /// is read; once it ends, it is dropped.
    fn drive(&mut self, context: &mut Context<'_>) {
        if let Some(open) = &mut self.connection
            && let Poll::Ready(ended) = Pin::new(open).poll(context)
        {
            self.connection = None;
            self.ended_with = ended.err();
        }
    }

    /// `statement` run on the connection, the session marked busy until
    /// it has answered. The connection's I/O is driven meanwhile; once it
    /// ends, the statement fails with the connection's error.
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
            ended_with,
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
                && let Poll::Ready(ended) = Pin::new(open).poll(cx)
            {
                *connection = None;
                *ended_with = ended.err();
            }
            // What the connection read may have answered the statement (or
            // its end failed it).
            statement.as_mut().poll(cx)
        })
        .await;
        *busy = false;
        match answer {
            Ok(answer) => Ok(answer),
            Err(error) => {
                // An error that ends the session (the server's FATAL, as
                // when an operator terminates it; a broken connection)
                // leaves it unusable, though its connection may not have
                // been read to its end yet.
                let fatal = error.as_db_error().is_none_or(|db| {
                    matches!(
                        db.parsed_severity(),
                        Some(Severity::Fatal | Severity::Panic) | None
                    )
                });
                if fatal {
                    *connection = None;
                }
                match ended_with.take() {
                    Some(reason) if error.is_closed() => Err(reason),
                    _ => Err(error),
                }
            }
        }
    }

    /// Whether the pool must drop the session: a statement is still
    /// running on it, or its connection ended.
    fn is_broken(&self) -> bool {
        self.busy || self.connection.is_none() || self.client.is_closed()
    }
}

impl Drop for Link {
    /// A session dropped while its statement runs (a decision timed out)
    /// has the statement cancelled on the server, so that it stops waiting
    /// for a lock or holding one. Any session dropped with its connection
    /// open says goodbye (PostgreSQL's Terminate) rather than vanish.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(connection) = self.connection.take() else {
            return;
        };
        if self.busy {
            let (cancel, tls) = (self.cancel.clone(), self.tls.clone());
            runtime.spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(5), cancel.cancel_query(tls)).await;
            });
        }
        // The client goes right after this: the connection then sends
        // Terminate and ends.
        runtime.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), connection).await;
        });
    }
}

/// The statements of a decision, prepared on the session.
struct Prepared {
    read: Statement,
    read_locked: Statement,
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
        let mut prepare =
            async |sql: &str, types: &[Type]| link.run(|c| c.prepare_typed(sql, types)).await;
        let prepared = Prepared {
            read: prepare(&sql.read, &[T::BYTEA]).await?,
            read_locked: prepare(&sql.read_locked, &[T::BYTEA]).await?,
            insert: prepare(&sql.insert, &[T::BYTEA, T::BYTEA, T::INT8]).await?,
            update: prepare(&sql.update, &[T::BYTEA, T::BYTEA, T::INT8, T::BYTEA]).await?,
            delete: prepare(&sql.delete, &[T::BYTEA, T::BYTEA]).await?,
        };
        Ok(Self { link, prepared })
    }

    /// Whether the session's connection is open as far as it knows: see
    /// [`Link::is_open`].
    pub(super) fn is_open(&mut self) -> bool {
        self.link.is_open()
    }

    /// The row of `key`, and the database's time; `locked`: in a
    /// transaction, the row locked until it ends.
    pub(super) async fn read(
        &mut self,
        key: &[u8],
        locked: bool,
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        let statement = if locked {
            self.prepared.read_locked.clone()
        } else {
            self.prepared.read.clone()
        };
        let params: [&(dyn ToSql + Sync); 1] = [&key];
        let rows = self.link.run(|c| c.query(&statement, &params)).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let now: i64 = row.try_get(0)?;
        let state: Option<Vec<u8>> = row.try_get(1)?;
        let deletable_at: Option<i64> = row.try_get(2)?;
        Ok(Some(Row {
            now,
            state: state.zip(deletable_at),
        }))
    }

    /// Make the row of `key` unless there is one: whether it was made.
    pub(super) async fn insert(
        &mut self,
        key: &[u8],
        state: &[u8],
        deletable_at: i64,
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.insert.clone();
        self.execute(&statement, &[&key, &state, &deletable_at])
            .await
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
        self.execute(&statement, &[&key, &state, &deletable_at, &old])
            .await
    }

    /// Delete the row of `key` if it is still `old`: whether it was.
    pub(super) async fn delete(
        &mut self,
        key: &[u8],
        old: &[u8],
    ) -> Result<bool, tokio_postgres::Error> {
        let statement = self.prepared.delete.clone();
        self.execute(&statement, &[&key, &old]).await
    }

    /// `statement` run with `params`: whether it changed one row.
    async fn execute(
        &mut self,
        statement: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<bool, tokio_postgres::Error> {
        Ok(self.link.run(|c| c.execute(statement, params)).await? == 1)
    }

    /// Run `sql` (no parameters, no rows: `BEGIN`, `COMMIT`).
    pub(super) async fn simple(&mut self, sql: &str) -> Result<(), tokio_postgres::Error> {
        self.link.run(|c| c.batch_execute(sql)).await
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

/// Opens the pool's sessions, and counts those being opened.
pub(super) struct Manager {
    pub(super) config: tokio_postgres::Config,
    pub(super) tls: Tls,
    pub(super) sql: Arc<Sql>,
    /// Sessions being opened now, by the pool or apart from it.
    pub(super) opening: Arc<AtomicU32>,
}

impl bb8::ManageConnection for Manager {
    type Connection = Session;
    type Error = tokio_postgres::Error;

    async fn connect(&self) -> Result<Session, tokio_postgres::Error> {
        // Counted until it ends, on a drop by a timeout too.
        struct Opening<'a>(&'a AtomicU32);
        impl Drop for Opening<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.opening.fetch_add(1, Ordering::AcqRel);
        let _opening = Opening(&self.opening);
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
