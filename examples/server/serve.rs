//! Serving the app: every connection bounded in time, and a stop that
//! lets the requests in flight finish within the grace period.

use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// How long a client may hold a connection without progress.
#[derive(Clone, Copy)]
pub(crate) struct ConnectionLimits {
    /// `HEADER_TIMEOUT`: to send a request's headers.
    pub(crate) header_timeout: Duration,
    /// `SHUTDOWN_GRACE`: for the requests in flight after the stop.
    pub(crate) grace: Duration,
}

/// Serves `app` until `stop` ([`shutdown_signal`]), then stops accepting and lets
/// the requests in flight finish for at most the grace period. (axum::serve
/// has neither a header timeout nor a bounded stop: one client holding
/// half-sent headers would hold the stop forever.)
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, say: wait, then go on.
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stop => break,
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
        });
    }
    drop(listener);
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

/// Resolves at the first `SIGTERM` (what orchestrators send) or Ctrl-C.
/// The signals are listened for from the moment this is called, not from
/// the first time the future is polled: a `SIGTERM` that comes before the
/// accept loop first waits for it would otherwise take its default action
/// and kill the process (exit by signal, not 0).
pub(crate) fn shutdown_signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let listening = signal(SignalKind::terminate())
            .and_then(|terminate| Ok((terminate, signal(SignalKind::interrupt())?)));
        async move {
            match listening {
                Ok((mut terminate, mut interrupt)) => {
                    tokio::select! {
                        _ = terminate.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for SIGTERM and Ctrl-C");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}

/// One stop for several servers: each call of the returned function is a
/// future that completes once `stop` has.
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) fn shared(
    stop: impl Future<Output = ()> + Send + 'static,
) -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    let (stopped, watch) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop.await;
        let _ = stopped.send(true);
    });
    move || {
        let mut watch = watch.clone();
        Box::pin(async move {
            // An error: the sender is gone, which it is only after the stop.
            let _ = watch.wait_for(|stopped| *stopped).await;
        })
    }
}
