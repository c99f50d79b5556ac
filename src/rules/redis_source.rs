//! Rule sets in Redis (feature `redis`): [`publish`] writes a versioned
//! key, and every process following it ([`Rules::follow_redis`]) puts the
//! new set in force within a round trip.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt as _;

use super::watch::{Source, Watch, WatchStatus, apply, record};
use super::{RuleSet, Rules, RulesError};

/// What [`publish`] writes: a hash of `version` (incremented by each
/// publication) and `rules` (the text), then the new version on the
/// channel named as the key.
const PUBLISH_SCRIPT: &str = r"
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'rules', ARGV[1])
redis.call('PUBLISH', KEYS[1], version)
return version
";

/// Why [`publish`] wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The rule set does not parse or validate.
    #[error("rule set rejected: {0}")]
    Rules(#[from] RulesError),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Publish the rule set `text` (TOML or JSON) at `key` for every process
/// following it ([`Rules::follow_redis`]): validated here first (a set
/// that does not validate is not written), then, in one atomic script, its
/// version incremented, the text stored and the version published on the
/// channel `key`. Returns the new version.
pub async fn publish(
    connection: &mut impl redis::aio::ConnectionLike,
    key: &str,
    text: &str,
) -> Result<u64, PublishError> {
    RuleSet::parse(text)?;
    Ok(redis::Script::new(PUBLISH_SCRIPT)
        .key(key)
        .arg(text)
        .invoke_async(connection)
        .await?)
}

impl Rules {
    /// Follow the rule set that [`publish`] writes at `key` in the Redis of
    /// `client`: read once now (an error if Redis cannot be reached or
    /// holds no rule set there, or if it does not validate), then in a task,
    /// re-read when a new version is published (pub/sub on the channel
    /// `key`: every process follows within a round trip) and, as a backstop
    /// for a missed message or a lost subscription, whenever the version
    /// differs at a check every `check_every`. A rule set that does not
    /// validate leaves the rules in force (logged, and in
    /// [`Watch::status`]). Needs a tokio runtime.
    pub async fn follow_redis(
        &self,
        client: redis::Client,
        key: impl Into<String>,
        check_every: Duration,
    ) -> Result<Watch, PublishError> {
        let key = key.into();
        let mut connection = client.get_multiplexed_async_connection().await?;
        let (version, text) = read(&mut connection, &key).await?;
        let Some(text) = text else {
            return Err(PublishError::Rules(RulesError {
                rule: None,
                field: key.clone(),
                problem: "no rule set in Redis at this key: publish one first".to_owned(),
            }));
        };
        self.replace(RuleSet::parse(&text)?);
        crate::metrics::rules_loaded(true);
        let source = Source::Redis {
            client: Box::new(client.clone()),
            key: key.clone(),
        };
        let status = Arc::new(Mutex::new(WatchStatus {
            source: source.to_string(),
            version,
            text: Some(text.clone()),
            loaded_at: Some(SystemTime::now()),
            ..WatchStatus::default()
        }));
        let status_in = Arc::clone(&status);
        let rules = self.clone();
        let task = tokio::spawn(async move {
            let mut applied = (version, Some(text));
            loop {
                if let Err(error) =
                    follow(&rules, &client, &key, check_every, &mut applied, &status_in).await
                {
                    let error = format!("redis: {error}");
                    tracing::warn!(%error, key, "rules: lost the rule source; the rules in force stay, retrying");
                    record(&status_in, |s| s.error = Some(error));
                }
                tokio::time::sleep(check_every).await;
            }
        });
        Ok(Watch {
            task: Some(task),
            status,
            source,
        })
    }
}

/// The version and text at `key`.
async fn read(
    connection: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> redis::RedisResult<(u64, Option<String>)> {
    let (version, text): (Option<u64>, Option<String>) = redis::cmd("HMGET")
        .arg(key)
        .arg("version")
        .arg("rules")
        .query_async(connection)
        .await?;
    Ok((version.unwrap_or(0), text))
}

/// Subscribe, then re-read on every message and at every check that sees
/// another version; returns on a Redis error.
async fn follow(
    rules: &Rules,
    client: &redis::Client,
    key: &str,
    check_every: Duration,
    applied: &mut (u64, Option<String>),
    status: &Mutex<WatchStatus>,
) -> redis::RedisResult<()> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(key).await?;
    let mut messages = pubsub.into_on_message();
    let mut connection = client.get_multiplexed_async_connection().await?;
    loop {
        // Subscribed first, then read: a version published meanwhile is
        // either read now or announced.
        // A new version, or the same number with another text (Redis
        // lost the key and it was published again from 1).
        let (version, text) = read(&mut connection, key).await?;
        if (version, text.as_deref()) != (applied.0, applied.1.as_deref()) {
            *applied = (version, text.clone());
            match text {
                Some(text) => apply(
                    rules,
                    RuleSet::parse(&text),
                    &text,
                    status,
                    Some(version),
                    key,
                ),
                None => record(status, |s| {
                    s.error = Some(format!(
                        "{key}: the rule set was deleted; the rules in force stay"
                    ));
                }),
            }
        }
        match tokio::time::timeout(check_every, messages.next()).await {
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "the subscription ended",
                )));
            }
        }
    }
}
