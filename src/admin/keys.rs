//! Peek, reset, block, penalty and reward of one key of a rule (and tier)
//! or a limiter.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State as Shared};
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::State;
use super::problem::{Problem, parse_body};
use crate::policy::{MAX_MAX, MAX_WINDOW};
use crate::store::MAX_RAW_KEY_LEN;
use crate::{Decision, Limiter};

#[derive(Debug, Deserialize)]
pub(crate) struct Tier {
    tier: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Block {
    seconds: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Units {
    units: u64,
}

/// `GET /api/limits/{name}/keys/{key}`: the decision a request would get
/// now, consuming nothing.
pub(crate) async fn peek(
    Shared(state): Shared<Arc<State>>,
    path: Result<Path<(String, String)>, PathRejection>,
    tier: Result<Query<Tier>, QueryRejection>,
) -> Result<Json<Value>, Problem> {
    let Path((name, key)) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let Query(tier) = tier.map_err(|e| Problem::bad_request(e.body_text()))?;
    let limiter = find(&state, &name, tier.tier.as_deref())?;
    check_key(&key)?;
    answer(&name, &key, limiter.peek(&key).await)
}

/// `GET /api/limits/{name}/top`: the keys denied most over this minute
/// and the last, by every process sharing the store (by this process with
/// a store that does not keep them).
pub(crate) async fn top(
    Shared(state): Shared<Arc<State>>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, Problem> {
    let Path(name) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let limiter = find(&state, &name, None)?;
    match limiter.most_denied().await {
        Ok(top) => Ok(Json(json!({
            "limit": name,
            "keys": top
                .into_iter()
                .map(|(key, denials)| json!({ "key": key, "denials": denials }))
                .collect::<Vec<_>>(),
        }))),
        Err(error) => Err(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the store failed: {error}"),
        )),
    }
}

/// `POST /api/limits/{name}/keys/{key}/{command}`.
pub(crate) async fn command(
    Shared(state): Shared<Arc<State>>,
    path: Result<Path<(String, String, String)>, PathRejection>,
    tier: Result<Query<Tier>, QueryRejection>,
    body: Bytes,
) -> Result<Json<Value>, Problem> {
    let Path((name, key, command)) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let Query(tier) = tier.map_err(|e| Problem::bad_request(e.body_text()))?;
    let limiter = find(&state, &name, tier.tier.as_deref())?;
    check_key(&key)?;
    let outcome = match command.as_str() {
        "reset" => limiter.reset(&key).await,
        "block" => {
            let Block { seconds } = parse_body(&body)?;
            if seconds > MAX_WINDOW.as_secs() {
                return Err(Problem::invalid(format!(
                    "a block of {seconds} s is longer than the longest window, {} s",
                    MAX_WINDOW.as_secs()
                ))
                .with("field", "seconds"));
            }
            limiter.block(&key, Duration::from_secs(seconds)).await
        }
        "penalty" | "reward" => {
            let Units { units } = parse_body(&body)?;
            if units == 0 || units > MAX_MAX {
                return Err(
                    Problem::invalid(format!("{units} units: give 1 to {MAX_MAX}"))
                        .with("field", "units"),
                );
            }
            if command == "penalty" {
                limiter.penalty(&key, units).await
            } else {
                limiter.reward(&key, units).await
            }
        }
        _ => {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                format!("no command {command:?}: reset, block, penalty or reward"),
            ));
        }
    };
    tracing::info!(limit = %name, key, command, "admin: key command");
    answer(&name, &key, outcome)
}

/// The limiter of rule (or limiter) `name` for `tier`.
fn find(state: &State, name: &str, tier: Option<&str>) -> Result<Limiter, Problem> {
    if let Some(rules) = &state.rules {
        let active = rules.current();
        if let Some(rule) = active.set().rules().iter().find(|r| r.name() == name) {
            if let Some(tier) = tier
                && !rule.tiers().any(|(t, _)| t == tier)
            {
                let known: Vec<&str> = rule.tiers().map(|(t, _)| t).collect();
                return Err(Problem::new(
                    StatusCode::NOT_FOUND,
                    format!("rule {name:?} has no tier {tier:?}"),
                )
                .with("rule", name)
                .with("tiers", known));
            }
            if let Some(limiter) = active.limiter(name, tier) {
                return Ok(limiter.clone());
            }
        }
    }
    if let Some(limiter) = state.limiters.iter().find(|l| l.name() == name) {
        if tier.is_some() {
            return Err(Problem::bad_request(format!(
                "limiter {name:?} has no tiers: leave out `tier`"
            ))
            .with("rule", name));
        }
        return Ok(limiter.clone());
    }
    Err(Problem::new(
        StatusCode::NOT_FOUND,
        format!("no rule or limiter named {name:?}"),
    )
    .with("rule", name))
}

fn check_key(key: &str) -> Result<(), Problem> {
    if key.is_empty() {
        return Err(Problem::invalid("the key is empty").with("field", "key"));
    }
    if key.len() > MAX_RAW_KEY_LEN {
        return Err(Problem::invalid(format!(
            "the key is {} bytes long; at most {MAX_RAW_KEY_LEN}",
            key.len()
        ))
        .with("field", "key"));
    }
    Ok(())
}

fn answer(
    name: &str,
    key: &str,
    outcome: Result<Decision, crate::StoreError>,
) -> Result<Json<Value>, Problem> {
    match outcome {
        Ok(decision) => Ok(Json(json!({
            "limit": name,
            "key": key,
            "state": decision_json(&decision),
        }))),
        Err(error) => {
            tracing::warn!(limit = %name, %error, "admin: the store failed");
            Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the store failed: {error}"),
            ))
        }
    }
}

/// A decision as JSON: durations in milliseconds.
pub(crate) fn decision_json(decision: &Decision) -> Value {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    json!({
        "allowed": decision.allowed(),
        "blocked": decision.blocked(),
        "limit": decision.limit(),
        "remaining": decision.remaining(),
        "reset_ms": ms(decision.reset()),
        "retry_after_ms": ms(decision.retry_after()),
        "rates": decision.rates().iter().map(|r| json!({
            "rate": r.rate().to_string(),
            "remaining": r.remaining(),
            "reset_ms": ms(r.reset()),
            "wait_ms": ms(r.wait()),
        })).collect::<Vec<_>>(),
    })
}
