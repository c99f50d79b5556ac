//! Checks decided in batches: the concurrent checks of one algorithm (the
//! window counters, GCRA and the sliding log's `Script` execution) on a
//! single Redis go out together: GCRA's and the sliding log's as one
//! `EVALSHA` that decides each in turn, on one reading of Redis's clock;
//! the window counters' as one pipeline of plain commands
//! ([`plain`](super::plain)).
//!
//! A check joins a queue. While fewer than the store's limit of batches are
//! in flight for the algorithm, it starts one at once (a lone check waits
//! for nothing); otherwise it waits, and the next batch to go takes every
//! check queued meanwhile (up to [`MAX_BATCH`]). Under load the cost of a
//! call, a script's set-up and Redis's socket work is shared by the checks
//! of a batch; each GCRA check's own work is one `HGET` and, admitted,
//! one `HSET`, a window counter's an `INCRBY` per rate, a sliding log's a
//! count per rate and, admitted, a trim, its `ZADD` and `PEXPIRE`, or
//! denied, one or two `ZREVRANGE`.
//!
//! GCRA's and the sliding log's exactness is the single check's: the
//! script runs atomically, each check against the state the checks before
//! it left; the window counters' rests on `INCRBY` being atomic. A failure
//! is each check's own (its caller's fail mode decides): a batch that may
//! have run is not sent again (the counters would count twice), but for
//! the sliding log's, sent again once as a single check is (each check
//! then looks for its own entries first: it counts once; the first sending
//! skips that search); one that Redis refused before running it is, as a
//! single check would be. A check whose caller gave up (its timeout)
//! before its batch went is not sent at all.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::Value;
use tokio::sync::oneshot;

use super::call::Call;
use super::check::carrying;
use super::clock_sync::ClockSync;
use super::connection::Connections;
use super::full_keys::FullKeys;
use super::plain;
use super::previous_counts::PreviousCounts;
use super::reply::member;
use super::script::{self, BatchItem, Keys};
use super::window_counts;
use crate::decision::{Decision, Lease};
use crate::policy::{Algorithm, Policy};
use crate::store::StoreError;

/// The most checks one batch decides (one `EVALSHA`, or one pipeline).
pub(super) const MAX_BATCH: usize = 128;

/// One check waiting for its batch.
pub(super) struct Waiting {
    pub(super) state: String,
    pub(super) block: String,
    pub(super) policy: Policy,
    /// This process's time (µs) when the check was asked: where its
    /// calendar windows are placed.
    pub(super) now: u64,
    /// The sliding log's request id: its entries' members.
    pub(super) request_id: Option<Lease>,
    pub(super) reply: oneshot::Sender<Result<Decision, StoreError>>,
}

/// The queue and the batches in flight of one algorithm.
pub(super) struct Batcher {
    algorithm: Algorithm,
    script: &'static redis::Script,
    in_flight: usize,
    state: Mutex<State>,
    /// The window counters' keys the script last found full.
    full: Option<FullKeys>,
    /// The sliding window's previous counts, as last read.
    previous: Option<PreviousCounts>,
}

#[derive(Default)]
struct State {
    queue: Vec<Waiting>,
    /// Batches in flight (each a task sending one batch after another
    /// while checks are queued).
    running: usize,
}

