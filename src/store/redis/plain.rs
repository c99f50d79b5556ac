//! The window counters' batched checks as plain commands, pipelined on one
//! connection: per check and rate an `INCRBY` of the current window's
//! count and a `PEXPIREAT` of it (the fixed window: at the window's end;
//! the sliding window: at the next one's, while it counts as the previous
//! window), and per batch one `TIME`, one `MGET` of the blocks and, for
//! the sliding window, one `MGET` of the previous windows' counts. Redis
//! runs no script: a check costs it about what the plain `INCRBY` +
//! `EXPIRE` of a counter costs.
//!
//! The store counts first and decides on the counts after: a check is
//! admitted when every rate's count, with its cost, is within its max (an
//! `INCRBY` is atomic, so no two checks are admitted on the same room). A
//! check that is denied, blocked, failed or placed in the wrong window has
//! its cost taken back off (`DECRBY`, with the count's expiry again: a
//! count that expired meanwhile is not left behind without one) before it
//! is answered, so a denied request counts nothing. A give-back that fails
//! leaves its cost counted: at most once, as a lost reply. Until it is
//! given back, a concurrent check of the key sees the denied cost: with a
//! cost above 1 (or several rates) it may be denied too, never admitted
//! too many.
//!
//! Windows follow Redis's clock, as the scripts' do: the counts are named
//! by the window this process places at Redis's time (its clock's offset
//! to Redis, measured from each batch's `TIME`), and the batch's `TIME`,
//! read before any of its counts, checks the placing. A check placed in
//! another window than that `TIME` says (its clock and Redis's a window
//! boundary apart, or no offset measured yet) gives its cost back and is
//! decided again by the script.

use std::time::Duration;

use redis::{Pipeline, Value};

use super::batch::Waiting;
use super::call::Call;
use super::clock_sync::ClockSync;
use super::connection::Connections;
use crate::algorithm;
use crate::algorithm::{fixed_window, sliding_window};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy, Rate};
use crate::store::StoreError;

/// What became of one check of a batch.
pub(super) enum Outcome {
    /// Decided (or failed) here.
    Decided(Result<Decision, StoreError>),
    /// Placed in another window than Redis's clock says: its cost was
    /// given back; the script decides it.
    Again,
}

/// One rate's count of one check: its key, its window's index and the
/// count's expiry (µs), and the sliding window's previous window's count.
struct Count {
    key: String,
    index: u64,
    expires: u64,
    previous: Option<String>,
}

