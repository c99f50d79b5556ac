//! A real PostgreSQL server for one test: Debian's `postgresql` package,
//! a throwaway data directory, a free loopback port.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::proxy::FaultProxy;
use super::server::free_port;
use tower_redis_ratelimit::{Algorithm, Policy};

/// A `postgres` server on a free loopback port, its data in a directory of
/// its own; stopped and removed on drop.
pub struct PostgresServer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    /// Starts so far: each writes a log of its own.
    runs: u32,
    /// Settings given to the server beside the usual ones.
    settings: Vec<String>,
}

impl PostgresServer {
    /// `initdb` a new data directory and start a server on it.
    pub fn start() -> Self {
        Self::start_with(|_| Vec::new())
    }

    /// A server that takes connections over TLS only (plain ones are
    /// refused), presenting `certificate`.
    pub fn start_tls(certificate: &crate::support::tls::Pair) -> Self {
        Self::start_with(|dir| {
            let data = dir.join("data");
            std::fs::write(data.join("server.crt"), &certificate.cert).unwrap();
            let key = data.join("server.key");
            std::fs::write(&key, &certificate.key).unwrap();
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .unwrap();
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .unwrap();
            if let Some((uid, gid)) = as_postgres() {
                for name in ["server.crt", "server.key", "pg_hba.conf"] {
                    std::os::unix::fs::chown(data.join(name), Some(uid), Some(gid)).unwrap();
                }
            }
            [
                "ssl=on",
                "ssl_cert_file=server.crt",
                "ssl_key_file=server.key",
            ]
            .map(str::to_owned)
            .to_vec()
        })
    }

    /// A server whose data directory `prepare` may change after `initdb`
    /// (given the server's directory), started with the settings it
    /// returns.
    fn start_with(prepare: impl FnOnce(&std::path::Path) -> Vec<String>) -> Self {
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pg-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let owner = as_postgres();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        }
        let status = run_as(Command::new(bin("initdb")), owner)
            .args(["-D", "data", "-U", "postgres", "-A", "trust", "--no-sync"])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "initdb in {} failed", dir.display());
        let settings = prepare(&dir);
        let mut server = Self {
            dir,
            port: free_port(),
            child: None,
            runs: 0,
            settings,
        };
        server.run();
        server
    }

    /// The server's connection settings (user `postgres`, database
    /// `postgres`).
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A session of the test's own on the server (the store's are apart),
    /// its connection driven on a task of its own.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
    }

    /// Stop the server (a fast shutdown) and start it again on its data.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// Stop the server: new connections are refused until [`restart`](Self::restart).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGINT: the fast shutdown (open transactions roll back).
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// Start the server on its data and wait until it takes connections.
    fn run(&mut self) {
        self.runs += 1;
        let log = self.dir.join(format!("log-{}", self.runs));
        let log_file = std::fs::File::create(&log).unwrap();
        let owner = as_postgres();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&log, Some(uid), Some(gid)).unwrap();
        }
        let port = self.port.to_string();
        let child = run_as(Command::new(bin("postgres")), owner)
            .args(["-D", "data", "-p", &port, "-k", "."])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "max_connections=200", "-c", "shared_buffers=16MB"])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("ready to accept connections") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not start within 30 s:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGQUIT: the immediate shutdown.
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A PostgreSQL program, from `POSTGRES_BIN` or Debian's newest
/// `/usr/lib/postgresql/<version>/bin`.
fn bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("POSTGRES_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|bin| bin.join("postgres").exists())
                .collect();
            versions.sort();
            versions.pop()
        })
        .unwrap_or_else(|| {
            panic!(
                "PostgreSQL is not installed: the tests start their own server from \
                 Debian's package. Install it ('sudo apt-get install postgresql', which \
                 scripts/test does as root) or set POSTGRES_BIN to a directory holding \
                 initdb and postgres."
            )
        });
    dir.join(name)
}

/// As root (which PostgreSQL refuses to run as), the `postgres` user's ids.
fn as_postgres() -> Option<(u32, u32)> {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !root {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().expect(
            "as root, the tests run PostgreSQL as the user postgres (Debian's package makes it)",
        )
    };
    Some((id("-u"), id("-g")))
}

fn run_as(mut command: Command, owner: Option<(u32, u32)>) -> Command {
    if let Some((uid, gid)) = owner {
        command.uid(uid).gid(gid);
    }
    command
}

/// The settings of a session to the server behind `proxy` (plain: the
/// proxy forwards bytes).
pub fn through(proxy: &FaultProxy) -> String {
    format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        proxy.port()
    )
}

/// Every algorithm that counts a rate, at `max` a minute.
pub fn rate_algorithms(max: u64) -> Vec<Policy> {
    let text = format!("{max}/1min");
    [
        Algorithm::SlidingLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
    ]
    .into_iter()
    .map(|algorithm| {
        text.parse::<Policy>()
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap()
    })
    .collect()
}

/// [`rate_algorithms`] and a concurrency limit of `max`.
pub fn every_algorithm(max: u64) -> Vec<Policy> {
    let mut all = rate_algorithms(max);
    all.push(Policy::concurrency(max).unwrap());
    all
}