impl Batcher {
    /// A batcher of `algorithm`'s checks, sent as `script`, with at most
    /// `in_flight` (≥ 1) batches in flight.
    fn new(algorithm: Algorithm, script: &'static redis::Script, in_flight: usize) -> Self {
        Self {
            algorithm,
            script,
            in_flight: in_flight.max(1),
            state: Mutex::new(State::default()),
            full: matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow)
                .then(FullKeys::new),
            previous: (algorithm == Algorithm::SlidingWindow).then(PreviousCounts::new),
        }
    }

    /// Queue a check; start a batch when fewer than the limit are in flight.
    pub(super) fn submit(
        self: &Arc<Self>,
        connections: &Connections,
        clock: &Arc<ClockSync>,
        timeout: Duration,
        waiting: Waiting,
    ) {
        let start = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.queue.push(waiting);
            if state.running < self.in_flight {
                state.running += 1;
                true
            } else {
                false
            }
        };
        if start {
            // The slot is given back by the guard if the task ends without
            // finding the queue empty (a panic, or dropped unpolled at a
            // runtime's shutdown).
            let guard = Running {
                batcher: Arc::clone(self),
                armed: true,
            };
            tokio::spawn(Arc::clone(self).send_while_queued(
                connections.clone(),
                Arc::clone(clock),
                timeout,
                guard,
            ));
        }
    }

    /// Drop the previous counts held of `state` (the sliding window's)
    /// about Redis's time `now` (µs, as this process estimates it): a
    /// command may have changed them.
    pub(super) fn forget_previous(&self, state: &str, policy: &Policy, now: u64) {
        if let Some(previous) = &self.previous {
            let keys = window_counts::previous_keys(state, policy, now);
            previous.forget(keys.iter().map(String::as_str));
        }
    }

    /// Send batches while checks are queued; then stop (in the same lock as
    /// the queue is found empty, so a check queued later starts another).
    /// (The batch's own timeout is that of the store clone that started the
    /// task; every check also waits within its own store's timeout.)
    async fn send_while_queued(
        self: Arc<Self>,
        connections: Connections,
        clock: Arc<ClockSync>,
        timeout: Duration,
        mut guard: Running,
    ) {
        loop {
            let batch: Vec<Waiting> = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                if state.queue.is_empty() {
                    state.running -= 1;
                    guard.armed = false;
                    return;
                }
                let take = state.queue.len().min(MAX_BATCH);
                state.queue.drain(..take).collect()
            };
            self.decide(&connections, &clock, timeout, batch).await;
        }
    }

    /// Send one batch and answer each of its checks.
    async fn decide(
        &self,
        connections: &Connections,
        clock: &ClockSync,
        timeout: Duration,
        batch: Vec<Waiting>,
    ) {
        // A check whose caller gave up is not sent: it would count an
        // admission nobody is told of.
        let batch: Vec<Waiting> = batch
            .into_iter()
            .filter(|waiting| !waiting.reply.is_closed())
            .collect();
        if batch.is_empty() {
            return;
        }
        let batch = match &self.full {
            // Decided with plain commands; the checks denied, placed in
            // another window than Redis's clock says, or of keys found full
            // with room again go on to the script (those whose caller has
            // not given up meanwhile).
            Some(full) => plain::decide(
                connections,
                timeout,
                clock,
                self.algorithm,
                full,
                self.previous.as_ref(),
                batch,
            )
            .await
            .into_iter()
            .filter(|waiting| !waiting.reply.is_closed())
            .collect(),
            None => batch,
        };
        if batch.is_empty() {
            return;
        }
        let sent = self.send(connections, timeout, &batch).await;
        match sent {
            Ok(replies) if replies.len() == batch.len() => {
                for (waiting, reply) in batch.into_iter().zip(replies) {
                    let decision =
                        script::decode_batched(reply, &waiting.policy).map(|decided| match waiting
                            .request_id
                        {
                            Some(id) => carrying(decided, &waiting.policy, id),
                            None => decided,
                        });
                    if let (Some(full), Ok(decision)) = (&self.full, &decision) {
                        full.learn(&waiting.state, &waiting.policy, decision, waiting.now);
                    }
                    // A caller that gave up meanwhile drops its answer.
                    let _ = waiting.reply.send(decision);
                }
            }
            Ok(replies) => {
                let error = StoreError::UnexpectedReply(format!(
                    "{} batch script: {} replies for {} checks",
                    self.algorithm,
                    replies.len(),
                    batch.len()
                ));
                answer_all(batch, &error);
            }
            Err(error) => answer_all(batch, &error),
        }
    }

    /// One `EVALSHA` for the batch, within `timeout`, sent again when Redis
    /// refused it before running it, and the sliding log's after a
    /// connection error too (its checks, sent again, each look for their
    /// own entries first: a check counts once). A replica writes nothing: a
    /// window counter's or a sliding log's check runs in its own `pcall`,
    /// so an admission's `READONLY` comes back as its check's error (a
    /// sliding log's denial, which writes nothing, is answered from the
    /// replica's data), and the checks it answered without an error counted
    /// nothing either; GCRA's first write fails the whole script with
    /// `READONLY`, before anything was written. Either way, with one
    /// `READONLY` among the replies, the batch goes again, on a new
    /// connection.
    async fn send(
        &self,
        connections: &Connections,
        timeout: Duration,
        batch: &[Waiting],
    ) -> Result<Vec<Value>, StoreError> {
        let members: Vec<Option<String>> = batch
            .iter()
            .map(|waiting| waiting.request_id.map(member))
            .collect();
        let items: Vec<BatchItem<'_>> = batch
            .iter()
            .zip(&members)
            .map(|(waiting, id)| BatchItem {
                keys: Keys {
                    state: &waiting.state,
                    block: &waiting.block,
                },
                policy: &waiting.policy,
                id: id.as_deref(),
            })
            .collect();
        // The batch's checks were asked within its timeout of each other:
        // the first one's time places every calendar window.
        let now = batch.first().map_or(0, |waiting| waiting.now);
        let first = script::batch(self.script, &items, now, false)?;
        let log = self.algorithm == Algorithm::SlidingLog;
        // The sliding log's batch as sent again (built only then): after a
        // connection error, and also (harmless: one more read a check)
        // after `NOSCRIPT` or a refusal.
        let resent = std::sync::OnceLock::new();
        let mut first_sent = false;
        Call::new(connections, timeout, "batch")
            .script(Some(first.script()))
            .repeatable(log)
            .replica_reply(|replies: &Vec<Value>| replies.iter().any(script::refused_as_replica))
            .run(|mut conn| {
                let eval = if log && first_sent {
                    resent
                        .get_or_init(|| script::batch(self.script, &items, now, true))
                        .as_ref()
                } else {
                    Ok(&first)
                };
                first_sent = true;
                async move {
                    match eval {
                        Ok(eval) => eval.send(conn.get()).await,
                        Err(error) => Err(duplicate(error)),
                    }
                }
            })
            .await
    }
}