/// Decide `batch`'s checks of `algorithm` (a window counter) with plain
/// commands within `timeout`; an error is the whole batch's (it may have
/// counted).
pub(super) async fn decide(
    connections: &Connections,
    timeout: Duration,
    clock: &ClockSync,
    algorithm: Algorithm,
    batch: &[Waiting],
) -> Result<Vec<Outcome>, StoreError> {
    let started = tokio::time::Instant::now();
    let at = clock
        .now()
        .map_or_else(|| clock.local_micros(), |(now, _)| now);
    let counts: Vec<Vec<Count>> = batch
        .iter()
        .map(|waiting| {
            waiting
                .policy
                .rates()
                .iter()
                .map(|rate| count(algorithm, &waiting.state, rate, at))
                .collect()
        })
        .collect();
    let rates = counts.iter().map(Vec::len).sum::<usize>();
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    pipe.cmd("TIME");
    let blocks = pipe.cmd("MGET");
    for waiting in batch {
        blocks.arg(&waiting.block);
    }
    let reads = if algorithm == Algorithm::SlidingWindow {
        let previous = pipe.cmd("MGET");
        for count in counts.iter().flatten() {
            previous.arg(&count.previous);
        }
        3
    } else {
        2
    };
    for (waiting, counts) in batch.iter().zip(&counts) {
        for count in counts {
            pipe.cmd("INCRBY")
                .arg(&count.key)
                .arg(waiting.policy.cost());
            pipe.cmd("PEXPIREAT")
                .arg(&count.key)
                .arg(expiry(count.expires));
        }
    }
    let sent = clock.local_micros();
    let replies: Vec<Value> = Call::new(connections, timeout, "batch")
        .replica_reply(|replies: &Vec<Value>| replies.iter().any(refused_as_replica))
        .run(|mut conn| {
            let pipe = &pipe;
            async move { Ok(pipe.query_async(conn.get()).await?) }
        })
        .await?;
    let received = clock.local_micros();
    if replies.len() != reads + 2 * rates {
        return Err(StoreError::UnexpectedReply(format!(
            "{algorithm} batch: {} replies for {}",
            replies.len(),
            reads + 2 * rates
        )));
    }
    let now = redis_time(&replies[0])?;
    clock.record(sent, received, now);
    let blocks = values(&replies[1], batch.len(), algorithm, "blocks")?;
    let mut previous = match algorithm {
        Algorithm::SlidingWindow => values(&replies[2], rates, algorithm, "previous counts")?,
        _ => &[],
    }
    .iter();
    let mut added = replies[reads..].chunks(2).map(|pair| &pair[0]);
    let mut give_back = redis::pipe();
    let mut outcomes = Vec::with_capacity(batch.len());
    for ((waiting, counts), block) in batch.iter().zip(&counts).zip(blocks) {
        let policy = &waiting.policy;
        let replies: Vec<&Value> = added.by_ref().take(counts.len()).collect();
        let previous: Vec<&Value> = previous.by_ref().take(counts.len()).collect();
        let outcome = outcome(algorithm, policy, counts, &replies, &previous, block, now);
        if !matches!(&outcome, Outcome::Decided(Ok(d)) if d.allowed()) {
            for (count, reply) in counts.iter().zip(&replies) {
                if matches!(reply, Value::Int(_)) {
                    give_back.cmd("DECRBY").arg(&count.key).arg(policy.cost());
                    give_back
                        .cmd("PEXPIREAT")
                        .arg(&count.key)
                        .arg(expiry(count.expires));
                }
            }
        }
        outcomes.push(outcome);
    }
    if !give_back.is_empty() {
        // Within what is left of the timeout: a give-back that fails leaves
        // the cost counted (at most once), and the decisions stand.
        let left = timeout.saturating_sub(started.elapsed());
        if let Err(error) = send_back(connections, left, &give_back).await {
            tracing::debug!(%error, "redis: a denied {algorithm} check's cost was not given back");
        }
    }
    Ok(outcomes)
}

/// Where `rate`'s count is at Redis time `at` (µs): the key
/// `{state}:{window µs or calendar}:{window index}`, as the scripts name it.
fn count(algorithm: Algorithm, state: &str, rate: &Rate, at: u64) -> Count {
    let (index, end) = place(algorithm, rate, at);
    match (algorithm, rate.calendar()) {
        (Algorithm::SlidingWindow, _) => {
            let window = rate.window_micros();
            Count {
                key: format!("{state}:{window}:{index}"),
                index,
                // It counts as the previous window until the next one ends.
                expires: end.saturating_add(window),
                previous: Some(format!("{state}:{window}:{}", index.saturating_sub(1))),
            }
        }
        (_, None) => Count {
            key: format!("{state}:{}:{index}", rate.window_micros()),
            index,
            expires: end,
            previous: None,
        },
        (_, Some(calendar)) => Count {
            key: format!("{state}:{}:{index}", calendar.field()),
            index,
            expires: end,
            previous: None,
        },
    }
}

/// The index and end (µs) of `rate`'s window at `now`.
fn place(algorithm: Algorithm, rate: &Rate, now: u64) -> (u64, u64) {
    match algorithm {
        Algorithm::SlidingWindow => {
            let window = rate.window_micros();
            let index = now / window;
            (index, (index + 1) * window)
        }
        _ => {
            let (_, index, end) = fixed_window::place(rate, now);
            (index, end)
        }
    }
}

/// The `n` values of an `MGET`'s reply.
fn values<'a>(
    reply: &'a Value,
    n: usize,
    algorithm: Algorithm,
    what: &str,
) -> Result<&'a [Value], StoreError> {
    match reply {
        Value::Array(values) if values.len() == n => Ok(values),
        other => Err(StoreError::UnexpectedReply(format!(
            "{algorithm} batch: MGET of the {what} replied {other:?}"
        ))),
    }
}

