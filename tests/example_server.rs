//! `examples/server.rs`, the program people copy into production, run as
//! a process: its settings, bad values, trusted proxies, fail modes,
//! header styles and graceful shutdown.
//!
//! The example's binary is built by `cargo test` (every target); run alone,
//! build it first with `cargo build --all-features --example server`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::RedisServer;

/// The example's binary, beside this test's in the target directory.
fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = debug.join("examples").join("server");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --all-features --example server` \
         (`cargo test` builds it)",
        path.display()
    );
    path
}

/// A running example server; killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// Start it with `vars` (and `BIND=127.0.0.1:0`), and wait for its
    /// "listening on" line.
    fn start(vars: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary());
        command
            .env_clear()
            .env("BIND", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (name, value) in vars {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the server says where it listens");
        Self { child, addr }
    }

    /// `GET path` with `headers`: the status and the response's headers
    /// (names lowercase).
    fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
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

    fn status(&self, headers: &[(&str, &str)]) -> u16 {
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
    let mut child = Command::new(binary())
        .env_clear()
        .env("BIND", "127.0.0.1:0")
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
    ] {
        let (status, stderr) = refused(&[(name, value)]);
        assert_eq!(status, Some(2), "{name}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{name}: ")),
            "{name}={value}: the message names the variable: {stderr}"
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

#[cfg(unix)]
#[test]
fn sigterm_stops_the_server_gracefully() {
    let mut server = Server::start(&[]);
    assert_eq!(server.status(&[]), 200);
    let pid = server.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
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
