//! The sliding log's `Transaction` execution on Redis: one sorted set per
//! key, one `MULTI`/`EXEC` round trip, decided on the client by
//! [`algorithm::sliding_log::decide`] (the `Script` execution is
//! `scripts/sliding_log.lua`).

use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;

use super::clock_sync::ClockSync;
use super::reply::int_reply;
use super::script::Keys;
use crate::algorithm;
use crate::algorithm::sliding_log::{Log, Times};
use crate::decision::Decision;
use crate::policy::{Policy, Rate, duration_micros};
use crate::store::StoreError;

/// One `MULTI`/`EXEC` round trip, decided here, on this process's clock
/// corrected to Redis's ([`ClockSync`]).
///
/// The entries are written as `members` (the request's ids: a retry after a
/// lost reply writes the same entries again instead of adding more). Every
/// transaction also reads Redis's `TIME`, so the decision knows when Redis
/// really ran it, whatever the offset estimate says. Entries are stamped
/// `tolerance` after the local reading and windows counted from `tolerance`
/// before it, so a reading off by up to `tolerance` still counts every
/// entry that counts and dates none before Redis wrote it. Beyond that:
/// - Redis ran it *earlier* than the reading minus `tolerance` (only a clock
///   estimate that moved can do that): the counts may have missed entries;
///   the offset is taken from this transaction's `TIME` and it runs again.
/// - Redis ran it *later* (a stall on the way): the decision stands (it
///   counted more, not less), but an admitted request's entries would be
///   dated in the past; they are stamped again with Redis's time (`ZADD XX`:
///   always later than their first stamp, since Redis ran it later) before
///   the admission is returned. An admission whose restamp may
///   have run once Redis's clock was a shortest window (or the spacing)
///   past the old stamp is not returned (an error instead, and the entries
///   are taken out): another check might have counted past it meanwhile.
///
/// So it never admits more than `max`, at the price of denying about
/// `2 × tolerance` (at most `4 ×`, with readings off both ways) longer than
/// an exact limiter at the end of a window. The waits it suggests are padded
/// by `2 × tolerance`, so that a client that waits them is admitted whatever
/// its own reading, but never beyond the rate's window (a `Retry-After` of
/// 11 s for a `5/10s` policy reads as a wrong limit): a retry at the very
/// end of the window that the padding would have covered (within about
/// `2 × tolerance` of the first admission's window end) meets one more
/// denial, whose wait is those few milliseconds (over HTTP, a
/// `Retry-After` of 1 s, the least it says).
/// A denied request's entries are still in the set: the caller takes them
/// back out (but for a denial on the read of a key found full, which
/// wrote nothing: [`Verdict::Unwritten`]).
///
/// The transaction also reads the key's block: a key blocked when Redis ran
/// it is denied until the block ends, on Redis's clock (the entries it wrote
/// are then taken back out like any denied request's).
///
/// With `read_first` (a key found full, whose denial may last, on the
/// check's first attempt; only for a policy that [`reads_first`]), the log
/// is read before it is written: a check denied on what it reads writes
/// nothing ([`read_denial`]).
pub(super) async fn transaction<C: ConnectionLike>(
    conn: &mut C,
    keys: Keys<'_>,
    policy: &Policy,
    members: &[String],
    clock: &ClockSync,
    read_first: bool,
) -> Result<Verdict, StoreError> {
    let key = keys.state;
    if read_first && let Some(decision) = read_denial(conn, keys, policy, clock).await? {
        return Ok(Verdict::Unwritten(decision));
    }
    loop {
        let (now, refresh) = clock_now(conn, clock).await?;
        let tolerance = clock.tolerance();
        let sent = clock.local_micros();
        let reply = send(conn, keys, policy, members, now, tolerance, clock.seen()).await?;
        let received = clock.local_micros();
        let (decision, redis_now) = decide(&reply, policy, members, now, tolerance)?;
        clock.saw(redis_now);
        let off = redis_now.abs_diff(now) > tolerance;
        if redis_now.saturating_add(tolerance) < now {
            tracing::debug!(
                ahead_us = now - redis_now,
                tolerance_us = tolerance,
                "sliding log transaction: the clock estimate ran ahead of Redis; taking this sample"
            );
            // This sample comes from the node that holds the key (on a
            // cluster, a measurement's `TIME` may go to another).
            clock.replace(sent, received, redis_now);
            continue;
        }
        if refresh || off {
            clock.record(sent, received, redis_now);
        }
        let decision = match decision {
            Verdict::Decided(decision) => decision,
            // (`decide` gives no `Unwritten`: only a read does.)
            other @ (Verdict::Denied(_) | Verdict::Unwritten(_)) => return Ok(other),
        };
        if off && decision.allowed() {
            restamp(conn, key, members, redis_now.saturating_add(tolerance)).await?;
            let took = clock.local_micros().saturating_sub(sent);
            // Until the restamp ran, our entries carried `now + tolerance`:
            // a check whose own reading is behind Redis by at most
            // `tolerance` passes that stamp (counts or prunes past it) only
            // once Redis's clock is at `now + tolerance + shortest` (its
            // shortest window, or the spacing). The restamp ran at most
            // `took` after the transaction, which ran at `redis_now`.
            let shortest = shortest_window(policy);
            if redis_now.saturating_add(took)
                >= now.saturating_add(tolerance).saturating_add(shortest)
            {
                return Err(StoreError::Timeout(Duration::from_micros(took)));
            }
        }
        return Ok(Verdict::Decided(decision));
    }
}

