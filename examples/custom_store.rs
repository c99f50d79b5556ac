//! A `Store` of your own, written only against the crate's public API:
//! every key's `KeyState` in a `HashMap` behind a `Mutex`, on a clock. The
//! same shape fits any place that can read and write one key's state
//! atomically (a row in one transaction, a document with a version).
//! The crate's conformance suite holds it to `MemoryStore`'s decisions
//! (`tests/it/custom_store.rs`).
//!
//! `cargo run --example custom_store` limits a few keys with it.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tower_redis_ratelimit::clock::{Clock, SystemClock};
use tower_redis_ratelimit::decision::Lease;
use tower_redis_ratelimit::store::{Command, KeyState};
use tower_redis_ratelimit::{Decision, Limiter, Policy, Store, StoreError};

/// Every key's state in one map.
#[derive(Debug)]
pub struct MapStore<C> {
    clock: C,
    keys: Mutex<HashMap<String, KeyState>>,
}

impl<C: Clock> MapStore<C> {
    /// An empty store on `clock`.
    pub fn new(clock: C) -> Self {
        Self {
            clock,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// Run `f` on the state of `key` at the time read once the lock is
    /// held, dropping states that stopped mattering.
    fn with_state<T>(&self, key: &str, f: impl FnOnce(&mut KeyState, Duration) -> T) -> T {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let now = self.clock.now();
        // A real store would bound its keys (MemoryStore keeps at most
        // 100,000); this one only forgets the expired ones.
        keys.retain(|_, state| state.expires_at() > now);
        f(keys.entry(key.to_owned()).or_default(), now)
    }
}

impl<C: Clock> Store for MapStore<C> {
    async fn check(&self, key: &str, policy: &Policy) -> Result<Decision, StoreError> {
        Ok(self.with_state(key, |state, now| state.check(now, policy)))
    }

    async fn command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> Result<Decision, StoreError> {
        Ok(self.with_state(key, |state, now| state.command(now, policy, command)))
    }

    async fn release(&self, key: &str, _policy: &Policy, lease: Lease) -> Result<(), StoreError> {
        self.with_state(key, |state, _| state.release(lease));
        Ok(())
    }
}

#[allow(dead_code)] // Included by tests/it/custom_store.rs, which has its own main.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let limiter =
        Limiter::new(MapStore::new(SystemClock::new()), "2/s".parse::<Policy>()?).with_name("jobs");
    for attempt in 1..=3 {
        let verdict = limiter.check("tenant-42").await?;
        println!("attempt {attempt}: admitted {}", verdict.allowed());
    }
    Ok(())
}
