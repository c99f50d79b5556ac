//! Prometheus: the recorder's builder with the crate's buckets, `GET
//! /metrics`, and the recorder's upkeep while nobody scrapes it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse as _, Response};
use http::{StatusCode, header};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::Operated;
use super::problem::Problem;

/// A Prometheus recorder's builder with the buckets of the crate's
/// histograms (the store's latency: 100 µs to 2.5 s), to install as the
/// process's `metrics` recorder and give to
/// [`Admin::with_metrics`](super::Admin::with_metrics).
pub fn prometheus_builder() -> PrometheusBuilder {
    const STORE_SECONDS: &[f64] = &[
        0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
        2.5,
    ];
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("ratelimit_store_duration_seconds".to_owned()),
            STORE_SECONDS,
        )
        // Valid buckets, never empty: this cannot fail.
        .unwrap_or_else(|_| PrometheusBuilder::new())
}

/// `GET /metrics`.
pub(crate) async fn render(State(operated): State<Arc<Operated>>) -> Result<Response, Problem> {
    let handle = operated.metrics.as_ref().ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "no metrics here: the application gave the admin router no Prometheus recorder",
        )
    })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response())
}

/// How often the recorder's upkeep runs.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Run the recorder's upkeep every [`UPKEEP_EVERY`] while `handle` lives
/// (the router holds it): a recorder installed alone
/// (`install_recorder`) keeps every histogram sample until it renders, so
/// a process nobody scrapes would grow by each request's samples. On the
/// current tokio runtime, else on a thread of its own.
pub(crate) fn keep_up(handle: &Arc<PrometheusHandle>) {
    let handle = Arc::downgrade(handle);
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let mut every = tokio::time::interval(UPKEEP_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if !upkeep(&handle) {
                    break;
                }
            }
        });
    } else {
        let spawned = std::thread::Builder::new()
            .name("ratelimit-admin-metrics".to_owned())
            .spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    if !upkeep(&handle) {
                        break;
                    }
                }
            });
        if let Err(error) = spawned {
            tracing::error!(%error, "admin: no thread for the metrics' upkeep: they grow until scraped");
        }
    }
}

/// One upkeep, if the recorder's handle is still held.
fn upkeep(handle: &Weak<PrometheusHandle>) -> bool {
    let Some(handle) = handle.upgrade() else {
        return false;
    };
    handle.run_upkeep();
    true
}
