//! What `examples/ai_gateway` costs per request: the program with the
//! budgets of a key, user, team and organisation (requests, tokens and
//! money, all five rules checked and settled for every request), in memory
//! and on the bench's redis-server, beside the same program with no rule
//! at all (the proxy alone), in front of an upstream that answers a chat
//! completion at once. One run, the variants' rounds interleaved:
//! requests/s, p50 and p99, and each as a ratio to the proxy alone.
//!
//! ```sh
//! cargo build --release --all-features --example ai_gateway
//! cargo bench --all-features --bench ai_gateway
//! BENCH_SECONDS=5 BENCH_ROUNDS=5 BENCH_CONCURRENCY=50 cargo bench --all-features --bench ai_gateway
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

#[path = "support/load.rs"]
mod load;
#[path = "support/processes.rs"]
mod processes;
#[path = "support/redis_work.rs"]
mod redis_work;
#[path = "support/setting.rs"]
mod setting;
use load::load;
use processes::{Own, redis_server};
use redis_work::redis_work;
use setting::setting;

/// The keys the load spreads over: 10 teams of 10.
const KEYS: usize = 100;

/// The budgets, far above what the bench spends: every request is
/// checked and settled by all five, none refused.
const LIMITS: &str = r#"
[catalog]
currency = "USD"
[catalog.models."gpt-4o-mini"]
input = 150_000
output = 600_000

[[rules]]
name = "key-requests"
key = "header:x-gateway-key"
policy = "100000000/min"
algorithm = "gcra"

[[rules]]
name = "key-tokens"
key = "header:x-gateway-key"
policy = "100000000000 tokens/min"
algorithm = "gcra"

[[rules]]
name = "user-spend"
key = "header:x-gateway-user"
policy = "1000000 USD/month"
algorithm = "fixed-window"
notify = [80, 100]

[[rules]]
name = "team-spend"
key = "header:x-gateway-team"
policy = "1000000 USD/month"
algorithm = "fixed-window"
notify = [50, 80, 95, 100]

[[rules]]
name = "org-spend"
key = "header:x-gateway-org"
policy = "1000000 USD/month"
algorithm = "fixed-window"
notify = [50, 80, 95, 100]
"#;

/// The proxy alone: the catalog, no rule.
const NONE: &str =
    "[catalog]\ncurrency = \"USD\"\n[catalog.models.\"gpt-4o-mini\"]\ninput = 1\noutput = 1\n";

/// The answer of the upstream: a chat completion with its usage.
const ANSWER: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"w0 w1 w2 w3"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16}}"#;

/// The request every call sends.
const REQUEST: &str = r#"{"model":"gpt-4o-mini","max_tokens":16,"messages":[{"role":"user","content":"Write one line about budgets, please."}]}"#;

