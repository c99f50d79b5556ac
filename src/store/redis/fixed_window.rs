//! The fixed window on Redis: one hash per limited key, one field per rate,
//! decided by one Lua script on Redis's clock. The semantics are those of
//! the memory store (`src/store/memory/fixed_window.rs`).

use std::time::Duration;

use super::connection::AnyConn;
use redis::Value;

use super::int_reply;
use crate::decision::{Decision, DecisionBuilder, RateStatus};
use crate::policy::{Algorithm, Policy};
use crate::store::StoreError;

/// The Lua source of the fixed window (public so benchmarks can feed the
/// same script to `redis-benchmark`). `KEYS[1]` is the key's hash; `ARGV`
/// holds the cost, then the max and window (µs) of each rate.
pub const FIXED_WINDOW_SCRIPT: &str = include_str!("scripts/fixed_window.lua");

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(FIXED_WINDOW_SCRIPT));

/// One `EVALSHA` (reloading the script after `NOSCRIPT`), atomic, on Redis's
/// clock.
pub(super) async fn check(
    conn: &mut AnyConn,
    key: &str,
    policy: &Policy,
) -> Result<Decision, StoreError> {
    let reply = invoke(&SCRIPT, conn, key, policy).await?;
    decision(&reply, policy, Algorithm::FixedWindow)
}

/// Run a script taking the key, then the cost and every rate's max and
/// window in µs: the counter scripts (fixed window, sliding window counter)
/// and GCRA's.
pub(super) async fn invoke(
    script: &redis::Script,
    conn: &mut AnyConn,
    key: &str,
    policy: &Policy,
) -> Result<Vec<Value>, StoreError> {
    let mut cmd = super::evalsha(script, key);
    cmd.arg(policy.cost());
    for rate in policy.rates() {
        cmd.arg(rate.max()).arg(rate.window_micros());
    }
    Ok(super::run_script(conn, script, &cmd).await?)
}

/// The decision of a counter script's reply:
/// `{allowed, then per rate: remaining, reset µs, wait µs}`.
pub(super) fn decision(
    reply: &[Value],
    policy: &Policy,
    algorithm: Algorithm,
) -> Result<Decision, StoreError> {
    let rates = policy.rates();
    let want = 1 + 3 * rates.len();
    if reply.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "{algorithm} script: expected {want} values, got {}",
            reply.len()
        )));
    }
    let allowed = match int_reply(&reply[0], "allowed")? {
        0 => false,
        1 => true,
        other => {
            return Err(StoreError::UnexpectedReply(format!(
                "{algorithm} script: allowed must be 0 or 1, got {other}"
            )));
        }
    };
    let mut builder = DecisionBuilder::new(allowed).algorithm(algorithm);
    for (rate, values) in rates.iter().zip(reply[1..].chunks_exact(3)) {
        builder.rate(RateStatus {
            rate: *rate,
            remaining: non_negative(&values[0], algorithm, "remaining")?,
            reset: Duration::from_micros(non_negative(&values[1], algorithm, "reset")?),
            wait: Duration::from_micros(non_negative(&values[2], algorithm, "wait")?),
        });
    }
    builder.build().ok_or_else(|| {
        StoreError::UnexpectedReply(format!("{algorithm} script: a policy without rates"))
    })
}

fn non_negative(value: &Value, algorithm: Algorithm, what: &str) -> Result<u64, StoreError> {
    let n = int_reply(value, what)?;
    u64::try_from(n).map_err(|_| {
        StoreError::UnexpectedReply(format!(
            "{algorithm} script: {what} must not be negative, got {n}"
        ))
    })
}
