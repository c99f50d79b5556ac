//! Envoy's rate limit service, measured in one run: decisions per second
//! and latency of `ShouldRateLimit` over gRPC (the service on one core,
//! 50 calls in flight) with 1 and 4 descriptors, in memory and through
//! Redis, beside the crate's HTTP layer making the same decisions; Redis
//! commands and CPU per descriptor beside the reference server's scheme
//! for the same fixed window (`INCRBY` + `EXPIRE` per descriptor,
//! pipelined), and for GCRA; requests per second through a real Envoy
//! with the rate limit filter and without it, and with it asking a stub
//! service that answers `OK` at once (the filter's own cost). Every line
//! `RESULT <name> <value>`. The gRPC load is a lean client over `h2`
//! alone (`Lean`), as the HTTP load is a hand-written HTTP/1.1 client:
//! with tonic's client, the load's core was the limit, not the servers.
//!
//! Kuadrant's Limitador, the Rust server of Envoy's protocol, is measured
//! beside the service when `LIMITADOR` names a `limitador-server` binary
//! (built from its sources; nothing of it is in this repository): one
//! descriptor a call, a fixed window per user at the same max and window
//! (its limits file is [`LIMITADOR_LIMITS`]), 10,000 keys, every call
//! admitted, in memory and on the bench's redis-server, the same load and
//! client (50 calls in flight over one HTTP/2 connection), rounds of the
//! two interleaved (`BENCH_ROUNDS`, default 3): calls/s, p50 and p99 (the
//! median of the rounds), CPU per call of Limitador's process and of the
//! service's runtime thread, on Redis Redis's CPU and commands per call
//! (sums over the rounds), and the ratios crate ÷ Limitador (the median of
//! the rounds'). In memory the stub is measured in the same rounds (its
//! calls/s and CPU a call: the transport's own cost, before any service's
//! work), with `ratio/stub_bound_per_second`, Limitador's CPU a call over
//! the stub's: the most calls/s over Limitador's that a service on this
//! transport could make with its own work free. Without `LIMITADOR` those
//! lines are left out.
//!
//! ```sh
//! cargo bench --features envoy --bench envoy      # starts its own redis-server, and Envoy
//! LIMITADOR=/path/to/limitador-server cargo bench --features envoy --bench envoy
//! ```
//!
//! Settings (environment): `BENCH_SECONDS` (each measurement, default 5),
//! `BENCH_CONCURRENCY` (calls in flight, default 50), `ENVOY` (an envoy
//! binary; default the one `scripts/test` installs into `target/envoy`;
//! without one, the Envoy figures are left out), `LIMITADOR` (a
//! `limitador-server` binary), `BENCH_ROUNDS` (rounds of the service and
//! Limitador, default 3), `BENCH_PARTS` (the parts measured, a
//! comma-separated list of `decisions`, `limitador` and `envoy`; default
//! all).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_redis_ratelimit::envoy::RateLimitService;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService as RateLimitServiceApi, RateLimitServiceServer,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tower_redis_ratelimit::rules::{RuleSet, Rules, RulesLayer};
use tower_redis_ratelimit::{MemoryStore, RedisStore, Store};

#[path = "support/load.rs"]
mod load;
#[path = "support/processes.rs"]
mod processes;
#[path = "support/redis_work.rs"]
mod redis_work;
#[path = "support/setting.rs"]
mod setting;
use load::load;
use processes::{Own, free_port, redis_server, wait_for};
use redis_work::redis_work;
use setting::setting;

/// Keys the load spreads over.
const KEYS: u64 = 10_000;

/// Descriptor rules, and the same limits as HTTP rules (the user's on
/// every path, the other three on `/4`): a fixed window per user and per
/// route, GCRA per tenant and per client, no key near its limit during a
/// run.
const RULES: &str = r#"
[[rules]]
name = "user"
domain = "bench"
descriptor = ["user"]
policy = "100000000/1h"
algorithm = "fixed-window"

[[rules]]
name = "route"
domain = "bench"
descriptor = ["route"]
policy = "100000000/1h"
algorithm = "fixed-window"

