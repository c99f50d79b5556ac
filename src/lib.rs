#![doc = include_str!("../README.md")]

mod algorithm;
pub mod clock;
mod decision;
mod http;
pub mod key;
mod limiter;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod policy;
pub mod rules;
mod store;

pub use algorithm::CONCURRENCY_RETRY_CAP;
pub use decision::{Decision, Lease, RateStatus};
pub use http::{
    HeaderStyle, RATELIMIT, RATELIMIT_POLICY, RateLimit, RateLimitLayer, Rejection, Responder,
    ResponseBody, ResponseFuture, RuleLimit, RulesFuture, RulesLayer, X_RATELIMIT_LIMIT,
    X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
pub use limiter::{
    Check, CircuitBreaker, FailMode, LimitError, Limiter, LocalQuota, Permit, Source, Verdict,
};
pub use policy::{
    Algorithm, DEFAULT_LEASE, Execution, MAX_COST, MAX_MAX, MAX_WINDOW, MIN_WINDOW, Policy,
    PolicyError, Rate,
};
pub use store::memory::MemoryStore;
pub use store::redis::RedisStore;
pub use store::redis::{RedisStoreBuilder, TrackedConnection, TrackedManager};
pub use store::{Command, MAX_RAW_KEY_LEN, Store, StoreError};

/// The Lua scripts `RedisStore` runs, as sent to Redis (for the crate's
/// benchmarks and differential tests; not a stable interface).
#[doc(hidden)]
pub mod scripts {
    pub use crate::store::redis::{
        CONCURRENCY_COMMAND_SCRIPT, CONCURRENCY_SCRIPT, FIXED_WINDOW_BATCH_SCRIPT,
        FIXED_WINDOW_COMMAND_SCRIPT, FIXED_WINDOW_SCRIPT, GCRA_BATCH_SCRIPT, GCRA_COMMAND_SCRIPT,
        GCRA_SCRIPT, SLIDING_LOG_COMMAND_SCRIPT, SLIDING_LOG_SCRIPT, SLIDING_WINDOW_BATCH_SCRIPT,
        SLIDING_WINDOW_COMMAND_SCRIPT, SLIDING_WINDOW_SCRIPT,
    };
}

/// The bb8 pool of Redis connections this crate is built on (with `bb8`
/// inside), so that a pool you pass to [`RedisStore::from_pool`] matches its version.
pub use bb8_redis;
/// The redis crate this one is built on (redis-rs 1.x), so that a
/// connection, cluster client or error you build matches its version.
pub use redis;
