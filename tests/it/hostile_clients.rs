//! The example server against hostile clients: floods of connections that
//! send nothing, from one address and from several, under a low limit of
//! open files; and signals an operator or a closed terminal sends.
//!
//! Every client is on loopback: 127.0.0.0/8 is all loopback on Linux, so a
//! socket bound to 127.0.0.2 before it connects is another client to the
//! server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::example_server::{Server, command, refused_by};

/// Opens connections to one server from chosen loopback addresses.
struct Clients {
    runtime: tokio::runtime::Runtime,
    server: SocketAddr,
}

impl Clients {
    fn of(server: &Server) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        Self {
            runtime,
            server: server.addr.parse().unwrap(),
        }
    }

    /// A connection from `source` (the handshake done; the server may not
    /// have accepted it yet).
    fn connect(&self, source: &str) -> TcpStream {
        self.runtime.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket
                .bind(SocketAddr::new(source.parse().unwrap(), 0))
                .unwrap();
            let stream = socket.connect(self.server).await.unwrap();
            let stream = stream.into_std().unwrap();
            stream.set_nonblocking(false).unwrap();
            stream
        })
    }

    /// `n` connections from `source` that send nothing.
    fn silent(&self, source: &str, n: usize) -> Vec<TcpStream> {
        (0..n).map(|_| self.connect(source)).collect()
    }

    /// `GET /health` from `source`: the status, or `None` when the server
    /// closed the connection without answering; panics when nothing came
    /// within `limit`.
    fn health(&self, source: &str, limit: Duration) -> Option<u16> {
        let mut stream = self.connect(source);
        stream.set_read_timeout(Some(limit)).unwrap();
        // A write to a connection the server already closed may fail:
        // then the read says so too.
        let _ = stream.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        let mut answer = Vec::new();
        match stream.read_to_end(&mut answer) {
            Ok(_) => {}
            Err(error) if is_timeout(&error) => {
                panic!("no answer from {source} within {limit:?}")
            }
            Err(_) => return None,
        }
        let answer = String::from_utf8_lossy(&answer);
        answer
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
    }
}

