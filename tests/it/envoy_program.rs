//! The ready program, `examples/envoy_rls.rs`, run as a process: the
//! files it reads are bounded in what they expand to (and the library
//! calls behind it are too), it stops within its grace period whatever
//! its clients do, it backs off when file descriptors run out, and it
//! refuses an over-size message as gRPC says.
//!
//! The program's binary is built by `cargo test` (every target); run
//! alone, build it first with `cargo build --all-features --example envoy_rls`.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tower_redis_ratelimit::rules::{MAX_VALUES, RuleSet};

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// The program with `GRPC_BIND=127.0.0.1:0` and nothing else in its
/// environment; with `open_files`, under that limit of open files.
fn command(open_files: Option<u32>) -> Command {
    crate::example_server::program(
        crate::example_server::example_binary("envoy_rls"),
        "GRPC_BIND",
        open_files,
    )
}

/// The running program; killed when dropped.
struct Program {
    child: Child,
    /// Where it serves gRPC.
    addr: String,
    /// Every line it logged, in order.
    log: Mutex<Receiver<String>>,
}

impl Program {
    fn start(vars: &[(&str, &str)]) -> Self {
        Self::spawn(command(None), vars)
    }

    /// Start it under a limit of `open_files` open files.
    fn with_open_files(open_files: u32, vars: &[(&str, &str)]) -> Self {
        Self::spawn(command(Some(open_files)), vars)
    }

