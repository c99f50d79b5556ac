//! Serving the app: connections capped in number and bounded in time, and
//! a stop that lets the requests in flight finish within the grace period.

use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::accept::Acceptor;
use crate::connections::{Caps, Connections};

/// The most a connection buffers: a request's head (answered `431 Request
/// Header Fields Too Large` past it: [`MAX_HEAD`]) and the answers waiting
/// to be written. hyper's default, about 400 KiB, would let the caps'
/// 10,000 connections hold 4 GB.
const MAX_BUFFER: usize = 32 * 1024;

/// The most bytes a request's head may take. The buffer's bound alone let
/// 48 KiB through (a read may fill more than the room it was asked for).
const MAX_HEAD: usize = 32 * 1024;

/// What bounds the connections of a listener.
#[derive(Clone, Copy)]
pub(crate) struct ConnectionLimits {
    /// `HEADER_TIMEOUT`: to send a request's headers.
    pub(crate) header_timeout: Duration,
    /// `SHUTDOWN_GRACE`: for the requests in flight after the stop.
    pub(crate) grace: Duration,
    /// `MAX_CONNECTIONS` and `MAX_CONNECTIONS_PER_IP`.
    pub(crate) caps: Caps,
}

/// Serves `app` until `stop` ([`shutdown_signal`](crate::signals::shutdown_signal)),
/// then stops accepting and lets the requests in flight finish for at most
/// the grace period. A connection over a cap is closed as soon as it is
/// accepted. (axum::serve has neither a header timeout, nor caps, nor a
/// bounded stop: one client holding half-sent headers would hold the stop
/// forever.)
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_BUFFER)
        .max_header_size(MAX_HEAD);
    let graceful = GracefulShutdown::new();
    let connections = Connections::new(limits.caps);
    let mut acceptor = Acceptor::new(listener);
    tokio::pin!(stop);
    loop {
        // Out of file descriptors, the acceptor waits: the open
        // connections go on meanwhile, and the stop is heard.
        let (stream, peer) = tokio::select! {
            accepted = acceptor.accept() => accepted,
            () = &mut stop => break,
        };
        // Over a cap: dropped, so closed at once.
        let Ok(slot) = connections.admit(peer.ip()) else {
            continue;
        };
        // `key::peer_ip()` reads the client address that this records.
        let app = app
            .clone()
            .map_request(move |mut request: http::Request<_>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            });
        let connection = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, %peer, "connection ended");
            }
            // Its place under the caps is free again.
            drop(slot);
        });
    }
    drop(acceptor);
    let open = graceful.count();
    tracing::info!(open, "shutting down: finishing the requests in flight");
    if tokio::time::timeout(limits.grace, graceful.shutdown())
        .await
        .is_err()
    {
        // Returning from main closes them.
        tracing::warn!(
            grace = ?limits.grace,
            "grace period over: closing the connections still open"
        );
    }
}
