//! One command sent as RESP over a socket of its own, and what tests read
//! from a server with it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::RedisServer;

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
