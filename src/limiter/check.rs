//! One check of a [`Limiter`](crate::Limiter) in its store: started at
//! once (the deny cache, a store deciding in process, the breaker),
//! finished when the store answers, and [`Check`], the future between.
//! Every decision's verdict is built by one function, `decided`.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use super::breaker::{Breaker, Gate, Ticket};
use super::{DecidedBy, LimitError, Limiter, Verdict};
use crate::decision::Decision;
use crate::key::KeyHash;
use crate::policy::{Algorithm, Policy};
use crate::store::{BoxFuture, StoreError};

/// A check waiting for the store. The future holds the key and hands it
/// back with the answer.
pub(super) struct Waiting {
    future: BoxFuture<(String, Result<Decision, StoreError>)>,
    sent: Instant,
    ticket: Option<Ticket>,
    policy: Arc<Policy>,
}

impl Limiter {
    /// The check of `key` (as given) under `policy` (the limiter's when
    /// `None`; only its denials use the deny cache), in order: the deny
    /// cache, a store deciding in process (it cannot fail: no breaker to
    /// ask, no latency to measure, no future), the breaker, and a future of
    /// the store's answer, which holds the key and hands it back.
    pub(super) fn start_in_store(&self, key: String, policy: Option<Arc<Policy>>) -> Check {
        let key = self.store_key(key);
        if policy.is_none()
            && let Some(denied) = self.cached(&key)
        {
            tracing::debug!(
                key = %KeyHash::stored(&key),
                retry_after_ms = denied.retry_after().as_millis() as u64,
                "rate limit: denied (deny cache)"
            );
            let verdict = Ok(Verdict::without_permit(Some(denied), DecidedBy::DenyCache));
            return Check::done(self.counted(self.raw_key(&key), verdict));
        }
        // Borrowed, not cloned: an `Arc` clone per check is a write to a
        // counter every thread shares.
        let policy = policy.as_ref().unwrap_or(&self.inner.policy);
        if let Some(decision) = self.inner.store.check_in_process(&key, policy) {
            return Check::done(self.decided(&key, policy, decision, None));
        }
        let ticket = match self.inner.breaker.as_deref().map(Breaker::gate) {
            Some(Gate::Skip) => {
                crate::metrics::breaker_open(self.name(), true);
                let outcome = Err(StoreError::CircuitOpen);
                return Check::done(self.finish(&key, policy, outcome, None, None));
            }
            Some(Gate::Ask(ticket)) => Some(ticket),
            None => None,
        };
        let future = Arc::clone(&self.inner.store).check_owned(key, Arc::clone(policy));
        Check {
            state: CheckState::Waiting {
                limiter: self.clone(),
                waiting: Waiting {
                    future,
                    sent: Instant::now(),
                    ticket,
                    policy: Arc::clone(policy),
                },
            },
        }
    }

    /// The verdict of the check of store key `key` under `policy`, from
    /// the store's `outcome` (asked at `sent`, when the clock was read):
    /// counted in the metrics and the breaker, a denial held in the deny
    /// cache, a failure handed to the fail mode.
    fn finish(
        &self,
        key: &str,
        policy: &Arc<Policy>,
        outcome: Result<Decision, StoreError>,
        sent: Option<Instant>,
        ticket: Option<Ticket>,
    ) -> Result<Verdict, LimitError> {
        let name = self.name();
        match outcome {
            Err(error) => {
                // While the circuit is open nothing was asked: no news for
                // the breaker. A busy key is the store answering about
                // that key alone: it does not open the breaker.
                if !matches!(error, StoreError::CircuitOpen) {
                    crate::metrics::store_latency(name, sent);
                    self.store_answered(ticket, matches!(error, StoreError::KeyBusy(_)));
                }
                let verdict = self.fail(key, policy, error);
                self.counted(self.raw_key(key), verdict)
            }
            Ok(decision) => {
                crate::metrics::store_latency(name, sent);
                self.store_answered(ticket, true);
                self.decided(key, policy, decision, sent)
            }
        }
    }

    /// The verdict of the store's `decision` on `store_key`, counted,
    /// a denial held in the deny cache: one function for a store asked
    /// directly, one deciding in process and one answering later alike.
    #[inline(always)]
    pub(super) fn decided(
        &self,
        store_key: &str,
        policy: &Arc<Policy>,
        decision: Decision,
        sent: Option<Instant>,
    ) -> Result<Verdict, LimitError> {
        let key = self.raw_key(store_key);
        let name = &*self.inner.name;
        let verdict = if decision.allowed() {
            tracing::debug!(key = %KeyHash::held(name, key), remaining = decision.remaining(), "rate limit: admitted");
            // Only a concurrency admission holds a permit (its slot).
            if policy.algorithm() == Algorithm::Concurrency {
                Verdict::of(
                    &self.inner.store,
                    policy,
                    store_key,
                    decision,
                    DecidedBy::Store,
                )
            } else {
                Verdict::without_permit(Some(decision), DecidedBy::Store)
            }
        } else {
            tracing::debug!(
                key = %KeyHash::held(name, key),
                retry_after_ms = decision.retry_after().as_millis() as u64,
                "rate limit: denied"
            );
            if Arc::ptr_eq(policy, &self.inner.policy)
                && let Some(deny_cache) = self.usable_deny_cache()
            {
                deny_cache.insert(store_key, &decision, sent.unwrap_or_else(Instant::now));
            }
            Verdict::without_permit(Some(decision), DecidedBy::Store)
        };
        self.counted(key, Ok(verdict))
    }

