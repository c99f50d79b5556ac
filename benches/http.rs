//! Requests per second of one axum server answering `hello`, without a
//! layer, behind tower_governor (without and with its headers) and behind
//! this crate's layer with `MemoryStore` (GCRA, fixed window, sliding log;
//! the default `X-RateLimit-*` headers), keyed by the `x-key` header (10,000
//! keys at random, `benches/keys.lua`), under a limit no key reaches: 1,000
//! a second per key (each key sees about 5 a second), on both layers.
//!
//! ```sh
//! cargo bench --bench http            # needs wrk (apt-get install wrk)
//! HTTP_ROUNDS=7 HTTP_SECONDS=5 cargo bench --bench http
//! ```
//!
//! Each server is this binary in a process of its own (`http serve <case>
//! <port>`), driven by `wrk -t1 -c50` on the same machine. The cases run in
//! a shuffled order in every round; a case's figure is the median over the
//! rounds of its requests per second over the same round's server without
//! a layer (the machines are shared and noisy: only ratios taken side by
//! side mean anything). The server's CPU per request (user + system, from
//! `/proc`) is printed too, and what each case adds to it over the same
//! round's server without a layer. The last lines hold the targets of
//! issue 25.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::routing::get;
use governor::middleware::NoOpMiddleware;
use http::Request;
use tower_governor::GovernorLayer;
use tower_governor::errors::GovernorError;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, key};

const CASES: [&str; 6] = [
    "off",
    "tower_governor",
    "tower_governor+headers",
    "gcra",
    "fixed-window",
    "sliding-log",
];

/// tower_governor's key: the `x-key` header, as `key::header("x-key")`.
#[derive(Clone)]
struct HeaderKey;

impl KeyExtractor for HeaderKey {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<Self::Key, GovernorError> {
        req.headers()
            .get("x-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

fn app(case: &str) -> Router {
    let ours = |policy: Policy| {
        hello().layer(RateLimitLayer::new(
            MemoryStore::new(),
            policy,
            key::header("x-key"),
        ))
    };
    let generous: Policy = "1000/s".parse().unwrap();
    match case {
        "off" => hello(),
        "tower_governor" => {
            let config = GovernorConfigBuilder::default()
                .per_millisecond(1)
                .burst_size(1_000)
                .key_extractor(HeaderKey)
                .finish()
                .unwrap();
            hello().layer(GovernorLayer::<HeaderKey, NoOpMiddleware, _>::new(config))
        }
        "tower_governor+headers" => {
            let config = GovernorConfigBuilder::default()
                .per_millisecond(1)
                .burst_size(1_000)
                .key_extractor(HeaderKey)
                .use_headers()
                .finish()
                .unwrap();
            hello().layer(GovernorLayer::new(config))
        }
        "gcra" => ours(generous.gcra().unwrap()),
        "fixed-window" => ours(generous.fixed_window().unwrap()),
        "sliding-log" => ours(generous),
        other => panic!("no case {other}"),
    }
}

fn serve(case: &str, port: u16) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        axum::serve(listener, app(case)).await.unwrap();
    });
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(case: &str) -> (Server, u16) {
    let port = free_port();
    // Killed and waited for on drop, whatever happens next.
    let server = Server(
        Command::new(std::env::current_exe().unwrap())
            .args(["serve", case, &port.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    for _ in 0..500 {
        if TcpStream::connect(addr).is_ok() {
            return (server, port);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the {case} server did not listen on {port}");
}

/// CPU seconds (user + system) process `pid` has used.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name (which is in parentheses).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

/// Requests per second of one wrk run.
fn wrk(port: u16, seconds: u64) -> f64 {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/keys.lua");
    let out = Command::new("wrk")
        .args(["-t1", "-c50", &format!("-d{seconds}s"), "-s"])
        .arg(&script)
        .arg(format!("http://127.0.0.1:{port}/"))
        .output()
        .unwrap_or_else(|e| panic!("wrk: {e} (install it: apt-get install wrk)"));
    let text = String::from_utf8_lossy(&out.stdout);
    if let Some(line) = text.lines().find(|l| l.contains("Non-2xx")) {
        eprintln!("wrk on port {port}: {}", line.trim());
    }
    text.lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Requests/sec in wrk's output:\n{text}"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        serve(&args[2], args[3].parse().unwrap());
        return;
    }
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let rounds = env("HTTP_ROUNDS", 5);
    let seconds = env("HTTP_SECONDS", 4);
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut rps: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut cpus: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut cpu_added: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    for round in 0..rounds {
        // Fisher-Yates with a xorshift: a new order every round.
        let mut order: Vec<usize> = (0..CASES.len()).collect();
        for i in (1..order.len()).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            order.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        let mut this = vec![0.0; CASES.len()];
        let mut cpu = vec![0.0; CASES.len()];
        for &i in &order {
            let (server, port) = start(CASES[i]);
            wrk(port, 1); // warm up: connections, the store's keys
            let before = cpu_seconds(server.0.id());
            this[i] = wrk(port, seconds);
            let used = cpu_seconds(server.0.id()) - before;
            cpu[i] = used * 1e6 / (this[i] * seconds as f64);
            eprintln!(
                "http round {}: {} {:.0} requests/s, {:.1} µs of server CPU per request",
                round + 1,
                CASES[i],
                this[i],
                cpu[i]
            );
        }
        for i in 0..CASES.len() {
            rps[i].push(this[i]);
            ratios[i].push(this[i] / this[0]);
            cpus[i].push(cpu[i]);
            cpu_added[i].push(cpu[i] - cpu[0]);
        }
    }
    println!("case,requests_per_second,ratio_to_off,server_cpu_us_per_request,added_cpu_us");
    let figure: Vec<f64> = ratios.iter().map(|r| median(r.clone())).collect();
    for (i, case) in CASES.iter().enumerate() {
        println!(
            "{case},{:.0},{:.3},{:.2},{:.2}",
            median(rps[i].clone()),
            figure[i],
            median(cpus[i].clone()),
            median(cpu_added[i].clone())
        );
    }
    let best_peer = figure[1].max(figure[2]);
    for (i, case) in CASES.iter().enumerate().skip(3) {
        println!(
            "target,{case}: {:.3}x the server without a layer (>= 0.95: {}), {:.3}x the better tower_governor (>= 1: {})",
            figure[i],
            if figure[i] >= 0.95 { "met" } else { "not met" },
            figure[i] / best_peer,
            if figure[i] >= best_peer {
                "met"
            } else {
                "not met"
            },
        );
    }
}
