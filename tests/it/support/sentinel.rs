//! A Redis Sentinel deployment on loopback: one primary, one replica and
//! three Sentinels (`redis-server --sentinel`, the same binary: see
//! [`server_binary`](super::server_binary)), all
//! killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::proxy::FaultProxy;
use super::tls::tempdir::Dir;
use super::tls::{Ca, Pair, tls_args};
use super::{RedisServer, answers_as, free_port, install_hint, raw_command_as, server_binary};

/// Three deployments at most run at once in a test binary: each is five
/// processes whose failover timing is measured, on a machine of two cores.
/// Hold the permit for the whole test. (A test waiting here holds one of
/// the test threads: with two at once, the run's twelve Sentinel tests
/// kept four of six threads waiting, 20 s of a 235 s run.)
pub async fn one_of_three() -> tokio::sync::SemaphorePermit<'static> {
    static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(3);
    SLOTS
        .acquire()
        .await
        .expect("the semaphore is never closed")
}

/// The service name the Sentinels monitor.
pub const SERVICE: &str = "mymaster";

/// How long a Sentinel waits for an unanswered primary before it calls it
/// down (`down-after-milliseconds`).
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

/// One `redis-server --sentinel`.
pub struct Sentinel {
    child: Child,
    port: u16,
    /// Its `requirepass`, if it has one.
    password: Option<String>,
    tls_port: Option<u16>,
    dir: super::tls::tempdir::Dir,
}

