//! Test support: real `redis-server` processes on free loopback ports.
//!
//! Never a mock: if `redis-server` is missing the tests fail and say how to
//! install it.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL_HINT: &str = "redis-server was not found on PATH. The integration tests start \
their own Redis: install it with `sudo apt-get install redis-server` (Debian/Ubuntu), or run \
`scripts/test`, which installs it.";

/// A `redis-server` on a free loopback port, killed on drop.
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl RedisServer {
    /// Start a server with no persistence and wait until it answers PING.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Start a server with extra command-line arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            match Self::try_start(port, extra) {
                Ok(server) => return server,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    fn try_start(port: u16, extra: &[&str]) -> Result<Self, String> {
        let dir = std::env::temp_dir().join(format!("trr-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{INSTALL_HINT}"),
            Err(e) => return Err(format!("spawning redis-server: {e}")),
        };
        let mut server = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("redis-server on port {port} exited: {status}"));
            }
            if ping(port) {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "redis-server on port {port} did not answer PING within 10 s"
        ))
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

    /// Send a signal (`STOP`, `CONT`, ...) to the server.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Run a command with redis-cli-free plain RESP and return the raw reply.
    pub fn command(&self, args: &[&str]) -> String {
        raw_command(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a free loopback port")
}

fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    // +PONG, or -NOAUTH from a server with a password: either way it is up.
    let mut buf = [0u8; 16];
    matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
}

/// Send one command as RESP and return the reply bytes as text.
pub fn raw_command(port: u16, args: &[&str]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to redis");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut out = format!("*{}\r\n", args.len());
    for arg in args {
        out.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(out.as_bytes()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Initialise tracing once for tests that want logs (RUST_LOG).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}
