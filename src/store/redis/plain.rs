//! The window counters' batched checks as plain commands: one `MULTI` …
//! `EXEC` transaction a batch, holding a `TIME`, an `MGET` of the blocks,
//! one of the sliding window's previous counts this process does not know
//! ([`previous_counts`](super::previous_counts)), one of the counts of the
//! checks it reads (below), and per counted check and rate an `INCRBY` of
//! the current window's count and a `PEXPIREAT` of it (the fixed window's
//! at the window's end; the sliding window's at the next one's, while it
//! counts as the previous window). Redis runs no script for an admission:
//! a check costs it about what the plain `INCRBY` + `EXPIRE` of a counter
//! costs. The transaction runs its commands together on one reading of
//! Redis's clock, with nothing between them, and a connection cut before
//! its `EXEC` runs none of them: no count is ever left without its expiry.
//!
//! The store counts first and decides on the counts after: a check is
//! admitted when every rate's count, with its cost, is within its max (an
//! `INCRBY` is atomic, so no two checks are admitted on the same room), and
//! answered at once. A check that is denied, blocked, failed or placed in
//! the wrong window has its cost taken back off (one script for the batch,
//! `scripts/give_back.lua`, which deletes a count that would go to zero or
//! below) before it is answered; a denied or misplaced one is then decided
//! again by the batch script, exactly (a denial taken here may have seen
//! another denied check's cost, not yet given back). A give-back that fails
//! leaves its cost counted: at most once, as a lost reply, and the denials
//! are then decided on counts holding their own cost.
//!
//! A check of a key found full ([`FullKeys`]) is read, not counted: denied
//! on the counts read (what the script would read on the same reading of
//! the clock), it is answered; with room, or placed in another window, the
//! script decides it. A denial then costs Redis less than an admission.
//!
//! The one inexactness: a reset or reward of a key between a denied
//! check's `INCRBY` and its give-back (one round trip) removes the denied
//! cost with the rest, and the give-back then takes it off the count again
//! (never below zero): up to the costs of the key's denials in flight at
//! that moment may be admitted over the max in that window.
//!
//! Windows follow Redis's clock, as the scripts' do: the counts are named
//! by the window this process places at Redis's time (its clock's offset
//! to Redis, measured from each batch's `TIME`), and the batch's `TIME`
//! checks the placing: a check whose counts are not in the window it says
//! (its clock and Redis's a window boundary apart, no offset measured yet)
//! gives its cost back and is decided again by the script.

use std::time::Duration;

use redis::Value;

use super::batch::{Waiting, answer_all};
use super::call::Call;
use super::clock_sync::ClockSync;
use super::connection::Connections;
use super::full_keys::FullKeys;
use super::previous_counts::PreviousCounts;
use super::window_counts::{Count, count, expiry, place};
use crate::algorithm;
use crate::algorithm::{fixed_window, sliding_window};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy};
use crate::store::StoreError;

/// What became of one check of a batch.
enum Outcome {
    /// Admitted: answered at once.
    Admitted(Decision),
    /// Denied on these counts (each rate's count after the `INCRBY`, and
    /// the sliding window's previous count or the fixed window's end): its
    /// cost is given back and the script decides it (on these counts, with
    /// its own cost still in them, when the give-back failed).
    Denied(Vec<(u64, u64)>),
    /// Blocked, or failed: answered once its cost is given back.
    Answered(Result<Decision, StoreError>),
    /// Placed in another window than Redis's clock says: its cost is given
    /// back and the script decides it.
    Again,
    /// Read, not counted, and not to be denied on what was read (there is
    /// room, or it was placed in another window): the script decides it.
    Script,
}

/// The latest Redis time a reply may show (µs: the end of the year 9999);
/// a later one is not a clock.
const MAX_REDIS_TIME: u64 = 253_402_300_799_999_999;