[[rules]]
name = "tenant"
domain = "bench"
descriptor = ["tenant"]
policy = "100000000/1h"
algorithm = "gcra"

[[rules]]
name = "client"
domain = "bench"
descriptor = ["client"]
policy = "100000000/1h"
algorithm = "gcra"

[[rules]]
name = "http-user"
key = "header:x-user"
policy = "100000000/1h"
algorithm = "fixed-window"

[[rules]]
name = "http-route"
path = "/4"
key = "header:x-route"
policy = "100000000/1h"
algorithm = "fixed-window"

[[rules]]
name = "http-tenant"
path = "/4"
key = "header:x-tenant"
policy = "100000000/1h"
algorithm = "gcra"

[[rules]]
name = "http-client"
path = "/4"
key = "header:x-client"
policy = "100000000/1h"
algorithm = "gcra"
"#;

/// `descriptors` descriptors for call `n` (1: the user's; 4: user, route,
/// tenant, client).
fn request(n: u64, descriptors: usize) -> RateLimitRequest {
    let one = |key: &str, value: String| RateLimitDescriptor {
        entries: vec![Entry {
            key: key.to_owned(),
            value,
        }],
        ..RateLimitDescriptor::default()
    };
    let k = n % KEYS;
    let all = [
        one("user", format!("u{k}")),
        one("route", format!("/r{}", k % 100)),
        one("tenant", format!("t{}", k % 1000)),
        one("client", format!("c{k}")),
    ];
    RateLimitRequest {
        domain: "bench".to_owned(),
        descriptors: all.into_iter().take(descriptors).collect(),
        hits_addend: 0,
    }
}

/// The id of the calling thread (`/proc/thread-self` links to
/// `<pid>/task/<tid>`).
fn thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Run `serve` on one core: a thread of its own and a current-thread
/// runtime. What it sends (its addresses, its thread's id) is returned.
fn on_one_core<T, Fut>(serve: impl FnOnce(std::sync::mpsc::Sender<T>) -> Fut + Send + 'static) -> T
where
    T: Send + 'static,
    Fut: Future<Output = ()>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(serve(tx));
    });
    rx.recv().unwrap()
}

/// Serve `rules` on one core: the gRPC service and an HTTP app under the
/// rules layer. Their addresses, and the id of the thread that runs both.
fn serve_on_one_core<St: Store>(store: St) -> (SocketAddr, SocketAddr, u32) {
    on_one_core(move |tx| async move {
        let rules = Rules::new(store, RuleSet::from_toml(RULES).unwrap());
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        tx.send((
            grpc.local_addr().unwrap(),
            http.local_addr().unwrap(),
            thread_id(),
        ))
        .unwrap();
        let app = axum::Router::new()
            .fallback(|| async { "ok" })
            .layer(RulesLayer::new(rules.clone()));
        tokio::spawn(async move { axum::serve(http, app).await });
        tonic::transport::Server::builder()
            .add_service(RateLimitService::new(rules).into_server())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc))
            .await
            .unwrap();
    })
}

/// A rate limit service that decides nothing: `OK` at once, to every call.
struct Stub;

#[tonic::async_trait]
impl RateLimitServiceApi for Stub {
    async fn should_rate_limit(
        &self,
        _: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            ..RateLimitResponse::default()
        }))
    }
}

/// Serve [`Stub`] on one core, as [`serve_on_one_core`] serves the rules.
fn stub_on_one_core() -> (SocketAddr, u32) {
    on_one_core(|tx| async move {
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        tx.send((grpc.local_addr().unwrap(), thread_id())).unwrap();
        tonic::transport::Server::builder()
            .add_service(RateLimitServiceServer::new(Stub))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc))
            .await
            .unwrap();
    })
}

