//! A rate-limited gRPC server: tonic's health service behind the layer.
//!
//! ```sh
//! cargo run --example tonic --features tonic                                  # in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example tonic --features tonic # through Redis
//! ```
//!
//! Each client address may call 5 times per 10 s; the sixth call fails with
//! `RESOURCE_EXHAUSTED`, its retry time in the `retry-after` metadata. Try
//! it with grpcurl:
//!
//! ```sh
//! grpcurl -plaintext -d '{}' 127.0.0.1:50051 grpc.health.v1.Health/Check
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;

use tonic::transport::Server;
use tower_redis_ratelimit::{MemoryStore, Policy, RateLimitLayer, RedisStore, key};

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let bind: SocketAddr = match std::env::var("BIND")
        .as_deref()
        .unwrap_or("127.0.0.1:50051")
        .parse()
    {
        Ok(addr) => addr,
        Err(error) => {
            eprintln!("BIND: {error}");
            return ExitCode::from(2);
        }
    };
    let policy: Policy = match "5/10s".parse() {
        Ok(policy) => policy,
        Err(error) => {
            eprintln!("policy: {error}");
            return ExitCode::from(2);
        }
    };

    // tonic records the peer address (TcpConnectInfo): `peer_ip()` reads it.
    let limiter = match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => match RedisStore::connect(&url).await {
            Ok(store) => RateLimitLayer::new(store, policy, key::peer_ip()),
            Err(error) => {
                eprintln!("REDIS_URL: cannot use Redis: {error}");
                return ExitCode::from(2);
            }
        },
        _ => RateLimitLayer::new(MemoryStore::new(), policy, key::peer_ip()),
    };

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<tonic_health::pb::health_server::HealthServer<
            tonic_health::server::HealthService,
        >>()
        .await;
    tracing::info!("gRPC health service on {bind}, 5 calls per 10 s per client address");
    if let Err(error) = Server::builder()
        .layer(limiter)
        .add_service(health)
        .serve(bind)
        .await
    {
        eprintln!("server error: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