/// Decide and answer `batch`'s checks of `algorithm` (a window counter)
/// with plain commands within `timeout`: a check of a key `full` holds is
/// read, not counted (denied on the counts read, else decided by the
/// script), the others counted; the sliding window's previous counts are
/// read unless `known` holds them (a read check's always are). The checks
/// the script must decide. A failure of the batch is every check's (it may
/// have counted).
pub(super) async fn decide(
    connections: &Connections,
    timeout: Duration,
    clock: &ClockSync,
    algorithm: Algorithm,
    full: &FullKeys,
    known: Option<&PreviousCounts>,
    batch: Vec<Waiting>,
) -> Vec<Waiting> {
    let started = tokio::time::Instant::now();
    let at = clock
        .now()
        .map_or_else(|| clock.local_micros(), |(now, _)| now);
    let checks: Vec<Check> = batch
        .iter()
        .map(|waiting| Check {
            reads: full.holds(&waiting.state, &waiting.policy, waiting.now),
            counts: waiting
                .policy
                .rates()
                .iter()
                .map(|rate| count(algorithm, &waiting.state, rate, at))
                .collect(),
        })
        .collect();
    // The sliding window's previous counts this process holds, for the
    // checks that count; the others are read.
    let counted_previous = || {
        checks
            .iter()
            .filter(|check| !check.reads)
            .flat_map(|check| &check.counts)
            .filter_map(|count| count.previous.as_deref())
    };
    let known_counts: Vec<Option<u64>> = match known {
        Some(known) => known.known(counted_previous()),
        None => Vec::new(),
    };
    let mut known_counts = known_counts.into_iter();
    let known_previous: Vec<Vec<Option<u64>>> = checks
        .iter()
        .map(|check| {
            check
                .counts
                .iter()
                .filter(|count| count.previous.is_some())
                .map(|_| {
                    if check.reads {
                        None
                    } else {
                        known_counts.next().flatten()
                    }
                })
                .collect()
        })
        .collect();
    let unknown: Vec<&Count> = checks
        .iter()
        .zip(&known_previous)
        .flat_map(|(check, known)| {
            check
                .counts
                .iter()
                .filter(|count| count.previous.is_some())
                .zip(known)
        })
        .filter(|(_, known)| known.is_none())
        .map(|(count, _)| count)
        .collect();
    let read: Vec<&Count> = checks
        .iter()
        .filter(|check| check.reads)
        .flat_map(|check| &check.counts)
        .collect();
    let counted = checks
        .iter()
        .filter(|check| !check.reads)
        .map(|check| check.counts.len())
        .sum::<usize>();
    // One transaction: its commands run together, on one reading of
    // Redis's clock, with nothing between them (a reset, another batch's
    // give-back), and a connection cut before its `EXEC` runs none of them.
    let mut pipe = redis::pipe();
    pipe.atomic().ignore_errors();
    pipe.cmd("TIME");
    let blocks = pipe.cmd("MGET");
    for waiting in &batch {
        blocks.arg(&waiting.block);
    }
    if !unknown.is_empty() {
        let previous = pipe.cmd("MGET");
        for count in &unknown {
            previous.arg(&count.previous);
        }
    }
    if !read.is_empty() {
        let current = pipe.cmd("MGET");
        for count in &read {
            current.arg(&count.key);
        }
    }
    for (waiting, check) in batch.iter().zip(&checks) {
        if check.reads {
            continue;
        }
        for count in &check.counts {
            // (An expiry already past, for a check placed in an ended
            // window, deletes the count at once: it is given back anyway.)
            pipe.cmd("INCRBY")
                .arg(&count.key)
                .arg(waiting.policy.cost());
            pipe.cmd("PEXPIREAT")
                .arg(&count.key)
                .arg(expiry(count.expires));
        }
    }
    let sent = clock.local_micros();
    let replies: Result<Vec<Value>, StoreError> = Call::new(connections, timeout, "batch")
        .replica_reply(|replies: &Vec<Value>| replies.iter().any(refused_as_replica))
        .run(|mut conn| {
            let pipe = &pipe;
            async move { Ok(pipe.query_async(conn.get()).await?) }
        })
        .await;
    let received = clock.local_micros();
    let replies = match replies {
        Ok(replies) => replies,
        Err(error) => {
            answer_all(batch, &error);
            return Vec::new();
        }
    };
    let Replies {
        now,
        blocks,
        previous,
        current,
        counted: added,
    } = match parse(
        &replies,
        algorithm,
        batch.len(),
        [unknown.len(), read.len()],
        counted,
    ) {
        Ok(replies) => replies,
        Err(error) => {
            answer_all(batch, &error);
            return Vec::new();
        }
    };
    clock.record(sent, received, now);
    let mut previous = previous.iter();
    let mut current = current.iter();
    let mut added = added.chunks(2).map(|pair| &pair[0]);
    let mut learned: Vec<(&str, u64, u64)> = Vec::new();
    let mut stale: Vec<&str> = Vec::new();
    let mut give_back = GIVE_BACK.prepare_invoke();
    let mut given = 0;
    let mut outcomes = Vec::with_capacity(batch.len());
    for (((waiting, check), block), known) in batch
        .into_iter()
        .zip(&checks)
        .zip(blocks)
        .zip(known_previous)
    {
        let policy = &waiting.policy;
        let n = check.counts.len();
        let counts = if check.reads {
            Counts::Read(current.by_ref().take(n).collect())
        } else {
            Counts::Added(added.by_ref().take(n).collect())
        };
        // Each count's previous count (the sliding window's): known, or read.
        let previous: Vec<Previous<'_>> = known
            .into_iter()
            .map(|known| match known {
                Some(count) => Previous::Known(count),
                None => Previous::Read(previous.next().unwrap_or(&Value::Nil)),
            })
            .collect();
        let outcome = outcome(
            algorithm,
            policy,
            &check.counts,
            &counts,
            &previous,
            block,
            now,
        );
        // Counts read in their window's successor are kept, when the
        // transaction wrote (so it ran on a primary, not on a replica a
        // connection was left on); a denial on a count known reads it again
        // next time (it may have shrunk).
        if !matches!(outcome, Outcome::Again | Outcome::Script) {
            for ((count, previous), rate) in check.counts.iter().zip(&previous).zip(policy.rates())
            {
                let Some(key) = count.previous.as_deref() else {
                    continue;
                };
                match previous {
                    // A previous count until the current window ends.
                    Previous::Read(value) if counted > 0 => {
                        if let Ok(read) = integer(value) {
                            learned.push((key, read, place(algorithm, rate, now).1));
                        }
                    }
                    Previous::Read(_) => {}
                    Previous::Known(_) if matches!(outcome, Outcome::Denied(_)) => stale.push(key),
                    Previous::Known(_) => {}
                }
            }
        }
        if let Counts::Added(replies) = &counts
            && !matches!(outcome, Outcome::Admitted(_))
        {
            for (count, reply) in check.counts.iter().zip(replies) {
                if matches!(reply, Value::Int(_)) {
                    give_back.key(&count.key).arg(policy.cost());
                    given += 1;
                }
            }
        }
        outcomes.push((waiting, check.reads, outcome));
    }
    // What was read is kept before any check is answered: a command the
    // caller sends next then drops it.
    if let Some(known) = known {
        known.learn(&learned, now);
        known.forget(stale.into_iter());
    }
    let mut pending = Vec::new();
    for (waiting, reads, outcome) in outcomes {
        match outcome {
            // Answered before any give-back of the batch.
            Outcome::Admitted(decision) => {
                let _ = waiting.reply.send(Ok(decision));
            }
            // Denied on the counts read: kept full until it ends.
            Outcome::Answered(Ok(decision)) if reads => {
                full.learn(&waiting.state, &waiting.policy, &decision, waiting.now);
                let _ = waiting.reply.send(Ok(decision));
            }
            outcome => pending.push((waiting, outcome)),
        }
    }
    // Within what is left of the timeout. Given back, the denied checks are
    // decided again by the script, on the counts as they are then (a denial
    // decided here may have seen another denied check's cost, not yet given
    // back: its wait would be too long). A give-back that fails leaves the
    // costs counted (at most once): the denials are then decided on counts
    // that hold their own cost, and the misplaced checks fail.
    let given_back = given == 0
        || {
            let left = timeout.saturating_sub(started.elapsed());
            match send_back(connections, left, &give_back).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::debug!(%error, "redis: denied {algorithm} checks' costs were not given back");
                    false
                }
            }
        };
    let mut again = Vec::new();
    for (waiting, outcome) in pending {
        let answer = match outcome {
            Outcome::Admitted(decision) => Ok(decision),
            Outcome::Script => {
                again.push(waiting);
                continue;
            }
            Outcome::Denied(_) | Outcome::Again if given_back => {
                again.push(waiting);
                continue;
            }
            // Not given back: decided on counts that hold its own cost.
            Outcome::Denied(mut added) => {
                let cost = waiting.policy.cost();
                for (count, _) in &mut added {
                    *count = count.saturating_add(cost);
                }
                Ok(decided(algorithm, &waiting.policy, now, &added))
            }
            Outcome::Answered(answer) => answer,
            Outcome::Again => Err(StoreError::UnexpectedReply(format!(
                "{algorithm} batch: a check counted in another window than Redis's clock's, \
                 and not given back"
            ))),
        };
        let _ = waiting.reply.send(answer);
    }
    again
}

