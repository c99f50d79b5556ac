#![doc = include_str!("docs/crate.md")]
#![cfg_attr(not(feature = "redis"), doc = include_str!("docs/links-without-redis.md"))]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// The link definitions of the items of a feature, for docs that link to
/// them (`[text][crate::RedisStore]`) built without it: they lead to the
/// item on docs.rs instead of nowhere. Built with the feature, the links
/// resolve to the items themselves (so with every feature it is unused).
#[allow(unused_macros)]
macro_rules! links_without {
    ($feature:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src/docs/links-without-",
            $feature,
            ".md"
        ))
    };
}

#[cfg(feature = "admin")]
pub mod admin;
pub mod ai;
mod algorithm;
pub mod clock;
pub mod decision;
#[cfg(feature = "envoy")]
pub mod envoy;
pub mod guide;
mod http;
pub mod key;
pub mod limiter;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
pub mod policy;
pub mod rules;
pub mod store;

pub use decision::Decision;
pub use http::{RateLimit, RateLimitLayer};
pub use limiter::{FailMode, LimitError, Limiter, Permit, Verdict};
pub use policy::{Algorithm, Policy, PolicyError, Rate};
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{MemoryStore, Store, StoreError};

/// The futures of the crate's services and of [`Limiter::check_owned`], for
/// naming them in your own types.
pub mod future {
    pub use crate::http::{ResponseFuture, RulesFuture};
    pub use crate::limiter::Check;
}

/// How a response is rendered: the rate-limit header style, the body of a
/// denial and the rejection of a failed check; and how its real cost is
/// settled after it ([`Settlement`](response::Settlement)).
pub mod response {
    pub use crate::http::{
        ActualCost, BodyPart, HeaderStyle, MeterFn, Rejection, Responder, ResponseBody, Settlement,
    };
}

/// The names of the rate-limit header fields the layers write.
pub mod header {
    pub use crate::http::{
        RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
    };
}

/// The bb8 pool of Redis connections this crate is built on (with `bb8`
/// inside), so that a pool you pass to [`RedisStore::from_pool`] matches its version.
#[cfg(feature = "redis")]
pub use bb8_redis;
/// The redis crate this one is built on (redis-rs 1.x), so that a
/// connection, cluster client or error you build matches its version.
#[cfg(feature = "redis")]
pub use redis;

/// The README's code blocks, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
