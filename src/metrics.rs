//! Counters and a latency histogram, with the `metrics` feature: exported
//! through whatever `metrics` recorder the application installs
//! (Prometheus, StatsD, ...). Without the feature these are no-ops.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `ratelimit_decisions_total` | counter | `policy` (the limiter's name; `<rule>@<policy>` under rules), `outcome`: `allowed`, `limited`, `skipped` (no key, or an allowed key), `store_error` |
//! | `ratelimit_store_seconds` | histogram | `policy`: time the store took to decide |
//! | `ratelimit_rule_sets_total` | counter | `result`: `loaded` (a rule set a watch put in force), `rejected` (one it refused: the rules in force stayed) |

use std::time::Instant;

/// What happened to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Allowed,
    Limited,
    Skipped,
    StoreError,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Limited => "limited",
            Self::Skipped => "skipped",
            Self::StoreError => "store_error",
        }
    }
}

/// Count one request of `policy`.
pub(crate) fn decision(policy: &str, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "ratelimit_decisions_total",
        "policy" => policy.to_owned(),
        "outcome" => outcome.as_str()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (policy, outcome);
}

/// Record how long the store of `policy` took since `sent`, when the clock
/// was read (without the feature, an in-process check does not read it).
pub(crate) fn store_latency(policy: &str, sent: Option<Instant>) {
    #[cfg(feature = "metrics")]
    if let Some(sent) = sent {
        metrics::histogram!("ratelimit_store_seconds", "policy" => policy.to_owned())
            .record(sent.elapsed().as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (policy, sent);
}

/// Count a rule set a watch put in force (`loaded`) or refused.
pub(crate) fn rules_loaded(loaded: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "ratelimit_rule_sets_total",
        "result" => if loaded { "loaded" } else { "rejected" }
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = loaded;
}