/// What a transaction decided.
pub(super) enum Verdict {
    /// The decision.
    Decided(Decision),
    /// Denied on the log as read, before the request's entries were
    /// written ([`read_denial`]): there is nothing to take back out.
    Unwritten(Decision),
    /// Denied, on the log's counts alone (a policy of one rate and no
    /// spacing: an admission needs nothing else): the wait and the reset
    /// come from the log's newest entries, read when the request's own
    /// entries are taken back out ([`Denial::reads`], [`Denial::decide`]).
    Denied(Denial),
}

/// A request denied on its rate's count, waiting for the entries its wait
/// and reset come from.
pub(super) struct Denial {
    count: u64,
    times: Times,
    redis_now: u64,
}

impl Denial {
    /// The reads a denial's wait and reset come from: the newest entry of
    /// `key`, and the one of reverse rank `max - cost` (whose leaving lets
    /// a request of `cost` in), which for a cost of the max is the newest
    /// itself: one read. They follow the removal of the request's entries,
    /// in the same transaction, or make the read of a key found full
    /// ([`read_denial`]).
    pub(super) fn reads(key: &str, policy: &Policy) -> Vec<redis::Cmd> {
        let rank = policy
            .rates()
            .first()
            .map_or(0, |rate| rate.max().saturating_sub(policy.cost()));
        if rank == 0 {
            return vec![newest(key, 0, 0)];
        }
        vec![newest(key, 0, 0), newest(key, rank, rank)]
    }

    /// The decision from the replies of [`reads`](Self::reads); without
    /// them (the removal failed or took too long), the wait and the reset
    /// are the whole window.
    pub(super) fn decide(self, reads: Option<&[Value]>, policy: &Policy) -> Decision {
        let first = |value: &Value| -> Option<u64> {
            scored_entries(value).ok()?.first().map(|&(_, score)| score)
        };
        let (newest, blocker) = match reads {
            Some([newest, blocker] | [newest @ blocker]) => {
                // Read after the denial: an entry gone meanwhile (other
                // denied requests' taken out, a reset) leaves room now, a
                // wait of the padding alone, and a reset no shorter.
                let window = policy.rates().first().map_or(0, Rate::window_micros);
                let blocker = first(blocker).unwrap_or(self.redis_now.saturating_sub(window));
                (Some(first(newest).unwrap_or(blocker)), Some(blocker))
            }
            _ => (Some(self.redis_now), Some(self.redis_now)),
        };
        let view = Replies {
            counts: vec![self.count],
            newest,
            blockers: vec![blocker],
        };
        algorithm::sliding_log::decide(&view, policy, self.times)
    }
}

/// The times a decision counts and waits from: windows counted from
/// `tolerance` before the reading `now`, waits measured from Redis's time
/// and padded by `2 × tolerance`.
fn times(now: u64, tolerance: u64, redis_now: u64) -> Times {
    Times {
        at: now.saturating_sub(tolerance),
        from: redis_now,
        pad: tolerance.saturating_mul(2),
    }
}

/// Whether a key of `policy` found full is read before it is written
/// ([`read_denial`]): a policy of one rate and no spacing, whose
/// transaction reads only the count.
pub(super) fn reads_first(policy: &Policy) -> bool {
    !reads_entries(policy)
}

