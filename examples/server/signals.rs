//! What the signals do: `SIGTERM` and Ctrl-C stop the server gracefully;
//! `SIGHUP` is logged and otherwise ignored.

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

/// From now on, a `SIGHUP` is logged instead of killing the process (its
/// default action: a closed terminal, or an operator's `kill -HUP` meant to
/// reload, would stop the server). Nothing reloads on a signal: the
/// settings (and `envoy_rls`'s directory of rules) are read once, at
/// start, and a rules file or a rule set in Redis is followed without one
/// (the file re-read every second, the set as it is published).
pub(crate) fn ignore_hangups() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(mut hangups) => {
                tokio::spawn(async move {
                    while hangups.recv().await.is_some() {
                        tracing::info!(
                            "SIGHUP ignored: nothing reloads on a signal; the settings (and a \
                             directory of rules) are read at start, restart to change them; a \
                             rules file or a rule set in Redis is followed as it changes"
                        );
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGHUP: one would kill the server")
            }
        }
    }
}
