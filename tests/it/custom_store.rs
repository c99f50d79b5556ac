//! A store written outside the crate (`examples/custom_store.rs`, over
//! the public `KeyState`) passes the crate's conformance suite: it decides
//! as `MemoryStore` does, for every algorithm, command and release.

#[path = "../../examples/custom_store.rs"]
#[allow(dead_code, unreachable_pub)]
mod example;

use tower_redis_ratelimit::store::conformance;

#[tokio::test]
async fn a_store_of_your_own_decides_as_memory_store_does() {
    if let Err(mismatch) = conformance::check_store(example::MapStore::new).await {
        panic!("{mismatch}");
    }
}

/// The stores the kit must reject: each of the guide's shape with one
/// defect.
mod broken {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use tower_redis_ratelimit::clock::{Clock, ManualClock};
    use tower_redis_ratelimit::decision::Lease;
    use tower_redis_ratelimit::store::{Command, KeyState, conformance};
    use tower_redis_ratelimit::{Decision, Policy, Store, StoreError};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Defect {
        /// `check_in_process` answers from a copy of the state: it counts
        /// nothing (a 3/s limiter over it admitted 10 of 10).
        InProcessCountsNothing,
        /// A state per key and algorithm: a block holds under one
        /// algorithm only.
        StatePerAlgorithm,
        /// A state dropped half a millisecond before it expires (an
        /// expiry rounded to milliseconds).
        ExpiresEarly,
        /// A check reads the state, waits, then writes it back: checks at
        /// once lose each other's counts.
        ReadWaitWrite,
        /// Operator commands left to the trait's default.
        NoCommands,
        /// Releases left to the trait's default: a slot is never freed.
        NoRelease,
    }

    struct Broken {
        clock: ManualClock,
        defect: Defect,
        keys: Mutex<HashMap<String, KeyState>>,
    }

    impl Broken {
        fn new(clock: ManualClock, defect: Defect) -> Self {
            let keys = Mutex::new(HashMap::new());
            Self {
                clock,
                defect,
                keys,
            }
        }

        fn slot(&self, key: &str, policy: &Policy) -> String {
            match self.defect {
                Defect::StatePerAlgorithm => format!("{}:{key}", policy.algorithm()),
                _ => key.to_owned(),
            }
        }

        fn with_state<T>(
            &self,
            key: &str,
            policy: &Policy,
            f: impl FnOnce(&mut KeyState) -> T,
        ) -> T {
            let now = self.clock.now();
            let early = match self.defect {
                Defect::ExpiresEarly => Duration::from_micros(500),
                _ => Duration::ZERO,
            };
            let mut keys = self.keys.lock().unwrap();
            keys.retain(|_, state| state.expires_at() > now + early);
            f(keys.entry(self.slot(key, policy)).or_default())
        }
    }

    impl Store for Broken {
        async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
            let now = self.clock.now();
            if self.defect == Defect::ReadWaitWrite {
                let mut state = self.with_state(key, policy, |state| state.clone());
                tokio::task::yield_now().await;
                let decision = state.check(now, policy);
                self.with_state(key, policy, |stored| *stored = state);
                return Ok(decision);
            }
            Ok(self.with_state(key, policy, |state| state.check(now, policy)))
        }

        fn check_in_process(&self, key: &str, policy: &Policy) -> Option<Decision> {
            let now = self.clock.now();
            (self.defect == Defect::InProcessCountsNothing)
                .then(|| self.with_state(key, policy, |state| state.clone().check(now, policy)))
        }

        async fn command(
            &self,
            key: &str,
            policy: &Policy,
            command: Command,
        ) -> Result<Decision, StoreError> {
            if self.defect == Defect::NoCommands {
                return Err(StoreError::Unsupported("operator commands"));
            }
            let now = self.clock.now();
            Ok(self.with_state(key, policy, |state| state.command(now, policy, command)))
        }

        async fn release(
            &self,
            key: &str,
            policy: &Policy,
            lease: Lease,
        ) -> Result<(), StoreError> {
            if self.defect != Defect::NoRelease {
                self.with_state(key, policy, |state| state.release(lease));
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn the_kit_rejects_each_defect_and_says_where() {
        for defect in [
            Defect::InProcessCountsNothing,
            Defect::StatePerAlgorithm,
            Defect::ExpiresEarly,
            Defect::ReadWaitWrite,
            Defect::NoCommands,
            Defect::NoRelease,
        ] {
            let mismatch = conformance::check_store(|clock| Broken::new(clock, defect))
                .await
                .expect_err(&format!("{defect:?} passed the kit"));
            let report = mismatch.to_string();
            eprintln!("{defect:?}: {report}");
            // The report names where the store went wrong, and how.
            assert_ne!(mismatch.expected, mismatch.got, "{defect:?}: {report}");
            let wrong = match defect {
                Defect::NoCommands => mismatch.got.contains("does not support operator commands"),
                Defect::ReadWaitWrite => mismatch.op.contains("at once"),
                Defect::NoRelease => {
                    mismatch.algorithm == tower_redis_ratelimit::Algorithm::Concurrency
                }
                _ => {
                    mismatch.op.contains("Check")
                        || mismatch.op.contains("GiveBack")
                        || mismatch.op.contains("Command")
                }
            };
            assert!(wrong, "{defect:?}: {report}");
        }
    }
}