    /// Tell the breaker how the store did with the check of `ticket`.
    fn store_answered(&self, ticket: Option<Ticket>, ok: bool) {
        if let (Some(breaker), Some(ticket)) = (&self.inner.breaker, ticket) {
            if ok {
                breaker.success(ticket);
            } else {
                breaker.failure(ticket);
            }
            crate::metrics::breaker_open(self.name(), breaker.is_open());
        }
    }
}

/// The future of [`Limiter::check_owned`](crate::Limiter::check_owned).
#[must_use = "a check does nothing unless awaited"]
pub struct Check {
    state: CheckState,
}

// Unboxed: the verdict moves once per check; boxing it would allocate.
#[allow(clippy::large_enum_variant)]
enum CheckState {
    Done(Option<Result<Verdict, LimitError>>),
    Waiting {
        limiter: Limiter,
        waiting: Waiting,
    },
    /// A local quota's refill (a lock, then one or two checks).
    Boxed(BoxFuture<Result<Verdict, LimitError>>),
}

impl Check {
    pub(super) fn done(verdict: Result<Verdict, LimitError>) -> Self {
        Self {
            state: CheckState::Done(Some(verdict)),
        }
    }

    pub(super) fn boxed(future: BoxFuture<Result<Verdict, LimitError>>) -> Self {
        Self {
            state: CheckState::Boxed(future),
        }
    }

    /// The answer, taken, when the check was answered without waiting (an
    /// in-process store, the deny cache, an open circuit): no need to poll.
    pub fn now(&mut self) -> Option<Result<Verdict, LimitError>> {
        match &mut self.state {
            CheckState::Done(verdict) => verdict.take(),
            CheckState::Waiting { .. } | CheckState::Boxed(_) => None,
        }
    }
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            CheckState::Done(_) => "done",
            CheckState::Waiting { .. } | CheckState::Boxed(_) => "waiting",
        };
        f.debug_struct("Check").field("state", &state).finish()
    }
}

