//! The Lua scripts: each built at compile time from one prelude (Redis's
//! clock, the arguments, the block), the algorithm's file and an entry point
//! (a check, or an operator's command); how they are called; and the one
//! decoder of their replies.
//!
//! Every script takes two keys of one hash tag (one cluster slot): the
//! algorithm's state (`{prefix}:{algorithm}:{key}`) and the key's block
//! (`{prefix}:block:{key}`). Every reply is
//! `{allowed (1/0), spacing wait µs, then per rate: remaining, reset µs, wait µs}`,
//! or `{-1, time left µs}` for a blocked key: a check (and each check of a
//! batch) replies these integers as one string, separated by spaces (one
//! value for redis-rs to parse, not five: its parser's cost is per value),
//! an operator's command as an array. [`decode_reply`] reads either.

use redis::Value;
use redis::aio::ConnectionLike;

use super::reply::{int_reply, member};
use crate::algorithm;
use crate::algorithm::CONCURRENCY_RETRY_CAP;
use crate::decision::{Decision, DecisionBuilder, Micros, RateStatus};
use crate::policy::{Algorithm, Policy, Rate, duration_micros};
use crate::store::{Command, StoreError};

/// A check script: no entry-point arguments, then the algorithm's.
macro_rules! check_script {
    ($file:literal) => {
        concat!(
            "local ARG0 = 0\n",
            include_str!("scripts/prelude.lua"),
            include_str!($file),
            include_str!("scripts/check.lua"),
        )
    };
}

/// A command script: the command, its amount and an id, then the
/// algorithm's arguments.
macro_rules! command_script {
    ($file:literal) => {
        concat!(
            "local ARG0 = 3\n",
            include_str!("scripts/prelude.lua"),
            include_str!($file),
            include_str!("scripts/command.lua"),
        )
    };
}

/// A batch script: the algorithm's file bound to each checked key in turn.
macro_rules! batch_script {
    ($file:literal) => {
        concat!(
            "local ARG0 = 0\n",
            include_str!("scripts/prelude.lua"),
            include_str!($file),
            include_str!("scripts/batch.lua"),
        )
    };
}

/// The Lua source of the sliding log's `Script` execution (public so
/// benchmarks can feed the same script to `redis-benchmark`). `KEYS` are
/// the key's sorted set and its block; `ARGV` the cost, the minimum spacing
/// in µs (0: none), a request id, then each rate's max and window in µs.
pub const SLIDING_LOG_SCRIPT: &str = check_script!("scripts/sliding_log.lua");
/// The Lua source of [`Algorithm::FixedWindow`]. `KEYS` are the name its
/// counts start with (each rate's count in its current window is an
/// integer at `{name}:{window µs or calendar}:{window index}`) and its
/// block; `ARGV` the cost, then each rate's max and window in µs.
pub const FIXED_WINDOW_SCRIPT: &str = check_script!("scripts/fixed_window.lua");
/// The Lua source of [`Algorithm::SlidingWindow`]. `KEYS` are the name its
/// counts start with (each rate's count of a window is an integer at
/// `{name}:{window µs}:{window index}`) and its block; `ARGV` the cost,
/// then each rate's max and window in µs.
pub const SLIDING_WINDOW_SCRIPT: &str = check_script!("scripts/sliding_window.lua");
/// The Lua source of [`Algorithm::Gcra`]. `KEYS` are the key's hash and its
/// block; `ARGV` the cost, then each rate's max and window in µs.
pub const GCRA_SCRIPT: &str = check_script!("scripts/gcra.lua");
/// The Lua source of [`Algorithm::Concurrency`]. `KEYS` are the key's
/// sorted set of leases and its block; `ARGV` the max, the lease time in
/// µs, the lease id and the longest suggested wait in µs.
pub const CONCURRENCY_SCRIPT: &str = check_script!("scripts/concurrency.lua");

