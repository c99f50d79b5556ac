//! Taking a request's entries (or its lease) back out of a sorted set when
//! the request must not count.

use std::time::Duration;

use super::connection::{AnyConn, Connections, is_connection_error};
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
    conn: Option<AnyConn>,
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
            conn: None,
            connections: connections.clone(),
            key: key.to_owned(),
            members,
            timeout,
            armed: true,
        }
    }

    /// The request's next attempt goes out on `conn`.
    pub(super) fn bind(&mut self, conn: &AnyConn) {
        self.conn = Some(conn.clone());
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
        let Some(conn) = self.conn.clone() else {
            return;
        };
        let removal = remove(conn, &self.connections, &self.key, &self.members);
        match tokio::time::timeout(budget, removal).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(
                %error,
                "could not remove a denied request's entry; it counts until its window passes"
            ),
            Err(_) => {
                tracing::debug!("removing a denied request's entry goes on in the background");
                return;
            }
        }
        let mut done = self;
        done.armed = false;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(conn) = self.conn.take() else {
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
                let removal = remove(conn.clone(), &connections, &key, &members);
                match tokio::time::timeout(timeout, removal).await {
                    Ok(Ok(())) => return,
                    Ok(Err(error)) if !is_connection_error(&error) => {
                        last = Some(error);
                        break;
                    }
                    Ok(Err(error)) => last = Some(error),
                    Err(_) => last = Some(StoreError::Timeout(timeout)),
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

/// `ZREM` the members on `conn`; when `conn` is broken, on a fresh
/// connection from `connections`.
async fn remove(
    mut conn: AnyConn,
    connections: &Connections,
    key: &str,
    members: &[String],
) -> Result<(), StoreError> {
    match zrem(&mut conn, key, members).await {
        Err(error) if is_connection_error(&error) => {
            let mut fresh = connections.get().await?;
            let removed = zrem(fresh.get(), key, members).await;
            if let Err(error) = &removed
                && is_connection_error(error)
            {
                fresh.mark_broken();
            }
            removed
        }
        other => other,
    }
}

async fn zrem(conn: &mut AnyConn, key: &str, members: &[String]) -> Result<(), StoreError> {
    redis::cmd("ZREM")
        .arg(key)
        .arg(members)
        .query_async::<()>(conn)
        .await?;
    Ok(())
}
