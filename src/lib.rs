#![doc = include_str!("../README.md")]

mod algorithm;
pub mod body;
mod breaker;
pub mod clock;
pub mod decision;
mod deny_cache;
pub mod future;
pub mod key;
pub mod layer;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
pub mod policy;
pub mod response;
pub mod service;
pub mod store;

pub use body::ResponseBody;
pub use breaker::CircuitBreaker;
pub use clock::{Clock, ManualClock, SkewedClock, SystemClock};
pub use decision::{Decision, Lease, RateStatus};
pub use future::ResponseFuture;
pub use key::KeyExtractor;
pub use layer::{FailMode, HeaderStyle, RateLimitLayer, Rejection};
pub use policy::{Algorithm, Execution, Policy, PolicyError, Rate};
pub use service::RateLimit;
pub use store::memory::MemoryStore;
pub use store::redis::RedisStore;
pub use store::{Command, Store, StoreError};
