//! The circuit breaker: after a run of store failures, stop paying the
//! store's timeout on every request; probe now and then; recover alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// When the breaker opens and how long it stays open.
///
/// Every value is accepted: `failures: 0` opens the breaker at the first
/// failure, as 1 does (it cannot open before a failure); a zero `cooldown`
/// lets every request after a failure probe the store, so the breaker never
/// holds one back; a `cooldown` past the clock's range (`Duration::MAX`)
/// never probes: once open, the breaker stays open and the fail mode answers
/// every request until the process restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct CircuitBreaker {
    /// Consecutive failures that open the breaker (0 counts as 1).
    pub failures: u32,
    /// How long it stays open before one request probes the store.
    pub cooldown: Duration,
}

impl CircuitBreaker {
    /// Open after `failures` consecutive failures; probe every `cooldown`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::limiter::CircuitBreaker;
    ///
    /// let breaker = CircuitBreaker::new(3, Duration::from_millis(500));
    /// assert_eq!(breaker.failures, 3);
    /// ```
    pub fn new(failures: u32, cooldown: Duration) -> Self {
        Self { failures, cooldown }
    }
}

impl Default for CircuitBreaker {
    /// Open after 5 consecutive failures, probe every second.
    fn default() -> Self {
        Self {
            failures: 5,
            cooldown: Duration::from_secs(1),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: CircuitBreaker,
    inner: Mutex<Inner>,
    /// `inner`'s epoch and what its state is, readable without the lock:
    /// `epoch << 2 | summary`, the summary one of the `HEALTHY`, `FAILING`,
    /// `OPEN` constants. While the store answers, a request neither locks nor
    /// reads the clock. Written under the lock, both at once; a reader that
    /// sees it a moment late only asks the store once more.
    word: AtomicU64,
}

/// The state and its epoch, which changes with every change of state but
/// the failure count: a result counts only in the epoch its request was
/// let through in.
#[derive(Debug)]
struct Inner {
    state: State,
    epoch: u64,
}

/// `Closed` with no failure.
const HEALTHY: u64 = 0;
/// `Closed` after some failures.
const FAILING: u64 = 1;
/// `Open` or `Probing`.
const OPEN: u64 = 2;
const SUMMARY_BITS: u32 = 2;
const SUMMARY_MASK: u64 = (1 << SUMMARY_BITS) - 1;
/// Epochs wrap within the bits the word has for them.
const EPOCH_MASK: u64 = u64::MAX >> SUMMARY_BITS;

/// When an open breaker lets a probe through: `None` is never (the cooldown
/// reaches past the clock's range).
type Deadline = Option<Instant>;

#[derive(Debug, Clone, Copy)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Deadline,
    },
    /// One probe is out; everyone else fails fast until it reports, or
    /// until `until` (a probe whose request was dropped never reports).
    Probing {
        until: Deadline,
    },
}

impl State {
    fn summary(self) -> u64 {
        match self {
            Self::Closed { failures: 0 } => HEALTHY,
            Self::Closed { .. } => FAILING,
            Self::Open { .. } | Self::Probing { .. } => OPEN,
        }
    }
}

/// Whether `deadline` has passed at `now`.
fn passed(deadline: Deadline, now: Instant) -> bool {
    deadline.is_some_and(|until| now >= until)
}

