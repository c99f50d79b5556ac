//! The sliding window counter on Redis: one hash per limited key, one field
//! per rate holding the window index and the current and previous counts,
//! decided by one Lua script on Redis's clock. The semantics are those of
//! the memory store (`src/store/memory/sliding_window.rs`); Redis computes
//! in doubles, exact while `max × window (µs) ≤ 2^53` (see the script).

use super::connection::AnyConn;

use super::fixed_window::{decision, invoke};
use crate::decision::Decision;
use crate::policy::{Algorithm, Policy};
use crate::store::StoreError;

/// The Lua source of the sliding window counter (public so benchmarks can
/// feed the same script to `redis-benchmark`). `KEYS[1]` is the key's hash;
/// `ARGV` holds the cost, then the max and window (µs) of each rate.
pub const SLIDING_WINDOW_SCRIPT: &str = include_str!("scripts/sliding_window.lua");

static SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(SLIDING_WINDOW_SCRIPT));

/// One `EVALSHA` (reloading the script after `NOSCRIPT`), atomic, on Redis's
/// clock.
pub(super) async fn check(
    conn: &mut AnyConn,
    key: &str,
    policy: &Policy,
) -> Result<Decision, StoreError> {
    let reply = invoke(&SCRIPT, conn, key, policy).await?;
    decision(&reply, policy, Algorithm::SlidingWindow)
}
