//! The sliding log on Redis: one sorted set per key, in a `MULTI`
//! transaction or a Lua script.

use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;

use super::connection::AnyConn;

use super::clock_sync::ClockSync;
use super::int_reply;
use crate::decision::{Decision, DecisionBuilder, RateState};
use crate::policy::{Policy, duration_micros};
use crate::store::StoreError;

/// The Lua source of the sliding log's `Script` execution (public so
/// benchmarks can feed the same script to `redis-benchmark`).
pub const SLIDING_LOG_SCRIPT: &str = include_str!("scripts/sliding_log.lua");

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(SLIDING_LOG_SCRIPT));

/// One `EVALSHA` (reloading the script after `NOSCRIPT`), on Redis's clock.
pub(super) async fn script<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    policy: &Policy,
    id: &str,
) -> Result<Decision, StoreError> {
    let mut cmd = super::evalsha(&SCRIPT, key);
    cmd.arg(policy.cost())
        .arg(policy.min_spacing().map_or(0, duration_micros))
        .arg(id);
    for rate in policy.rates() {
        cmd.arg(rate.max()).arg(rate.window_micros());
    }
    let reply = super::run_script(conn, &SCRIPT, &cmd).await?;
    let want = 2 + 3 * policy.rates().len();
    if reply.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "sliding log script: expected {want} values, got {}",
            reply.len()
        )));
    }
    let allowed = int_reply(&reply[0], "allowed")? == 1;
    let mut builder = DecisionBuilder::new(allowed);
    builder.wait(micros(int_reply(&reply[1], "spacing wait")?));
    for (rate, values) in policy.rates().iter().zip(reply[2..].chunks_exact(3)) {
        builder.rate(RateState {
            rate: *rate,
            remaining: u64::try_from(int_reply(&values[0], "remaining")?).unwrap_or(0),
            reset: micros(int_reply(&values[1], "reset")?),
            wait: micros(int_reply(&values[2], "wait")?),
        });
    }
    builder
        .build()
        .ok_or_else(|| StoreError::UnexpectedReply("no rate in the reply".to_owned()))
}

/// One `MULTI`/`EXEC` round trip, decided here. A denied request comes
/// back with the [`Cleanup`] that takes its entries out again.
pub(super) async fn transaction(
    conn: &mut AnyConn,
    key: &str,
    policy: &Policy,
    id: &str,
    clock: &ClockSync,
    timeout: Duration,
) -> Result<(Decision, Option<Cleanup>), StoreError> {
    let (now, refresh) = match clock.now() {
        Some(now) => now,
        None => {
            clock.measure(conn).await?;
            clock.now().ok_or_else(|| {
                StoreError::UnexpectedReply("TIME gave no usable clock sample".to_owned())
            })?
        }
    };
    let cost = policy.cost();
    let rates = policy.rates();
    let longest = duration_micros(policy.longest_window());
    let members: Vec<String> = if cost == 1 {
        vec![format!("{now}:{id}")]
    } else {
        (1..=cost).map(|j| format!("{now}:{id}:{j}")).collect()
    };

    let mut pipe = redis::pipe();
    pipe.atomic();
    pipe.cmd("ZREMRANGEBYSCORE")
        .arg(key)
        .arg("-inf")
        .arg(now.saturating_sub(longest))
        .ignore();
    let zadd = pipe.cmd("ZADD").arg(key);
    for member in &members {
        zadd.arg(now).arg(member);
    }
    zadd.ignore();
    for rate in rates {
        pipe.cmd("ZCOUNT")
            .arg(key)
            .arg(format!("({}", now.saturating_sub(rate.window_micros())))
            .arg("+inf");
    }
    for rate in rates {
        // With our entries the newest, the entry of reverse rank `max` is the
        // one whose leaving lets a request of `cost` in.
        pipe.cmd("ZREVRANGE")
            .arg(key)
            .arg(rate.max())
            .arg(rate.max())
            .arg("WITHSCORES");
    }
    // The newest entries, ours among them: the newest other one gives the
    // spacing and the reset of a denied request.
    pipe.cmd("ZREVRANGE")
        .arg(key)
        .arg(0)
        .arg(cost)
        .arg("WITHSCORES");
    pipe.cmd("PEXPIRE")
        .arg(key)
        .arg(longest.div_ceil(1_000))
        .ignore();
    if refresh {
        pipe.cmd("TIME");
    }
    // From here until the decision is known, an error or a dropped future
    // takes our entries back out (on the same connection, so after EXEC).
    let cleanup = Cleanup::new(conn, key, members, timeout);
    let members = &cleanup.members;
    let sent = clock.local_micros();
    let reply: Vec<Value> = pipe.query_async(conn).await?;
    let received = clock.local_micros();

    let n = rates.len();
    let want = 2 * n + 1 + usize::from(refresh);
    if reply.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "sliding log transaction: expected {want} replies, got {}",
            reply.len()
        )));
    }
    if refresh {
        let (secs, us) = time_reply(&reply[want - 1])?;
        clock.record(
            sent,
            received,
            secs.saturating_mul(1_000_000).saturating_add(us),
        );
    }
    let newest_other = scored_entries(&reply[2 * n])?
        .into_iter()
        .find(|(member, _)| !members.iter().any(|m| m.as_bytes() == member.as_slice()))
        .map(|(_, score)| score);

    let mut allowed = true;
    let mut spacing_wait = 0;
    if let (Some(spacing), Some(last)) = (policy.min_spacing(), newest_other) {
        let ready_at = last.saturating_add(duration_micros(spacing));
        if ready_at > now {
            allowed = false;
            spacing_wait = ready_at - now;
        }
    }
    let mut counts = Vec::with_capacity(n);
    for (i, rate) in rates.iter().enumerate() {
        // Counts include our own entries.
        let count = u64::try_from(int_reply(&reply[i], "ZCOUNT")?).unwrap_or(0);
        if count > rate.max() {
            allowed = false;
        }
        counts.push(count);
    }

    let mut builder = DecisionBuilder::new(allowed);
    builder.wait(Duration::from_micros(spacing_wait));
    for (i, rate) in rates.iter().enumerate() {
        let window = rate.window_micros();
        let others = counts[i].saturating_sub(cost);
        let state = if allowed {
            RateState {
                rate: *rate,
                remaining: rate.max().saturating_sub(counts[i]),
                reset: Duration::from_micros(window),
                wait: Duration::ZERO,
            }
        } else {
            let reset = match newest_other {
                Some(t) if others > 0 => (t + window).saturating_sub(now),
                _ => 0,
            };
            let wait = if counts[i] > rate.max() {
                scored_entries(&reply[n + i])?
                    .first()
                    .map_or(window, |&(_, t)| (t + window).saturating_sub(now))
            } else {
                0
            };
            RateState {
                rate: *rate,
                remaining: rate.max().saturating_sub(others),
                reset: Duration::from_micros(reset),
                wait: Duration::from_micros(wait),
            }
        };
        builder.rate(state);
    }
    let decision = builder
        .build()
        .ok_or_else(|| StoreError::UnexpectedReply("policy without rates".to_owned()))?;
    if allowed {
        cleanup.disarm();
        Ok((decision, None))
    } else {
        // Denied attempts must not count.
        Ok((decision, Some(cleanup)))
    }
}