/// The Lua source of the sliding log's operator commands
/// ([`Store::command`](crate::Store::command)), in either execution.
/// `ARGV` is the command (`peek`, `reset`, `block`, `penalty`, `reward`),
/// its amount (µs of a block, units of a penalty or reward), an id, then
/// [`SLIDING_LOG_SCRIPT`]'s arguments.
pub const SLIDING_LOG_COMMAND_SCRIPT: &str = command_script!("scripts/sliding_log.lua");
/// The operator commands of [`Algorithm::FixedWindow`] (arguments as
/// [`SLIDING_LOG_COMMAND_SCRIPT`]'s, then [`FIXED_WINDOW_SCRIPT`]'s).
pub const FIXED_WINDOW_COMMAND_SCRIPT: &str = command_script!("scripts/fixed_window.lua");
/// The operator commands of [`Algorithm::SlidingWindow`] (arguments as
/// [`SLIDING_LOG_COMMAND_SCRIPT`]'s, then [`SLIDING_WINDOW_SCRIPT`]'s).
pub const SLIDING_WINDOW_COMMAND_SCRIPT: &str = command_script!("scripts/sliding_window.lua");
/// The operator commands of [`Algorithm::Gcra`] (arguments as
/// [`SLIDING_LOG_COMMAND_SCRIPT`]'s, then [`GCRA_SCRIPT`]'s).
pub const GCRA_COMMAND_SCRIPT: &str = command_script!("scripts/gcra.lua");
/// The operator commands of [`Algorithm::Concurrency`] (arguments as
/// [`SLIDING_LOG_COMMAND_SCRIPT`]'s, then [`CONCURRENCY_SCRIPT`]'s).
pub const CONCURRENCY_COMMAND_SCRIPT: &str = command_script!("scripts/concurrency.lua");

/// The batch of checks of [`Algorithm::FixedWindow`] (the store sends its
/// batches as plain commands, and this script for the checks placed in
/// another window than Redis's clock): `KEYS` are the checked keys' names,
/// then their blocks in the same order; `ARGV` the
/// number of distinct policies, each policy as its number of arguments and
/// [`FIXED_WINDOW_SCRIPT`]'s arguments, then (with more than one policy)
/// each check's policy, from 1. Replies with each check's reply.
pub const FIXED_WINDOW_BATCH_SCRIPT: &str = batch_script!("scripts/fixed_window.lua");
/// The batch of checks of [`Algorithm::SlidingWindow`] (as
/// [`FIXED_WINDOW_BATCH_SCRIPT`], with [`SLIDING_WINDOW_SCRIPT`]'s
/// arguments).
pub const SLIDING_WINDOW_BATCH_SCRIPT: &str = batch_script!("scripts/sliding_window.lua");
/// The batch of checks of [`Algorithm::Gcra`] (as
/// [`FIXED_WINDOW_BATCH_SCRIPT`], with [`GCRA_SCRIPT`]'s arguments), but a
/// decided check's reply is bytes: admitted (1) or not (0), then each
/// rate's offset before the check as a little-endian `f64`.
pub const GCRA_BATCH_SCRIPT: &str = batch_script!("scripts/gcra.lua");
/// The batch of checks of [`Algorithm::SlidingLog`] in its `Script`
/// execution (as [`FIXED_WINDOW_BATCH_SCRIPT`], with
/// [`SLIDING_LOG_SCRIPT`]'s arguments, the request id empty), then 1 if
/// the batch is sent again after a lost reply (each check looks for its
/// own entries first) or 0, then each check's request id.
pub const SLIDING_LOG_BATCH_SCRIPT: &str = batch_script!("scripts/sliding_log.lua");

/// The check script, the command script and (for the algorithms checked in
/// batches) the batch script of one algorithm.
struct Scripts {
    check: redis::Script,
    command: redis::Script,
    batch: Option<redis::Script>,
}

impl Scripts {
    fn new(check: &str, command: &str, batch: Option<&str>) -> Self {
        Self {
            check: redis::Script::new(check),
            command: redis::Script::new(command),
            batch: batch.map(redis::Script::new),
        }
    }
}

/// Every algorithm's scripts, in [`Algorithm::index`] order.
static SCRIPTS: std::sync::LazyLock<[Scripts; 5]> = std::sync::LazyLock::new(|| {
    [
        Scripts::new(
            SLIDING_LOG_SCRIPT,
            SLIDING_LOG_COMMAND_SCRIPT,
            Some(SLIDING_LOG_BATCH_SCRIPT),
        ),
        Scripts::new(
            FIXED_WINDOW_SCRIPT,
            FIXED_WINDOW_COMMAND_SCRIPT,
            Some(FIXED_WINDOW_BATCH_SCRIPT),
        ),
        Scripts::new(
            SLIDING_WINDOW_SCRIPT,
            SLIDING_WINDOW_COMMAND_SCRIPT,
            Some(SLIDING_WINDOW_BATCH_SCRIPT),
        ),
        Scripts::new(GCRA_SCRIPT, GCRA_COMMAND_SCRIPT, Some(GCRA_BATCH_SCRIPT)),
        Scripts::new(CONCURRENCY_SCRIPT, CONCURRENCY_COMMAND_SCRIPT, None),
    ]
});