/// The denial of a check of a key found full, from one round trip that
/// only reads: the rate's count from `tolerance` before the clock
/// estimate's reading (the writing transaction's own bound), the entries a
/// denial's wait and reset come from ([`Denial::reads`]), the key's block
/// and Redis's `TIME`, decided as the writing transaction decides a denial
/// ([`Denial::decide`]). `None` (go on to write) when the log has room,
/// when the estimate asks for a fresh measurement, or when Redis's time is
/// off the reading by more than the tolerance: the writing transaction
/// deals with those. For a policy of one rate and no spacing
/// ([`reads_first`]).
///
/// A denial here is one the writing transaction would give on the same
/// log: it counts from the same bound, so it denies, as the transaction
/// does, up to about `2 × tolerance` longer at a window's end. It never
/// admits, so no error of the clock can admit too many; a reading ahead
/// of Redis's clock only counts fewer entries, and a count with room goes
/// on to the transaction.
async fn read_denial<C: ConnectionLike>(
    conn: &mut C,
    keys: Keys<'_>,
    policy: &Policy,
    clock: &ClockSync,
) -> Result<Option<Decision>, StoreError> {
    let Some((now, false)) = clock.now() else {
        return Ok(None);
    };
    let tolerance = clock.tolerance();
    let from = now.saturating_sub(tolerance);
    // Pipelined, not a transaction (nothing is written): `TIME` runs after
    // the reads, so a reply that waited still decides at the reads' time
    // or later.
    let reads = Denial::reads(keys.state, policy);
    let want = reads.len() + 3;
    let mut pipe = redis::pipe();
    read_log(&mut pipe, keys.state, policy, 0, from);
    for read in reads {
        pipe.add_command(read);
    }
    pipe.cmd("GET").arg(keys.block);
    pipe.cmd("TIME");
    let reply: Vec<Value> = pipe.query_async(conn).await?;
    let ([count, entries @ .., block, time], true) = (reply.as_slice(), reply.len() == want) else {
        return Err(StoreError::UnexpectedReply(format!(
            "sliding log read: expected {want} replies, got {}",
            reply.len()
        )));
    };
    let redis_now = redis_time(time)?;
    clock.saw(redis_now);
    if redis_now.abs_diff(now) > tolerance {
        return Ok(None);
    }
    if let Some(blocked) = blocked(block, policy, redis_now) {
        return Ok(Some(blocked));
    }
    let denial = Denial {
        count: u64::try_from(int_reply(count, "ZCOUNT")?).unwrap_or(0),
        times: times(now, tolerance, redis_now),
        redis_now,
    };
    let decision = denial.decide(Some(entries), policy);
    Ok((!decision.allowed()).then_some(decision))
}

/// Whether the transaction reads the log's newest entries (the spacing,
/// and the waits of several rates, need them to decide): else it reads the
/// count alone, and a denial reads the rest with its clean-up.
fn reads_entries(policy: &Policy) -> bool {
    policy.rates().len() > 1 || policy.min_spacing().is_some()
}

/// The clock estimate's reading of Redis's time and whether it asks for a
/// refresh, measured first when there is none yet.
async fn clock_now<C: ConnectionLike>(
    conn: &mut C,
    clock: &ClockSync,
) -> Result<(u64, bool), StoreError> {
    if let Some(now) = clock.now() {
        return Ok(now);
    }
    clock.measure(conn).await?;
    clock
        .now()
        .ok_or_else(|| StoreError::UnexpectedReply("TIME gave no usable clock sample".to_owned()))
}

/// The shortest window of `policy`, or its spacing if shorter (µs).
fn shortest_window(policy: &Policy) -> u64 {
    policy
        .rates()
        .iter()
        .map(|rate| rate.window_micros())
        .chain(policy.min_spacing().map(duration_micros))
        .min()
        .unwrap_or(0)
}

/// Date the entries of an admitted request at `stamp` (later only).
async fn restamp<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    members: &[String],
    stamp: u64,
) -> Result<(), StoreError> {
    let mut cmd = redis::cmd("ZADD");
    // `XX`: entries taken out meanwhile (by a clean-up) stay out. Redis
    // 3.0.2 has it (`GT` would need 6.2, and the new stamp is always later).
    cmd.arg(key).arg("XX");
    for member in members {
        cmd.arg(stamp).arg(member);
    }
    cmd.query_async::<()>(conn).await?;
    Ok(())
}