/// One check of a batch: its counts, and whether they are read (its key
/// held full) or counted.
struct Check {
    reads: bool,
    counts: Vec<Count>,
}

/// A check's counts as the batch found them: read (`MGET`), or after its
/// `INCRBY`s (their replies).
enum Counts<'a> {
    Read(Vec<&'a Value>),
    Added(Vec<&'a Value>),
}

/// The decision on counts added to first.
fn decided(algorithm: Algorithm, policy: &Policy, now: u64, added: &[(u64, u64)]) -> Decision {
    match algorithm {
        Algorithm::SlidingWindow => sliding_window::decided_after_adding(policy, now, added),
        _ => fixed_window::decided_after_adding(policy, now, added),
    }
}

/// A batch's replies, read.
struct Replies<'a> {
    /// Redis's time (µs).
    now: u64,
    /// Each check's block.
    blocks: &'a [Value],
    /// The sliding window's previous counts not known, in order.
    previous: &'a [Value],
    /// The counts of the checks read, in order.
    current: &'a [Value],
    /// An `INCRBY`'s and a `PEXPIREAT`'s reply a rate of each check
    /// counted.
    counted: &'a [Value],
}

/// A batch's `replies` read, for its `checks`, the previous and current
/// counts it read (`mgets`) and the `rates` it counted, after checking
/// that every reply is there.
fn parse(
    replies: &[Value],
    algorithm: Algorithm,
    checks: usize,
    mgets: [usize; 2],
    rates: usize,
) -> Result<Replies<'_>, StoreError> {
    let reads = 2 + mgets.iter().filter(|&&n| n > 0).count();
    if replies.len() != reads + 2 * rates {
        return Err(StoreError::UnexpectedReply(format!(
            "{algorithm} batch: {} replies for {}",
            replies.len(),
            reads + 2 * rates
        )));
    }
    let now = redis_time(&replies[0])?;
    let blocks = values(&replies[1], checks, algorithm, "blocks")?;
    let mut next = 2;
    let mut mget = |n: usize, what: &str| -> Result<&[Value], StoreError> {
        if n == 0 {
            return Ok(&[]);
        }
        next += 1;
        values(&replies[next - 1], n, algorithm, what)
    };
    let previous = mget(mgets[0], "previous counts")?;
    let current = mget(mgets[1], "counts")?;
    Ok(Replies {
        now,
        blocks,
        previous,
        current,
        counted: &replies[reads..],
    })
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

