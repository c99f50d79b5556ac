//! [`RateLimitLayer`]: the layer and its settings.

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use crate::policy::Policy;
use crate::service::RateLimit;
use crate::store::{DynStore, Store};

/// What to do when the store cannot decide (Redis down, slow or failing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailMode {
    /// Admit the request without limiting it, and log the failure at warn
    /// (the default: the limiter never takes the service down).
    #[default]
    Open,
    /// Answer `503 Service Unavailable`.
    Closed,
}

/// Rate-limits every request of the wrapped service under the key its
/// extractor picks, against a [`Policy`] kept in a [`Store`].
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_redis_ratelimit::{FailMode, MemoryStore, Policy, RateLimitLayer, key};
///
/// let limiter = RateLimitLayer::new(MemoryStore::new(), "3/s, 20/min".parse::<Policy>()?, key::peer_ip())
///     .with_fail_mode(FailMode::Closed);
/// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(limiter);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
pub struct RateLimitLayer<K> {
    settings: Arc<Settings>,
    key: Arc<K>,
}

/// What every request of one layer shares, whatever its key extractor.
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn DynStore>,
    pub(crate) policy: Arc<Policy>,
    /// Namespaces the keys of this layer in the store.
    pub(crate) name: Arc<str>,
    pub(crate) fail_mode: FailMode,
}

impl Settings {
    /// The store key of an extracted key: `{name}:{key}`.
    pub(crate) fn store_key(&self, key: &str) -> String {
        let mut out = String::with_capacity(self.name.len() + 1 + key.len());
        out.push_str(&self.name);
        out.push(':');
        out.push_str(key);
        out
    }
}

impl<K> RateLimitLayer<K> {
    /// Limit requests by the key `key` picks, to `policy`, in `store`.
    pub fn new<St: Store>(store: St, policy: Policy, key: K) -> Self {
        let name = default_name(&policy);
        Self {
            settings: Arc::new(Settings {
                store: Arc::new(store),
                policy: Arc::new(policy),
                name: Arc::from(name),
                fail_mode: FailMode::default(),
            }),
            key: Arc::new(key),
        }
    }

    /// What to do when the store fails (default [`FailMode::Open`]).
    #[must_use]
    pub fn with_fail_mode(self, fail_mode: FailMode) -> Self {
        self.map_settings(|s| s.fail_mode = fail_mode)
    }

    /// Name this limit. Keys are counted per name, so two layers sharing a
    /// store and a key extractor keep separate counts unless they share a
    /// name. The default is the policy text without spaces (`"3/s,20/min"`):
    /// layers with the same policy share counts, and changing a policy starts
    /// its counts afresh. Use one name for one policy only: a check trims
    /// entries older than its own longest window, so a shorter policy under
    /// the same name would erase history a longer one needs.
    #[must_use]
    pub fn with_name(self, name: impl Into<String>) -> Self {
        let name: String = name.into();
        self.map_settings(|s| s.name = Arc::from(name))
    }

    /// The policy enforced.
    pub fn policy(&self) -> &Policy {
        &self.settings.policy
    }

    /// The name keys are counted under.
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    fn map_settings(mut self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = Settings {
            store: Arc::clone(&self.settings.store),
            policy: Arc::clone(&self.settings.policy),
            name: Arc::clone(&self.settings.name),
            fail_mode: self.settings.fail_mode,
        };
        change(&mut settings);
        self.settings = Arc::new(settings);
        self
    }
}

fn default_name(policy: &Policy) -> String {
    policy.to_string().replace(' ', "")
}

impl<K> Clone for RateLimitLayer<K> {
    fn clone(&self) -> Self {
        Self {
            settings: Arc::clone(&self.settings),
            key: Arc::clone(&self.key),
        }
    }
}

impl<K> fmt::Debug for RateLimitLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.settings.policy.to_string())
            .field("name", &self.settings.name)
            .field("fail_mode", &self.settings.fail_mode)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for RateLimitLayer<K> {
    type Service = RateLimit<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_parts(inner, Arc::clone(&self.settings), Arc::clone(&self.key))
    }
}
