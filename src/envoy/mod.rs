//! Envoy's global rate limit service (`envoy.service.ratelimit.v3`,
//! feature `envoy`): the crate's engine and rules answering Envoy and
//! every gateway built on it. See the guide's
//! [Envoy and gateways](crate::guide::envoy) page.

mod decide;
mod plan;
mod price;
mod service;
mod unit;

pub use service::{MAX_DESCRIPTORS, MAX_ENTRIES, MAX_MESSAGE, OVERRIDE_NAME, RateLimitService};

/// The protocol's messages and services (the `envoy-types` crate this
/// one is built on), so that a client or server you build matches its
/// version.
pub use envoy_types;