impl std::future::Future for Check {
    type Output = Result<Verdict, LimitError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let verdict = match &mut self.state {
            CheckState::Done(verdict) => verdict.take(),
            CheckState::Waiting { limiter, waiting } => {
                let (key, outcome) = std::task::ready!(waiting.future.as_mut().poll(cx));
                Some(limiter.finish(
                    &key,
                    &waiting.policy,
                    outcome,
                    Some(waiting.sent),
                    waiting.ticket,
                ))
            }
            CheckState::Boxed(future) => Some(std::task::ready!(future.as_mut().poll(cx))),
        };
        self.state = CheckState::Done(None);
        std::task::Poll::Ready(verdict.unwrap_or_else(|| {
            Err(LimitError::Store(StoreError::UnexpectedReply(
                "a check polled after it completed".into(),
            )))
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use crate::clock::ManualClock;
    use crate::decision::{Decision, Lease, RateStatus};
    use crate::limiter::Limiter;
    use crate::policy::{Algorithm, Policy};
    use crate::store::{Command, MemoryStore, Store, StoreError};

    /// A `MemoryStore` the limiter does not recognise: its checks take the
    /// general path (breaker, deny cache, a dynamic call).
    struct Wrapped(MemoryStore);

    impl Store for Wrapped {
        async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
            self.0.check(key, policy).await
        }

        fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision> {
            self.0.check_in_process(key, policy)
        }

        async fn command(
            &self,
            key: &str,
            policy: &Policy,
            command: Command,
        ) -> Result<Decision, StoreError> {
            self.0.command(key, policy, command).await
        }

        async fn release(
            &self,
            key: &str,
            policy: &Policy,
            lease: Lease,
        ) -> Result<(), StoreError> {
            self.0.release(key, policy, lease).await
        }
    }

    /// A limiter over a `MemoryStore` decides in process without the
    /// breaker or the deny cache: the same verdicts, the same state and
    /// the same metrics source as the general path, for every algorithm.
    #[tokio::test]
    async fn the_memory_path_takes_the_general_paths_decisions() {
        let policies = [
            "3/s".parse::<Policy>().unwrap(),
            "3/s".parse::<Policy>().unwrap().gcra().unwrap(),
            "3/s".parse::<Policy>().unwrap().fixed_window().unwrap(),
            "3/s".parse::<Policy>().unwrap().sliding_window().unwrap(),
            "2/s, 5/min".parse::<Policy>().unwrap().gcra().unwrap(),
            "6/s".parse::<Policy>().unwrap().with_cost(2).unwrap(),
            "2/day".parse::<Policy>().unwrap(),
            Policy::concurrency(2).unwrap(),
        ];
        // A name held as it is in `{name}:{key}`, and one that makes every
        // store key hashed (a brace).
        for (policy, name) in policies
            .iter()
            .flat_map(|p| [(p.clone(), "api"), (p.clone(), "{api}")])
        {
            let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
            let fast = Limiter::new(MemoryStore::with_clock(clock.clone()), policy.clone())
                .with_name(name);
            let general = Limiter::new(
                Wrapped(MemoryStore::with_clock(clock.clone())),
                policy.clone(),
            )
            .with_name(name);
            assert!(fast.inner.memory.is_some() && general.inner.memory.is_none());
            // Short keys; one of the hashed form (held by its hash, as a
            // long one is); the longest whose store key is held as it is,
            // and one byte longer (hashed).
            let longest = crate::store::MAX_RAW_KEY_LEN - name.len() - 1;
            let keys = [
                "k0".to_owned(),
                "k1".to_owned(),
                "#k".to_owned(),
                "x".repeat(500),
                "y".repeat(longest),
                "z".repeat(longest + 1),
            ];
            let mut held = Vec::new();
            let metrics = (recorder(), recorder());
            for step in 0..100u64 {
                let key = keys[step as usize % keys.len()].clone();
                if step % 17 == 5 {
                    fast.block(&key, Duration::from_millis(300)).await.unwrap();
                    general
                        .block(&key, Duration::from_millis(300))
                        .await
                        .unwrap();
                }
                let a = recorded(&metrics.0, || fast.check_owned(key.clone()).now());
                let b = recorded(&metrics.1, || general.check_owned(key.clone()).now());
                let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
                // Neither holds a denial of a store whose denials are not
                // final.
                let store_key = fast.store_key(crate::store::bounded(key.clone()));
                assert!(fast.cached(&store_key).is_none() && general.cached(&store_key).is_none());
                // Lease ids are the store's own: equal in kind, not in value.
                assert_eq!(
                    a.decision().map(shape),
                    b.decision().map(shape),
                    "{policy} step {step}"
                );
                assert_eq!(a.decided_by(), b.decided_by(), "{policy} step {step}");
                let (a, b) = (a.into_permit(), b.into_permit());
                assert_eq!(a.is_some(), b.is_some(), "{policy} step {step}");
                if step % 2 == 0 {
                    held.push((a, b));
                } else {
                    held.clear();
                }
                clock.advance(Duration::from_millis(70));
            }
            for key in &keys {
                assert_eq!(
                    shape(&fast.peek(key).await.unwrap()),
                    shape(&general.peek(key).await.unwrap()),
                    "{policy} {key}"
                );
            }
            // The same keys denied most, and the same metrics.
            assert_eq!(
                fast.most_denied().await.unwrap(),
                general.most_denied().await.unwrap(),
                "{policy}"
            );
            #[cfg(feature = "metrics")]
            assert_eq!(counters(&metrics.0), counters(&metrics.1), "{policy}");
        }
    }

    /// Each limiter's metrics apart (`()` without the feature).
    #[cfg(feature = "metrics")]
    type Recorder = metrics_util::debugging::DebuggingRecorder;
    #[cfg(not(feature = "metrics"))]
    type Recorder = ();

    fn recorder() -> Recorder {
        Recorder::default()
    }

    /// `check`, its metrics recorded in `recorder`.
    fn recorded<T>(recorder: &Recorder, check: impl FnOnce() -> T) -> T {
        #[cfg(feature = "metrics")]
        return metrics::with_local_recorder(recorder, check);
        #[cfg(not(feature = "metrics"))]
        {
            let () = recorder;
            check()
        }
    }

    /// The counters `recorder` holds, by key.
    #[cfg(feature = "metrics")]
    fn counters(recorder: &Recorder) -> Vec<String> {
        let mut counters: Vec<String> = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| format!("{key:?} {value:?}"))
            .collect();
        counters.sort();
        counters
    }

    /// What a decision says, apart from its lease's id.
    #[allow(clippy::type_complexity)]
    fn shape(d: &Decision) -> (bool, Algorithm, bool, Duration, Vec<RateStatus>, bool, bool) {
        (
            d.allowed(),
            d.algorithm(),
            d.blocked(),
            d.retry_after(),
            d.rates().to_vec(),
            d.lease().is_some(),
            d.refund_id().is_some(),
        )
    }
}