    fn spawn(mut command: Command, vars: &[(&str, &str)]) -> Self {
        command
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .envs(vars.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (log_tx, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("rate limit service listening on ").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = addr_tx.send(addr);
                }
                let _ = log_tx.send(line);
            }
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the program says where it listens");
        Self {
            child,
            addr,
            log: Mutex::new(log),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The first line logged from now on that holds `needle`, waiting at
    /// most `within`.
    fn logged(&self, needle: &str, within: Duration) -> Option<String> {
        let log = self.log.lock().unwrap();
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match log.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// Its exit status, if it exits within `within`.
    fn exits_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Send it `SIGTERM`, as an orchestrator stops it.
    fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM");
    }

    async fn client(&self) -> Client {
        RateLimitServiceClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A directory of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("envoy-program-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A request for domain `edge` with one descriptor `api_key=key`.
fn api_key(key: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![rate_limit_descriptor::Entry {
                key: "api_key".to_owned(),
                value: key.to_owned(),
            }],
            ..RateLimitDescriptor::default()
        }],
        hits_addend: 0,
    }
}

/// Whether the program answers `request` over the limit.
async fn over(client: &mut Client, request: RateLimitRequest) -> bool {
    let answer = client.should_rate_limit(request).await.unwrap();
    answer.into_inner().overall_code == Code::OverLimit as i32
}

/// Two calls a minute for each `api_key`, in the reference server's YAML.
const TWO_A_MINUTE: &str = "domain: edge
descriptors:
  - key: api_key
    rate_limit:
      unit: minute
      requests_per_unit: 2
";

/// 190 KB of the reference server's YAML that stands for 9 million
/// descriptors: an anchor of 3,000 aliased 3,000 times.
fn expanding_yaml() -> String {
    let mut text = String::from("domain: edge\ndescriptors:\n  - key: a\n    descriptors: &d\n");
    for i in 0..3000 {
        text += &format!("      - {{key: k, value: v{i}}}\n");
    }
    for i in 0..3000 {
        text += &format!("  - {{key: b{i}, descriptors: *d}}\n");
    }
    text
}

/// The resident memory of `pid`, from `/proc/PID/status`.
fn resident(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Each library call that reads a rule set's text refuses one that
/// expands past the bound, naming it, at once and without the memory the
/// expansion would take.
#[test]
fn a_text_that_expands_past_the_bound_is_refused_naming_it() {
    let bound = format!("{MAX_VALUES} values");
    let yaml = expanding_yaml();
    assert!(yaml.len() < 200_000, "{} bytes", yaml.len());
    let started = Instant::now();
    let error = RuleSet::from_envoy_yaml([("rules.yaml", yaml.as_str())]).unwrap_err();
    assert!(error.to_string().contains(&bound), "{error}");
    assert!(error.to_string().contains("rules.yaml"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));

    let dir = Scratch::new();
    let path = dir.0.join("rules.yml");
    std::fs::write(&path, &yaml).unwrap();
    let error = RuleSet::from_file(&path).unwrap_err();
    assert!(error.to_string().contains(&bound), "{error}");

    // JSON cannot alias, but is held to the same bound.
    let json = format!(
        "{{\"rules\": [], \"x\": [{}]}}",
        vec!["0"; MAX_VALUES].join(",")
    );
    let error = RuleSet::from_json(&json).unwrap_err();
    assert!(error.to_string().contains(&bound), "{error}");
    let error = RuleSet::parse(&json).unwrap_err();
    assert!(error.to_string().contains(&bound), "{error}");
}

/// The expanding file saved over the watched one: refused as a file that
/// does not validate, naming the bound; the program's memory stays small,
/// and the rules in force stay in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expanding_rules_file_is_refused_and_the_rules_in_force_stay() {
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let program = Program::start(&[("RULES", path.to_str().unwrap())]);
    let mut client = program.client().await;
    for _ in 0..2 {
        assert!(!over(&mut client, api_key("a")).await);
    }
    assert!(over(&mut client, api_key("a")).await);

    std::fs::write(&path, expanding_yaml()).unwrap();
    let refused = program
        .logged("rule set rejected", Duration::from_secs(10))
        .expect("the watch refuses the file");
    assert!(
        refused.contains(&format!("{MAX_VALUES} values")),
        "{refused}"
    );
    let memory = resident(program.pid());
    assert!(memory < 200 << 20, "{} MiB resident", memory >> 20);
    for _ in 0..2 {
        assert!(!over(&mut client, api_key("b")).await);
    }
    assert!(over(&mut client, api_key("b")).await);
}

/// A directory holding the expanding file: the program refuses to start,
/// with status 2, naming the bound.
#[test]
fn an_expanding_file_in_the_rules_directory_is_refused_at_start() {
    let dir = Scratch::new();
    std::fs::write(dir.0.join("a.yaml"), expanding_yaml()).unwrap();
    let (status, stderr) =
        crate::example_server::refused_by(command(None), &[("RULES", dir.0.to_str().unwrap())]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(stderr.contains(&format!("{MAX_VALUES} values")), "{stderr}");
}

/// The program's promise: `SIGTERM` stops it within 10 s.
const GRACE: Duration = Duration::from_secs(10);

/// An HTTP/2 connection to `addr` with one call opened and never sent:
/// the preface, empty settings, and the headers of a `ShouldRateLimit`
/// call without its message.
fn idle_call(addr: &str) -> std::net::TcpStream {
    use std::io::Write as _;
    // HPACK, literals without indexing (no Huffman): `:method: POST` and
    // `:scheme: http` from the static table, `:path` and `:authority`
    // under the static table's names, and two new names.
    let literal = |name: &str, value: &str| {
        let mut field = vec![0, u8::try_from(name.len()).unwrap()];
        field.extend(name.as_bytes());
        field.push(u8::try_from(value.len()).unwrap());
        field.extend(value.as_bytes());
        field
    };
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let mut block = vec![0x83, 0x86, 0x04, u8::try_from(path.len()).unwrap()];
    block.extend(path.as_bytes());
    block.extend([0x01, u8::try_from(addr.len()).unwrap()]);
    block.extend(addr.as_bytes());
    block.extend(literal("content-type", "application/grpc"));
    block.extend(literal("te", "trailers"));
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS, empty.
    bytes.extend([0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    // HEADERS on stream 1: END_HEADERS, not END_STREAM.
    let length = u32::try_from(block.len()).unwrap().to_be_bytes();
    bytes.extend(&length[1..]);
    bytes.extend([0x1, 0x4, 0, 0, 0, 1]);
    bytes.extend(block);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(&bytes).unwrap();
    stream
}

/// A connection that never sends a byte, and one whose call never sends
/// its message, do not hold the stop: after `SIGTERM` the program exits 0
/// within its grace period (and a margin for a loaded machine), having
/// said that it closed them.
#[test]
fn sigterm_stops_the_program_within_its_grace_period_whatever_its_clients_do() {
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let mut program = Program::start(&[("RULES", path.to_str().unwrap())]);
    let silent = std::net::TcpStream::connect(&program.addr).unwrap();
    let idle = idle_call(&program.addr);
    // The program has both connections (and the call) before the stop.
    std::thread::sleep(Duration::from_millis(300));
    program.terminate();
    let asked = Instant::now();
    let status = program
        .exits_within(GRACE + Duration::from_secs(5))
        .expect("the program still runs after its grace period");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(asked.elapsed() < GRACE + Duration::from_secs(5));
    drop((silent, idle));
}

/// Out of file descriptors (a limit of 64, and 100 connections that send
/// nothing), the accept loop waits instead of spinning: little CPU over
/// two seconds; once the connections close, the program answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_program_waits_instead_of_spinning() {
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let program = Program::with_open_files(64, &[("RULES", path.to_str().unwrap())]);
    let flood: Vec<_> = (0..100)
        .map(|_| std::net::TcpStream::connect(&program.addr).unwrap())
        .collect();
    let pid = program.pid();
    let open = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let flooded = Instant::now();
    while open() < 64 {
        assert!(
            flooded.elapsed() < Duration::from_secs(5),
            "{} files open",
            open()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let cpu = crate::hostile_clients::cpu_time(pid);
    std::thread::sleep(Duration::from_secs(2));
    let spent = crate::hostile_clients::cpu_time(pid) - cpu;
    // Spinning, it took 1.4 s to 2.6 s of every 3 s.
    assert!(
        spent < Duration::from_millis(500),
        "{spent:?} of CPU in 2 s"
    );
    let said = program
        .logged("cannot accept", Duration::from_secs(1))
        .expect("the program says it cannot accept");
    assert!(said.contains("Too many open files"), "{said}");
    drop(flood);
    // The longest wait between two accepts is a second.
    let freed = Instant::now();
    let mut client = loop {
        let connected = RateLimitServiceClient::connect(format!("http://{}", program.addr));
        if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(2), connected).await {
            break client;
        }
        assert!(freed.elapsed() < Duration::from_secs(10), "still refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!over(&mut client, api_key("a")).await);
}

/// A message over 64 KiB (70,000 bytes) is refused with
/// `RESOURCE_EXHAUSTED`, as gRPC says of a message over the size limit
/// (tonic alone answers `OUT_OF_RANGE`); the program serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_64_kib_is_refused_with_resource_exhausted() {
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let program = Program::start(&[("RULES", path.to_str().unwrap())]);
    let mut client = program.client().await;
    let refused = client
        .should_rate_limit(api_key(&"v".repeat(70_000)))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(!over(&mut client, api_key("a")).await);
}

/// The keys the program counted in, on `nodes`.
fn keys_on(nodes: &[&crate::support::RedisServer]) -> u64 {
    nodes
        .iter()
        .map(|node| {
            node.command(&["DBSIZE"])
                .trim()
                .trim_start_matches(':')
                .parse::<u64>()
                .unwrap()
        })
        .sum()
}

/// Two calls a minute, then over the limit, counted in Redis.
async fn counts_two_a_minute(program: &Program) {
    let mut client = program.client().await;
    for _ in 0..2 {
        assert!(!over(&mut client, api_key("a")).await);
    }
    assert!(over(&mut client, api_key("a")).await);
}

/// `REDIS_CLUSTER`, the seed nodes of the 3-master cluster: the program
/// counts there.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_program_counts_in_a_redis_cluster() {
    let cluster = crate::support::RedisCluster::start();
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let nodes = cluster.urls().join(",");
    let program = Program::start(&[("RULES", path.to_str().unwrap()), ("REDIS_CLUSTER", &nodes)]);
    counts_two_a_minute(&program).await;
    assert!(keys_on(&cluster.nodes().iter().collect::<Vec<_>>()) > 0);
}

/// `REDIS_URL=redis+sentinel://…/mymaster`: the program counts on the
/// primary the Sentinels name.
#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_program_counts_on_the_primary_sentinels_name() {
    let _slot = crate::support::sentinel::one_of_three().await;
    let deployment = crate::support::sentinel::Deployment::start();
    let dir = Scratch::new();
    let path = dir.0.join("rules.yaml");
    std::fs::write(&path, TWO_A_MINUTE).unwrap();
    let program = Program::start(&[
        ("RULES", path.to_str().unwrap()),
        ("REDIS_URL", &deployment.url()),
    ]);
    counts_two_a_minute(&program).await;
    assert!(keys_on(&[&deployment.primary]) > 0);
}

/// A cluster and a single node at once, or a rule set followed in Redis
/// through a cluster, are refused with status 2, naming the variable.
#[test]
fn redis_settings_that_cannot_work_together_are_refused() {
    for (vars, named) in [
        (
            &[
                ("RULES", "rules.yaml"),
                ("REDIS_URL", "redis://127.0.0.1:1"),
                ("REDIS_CLUSTER", "redis://127.0.0.1:2"),
            ][..],
            "REDIS_CLUSTER:",
        ),
        (
            &[("RULES", "rules.yaml"), ("REDIS_CLUSTER", " , ")][..],
            "REDIS_CLUSTER:",
        ),
        (
            &[("RULES", "redis"), ("REDIS_CLUSTER", "redis://127.0.0.1:2")][..],
            "RULES:",
        ),
    ] {
        let (status, stderr) = crate::example_server::refused_by(command(None), vars);
        assert_eq!(status, Some(2), "{vars:?}: {stderr}");
        assert!(stderr.starts_with(named), "{vars:?}: {stderr}");
    }
}