/// The expiry (ms) of a count that stops counting at `end` (µs).
fn expiry(end: u64) -> u64 {
    end.div_ceil(1000)
}

/// One check's outcome from its block, its counts' `INCRBY` replies and
/// (the sliding window) its previous windows' counts, at Redis time `now`.
fn outcome(
    algorithm: Algorithm,
    policy: &Policy,
    counts: &[Count],
    replies: &[&Value],
    previous: &[&Value],
    block: &Value,
    now: u64,
) -> Outcome {
    // Placed at Redis's time, in the window every count was named by?
    if counts
        .iter()
        .zip(policy.rates())
        .any(|(count, rate)| place(algorithm, rate, now).0 != count.index)
    {
        return Outcome::Again;
    }
    if let Some(ends) = block_end(block)
        && ends > now
    {
        return Outcome::Decided(Ok(algorithm::blocked(policy, ends - now)));
    }
    let mut added = Vec::with_capacity(counts.len());
    for (i, (rate, reply)) in policy.rates().iter().zip(replies).enumerate() {
        let count = match reply {
            Value::Int(n) => u64::try_from(*n).unwrap_or(0),
            Value::ServerError(error) => {
                return Outcome::Decided(Err(StoreError::UnexpectedReply(format!(
                    "{algorithm}: {error}"
                ))));
            }
            other => {
                return Outcome::Decided(Err(StoreError::UnexpectedReply(format!(
                    "{algorithm}: INCRBY replied {other:?}"
                ))));
            }
        };
        // The sliding window's previous count, the fixed window's end.
        let other = match algorithm {
            Algorithm::SlidingWindow => match previous.get(i).map_or(Ok(0), |v| integer(v)) {
                Ok(previous) => previous,
                Err(error) => return Outcome::Decided(Err(error)),
            },
            _ => place(algorithm, rate, now).1,
        };
        added.push((count, other));
    }
    Outcome::Decided(Ok(match algorithm {
        Algorithm::SlidingWindow => sliding_window::decided_after_adding(policy, now, &added),
        _ => fixed_window::decided_after_adding(policy, now, &added),
    }))
}

/// A count read with `MGET` (none is zero).
fn integer(value: &Value) -> Result<u64, StoreError> {
    match value {
        Value::Nil => Ok(0),
        Value::BulkString(text) => std::str::from_utf8(text)
            .ok()
            .and_then(|text| text.parse::<i64>().ok())
            .map(|n| u64::try_from(n).unwrap_or(0))
            .ok_or_else(|| {
                StoreError::UnexpectedReply(format!(
                    "sliding window: an unreadable previous count {:?}",
                    String::from_utf8_lossy(text)
                ))
            }),
        other => Err(StoreError::UnexpectedReply(format!(
            "sliding window: a previous count of {other:?}"
        ))),
    }
}

/// The time (µs) a key's block ends, if it has one.
fn block_end(block: &Value) -> Option<u64> {
    match block {
        Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse().ok(),
        _ => None,
    }
}

/// Redis's `TIME` reply in µs.
fn redis_time(reply: &Value) -> Result<u64, StoreError> {
    let part = |value: &Value| match value {
        Value::BulkString(text) => std::str::from_utf8(text).ok()?.parse::<u64>().ok(),
        _ => None,
    };
    match reply {
        Value::Array(parts) if parts.len() == 2 => part(&parts[0])
            .zip(part(&parts[1]))
            .map(|(s, us)| s.saturating_mul(1_000_000).saturating_add(us)),
        _ => None,
    }
    .ok_or_else(|| StoreError::UnexpectedReply(format!("TIME replied {reply:?}")))
}

/// Whether a reply is a replica's refusal to write (nothing counted).
fn refused_as_replica(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(error) if error.code() == "READONLY")
}

/// Send the give-backs within `left`, never twice (a cost given back
/// twice would let a request too many in).
async fn send_back(
    connections: &Connections,
    left: Duration,
    give_back: &Pipeline,
) -> Result<(), StoreError> {
    Call::new(connections, left, "give-back")
        .run(|mut conn| async move {
            give_back
                .query_async::<Vec<Value>>(conn.get())
                .await
                .map(drop)
                .map_err(StoreError::from)
        })
        .await
}
