//! The operator's router (`ADMIN_BIND`, `ADMIN_TOKEN`, `ADMIN_HOST_NAMES`;
//! `--features admin`) on a listener of its own, never the public one.

use axum::Router;
use tokio::net::TcpListener;
use tower_redis_ratelimit::admin::Admin;

use crate::app::Operated;
use crate::connections::Caps;
use crate::serve::ConnectionLimits;
use crate::settings::{AdminSettings, BadSetting};

/// Connections open at once on the admin listener, from any address: its
/// clients are a few operators and a metrics scraper. Counted apart from
/// the public listener's, so a flood there never locks the operator out
/// (and kept within `connections::RESERVED_FILES`).
pub(crate) const MAX_CONNECTIONS: usize = 32;

/// The admin listener's limits: the public one's times, its own caps.
pub(crate) fn limits(public: ConnectionLimits) -> ConnectionLimits {
    ConnectionLimits {
        caps: Caps {
            total: MAX_CONNECTIONS,
            per_client: MAX_CONNECTIONS,
        },
        ..public
    }
}

/// The admin router and its listener.
pub(crate) struct AdminListener {
    pub(crate) listener: TcpListener,
    pub(crate) router: Router,
}

/// Build the admin router over what the app limits with, with the
/// Prometheus recorder installed for the process, and bind its listener.
pub(crate) async fn listen(
    settings: &AdminSettings,
    operated: &Operated,
) -> Result<AdminListener, BadSetting> {
    let metrics = tower_redis_ratelimit::admin::prometheus_builder()
        .install_recorder()
        .map_err(|error| {
            BadSetting::new(
                "ADMIN_BIND",
                format!("cannot install the metrics recorder: {error}"),
            )
        })?;
    let listener = TcpListener::bind(&settings.bind).await.map_err(|error| {
        BadSetting::new(
            "ADMIN_BIND",
            format!("cannot listen on {:?}: {error}", settings.bind),
        )
    })?;
    let addr = listener
        .local_addr()
        .map_err(|error| BadSetting::new("ADMIN_BIND", format!("no address to serve: {error}")))?;
    // It serves the hosts of this address and the names listed: a page of
    // another name that resolves to it (DNS rebinding) is refused.
    let mut admin = Admin::new(settings.token.clone(), addr)
        .map_err(|error| BadSetting::new("ADMIN_TOKEN", error))?;
    for name in &settings.host_names {
        admin = admin
            .with_host_name(name)
            .map_err(|error| BadSetting::new("ADMIN_HOST_NAMES", error))?;
    }
    let admin = admin.with_metrics(metrics);
    let admin = match operated {
        Operated::Nothing => admin,
        Operated::Limiter(limiter) => admin.with_limiter(limiter.clone()),
        Operated::Rules(rules, watch) => admin.with_rules(rules).with_watch(watch),
    };
    tracing::info!("admin router on http://{addr} (bearer token required)");
    Ok(AdminListener {
        listener,
        router: admin.into_router(),
    })
}
