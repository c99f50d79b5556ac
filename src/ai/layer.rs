//! [`OpenAiLayer`]: its settings, and the service it makes.

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::notice::{Notice, NoticeFn, Notices};
use super::service::OpenAi;
use crate::key::{self, ClientIp};
use crate::rules::{Counting, Rules};

/// The default bound on a request's body.
pub const DEFAULT_MAX_BODY: usize = 4 << 20;

/// The output a request is estimated at when it names no `max_tokens`.
pub const DEFAULT_MAX_OUTPUT: u64 = 4096;

/// Limits an OpenAI-compatible API by a rule set whose rules count
/// requests, tokens or money (see the [AI gateways guide](crate::guide::ai_gateways)).
///
/// For each `POST` to `…/chat/completions`, `…/completions` and
/// `…/embeddings` it reads the JSON body (at most
/// [`with_max_body`](Self::with_max_body) bytes; a body that is not the
/// JSON the endpoint takes is answered `400` before anything is counted),
/// estimates its usage (the prompt's size, and its `max_tokens` of
/// output), checks every matching rule at once — a rule counting
/// `requests` at its cost, `tokens` at the estimate, money at the
/// catalog's price of the estimate — and, once the answer has reported
/// its usage (its JSON `usage`, or a stream's usage chunk, which the layer
/// asks for and keeps from a client that did not), settles each rule to
/// the real cost. The body is read whole before the check: bound the time
/// a client may take to send it in front of the layer (`examples/ai_gateway`
/// does, as the example server does). Answers carry OpenAI's
/// `x-ratelimit-*` fields; a denial
/// is OpenAI's `429` error: `rate_limit_exceeded` with `retry-after` for
/// a rate, `insufficient_quota` (not retried by OpenAI's SDKs) for a
/// spent budget. Other requests pass untouched.
#[derive(Clone)]
pub struct OpenAiLayer {
    pub(crate) shared: Arc<Settings>,
}

/// What every service of a layer shares.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) rules: Rules,
    pub(crate) client_ip: ClientIp,
    pub(crate) max_body: usize,
    pub(crate) default_output: u64,
    pub(crate) hook: Option<Arc<NoticeFn>>,
    pub(crate) notices: Arc<Notices>,
}

impl OpenAiLayer {
    /// Limit by `rules` (which may be replaced at runtime, prices and all).
    pub fn new(rules: Rules) -> Self {
        let notices = Arc::new(Notices::new(rules.clone(), None));
        Self {
            shared: Arc::new(Settings {
                rules,
                client_ip: key::client_ip(),
                max_body: DEFAULT_MAX_BODY,
                default_output: DEFAULT_MAX_OUTPUT,
                hook: None,
                notices,
            }),
        }
    }

    /// The most bytes of a request's body read ([`DEFAULT_MAX_BODY`]); a
    /// longer one is answered `413`.
    #[must_use]
    pub fn with_max_body(self, bytes: usize) -> Self {
        self.map(|s| s.max_body = bytes)
    }

    /// The output tokens a request naming no `max_tokens` (nor
    /// `max_completion_tokens`) is estimated at ([`DEFAULT_MAX_OUTPUT`]).
    #[must_use]
    pub fn with_default_max_output(self, tokens: u64) -> Self {
        self.map(|s| s.default_output = tokens)
    }

    /// How `client_ip` key parts find the client behind proxies, and
    /// which peers may say the tier (as
    /// [`RulesLayer::with_client_ip`](crate::rules::RulesLayer::with_client_ip)).
    #[must_use]
    pub fn with_client_ip(self, client_ip: ClientIp) -> Self {
        self.map(|s| s.client_ip = client_ip)
    }

    /// Call `hook` with each [`Notice`]: a budget's share crossed, told
    /// once per rule, key, share and period across every process sharing
    /// the store (besides a log line at info, without the key, and the
    /// `ratelimit_notices_total` metric). It runs in the task settling
    /// the request: hand slow work (a webhook) to a task of its own.
    #[must_use]
    pub fn on_notice(self, hook: impl Fn(&Notice) + Send + Sync + 'static) -> Self {
        self.map(|s| s.hook = Some(Arc::new(hook)))
    }

    fn map(self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = (*self.shared).clone();
        change(&mut settings);
        settings.notices = Arc::new(Notices::new(settings.rules.clone(), settings.hook.clone()));
        Self {
            shared: Arc::new(settings),
        }
    }
}

impl fmt::Debug for OpenAiLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiLayer")
            .field("rules", &self.shared.rules)
            .field("max_body", &self.shared.max_body)
            .field("default_output", &self.shared.default_output)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for OpenAiLayer {
    type Service = OpenAi<S>;

    fn layer(&self, inner: S) -> Self::Service {
        // What this layer does not read is said, not silently ignored.
        for rule in self.shared.rules.current().set().rules() {
            let by_outcome = !matches!(rule.counting(), Counting::All);
            if by_outcome || rule.settle().is_some() {
                tracing::warn!(
                    rule = rule.name(),
                    "ai: OpenAiLayer settles every rule from the answer's usage: the rule's \
                     `count`, `refund` and `settle` are not read"
                );
            }
        }
        OpenAi {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}