/// The transaction's commands, sent in one round trip.
async fn send<C: ConnectionLike>(
    conn: &mut C,
    keys: Keys<'_>,
    policy: &Policy,
    members: &[String],
    now: u64,
    tolerance: u64,
    clock_seen: u64,
) -> Result<Vec<Value>, StoreError> {
    let key = keys.state;
    let longest = policy.longest_window_micros();
    let stamp = now.saturating_add(tolerance);
    let from = now.saturating_sub(tolerance);
    // Entries are deleted only once they are out of every window by a time
    // Redis's clock has certainly passed: a reading that ran ahead (its
    // decision is then thrown away) must not delete live entries.
    let prune = from.min(clock_seen);

    let mut pipe = redis::pipe();
    pipe.atomic();
    pipe.cmd("ZREMRANGEBYSCORE")
        .arg(key)
        .arg("-inf")
        .arg(prune.saturating_sub(longest))
        .ignore();
    let zadd = pipe.cmd("ZADD").arg(key);
    for member in members {
        zadd.arg(stamp).arg(member);
    }
    zadd.ignore();
    read_log(&mut pipe, key, policy, members.len(), from);
    pipe.cmd("PEXPIRE")
        .arg(key)
        .arg(
            longest
                .saturating_add(tolerance.saturating_mul(2))
                .div_ceil(1_000),
        )
        .ignore();
    // The key's block, read in the same transaction.
    pipe.cmd("GET").arg(keys.block);
    // When Redis really ran it.
    pipe.cmd("TIME");
    Ok(pipe.query_async(conn).await?)
}

/// Add to `pipe` the reads of the log a decision needs, counted from
/// `from`: each rate's count, and where the policy needs them
/// ([`reads_entries`]) each rate's blocking entry and the newest entries
/// (the request's `ours` entries among them).
fn read_log(pipe: &mut redis::Pipeline, key: &str, policy: &Policy, ours: usize, from: u64) {
    let rates = policy.rates();
    for rate in rates {
        pipe.cmd("ZCOUNT")
            .arg(key)
            .arg(format!("({}", from.saturating_sub(rate.window_micros())))
            .arg("+inf");
    }
    if !reads_entries(policy) {
        return;
    }
    for rate in rates {
        // With our entries the newest, the entry of reverse rank `max` is the
        // one whose leaving lets a request of `cost` in.
        pipe.add_command(newest(key, rate.max(), rate.max()));
    }
    // The newest entries, ours among them: the newest other one gives the
    // spacing and the reset of a denied request.
    pipe.add_command(newest(key, 0, ours as u64));
}

/// The entries of `key` from reverse rank `first` to `last`, newest first,
/// with their stamps.
fn newest(key: &str, first: u64, last: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("ZREVRANGE");
    cmd.arg(key).arg(first).arg(last).arg("WITHSCORES");
    cmd
}

/// The decision from the transaction's replies, and Redis's time when it
/// ran, taken by the sliding log's own arithmetic
/// ([`algorithm::sliding_log::decide`]) on what the replies show of the
/// log. Counted from `now - tolerance`; waits are measured from Redis's time
/// and padded by `2 × tolerance` (at most the window), so a client that
/// waits them finds the entries gone for a check whose reading is off by up
/// to `tolerance`.
fn decide(
    reply: &[Value],
    policy: &Policy,
    members: &[String],
    now: u64,
    tolerance: u64,
) -> Result<(Verdict, u64), StoreError> {
    let rates = policy.rates();
    let n = rates.len();
    let entries = reads_entries(policy);
    let want = if entries { 2 * n + 3 } else { n + 2 };
    if reply.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "sliding log transaction: expected {want} replies, got {}",
            reply.len()
        )));
    }
    let redis_now = redis_time(&reply[want - 1])?;
    if let Some(blocked) = blocked(&reply[want - 2], policy, redis_now) {
        return Ok((Verdict::Decided(blocked), redis_now));
    }
    let cost = u64::try_from(members.len()).unwrap_or(u64::MAX);
    let times = times(now, tolerance, redis_now);
    if !entries {
        // One rate, no spacing: the count decides; a denial's wait and
        // reset are read later.
        let count = u64::try_from(int_reply(&reply[0], "ZCOUNT")?)
            .unwrap_or(0)
            .saturating_sub(cost);
        let view = Replies {
            counts: vec![count],
            newest: None,
            blockers: vec![None],
        };
        let decision = algorithm::sliding_log::decide(&view, policy, times);
        let verdict = if decision.allowed() {
            Verdict::Decided(decision)
        } else {
            Verdict::Denied(Denial {
                count,
                times,
                redis_now,
            })
        };
        return Ok((verdict, redis_now));
    }
    let newest = scored_entries(&reply[2 * n])?
        .into_iter()
        .find(|(member, _)| !members.iter().any(|m| m.as_bytes() == member.as_slice()))
        .map(|(_, score)| score);
    let mut counts = Vec::with_capacity(n);
    let mut blockers = Vec::with_capacity(n);
    for i in 0..n {
        // The counts include our own entries.
        let count = u64::try_from(int_reply(&reply[i], "ZCOUNT")?).unwrap_or(0);
        counts.push(count.saturating_sub(cost));
        // With our entries the newest, the entry of reverse rank `max` is
        // the one of reverse rank `max - cost` among the others.
        blockers.push(scored_entries(&reply[n + i])?.first().map(|&(_, t)| t));
    }
    let view = Replies {
        counts,
        newest,
        blockers,
    };
    Ok((
        Verdict::Decided(algorithm::sliding_log::decide(&view, policy, times)),
        redis_now,
    ))
}

