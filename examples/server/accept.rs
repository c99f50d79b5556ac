//! Accepting connections without spinning: an accept that fails for the
//! listener (out of file descriptors: `EMFILE`, `ENFILE`) is tried again
//! after a wait, 10 ms doubling up to a second, while the connections
//! already open go on; one that fails for its own client is skipped.
//! (Shared with `examples/envoy_rls.rs`.)

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// A listener's connections, one at a time.
pub(crate) struct Acceptor {
    listener: TcpListener,
    /// The wait after the next failed accept.
    next: Duration,
}

impl Acceptor {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    pub(crate) fn new(listener: TcpListener) -> Self {
        Self {
            listener,
            next: Self::FIRST,
        }
    }

    /// The next connection and its client's address. Dropping the future
    /// loses nothing: a connection not yet accepted waits in the backlog.
    pub(crate) async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok(accepted) => {
                    self.next = Self::FIRST;
                    return accepted;
                }
                // The client gave up before it was accepted: nothing to wait for.
                Err(error) if is_the_clients(&error) => {
                    tracing::debug!(%error, "a connection ended before it was accepted");
                }
                Err(error) => {
                    // The connection waits in the backlog, and accepting
                    // again at once would fail at once.
                    let delay = self.next;
                    self.next = (delay * 2).min(Self::MAX);
                    tracing::warn!(%error, ?delay, "cannot accept a connection: waiting");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}

/// An accept error that is about one connection (its client reset or
/// aborted it), not about the listener.
fn is_the_clients(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}
