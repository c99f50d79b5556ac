//! The primary that Redis Sentinel names, for [`TrackedManager`]'s
//! connections (`sentinel` feature): asked once per epoch, and watched.
//!
//! [`TrackedManager`]: super::TrackedManager

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use redis::RedisError;
use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;

use super::connection::connection_config;

/// A primary found through Redis Sentinel, and watched.
///
/// The first connection of each epoch (after a start, a failed connection,
/// a `READONLY` answer or a change the watch saw) asks the Sentinels for
/// the primary: the first Sentinel that names a primary `ROLE` confirms,
/// beginning with the one that answered last (at first, the first given),
/// then the others in the order given. The connections opened in the same
/// epoch, at once or later, go to that primary with no more questions.
///
/// A primary that was cut off and comes back still answers the connections
/// opened to it, and takes writes until the Sentinels demote it (about ten
/// seconds), which then discards them. So every [`SENTINEL_WATCH`] a task
/// asks a Sentinel which primary it names; when that is not the one in use,
/// it asks the question the connections ask, and if that names another
/// primary too, every connection opened before is retired: the pool goes
/// where a new connection would go. (The watch and the connections ask the
/// same Sentinel first, so a Sentinel that lags the others is believed
/// until it fails, as redis-rs believes the first one that answers.)
pub(super) struct SentinelTarget {
    /// A client of every Sentinel: asked when `each` is empty (a client of
    /// the user's, whose Sentinels are not known one by one).
    all: tokio::sync::Mutex<SentinelClient>,
    /// One client per Sentinel, each built like `all` with that Sentinel
    /// alone. Asked one at a time: redis-rs asks its Sentinels in order and
    /// waits out an unreachable first one at every question, and its
    /// `async_get_sentinel_client` checks every Sentinel on one cached
    /// connection, so it can name one it never reached.
    each: Vec<tokio::sync::Mutex<SentinelClient>>,
    /// The index in `each` of the Sentinel asked first: the one that
    /// answered last.
    preferred: AtomicUsize,
    /// Held while the primary of an epoch is looked up: one question per
    /// epoch.
    finding: tokio::sync::Mutex<()>,
    service: String,
    /// The primary in use, and the epoch it was found in.
    primary: Mutex<Option<Primary>>,
    /// Whether the watching task runs.
    watching: AtomicBool,
}

/// A primary the Sentinels named.
#[derive(Clone)]
struct Primary {
    client: redis::Client,
    /// (host, port), as the Sentinels name it.
    addr: Option<(String, u16)>,
    /// The epoch it was found in: connections of a later epoch ask again.
    generation: u64,
}

/// How often the primary a Sentinel names is compared with the one the
/// pool's connections go to.
const SENTINEL_WATCH: Duration = Duration::from_millis(500);

/// How long one Sentinel may take to answer (connecting, and for a lookup
/// the `ROLE` of the primary it names, included) before the next is
/// asked: a Sentinel on a working network answers in milliseconds, an
/// unreachable one never.
const SENTINEL_ASK_TIMEOUT: Duration = Duration::from_secs(1);

impl SentinelTarget {
    /// A target asking the Sentinels through `all`, or one at a time
    /// through `each` when given (see the fields).
    pub(super) fn new(all: SentinelClient, each: Vec<SentinelClient>, service: &str) -> Self {
        Self {
            all: tokio::sync::Mutex::new(all),
            each: each.into_iter().map(tokio::sync::Mutex::new).collect(),
            preferred: AtomicUsize::new(0),
            finding: tokio::sync::Mutex::new(()),
            service: service.to_owned(),
            primary: Mutex::new(None),
            watching: AtomicBool::new(false),
        }
    }