/// A request let through to the store, in the breaker's epoch of the moment:
/// its result is passed back with it to [`Breaker::success`] or
/// [`Breaker::failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    epoch: u64,
}

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Ask the store, and report how it did with the ticket.
    Ask(Ticket),
    /// Do not: the store is considered down.
    Skip,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self {
            config,
            inner: Mutex::new(Inner {
                state: State::Closed { failures: 0 },
                epoch: 0,
            }),
            word: AtomicU64::new(HEALTHY),
        }
    }

    /// Move to `next`, in a new epoch unless only the failure count changes,
    /// keeping the lock-free word in step (`inner` is locked).
    fn set(&self, inner: &mut Inner, next: State) {
        let same_state = matches!(
            (inner.state, next),
            (State::Closed { .. }, State::Closed { .. })
        );
        if !same_state {
            inner.epoch = inner.epoch.wrapping_add(1) & EPOCH_MASK;
        }
        inner.state = next;
        self.word.store(
            (inner.epoch << SUMMARY_BITS) | next.summary(),
            Ordering::Release,
        );
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ticket of the current epoch.
    fn ticket(&self, inner: &Inner) -> Ticket {
        Ticket { epoch: inner.epoch }
    }

    /// When a breaker opened or probing at `now` lets the next probe through.
    fn deadline(&self, now: Instant) -> Deadline {
        now.checked_add(self.config.cooldown)
    }

    /// Whether the breaker is open or probing: the next request let
    /// through (if any) is the probe, and nothing else is until it reports.
    pub(crate) fn is_open(&self) -> bool {
        self.word.load(Ordering::Acquire) & SUMMARY_MASK == OPEN
    }

    pub(crate) fn gate(&self) -> Gate {
        let word = self.word.load(Ordering::Acquire);
        if word & SUMMARY_MASK != OPEN {
            return Gate::Ask(Ticket {
                epoch: word >> SUMMARY_BITS,
            });
        }
        let mut inner = self.inner();
        match inner.state {
            State::Closed { .. } => Gate::Ask(self.ticket(&inner)),
            State::Open { until } | State::Probing { until } => {
                let now = Instant::now();
                if !passed(until, now) {
                    return Gate::Skip;
                }
                let next = State::Probing {
                    until: self.deadline(now),
                };
                self.set(&mut inner, next);
                tracing::info!("rate limit store: circuit half-open, probing");
                Gate::Ask(self.ticket(&inner))
            }
        }
    }

    /// The store answered the request of `ticket`.
    pub(crate) fn success(&self, ticket: Ticket) {
        if self.word.load(Ordering::Acquire) & SUMMARY_MASK == HEALTHY {
            return;
        }
        let mut inner = self.inner();
        if self.ticket(&inner) != ticket {
            // Let through in an earlier state: not news about this one.
            return;
        }
        match inner.state {
            State::Closed { failures: 0 } => {}
            State::Closed { .. } => self.set(&mut inner, State::Closed { failures: 0 }),
            State::Probing { .. } => {
                tracing::warn!("rate limit store: answering again, circuit closed");
                self.set(&mut inner, State::Closed { failures: 0 });
            }
            // No request is let through while open.
            State::Open { .. } => {}
        }
    }

    /// The store failed the request of `ticket`.
    pub(crate) fn failure(&self, ticket: Ticket) {
        let mut inner = self.inner();
        if self.ticket(&inner) != ticket {
            return;
        }
        let now = Instant::now();
        let open = State::Open {
            until: self.deadline(now),
        };
        match inner.state {
            State::Closed { failures } if failures.saturating_add(1) >= self.config.failures => {
                let cooldown_ms =
                    u64::try_from(self.config.cooldown.as_millis()).unwrap_or(u64::MAX);
                if self.deadline(now).is_some() {
                    tracing::warn!(
                        failures = failures.saturating_add(1),
                        cooldown_ms,
                        "rate limit store: circuit open, not asking the store until a probe succeeds"
                    );
                } else {
                    tracing::warn!(
                        failures = failures.saturating_add(1),
                        "rate limit store: circuit open for good (the cooldown never ends), not asking the store again"
                    );
                }
                self.set(&mut inner, open);
            }
            State::Closed { failures } => self.set(
                &mut inner,
                State::Closed {
                    failures: failures.saturating_add(1),
                },
            ),
            State::Probing { .. } => {
                tracing::warn!("rate limit store: probe failed, circuit open again");
                self.set(&mut inner, open);
            }
            State::Open { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ticket to ask the store; panics if the breaker says skip.
    fn ask(breaker: &Breaker, why: &str) -> Ticket {
        match breaker.gate() {
            Gate::Ask(ticket) => ticket,
            Gate::Skip => panic!("skipped: {why}"),
        }
    }

    fn skips(breaker: &Breaker) -> bool {
        breaker.gate() == Gate::Skip
    }

    #[test]
    fn opens_after_a_run_of_failures_and_recovers_through_a_probe() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 3,
            cooldown: Duration::from_millis(30),
        });
        breaker.failure(ask(&breaker, "closed"));
        breaker.failure(ask(&breaker, "closed"));
        breaker.success(ask(&breaker, "closed")); // a success resets the run
        breaker.failure(ask(&breaker, "closed"));
        breaker.failure(ask(&breaker, "closed"));
        let third = ask(&breaker, "two failures in a row");
        breaker.failure(third);
        assert!(skips(&breaker), "three in a row open it");
        std::thread::sleep(Duration::from_millis(40));
        let probe = ask(&breaker, "one probe");
        assert!(skips(&breaker), "only one");
        breaker.failure(probe);
        assert!(skips(&breaker), "open again");
        std::thread::sleep(Duration::from_millis(40));
        let _lost = ask(&breaker, "a probe that never reports");
        // A probe that never reports is replaced after a cooldown.
        std::thread::sleep(Duration::from_millis(40));
        let probe = ask(&breaker, "a new probe");
        breaker.success(probe);
        ask(&breaker, "closed");
        ask(&breaker, "closed");
    }

    #[test]
    fn zero_failures_opens_at_the_first_failure() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 0,
            cooldown: Duration::from_secs(60),
        });
        ask(&breaker, "nothing failed yet");
        breaker.success(ask(&breaker, "nothing failed yet"));
        ask(&breaker, "a success does not open it");
        breaker.failure(ask(&breaker, "closed"));
        assert!(skips(&breaker), "the first failure opens it");
    }

    #[test]
    fn a_zero_cooldown_never_holds_a_request_back() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 1,
            cooldown: Duration::ZERO,
        });
        breaker.failure(ask(&breaker, "closed"));
        let a = ask(&breaker, "every request probes");
        let b = ask(&breaker, "every request probes");
        breaker.failure(a);
        breaker.success(b);
        ask(&breaker, "closed again");
    }

    #[test]
    fn a_cooldown_past_the_clock_never_probes() {
        for cooldown in [Duration::MAX, Duration::from_secs(u64::MAX)] {
            let breaker = Breaker::new(CircuitBreaker {
                failures: 1,
                cooldown,
            });
            breaker.failure(ask(&breaker, "closed"));
            assert!(skips(&breaker));
            std::thread::sleep(Duration::from_millis(5));
            assert!(skips(&breaker), "never probes");
        }
    }

    #[test]
    fn a_result_from_before_the_circuit_opened_does_not_close_it() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 1,
            cooldown: Duration::from_millis(30),
        });
        // An old request is asked while the circuit is closed...
        let old = ask(&breaker, "closed");
        // ...another fails and opens it...
        breaker.failure(ask(&breaker, "closed"));
        std::thread::sleep(Duration::from_millis(40));
        // ...a probe goes out...
        let probe = ask(&breaker, "the probe");
        // ...and the old request's success arrives first.
        breaker.success(old);
        assert!(
            skips(&breaker),
            "a result from before the circuit opened closed it"
        );
        // Only the probe's result closes it.
        breaker.success(probe);
        ask(&breaker, "the probe closed it");
    }

    #[test]
    fn a_late_failure_does_not_reopen_while_a_probe_is_out() {
        let cooldown = Duration::from_millis(100);
        let breaker = Breaker::new(CircuitBreaker {
            failures: 1,
            cooldown,
        });
        let old = ask(&breaker, "closed");
        breaker.failure(ask(&breaker, "closed"));
        std::thread::sleep(cooldown + Duration::from_millis(10));
        let _probe = ask(&breaker, "the probe");
        let probed = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        // The old request fails late: not news about the probe.
        breaker.failure(old);
        // The probe never reports (its request was dropped): once it is a
        // cooldown overdue, the next request probes again.
        let overdue = probed + cooldown + Duration::from_millis(10);
        std::thread::sleep(overdue.saturating_duration_since(Instant::now()));
        assert!(
            !skips(&breaker),
            "a result from before the circuit opened reopened it"
        );
    }

    #[test]
    fn a_replaced_probe_does_not_decide() {
        let cooldown = Duration::from_millis(30);
        let breaker = Breaker::new(CircuitBreaker {
            failures: 1,
            cooldown,
        });
        breaker.failure(ask(&breaker, "closed"));
        std::thread::sleep(cooldown + Duration::from_millis(10));
        let lost = ask(&breaker, "the first probe");
        std::thread::sleep(cooldown + Duration::from_millis(10));
        let probe = ask(&breaker, "the first probe is overdue");
        // The overdue probe answers at last: its successor decides.
        breaker.success(lost);
        assert!(skips(&breaker), "a replaced probe closed the circuit");
        breaker.failure(probe);
        assert!(skips(&breaker));
    }

    #[test]
    fn a_failure_from_before_the_circuit_closed_does_not_count() {
        let cooldown = Duration::from_millis(30);
        let breaker = Breaker::new(CircuitBreaker {
            failures: 2,
            cooldown,
        });
        let old = ask(&breaker, "closed");
        breaker.failure(ask(&breaker, "closed"));
        breaker.failure(ask(&breaker, "closed"));
        std::thread::sleep(cooldown + Duration::from_millis(10));
        breaker.success(ask(&breaker, "the probe"));
        // Closed again: a failure from before it opened is old news.
        breaker.failure(old);
        breaker.failure(ask(&breaker, "closed"));
        ask(&breaker, "one failure of two");
    }
}