/// The stub on `h2` alone, without tonic or hyper: each call's body read,
/// `OK` answered (its prost encoding, then `grpc-status: 0`). What a call
/// costs a server on this machine's HTTP/2 before any framework's work.
fn bare_stub_on_one_core() -> (SocketAddr, u32) {
    on_one_core(|tx| async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        tx.send((listener.local_addr().unwrap(), thread_id()))
            .unwrap();
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            tcp.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let mut connection = h2::server::Builder::new()
                    .initial_window_size(1 << 20)
                    .initial_connection_window_size(1 << 24)
                    .max_concurrent_streams(128)
                    .handshake::<_, bytes::Bytes>(tcp)
                    .await
                    .unwrap();
                while let Some(Ok((request, mut respond))) = connection.accept().await {
                    tokio::spawn(async move {
                        let mut body = request.into_body();
                        while let Some(Ok(chunk)) = body.data().await {
                            let _ = body.flow_control().release_capacity(chunk.len());
                        }
                        let head = http::Response::builder()
                            .header("content-type", "application/grpc")
                            .body(())
                            .unwrap();
                        let Ok(mut send) = respond.send_response(head, false) else {
                            return;
                        };
                        // overall_code OK (field 1, varint 1), framed.
                        let _ = send.send_data(
                            bytes::Bytes::from_static(&[0, 0, 0, 0, 2, 0x08, 0x01]),
                            false,
                        );
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                        let _ = send.send_trailers(trailers);
                    });
                }
            });
        }
    })
}

/// A gRPC client of `ShouldRateLimit` over `h2` alone, as lean as the HTTP
/// load's hand-written HTTP/1.1 client: tonic's own client costs the
/// load's core more a call than either server measured does, so with it a
/// run measures the client. Each call is a stream carrying the request's
/// prost encoding; its answer is read whole, its `grpc-status` checked and
/// its code returned.
#[derive(Clone)]
struct Lean {
    send: h2::client::SendRequest<bytes::Bytes>,
    uri: http::Uri,
}

impl Lean {
    async fn connect(addr: SocketAddr) -> Self {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(1 << 20)
            .initial_connection_window_size(1 << 24)
            .handshake(tcp)
            .await
            .unwrap();
        // (It ends with an error when the server goes first.)
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Self {
            send,
            uri: format!(
                "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
            )
            .parse()
            .unwrap(),
        }
    }

    async fn should_rate_limit(&self, request: RateLimitRequest) -> Code {
        use prost::Message;
        // The gRPC frame: uncompressed, the message's length, the message.
        let mut body = Vec::with_capacity(5 + request.encoded_len());
        body.push(0);
        body.extend(u32::try_from(request.encoded_len()).unwrap().to_be_bytes());
        request.encode(&mut body).unwrap();
        let head = http::Request::post(self.uri.clone())
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let mut send = self.send.clone().ready().await.unwrap();
        let (answer, mut stream) = send.send_request(head, false).unwrap();
        stream.send_data(body.into(), true).unwrap();
        let answer = answer.await.unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK);
        let mut body = answer.into_body();
        let mut data = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.unwrap().unwrap_or_default();
        assert_eq!(
            trailers.get("grpc-status").map(|status| status.as_bytes()),
            Some(&b"0"[..]),
            "{trailers:?}"
        );
        let answer = RateLimitResponse::decode(data.get(5..).unwrap()).unwrap();
        Code::try_from(answer.overall_code).unwrap()
    }
}

/// One HTTP/1.1 keep-alive connection per task, reading whole answers.
struct Http {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Http {
    async fn connect(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: Vec::with_capacity(4096),
        }
    }

    /// `GET path` with `headers`; the status.
    async fn get(&mut self, path: &str, headers: &str) -> u16 {
        let request = format!("GET {path} HTTP/1.1\r\nHost: b\r\n{headers}\r\n");
        self.stream.write_all(request.as_bytes()).await.unwrap();
        self.buf.clear();
        loop {
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed");
            self.buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&self.buf);
            let Some(end) = text.find("\r\n\r\n") else {
                continue;
            };
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if self.buf.len() >= end + 4 + length {
                return text[9..12].parse().unwrap();
            }
        }
    }
}

