//! The primary that Redis Sentinel names, for [`TrackedManager`]'s
//! connections (`sentinel` feature): asked once per epoch, and watched.
//!
//! [`TrackedManager`]: super::TrackedManager

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
/// primary too, every connection opened before is retired. (A Sentinel that
/// alone names another primary retires nothing.)
pub(super) struct SentinelTarget {
    clients: tokio::sync::Mutex<Clients>,
    service: String,
    /// The primary in use, and the epoch it was found in.
    primary: Mutex<Option<Primary>>,
    /// Whether the watching task runs.
    watching: AtomicBool,
}

/// The clients that ask the Sentinels.
struct Clients {
    /// A client of every Sentinel: asked when `each` is empty (a client of
    /// the user's, whose Sentinels are not known one by one).
    all: SentinelClient,
    /// One client per Sentinel, each built like `all` with that Sentinel
    /// alone. Asked one at a time: redis-rs asks its Sentinels in order and
    /// waits out an unreachable first one at every question, and its
    /// `async_get_sentinel_client` checks every Sentinel on one cached
    /// connection, so it can name one it never reached.
    each: Vec<SentinelClient>,
    /// The index in `each` of the Sentinel asked first: the one that
    /// answered last.
    preferred: usize,
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
pub(super) const SENTINEL_WATCH: Duration = Duration::from_millis(500);

/// How long one Sentinel may take to answer (connecting, and for a lookup
/// the `ROLE` of the primary it names, included) before the next is
/// asked: a Sentinel on a working network answers in milliseconds, an
/// unreachable one never.
const SENTINEL_ASK_TIMEOUT: Duration = Duration::from_secs(1);

impl SentinelTarget {
    /// A target asking the Sentinels through `all`, and one at a time
    /// through `each` when given (see [`Clients`]).
    pub(super) fn new(all: SentinelClient, each: Vec<SentinelClient>, service: &str) -> Self {
        Self {
            clients: tokio::sync::Mutex::new(Clients {
                all,
                each,
                preferred: 0,
            }),
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
            // The next connection asks again.
            let mut primary = self.primary.lock().unwrap_or_else(PoisonError::into_inner);
            if primary.as_ref().is_some_and(|p| p.generation == generation) {
                *primary = None;
            }
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
        let mut clients = self.clients.lock().await;
        if let Some(primary) = self.primary_of(generation) {
            return Ok(primary.client);
        }
        let (client, addr) = clients.lookup().await?;
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
    async fn watch_once(&self, epoch: &AtomicU64, sentinel: &mut Option<MultiplexedConnection>) {
        let named = match self.named_primary(sentinel).await {
            Ok(named) => named,
            Err(error) => {
                *sentinel = None;
                self.clients.lock().await.prefer_next();
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
        let found = self.clients.lock().await.lookup().await;
        let (client, addr) = match found {
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
    /// GET-MASTER-ADDR-BY-NAME`), on a connection kept between calls.
    async fn named_primary(
        &self,
        sentinel: &mut Option<MultiplexedConnection>,
    ) -> Result<Option<(String, u16)>, RedisError> {
        let conn = match sentinel {
            Some(conn) => conn,
            None => {
                let connecting = async {
                    let client = self.clients.lock().await.preferred_sentinel().await?;
                    client
                        .get_multiplexed_async_connection_with_config(&connection_config())
                        .await
                };
                sentinel.insert(within(SENTINEL_ASK_TIMEOUT, connecting).await?)
            }
        };
        let mut question = redis::cmd("SENTINEL");
        question.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.service);
        within(SENTINEL_ASK_TIMEOUT, question.query_async(conn)).await
    }
}

impl Clients {
    /// Ask for the primary: each Sentinel in turn, the preferred first,
    /// until one names a primary that `ROLE` confirms; that Sentinel is
    /// preferred from then on. Returns the primary's client and address.
    async fn lookup(&mut self) -> Result<(redis::Client, Option<(String, u16)>), RedisError> {
        if self.each.is_empty() {
            return Ok(located(self.all.async_get_client().await?));
        }
        let count = self.each.len();
        let mut failure = None;
        for i in 0..count {
            let at = (self.preferred + i) % count;
            match within(SENTINEL_ASK_TIMEOUT, self.each[at].async_get_client()).await {
                Ok(client) => {
                    self.preferred = at;
                    return Ok(located(client));
                }
                Err(error) => failure = Some(error),
            }
        }
        Err(failure.unwrap_or_else(no_sentinel))
    }

    /// A client of the preferred Sentinel (without clients of each, the
    /// first of `all` that answers `ROLE`).
    async fn preferred_sentinel(&mut self) -> Result<redis::Client, RedisError> {
        match self.each.get_mut(self.preferred) {
            Some(client) => client.async_get_sentinel_client().await,
            None => self.all.async_get_sentinel_client().await,
        }
    }

    /// The preferred Sentinel failed: prefer the next one.
    fn prefer_next(&mut self) {
        if !self.each.is_empty() {
            self.preferred = (self.preferred + 1) % self.each.len();
        }
    }
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
