//! The one send loop: every call the store makes to Redis (a check, a
//! batch, an operator's command or refund, a lease release, a clean-up, a
//! ping) goes through [`Call::run`], which takes a connection, sends, and
//! decides what a failure means:
//!
//! - `NOSCRIPT` (a Redis restarted or flushed since the script was
//!   loaded): load the script and send again on the same connection;
//! - refused before it ran ([`not_run`]: a cluster's `MOVED`/`ASK`, a node
//!   loading or failing over, a demoted primary's `READONLY`): send again,
//!   a few times, after a short pause (after `MOVED` the cluster client has
//!   refreshed its slots). An `ASK` is sent again the same way, not to the
//!   importing node after `ASKING`: that node answers `TRYAGAIN` to a
//!   request of several keys some of which it lacks, and every check and
//!   command names two (the state and the block, which rarely exists);
//! - `READONLY` (a primary demoted by a failover): retire the connection,
//!   so the next goes to the new primary;
//! - a connection error: retire the connection and, only when running the
//!   call twice leaves what running it once does ([`Call::repeatable`]),
//!   send it once more on a fresh one. Otherwise the reply may have been
//!   lost after Redis ran it, and the failure is the caller's;
//! - the whole call, connection checkout included, within a timeout.

use std::time::Duration;

use super::connection::{Conn, Connections};
use super::errors::{is_connection_error, is_demoted, no_script, not_run};
use crate::store::StoreError;

/// How many times a call Redis refused before running it is sent again.
const MAX_REDIRECTS: u32 = 3;
/// The pause before sending it again, times the number of the try.
const REDIRECT_PAUSE: Duration = Duration::from_millis(5);

/// One call to Redis and what may be done to get it through.
pub(super) struct Call<'a, T> {
    connections: &'a Connections,
    timeout: Duration,
    /// What the call is, for the logs.
    what: &'static str,
    /// The script the call runs, loaded again after `NOSCRIPT`.
    script: Option<&'static redis::Script>,
    /// Whether it may be sent again after a connection error.
    repeatable: bool,
    /// The connection of the first attempt, instead of a new one.
    first: Option<Conn>,
    /// Whether a reply says that a replica answered (and nothing counted).
    from_replica: fn(&T) -> bool,
}

impl<'a, T> Call<'a, T> {
    /// A call named `what` (for the logs) on `connections`, within
    /// `timeout`: sent again only when Redis refused it before running it.
    pub(super) fn new(connections: &'a Connections, timeout: Duration, what: &'static str) -> Self {
        Self {
            connections,
            timeout,
            what,
            script: None,
            repeatable: false,
            first: None,
            from_replica: |_| false,
        }
    }

    /// The call runs `script`: after `NOSCRIPT`, load it and send again.
    #[must_use]
    pub(super) fn script(mut self, script: Option<&'static redis::Script>) -> Self {
        self.script = script;
        self
    }

    /// Whether running the call twice leaves what running it once does, so
    /// that it may be sent again after a connection error (once: the
    /// reply may have been lost after Redis ran it).
    #[must_use]
    pub(super) fn repeatable(mut self, repeatable: bool) -> Self {
        self.repeatable = repeatable;
        self
    }

    /// Send the first attempt on `conn` (where commands sent before it must
    /// run first), the next ones on new connections.
    #[must_use]
    pub(super) fn first_on(mut self, conn: Conn) -> Self {
        self.first = Some(conn);
        self
    }

    /// A reply for which `from_replica` holds came from a replica, which
    /// wrote nothing (a batch whose checks each caught `READONLY`): the
    /// connection is retired and the call sent again, like a `READONLY`
    /// error; past the last try the reply is returned as it is.
    #[must_use]
    pub(super) fn replica_reply(mut self, from_replica: fn(&T) -> bool) -> Self {
        self.from_replica = from_replica;
        self
    }

    /// Send the call: `attempt` sends it once on the connection it is
    /// given (a clone: the loop keeps it to retire it), and may send what
    /// belongs with it (a restamp, a clock measurement). A connection that
    /// cannot be had fails the call at once.
    pub(super) async fn run<F>(self, attempt: impl FnMut(Conn) -> F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        within(self.timeout, self.send(attempt)).await
    }

    async fn send<F>(mut self, mut attempt: impl FnMut(Conn) -> F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let what = self.what;
        let mut resent = false;
        let mut redirects = 0;
        loop {
            let mut conn = match self.first.take() {
                Some(conn) => conn,
                None => self.connections.get().await?,
            };
            let mut result = attempt(conn.clone()).await;
            if let (Err(error), Some(script)) = (&result, self.script)
                && no_script(error)
            {
                result = match script.load_async(conn.get()).await {
                    Ok(_) => attempt(conn.clone()).await,
                    Err(error) => Err(error.into()),
                };
            }
            match result {
                Ok(reply) if (self.from_replica)(&reply) => {
                    conn.mark_broken();
                    if redirects == MAX_REDIRECTS {
                        return Ok(reply);
                    }
                    redirects += 1;
                    tracing::debug!("redis answered the {what} as a replica; sending it again");
                    tokio::time::sleep(REDIRECT_PAUSE * redirects).await;
                }
                Ok(reply) => return Ok(reply),
                // A connection broken by a Redis restart or a lost reply:
                // drop it and try once more on a fresh one, where a repeat
                // is harmless.
                Err(error) if is_connection_error(&error) && self.repeatable && !resent => {
                    conn.mark_broken();
                    resent = true;
                    tracing::debug!(%error, "redis connection failed; sending the {what} again on a fresh one");
                }
                // Refused before it ran (a cluster redirect, a node loading
                // or failing over, a replica): any call may be sent again,
                // a few times.
                Err(error) if not_run(&error) && redirects < MAX_REDIRECTS => {
                    if is_demoted(&error) {
                        conn.mark_broken();
                    }
                    redirects += 1;
                    tracing::debug!(%error, "redis did not run the {what}; sending it again");
                    tokio::time::sleep(REDIRECT_PAUSE * redirects).await;
                }
                Err(error) => {
                    if is_connection_error(&error) || is_demoted(&error) {
                        conn.mark_broken();
                    }
                    return Err(error);
                }
            }
        }
    }
}

/// `work`, or [`StoreError::Timeout`] once `timeout` has passed.
pub(super) async fn within<T>(
    timeout: Duration,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(StoreError::Timeout(timeout)))
}