/// The batch script of `algorithm`, if its checks can be decided in
/// batches: all but the concurrency limit (the sliding log's in its
/// `Script` execution).
pub(super) fn batch_script(algorithm: Algorithm) -> Option<&'static redis::Script> {
    scripts(algorithm).batch.as_ref()
}

fn scripts(algorithm: Algorithm) -> &'static Scripts {
    &SCRIPTS[algorithm.index()]
}

/// The two keys of one limited key: its state and its block.
#[derive(Debug, Clone, Copy)]
pub(super) struct Keys<'a> {
    pub(super) state: &'a str,
    pub(super) block: &'a str,
}

/// `EVALSHA <sha1 of script> 2 <state key> <block key>`; the caller adds
/// the arguments.
///
/// Built by hand rather than through `redis::Script::key(..).arg(..)`, whose
/// invocation copies the key and each argument into a `Vec` of its own before
/// packing them into a command: about six allocations per check.
fn evalsha(script: &redis::Script, keys: Keys<'_>) -> redis::Cmd {
    let mut cmd = redis::Cmd::with_capacity(14, 128 + keys.state.len() + keys.block.len());
    cmd.arg("EVALSHA")
        .arg(script.get_hash())
        .arg(2)
        .arg(keys.state)
        .arg(keys.block);
    cmd
}

/// The window argument of `rate`: its window in µs (also the name of its
/// count), or for a calendar rate its count's name, `@`,
/// and four consecutive boundaries (µs) around `now`, this process's time,
/// separated by commas (`month:Europe/Paris:15@b0,b1,b2,b3`): the script
/// counts in the window among them that holds Redis's own time.
fn window_arg(cmd: &mut redis::Cmd, rate: &Rate, now: u64) {
    match rate.calendar() {
        None => {
            cmd.arg(rate.window_micros());
        }
        Some(calendar) => {
            let [b0, b1, b2, b3] = calendar.boundaries(now);
            cmd.arg(format!("{}@{b0},{b1},{b2},{b3}", calendar.field()));
        }
    }
}

/// How many arguments [`algorithm_args`] gives `policy`.
fn algorithm_arg_count(policy: &Policy) -> usize {
    match policy.algorithm() {
        Algorithm::Concurrency => 4,
        Algorithm::SlidingLog => 3 + 2 * policy.rates().len(),
        _ => 1 + 2 * policy.rates().len(),
    }
}

/// The algorithm's arguments of a request by `id` under `policy`, at `now`
/// (this process's time, µs: where calendar windows are placed).
fn algorithm_args(
    cmd: &mut redis::Cmd,
    policy: &Policy,
    id: &str,
    now: u64,
) -> Result<(), StoreError> {
    match policy.algorithm() {
        Algorithm::Concurrency => {
            let [rate] = policy.rates() else {
                return Err(StoreError::UnexpectedReply(format!(
                    "concurrency needs exactly one rate, the policy has {}",
                    policy.rates().len()
                )));
            };
            cmd.arg(rate.max())
                .arg(rate.window_micros())
                .arg(id)
                .arg(duration_micros(CONCURRENCY_RETRY_CAP));
            return Ok(());
        }
        Algorithm::SlidingLog => {
            cmd.arg(policy.cost())
                .arg(policy.min_spacing().map_or(0, duration_micros))
                .arg(id);
        }
        _ => {
            cmd.arg(policy.cost());
        }
    }
    for rate in policy.rates() {
        cmd.arg(rate.max());
        window_arg(cmd, rate, now);
    }
    Ok(())
}

/// One `EVALSHA` of a script, ready to send (the send loop,
/// [`Call`](super::call::Call), loads the script after `NOSCRIPT`).
pub(super) struct Eval {
    script: &'static redis::Script,
    cmd: redis::Cmd,
}

impl Eval {
    /// The script it runs.
    pub(super) fn script(&self) -> &'static redis::Script {
        self.script
    }

    /// Send it once: the script's reply.
    pub(super) async fn send<C: ConnectionLike, T: redis::FromRedisValue>(
        &self,
        conn: &mut C,
    ) -> Result<T, StoreError> {
        Ok(self.cmd.query_async(conn).await?)
    }
}

