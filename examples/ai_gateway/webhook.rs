//! Notices of budgets crossing their thresholds: a log line (with the
//! budget's key: names from the keys file, never a secret) and, with
//! `WEBHOOK_URL`, a JSON `POST` there.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Uri, header};
use tokio::sync::Semaphore;
use tower_redis_ratelimit::ai::Notice;
use tower_redis_ratelimit::rules::{Rules, Unit};

use crate::proxy::client;

/// The most webhook calls in flight: past it, a notice is logged only.
const IN_FLIGHT: usize = 64;

/// How long a webhook call may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// `WEBHOOK_URL` read: an http:// or https:// URL.
pub(crate) fn url(text: &str) -> Result<Uri, String> {
    let uri: Uri = text
        .parse()
        .map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(format!("{text:?} is not an http:// or https:// URL"));
    }
    Ok(uri)
}

/// What tells each notice; amounts of money in the currency of the
/// catalog of `rules` in force.
pub(crate) fn teller(
    webhook: Option<Uri>,
    rules: Rules,
) -> impl Fn(&Notice) + Send + Sync + 'static {
    let client = client();
    let room = Arc::new(Semaphore::new(IN_FLIGHT));
    move |notice: &Notice| {
        let active = rules.current();
        let catalog = active
            .set()
            .catalog()
            .filter(|_| notice.unit == Unit::Money);
        let amount = |units: u64| match catalog {
            Some(catalog) => catalog.amount(units),
            None => format!("{units} {}", notice.unit),
        };
        tracing::info!(
            rule = notice.rule,
            key = notice.key,
            threshold = notice.threshold,
            "notice: {}% of the budget spent: {} of {} this period",
            notice.threshold,
            amount(notice.used),
            amount(notice.limit),
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
            "currency": catalog.map(|c| c.currency().to_owned()),
            "used": notice.used,
            "limit": notice.limit,
            "period": notice.rate.to_string(),
            "resets_in_seconds": notice.resets.as_secs(),
        });
        let request = Request::post(url.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()));
        let client = client.clone();
        tokio::spawn(async move {
            let sent = match request {
                Ok(request) => match tokio::time::timeout(TIMEOUT, client.request(request)).await {
                    Ok(Ok(response)) => Ok(response.status()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err(format!("no answer within {TIMEOUT:?}")),
                },
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
