//! The caps on open connections: in total, and per client address, so
//! that silent connections from one client cannot take every file
//! descriptor of the process and lock the other clients out.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How many connections may be open at once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    /// `MAX_CONNECTIONS`: on the listener.
    pub(crate) total: usize,
    /// `MAX_CONNECTIONS_PER_IP`: from one client address (an IPv6 /64).
    pub(crate) per_client: usize,
}

/// `MAX_CONNECTIONS` unless the open-file limit calls for fewer.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// `MAX_CONNECTIONS_PER_IP` unless `MAX_CONNECTIONS` is lower (or the
/// server is behind trusted proxies, whose addresses every client shares).
pub(crate) const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 100;
/// File descriptors kept for what is not a client's connection: the
/// listeners, the Redis connections (16 by default), the admin router's
/// connections (at most `admin::MAX_CONNECTIONS`), the rules file, logs.
pub(crate) const RESERVED_FILES: u64 = 128;

/// The process's limit on open files (the soft `RLIMIT_NOFILE`, from
/// `/proc/self/limits`); `None` if unlimited or unknown (not Linux).
pub(crate) fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))?;
    // "Max open files   1024   524288   files": the soft limit first.
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// How long the refusals of a flood go unreported (one `warn` line, then
/// their count at most once per this).
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The connections open on one listener, by client, held under the caps.
pub(crate) struct Connections {
    caps: Caps,
    open: Arc<Mutex<Open>>,
}

/// What is open now, and what was refused since the last report. It holds
/// an entry per client with a connection open: at most `caps.total`.
#[derive(Default)]
struct Open {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
    refused: u64,
    reported: Option<Instant>,
}

/// A connection's place under the caps, given back when it is dropped.
pub(crate) struct Slot {
    open: Arc<Mutex<Open>>,
    client: IpAddr,
}

/// Which cap refused a connection.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Refused {
    Total,
    PerClient,
}

impl Connections {
    pub(crate) fn new(caps: Caps) -> Self {
        Self {
            caps,
            open: Arc::default(),
        }
    }

    /// A slot for a connection from `peer`, or the cap it would exceed
    /// (logged: each refusal at `debug`, their count at `warn` at most once
    /// every ten seconds, without addresses).
    pub(crate) fn admit(&self, peer: IpAddr) -> Result<Slot, Refused> {
        let client = client_of(peer);
        let mut open = lock(&self.open);
        let of_client = open.by_client.get(&client).copied().unwrap_or(0);
        let refused = if open.total >= self.caps.total {
            Refused::Total
        } else if of_client >= self.caps.per_client {
            Refused::PerClient
        } else {
            open.total += 1;
            open.by_client.insert(client, of_client + 1);
            return Ok(Slot {
                open: Arc::clone(&self.open),
                client,
            });
        };
        tracing::debug!(%peer, cap = ?refused, "connection over a cap: closed");
        open.refused += 1;
        if open.reported.is_none_or(|at| at.elapsed() >= REPORT_EVERY) {
            tracing::warn!(
                refused = open.refused,
                open = open.total,
                max_connections = self.caps.total,
                max_connections_per_ip = self.caps.per_client,
                "connections over MAX_CONNECTIONS or MAX_CONNECTIONS_PER_IP closed at once \
                 (next count in {REPORT_EVERY:?} at the earliest)"
            );
            open.refused = 0;
            open.reported = Some(Instant::now());
        }
        Err(refused)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = lock(&self.open);
        open.total -= 1;
        if let Some(count) = open.by_client.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                open.by_client.remove(&self.client);
            }
        }
    }
}

/// The counts stay right even if a thread panicked holding the lock:
/// nothing panics between reading and writing them.
fn lock(open: &Mutex<Open>) -> std::sync::MutexGuard<'_, Open> {
    open.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Who `peer` is for the per-client cap: an IPv4 address (IPv4-mapped IPv6
/// addresses included), or an IPv6 address's /64, which one subscriber
/// usually holds whole (as the rate-limit keys group them).
fn client_of(peer: IpAddr) -> IpAddr {
    match peer.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
        v4 => v4,
    }
}