/// [`load`] of `GET`s to `addr`, each task on a keep-alive connection of
/// its own; `request(n)` gives call `n`'s path and header lines.
async fn http_load(
    addr: SocketAddr,
    seconds: Duration,
    concurrency: usize,
    request: impl Fn(u64) -> (&'static str, String) + Clone + Send + Sync + 'static,
) -> (f64, f64, f64) {
    let connections: Vec<_> =
        futures_util::future::join_all((0..concurrency).map(|_| Http::connect(addr)))
            .await
            .into_iter()
            .map(|c| Arc::new(tokio::sync::Mutex::new(c)))
            .collect();
    let next = Arc::new(AtomicU64::new(0));
    load(seconds, concurrency, move |n| {
        let connection = Arc::clone(
            &connections[next.fetch_add(1, Ordering::Relaxed) as usize % connections.len()],
        );
        let (path, headers) = request(n);
        async move {
            let status = connection.lock().await.get(path, &headers).await;
            assert_eq!(status, 200);
        }
    })
    .await
}

fn http_headers(n: u64, descriptors: usize) -> String {
    let k = n % KEYS;
    let all = [
        format!("x-user: u{k}\r\n"),
        format!("x-route: /r{}\r\n", k % 100),
        format!("x-tenant: t{}\r\n", k % 1000),
        format!("x-client: c{k}\r\n"),
    ];
    all.into_iter().take(descriptors).collect()
}

async fn decisions(
    name: &str,
    grpc: SocketAddr,
    http: SocketAddr,
    seconds: Duration,
    concurrency: usize,
) {
    let client = Lean::connect(grpc).await;
    for descriptors in [1, 4] {
        let (rate, p50, p99) = load(seconds, concurrency, {
            let client = client.clone();
            move |n| {
                let client = client.clone();
                async move {
                    client.should_rate_limit(request(n, descriptors)).await;
                }
            }
        })
        .await;
        println!("RESULT envoy/{name}/grpc/{descriptors}/per_second {rate:.0}");
        println!("RESULT envoy/{name}/grpc/{descriptors}/p50_us {p50:.0}");
        println!("RESULT envoy/{name}/grpc/{descriptors}/p99_us {p99:.0}");
        // The HTTP layer. The user's rule matches every path, the other
        // three `/4`.
        let path = if descriptors == 4 { "/4" } else { "/1" };
        let (rate, p50, p99) = http_load(http, seconds, concurrency, move |n| {
            (path, http_headers(n, descriptors))
        })
        .await;
        println!("RESULT envoy/{name}/http/{descriptors}/per_second {rate:.0}");
        println!("RESULT envoy/{name}/http/{descriptors}/p50_us {p50:.0}");
        println!("RESULT envoy/{name}/http/{descriptors}/p99_us {p99:.0}");
    }
}

/// Redis CPU and commands per descriptor: this service's fixed window and
/// GCRA (1 descriptor a call), and the reference server's scheme replayed
/// (`INCRBY key 1` + `EXPIRE key 3600`, pipelined, per descriptor).
async fn redis_per_descriptor(url: &str, grpc: SocketAddr, seconds: Duration, concurrency: usize) {
    let client = redis::Client::open(url).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let service = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    for (name, key) in [("fixed-window", "user"), ("gcra", "tenant")] {
        let before = redis_work(&mut admin).await;
        let (rate, _, _) = load(seconds, concurrency, {
            let service = service.clone();
            move |n| {
                let mut service = service.clone();
                async move {
                    let mut one = request(n, 4);
                    one.descriptors.retain(|d| d.entries[0].key == key);
                    service.should_rate_limit(one).await.unwrap();
                }
            }
        })
        .await;
        let after = redis_work(&mut admin).await;
        let decided = rate * seconds.as_secs_f64();
        println!(
            "RESULT envoy/redis/{name}/cpu_us_per_descriptor {:.2}",
            (after.0 - before.0) / decided
        );
        println!(
            "RESULT envoy/redis/{name}/commands_per_descriptor {:.2}",
            (after.1 - before.1 - 1.0) / decided
        );
    }
    let connection = client.get_multiplexed_async_connection().await.unwrap();
    let before = redis_work(&mut admin).await;
    let (rate, _, _) = load(seconds, concurrency, move |n| {
        let mut connection = connection.clone();
        async move {
            let window = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                / 3600
                * 3600;
            let key = format!("bench_user_u{}_{window}", n % KEYS);
            let _: (u64, u64) = redis::pipe()
                .cmd("INCRBY")
                .arg(&key)
                .arg(1)
                .cmd("EXPIRE")
                .arg(&key)
                .arg(3600)
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    })
    .await;
    let after = redis_work(&mut admin).await;
    let decided = rate * seconds.as_secs_f64();
    println!(
        "RESULT envoy/redis/reference-scheme/cpu_us_per_descriptor {:.2}",
        (after.0 - before.0) / decided
    );
    println!(
        "RESULT envoy/redis/reference-scheme/commands_per_descriptor {:.2}",
        (after.1 - before.1 - 1.0) / decided
    );
}

/// Limitador's limits: the service's `user` rule (a fixed window of
/// 100,000,000 an hour per user, in the domain `bench`) in its format. Its
/// window starts at a key's first hit, where the rule's starts on the hour.
const LIMITADOR_LIMITS: &str = r#"
- namespace: bench
  name: user
  max_value: 100000000
  seconds: 3600
  conditions: []
  variables:
    - descriptors[0].user
"#;

/// A `limitador-server` of the bench's own: its gRPC address and process
/// id; stopped, and its limits file removed, when dropped.
struct Limitador {
    grpc: SocketAddr,
    pid: u32,
    process: Own,
    dir: std::path::PathBuf,
}

impl Drop for Limitador {
    fn drop(&mut self) {
        let _ = self.process.0.kill();
        let _ = self.process.0.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Start `binary` on loopback with [`LIMITADOR_LIMITS`] and `storage` (its
/// subcommand and arguments: `memory`, or `redis <url>`).
fn limitador(binary: &str, storage: &[&str]) -> Limitador {
    let (rls, http) = (free_port(), free_port());
    // A directory of its own: Limitador watches the limits file's
    // directory, and all below it, for changes.
    let dir = std::env::temp_dir().join(format!("bench-limitador-{rls}"));
    std::fs::create_dir_all(&dir).unwrap();
    let limits = dir.join("limits.yaml");
    std::fs::write(&limits, LIMITADOR_LIMITS).unwrap();
    let child = Command::new(binary)
        .args(["--rls-ip", "127.0.0.1", "--rls-port", &rls.to_string()])
        .args(["--http-ip", "127.0.0.1", "--http-port", &http.to_string()])
        .arg(&limits)
        .args(storage)
        .stdout(Stdio::null())
        .spawn()
        .expect(binary);
    let limitador = Limitador {
        grpc: format!("127.0.0.1:{rls}").parse().unwrap(),
        pid: child.id(),
        process: Own(child),
        dir,
    };
    wait_for(rls);
    limitador
}

/// The clock ticks a second of `/proc`'s CPU times.
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// CPU seconds (user + system) so far of a process (`/proc/<pid>/stat`)
/// or of one thread (`/proc/self/task/<tid>/stat`).
fn cpu_seconds(stat: &str) -> f64 {
    let text = std::fs::read_to_string(stat).unwrap();
    // The fields after the command's name: state is the 3rd, utime the
    // 14th, stime the 15th.
    let fields: Vec<&str> = text[text.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .collect();
    (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / clock_ticks()
}

/// One side's round: calls, calls/s, p50 and p99 µs, CPU s of the server
/// (its process or its runtime thread), and Redis's CPU µs and commands.
#[derive(Clone, Copy, Default)]
struct Round {
    calls: f64,
    rate: f64,
    p50: f64,
    p99: f64,
    cpu: f64,
    redis_cpu: f64,
    redis_commands: f64,
}

/// Call `client` once for every key (one descriptor, the user's), 50 at
/// a time, each call admitted: the counters exist before a round.
async fn each_key_once(
    client: &RateLimitServiceClient<tonic::transport::Channel>,
    concurrency: usize,
) {
    futures_util::future::join_all((0..concurrency as u64).map(|first| {
        let mut client = client.clone();
        async move {
            for n in (first..KEYS).step_by(concurrency) {
                let answer = client.should_rate_limit(request(n, 1)).await.unwrap();
                assert_eq!(answer.into_inner().overall_code, i32::from(Code::Ok));
            }
        }
    }))
    .await;
}

/// One descriptor a call to `client` for `seconds`, with the CPU of
/// `stat` and the work of the Redis `admin` talks to around it.
async fn round(
    client: &Lean,
    stat: &str,
    admin: Option<&mut redis::aio::MultiplexedConnection>,
    seconds: Duration,
    concurrency: usize,
) -> Round {
    let mut admin = admin;
    let before = match admin.as_deref_mut() {
        Some(admin) => redis_work(admin).await,
        None => (0.0, 0.0),
    };
    let cpu = cpu_seconds(stat);
    let (rate, p50, p99) = load(seconds, concurrency, {
        let client = client.clone();
        move |n| {
            let client = client.clone();
            async move {
                assert_eq!(client.should_rate_limit(request(n, 1)).await, Code::Ok);
            }
        }
    })
    .await;
    let cpu = cpu_seconds(stat) - cpu;
    let (redis_cpu, redis_commands) = match admin {
        Some(admin) => {
            let after = redis_work(admin).await;
            (after.0 - before.0, after.1 - before.1 - 1.0)
        }
        None => (0.0, 0.0),
    };
    Round {
        calls: rate * seconds.as_secs_f64(),
        rate,
        p50,
        p99,
        cpu,
        redis_cpu,
        redis_commands,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The service (its gRPC address and runtime thread) beside Limitador
/// (`binary`), both in memory or both on the Redis at `redis_url`, rounds
/// interleaved.
#[allow(clippy::too_many_arguments)]
async fn beside_limitador(
    name: &str,
    (grpc, thread): (SocketAddr, u32),
    stub: Option<(SocketAddr, u32)>,
    bare: Option<(SocketAddr, u32)>,
    binary: &str,
    redis_url: Option<&str>,
    rounds: usize,
    seconds: Duration,
    concurrency: usize,
) {
    let peer = match redis_url {
        Some(url) => limitador(binary, &["redis", url]),
        None => limitador(binary, &["memory"]),
    };
    let mut admin = match redis_url {
        Some(url) => Some(
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        ),
        None => None,
    };
    let ours = RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let theirs = RateLimitServiceClient::connect(format!("http://{}", peer.grpc))
        .await
        .unwrap();
    each_key_once(&ours, concurrency).await;
    each_key_once(&theirs, concurrency).await;
    let (ours, theirs) = (Lean::connect(grpc).await, Lean::connect(peer.grpc).await);
    let (our_stat, their_stat) = (
        format!("/proc/self/task/{thread}/stat"),
        format!("/proc/{}/stat", peer.pid),
    );
    // The stubs, deciding nothing (on tonic, as the service; on h2
    // alone): what a call costs before any service's own work. Each with
    // its side of the rounds.
    let mut stubs = Vec::new();
    for (side, stub) in [(2, stub), (3, bare)] {
        if let Some((addr, thread)) = stub {
            stubs.push((
                side,
                Lean::connect(addr).await,
                format!("/proc/self/task/{thread}/stat"),
            ));
        }
    }
    let mut sides: [Vec<Round>; 4] = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for r in 1..=rounds {
        for (side, client, stat) in [(0, &ours, &our_stat), (1, &theirs, &their_stat)] {
            let one = round(client, stat, admin.as_mut(), seconds, concurrency).await;
            sides[side].push(one);
        }
        for (side, client, stat) in &stubs {
            sides[*side].push(round(client, stat, None, seconds, concurrency).await);
        }
        let (o, t) = (sides[0][r - 1], sides[1][r - 1]);
        eprintln!(
            "envoy/limitador/{name} round {r}/{rounds}: crate {:.0} calls/s, p99 {:.0} µs; \
             Limitador {:.0} calls/s, p99 {:.0} µs",
            o.rate, o.p99, t.rate, t.p99
        );
    }
    let on_redis = redis_url.is_some();
    for (side, who) in [
        (0, "crate"),
        (1, "limitador"),
        (2, "stub"),
        (3, "bare_stub"),
    ] {
        let all = &sides[side];
        if all.is_empty() {
            continue;
        }
        let of = |f: fn(&Round) -> f64| median(all.iter().map(f).collect());
        let sum = |f: fn(&Round) -> f64| all.iter().map(f).sum::<f64>();
        let calls = sum(|r| r.calls);
        println!(
            "RESULT envoy/limitador/{name}/{who}/per_second {:.0}",
            of(|r| r.rate)
        );
        println!(
            "RESULT envoy/limitador/{name}/{who}/p50_us {:.0}",
            of(|r| r.p50)
        );
        println!(
            "RESULT envoy/limitador/{name}/{who}/p99_us {:.0}",
            of(|r| r.p99)
        );
        println!(
            "RESULT envoy/limitador/{name}/{who}/cpu_us_per_call {:.2}",
            sum(|r| r.cpu) * 1e6 / calls
        );
        if on_redis {
            println!(
                "RESULT envoy/limitador/{name}/{who}/redis_cpu_us_per_call {:.2}",
                sum(|r| r.redis_cpu) / calls
            );
            println!(
                "RESULT envoy/limitador/{name}/{who}/redis_commands_per_call {:.2}",
                sum(|r| r.redis_commands) / calls
            );
        }
    }
    // Crate ÷ Limitador, round by round (each pair ran back to back).
    let ratio = |f: fn(&Round) -> f64| {
        median(
            sides[0]
                .iter()
                .zip(&sides[1])
                .map(|(o, t)| f(o) / f(t))
                .collect(),
        )
    };
    println!(
        "RESULT envoy/limitador/{name}/ratio/per_second {:.2}",
        ratio(|r| r.rate)
    );
    println!(
        "RESULT envoy/limitador/{name}/ratio/p99_us {:.2}",
        ratio(|r| r.p99)
    );
    println!(
        "RESULT envoy/limitador/{name}/ratio/cpu_us_per_call {:.2}",
        ratio(|r| r.cpu / r.calls)
    );
    // Limitador's CPU a call over a stub's, round by round: the most
    // calls/s (over Limitador's) a service on the stub's transport (tonic;
    // h2 alone) could make on a saturated core if its own work cost
    // nothing.
    for (side, stub) in [(2, "stub"), (3, "bare_stub")] {
        if sides[side].is_empty() {
            continue;
        }
        let bound = median(
            sides[1]
                .iter()
                .zip(&sides[side])
                .map(|(t, stub)| (t.cpu / t.calls) / (stub.cpu / stub.calls))
                .collect(),
        );
        println!("RESULT envoy/limitador/{name}/ratio/{stub}_bound_per_second {bound:.2}");
    }
    if on_redis {
        println!(
            "RESULT envoy/limitador/{name}/ratio/redis_cpu_us_per_call {:.2}",
            ratio(|r| r.redis_cpu / r.calls)
        );
    }
}

/// Requests per second through Envoy without the rate limit filter, and
/// with it asking each of `services` (a name, its gRPC address).
async fn through_envoy(services: &[(&str, SocketAddr)], seconds: Duration, concurrency: usize) {
    let envoy = std::env::var("ENVOY")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/target/envoy/envoy/_bin/envoy").to_owned()
        });
    if !std::path::Path::new(&envoy).exists() {
        eprintln!("no envoy at {envoy}: the Envoy figures are left out (scripts/test installs it)");
        return;
    }
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_port = upstream.local_addr().unwrap().port();
    tokio::spawn(async move {
        axum::serve(upstream, axum::Router::new().fallback(|| async { "hello" })).await
    });
    let guide = include_str!("../src/docs/guide/envoy.md");
    let start = guide.find("static_resources:").unwrap();
    let end = start + guide[start..].find("```").unwrap();
    let without = std::iter::once(("without-filter", None));
    for (name, grpc) in without.chain(services.iter().map(|&(n, a)| (n, Some(a)))) {
        let port = free_port();
        let mut bootstrap = guide[start..end]
            .replace("port_value: 10000", &format!("port_value: {port}"))
            .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
            .replace(
                "port_value: 8081",
                &format!("port_value: {}", grpc.map_or(0, |g| g.port())),
            )
            // The bench's own domain and a limit no client reaches.
            .replace("domain: edge", "domain: bench")
            .replace("descriptor_key: api_key", "descriptor_key: user");
        if grpc.is_none() {
            let from = bootstrap
                .find("          - name: envoy.filters.http.ratelimit")
                .unwrap();
            let to = bootstrap
                .find("          - name: envoy.filters.http.router")
                .unwrap();
            bootstrap.replace_range(from..to, "");
        }
        let path = std::env::temp_dir().join(format!("bench-envoy-{port}.yaml"));
        std::fs::write(&path, bootstrap).unwrap();
        let _envoy = Own(Command::new(&envoy)
            .args(["-c", path.to_str().unwrap(), "--base-id", &port.to_string()])
            .args([
                "--disable-hot-restart",
                "--log-level",
                "error",
                "--concurrency",
                "1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap());
        wait_for(port);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let (rate, p50, p99) = http_load(addr, seconds, concurrency, |n| {
            ("/", format!("x-api-key: u{}\r\n", n % KEYS))
        })
        .await;
        println!("RESULT envoy/end-to-end/{name}/per_second {rate:.0}");
        println!("RESULT envoy/end-to-end/{name}/p50_us {p50:.0}");
        println!("RESULT envoy/end-to-end/{name}/p99_us {p99:.0}");
        let _ = std::fs::remove_file(&path);
    }
}

fn main() {
    // A subscriber that records nothing, as a program with its own would
    // filter: without any, tracing's `log` fallback (the `log` feature
    // axum's defaults turn on) formats every span of h2's, about 12 % of a
    // gRPC call's work on the server.
    tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default()).unwrap();
    let seconds = Duration::from_secs_f64(setting("BENCH_SECONDS", 5.0));
    let concurrency = setting("BENCH_CONCURRENCY", 50.0) as usize;
    let (url, _redis) = redis_server();
    let (memory_grpc, memory_http, memory_thread) = serve_on_one_core(MemoryStore::new());
    let store = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(RedisStore::connect(&url))
        .unwrap();
    let (redis_grpc, redis_http, redis_thread) = serve_on_one_core(store);
    let (stub_grpc, stub_thread) = stub_on_one_core();
    let bare_stub = bare_stub_on_one_core();
    let rounds = setting("BENCH_ROUNDS", 3.0) as usize;
    let limitador_binary = std::env::var("LIMITADOR")
        .ok()
        .filter(|l| !l.is_empty() && std::path::Path::new(l).exists());
    // The load on the other core.
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // The parts measured (`BENCH_PARTS`, a comma-separated list of
    // `decisions`, `limitador` and `envoy`; all of them when unset).
    let parts = std::env::var("BENCH_PARTS")
        .ok()
        .filter(|parts| !parts.is_empty());
    if let Some(parts) = &parts {
        for part in parts.split(',') {
            assert!(
                ["decisions", "limitador", "envoy"].contains(&part.trim()),
                "BENCH_PARTS: no part {part:?} (decisions, limitador, envoy)"
            );
        }
    }
    let part = |name: &str| {
        parts
            .as_deref()
            .is_none_or(|parts| parts.split(',').any(|part| part.trim() == name))
    };
    client.block_on(async {
        if part("decisions") {
            decisions("memory", memory_grpc, memory_http, seconds, concurrency).await;
            decisions("redis", redis_grpc, redis_http, seconds, concurrency).await;
            redis_per_descriptor(&url, redis_grpc, seconds, concurrency).await;
        }
        match &limitador_binary {
            _ if !part("limitador") => {}
            Some(binary) => {
                let (memory, redis) = ((memory_grpc, memory_thread), (redis_grpc, redis_thread));
                let stub = Some((stub_grpc, stub_thread));
                beside_limitador(
                    "memory",
                    memory,
                    stub,
                    Some(bare_stub),
                    binary,
                    None,
                    rounds,
                    seconds,
                    concurrency,
                )
                .await;
                beside_limitador(
                    "redis",
                    redis,
                    None,
                    None,
                    binary,
                    Some(&url),
                    rounds,
                    seconds,
                    concurrency,
                )
                .await;
            }
            None => {
                eprintln!("LIMITADOR names no limitador-server binary: Limitador was not measured")
            }
        }
        let services = [
            ("stub", stub_grpc),
            ("memory", memory_grpc),
            ("redis", redis_grpc),
        ];
        if part("envoy") {
            through_envoy(&services, seconds, concurrency).await;
        }
    });
}
