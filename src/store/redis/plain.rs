//! The fixed window's batched checks as plain commands, pipelined on one
//! connection: per check and rate an `INCRBY` of the window's count and a
//! `PEXPIREAT` at its end, and per batch one `TIME` and one `MGET` of the
//! blocks. Redis runs no script: a check costs it about what the plain
//! `INCRBY` + `EXPIRE` of a counter costs.
//!
//! The store counts first and decides on the counts after: a check is
//! admitted when every rate's count is at most its max (an `INCRBY` is
//! atomic, so never more than `max` are admitted in a window). A check
//! that is denied, blocked, failed or placed in the wrong window has its
//! cost taken back off (`DECRBY`, with the window's expiry again: a count
//! that expired meanwhile is not left behind without one) before it is
//! answered, so a denied request counts nothing. A give-back that fails
//! leaves its cost counted: at most once, as a lost reply.
//!
//! Windows follow Redis's clock, as the script's do: the counts are named
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
use crate::algorithm::fixed_window;
use crate::decision::Decision;
use crate::policy::Rate;
use crate::store::StoreError;

/// What became of one check of a batch.
pub(super) enum Outcome {
    /// Decided (or failed) here.
    Decided(Result<Decision, StoreError>),
    /// Placed in another window than Redis's clock says: its cost was
    /// given back; the script decides it.
    Again,
}

/// One rate's count of one check: its key, its window's index and end.
struct Count {
    key: String,
    index: u64,
    end: u64,
}

/// Decide `batch`'s fixed-window checks with plain commands within
/// `timeout`; an error is the whole batch's (it may have counted).
pub(super) async fn decide(
    connections: &Connections,
    timeout: Duration,
    clock: &ClockSync,
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
                .map(|rate| count(&waiting.state, rate, at))
                .collect()
        })
        .collect();
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    pipe.cmd("TIME");
    let blocks = pipe.cmd("MGET");
    for waiting in batch {
        blocks.arg(&waiting.block);
    }
    for (waiting, counts) in batch.iter().zip(&counts) {
        for count in counts {
            pipe.cmd("INCRBY")
                .arg(&count.key)
                .arg(waiting.policy.cost());
            pipe.cmd("PEXPIREAT").arg(&count.key).arg(expiry(count.end));
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
    let want = 2 + 2 * counts.iter().map(Vec::len).sum::<usize>();
    if replies.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "fixed window batch: {} replies for {want}",
            replies.len()
        )));
    }
    let now = redis_time(&replies[0])?;
    clock.record(sent, received, now);
    let blocks = match &replies[1] {
        Value::Array(blocks) if blocks.len() == batch.len() => blocks,
        other => {
            return Err(StoreError::UnexpectedReply(format!(
                "fixed window batch: MGET of the blocks replied {other:?}"
            )));
        }
    };
    let mut added = replies[2..].chunks(2).map(|pair| &pair[0]);
    let mut give_back = redis::pipe();
    let mut outcomes = Vec::with_capacity(batch.len());
    for ((waiting, counts), block) in batch.iter().zip(&counts).zip(blocks) {
        let policy = &waiting.policy;
        let replies: Vec<&Value> = added.by_ref().take(counts.len()).collect();
        let outcome = outcome(policy, counts, &replies, block, now);
        if !matches!(&outcome, Outcome::Decided(Ok(d)) if d.allowed()) {
            for (count, reply) in counts.iter().zip(&replies) {
                if matches!(reply, Value::Int(_)) {
                    give_back.cmd("DECRBY").arg(&count.key).arg(policy.cost());
                    give_back
                        .cmd("PEXPIREAT")
                        .arg(&count.key)
                        .arg(expiry(count.end));
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
            tracing::debug!(%error, "redis: a denied fixed-window check's cost was not given back");
        }
    }
    Ok(outcomes)
}

/// Where `rate`'s count is at Redis time `at` (µs): the key
/// `{state}:{window µs or calendar}:{window index}`, as the scripts name it.
fn count(state: &str, rate: &Rate, at: u64) -> Count {
    let (_, index, end) = fixed_window::place(rate, at);
    let key = match rate.calendar() {
        None => format!("{state}:{}:{index}", rate.window_micros()),
        Some(calendar) => format!("{state}:{}:{index}", calendar.field()),
    };
    Count { key, index, end }
}

/// The expiry of a count whose window ends at `end` (µs), in ms.
fn expiry(end: u64) -> u64 {
    end.div_ceil(1000)
}

/// One check's outcome from its block and its counts' `INCRBY` replies, at
/// Redis time `now`.
fn outcome(
    policy: &crate::policy::Policy,
    counts: &[Count],
    replies: &[&Value],
    block: &Value,
    now: u64,
) -> Outcome {
    // Placed at Redis's time, in the window every count was named by?
    if counts
        .iter()
        .zip(policy.rates())
        .any(|(count, rate)| fixed_window::place(rate, now).1 != count.index)
    {
        return Outcome::Again;
    }
    if let Some(ends) = block_end(block)
        && ends > now
    {
        return Outcome::Decided(Ok(algorithm::blocked(policy, ends - now)));
    }
    let mut added = Vec::with_capacity(counts.len());
    for (count, reply) in counts.iter().zip(replies) {
        match reply {
            Value::Int(n) => added.push((u64::try_from(*n).unwrap_or(0), count.end)),
            Value::ServerError(error) => {
                return Outcome::Decided(Err(StoreError::UnexpectedReply(format!(
                    "fixed window: {error}"
                ))));
            }
            other => {
                return Outcome::Decided(Err(StoreError::UnexpectedReply(format!(
                    "fixed window: INCRBY replied {other:?}"
                ))));
            }
        }
    }
    Outcome::Decided(Ok(fixed_window::decided_after_adding(policy, now, &added)))
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