/// Takes the entries of a request that must not count out of its sorted
/// set: run it, or drop it and it runs in a spawned task. It uses a clone
/// of the request's own multiplexed connection, so the `ZREM` reaches Redis
/// after the request's `EXEC`, even when the request timed out or its
/// future was dropped while waiting.
pub(super) struct Cleanup {
    conn: AnyConn,
    key: String,
    members: Vec<String>,
    timeout: Duration,
    armed: bool,
}

impl Cleanup {
    /// A clean-up of `members` of `key`, armed: it runs when dropped unless
    /// disarmed.
    pub(super) fn new(conn: &AnyConn, key: &str, members: Vec<String>, timeout: Duration) -> Self {
        Self {
            conn: conn.clone(),
            key: key.to_owned(),
            members,
            timeout,
            armed: true,
        }
    }

    /// Nothing to take out: the request's outcome is known.
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }

    /// Remove the entries now, within the timeout; failures are logged.
    pub(super) async fn run(mut self) {
        let outcome =
            tokio::time::timeout(self.timeout, zrem(&mut self.conn, &self.key, &self.members))
                .await;
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(
                %error,
                "could not remove a denied request's entry; it counts until its window passes"
            ),
            Err(_) => tracing::warn!(
                "removing a denied request's entry timed out; Redis runs it when it answers again"
            ),
        }
        self.armed = false;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut conn = self.conn.clone();
        let key = std::mem::take(&mut self.key);
        let members = std::mem::take(&mut self.members);
        let timeout = self.timeout;
        runtime.spawn(async move {
            let _ = tokio::time::timeout(timeout, zrem(&mut conn, &key, &members)).await;
        });
    }
}

async fn zrem(conn: &mut AnyConn, key: &str, members: &[String]) -> Result<(), redis::RedisError> {
    redis::cmd("ZREM")
        .arg(key)
        .arg(members)
        .query_async(conn)
        .await
}

fn micros(value: i64) -> Duration {
    Duration::from_micros(u64::try_from(value).unwrap_or(0))
}

/// `(member, score)` pairs of a `WITHSCORES` reply, RESP2 (flat) or RESP3 (pairs).
fn scored_entries(value: &Value) -> Result<Vec<(Vec<u8>, u64)>, StoreError> {
    let Value::Array(items) = value else {
        return Err(StoreError::UnexpectedReply(format!(
            "expected an array of scored members, got {value:?}"
        )));
    };
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut push = |member: &Value, score: &Value| -> Result<(), StoreError> {
        let Value::BulkString(member) = member else {
            return Err(StoreError::UnexpectedReply(format!(
                "expected a member, got {member:?}"
            )));
        };
        let score = u64::try_from(int_reply(score, "score")?).unwrap_or(0);
        out.push((member.clone(), score));
        Ok(())
    };
    if items.iter().all(|v| matches!(v, Value::Array(_))) {
        for pair in items {
            if let Value::Array(pair) = pair
                && let [member, score] = pair.as_slice()
            {
                push(member, score)?;
            }
        }
    } else {
        for pair in items.chunks_exact(2) {
            push(&pair[0], &pair[1])?;
        }
    }
    Ok(out)
}

fn time_reply(value: &Value) -> Result<(u64, u64), StoreError> {
    match value {
        Value::Array(parts) if parts.len() == 2 => Ok((
            u64::try_from(int_reply(&parts[0], "TIME seconds")?).unwrap_or(0),
            u64::try_from(int_reply(&parts[1], "TIME micros")?).unwrap_or(0),
        )),
        other => Err(StoreError::UnexpectedReply(format!("TIME: got {other:?}"))),
    }
}
