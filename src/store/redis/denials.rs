//! The keys denied most, shared by every process through Redis
//! ([`Store::share_denials`](crate::Store::share_denials)): one sorted set
//! per limit and minute, `{prefix}:denied:{<limit>}:<minute>`, of at most
//! [`KEPT`] keys of at most [`MAX_RAW_KEY_LEN`] bytes scored by their
//! denials, living three minutes. A process
//! adds to it at most about once a second per limit (one `EVALSHA` of at
//! most 32 `ZINCRBY`s), so Redis's work and memory are bounded whatever the
//! flood; reading merges this minute's and the last.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::RedisStore;
use crate::store::{MAX_RAW_KEY_LEN, StoreError};

/// Keys kept per limit and minute.
const KEPT: usize = 128;
/// How long a minute's set lives.
const LIVES: Duration = Duration::from_secs(180);
/// Keys read back.
const SHOWN: usize = 32;

/// Add each (key, count) of ARGV to this minute's set, keep the `KEPT`
/// largest, and let it live `LIVES`.
static SHARE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
for i = 3, #ARGV, 2 do
  redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], ARGV[i])
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[2]) + 1))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
",
    )
});

/// The minute of `at` since the epoch.
fn minute(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 60)
}

impl RedisStore {
    /// The set of `limit`'s denials in `minute` (both minutes of a limit in
    /// one cluster slot).
    fn denials_key(&self, limit: &str, minute: u64) -> String {
        format!("{}:{minute}", self.redis_key(DENIED_TAG, limit))
    }

    pub(super) async fn add_denials(
        &self,
        limit: &str,
        counts: Vec<(String, u64)>,
    ) -> Result<(), StoreError> {
        if counts.is_empty() {
            return Ok(());
        }
        let key = self.denials_key(limit, minute(SystemTime::now()));
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(SHARE.get_hash())
            .arg(1)
            .arg(&key)
            .arg(LIVES.as_millis() as u64)
            .arg(KEPT);
        // A limiter hands over keys as it holds them, at most
        // MAX_RAW_KEY_LEN bytes (a long one by its hash): a longer one
        // would make the set's bytes the client's to choose.
        for (denied, count) in counts.iter().filter(|(k, _)| k.len() <= MAX_RAW_KEY_LEN) {
            cmd.arg(denied).arg(*count);
        }
        // Not sent again after a lost reply: the counts would add twice.
        self.call("denial share")
            .script(Some(&SHARE))
            .run(|mut conn| {
                let cmd = &cmd;
                async move { Ok(cmd.query_async::<()>(conn.get()).await?) }
            })
            .await
    }

    pub(super) async fn read_denials(&self, limit: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let now = minute(SystemTime::now());
        let keys = [
            self.denials_key(limit, now),
            self.denials_key(limit, now.saturating_sub(1)),
        ];
        let mut pipe = redis::pipe();
        for key in &keys {
            pipe.cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES");
        }
        let sets: Vec<Vec<(String, f64)>> = self
            .call("denial read")
            .repeatable(true)
            .run(|mut conn| {
                let pipe = &pipe;
                async move { Ok(pipe.query_async(conn.get()).await?) }
            })
            .await?;
        let mut merged: HashMap<String, u64> = HashMap::new();
        for (key, score) in sets
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.len() <= MAX_RAW_KEY_LEN)
        {
            // Scores are sums of counts: whole, non-negative numbers.
            let count = merged.entry(key).or_default();
            *count = count.saturating_add(score.max(0.0) as u64);
        }
        let mut top: Vec<(String, u64)> = merged.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(SHOWN);
        Ok(top)
    }
}

/// The part of a denials set's Redis key that names it.
const DENIED_TAG: &str = "denied";
