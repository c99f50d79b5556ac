//! One check of a key in Redis: alone (one script, or the sliding log's
//! transaction), or in a batch of checks of its algorithm.

use std::sync::Arc;

use super::batch::{Batcher, Waiting};
use super::cleanup::Cleanup;
use super::reply::member;
use super::{BLOCK_TAG, RedisStore, script, sliding_log};
use crate::decision::Decision;
use crate::policy::{Algorithm, Execution, Policy};
use crate::store::StoreError;

impl RedisStore {
    /// The batcher of `algorithm`'s checks, when they go in batches.
    pub(super) fn batcher(&self, algorithm: Algorithm) -> Option<&Arc<Batcher>> {
        self.batchers.as_ref()?.get(algorithm)
    }

    /// The check of `key` as one of `batcher`'s batch, answered within the
    /// timeout.
    pub(super) async fn check_in_batch(
        &self,
        batcher: &Arc<Batcher>,
        key: &str,
        policy: &Policy,
    ) -> Result<Decision, StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let waiting = Waiting {
            state: self.redis_key(policy.algorithm().tag(), key),
            block: self.redis_key(BLOCK_TAG, key),
            policy: policy.clone(),
            now: self.clock.local_micros(),
            reply,
        };
        batcher.submit(&self.connections, self.timeout, waiting);
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(decision)) => decision,
            Ok(Err(_)) => Err(StoreError::UnexpectedReply(
                "the check's batch ended without an answer".to_owned(),
            )),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// The check of `key` on its own: one script, or the sliding log's
    /// transaction.
    pub(super) async fn check_alone(
        &self,
        key: &str,
        policy: &Policy,
    ) -> Result<Decision, StoreError> {
        let started = tokio::time::Instant::now();
        let redis_key = self.redis_key(policy.algorithm().tag(), key);
        let block_key = self.redis_key(BLOCK_TAG, key);
        let keys = script::Keys {
            state: &redis_key,
            block: &block_key,
        };
        let lease = self.ids.next();
        let id = member(lease);
        let eval = match (policy.algorithm(), policy.execution()) {
            (Algorithm::SlidingLog, Execution::Transaction) => None,
            _ => Some(script::check(keys, policy, &id, self.clock.local_micros())?),
        };
        // The entries the sliding log's transaction writes, or the lease the
        // concurrency limit takes: the same on every attempt, so a retry
        // after a lost reply counts once. Until the outcome is known, an
        // error or a dropped future (the timeout) takes them back out, after
        // the last attempt's commands on the same connection. (The script
        // writes only admitted requests: an error after it ran leaves an
        // admission that counts once, as the fail mode decides.)
        let pending = match (policy.algorithm(), policy.execution()) {
            (Algorithm::SlidingLog, Execution::Transaction) => Some(Cleanup::new(
                &self.connections,
                &redis_key,
                sliding_log::members(&id, policy.cost()),
                self.timeout,
            )),
            (Algorithm::Concurrency, _) => Some(Cleanup::new(
                &self.connections,
                &redis_key,
                vec![id.clone()],
                self.timeout,
            )),
            _ => None,
        };
        // A connection broken by a Redis restart or a lost reply: the check
        // is sent again where a repeat is harmless (the request's entries
        // or lease are the same). The counters and GCRA would count it
        // twice: their failure goes to the fail mode instead.
        let decision = self
            .call("check")
            .script(eval.as_ref().map(script::Eval::script))
            .repeatable(idempotent(policy.algorithm()))
            .run(|mut conn| {
                let pending = pending.as_ref();
                if let Some(pending) = pending {
                    pending.bind(&conn);
                }
                let members = pending.map_or(&[][..], Cleanup::members);
                let (eval, clock) = (eval.as_ref(), &self.clock);
                async move {
                    match eval {
                        None => {
                            sliding_log::transaction(conn.get(), keys, policy, members, clock).await
                        }
                        Some(eval) => script::decode_reply(eval.send(conn.get()).await?, policy),
                    }
                }
            })
            .await?;
        // Admitted by the concurrency limit, the decision holds its lease.
        let decision = if decision.allowed() && policy.algorithm() == Algorithm::Concurrency {
            decision.with_lease(lease)
        } else {
            decision
        };
        if let Some(mut pending) = pending {
            if decision.allowed() || policy.algorithm() == Algorithm::Concurrency {
                // Admitted: the entries count (a lease is the caller's to
                // release). A denied lease was never taken.
                pending.disarm();
            } else {
                // Denied attempts must not count. Taking a denied entry
                // back out never turns the decision into an error, and
                // waits no longer than what is left of the timeout (then
                // it goes on in the background).
                pending
                    .run(self.timeout.saturating_sub(started.elapsed()))
                    .await;
            }
        }
        // An admitted sliding-log check carries the id of its entries: what
        // a refund of it removes.
        if decision.allowed() && policy.algorithm() == Algorithm::SlidingLog {
            return Ok(decision.with_entries(lease.into()));
        }
        Ok(decision)
    }
}

/// Whether running a check twice (after a connection error that may have
/// come after Redis ran it) counts once.
fn idempotent(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::SlidingLog | Algorithm::Concurrency)
}
