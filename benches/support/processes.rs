//! The processes a bench starts of its own: each stopped when dropped, and
//! a redis-server on a free port.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A process of the bench's own, stopped when dropped.
pub(crate) struct Own(pub(crate) Child);

impl Drop for Own {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on now.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Wait until something listens on `port` (at most 30 s).
pub(crate) fn wait_for(port: u16) {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "nothing on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A redis-server on a free port, without persistence: its URL.
pub(crate) fn redis_server() -> (String, Own) {
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server: install it (`apt-get install redis-server`)");
    wait_for(port);
    (format!("redis://127.0.0.1:{port}"), Own(child))
}