impl Sentinel {
    /// A Sentinel monitoring the primary at `primary_port`; with `tls`, it
    /// also listens on a TLS port and reaches Redis and the other Sentinels
    /// over TLS; with `password`, clients and the other Sentinels need it.
    fn start(primary_port: u16, tls: Option<(&Ca, &Pair)>, password: Option<&str>) -> Self {
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir = super::tls::tempdir::Dir::new("sentinel");
            let tls_port = tls.map(|_| free_port());
            let extra = match (tls, tls_port) {
                (Some((ca, pair)), Some(tls_port)) => {
                    let lines: Vec<String> = tls_args(dir.path(), tls_port, ca, pair, false)
                        .chunks(2)
                        .map(|kv| format!("{} {}", kv[0].trim_start_matches("--"), kv[1]))
                        .collect();
                    format!("{}\ntls-replication yes\n", lines.join("\n"))
                }
                _ => String::new(),
            };
            let extra = match password {
                Some(password) => {
                    format!("{extra}requirepass {password}\nsentinel sentinel-pass {password}\n")
                }
                None => extra,
            };
            let config: PathBuf = dir.path().join("sentinel.conf");
            // Sentinel rewrites its configuration file: it must be its own.
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\n\
                     sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {SERVICE} {down}\n\
                     sentinel failover-timeout {SERVICE} 10000\n\
                     sentinel parallel-syncs {SERVICE} 1\n{extra}",
                    dir = dir.path().display(),
                    down = DOWN_AFTER.as_millis(),
                ),
            )
            .unwrap();
            let child = match Command::new(server_binary())
                .arg(&config)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
            {
                Ok(child) => child,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    panic!("{}", install_hint())
                }
                Err(e) => panic!("spawning {} --sentinel: {e}", server_binary().display()),
            };
            let mut sentinel = Self {
                child,
                port,
                password: password.map(str::to_owned),
                tls_port,
                dir,
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(status)) = sentinel.child.try_wait() {
                    last = format!("sentinel on port {port} exited: {status}");
                    break;
                }
                if answers_as(port, sentinel.child.id(), password) {
                    return sentinel;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = sentinel.child.kill();
            let _ = sentinel.child.wait();
            let _ = &sentinel.dir;
        }
        panic!("could not start a Sentinel: {last}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn command(&self, args: &[&str]) -> String {
        raw_command_as(self.port, self.password.as_deref(), args)
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A primary, its replica and three Sentinels that agree on them.
pub struct Deployment {
    pub primary: RedisServer,
    pub replica: RedisServer,
    /// Between the replica and the primary, when asked for: the replication
    /// stream can be held back to lose writes on purpose.
    pub link: Option<FaultProxy>,
    pub sentinels: Vec<Sentinel>,
    /// The primary's and the replica's TLS ports, in a TLS deployment.
    pub tls_ports: Option<(u16, u16)>,
    _dirs: Vec<Dir>,
}

impl Deployment {
    /// Start it and wait until every Sentinel knows the replica and the
    /// other two Sentinels (so a failover can happen).
    pub fn start() -> Self {
        Self::start_inner(false)
    }

    /// As [`start`](Self::start), with the replica replicating through a
    /// [`FaultProxy`] ([`link`](Self::link)).
    pub fn start_with_link() -> Self {
        Self::start_inner(true)
    }

    /// As [`start`](Self::start), everything over TLS with certificates of
    /// `ca` (for `127.0.0.1`): the primary and the replica serve TLS (and
    /// replicate over it), the Sentinels listen on TLS and reach Redis and
    /// each other over it. Every process keeps a plain port for the tests'
    /// own commands. [`tls_url`](Self::tls_url) is the client's URL.
    pub fn start_tls(ca: &Ca) -> Self {
        Self::start_inner_with(false, Some(ca), None)
    }

    /// As [`start`](Self::start), with Sentinels that need `password`
    /// (`requirepass`; they authenticate to each other with it too).
    pub fn start_with_sentinel_password(password: &str) -> Self {
        Self::start_inner_with(false, None, Some(password))
    }

    fn start_inner(proxied: bool) -> Self {
        Self::start_inner_with(proxied, None, None)
    }

    fn start_inner_with(proxied: bool, ca: Option<&Ca>, sentinel_password: Option<&str>) -> Self {
        let server_pair = ca.map(|ca| ca.server(&["127.0.0.1", "localhost"]));
        let dirs: Vec<Dir> = (0..2).map(|_| Dir::new("sentinel-tls")).collect();
        // Server `i` with `extra` arguments, and the port others reach it
        // on when it serves TLS.
        let start = |i: usize, mut extra: Vec<String>| -> (RedisServer, Option<u16>) {
            // A full sync starts at once, not after Redis's default wait of
            // 5 s for more replicas to join it (the replica at start, and
            // the old primary after a failover).
            extra.extend(["--repl-diskless-sync-delay".to_owned(), "0".to_owned()]);
            match (ca, &server_pair) {
                (Some(ca), Some(pair)) => {
                    let (server, tls_port) = RedisServer::start_with_port(|tls_port| {
                        let mut args = tls_args(dirs[i].path(), tls_port, ca, pair, false);
                        args.extend(["--tls-replication".to_owned(), "yes".to_owned()]);
                        args.extend(extra.iter().cloned());
                        args
                    });
                    (server, Some(tls_port))
                }
                _ => (RedisServer::start_with_port(|_| extra.clone()).0, None),
            }
        };
        let (primary, primary_tls) = start(0, Vec::new());
        let primary_port = primary_tls.unwrap_or(primary.port());
        let link = proxied.then(|| FaultProxy::start(primary.port()));
        let upstream = link.as_ref().map_or(primary_port, FaultProxy::port);
        let replica_of = vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            upstream.to_string(),
        ];
        let (replica, replica_tls) = start(1, replica_of);
        wait_for("the replica to sync", Duration::from_secs(20), || {
            replica
                .command(&["INFO", "replication"])
                .contains("master_link_status:up")
        });
        let tls = ca.zip(server_pair.as_ref());
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start(primary_port, tls, sentinel_password))
            .collect();
        wait_for(
            "the Sentinels to know the replica and each other",
            Duration::from_secs(30),
            || {
                sentinels.iter().all(|s| {
                    let master = s.command(&["SENTINEL", "MASTER", SERVICE]);
                    field(&master, "num-slaves") == Some(1)
                        && field(&master, "num-other-sentinels") == Some(2)
                })
            },
        );
        Self {
            primary,
            replica,
            link,
            sentinels,
            tls_ports: primary_tls.zip(replica_tls),
            _dirs: dirs,
        }
    }

    /// `rediss+sentinel://…` to the Sentinels' TLS ports.
    pub fn tls_url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.tls_port.expect("a TLS deployment")))
            .collect();
        format!("rediss+sentinel://{}/{SERVICE}", hosts.join(","))
    }

    /// `127.0.0.1:port` of each Sentinel.
    pub fn sentinel_addresses(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect()
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster`.
    pub fn url(&self) -> String {
        format!(
            "redis+sentinel://{}/{SERVICE}",
            self.sentinel_addresses().join(",")
        )
    }

    /// Wait until the replica has every write of the primary (their
    /// replication offsets agree).
    pub fn wait_replicated(&self) {
        wait_for("the counts to replicate", Duration::from_secs(10), || {
            let primary = self.primary.command(&["INFO", "replication"]);
            let replica = self.replica.command(&["INFO", "replication"]);
            offset(&primary, "master_repl_offset") == offset(&replica, "slave_repl_offset")
        });
    }

    /// The port of the primary the first Sentinel names.
    pub fn named_primary(&self) -> Option<u16> {
        named_by(&self.sentinels[0])
    }

    /// Whether any Sentinel names a primary other than the one on `old`.
    pub fn any_names_other_than(&self, old: u16) -> bool {
        self.sentinels
            .iter()
            .any(|sentinel| named_by(sentinel).is_some_and(|port| port != old))
    }
}

/// The port of the primary `sentinel` names.
fn named_by(sentinel: &Sentinel) -> Option<u16> {
    let reply = sentinel.command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
    // *2 $9 127.0.0.1 $5 port
    reply.lines().nth(4).and_then(|p| p.trim().parse().ok())
}

/// The integer after `name` in a flat RESP array of field, value pairs.
fn field(reply: &str, name: &str) -> Option<u64> {
    let lines: Vec<&str> = reply.lines().collect();
    let at = lines.iter().position(|line| *line == name)?;
    lines.get(at + 2)?.trim().parse().ok()
}

/// `master_repl_offset` or `slave_repl_offset` from `INFO replication`.
fn offset(info: &str, name: &str) -> Option<u64> {
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("{name}:")))
        .and_then(|v| v.trim().parse().ok())
}

/// Wait until `done`, or panic saying what did not happen.
pub fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
