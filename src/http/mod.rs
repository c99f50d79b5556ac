//! The tower glue: the layer, its service, future and body, the rate-limit
//! fields and the denials (429, problem+json, gRPC). It turns a request
//! into a key, asks the engine ([`Limiter`](crate::Limiter)) and renders
//! its verdict; it decides nothing about limiting.

mod body;
mod denial;
mod fields;
mod future;
mod layer;
mod rules;
mod service;
mod settings;
mod settlement;

pub use body::ResponseBody;
pub(crate) use body::Whole;
pub use fields::{
    RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
pub use future::ResponseFuture;
pub use layer::RateLimitLayer;
pub use rules::{RuleLimit, RulesFuture, RulesLayer};
pub(crate) use rules::{rule_key, tier_of};
pub use service::RateLimit;
#[cfg(feature = "envoy")]
pub(crate) use settings::Rendering;
pub use settings::{HeaderStyle, Rejection, Responder};
pub(crate) use settlement::unusable_cost_header;
pub use settlement::{ActualCost, BodyPart, MeterFn, Settlement};