/// The check of one request by `id` (the sliding log's entries, the
/// concurrency limit's lease): one `EVALSHA`, atomic, on Redis's clock,
/// whose reply [`decode_reply`] reads. `now`: this process's time (µs).
pub(super) fn check(
    keys: Keys<'_>,
    policy: &Policy,
    id: &str,
    now: u64,
) -> Result<Eval, StoreError> {
    let script = &scripts(policy.algorithm()).check;
    let mut cmd = evalsha(script, keys);
    algorithm_args(&mut cmd, policy, id, now)?;
    Ok(Eval { script, cmd })
}

/// One check in a batch: its keys, policy and (the sliding log's) request
/// id.
pub(super) struct BatchItem<'a> {
    pub(super) keys: Keys<'a>,
    pub(super) policy: &'a Policy,
    pub(super) id: Option<&'a str>,
}

/// The `EVALSHA` of `script` (a [`batch_script`]) for a batch of checks,
/// all on a single Redis: the keys, each distinct policy's arguments once,
/// each check's policy when there are several, and for the sliding log
/// whether the batch is `resent` (after a reply lost: each check looks
/// for its own entries first) and each check's request id. Its reply holds each
/// check's reply, in order ([`decode_batched`]). `now`: this process's
/// time (µs).
pub(super) fn batch(
    script: &'static redis::Script,
    items: &[BatchItem<'_>],
    now: u64,
    resent: bool,
) -> Result<Eval, StoreError> {
    let key_bytes: usize = items
        .iter()
        .map(|item| item.keys.state.len() + item.keys.block.len())
        .sum();
    let mut cmd = redis::Cmd::with_capacity(8 + 4 * items.len(), 64 + 34 * items.len() + key_bytes);
    cmd.arg("EVALSHA")
        .arg(script.get_hash())
        .arg(2 * items.len());
    for item in items {
        cmd.arg(item.keys.state);
    }
    for item in items {
        cmd.arg(item.keys.block);
    }
    // Distinct policies, in order of first use: a batch usually holds one.
    let mut policies: Vec<&Policy> = Vec::with_capacity(1);
    let mut which: Vec<usize> = Vec::with_capacity(items.len());
    for item in items {
        let index = match policies.iter().position(|p| *p == item.policy) {
            Some(index) => index,
            None => {
                policies.push(item.policy);
                policies.len() - 1
            }
        };
        which.push(index + 1);
    }
    cmd.arg(policies.len());
    for policy in &policies {
        // A single check's arguments (the sliding log's request id empty:
        // each check's follows), after their number.
        cmd.arg(algorithm_arg_count(policy));
        algorithm_args(&mut cmd, policy, "", now)?;
    }
    if policies.len() > 1 {
        for index in which {
            cmd.arg(index);
        }
    }
    if items.iter().any(|item| item.id.is_some()) {
        cmd.arg(u8::from(resent));
        for id in items.iter().filter_map(|item| item.id) {
            cmd.arg(id);
        }
    }
    Ok(Eval { script, cmd })
}

/// The decision of one check's reply in a batch: as [`decode_reply`], and
/// `{-2, message}` for an error of that check alone.
pub(super) fn decode_batched(reply: Value, policy: &Policy) -> Result<Decision, StoreError> {
    if let Value::Array(values) = &reply
        && let [Value::Int(-2), message] = &values[..]
    {
        let message = match message {
            Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            other => format!("{other:?}"),
        };
        return Err(StoreError::UnexpectedReply(message));
    }
    if policy.algorithm() == Algorithm::Gcra
        && let Value::BulkString(bytes) = &reply
        && let [0 | 1, offsets @ ..] = bytes.as_slice()
    {
        return gcra_decided(bytes[0] == 1, offsets, policy);
    }
    decode_reply(reply, policy)
}

/// One check's decision from its element of a batch script's reply, as
/// the store reads it: for differential tests that run the batch scripts
/// themselves (feature `test-util`).
///
/// # Errors
///
/// The reply is not a decision of `policy`, or the check's own error.
#[cfg(feature = "test-util")]
pub fn decode_batched_reply(reply: Value, policy: &Policy) -> Result<Decision, StoreError> {
    decode_batched(reply, policy)
}

/// A batched GCRA check's decision from its reply (`decide_batched` in
/// `scripts/gcra.lua`): after its first byte (admitted or not), each
/// rate's offset before the check as a little-endian `f64`, from which
/// [`algorithm::gcra::decided`] takes the rest, as the memory store would.
/// (A text reply, a blocked key's, begins with `-` or a digit.)
fn gcra_decided(allowed: bool, offsets: &[u8], policy: &Policy) -> Result<Decision, StoreError> {
    let offsets: Option<smallvec::SmallVec<[f64; 2]>> = offsets
        .chunks(8)
        .map(|bytes| {
            let d = f64::from_le_bytes(bytes.try_into().ok()?);
            (d.is_finite() && d >= 0.0).then_some(d)
        })
        .collect();
    offsets
        .and_then(|offsets| algorithm::gcra::decided(policy, allowed, &offsets))
        .ok_or_else(|| {
            StoreError::UnexpectedReply(format!(
                "GCRA batch script: a reply that is not one offset for each of {} rates",
                policy.rates().len()
            ))
        })
}

/// The decision of a script's reply: [`decode`]'s integers as one string,
/// separated by spaces (a check's, `encode` in the scripts), or as an
/// array (an operator command's).
pub(super) fn decode_reply(reply: Value, policy: &Policy) -> Result<Decision, StoreError> {
    match reply {
        Value::BulkString(text) => {
            let ints = integers(&text).ok_or_else(|| {
                StoreError::UnexpectedReply(format!(
                    "{} script: a reply that is not integers separated by spaces: {:?}",
                    policy.algorithm(),
                    String::from_utf8_lossy(&text)
                ))
            })?;
            decode_ints(&ints, policy)
        }
        Value::Array(values) => decode(&values, policy),
        other => Err(StoreError::UnexpectedReply(format!(
            "{} script: a reply that is neither integers nor an array: {other:?}",
            policy.algorithm()
        ))),
    }
}

/// The integers of `text`, separated by single spaces (`None` if anything
/// else is in it, or one overflows).
fn integers(text: &[u8]) -> Option<Ints> {
    let mut ints = Ints::new();
    for word in text.split(|&b| b == b' ') {
        let (negative, digits) = match word {
            [b'-', rest @ ..] => (true, rest),
            _ => (false, word),
        };
        if digits.is_empty() {
            return None;
        }
        let mut n: i64 = 0;
        for &b in digits {
            if !b.is_ascii_digit() {
                return None;
            }
            n = n.checked_mul(10)?.checked_add(i64::from(b - b'0'))?;
        }
        ints.push(if negative { -n } else { n });
    }
    Some(ints)
}

/// Whether a check's reply in a batch is the error a replica gives a
/// write (`{-2, "READONLY ..."}`): the connection leads to a demoted
/// primary.
pub(super) fn refused_as_replica(reply: &Value) -> bool {
    matches!(reply, Value::Array(values)
        if matches!(&values[..], [Value::Int(-2), Value::BulkString(message)]
            if message.starts_with(b"READONLY")))
}

/// An operator's command: one `EVALSHA` of the algorithm's command script,
/// atomic, on Redis's clock, whose reply [`decode`] reads. `id` names the
/// members a penalty writes (unique across processes); `now` is this
/// process's time (µs).
pub(super) fn command(
    keys: Keys<'_>,
    policy: &Policy,
    command: Command,
    id: &str,
    now: u64,
) -> Result<Eval, StoreError> {
    let script = &scripts(policy.algorithm()).command;
    let mut cmd = evalsha(script, keys);
    let mut refunded = None;
    let (name, amount) = match command {
        Command::Peek => ("peek", 0),
        Command::Reset => ("reset", 0),
        Command::Block(duration) => ("block", algorithm::block_micros(duration)),
        Command::Penalty(units) => ("penalty", algorithm::units(units)),
        Command::Reward(units) => ("reward", algorithm::units(units)),
        Command::Refund { id, units } => {
            refunded = Some(member(id.into()));
            ("refund", algorithm::units(units))
        }
    };
    // A refund names the members of the check it gives back.
    cmd.arg(name)
        .arg(amount)
        .arg(refunded.as_deref().unwrap_or(id));
    // The request id of the algorithm's arguments: one no request holds.
    algorithm_args(&mut cmd, policy, id, now)?;
    Ok(Eval { script, cmd })
}

/// The decision of a reply as an array (an operator's command):
/// `{allowed, spacing wait, then per rate: remaining, reset, wait}`, or
/// `{-1, time left}` for a blocked key.
pub(super) fn decode(reply: &[Value], policy: &Policy) -> Result<Decision, StoreError> {
    let mut ints = Ints::new();
    for (i, value) in reply.iter().enumerate() {
        ints.push(int_reply(value, field(i))?);
    }
    decode_ints(&ints, policy)
}

/// A reply's integers (a decision of up to two rates without allocating).
type Ints = smallvec::SmallVec<[i64; 8]>;

/// The name of the `i`th integer of a decision's reply.
fn field(i: usize) -> &'static str {
    match i {
        0 => "allowed",
        1 => "spacing wait",
        _ => ["remaining", "reset", "wait"][(i - 2) % 3],
    }
}

