//! Soft limits: a [`Notice`] when a key's spend crosses a share of its
//! budget (`notify = [50, 80, 95, 100]`), told once per rule, key, share
//! and period across every process sharing the store: the store decides
//! which process is first, as it decides any limit (a fixed window of one
//! per period).

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::decision::Decision;
use crate::limiter::{DecidedBy, FailMode};
use crate::policy::{Policy, Rate};
use crate::rules::{Rules, Unit};

/// A budget's share crossed: told once per rule, key, share and period.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Notice {
    /// The rule whose budget it is.
    pub rule: String,
    /// The key spending it (an API key, a user, a team: keep it out of
    /// logs when it is a credential).
    pub key: String,
    /// The share crossed, in percent.
    pub threshold: u8,
    /// What the budget counts.
    pub unit: Unit,
    /// Units spent in the period (money in micro-units): settled spend and
    /// the estimates of requests in flight, at most `limit` (a key in debt
    /// shows its whole budget).
    pub used: u64,
    /// The budget: units in the period.
    pub limit: u64,
    /// The rate of the policy whose period it is.
    pub rate: Rate,
    /// When the period ends (the budget is whole again).
    pub resets: Duration,
}

/// What to call with each notice.
pub(crate) type NoticeFn = dyn Fn(&Notice) + Send + Sync;

/// The most crossings remembered in process (each told, or known told by
/// another process, until its period ends): beyond, the store is asked.
const REMEMBERED: usize = 10_000;

/// The notices of one layer.
pub(crate) struct Notices {
    rules: Rules,
    hook: Option<Arc<NoticeFn>>,
    /// Crossings already told in their period, by the hash of (rule, key,
    /// share, window), until the period ends: 8 bytes a key, whatever its
    /// length.
    told: Mutex<HashMap<u64, Instant>>,
    /// The hash's keys, random per layer.
    seed: RandomState,
}

impl fmt::Debug for Notices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notices")
            .field("hook", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

impl Notices {
    pub(crate) fn new(rules: Rules, hook: Option<Arc<NoticeFn>>) -> Self {
        Self {
            rules,
            hook,
            told: Mutex::default(),
            seed: RandomState::new(),
        }
    }

    /// Tell each share of `notify` that `decision` (the key's state after
    /// its latest charge) has crossed, unless told already this period.
    /// `command`: the decision is a command's, which answers as a request
    /// of that cost would after it.
    pub(crate) async fn crossed(
        &self,
        rule: &str,
        key: &str,
        unit: Unit,
        notify: &[u8],
        decision: &Decision,
        command: Option<u64>,
    ) {
        if notify.is_empty() {
            return;
        }
        for status in decision.rates() {
            let rate = status.rate();
            let limit = rate.max();
            let used = status.spent(command.map(|cost| (decision.allowed(), cost)));
            for &threshold in notify {
                if u128::from(used) * 100 < u128::from(threshold) * u128::from(limit) {
                    break;
                }
                let window = u64::try_from(rate.window().as_micros()).unwrap_or(u64::MAX);
                let memo = self.seed.hash_one((rule, key, threshold, window));
                if self.was_told(memo) {
                    continue;
                }
                let Some(first) = self.first(rule, key, threshold, rate).await else {
                    continue;
                };
                self.remember(memo, first.1);
                if first.0 {
                    self.tell(&Notice {
                        rule: rule.to_owned(),
                        key: key.to_owned(),
                        threshold,
                        unit,
                        used,
                        limit,
                        rate,
                        resets: status.reset(),
                    });
                }
            }
        }
    }

    fn was_told(&self, memo: u64) -> bool {
        let told = self
            .told
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        told.get(&memo).is_some_and(|until| *until > Instant::now())
    }

    fn remember(&self, memo: u64, until: Instant) {
        let mut told = self
            .told
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if told.len() >= REMEMBERED {
            let now = Instant::now();
            told.retain(|_, until| *until > now);
            if told.len() >= REMEMBERED {
                told.clear();
            }
        }
        told.insert(memo, until);
    }

    /// Whether this process is the first to tell the crossing of
    /// `threshold` by `key` in the period of `rate`, and until when the
    /// period lasts; `None` when the store cannot say (nothing is told:
    /// better one notice missed than one told twice).
    async fn first(
        &self,
        rule: &str,
        key: &str,
        threshold: u8,
        rate: Rate,
    ) -> Option<(bool, Instant)> {
        let once = match rate.calendar() {
            Some(calendar) => Rate::on_calendar(1, calendar),
            None => Rate::new(1, rate.window()),
        };
        let policy = once
            .and_then(|once| Policy::new([once]))
            .and_then(Policy::fixed_window)
            .ok()?;
        let limiter = self
            .rules
            // `:` is in no rule's name: no rule shares these counts.
            .limiter_for(&format!("{rule}:notice"), policy)
            .with_fail_mode(FailMode::Closed)
            .without_deny_cache();
        let verdict = match limiter.check(&format!("{threshold}|{key}")).await {
            Ok(verdict) => verdict,
            Err(error) => {
                tracing::warn!(%error, rule, threshold, "ai: cannot tell whether a notice was told; not telling it");
                return None;
            }
        };
        if verdict.decided_by() != DecidedBy::Store {
            return None;
        }
        let resets = verdict.decision().map_or(Duration::ZERO, Decision::reset);
        Some((verdict.allowed(), Instant::now() + resets))
    }

    fn tell(&self, notice: &Notice) {
        crate::metrics::notice(&notice.rule, notice.threshold);
        tracing::info!(
            rule = notice.rule,
            threshold = notice.threshold,
            used = notice.used,
            limit = notice.limit,
            unit = %notice.unit,
            "ai: a budget's share was crossed"
        );
        if let Some(hook) = &self.hook {
            hook(notice);
        }
    }
}