fn is_timeout(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Whether the server closed `stream` within `limit` (a silent connection
/// reads nothing until then).
fn closed_within(stream: &TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    // A read with a timeout is not restarted after a signal: read again.
    let read = loop {
        match (&*stream).read(&mut [0; 1]) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            read => break read,
        }
    };
    match read {
        Ok(0) => true,
        Ok(_) => panic!("a silent connection got an answer"),
        Err(error) => !is_timeout(&error),
    }
}

/// Whether the server still holds `stream` open, as far as it has told the
/// client by now (no waiting).
fn is_open(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let open = match (&*stream).read(&mut [0; 1]) {
        Ok(0) => false,
        Ok(_) => panic!("a silent connection got an answer"),
        Err(error) => error.kind() == std::io::ErrorKind::WouldBlock,
    };
    stream.set_nonblocking(false).unwrap();
    open
}

/// How many of `streams` are open, once the server has made up its mind
/// about the last (which it accepted last): it was closed at once.
fn open_after_the_last_is_closed(streams: &[TcpStream]) -> usize {
    let (last, rest) = streams.split_last().unwrap();
    assert!(
        closed_within(last, Duration::from_secs(2)),
        "a connection over the cap is closed at once"
    );
    rest.iter().filter(|s| is_open(s)).count()
}

/// `n` silent connections from `source`, of which the server is expected
/// to hold `held` (the last one closed at once): never more, and fewer only
/// for as long as a connection closed just before has not given its place
/// back (tried again for up to a second).
fn fill(clients: &Clients, source: &str, n: usize, held: usize) -> Vec<TcpStream> {
    let started = Instant::now();
    loop {
        let streams = clients.silent(source, n);
        let open = open_after_the_last_is_closed(&streams);
        assert!(
            open <= held,
            "{open} connections held, over the cap of {held}"
        );
        if open == held {
            return streams;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{open} held, not {held}"
        );
        drop(streams);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Fifty silent connections from one address take no more than their
/// share: the 51st is closed at once, another address is answered within
/// a second, and the total cap holds across addresses.
#[test]
fn connections_are_capped_per_address_and_in_total() {
    let server = Server::start(&[
        ("MAX_CONNECTIONS", "80"),
        ("MAX_CONNECTIONS_PER_IP", "50"),
        // Far beyond the test: only the caps close these.
        ("HEADER_TIMEOUT", "10m"),
    ]);
    let clients = Clients::of(&server);
    let flood = fill(&clients, "127.0.0.1", 51, 50);

    let asked = Instant::now();
    assert_eq!(
        clients.health("127.0.0.2", Duration::from_secs(1)),
        Some(200)
    );
    assert!(asked.elapsed() < Duration::from_secs(1));

    // 30 more fit the total of 80, from any address.
    let others = fill(&clients, "127.0.0.3", 31, 30);
    assert_eq!(
        clients.health("127.0.0.4", Duration::from_secs(2)),
        None,
        "the total is reached: closed at once"
    );

    // Places freed by closed connections are taken again.
    drop((flood, others));
    let freed = Instant::now();
    loop {
        if clients.health("127.0.0.4", Duration::from_secs(2)) == Some(200) {
            break;
        }
        assert!(
            freed.elapsed() < Duration::from_secs(2),
            "still refused 2 s after 50 connections closed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The attack, on a smaller scale: under systemd's default of 1,024 open
/// files, 1,100 silent connections from one address made another client
/// wait until it timed out. Here the limit is 256 files: the default caps
/// fit it (128 connections, 100 per address), so a flood of 300 from one
/// address leaves room for others, and floods from several addresses are
/// refused at the total instead of exhausting the files.
#[test]
fn a_flood_of_silent_connections_cannot_exhaust_the_open_files() {
    let server = Server::with_open_files(256, &[("HEADER_TIMEOUT", "10m")]);
    let clients = Clients::of(&server);
    let flood = clients.silent("127.0.0.1", 300);
    let asked = Instant::now();
    assert_eq!(
        clients.health("127.0.0.2", Duration::from_secs(1)),
        Some(200)
    );
    assert!(asked.elapsed() < Duration::from_secs(1));
    assert_eq!(open_after_the_last_is_closed(&flood), 100);
    let caps = server
        .logged("connection limits", Duration::from_secs(1))
        .unwrap();
    assert!(
        caps.contains("max_connections=128") && caps.contains("max_connections_per_ip=100"),
        "{caps}"
    );

    // 128 in total, whoever holds them.
    let more = fill(&clients, "127.0.0.3", 100, 28);
    assert_eq!(clients.health("127.0.0.2", Duration::from_secs(2)), None);
    drop((flood, more));
    let freed = Instant::now();
    while clients.health("127.0.0.2", Duration::from_secs(2)) != Some(200) {
        assert!(freed.elapsed() < Duration::from_secs(2), "still refused");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        server.logged("cannot accept", Duration::from_millis(200)),
        None,
        "the server never ran out of files"
    );
}

/// Sets the soft open-file limit of the running process `pid` (the hard
/// one stays, so the limit can be raised again).
fn set_open_files(pid: u32, limit: usize) {
    let set = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={limit}:")])
        .status()
        .expect("prlimit (util-linux) sets a running process's limits");
    assert!(set.success(), "prlimit --pid {pid} --nofile={limit}:");
}

/// The CPU time `pid` has used (user and system).
pub(crate) fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the whole line, in ticks of 1/100 s.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// Out of files anyway (the limit lowered under the running server, below
/// what the caps assumed): a failed accept is retried after 10 ms, doubling
/// up to a second, without spinning; once files are free again the waiting
/// clients are served.
#[test]
fn accept_errors_back_off_without_spinning() {
    let server = Server::start(&[("HEADER_TIMEOUT", "10m")]);
    let clients = Clients::of(&server);
    let pid = server.pid();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    set_open_files(pid, open + 5);
    let flood = clients.silent("127.0.0.1", 30);
    let cpu = cpu_time(pid);
    let first = server
        .logged("cannot accept", Duration::from_secs(2))
        .expect("the server ran out of files");
    assert!(first.contains("Too many open files"), "{first}");
    // 10 + 20 + 40 + ... ms: the 8th retry comes 2.27 s after the first
    // failure (a fixed 100 ms would fail 20 times in 2 s).
    let window = Instant::now();
    let mut failures = 1;
    while let Some(left) = Duration::from_secs(2).checked_sub(window.elapsed()) {
        if server.logged("cannot accept", left).is_some() {
            failures += 1;
        }
    }
    assert!(
        (4..=9).contains(&failures),
        "{failures} failed accepts in 2 s"
    );
    let spent = cpu_time(pid) - cpu;
    assert!(
        spent < Duration::from_millis(300),
        "{spent:?} of CPU in 2 s"
    );

    set_open_files(pid, 4096);
    drop(flood);
    let freed = Instant::now();
    assert_eq!(
        clients.health("127.0.0.2", Duration::from_secs(3)),
        Some(200)
    );
    assert!(
        freed.elapsed() < Duration::from_millis(1500),
        "served {:?} after files were free (the wait is at most 1 s)",
        freed.elapsed()
    );
}

/// Caps that cannot hold are refused at start, naming the variable: a
/// total above what the open-file limit leaves room for, a per-address cap
/// above the total.
#[test]
fn caps_that_cannot_hold_exit_2() {
    let (code, stderr) = refused_by(command(Some(256)), &[("MAX_CONNECTIONS", "1000")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("MAX_CONNECTIONS: 1000 connections cannot be held")
            && stderr.contains("room for 128 connections"),
        "{stderr}"
    );
    let (code, stderr) = refused_by(command(Some(100)), &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("MAX_CONNECTIONS: no connection"),
        "{stderr}"
    );
    let (code, stderr) = refused_by(
        command(None),
        &[("MAX_CONNECTIONS", "10"), ("MAX_CONNECTIONS_PER_IP", "11")],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("MAX_CONNECTIONS_PER_IP: 11 is above"),
        "{stderr}"
    );
}

/// `SIGHUP` (a closed terminal, or `kill -HUP` from an operator expecting
/// a reload) is logged, and the server goes on serving.
#[cfg(unix)]
#[test]
fn sighup_is_logged_and_the_server_keeps_serving() {
    let mut server = Server::start(&[]);
    assert_eq!(server.status(&[]), 200);
    for _ in 0..2 {
        server.signal("HUP");
        let line = server.logged("SIGHUP", Duration::from_secs(5));
        assert!(
            line.is_some_and(|l| l.contains("ignored")),
            "the SIGHUP is logged"
        );
    }
    assert!(server.is_running(), "SIGHUP did not stop the server");
    assert_eq!(server.get("/health", &[]).0, 200);
}