/// A sliding window's previous count: known, or as read in the batch.
#[derive(Clone, Copy)]
enum Previous<'a> {
    Known(u64),
    Read(&'a Value),
}

/// One check's outcome from its block, its counts (read, or its
/// `INCRBY`s' replies) and (the sliding window) its previous windows'
/// counts, at Redis time `now`.
fn outcome(
    algorithm: Algorithm,
    policy: &Policy,
    keys: &[Count],
    counts: &Counts<'_>,
    previous: &[Previous<'_>],
    block: &Value,
    now: u64,
) -> Outcome {
    let reads = matches!(counts, Counts::Read(_));
    // Counted in the window every count was named by?
    if keys
        .iter()
        .zip(policy.rates())
        .any(|(count, rate)| place(algorithm, rate, now).0 != count.index)
    {
        return if reads {
            Outcome::Script
        } else {
            Outcome::Again
        };
    }
    if let Some(ends) = block_end(block)
        && ends > now
    {
        return Outcome::Answered(Ok(algorithm::blocked(policy, ends - now)));
    }
    let replies = match counts {
        Counts::Read(values) | Counts::Added(values) => values,
    };
    let mut added = Vec::with_capacity(keys.len());
    for (i, (rate, reply)) in policy.rates().iter().zip(replies).enumerate() {
        let count = match (reads, reply) {
            // As if counted.
            (true, value) => match integer(value) {
                Ok(count) => count.saturating_add(policy.cost()),
                Err(error) => return Outcome::Answered(Err(error)),
            },
            (false, Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
            (false, Value::ServerError(error)) => {
                return Outcome::Answered(Err(StoreError::UnexpectedReply(format!(
                    "{algorithm}: {error}"
                ))));
            }
            (false, other) => {
                return Outcome::Answered(Err(StoreError::UnexpectedReply(format!(
                    "{algorithm}: INCRBY replied {other:?}"
                ))));
            }
        };
        // The sliding window's previous count, the fixed window's end.
        let other = match algorithm {
            Algorithm::SlidingWindow => {
                match previous.get(i).map_or(Ok(0), |previous| match previous {
                    Previous::Known(count) => Ok(*count),
                    Previous::Read(value) => integer(value),
                }) {
                    Ok(previous) => previous,
                    Err(error) => return Outcome::Answered(Err(error)),
                }
            }
            _ => place(algorithm, rate, now).1,
        };
        added.push((count, other));
    }
    let decision = decided(algorithm, policy, now, &added);
    match (reads, decision.allowed()) {
        (false, true) => Outcome::Admitted(decision),
        (false, false) => Outcome::Denied(added),
        // Room: the script counts it.
        (true, true) => Outcome::Script,
        (true, false) => Outcome::Answered(Ok(decision)),
    }
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
                    "window counter: an unreadable count {:?}",
                    String::from_utf8_lossy(text)
                ))
            }),
        other => Err(StoreError::UnexpectedReply(format!(
            "window counter: a count of {other:?}"
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
            .map(|(s, us)| s.saturating_mul(1_000_000).saturating_add(us))
            .filter(|&us| us <= MAX_REDIS_TIME),
        _ => None,
    }
    .ok_or_else(|| StoreError::UnexpectedReply(format!("TIME replied {reply:?}")))
}

/// Whether a reply is a replica's refusal to write (nothing counted).
fn refused_as_replica(reply: &Value) -> bool {
    matches!(reply, Value::ServerError(error) if error.code() == "READONLY")
}

/// The script that gives denied checks' costs back.
static GIVE_BACK: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("scripts/give_back.lua")));

/// Send the give-backs within `left`, never twice (a cost given back
/// twice would let a request too many in): sent again only when Redis
/// refused the script before running it, or did not have it.
async fn send_back(
    connections: &Connections,
    left: Duration,
    give_back: &redis::ScriptInvocation<'_>,
) -> Result<(), StoreError> {
    Call::new(connections, left, "give-back")
        .script(Some(&GIVE_BACK))
        .run(|mut conn| async move {
            give_back
                .invoke_async::<Value>(conn.get())
                .await
                .map(drop)
                .map_err(StoreError::from)
        })
        .await
}