    /// A connection of epoch `generation` to the primary: the one found in
    /// that epoch, or the one the Sentinels name now. Starts the watch with
    /// the first connection.
    pub(super) async fn open(
        self: &Arc<Self>,
        generation: u64,
        epoch: &Arc<AtomicU64>,
    ) -> Result<MultiplexedConnection, RedisError> {
        if !self.watching.swap(true, Ordering::AcqRel) {
            watch(Arc::clone(self), Arc::downgrade(epoch));
        }
        let client = match self.primary_of(generation) {
            Some(primary) => primary.client,
            None => self.find(generation, epoch).await?,
        };
        let opened = client
            .get_multiplexed_async_connection_with_config(&connection_config())
            .await;
        if opened.is_err() {
            // The primary may be gone: a new epoch, whose first connection
            // asks again, and the connections opened before to the primary
            // are retired (if the Sentinels name another one, they would
            // otherwise stay beside the new ones).
            epoch.fetch_max(generation + 1, Ordering::AcqRel);
        }
        opened
    }

    /// The primary in use, if it was found in epoch `generation`.
    fn primary_of(&self, generation: u64) -> Option<Primary> {
        self.primary
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|primary| primary.generation == generation)
            .cloned()
    }

    /// Ask the Sentinels for the primary of epoch `generation`, once per
    /// epoch: connections opened at once (a pool filling after a failover)
    /// wait for the first one's answer instead of each asking in turn.
    async fn find(&self, generation: u64, epoch: &AtomicU64) -> Result<redis::Client, RedisError> {
        let _finding = self.finding.lock().await;
        if let Some(primary) = self.primary_of(generation) {
            return Ok(primary.client);
        }
        let (client, addr) = self.lookup().await?;
        let mut primary = self.primary.lock().unwrap_or_else(PoisonError::into_inner);
        // Kept only if no connection failed meanwhile (an answer given
        // before a failure may name the primary that failed).
        if epoch.load(Ordering::Acquire) == generation {
            *primary = Some(Primary {
                client: client.clone(),
                addr,
                generation,
            });
        }
        Ok(client)
    }

    /// Once: the primary the preferred Sentinel names differs from the one
    /// in use, and the connections' question confirms it: start a new
    /// epoch with it (the connections opened before are retired). When the
    /// Sentinel does not answer, the next one is preferred.
    async fn watch_once(&self, epoch: &AtomicU64, sentinel: &mut Option<Asked>) {
        let named = match self.named_primary(sentinel).await {
            Ok(named) => named,
            Err(error) => {
                if let Some(asked) = sentinel.take() {
                    self.prefer_next(asked.at);
                }
                tracing::debug!(%error, "redis sentinel: could not ask which primary it names");
                return;
            }
        };
        let Some(named) = named else {
            return;
        };
        let Some(in_use) = self.primary_of(epoch.load(Ordering::Acquire)) else {
            // No primary in use (the next connection asks anyway).
            return;
        };
        if in_use.addr.as_ref() == Some(&named) {
            return;
        }
        // This Sentinel names another primary: does the question the
        // connections ask name it too?
        let (client, addr) = match self.lookup().await {
            Ok(found) => found,
            Err(error) => {
                tracing::debug!(%error, "redis sentinel: could not look the primary up");
                return;
            }
        };
        let mut primary = self.primary.lock().unwrap_or_else(PoisonError::into_inner);
        let current = primary.as_ref().map(|p| (p.generation, &p.addr));
        if addr != in_use.addr && current == Some((in_use.generation, &in_use.addr)) {
            let generation = epoch.fetch_add(1, Ordering::AcqRel) + 1;
            tracing::info!(
                service = self.service,
                primary = addr.as_ref().map(|(host, port)| format!("{host}:{port}")),
                "redis sentinel names another primary: retiring the connections to the old one"
            );
            *primary = Some(Primary {
                client,
                addr,
                generation,
            });
        }
    }

    /// The primary the preferred Sentinel names for the service (`SENTINEL
    /// GET-MASTER-ADDR-BY-NAME`), on a connection kept between calls while
    /// that Sentinel stays preferred. On an error, `sentinel` still says
    /// which Sentinel failed.
    async fn named_primary(
        &self,
        sentinel: &mut Option<Asked>,
    ) -> Result<Option<(String, u16)>, RedisError> {
        let at = self.preferred.load(Ordering::Acquire);
        if sentinel.as_ref().is_some_and(|asked| asked.at != at) {
            *sentinel = None;
        }
        let asked = match sentinel {
            Some(asked) => asked,
            None => {
                // A client of the preferred Sentinel (without clients of
                // each, the first of `all` that answers `ROLE`). The wait
                // for its lock is not the Sentinel's time.
                let mut clients = match self.each.get(at) {
                    Some(client) => client.lock().await,
                    None => self.all.lock().await,
                };
                let connecting = async {
                    let client = clients.async_get_sentinel_client().await?;
                    client
                        .get_multiplexed_async_connection_with_config(&connection_config())
                        .await
                };
                let connected = within(SENTINEL_ASK_TIMEOUT, connecting).await;
                let conn = connected.inspect_err(|_| self.prefer_next(at))?;
                sentinel.insert(Asked { at, conn })
            }
        };
        let mut question = redis::cmd("SENTINEL");
        question.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.service);
        within(SENTINEL_ASK_TIMEOUT, question.query_async(&mut asked.conn)).await
    }

    /// Ask for the primary: each Sentinel in turn, the preferred first,
    /// until one names a primary that `ROLE` confirms; that Sentinel is
    /// preferred from then on. Returns the primary's client and address.
    async fn lookup(&self) -> Result<(redis::Client, Option<(String, u16)>), RedisError> {
        if self.each.is_empty() {
            return Ok(located(self.all.lock().await.async_get_client().await?));
        }
        let count = self.each.len();
        let first = self.preferred.load(Ordering::Acquire);
        let mut failure = None;
        for i in 0..count {
            let at = (first + i) % count;
            let mut client = self.each[at].lock().await;
            match within(SENTINEL_ASK_TIMEOUT, client.async_get_client()).await {
                Ok(client) => {
                    self.preferred.store(at, Ordering::Release);
                    return Ok(located(client));
                }
                Err(error) => failure = Some(error),
            }
        }
        Err(failure.unwrap_or_else(no_sentinel))
    }

    /// Sentinel `at` failed the watch: prefer the next one (unless a
    /// lookup has moved the preference meanwhile).
    fn prefer_next(&self, at: usize) {
        if self.each.is_empty() {
            return;
        }
        let next = (at + 1) % self.each.len();
        let _ = self
            .preferred
            .compare_exchange(at, next, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// The watch's connection to the Sentinel it asks.
struct Asked {
    /// The Sentinel's index in [`SentinelTarget::each`].
    at: usize,
    conn: MultiplexedConnection,
}

/// Every [`SENTINEL_WATCH`], [`SentinelTarget::watch_once`]. Ends when the
/// pool (which holds `epoch`) is gone.
fn watch(target: Arc<SentinelTarget>, epoch: Weak<AtomicU64>) {
    tokio::spawn(async move {
        let mut sentinel = None;
        loop {
            tokio::time::sleep(SENTINEL_WATCH).await;
            let Some(epoch) = epoch.upgrade() else {
                return;
            };
            target.watch_once(&epoch, &mut sentinel).await;
        }
    });
}

/// `future`'s result, or an I/O error if it takes longer than `limit`.
async fn within<T>(
    limit: Duration,
    future: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from((
                redis::ErrorKind::Io,
                "no answer from the Sentinel in time",
            )))
        })
}

/// A primary's client, and its (host, port).
fn located(client: redis::Client) -> (redis::Client, Option<(String, u16)>) {
    let addr = match client.get_connection_info().addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
        _ => None,
    };
    (client, addr)
}

fn no_sentinel() -> RedisError {
    RedisError::from((redis::ErrorKind::InvalidClientConfig, "no Sentinel to ask"))
}
