//! The circuit breaker: after a run of store failures, stop paying the
//! store's timeout on every request; probe now and then; recover alone.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// When the breaker opens and how long it stays open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitBreaker {
    /// Consecutive failures that open the breaker.
    pub failures: u32,
    /// How long it stays open before one request probes the store.
    pub cooldown: Duration,
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
    state: Mutex<State>,
    /// What `state` is, readable without the lock (one of the `HEALTHY`,
    /// `FAILING`, `OPEN` constants): while the store answers, a request
    /// neither locks nor reads the clock. Written under the lock; a reader
    /// that sees it a moment late only asks the store once more.
    summary: AtomicU8,
}

/// `Closed` with no failure.
const HEALTHY: u8 = 0;
/// `Closed` after some failures.
const FAILING: u8 = 1;
/// `Open` or `Probing`.
const OPEN: u8 = 2;

#[derive(Debug, Clone, Copy)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is out; everyone else fails fast until it reports, or
    /// until `until` (a probe whose request was dropped never reports).
    Probing {
        until: Instant,
    },
}

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permit {
    /// Ask the store.
    Ask,
    /// Do not: the store is considered down.
    Skip,
}

impl Breaker {
    pub(crate) fn new(config: CircuitBreaker) -> Self {
        Self {
            config,
            state: Mutex::new(State::Closed { failures: 0 }),
            summary: AtomicU8::new(HEALTHY),
        }
    }

    /// Move to `next`, keeping the summary in step (`state` is the locked
    /// state).
    fn set(&self, state: &mut State, next: State) {
        *state = next;
        let summary = match next {
            State::Closed { failures: 0 } => HEALTHY,
            State::Closed { .. } => FAILING,
            State::Open { .. } | State::Probing { .. } => OPEN,
        };
        self.summary.store(summary, Ordering::Release);
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn permit(&self) -> Permit {
        if self.summary.load(Ordering::Acquire) != OPEN {
            return Permit::Ask;
        }
        let mut state = self.state();
        let now = Instant::now();
        match *state {
            State::Closed { .. } => Permit::Ask,
            State::Open { until } | State::Probing { until } if now >= until => {
                self.set(
                    &mut state,
                    State::Probing {
                        until: now + self.config.cooldown,
                    },
                );
                tracing::info!("rate limit store: circuit half-open, probing");
                Permit::Ask
            }
            State::Open { .. } | State::Probing { .. } => Permit::Skip,
        }
    }

    pub(crate) fn success(&self) {
        if self.summary.load(Ordering::Acquire) == HEALTHY {
            return;
        }
        let mut state = self.state();
        if !matches!(*state, State::Closed { failures: 0 }) {
            if !matches!(*state, State::Closed { .. }) {
                tracing::warn!("rate limit store: answering again, circuit closed");
            }
            self.set(&mut state, State::Closed { failures: 0 });
        }
    }

    pub(crate) fn failure(&self) {
        let mut state = self.state();
        let open = State::Open {
            until: Instant::now() + self.config.cooldown,
        };
        match *state {
            State::Closed { failures } if failures + 1 >= self.config.failures => {
                tracing::warn!(
                    failures = failures + 1,
                    cooldown_ms = self.config.cooldown.as_millis() as u64,
                    "rate limit store: circuit open, not asking the store until a probe succeeds"
                );
                self.set(&mut state, open);
            }
            State::Closed { failures } => self.set(
                &mut state,
                State::Closed {
                    failures: failures + 1,
                },
            ),
            State::Probing { .. } => {
                tracing::warn!("rate limit store: probe failed, circuit open again");
                self.set(&mut state, open);
            }
            State::Open { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_a_run_of_failures_and_recovers_through_a_probe() {
        let breaker = Breaker::new(CircuitBreaker {
            failures: 3,
            cooldown: Duration::from_millis(30),
        });
        breaker.failure();
        breaker.failure();
        breaker.success(); // a success resets the run
        breaker.failure();
        breaker.failure();
        assert_eq!(breaker.permit(), Permit::Ask);
        breaker.failure();
        assert_eq!(breaker.permit(), Permit::Skip);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(breaker.permit(), Permit::Ask, "one probe");
        assert_eq!(breaker.permit(), Permit::Skip, "only one");
        breaker.failure();
        assert_eq!(breaker.permit(), Permit::Skip, "open again");
        std::thread::sleep(Duration::from_millis(40));
        // A probe that never reports is replaced after a cooldown.
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(breaker.permit(), Permit::Ask);
        breaker.success();
        assert_eq!(breaker.permit(), Permit::Ask);
        assert_eq!(breaker.permit(), Permit::Ask);
    }
}
