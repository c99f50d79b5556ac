//! Peek, reset, block, penalty and reward of one key of a rule (and tier)
//! or a limiter, and the keys denied most.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::Operated;
use super::problem::{Problem, parse_body};
use crate::key::KeyHash;
use crate::policy::MAX_MAX;
use crate::rules::MAX_BLOCK;
use crate::store::{Command, bounded_key};
use crate::{Decision, Limiter, StoreError};

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

/// `GET /api/limits/{name}/top`: the keys denied most over this minute
/// and the last, across the processes that share them. A rule's tiers
/// count under the rule's name: its default limiter reads them all.
pub(crate) async fn top(
    State(operated): State<Arc<Operated>>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, Problem> {
    let Path(name) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let denied = find(&operated, &name, None)?
        .most_denied()
        .await
        .map_err(store_failed)?;
    Ok(Json(json!({
        "name": name,
        "keys": denied
            .into_iter()
            .map(|(key, denials)| json!({ "key": key, "denials": denials }))
            .collect::<Vec<_>>(),
    })))
}

/// `GET /api/limits/{name}/keys/{key}`: the decision a request would get
/// now, consuming nothing; for a rule, also what it counts (`unit`:
/// requests, tokens or money, and the catalog's `currency`) and the units
/// the key has `spent` (money in micro-units).
pub(crate) async fn peek(
    State(operated): State<Arc<Operated>>,
    path: Result<Path<(String, String)>, PathRejection>,
    tier: Result<Query<Tier>, QueryRejection>,
) -> Result<Json<Value>, Problem> {
    let Path((name, key)) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let Query(tier) = tier.map_err(|e| Problem::bad_request(e.body_text()))?;
    let limiter = find(&operated, &name, tier.tier.as_deref())?;
    let held = held_key(&key)?;
    let peeked = limiter.command_limited(&held, Command::Peek).await;
    let spent = peeked.as_ref().ok().and_then(|decision| {
        let shown = decision
            .rates()
            .iter()
            .find(|s| s.rate() == decision.rate())?;
        Some(shown.spent(Some((decision.allowed(), limiter.policy().cost()))))
    });
    let mut answer = answer(&name, &held, peeked)?;
    spend(&operated, &name, spent, &mut answer.0);
    Ok(answer)
}

/// A peek at a rule says what it counts (and the catalog's currency, for
/// money) and what the key has `spent` of the rate that decides.
fn spend(operated: &Operated, name: &str, spent: Option<u64>, answer: &mut Value) {
    let Some(rules) = &operated.rules else { return };
    let active = rules.current();
    let Some(rule) = active.rule(name) else {
        return;
    };
    let unit = rule.unit();
    answer["unit"] = json!(unit.to_string());
    if unit == crate::rules::Unit::Money
        && let Some(catalog) = active.set().catalog()
    {
        answer["currency"] = json!(catalog.currency());
    }
    if let Some(spent) = spent {
        answer["spent"] = json!(spent);
    }
}

/// `POST /api/limits/{name}/keys/{key}/{command}`.
pub(crate) async fn command(
    State(operated): State<Arc<Operated>>,
    path: Result<Path<(String, String, String)>, PathRejection>,
    tier: Result<Query<Tier>, QueryRejection>,
    body: Bytes,
) -> Result<Json<Value>, Problem> {
    let Path((name, key, command)) = path.map_err(|e| Problem::bad_request(e.body_text()))?;
    let Query(tier) = tier.map_err(|e| Problem::bad_request(e.body_text()))?;
    let limiter = find(&operated, &name, tier.tier.as_deref())?;
    let held = held_key(&key)?;
    let run = match command.as_str() {
        "reset" => Command::Reset,
        "block" => {
            let Block { seconds } = parse_body(&body)?;
            if seconds > MAX_BLOCK.as_secs() {
                return Err(Problem::invalid(format!(
                    "a block of {seconds} s is longer than the longest, {} s (a day)",
                    MAX_BLOCK.as_secs()
                ))
                .with("field", "seconds"));
            }
            Command::Block(Duration::from_secs(seconds))
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
                Command::Penalty(units)
            } else {
                Command::Reward(units)
            }
        }
        _ => {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                format!("no command {command:?}: reset, block, penalty or reward"),
            ));
        }
    };
    let outcome = limiter.command_limited(&held, run).await;
    // Keys are often API keys: hashed as every log of the crate shows them,
    // the key itself only at debug level.
    tracing::info!(limit = %name, tier = ?tier.tier, key = %KeyHash::held(limiter.name(), &held), command, "admin: key command");
    tracing::debug!(limit = %name, key = %held, command, "admin: key command on this key");
    answer(&name, &held, outcome)
}

