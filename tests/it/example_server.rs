//! `examples/server/`, the program people copy into production, run as
//! a process: its settings, bad values, trusted proxies, fail modes,
//! header styles and graceful shutdown.
//!
//! The example's binary is built by `cargo test` (every target); run alone,
//! build it first with `cargo build --all-features --example server`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::RedisServer;

/// The example's binary, beside this test's in the target directory.
fn binary() -> PathBuf {
    example_binary("server")
}

/// The binary of the example `name`, beside this test's in the target
/// directory (`cargo test --all-features` builds it).
pub(crate) fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = debug.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --all-features --example {name}` \
         (`cargo test --all-features` builds it)",
        path.display()
    );
    path
}

/// The example's binary with `BIND=127.0.0.1:0` and nothing else in its
/// environment; with `open_files`, under that limit of open files.
pub(crate) fn command(open_files: Option<u32>) -> Command {
    program(binary(), "BIND", open_files)
}

/// `binary` with `bind` set to `127.0.0.1:0` and nothing else in its
/// environment; with `open_files`, under that limit of open files (the
/// soft and hard `RLIMIT_NOFILE`, as systemd's `LimitNOFILE` sets them).
pub(crate) fn program(binary: PathBuf, bind: &str, open_files: Option<u32>) -> Command {
    let mut command = match open_files {
        None => Command::new(binary),
        Some(limit) => {
            let mut shell = Command::new("sh");
            shell
                .arg("-c")
                .arg(format!("ulimit -n {limit} && exec \"$0\""))
                .arg(binary);
            shell
        }
    };
    command.env_clear().env(bind, "127.0.0.1:0");
    command
}

/// A running example server; killed when dropped.
pub(crate) struct Server {
    child: Child,
    pub(crate) addr: String,
    /// The line that says where it listens (and what it limits, how).
    start_line: String,
    /// Where its admin router listens (`ADMIN_BIND`), once it said so.
    admin: std::sync::Mutex<std::sync::mpsc::Receiver<String>>,
    /// Every line it logged, in order.
    log: std::sync::Mutex<std::sync::mpsc::Receiver<String>>,
}

impl Server {
    /// Start it with `vars` (and `BIND=127.0.0.1:0`), and wait for its
    /// "listening on" line.
    pub(crate) fn start(vars: &[(&str, &str)]) -> Self {
        Self::spawn(command(None), vars)
    }

    /// Start it under a limit of `open_files` open files.
    pub(crate) fn with_open_files(open_files: u32, vars: &[(&str, &str)]) -> Self {
        Self::spawn(command(Some(open_files)), vars)
    }

    fn spawn(mut command: Command, vars: &[(&str, &str)]) -> Self {
        command
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (name, value) in vars {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (admin_tx, admin) = std::sync::mpsc::channel();
        let (log_tx, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = tx.send((addr, line.clone()));
                } else if let Some(rest) = line.split("admin router on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = admin_tx.send(addr);
                }
                let _ = log_tx.send(line);
            }
        });
        let (addr, start_line) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the server says where it listens");
        Self {
            child,
            addr,
            start_line,
            admin: std::sync::Mutex::new(admin),
            log: std::sync::Mutex::new(log),
        }
    }

    /// Send it `signal` (`TERM`, `HUP`) as an operator would, with `kill`.
    pub(crate) fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -{signal}");
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs (it has not exited).
    pub(crate) fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The next line it logs that contains `text`, waiting up to `limit`
    /// (lines logged before are read too, once).
    pub(crate) fn logged(&self, text: &str, limit: Duration) -> Option<String> {
        let log = self.log.lock().unwrap();
        let deadline = Instant::now() + limit;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match log.recv_timeout(left) {
                Ok(line) if line.contains(text) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }

    /// Where its admin router listens (it says so right after it starts).
    pub(crate) fn admin_addr(&self) -> String {
        self.admin
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(10))
            .expect("the server says where its admin router listens")
    }

    /// `GET path` with `headers`: the status and the response's headers
    /// (names lowercase).
    pub(crate) fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
        self.send("GET", path, headers, "")
    }

    /// `method path` with `headers` and `body` on a connection of its own:
    /// the status and the response's headers (names lowercase).
    pub(crate) fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, Vec<(String, String)>) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut request =
            format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
        if !body.is_empty() {
            request.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let head = response.split("\r\n\r\n").next().unwrap();
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        (status, headers)
    }

    pub(crate) fn status(&self, headers: &[(&str, &str)]) -> u16 {
        self.get("/", headers).0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run the server with `vars` expecting it to refuse them: its exit status
/// and what it wrote on stderr (a server that starts instead is stopped
/// after 10 s, and the test fails).
fn refused(vars: &[(&str, &str)]) -> (Option<i32>, String) {
    refused_by(command(None), vars)
}

/// `refused`, of `command`.
pub(crate) fn refused_by(mut command: Command, vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = command
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{vars:?}: the server started instead of refusing the setting");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        pipe.read_to_string(&mut stderr).unwrap();
    }
    (status.code(), stderr)
}

#[test]
fn a_bad_value_exits_with_status_2_naming_the_variable() {
    for (name, value) in [
        ("FAIL_MODE", "sometimes"),
        ("FAIL_MODE", "fallback:0"),
        ("FAIL_MODE", "fallback:many"),
        ("HEADERS", "xml"),
        ("TRUSTED_PROXIES", "10.0.0.0/8, proxy.internal"),
        ("TRUSTED_PROXIES", " , "),
        ("PROXY_HEADER", "via"),
        ("RATE_LIMIT", "3 per second"),
        ("KEY", "cookie:session"),
        ("LOCAL_QUOTA", "100"),
        ("LOCAL_QUOTA", "1/s"),
        ("HEADER_TIMEOUT", "soon"),
        ("HEADER_TIMEOUT", "0s"),
        ("SHUTDOWN_GRACE", "10"),
        ("EXECUTION", "both"),
        ("MAX_CONNECTIONS", "0"),
        ("MAX_CONNECTIONS", "many"),
        ("MAX_CONNECTIONS_PER_IP", "-1"),
    ] {
        let (status, stderr) = refused(&[(name, value)]);
        assert_eq!(status, Some(2), "{name}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{name}: ")),
            "{name}={value}: the message names the variable: {stderr}"
        );
    }
}

/// `GET /metrics` from the admin router at `addr`, naming `host` in
/// `Host`: the status.
#[cfg(feature = "admin")]
fn admin_status(addr: &str, host: &str, token: &str) -> u16 {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\
         Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap()
}

/// `ADMIN_HOST_NAMES` lists the names the admin router serves besides its
/// address: a request naming `admin.internal` is refused without it and
/// served with it; a bad name, or the list without the router, exits 2
/// naming the variable.
#[cfg(feature = "admin")]
#[test]
fn admin_host_names_are_served_when_listed() {
    let token = "a-token-of-sixteen-plus-bytes";
    let admin = [("ADMIN_BIND", "127.0.0.1:0"), ("ADMIN_TOKEN", token)];
    let unlisted = Server::start(&admin);
    let addr = unlisted.admin_addr();
    let port = addr.rsplit_once(':').unwrap().1;
    assert_eq!(admin_status(&addr, &addr, token), 200);
    assert_eq!(
        admin_status(&addr, &format!("admin.internal:{port}"), token),
        403
    );
    drop(unlisted);

    let mut vars = admin.to_vec();
    vars.push(("ADMIN_HOST_NAMES", "admin.internal, ops.example:443"));
    let listed = Server::start(&vars);
    let addr = listed.admin_addr();
    let port = addr.rsplit_once(':').unwrap().1;
    assert_eq!(
        admin_status(&addr, &format!("admin.internal:{port}"), token),
        200
    );
    assert_eq!(admin_status(&addr, "ADMIN.internal", token), 200);
    // Behind a proxy that ends TLS: the browser leaves out port 443.
    assert_eq!(admin_status(&addr, "ops.example", token), 200);
    assert_eq!(
        admin_status(&addr, &format!("ops.example:{port}"), token),
        403
    );
    assert_eq!(
        admin_status(&addr, &format!("evil.example:{port}"), token),
        403
    );
    drop(listed);

    for (vars, named) in [
        (
            &[admin[0], admin[1], ("ADMIN_HOST_NAMES", "admin internal")][..],
            "ADMIN_HOST_NAMES",
        ),
        (
            &[
                admin[0],
                admin[1],
                ("ADMIN_HOST_NAMES", "admin.internal,,ops.example"),
            ][..],
            "ADMIN_HOST_NAMES",
        ),
        (
            &[admin[0], admin[1], ("ADMIN_HOST_NAMES", "admin.internal,")][..],
            "ADMIN_HOST_NAMES",
        ),
        (
            &[
                admin[0],
                admin[1],
                ("ADMIN_HOST_NAMES", "user@admin.internal"),
            ][..],
            "ADMIN_HOST_NAMES",
        ),
        (
            &[("ADMIN_HOST_NAMES", "admin.internal")][..],
            "ADMIN_HOST_NAMES",
        ),
    ] {
        let (status, stderr) = refused(vars);
        assert_eq!(status, Some(2), "{vars:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{named}: ")),
            "{vars:?}: {stderr}"
        );
        assert!(!stderr.contains(token), "{stderr}");
    }
}

/// The admin router needs both its address and its token, a token of at
/// least 16 bytes, and never the public listener; the token is never
/// echoed.
#[cfg(feature = "admin")]
#[test]
fn admin_settings_are_both_or_neither_and_never_public() {
    let token = "a-token-of-sixteen-plus-bytes";
    for (vars, named) in [
        (&[("ADMIN_TOKEN", token)][..], "ADMIN_BIND"),
        (&[("ADMIN_BIND", "127.0.0.1:0")][..], "ADMIN_TOKEN"),
        (
            &[
                ("ADMIN_BIND", "127.0.0.1:0"),
                ("ADMIN_TOKEN", "short-token"),
            ][..],
            "ADMIN_TOKEN",
        ),
        (
            &[
                ("BIND", "127.0.0.1:3999"),
                ("ADMIN_BIND", "127.0.0.1:3999"),
                ("ADMIN_TOKEN", token),
            ][..],
            "ADMIN_BIND",
        ),
    ] {
        let (status, stderr) = refused(vars);
        assert_eq!(status, Some(2), "{vars:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{named}: ")),
            "{vars:?}: {stderr}"
        );
        assert!(
            !stderr.contains(token) && !stderr.contains("short-token"),
            "{stderr}"
        );
    }
}

/// Behind trusted proxies the forwarded client is the key; otherwise the
/// header is ignored and the peer is the key, so a client cannot choose it.
#[test]
fn trusted_proxies_make_the_forwarded_client_the_key() {
    let trusting = Server::start(&[("RATE_LIMIT", "1/min"), ("TRUSTED_PROXIES", "127.0.0.1")]);
    let from = |ip: &'static str| [("X-Forwarded-For", ip)];
    assert_eq!(trusting.status(&from("203.0.113.1")), 200);
    assert_eq!(trusting.status(&from("203.0.113.1")), 429);
    assert_eq!(trusting.status(&from("203.0.113.2")), 200, "another client");

    let not_trusting = Server::start(&[("RATE_LIMIT", "1/min")]);
    assert_eq!(not_trusting.status(&from("203.0.113.1")), 200);
    assert_eq!(
        not_trusting.status(&from("203.0.113.2")),
        429,
        "the header is not believed: one peer, one key"
    );
}

#[test]
fn headers_choose_the_rate_limit_fields() {
    let has = |headers: &[(String, String)], name: &str| headers.iter().any(|(n, _)| n == name);
    for (style, x, ietf) in [
        ("x", true, false),
        ("ietf", false, true),
        ("both", true, true),
    ] {
        let server = Server::start(&[("RATE_LIMIT", "5/min"), ("HEADERS", style)]);
        let (status, headers) = server.get("/", &[]);
        assert_eq!(status, 200);
        assert_eq!(
            has(&headers, "x-ratelimit-limit"),
            x,
            "{style}: {headers:?}"
        );
        assert_eq!(
            has(&headers, "ratelimit-policy"),
            ietf,
            "{style}: {headers:?}"
        );
        assert_eq!(has(&headers, "ratelimit"), ietf, "{style}: {headers:?}");
    }
}

/// A calendar quota in `RATE_LIMIT` counts with the fixed window it needs
/// when `ALGORITHM` is unset, and an algorithm that cannot count it is
/// refused by name.
#[test]
fn a_calendar_quota_runs_from_rate_limit() {
    let server = Server::start(&[("RATE_LIMIT", "2/month")]);
    let (status, headers) = server.get("/", &[]);
    assert_eq!(status, 200, "{headers:?}");
    assert!(
        headers
            .iter()
            .any(|(n, v)| n == "x-ratelimit-limit" && v == "2"),
        "{headers:?}"
    );
    assert_eq!(server.get("/", &[]).0, 200);
    let (status, headers) = server.get("/", &[]);
    assert_eq!(status, 429);
    let retry: u64 = headers
        .iter()
        .find(|(n, _)| n == "retry-after")
        .map(|(_, v)| v.parse().unwrap())
        .unwrap();
    assert!(retry > 0 && retry <= 31 * 86_400, "{retry}");
    let (code, stderr) = refused(&[("RATE_LIMIT", "2/month"), ("ALGORITHM", "gcra")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("ALGORITHM") && stderr.contains("calendar"),
        "{stderr}"
    );
}

/// With Redis gone: `closed` answers 503, `fallback:1` limits in process,
/// `open` admits.
#[test]
fn fail_modes_answer_when_redis_is_down() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let closed = Server::start(&[
        ("RATE_LIMIT", "1/min"),
        ("REDIS_URL", &url),
        ("FAIL_MODE", "closed"),
    ]);
    let fallback = Server::start(&[
        ("RATE_LIMIT", "1/min"),
        ("REDIS_URL", &url),
        ("FAIL_MODE", "fallback:1"),
    ]);
    let open = Server::start(&[("RATE_LIMIT", "1/min"), ("REDIS_URL", &url)]);
    assert_eq!(closed.status(&[]), 200, "Redis up: limited as usual");
    redis.kill();
    assert_eq!(closed.status(&[]), 503);
    assert_eq!(fallback.status(&[]), 200, "the fallback's own count");
    assert_eq!(fallback.status(&[]), 429, "the fallback limits");
    assert_eq!(open.status(&[]), 200);
    assert_eq!(open.status(&[]), 200, "open admits while Redis is down");
    assert_eq!(closed.get("/health", &[]).0, 200, "health is never limited");
}

/// The password in `REDIS_URL` shows neither in the start line nor in the
/// message of a refused connection; the user name does.
#[test]
fn the_redis_password_is_never_logged() {
    let redis = RedisServer::start();
    let url = redis.least_privileged_url("rl");
    assert!(url.contains(":least-privilege@"), "{url}");
    let server = Server::start(&[("RATE_LIMIT", "5/s"), ("REDIS_URL", &url)]);
    let line = &server.start_line;
    assert!(
        line.contains(&format!("redis://ratelimit@127.0.0.1:{}", redis.port())),
        "{line}"
    );
    assert!(!line.contains("least-privilege"), "{line}");
    assert_eq!(server.status(&[]), 200, "limited through Redis as the user");

    let wrong = url.replace("least-privilege", "not-the-password");
    let (code, stderr) = refused(&[("RATE_LIMIT", "5/s"), ("REDIS_URL", &wrong)]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("REDIS_URL: "), "{stderr}");
    assert!(stderr.contains("redis://ratelimit@127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("not-the-password"), "{stderr}");
}

#[cfg(unix)]
#[test]
fn sigterm_stops_the_server_gracefully() {
    let mut server = Server::start(&[]);
    assert_eq!(server.status(&[]), 200);
    server.signal("TERM");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "a graceful stop exits 0");
    assert!(
        TcpStream::connect(&server.addr).is_err(),
        "no longer listening"
    );
}

/// Wait up to `limit` for the server to exit: its status and how long it took.
fn wait_for_exit(server: &mut Server, limit: Duration) -> (std::process::ExitStatus, Duration) {
    let started = Instant::now();
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        assert!(
            started.elapsed() < limit,
            "still running {limit:?} after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A client that sent half a request (no blank line ends its headers) and
/// one that sent many requests and stopped reading the answers hold
/// connections with work in flight; the stop waits for them only for
/// `SHUTDOWN_GRACE`, then exits 0.
#[cfg(unix)]
#[test]
fn sigterm_exits_within_the_grace_period_despite_half_sent_and_unread_requests() {
    let grace = Duration::from_secs(2);
    let mut server = Server::start(&[
        ("RATE_LIMIT", "100/10s"),
        ("SHUTDOWN_GRACE", "2s"),
        // Far beyond the test: only the grace period can end these.
        ("HEADER_TIMEOUT", "10m"),
    ]);
    let mut half = TcpStream::connect(&server.addr).unwrap();
    half.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    // Pipelined requests whose answers fill both socket buffers: the
    // server blocks writing them.
    let unread = TcpStream::connect(&server.addr).unwrap();
    unread.set_nonblocking(true).unwrap();
    let requests = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".repeat(1_000_000);
    let mut sent = 0;
    let mut progress = Instant::now();
    // Until the server stops reading them for 300 ms.
    while sent < requests.len() && progress.elapsed() < Duration::from_millis(300) {
        match (&unread).write(&requests[sent..]) {
            Ok(n) => {
                sent += n;
                progress = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        sent < requests.len(),
        "the server stopped reading: its answers were not read"
    );
    // A client that sends whole requests is still answered.
    assert_eq!(server.get("/health", &[]).0, 200);

    server.signal("TERM");
    let (status, took) = wait_for_exit(&mut server, grace + Duration::from_secs(3));
    assert_eq!(
        status.code(),
        Some(0),
        "a stop cut short by the grace period still exits 0"
    );
    assert!(
        took >= grace - Duration::from_millis(200),
        "the unread answers were in flight: the stop waited for them ({took:?})"
    );
    // The half-sent connection was closed, not left to the client.
    half.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut rest = Vec::new();
    assert!(half.read_to_end(&mut rest).is_ok(), "closed by the server");
    drop(unread);
}

/// Without any signal, a connection that does not finish its headers
/// within `HEADER_TIMEOUT` is closed; whole requests are served as before.
#[test]
fn a_half_sent_request_is_closed_after_the_header_timeout() {
    let server = Server::start(&[("HEADER_TIMEOUT", "1s")]);
    let mut half = TcpStream::connect(&server.addr).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let sent = Instant::now();
    half.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut answer = Vec::new();
    half.read_to_end(&mut answer)
        .expect("closed by the server before the test's own 10 s timeout");
    let took = sent.elapsed();
    assert!(
        (Duration::from_millis(900)..Duration::from_secs(5)).contains(&took),
        "closed after {took:?}"
    );
    assert!(
        !String::from_utf8_lossy(&answer).contains("200 OK"),
        "a half-sent request is not served"
    );
    assert_eq!(server.status(&[]), 200, "the server still serves");
}

#[test]
fn two_servers_follow_rules_written_to_redis_within_a_second_under_load() {
    let redis = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let publish = |policy: &str| {
        let text = format!(
            "[[rules]]\nname = \"api\"\nkey = \"global\"\npolicy = \"{policy}\"\nalgorithm = \"fixed-window\"\n"
        );
        runtime.block_on(async {
            let client = redis::Client::open(redis.url()).unwrap();
            let mut connection = client.get_multiplexed_async_connection().await.unwrap();
            tower_redis_ratelimit::rules::publish(&mut connection, "rl:rules", &text)
                .await
                .unwrap()
        })
    };
    assert_eq!(publish("100000/h"), 1);
    let url = redis.url();
    let vars = [("REDIS_URL", url.as_str()), ("RULES", "redis")];
    let servers = [Server::start(&vars), Server::start(&vars)];

    // Load on both servers from 4 clients; every response is recorded with
    // when its request was sent.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = Instant::now();
    let mut published_at = Duration::ZERO;
    let responses: Vec<Vec<(usize, Duration, u16, String)>> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..4)
            .map(|c| {
                let (servers, stop) = (&servers, &stop);
                scope.spawn(move || {
                    let mut seen = Vec::new();
                    let mut i = c;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let s = i % 2;
                        let sent = start.elapsed();
                        let (status, headers) = servers[s].get("/api/items", &[]);
                        let limit = headers
                            .iter()
                            .find(|(n, _)| n == "x-ratelimit-limit")
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default();
                        seen.push((s, sent, status, limit));
                        i += 1;
                    }
                    seen
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        published_at = start.elapsed();
        assert_eq!(publish("200000/h"), 2);
        std::thread::sleep(Duration::from_millis(1500));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let all: Vec<_> = responses.into_iter().flatten().collect();
    assert!(all.len() > 100, "too little load: {} requests", all.len());
    let failed: Vec<_> = all.iter().filter(|r| r.2 != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        all.len(),
        &failed[..failed.len().min(5)]
    );
    for s in 0..2 {
        let of_server: Vec<_> = all.iter().filter(|r| r.0 == s).collect();
        assert!(
            of_server.iter().all(|r| r.3 == "100000" || r.3 == "200000"),
            "server {s}: {of_server:?}"
        );
        let last_old = of_server
            .iter()
            .filter(|r| r.3 == "100000")
            .map(|r| r.1)
            .max()
            .unwrap();
        let switched_after = last_old.saturating_sub(published_at);
        assert!(
            switched_after < Duration::from_secs(1),
            "server {s} still on the old rules {switched_after:?} after the publication"
        );
        assert!(
            of_server
                .iter()
                .any(|r| r.3 == "200000" && r.1 > published_at),
            "server {s} never switched"
        );
        eprintln!(
            "server {s}: {} requests, last on the old rules sent {switched_after:?} after the publication",
            of_server.len()
        );
    }
}

#[test]
fn rules_from_a_file_pick_the_tier_and_a_bad_rules_setting_exits_2() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/rules.toml");
    // The plan header is believed from a trusted proxy only: here the
    // test client, on loopback.
    let server = Server::start(&[("RULES", file), ("TRUSTED_PROXIES", "127.0.0.1")]);
    let limit = |headers: &[(&str, &str)]| {
        let (status, got) = server.get("/api/items", headers);
        assert_eq!(status, 200);
        got.into_iter()
            .find(|(n, _)| n == "x-ratelimit-limit")
            .map(|(_, v)| v)
    };
    // The fields show the matching rule with the fewest units left: for
    // the free plan the API rule (100/min), for pro the global one
    // (2000/s, where pro's 5000/min has more left).
    assert_eq!(limit(&[]).as_deref(), Some("100"));
    assert_eq!(limit(&[("x-plan", "pro")]).as_deref(), Some("2000"));
    assert_eq!(server.get("/health", &[]).0, 200);

    let dir = std::env::temp_dir().join(format!("server-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5 a minute\"\n",
    )
    .unwrap();
    let (code, stderr) = refused(&[("RULES", bad.to_str().unwrap())]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("RULES: rule \"a\" (#1), field policy"),
        "{stderr}"
    );
    let (code, stderr) = refused(&[("RULES", "redis")]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("RULES: `redis` needs REDIS_URL"),
        "{stderr}"
    );
    let (code, stderr) = refused(&[("RULES", file), ("RATE_LIMIT", "5/s")]);
    assert_eq!(code, Some(2));
    assert!(stderr.starts_with("RATE_LIMIT: "), "{stderr}");
    // A local quota is a rule's own (`local_quota`): not set beside RULES.
    let (code, stderr) = refused(&[("RULES", file), ("LOCAL_QUOTA", "100/250ms")]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.starts_with("LOCAL_QUOTA: ") && stderr.contains("local_quota"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rules file edited from 10 to 5 an hour denies at once a client that
/// used 8: the rule's count is kept under its name, not its numbers.
#[test]
fn a_tightened_rules_file_bites_at_once() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("server-tighten-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rules.toml");
    let rules = |policy: &str| {
        format!("[[rules]]\nname = \"api\"\nkey = \"header:x-client\"\npolicy = \"{policy}\"\n")
    };
    std::fs::write(&file, rules("10/h")).unwrap();
    let url = redis.url();
    let server = Server::start(&[
        ("REDIS_URL", url.as_str()),
        ("RULES", file.to_str().unwrap()),
    ]);
    for i in 0..8 {
        assert_eq!(server.status(&[("x-client", "a")]), 200, "request {i}");
    }
    std::fs::write(&file, rules("5/h")).unwrap();
    // The server re-reads the file every second; no request meanwhile.
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(server.status(&[("x-client", "a")]), 429, "8 used of 5");
    assert_eq!(server.status(&[("x-client", "b")]), 200, "a fresh client");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_local_quota_admits_hot_keys_locally_within_the_limit() {
    let redis = RedisServer::start();
    let url = redis.url();
    let server = Server::start(&[
        ("REDIS_URL", url.as_str()),
        ("RATE_LIMIT", "20/h"),
        // GCRA: no window edge for a run to cross.
        ("ALGORITHM", "gcra"),
        ("LOCAL_QUOTA", "5/10s"),
    ]);
    let calls = redis.calls("evalsha");
    for i in 0..20 {
        assert_eq!(server.status(&[]), 200, "request {i}");
    }
    assert_eq!(server.status(&[]), 429);
    // Four batches of 5, then the denial (a batch refused, then one
    // request refused): 6 checks in Redis for 21 requests, and one more
    // when the first found the script not loaded yet.
    let checks = redis.calls("evalsha") - calls;
    assert!((6..=7).contains(&checks), "{checks} checks in Redis");
    let (code, stderr) = refused(&[("LOCAL_QUOTA", "5/10s"), ("ALGORITHM", "concurrency")]);
    assert_eq!(code, Some(2));
    assert!(stderr.starts_with("LOCAL_QUOTA: "), "{stderr}");

    // With rules, the rule's own `local_quota` does the same.
    let dir = std::env::temp_dir().join(format!("server-local-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rules.toml");
    std::fs::write(
        &file,
        "[[rules]]\nname = \"all\"\nkey = \"global\"\npolicy = \"1000/h\"\n\
         algorithm = \"gcra\"\nlocal_quota = \"50/30s\"\n",
    )
    .unwrap();
    let server = Server::start(&[
        ("REDIS_URL", url.as_str()),
        ("RULES", file.to_str().unwrap()),
    ]);
    let calls = redis.calls("evalsha");
    for i in 0..200 {
        assert_eq!(server.status(&[]), 200, "request {i}");
    }
    // Four batches of 50 (and one more when the script was not loaded).
    let checks = redis.calls("evalsha") - calls;
    assert!((4..=5).contains(&checks), "{checks} checks in Redis");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An execution is the sliding log's: beside another algorithm it is
/// refused, as a rule's `execution` is, with the same reason.
#[test]
fn an_execution_with_another_algorithm_exits_2() {
    for algorithm in ["gcra", "fixed-window"] {
        for execution in ["script", "transaction"] {
            let (code, stderr) = refused(&[("ALGORITHM", algorithm), ("EXECUTION", execution)]);
            assert_eq!(code, Some(2), "{algorithm} {execution}: {stderr}");
            assert!(
                stderr.starts_with("EXECUTION: ") && stderr.contains("only the sliding log"),
                "{stderr}"
            );
        }
    }
    let server = Server::start(&[("ALGORITHM", "sliding-log"), ("EXECUTION", "script")]);
    assert!(
        server.start_line.contains("execution=script"),
        "{}",
        server.start_line
    );
}

/// `REDIS_URL=rediss://…` with the CA and a client certificate from files
/// (mutual TLS), and `redis+sentinel://…`: the server limits through them,
/// and every server sees the other's counts.
#[cfg(all(feature = "tls", feature = "sentinel"))]
#[test]
fn tls_and_sentinel_urls_are_accepted() {
    use support::sentinel::Deployment;
    use support::tls::{Ca, TlsRedis, tempdir};

    let ca = Ca::new("example CA");
    let redis = TlsRedis::start(&ca, &["localhost"], true);
    let dir = tempdir::Dir::new("example-tls");
    let client = ca.client("example");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (ca_file, cert_file, key_file) = (
        write("ca.pem", &ca.pem()),
        write("client.pem", &client.cert),
        write("client.key", &client.key),
    );
    let url = redis.url("localhost");
    let tls_vars = [
        ("RATE_LIMIT", "2/min"),
        ("REDIS_URL", url.as_str()),
        ("REDIS_CA_CERT", ca_file.as_str()),
        ("REDIS_CLIENT_CERT", cert_file.as_str()),
        ("REDIS_CLIENT_KEY", key_file.as_str()),
    ];
    let a = Server::start(&tls_vars);
    let b = Server::start(&tls_vars);
    assert_eq!(a.status(&[]), 200);
    assert_eq!(b.status(&[]), 200);
    assert_eq!(
        a.status(&[]),
        429,
        "the two servers share the count over TLS"
    );
    assert!(redis.tls_clients() >= 2);

    // Without the client certificate Redis refuses the handshake: exit 2.
    let (code, stderr) = refused(&tls_vars[..3]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("REDIS_URL: cannot use Redis at rediss://"),
        "{stderr}"
    );
    // A key without its certificate is a bad setting.
    let (code, stderr) = refused(&[tls_vars[0], tls_vars[1], tls_vars[4]]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("REDIS_CLIENT_CERT"), "{stderr}");

    let deployment = Deployment::start();
    let sentinel_url = deployment.url();
    let server = Server::start(&[("RATE_LIMIT", "2/min"), ("REDIS_URL", &sentinel_url)]);
    assert_eq!(server.status(&[]), 200);
    assert_eq!(server.status(&[]), 200);
    assert_eq!(server.status(&[]), 429);
    assert_ne!(deployment.primary.command(&["DBSIZE"]).trim(), ":0");
    // RULES=redis does not follow a failover: refused, with the reason.
    let (code, stderr) = refused(&[("REDIS_URL", &sentinel_url), ("RULES", "redis")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("Sentinel URL is not supported"), "{stderr}");
}

/// Counts belong to a limit's name: the example's rules and its
/// `RATE_LIMIT` limiter, both on one Redis, never count into each other.
#[test]
fn the_example_rules_and_limiter_never_share_a_count() {
    let redis = RedisServer::start();
    let url = redis.url();
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/rules.toml");
    let with_rules = Server::start(&[("REDIS_URL", url.as_str()), ("RULES", rules)]);
    // The default policy, 5/10s, by peer address (the rules' `api` rule is
    // by client address too: the same key, 127.0.0.1).
    let with_limiter = Server::start(&[("REDIS_URL", url.as_str())]);
    for i in 0..5 {
        assert_eq!(with_rules.get("/api/x", &[]).0, 200, "request {i}");
    }
    assert_eq!(
        with_limiter.status(&[]),
        200,
        "the rules' requests are not the limiter's"
    );
}

/// The example rules' `tokens` rule, loaded from `examples/rules.toml`:
/// a call is admitted against its cost (500) and charged the tokens the
/// demo upstream (`POST /completions`) reports in `x-usage-tokens`, which
/// the client never sees.
#[test]
fn the_example_rules_settle_a_metered_call_from_its_usage_header() {
    let redis = RedisServer::start();
    let url = redis.url();
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/rules.toml");
    let server = Server::start(&[("REDIS_URL", url.as_str()), ("RULES", rules)]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The rule's day is the UTC calendar day: no test straddles its end.
    runtime.block_on(support::harness::away_from_a_boundary(
        Duration::from_secs(86_400),
        Duration::from_secs(5),
    ));
    // The rule's count, read through a limiter of its name and policy.
    let store = runtime
        .block_on(tower_redis_ratelimit::RedisStore::connect(&url))
        .unwrap();
    let tokens = tower_redis_ratelimit::Limiter::new(store, "100000/day".parse().unwrap())
        .with_name("tokens");
    let used = || {
        // A peek answers what a check at the policy's cost (1) would leave.
        let peek = runtime.block_on(tokens.peek("key-1")).unwrap();
        100_000 - (peek.remaining() + 1)
    };
    let settles_to = |expected: u64| {
        let deadline = Instant::now() + Duration::from_secs(2);
        while used() != expected {
            assert!(
                Instant::now() < deadline,
                "used {}, expected {expected}",
                used()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let words = |n: usize| vec!["token"; n].join(" ");

    // 120 used: 380 of the estimate given back.
    let (status, headers) = server.send(
        "POST",
        "/completions",
        &[("x-api-key", "key-1")],
        &words(120),
    );
    assert_eq!(status, 200);
    assert!(
        headers.iter().all(|(name, _)| name != "x-usage-tokens"),
        "stripped: {headers:?}"
    );
    settles_to(120);
    // 800 used: 300 charged on top of the estimate.
    let (status, _) = server.send(
        "POST",
        "/completions",
        &[("x-api-key", "key-1")],
        &words(800),
    );
    assert_eq!(status, 200);
    settles_to(920);
}

/// `REDIS_CLUSTER`, the seed nodes of the 3-master cluster: the server
/// counts there, and says so at start; with `REDIS_URL` as well, or naming
/// no node, it exits 2 naming the variable.
#[cfg(feature = "cluster")]
#[test]
fn the_server_counts_in_a_redis_cluster() {
    let cluster = support::RedisCluster::start();
    let nodes = cluster.urls().join(",");
    let server = Server::start(&[("RATE_LIMIT", "2/min"), ("REDIS_CLUSTER", &nodes)]);
    assert!(
        server.start_line.contains("redis cluster redis://"),
        "{}",
        server.start_line
    );
    assert_eq!(server.status(&[]), 200);
    assert_eq!(server.status(&[]), 200);
    assert_eq!(server.status(&[]), 429);
    let keys: u64 = cluster
        .nodes()
        .iter()
        .map(|node| {
            let size = node.command(&["DBSIZE"]);
            size.trim().trim_start_matches(':').parse::<u64>().unwrap()
        })
        .sum();
    assert!(keys > 0, "no key in the cluster");
    drop(server);
    for vars in [
        &[
            ("REDIS_CLUSTER", nodes.as_str()),
            ("REDIS_URL", "redis://127.0.0.1:1"),
        ][..],
        &[("REDIS_CLUSTER", " , ")][..],
    ] {
        let (status, stderr) = refused_by(command(None), vars);
        assert_eq!(status, Some(2), "{vars:?}: {stderr}");
        assert!(stderr.contains("REDIS_CLUSTER"), "{vars:?}: {stderr}");
    }
}
