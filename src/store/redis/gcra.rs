//! GCRA on Redis: one hash per key holding a theoretical arrival time per
//! rate, updated by one Lua script on Redis's clock with the memory store's
//! arithmetic (see `scripts/gcra.lua`).

use std::time::Duration;

use super::connection::AnyConn;
use redis::Value;

use super::int_reply;
use crate::decision::{Decision, DecisionBuilder, RateStatus};
use crate::policy::{Algorithm, Policy};
use crate::store::StoreError;

/// The Lua source of [`Algorithm::Gcra`] (public so benchmarks can feed the
/// same script to `redis-benchmark`). `KEYS[1]` is the key's hash; `ARGV` is
/// the cost, then each rate's max and window in µs.
pub const GCRA_SCRIPT: &str = include_str!("scripts/gcra.lua");

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(GCRA_SCRIPT));

/// One `EVALSHA` (reloading the script after `NOSCRIPT`), on Redis's clock.
pub(super) async fn check(
    conn: &mut AnyConn,
    key: &str,
    policy: &Policy,
) -> Result<Decision, StoreError> {
    // The counter scripts' arguments: the cost, then each rate's max and window.
    let reply = super::fixed_window::invoke(&SCRIPT, conn, key, policy).await?;
    let want = 1 + 3 * policy.rates().len();
    if reply.len() != want {
        return Err(StoreError::UnexpectedReply(format!(
            "gcra script: expected {want} values, got {}",
            reply.len()
        )));
    }
    let allowed = match int_reply(&reply[0], "gcra allowed")? {
        1 => true,
        0 => false,
        other => {
            return Err(StoreError::UnexpectedReply(format!(
                "gcra allowed: expected 0 or 1, got {other}"
            )));
        }
    };
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Gcra);
    for (rate, values) in policy.rates().iter().zip(reply[1..].chunks_exact(3)) {
        builder.rate(RateStatus {
            rate: *rate,
            remaining: non_negative(&values[0], "gcra remaining")?,
            reset: Duration::from_micros(non_negative(&values[1], "gcra reset")?),
            wait: Duration::from_micros(non_negative(&values[2], "gcra wait")?),
        });
    }
    builder
        .build()
        .ok_or_else(|| StoreError::UnexpectedReply("gcra: no rate in the reply".to_owned()))
}

fn non_negative(value: &Value, what: &str) -> Result<u64, StoreError> {
    let n = int_reply(value, what)?;
    u64::try_from(n)
        .map_err(|_| StoreError::UnexpectedReply(format!("{what}: expected at least 0, got {n}")))
}
