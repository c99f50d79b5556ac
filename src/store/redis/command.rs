//! An operator's command on a key, and the release of a concurrency
//! lease: one call each, within the timeout.

use super::reply::member;
use super::{BLOCK_TAG, RedisStore, cleanup, script};
use crate::decision::{Decision, Lease};
use crate::policy::Policy;
use crate::store::{Command, StoreError};

impl RedisStore {
    /// Run an operator's command: one script, atomic, within the timeout;
    /// sent again after a lost reply only when it cannot have run twice
    /// (see [`command_idempotent`]).
    pub(super) async fn run_command(
        &self,
        key: &str,
        policy: &Policy,
        command: Command,
    ) -> Result<Decision, StoreError> {
        let redis_key = self.redis_key(policy.algorithm().tag(), key);
        let block_key = self.redis_key(BLOCK_TAG, key);
        let keys = script::Keys {
            state: &redis_key,
            block: &block_key,
        };
        let id = member(self.ids.next());
        let now = self.clock.local_micros();
        let eval = script::command(keys, policy, command, &id, now)?;
        let answer = self
            .call("command")
            .script(Some(eval.script()))
            .repeatable(command_idempotent(command))
            .run(|mut conn| {
                let eval = &eval;
                async move { script::decode_reply(eval.send(conn.get()).await?, policy) }
            })
            .await;
        // A reward or a reset may have taken off a previous count this
        // process holds: it is read again. (The counts held are named by
        // Redis's windows: about its time as this process estimates it.)
        if let Some(batcher) = self.batcher(policy) {
            let redis_now = self.clock.now().map_or(now, |(redis_now, _)| redis_now);
            batcher.forget_previous(&redis_key, policy, redis_now);
        }
        answer
    }

    /// Give back a concurrency lease (one `ZREM`), within the timeout. Like
    /// every give-back (a refund), it is not sent again after a connection
    /// error: whatever happened to it counts at most once.
    pub(super) async fn release_lease(
        &self,
        key: &str,
        policy: &Policy,
        lease: Lease,
    ) -> Result<(), StoreError> {
        let redis_key = self.redis_key(policy.algorithm().tag(), key);
        self.call("release")
            .run(|mut conn| {
                let redis_key = &redis_key;
                async move { cleanup::zrem(conn.get(), redis_key, &[member(lease)]).await }
            })
            .await
    }
}

/// Whether running a command twice (after a connection error that may have
/// come after Redis ran it) leaves what running it once does: not a penalty
/// nor a reward, which would move the quota twice. (A block sent again ends
/// a round trip later, as if it had been sent then.)
fn command_idempotent(command: Command) -> bool {
    matches!(command, Command::Peek | Command::Reset | Command::Block(_))
}
