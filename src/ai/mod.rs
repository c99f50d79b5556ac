//! AI gateways: an OpenAI-compatible API limited by requests, tokens and
//! money, per key and up a hierarchy (key, user, team, organisation), with
//! the answers OpenAI's clients read. [`OpenAiLayer`] puts a rule set (with
//! its [price catalog](crate::rules::Catalog)) in front of the API; the
//! [AI gateways guide](crate::guide::ai_gateways) tells the whole story.
//!
//! The engine knows costs and keys; the layer reads the models, usage and
//! JSON: it estimates a request from its body, checks every rule at once,
//! settles each to the usage the answer reports, and tells the budgets'
//! [notices](Notice) once per period.

mod body;
mod charge;
mod error;
mod future;
mod headers;
mod layer;
mod notice;
mod request;
mod service;
mod stream;
mod usage;

pub use body::{RequestBody, ResponseBody};
pub use charge::Unanswered;
pub use future::ResponseFuture;
pub use layer::{DEFAULT_MAX_BODY, DEFAULT_MAX_OUTPUT, OpenAiLayer};
pub use notice::Notice;
pub use service::OpenAi;
