//! One check of a key in Redis: alone (one script, or the sliding log's
//! transaction), or in a batch of checks of its algorithm.

use std::sync::Arc;
use std::time::Duration;

use super::batch::{Batcher, Waiting};
use super::cleanup::Cleanup;
use super::reply::member;
use super::sliding_log::{Denial, Verdict};
use super::{BLOCK_TAG, RedisStore, script, sliding_log};
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Execution, Policy};
use crate::store::StoreError;

impl RedisStore {
    /// The batcher of `policy`'s checks, when they go in batches (the
    /// sliding log's in its `Script` execution only).
    pub(super) fn batcher(&self, policy: &Policy) -> Option<&Arc<Batcher>> {
        if policy.execution() == Execution::Transaction
            && policy.algorithm() == Algorithm::SlidingLog
        {
            return None;
        }
        self.batchers.as_ref()?.get(policy.algorithm())
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
            request_id: (policy.algorithm() == Algorithm::SlidingLog).then(|| self.ids.next()),
            reply,
        };
        batcher.submit(&self.connections, &self.clock, self.timeout, waiting);
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
        let asked = self.clock.local_micros();
        let eval = match (policy.algorithm(), policy.execution()) {
            (Algorithm::SlidingLog, Execution::Transaction) => None,
            _ => Some(script::check(keys, policy, &id, asked)?),
        };
        let pending = self.pending(&redis_key, policy, &id);
        let reads_first = eval.is_none() && sliding_log::reads_first(policy);
        let known_full = reads_first && self.full_logs.holds(&redis_key, policy, asked);
        // Only the first attempt reads first: sent again, the check may
        // have written its entries, which a read would count against it.
        let mut first = known_full;
        // A connection broken by a Redis restart or a lost reply: the check
        // is sent again where a repeat is harmless (the request's entries
        // or lease are the same). The counters and GCRA would count it
        // twice: their failure goes to the fail mode instead.
        let verdict = self
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
                let read_first = std::mem::take(&mut first);
                async move {
                    match eval {
                        None => {
                            sliding_log::transaction(
                                conn.get(),
                                keys,
                                policy,
                                members,
                                clock,
                                read_first,
                            )
                            .await
                        }
                        Some(eval) => script::decode_reply(eval.send(conn.get()).await?, policy)
                            .map(Verdict::Decided),
                    }
                }
            })
            .await?;
        let left = self.timeout.saturating_sub(started.elapsed());
        let decision = match (verdict, pending) {
            // The denied request's entries come out, and the entries its
            // wait and reset come from are read after, in one transaction.
            (Verdict::Denied(denial), Some(pending)) => {
                let reads = pending
                    .run_reading(left, &Denial::reads(&redis_key, policy))
                    .await;
                denial.decide(reads.as_deref(), policy)
            }
            (Verdict::Denied(denial), None) => denial.decide(None, policy),
            (Verdict::Decided(decision), Some(pending)) => {
                Self::conclude(pending, &decision, policy, left).await;
                decision
            }
            (Verdict::Decided(decision), None) => decision,
            (Verdict::Unwritten(decision), pending) => {
                if let Some(mut pending) = pending {
                    pending.disarm();
                }
                decision
            }
        };
        if reads_first && (known_full || !decision.allowed()) {
            self.full_logs.learn(&redis_key, policy, &decision, asked);
        }
        Ok(carrying(decision, policy, lease))
    }

    /// The entries the sliding log's transaction writes, or the lease the
    /// concurrency limit takes: the same on every attempt, so a retry after
    /// a lost reply counts once. Until the outcome is known, an error or a
    /// dropped future (the timeout) takes them back out, after the last
    /// attempt's commands on the same connection. (The script writes only
    /// admitted requests: an error after it ran leaves an admission that
    /// counts once, as the fail mode decides.)
    fn pending(&self, redis_key: &str, policy: &Policy, id: &str) -> Option<Cleanup> {
        let members = match (policy.algorithm(), policy.execution()) {
            (Algorithm::SlidingLog, Execution::Transaction) => {
                sliding_log::members(id, policy.cost())
            }
            (Algorithm::Concurrency, _) => vec![id.to_owned()],
            _ => return None,
        };
        Some(Cleanup::new(
            &self.connections,
            redis_key,
            members,
            self.timeout,
        ))
    }

    /// What becomes of the `pending` entries or lease once the store
    /// decided: kept when admitted (a lease is the caller's to release; a
    /// denied lease was never taken), else taken back out within `left` (a
    /// denied attempt must not count; taking it out never turns the
    /// decision into an error, and goes on in the background after `left`).
    async fn conclude(mut pending: Cleanup, decision: &Decision, policy: &Policy, left: Duration) {
        if decision.allowed() || policy.algorithm() == Algorithm::Concurrency {
            pending.disarm();
        } else {
            pending.run(left).await;
        }
    }
}

/// `decision` carrying what the caller gives back later: an admitted
/// concurrency check's lease (to release), an admitted sliding-log check's
/// entries (what a refund of it removes).
pub(super) fn carrying(decision: Decision, policy: &Policy, lease: Lease) -> Decision {
    match policy.algorithm() {
        Algorithm::Concurrency if decision.allowed() => decision.with_lease(lease),
        Algorithm::SlidingLog if decision.allowed() => decision.with_entries(lease.into()),
        _ => decision,
    }
}

/// Whether running a check twice (after a connection error that may have
/// come after Redis ran it) counts once.
fn idempotent(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::SlidingLog | Algorithm::Concurrency)
}