/// Gives a batch's slot back if its task ends without finding the queue
/// empty (a panic, or the task dropped before it ran). Checks still queued
/// then go with the next check's batch, or time out.
struct Running {
    batcher: Arc<Batcher>,
    armed: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.armed {
            let mut state = self
                .batcher
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            state.running -= 1;
        }
    }
}

/// Fail every check of a batch with `error`.
pub(super) fn answer_all(batch: Vec<Waiting>, error: &StoreError) {
    for waiting in batch {
        let _ = waiting.reply.send(Err(duplicate(error)));
    }
}

/// The same error again, for each check of a failed batch.
pub(super) fn duplicate(error: &StoreError) -> StoreError {
    match error {
        StoreError::Timeout(after) => StoreError::Timeout(*after),
        StoreError::CircuitOpen => StoreError::CircuitOpen,
        StoreError::PoolTimeout => StoreError::PoolTimeout,
        StoreError::UnexpectedReply(what) => StoreError::UnexpectedReply(what.clone()),
        StoreError::Unsupported(what) => StoreError::Unsupported(what),
        StoreError::KeyBusy(source) => StoreError::UnexpectedReply(source.to_string()),
        StoreError::Backend { .. } => match error.backend_error::<redis::RedisError>() {
            Some(redis_error) => StoreError::from(redis_error.clone()),
            None => StoreError::UnexpectedReply(error.to_string()),
        },
    }
}

/// The batchers of a store: one per batched algorithm.
pub(super) struct Batchers {
    by_algorithm: [Option<Arc<Batcher>>; 5],
}

impl Batchers {
    /// Batchers of every batched algorithm with at most `in_flight`
    /// batches in flight each.
    pub(super) fn new(in_flight: usize) -> Self {
        let by_algorithm = std::array::from_fn(|index| {
            let algorithm = Algorithm::ALL[index];
            script::batch_script(algorithm)
                .map(|script| Arc::new(Batcher::new(algorithm, script, in_flight)))
        });
        Self { by_algorithm }
    }

    /// The batcher of `algorithm`, if its checks are batched.
    pub(super) fn get(&self, algorithm: Algorithm) -> Option<&Arc<Batcher>> {
        self.by_algorithm[algorithm.index()].as_ref()
    }
}