/// What the transaction's replies show of the log, without the request's
/// own entries.
struct Replies {
    counts: Vec<u64>,
    newest: Option<u64>,
    /// Per rate: the entry of reverse rank `max - cost` among the others.
    blockers: Vec<Option<u64>>,
}

impl Log for Replies {
    fn count(&self, i: usize, _: &Rate) -> u64 {
        self.counts.get(i).copied().unwrap_or(0)
    }

    fn newest(&self) -> Option<u64> {
        self.newest
    }

    fn nth_newest(&self, i: usize, _: u64) -> Option<u64> {
        self.blockers.get(i).copied().flatten()
    }
}

/// The entries of one request of `cost` units: its id, or its id and `:j`
/// for each unit. The same in both executions, and the same on a retry, so
/// a retried request never counts twice.
pub(super) fn members(id: &str, cost: u64) -> Vec<String> {
    if cost == 1 {
        vec![id.to_owned()]
    } else {
        (1..=cost).map(|j| format!("{id}:{j}")).collect()
    }
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

/// Redis's time (µs) from its `TIME` reply.
fn redis_time(value: &Value) -> Result<u64, StoreError> {
    match value {
        Value::Array(parts) if parts.len() == 2 => {
            let secs = u64::try_from(int_reply(&parts[0], "TIME seconds")?).unwrap_or(0);
            let us = u64::try_from(int_reply(&parts[1], "TIME micros")?).unwrap_or(0);
            Ok(secs.saturating_mul(1_000_000).saturating_add(us))
        }
        other => Err(StoreError::UnexpectedReply(format!("TIME: got {other:?}"))),
    }
}

/// The decision of a key blocked at `redis_now` by the `block` read with
/// its log, if it is. A block value that is not a number blocks nothing,
/// as in the scripts.
fn blocked(block: &Value, policy: &Policy, redis_now: u64) -> Option<Decision> {
    let until = match block {
        Value::Nil => None,
        value => int_reply(value, "block")
            .ok()
            .and_then(|until| u64::try_from(until).ok()),
    }?;
    algorithm::block_left(until, redis_now).map(|left| algorithm::blocked(policy, left))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A denial whose entries could not be read waits, and resets, the
    /// whole window: never less than the log would say.
    #[test]
    fn a_denial_without_its_reads_waits_the_window() {
        let policy: Policy = "3/1s".parse().unwrap();
        let now = 1_700_000_000_000_000;
        let denial = || Denial {
            count: 3,
            times: Times {
                at: now - 5_000,
                from: now,
                pad: 10_000,
            },
            redis_now: now,
        };
        let decision = denial().decide(None, &policy);
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Duration::from_secs(1));
        assert_eq!(decision.reset(), Duration::from_secs(1));
        // Read: the oldest of the three 400 ms ago, the newest 100 ms ago.
        let entry = |ago: u64| {
            Value::Array(vec![
                Value::BulkString(b"id".to_vec()),
                Value::BulkString((now - ago).to_string().into_bytes()),
            ])
        };
        let read = [entry(100_000), entry(400_000)];
        let decision = denial().decide(Some(&read), &policy);
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Duration::from_micros(610_000));
        assert_eq!(decision.reset(), Duration::from_micros(910_000));
        // Read after other requests' entries went (the set holds one):
        // room now, a wait of the padding alone, and a reset no shorter.
        let read = [entry(100_000), Value::Array(Vec::new())];
        let decision = denial().decide(Some(&read), &policy);
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Duration::from_micros(10_000));
        assert_eq!(decision.reset(), Duration::from_micros(910_000));
        let empty = [Value::Array(Vec::new()), Value::Array(Vec::new())];
        let decision = denial().decide(Some(&empty), &policy);
        assert_eq!(decision.retry_after(), Duration::from_micros(10_000));
        assert_eq!(decision.reset(), Duration::from_micros(10_000));
    }
}
