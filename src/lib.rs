#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod clock;
pub mod decision;
pub mod policy;
pub mod store;

pub use clock::{Clock, ManualClock, SkewedClock, SystemClock};
pub use decision::Decision;
pub use policy::{Execution, Policy, PolicyError, Rate};
pub use store::memory::MemoryStore;
pub use store::redis::RedisStore;
pub use store::{Store, StoreError};
