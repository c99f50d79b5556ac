//! Counters, a gauge and a latency histogram, with the `metrics` feature:
//! exported through whatever `metrics` recorder the application installs
//! (Prometheus, StatsD, ...; the admin router serves Prometheus's text
//! format). Without the feature these are no-ops.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `ratelimit_decisions_total` | counter | `rule` (the rule's name under rules; else the limiter's name), `outcome`, `source` (below) |
//! | `ratelimit_store_duration_seconds` | histogram | `rule`: time the store took to answer a check |
//! | `ratelimit_circuit_breaker_open` | gauge | `rule`: 1 while the limiter's circuit breaker is open (checks fail fast), else 0 |
//! | `ratelimit_settlements_total` | counter | `rule`, `result`: how a cost settled after the response went (below) |
//! | `ratelimit_rule_sets_total` | counter | `result`: `loaded` (a rule set a watch put in force), `rejected` (one it refused: the rules in force stayed) |
//!
//! `outcome` is `admitted`, `denied`, `blocked` (denied by an operator's
//! block), `failed_open` (the store failed and [`FailMode::Open`](crate::FailMode::Open)
//! admitted), `failed_closed` (the store failed and the request was
//! refused) or `skipped` (no key, or an allowed key). `source` says who
//! decided: `store`, `deny_cache` (a denial held in this process),
//! `local_quota` (units this process took from the store earlier),
//! `fallback` (the fail mode's in-process store while the store fails) or
//! `none`. The deny cache's and the local quota's hits are the decisions
//! of those sources.
//!
//! A settlement's `result` ([`Reservation::settle`](crate::limiter::Reservation::settle))
//! is `as_estimated` (nothing to send), `charged` (an over-run charged),
//! `given_back`, `kept` (too late to give back: the window that counted
//! it ended), `unreported` (the response never reported its cost: the
//! estimate stands) or `failed` (the store failed: the estimate stands).

use std::time::Instant;

/// What happened to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Admitted,
    Denied,
    Blocked,
    FailedOpen,
    FailedClosed,
    Skipped,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Denied => "denied",
            Self::Blocked => "blocked",
            Self::FailedOpen => "failed_open",
            Self::FailedClosed => "failed_closed",
            Self::Skipped => "skipped",
        }
    }
}

/// Who decided (the `source` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decider {
    Store,
    DenyCache,
    LocalQuota,
    Fallback,
    None,
}

impl Decider {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::DenyCache => "deny_cache",
            Self::LocalQuota => "local_quota",
            Self::Fallback => "fallback",
            Self::None => "none",
        }
    }
}

/// Count one request of the limit named `rule`.
pub(crate) fn decision(rule: &str, outcome: Outcome, source: Decider) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "ratelimit_decisions_total",
        "rule" => rule.to_owned(),
        "outcome" => outcome.as_str(),
        "source" => source.as_str()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (rule, outcome, source);
}

/// Record how long the store of `rule` took since `sent`, when the clock
/// was read (without the feature, an in-process check does not read it).
pub(crate) fn store_latency(rule: &str, sent: Option<Instant>) {
    #[cfg(feature = "metrics")]
    if let Some(sent) = sent {
        metrics::histogram!("ratelimit_store_duration_seconds", "rule" => rule.to_owned())
            .record(sent.elapsed().as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (rule, sent);
}

/// Whether the circuit breaker of `rule` is open now.
pub(crate) fn breaker_open(rule: &str, open: bool) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("ratelimit_circuit_breaker_open", "rule" => rule.to_owned()).set(if open {
        1.0
    } else {
        0.0
    });
    #[cfg(not(feature = "metrics"))]
    let _ = (rule, open);
}

/// Count one settlement of a cost after the response, of the limit named
/// `rule`, by its `result`.
pub(crate) fn settlement(rule: &str, result: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "ratelimit_settlements_total",
        "rule" => rule.to_owned(),
        "result" => result
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (rule, result);
}

/// Count a notice of a budget's share crossed (`threshold` percent), told
/// once per key and period, of the rule named `rule`.
pub(crate) fn notice(rule: &str, threshold: u8) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "ratelimit_notices_total",
        "rule" => rule.to_owned(),
        "threshold" => threshold.to_string()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (rule, threshold);
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
