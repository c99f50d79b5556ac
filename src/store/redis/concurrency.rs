//! The concurrency limit on Redis: one sorted set of leases per key, scored
//! by expiry on Redis's clock, taken by one Lua script (see
//! `scripts/concurrency.lua`) and given back with one `ZREM`.

use std::time::Duration;

use super::connection::AnyConn;
use redis::Value;

use super::{int_reply, member};
use crate::decision::{Decision, DecisionBuilder, Lease, RateStatus};
use crate::policy::{Algorithm, Policy, duration_micros};
use crate::store::StoreError;

/// The Lua source of [`Algorithm::Concurrency`] (public so benchmarks can
/// feed the same script to `redis-benchmark`). `KEYS[1]` is the key's sorted
/// set; `ARGV` is the max, the lease time in µs, the lease id and the longest
/// suggested wait in µs.
pub const CONCURRENCY_SCRIPT: &str = include_str!("scripts/concurrency.lua");

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(CONCURRENCY_SCRIPT));

/// Take a lease: one `EVALSHA` (reloading the script after `NOSCRIPT`), on
/// Redis's clock. The caller takes the lease back out if the check fails
/// (see `Cleanup`).
pub(super) async fn check<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    key: &str,
    policy: &Policy,
    lease: Lease,
) -> Result<Decision, StoreError> {
    let [rate] = policy.rates() else {
        return Err(StoreError::UnexpectedReply(format!(
            "concurrency needs exactly one rate, the policy has {}",
            policy.rates().len()
        )));
    };
    let mut cmd = super::evalsha(&SCRIPT, key);
    cmd.arg(rate.max())
        .arg(rate.window_micros())
        .arg(member(lease))
        .arg(duration_micros(crate::store::CONCURRENCY_RETRY_CAP));
    let reply = super::run_script(conn, &SCRIPT, &cmd).await?;
    let [allowed, remaining, wait] = reply.as_slice() else {
        return Err(StoreError::UnexpectedReply(format!(
            "concurrency script: expected 3 values, got {}",
            reply.len()
        )));
    };
    let allowed = match int_reply(allowed, "concurrency allowed")? {
        1 => true,
        0 => false,
        other => {
            return Err(StoreError::UnexpectedReply(format!(
                "concurrency allowed: expected 0 or 1, got {other}"
            )));
        }
    };
    let mut builder = DecisionBuilder::new(allowed).algorithm(Algorithm::Concurrency);
    builder.rate(RateStatus {
        rate: *rate,
        remaining: non_negative(remaining, "concurrency remaining")?,
        reset: Duration::ZERO,
        wait: Duration::from_micros(non_negative(wait, "concurrency wait")?),
    });
    let decision = builder
        .build()
        .ok_or_else(|| StoreError::UnexpectedReply("concurrency: no rate".to_owned()))?;
    Ok(if allowed {
        decision.with_lease(lease)
    } else {
        decision
    })
}

/// Give a lease back: one `ZREM`. Releasing a lease that expired or was
/// already released does nothing.
pub(super) async fn release(conn: &mut AnyConn, key: &str, lease: Lease) -> Result<(), StoreError> {
    redis::cmd("ZREM")
        .arg(key)
        .arg(member(lease))
        .query_async::<()>(conn)
        .await?;
    Ok(())
}

fn non_negative(value: &Value, what: &str) -> Result<u64, StoreError> {
    let n = int_reply(value, what)?;
    u64::try_from(n)
        .map_err(|_| StoreError::UnexpectedReply(format!("{what}: expected at least 0, got {n}")))
}