/// The limiter of rule (or limiter) `name` for `tier`.
fn find(operated: &Operated, name: &str, tier: Option<&str>) -> Result<Limiter, Problem> {
    let found = tiers(operated, name)?;
    if let Some(tier) = tier {
        return found
            .iter()
            .find(|(t, _)| t.as_deref() == Some(tier))
            .map(|(_, limiter)| limiter.clone())
            .ok_or_else(|| {
                let known: Vec<&str> = found.iter().filter_map(|(t, _)| t.as_deref()).collect();
                Problem::new(
                    StatusCode::NOT_FOUND,
                    format!("{name:?} has no tier {tier:?}"),
                )
                .with("rule", name)
                .with("tiers", known)
            });
    }
    found
        .into_iter()
        .find(|(t, _)| t.is_none())
        .map(|(_, limiter)| limiter)
        .ok_or_else(|| unknown(name))
}

/// The limiters of rule (or limiter) `name`: its default (tier `None`)
/// and each tier's.
fn tiers(operated: &Operated, name: &str) -> Result<Vec<(Option<String>, Limiter)>, Problem> {
    if let Some(rules) = &operated.rules {
        let active = rules.current();
        if let Some(rule) = active.rule(name) {
            let mut found = Vec::new();
            if let Some(limiter) = active.limiter(name, None) {
                found.push((None, limiter.clone()));
            }
            for (tier, _) in rule.tiers() {
                if let Some(limiter) = active.limiter(name, Some(tier)) {
                    found.push((Some(tier.to_owned()), limiter.clone()));
                }
            }
            return Ok(found);
        }
    }
    operated
        .limiters
        .iter()
        .find(|l| l.name() == name)
        .map(|limiter| vec![(None, limiter.clone())])
        .ok_or_else(|| unknown(name))
}

fn unknown(name: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        format!("no rule or limiter named {name:?}"),
    )
    .with("rule", name)
}

/// The key as the limiter holds it: `key` itself (hashed by the limiter
/// when long), or, for `#` and 40 hex digits, the hashed form the top keys
/// show for a key too long to show (a key sent starting with `#` is always
/// held hashed, so the two cannot meet).
fn held_key(key: &str) -> Result<Cow<'_, str>, Problem> {
    if key.is_empty() {
        return Err(Problem::invalid("the key is empty").with("field", "key"));
    }
    let Some(hash) = key.strip_prefix('#') else {
        return Ok(bounded_key(key));
    };
    if hash.len() == 40 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Ok(Cow::Borrowed(key));
    }
    Err(Problem::invalid(
        "a key starting with `#` is the form the top keys show for a long key: \
         `#` and 40 lowercase hex digits",
    )
    .with("field", "key"))
}

fn store_failed(error: StoreError) -> Problem {
    tracing::warn!(%error, "admin: the store failed");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the store failed: {error}"),
    )
}

/// The answer to a key command: the key as held (at most 128 bytes, a
/// longer one by its hash), never the path's whole (a client could make it
/// as long as a request's head).
fn answer(
    name: &str,
    key: &str,
    outcome: Result<Decision, StoreError>,
) -> Result<Json<Value>, Problem> {
    let decision = outcome.map_err(store_failed)?;
    Ok(Json(json!({
        "name": name,
        "key": key,
        "state": decision_json(&decision),
    })))
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