/// The decision of a reply's integers ([`decode`]).
fn decode_ints(reply: &[i64], policy: &Policy) -> Result<Decision, StoreError> {
    let algorithm = policy.algorithm();
    let rates = policy.rates();
    let unexpected =
        |what: String| StoreError::UnexpectedReply(format!("{algorithm} script: {what}"));
    let non_negative = |i: usize, what: &str| {
        u64::try_from(reply[i])
            .map_err(|_| unexpected(format!("{what} must not be negative, got {}", reply[i])))
    };
    // Times are bounded by twice the longest window (GCRA's debt); a
    // larger one (a corrupted key) is read as that bound, so no caller
    // adds an absurd wait to a clock.
    let micros = |i: usize| non_negative(i, field(i)).map(|us| Micros(us.min(MAX_MICROS)));
    let Some(&first) = reply.first() else {
        return Err(unexpected("an empty reply".to_owned()));
    };
    let allowed = match first {
        -1 if reply.len() == 2 => {
            let left = non_negative(1, "block time left")?.min(MAX_MICROS);
            return Ok(algorithm::blocked(policy, left));
        }
        0 => false,
        1 => true,
        other => return Err(unexpected(format!("allowed must be 0 or 1, got {other}"))),
    };
    let want = 2 + 3 * rates.len();
    if reply.len() != want {
        return Err(unexpected(format!(
            "expected {want} values, got {}",
            reply.len()
        )));
    }
    let status = |i: usize, rate: &crate::policy::Rate| -> Result<RateStatus, StoreError> {
        Ok(RateStatus {
            rate: *rate,
            remaining: non_negative(i, field(i))?,
            reset: micros(i + 1)?,
            wait: micros(i + 2)?,
        })
    };
    let spacing = micros(1)?;
    if let [rate] = rates
        && spacing.is_zero()
    {
        return Ok(DecisionBuilder::one(allowed, algorithm, status(2, rate)?));
    }
    let mut builder = DecisionBuilder::new(allowed).algorithm(algorithm);
    builder.wait(spacing);
    for (i, rate) in rates.iter().enumerate() {
        builder.rate(status(2 + 3 * i, rate)?);
    }
    builder
        .build()
        .ok_or_else(|| unexpected("a policy without rates".to_owned()))
}

