//! Notices of budgets crossing their thresholds: a log line (with the
//! budget's key: names from the keys file, never a secret) and, with
//! `WEBHOOK_URL`, a JSON `POST` there.

use std::sync::Arc;

use axum::body::Body;
use http::{Request, header};
use tokio::sync::Semaphore;
use tower_redis_ratelimit::ai::Notice;
use tower_redis_ratelimit::rules::Unit;

use crate::proxy::client;

/// The most webhook calls in flight: past it, a notice is logged only.
const IN_FLIGHT: usize = 64;

/// What tells each notice.
pub(crate) fn teller(
    webhook: Option<String>,
    currency: Option<String>,
) -> impl Fn(&Notice) + Send + Sync + 'static {
    let client = client();
    let room = Arc::new(Semaphore::new(IN_FLIGHT));
    move |notice: &Notice| {
        let used = amount(notice.used, notice.unit, currency.as_deref());
        let limit = amount(notice.limit, notice.unit, currency.as_deref());
        tracing::info!(
            rule = notice.rule,
            key = notice.key,
            threshold = notice.threshold,
            "notice: {}% of {limit} {} spent ({used})",
            notice.threshold,
            notice.rate,
        );
        let Some(url) = &webhook else { return };
        let Ok(permit) = Arc::clone(&room).try_acquire_owned() else {
            tracing::warn!(
                rule = notice.rule,
                "notice: too many webhook calls in flight; this one is not sent"
            );
            return;
        };
        let body = serde_json::json!({
            "rule": notice.rule,
            "key": notice.key,
            "threshold": notice.threshold,
            "unit": notice.unit.to_string(),
            "currency": if notice.unit == Unit::Money { currency.clone() } else { None },
            "used": notice.used,
            "limit": notice.limit,
            "period": notice.rate.to_string(),
            "resets_in_seconds": notice.resets.as_secs(),
        });
        let request = Request::post(url.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()));
        let client = client.clone();
        tokio::spawn(async move {
            let sent = match request {
                Ok(request) => client
                    .request(request)
                    .await
                    .map(|r| r.status())
                    .map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            };
            match sent {
                Ok(status) if status.is_success() => {}
                Ok(status) => tracing::warn!(%status, "notice: the webhook refused a notice"),
                Err(error) => tracing::warn!(%error, "notice: cannot call the webhook"),
            }
            drop(permit);
        });
    }
}

/// Units as a reader says them: money in the currency (`12.5 USD`).
fn amount(units: u64, unit: Unit, currency: Option<&str>) -> String {
    match (unit, currency) {
        (Unit::Money, Some(currency)) => {
            let text = format!("{}.{:06}", units / 1_000_000, units % 1_000_000);
            format!(
                "{} {currency}",
                text.trim_end_matches('0').trim_end_matches('.')
            )
        }
        _ => format!("{units} {unit}"),
    }
}
