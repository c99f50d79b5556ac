//! Taking a request's entries (or its lease) back out of a sorted set when
//! the request must not count.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;

use super::call::Call;
use super::connection::{Conn, Connections};
use super::errors::is_connection_error;
use crate::store::StoreError;

/// How many times a clean-up in the background tries to remove its entries.
const BACKGROUND_TRIES: u32 = 5;
/// The pause between two of those tries.
const BACKGROUND_PAUSE: Duration = Duration::from_millis(100);

/// Takes the entries (or the lease) of a request that must not count out of
/// its sorted set, unless disarmed: run it, or drop it and it runs in a
/// spawned task.
///
/// It is bound to the connection the request's last attempt went out on (a
/// clone of it), so the `ZREM` reaches Redis after that attempt's commands,
/// even when the request timed out or its future was dropped while waiting.
/// When that connection is broken (nothing of the request can still be in
/// flight on it), the `ZREM` goes out on a fresh connection instead. One
/// guard serves every attempt of a request: an attempt that failed and is
/// retried leaves nothing to clean up behind the retry (its entries are the
/// retry's own).
pub(super) struct Cleanup {
    /// The connection of the request's last attempt (bound as each
    /// attempt goes out, from inside the send loop).
    conn: Mutex<Option<Conn>>,
    connections: Connections,
    key: String,
    members: Vec<String>,
    timeout: Duration,
    armed: bool,
}

impl Cleanup {
    /// A clean-up of `members` of `key`, armed: it runs when dropped unless
    /// disarmed, once it is bound to a connection.
    pub(super) fn new(
        connections: &Connections,
        key: &str,
        members: Vec<String>,
        timeout: Duration,
    ) -> Self {
        Self {
            conn: Mutex::new(None),
            connections: connections.clone(),
            key: key.to_owned(),
            members,
            timeout,
            armed: true,
        }
    }

    /// The request's next attempt goes out on `conn`.
    pub(super) fn bind(&self, conn: &Conn) {
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
    }

    /// The connection it is bound to.
    fn bound(&self) -> Option<Conn> {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The members this guard takes out.
    pub(super) fn members(&self) -> &[String] {
        &self.members
    }

    /// Nothing to take out: the request's outcome is known.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Remove the entries now, waiting at most `budget`; failures are
    /// logged. Cut short (by `budget`, or a dropped future), the guard is
    /// dropped still armed, and the removal goes on in a spawned task.
    pub(super) async fn run(self, budget: Duration) {
        self.run_reading(budget, &[]).await;
    }

    /// [`run`](Self::run), with `reads` sent after the removal in the same
    /// transaction: their replies, or `None` when the removal failed or
    /// was cut short.
    pub(super) async fn run_reading(
        self,
        budget: Duration,
        reads: &[redis::Cmd],
    ) -> Option<Vec<Value>> {
        let conn = self.bound()?;
        let read = match remove(
            conn,
            &self.connections,
            budget,
            &self.key,
            &self.members,
            reads,
        )
        .await
        {
            Ok(replies) => Some(replies),
            Err(StoreError::Timeout(_)) => {
                tracing::debug!("removing a denied request's entry goes on in the background");
                return None;
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    "could not remove a denied request's entry; it counts until its window passes"
                );
                None
            }
        };
        let mut done = self;
        done.armed = false;
        read
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(conn) = self.bound() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let connections = self.connections.clone();
        let key = std::mem::take(&mut self.key);
        let members = std::mem::take(&mut self.members);
        let timeout = self.timeout;
        runtime.spawn(async move {
            // A request that failed must not count: keep trying a while,
            // each try within the store's timeout (a late `ZREM` of entries
            // nobody was admitted for is harmless).
            let mut last = None;
            for attempt in 0..BACKGROUND_TRIES {
                if attempt > 0 {
                    tokio::time::sleep(BACKGROUND_PAUSE).await;
                }
                match remove(conn.clone(), &connections, timeout, &key, &members, &[]).await {
                    Ok(_) => return,
                    Err(error @ StoreError::Timeout(_)) => last = Some(error),
                    Err(error) if !is_connection_error(&error) => {
                        last = Some(error);
                        break;
                    }
                    Err(error) => last = Some(error),
                }
            }
            if let Some(error) = last {
                tracing::warn!(
                    %error,
                    "could not remove an unfinished request's entry; it counts until its window passes"
                );
            }
        });
    }
}

/// `ZREM` the members, within `timeout`: first on `conn` (after the
/// request's own commands), then, should that fail, on fresh connections
/// (removing them twice does what removing them once does). With `reads`,
/// in one transaction with them after the `ZREM`: their replies.
async fn remove(
    conn: Conn,
    connections: &Connections,
    timeout: Duration,
    key: &str,
    members: &[String],
    reads: &[redis::Cmd],
) -> Result<Vec<Value>, StoreError> {
    Call::new(connections, timeout, "clean-up")
        .repeatable(true)
        .first_on(conn)
        .run(|mut conn| async move {
            if reads.is_empty() {
                zrem(conn.get(), key, members).await?;
                return Ok(Vec::new());
            }
            let mut pipe = redis::pipe();
            pipe.atomic();
            pipe.cmd("ZREM").arg(key).arg(members).ignore();
            for read in reads {
                pipe.add_command(read.clone());
            }
            Ok(pipe.query_async(conn.get()).await?)
        })
        .await
}

/// `ZREM key members…`: take a request's entries, or a lease, out of a
/// sorted set.
pub(super) async fn zrem<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    members: &[String],
) -> Result<(), StoreError> {
    redis::cmd("ZREM")
        .arg(key)
        .arg(members)
        .query_async::<()>(conn)
        .await?;
    Ok(())
}