/// The longest time (µs) a reply may carry: twice [`MAX_WINDOW`](crate::policy::MAX_WINDOW).
const MAX_MICROS: u64 = 2 * crate::policy::MAX_WINDOW.as_micros() as u64;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A check's reply in a batch is its integers as one string; anything
    /// else in it is an error naming the reply, not a panic.
    #[test]
    fn a_batched_reply_is_read_from_its_integers() {
        let policy: Policy = "5/1s".parse::<Policy>().unwrap().gcra().unwrap();
        let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let admitted = decode_batched(text("1 0 4 200000 0"), &policy).unwrap();
        assert!(admitted.allowed());
        assert_eq!(admitted.remaining(), 4);
        assert_eq!(admitted.reset(), Duration::from_millis(200));
        let denied = decode_batched(text("0 0 0 1000000 200000"), &policy).unwrap();
        assert!(!denied.allowed());
        assert_eq!(denied.retry_after(), Duration::from_millis(200));
        let blocked = decode_batched(text("-1 3000000"), &policy).unwrap();
        assert!(!blocked.allowed());
        assert_eq!(blocked.retry_after(), Duration::from_secs(3));
        for bad in [
            "",
            "1 0 4 x 0",
            "1 0 4 200000",
            "1  0 4 200000 0",
            "1 0 4 1e5 0",
        ] {
            let error = decode_batched(text(bad), &policy).unwrap_err();
            assert!(
                matches!(error, StoreError::UnexpectedReply(_)),
                "{bad:?}: {error:?}"
            );
        }
        let error = Value::Array(vec![
            Value::Int(-2),
            Value::BulkString(b"WRONGTYPE".to_vec()),
        ]);
        assert!(matches!(
            decode_batched(error, &policy),
            Err(StoreError::UnexpectedReply(m)) if m == "WRONGTYPE"
        ));
    }
}
