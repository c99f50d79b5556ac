//! The rules in force, and publishing a rule set.

use std::path::Path;
use std::sync::{Arc, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::problem::{Problem, parse_body};
use super::{Operated, rules_file};
use crate::rules::{RuleSet, Source, WatchStatus};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Publish {
    /// A rule set in TOML, or JSON.
    text: String,
    /// Publish it even though it has no rules (which lifts every limit).
    #[serde(default)]
    confirm_empty: bool,
}

/// `GET /api/rules`: each rule and tier's policy, and what the watch last
/// did.
pub(crate) async fn show(State(operated): State<Arc<Operated>>) -> Json<Value> {
    let state = &*operated;
    let rules = state.rules.as_ref().map(|rules| {
        let active = rules.current();
        let set = active.set();
        json!({
            "version": set.version(),
            "rules": set.rules().iter().map(|rule| json!({
                "name": rule.name(),
                "policy": rule.policy(None).to_string(),
                "algorithm": rule.policy(None).algorithm().to_string(),
                "tiers": rule.tiers()
                    .map(|(tier, policy)| (tier.to_owned(), Value::String(policy.to_string())))
                    .collect::<serde_json::Map<_, _>>(),
            })).collect::<Vec<_>>(),
        })
    });
    let limiters: Vec<Value> = state
        .limiters
        .iter()
        .map(|l| json!({ "name": l.name(), "policy": l.policy().to_string() }))
        .collect();
    let watch = state.watch.as_ref().map(|(status, _)| {
        let status = status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        watch_json(&status)
    });
    Json(json!({
        "source": match (&state.rules, &state.watch) {
            (None, _) => Value::Null,
            (Some(_), None) => Value::String("code".to_owned()),
            (Some(_), Some((_, source))) => Value::String(source.to_string()),
        },
        "rules": rules,
        "watch": watch,
        "limiters": limiters,
    }))
}

fn watch_json(status: &WatchStatus) -> Value {
    json!({
        "source": status.source,
        "version": status.version,
        "text": status.text,
        "loaded_at_ms": status.loaded_at.map(unix_ms),
        "error": status.error,
        "rejected": status.rejected.as_ref().map(|r| json!({
            "text": r.text,
            "error": r.error,
            "at_ms": unix_ms(r.at),
        })),
    })
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `PUT /api/rules` `{"text": "..."}`: validated, then published to the
/// watch's source. A set that does not validate changes nothing; nor does
/// a set of no rules, unless `"confirm_empty": true` says that every limit
/// is to be lifted (and, for a file, the text is blank or names its list
/// of rules, as the watch requires).
pub(crate) async fn publish(
    State(operated): State<Arc<Operated>>,
    body: Bytes,
) -> Result<(StatusCode, Json<Value>), Problem> {
    let Publish {
        text,
        confirm_empty,
    } = parse_body(&body)?;
    check_publishable(&operated, &text, confirm_empty)?;
    let Some((_, source)) = &operated.watch else {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "these rules are not read from a file or Redis: only a watched source accepts a rule set",
        ));
    };
    match source {
        #[cfg(feature = "redis")]
        Source::Redis { client, key } => to_redis(client, key, &text, source).await,
        Source::File(path) => to_file(path, text, source).await,
    }
}

/// Refuse `text` unless it validates (read as its destination will read
/// it) and holds rules, or `confirm_empty` says that none is meant.
fn check_publishable(operated: &Operated, text: &str, confirm_empty: bool) -> Result<(), Problem> {
    // Read as its destination will read it: a file by its name's extension.
    let parsed = match &operated.watch {
        Some((_, Source::File(path))) => RuleSet::parse_as(path, text),
        _ => RuleSet::parse(text),
    };
    match parsed {
        Err(error) => {
            let mut problem = Problem::invalid(format!("rule set rejected: {error}"))
                .with("field", error.field());
            if let Some(rule) = error.rule() {
                problem = problem.with("rule", rule);
            }
            Err(problem)
        }
        Ok(set) if set.rules().is_empty() && !confirm_empty => Err(Problem::invalid(
            "this rule set has no rules: publishing it lifts every limit at once; \
             to do so, send it with `\"confirm_empty\": true`",
        )
        .with("field", "confirm_empty")),
        Ok(set) if set.rules().is_empty() => names_its_rules(operated, text),
        Ok(_) => Ok(()),
    }
}

/// Refuse a confirmed set of no rules for a watched file unless it is
/// blank (written out as no rules) or names its list of rules: the watch
/// keeps the rules in force for a file that names none (a save caught
/// half way), so it would be accepted and never applied.
fn names_its_rules(operated: &Operated, text: &str) -> Result<(), Problem> {
    let Some((_, Source::File(path))) = &operated.watch else {
        return Ok(());
    };
    let format = crate::rules::Format::of(path);
    if text.trim().is_empty() || format.names_its_rules(text) {
        return Ok(());
    }
    Err(Problem::invalid(format!(
        "this rule set of no rules does not name its list of rules, and the watched \
         file {} lifts every limit only when it does (a file caught half written names \
         none): add `{}` to the text",
        path.display(),
        format.no_rules()
    ))
    .with("field", "text"))
}

/// Write `text` to the rules file at `path`.
async fn to_file(
    path: &Path,
    text: String,
    source: &Source,
) -> Result<(StatusCode, Json<Value>), Problem> {
    // A confirmed empty set is written out: the watch never applies
    // an empty file (a save caught half way).
    let text = if text.trim().is_empty() {
        crate::rules::Format::of(path).no_rules().to_owned()
    } else {
        text
    };
    rules_file::write(path, &text).await.map_err(|error| {
        tracing::warn!(%error, path = %path.display(), "admin: writing the rules file failed");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "cannot write {}: {error}; the file is unchanged",
                path.display()
            ),
        )
    })?;
    tracing::info!(path = %path.display(), "admin: rule set written");
    // The watch reads the file on its next turn.
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "source": source.to_string() })),
    ))
}

/// How long publishing a rule set to Redis may take.
#[cfg(feature = "redis")]
const PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Publish `text` to Redis at `key` ([`crate::rules::publish`]): every
/// process following it puts it in force within a round trip.
#[cfg(feature = "redis")]
async fn to_redis(
    client: &redis::Client,
    key: &str,
    text: &str,
    source: &Source,
) -> Result<(StatusCode, Json<Value>), Problem> {
    let failed = |error: String| {
        tracing::warn!(%error, key, "admin: publishing the rule set failed");
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("redis: {error}; nothing was published"),
        )
    };
    let publish = async {
        let mut connection = client.get_multiplexed_async_connection().await?;
        crate::rules::publish(&mut connection, key, text).await
    };
    let version = match tokio::time::timeout(PUBLISH_TIMEOUT, publish).await {
        Ok(Ok(version)) => version,
        Ok(Err(crate::rules::PublishError::Redis(error))) => {
            return Err(failed(error.to_string()));
        }
        Ok(Err(other)) => return Err(Problem::invalid(other.to_string())),
        Err(_) => {
            return Err(failed(format!(
                "no answer within {PUBLISH_TIMEOUT:?} (it may still be published)"
            )));
        }
    };
    tracing::info!(key, version, "admin: rule set published");
    Ok((
        StatusCode::OK,
        Json(json!({ "source": source.to_string(), "version": version })),
    ))
}