/// An upstream on its own thread that answers at once.
fn upstream() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let app = Router::new().route(
                "/v1/chat/completions",
                post(|| async { ([("content-type", "application/json")], ANSWER) }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// The release binary of the program.
fn program() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let release = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let binary = release.join("examples").join("ai_gateway");
    assert!(
        binary.exists(),
        "{} is missing: cargo build --release --all-features --example ai_gateway",
        binary.display()
    );
    binary
}

/// The program on a free port with `rules` and `store`; where it listens.
fn gateway(
    dir: &std::path::Path,
    name: &str,
    rules: &str,
    upstream: SocketAddr,
    store: Option<&str>,
) -> (SocketAddr, Own) {
    let rules_path = dir.join(format!("{name}.toml"));
    std::fs::write(&rules_path, rules).unwrap();
    let mut command = Command::new(program());
    command
        .env_clear()
        .env("BIND", "127.0.0.1:0")
        .env("RUST_LOG", "warn,ai_gateway=info")
        .env("RULES", &rules_path)
        .env("KEYS", dir.join("keys.toml"))
        .env("UPSTREAM_URL", format!("http://{upstream}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(url) = store {
        command.env("REDIS_URL", url);
    }
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the gateway listens");
    (addr.parse().unwrap(), Own(child))
}

/// Requests from `concurrency` tasks for `seconds`, each with a key of
/// its own in turn: requests/s, p50 and p99 in µs.
async fn requests(addr: SocketAddr, seconds: Duration, concurrency: usize) -> (f64, f64, f64) {
    let client: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let url: http::Uri = format!("http://{addr}/v1/chat/completions")
        .parse()
        .unwrap();
    load(seconds, concurrency, move |n| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let request = http::Request::post(url)
                .header(
                    "authorization",
                    format!("Bearer sk-bench-key-{:04}", n as usize % KEYS),
                )
                .header("content-type", "application/json")
                .body(Body::from(REQUEST))
                .unwrap();
            let response = client.request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            response.into_body().collect().await.unwrap();
        }
    })
    .await
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let seconds = Duration::from_secs_f64(setting("BENCH_SECONDS", 4.0));
    let rounds = setting("BENCH_ROUNDS", 3.0) as usize;
    let concurrency = setting("BENCH_CONCURRENCY", 50.0) as usize;
    let dir = std::env::temp_dir().join(format!("ai-gateway-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut keys = String::new();
    for n in 0..KEYS {
        keys.push_str(&format!(
            "[keys.\"sk-bench-key-{n:04}\"]\nname = \"key-{n}\"\nuser = \"user-{n}\"\nteam = \"team-{}\"\norg = \"acme\"\n",
            n / 10
        ));
    }
    std::fs::write(dir.join("keys.toml"), keys).unwrap();
    let (redis, _redis) = redis_server();
    let upstream = upstream();
    let variants = [
        (
            "the proxy alone (no rule)",
            gateway(&dir, "none", NONE, upstream, None),
        ),
        (
            "5 rules, in memory",
            gateway(&dir, "memory", LIMITS, upstream, None),
        ),
        (
            "5 rules, on Redis",
            gateway(&dir, "redis", LIMITS, upstream, Some(&redis)),
        ),
    ];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut figures: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); variants.len()];
    // Redis's work during the Redis variant's rounds, and its requests.
    let (mut redis_cpu, mut redis_commands, mut redis_requests) = (0.0, 0.0, 0.0);
    runtime.block_on(async {
        let mut connection = redis::Client::open(redis.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        // Warm: every key once through each, connections opened.
        for (_, (addr, _)) in &variants {
            requests(*addr, Duration::from_millis(500), concurrency).await;
        }
        for round in 0..rounds {
            for (i, (name, (addr, _))) in variants.iter().enumerate() {
                let before = redis_work(&mut connection).await;
                let (rps, p50, p99) = requests(*addr, seconds, concurrency).await;
                // The settlements of the last requests land after the load.
                tokio::time::sleep(Duration::from_millis(200)).await;
                if i == 2 {
                    let after = redis_work(&mut connection).await;
                    redis_cpu += after.0 - before.0;
                    redis_commands += after.1 - before.1 - 1.0;
                    redis_requests += rps * seconds.as_secs_f64();
                }
                eprintln!(
                    "round {round}: {name}: {rps:.0} requests/s, p50 {p50:.0} µs, p99 {p99:.0} µs"
                );
                figures[i].push((rps, p50, p99));
            }
        }
    });
    let alone = &figures[0];
    println!(
        "\n| {} rounds × {:?}, {concurrency} in flight, {KEYS} keys | requests/s | p50 µs | p99 µs | requests/s ÷ alone (median of rounds) | p99 ÷ alone |",
        rounds, seconds
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (i, (name, _)) in variants.iter().enumerate() {
        let f = &figures[i];
        let ratio = median(f.iter().zip(alone).map(|(a, b)| a.0 / b.0).collect());
        let p99_ratio = median(f.iter().zip(alone).map(|(a, b)| a.2 / b.2).collect());
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {ratio:.2} | {p99_ratio:.2} |",
            median(f.iter().map(|x| x.0).collect()),
            median(f.iter().map(|x| x.1).collect()),
            median(f.iter().map(|x| x.2).collect()),
        );
    }
    if std::env::var_os("BENCH_COMMANDSTATS").is_some() {
        runtime.block_on(async {
            let mut connection = redis::Client::open(redis.as_str())
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let stats: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut connection)
                .await
                .unwrap();
            eprintln!("{stats}");
        });
    }
    println!(
        "\nOn Redis, per request (5 rules checked, 4 settled): {:.1} commands, {:.1} µs of Redis CPU",
        redis_commands / redis_requests,
        redis_cpu / redis_requests
    );
    let _ = std::fs::remove_dir_all(&dir);
}
