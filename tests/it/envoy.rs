//! Envoy's rate limit service (`envoy::RateLimitService`), over gRPC
//! against a real Redis: the reference server's YAML answered as it
//! answers (limits, nested and wildcard descriptors, unlimited, shadow,
//! replaces, unknown domains), the crate's own descriptor rules, the
//! protocol's costs and overrides, bad input, faults; and through a real
//! Envoy with the guide's bootstrap and the ready program.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tower_redis_ratelimit::envoy::RateLimitService;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::google::protobuf::UInt64Value;
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{FailMode, RedisStore};

use crate::support::RedisServer;
use crate::support::harness::away_from_a_boundary;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// The service over `rules`, on a port of its own, and a client of it.
pub(crate) async fn serve(rules: Rules) -> Client {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimitService::new(rules).into_server())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

pub(crate) fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| rate_limit_descriptor::Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(client: &mut Client, request: RateLimitRequest) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .unwrap()
        .into_inner()
}

pub(crate) fn over(response: &RateLimitResponse) -> bool {
    response.overall_code == Code::OverLimit as i32
}

fn header<'a>(response: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    response
        .response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

const REFERENCE: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit:
      unit: minute
      requests_per_unit: 3
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit:
          unit: minute
          requests_per_unit: 2
  - key: path
    value: /api/*
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: path
    value: /health
    rate_limit:
      unlimited: true
  - key: trial
    shadow_mode: true
    rate_limit:
      unit: minute
      requests_per_unit: 1
  - key: plan
    value: gold
    rate_limit:
      name: gold
      unit: minute
      requests_per_unit: 100
      replaces:
        - name: standard
  - key: plan
    rate_limit:
      name: standard
      unit: minute
      requests_per_unit: 1
"#;

async fn reference_service(server: &RedisServer) -> Client {
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let set = RuleSet::from_envoy_yaml([("config.yaml", REFERENCE)]).unwrap();
    serve(Rules::new(store, set)).await
}

#[tokio::test]
async fn the_reference_yaml_limits_as_the_reference_server_does() {
    let server = RedisServer::start();
    let mut client = reference_service(&server).await;
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
    let by_address = || request("edge", vec![descriptor(&[("remote_address", "10.0.0.1")])]);
    for remaining in [2, 1, 0] {
        let response = ask(&mut client, by_address()).await;
        assert!(!over(&response), "{response:?}");
        let status = &response.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        assert_eq!(status.limit_remaining, remaining);
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (3, Unit::Minute as i32)
        );
        let reset = status.duration_until_reset.unwrap();
        assert!((0..=60).contains(&reset.seconds), "{reset:?}");
        assert_eq!(header(&response, "x-ratelimit-limit"), Some("3"));
        assert_eq!(
            header(&response, "x-ratelimit-remaining"),
            Some(remaining.to_string().as_str())
        );
    }
    let denied = ask(&mut client, by_address()).await;
    assert!(over(&denied));
    assert_eq!(denied.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(denied.statuses[0].limit_remaining, 0);
    let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // Another address has its own count.
    let other = ask(
        &mut client,
        request("edge", vec![descriptor(&[("remote_address", "10.0.0.2")])]),
    )
    .await;
    assert!(!over(&other));
}

#[tokio::test]
async fn nested_wildcard_unlimited_shadow_and_replaced_limits() {
    let server = RedisServer::start();
    let mut client = reference_service(&server).await;
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
    let shared = client.clone();
    let admitted = |entries: Vec<(&'static str, &'static str)>| {
        let mut client = shared.clone();
        async move {
            let response = ask(&mut client, request("edge", vec![descriptor(&entries)])).await;
            (!over(&response), response)
        }
    };
    // Nested: the limit of [key1=value1, subkey1]; key1=value1 alone has none.
    for _ in 0..2 {
        assert!(admitted(vec![("key1", "value1"), ("subkey1", "x")]).await.0);
    }
    assert!(!admitted(vec![("key1", "value1"), ("subkey1", "x")]).await.0);
    let (ok, alone) = admitted(vec![("key1", "value1")]).await;
    assert!(ok && alone.statuses[0].current_limit.is_none(), "{alone:?}");
    // A wildcard value: each value its own count.
    assert!(admitted(vec![("path", "/api/a")]).await.0);
    assert!(!admitted(vec![("path", "/api/a")]).await.0);
    assert!(admitted(vec![("path", "/api/b")]).await.0);
    // Unlimited: never counted.
    for _ in 0..5 {
        let (ok, response) = admitted(vec![("path", "/health")]).await;
        assert!(ok);
        assert_eq!(response.statuses[0].limit_remaining, u32::MAX);
    }
    // Shadow: counted, reported, never refusing.
    for _ in 0..3 {
        let (ok, response) = admitted(vec![("trial", "t1")]).await;
        assert!(
            ok && response.statuses[0].code == Code::Ok as i32,
            "{response:?}"
        );
    }
    // Replaces: with gold in the request, standard is not applied.
    let both = || {
        request(
            "edge",
            vec![
                descriptor(&[("plan", "gold")]),
                descriptor(&[("plan", "free")]),
            ],
        )
    };
    for _ in 0..3 {
        assert!(!over(&ask(&mut client, both()).await));
    }
    assert!(admitted(vec![("plan", "free")]).await.0);
    assert!(
        !admitted(vec![("plan", "free")]).await.0,
        "standard applies alone"
    );
    // An unknown domain or descriptor: no limit.
    let unknown = ask(
        &mut client,
        request("elsewhere", vec![descriptor(&[("remote_address", "x")])]),
    )
    .await;
    assert!(!over(&unknown) && unknown.statuses[0].current_limit.is_none());
}

#[tokio::test]
async fn descriptor_rules_check_every_rate_and_descriptor_all_or_nothing() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(
        store,
        RuleSet::from_toml(
            r#"
            [[rules]]
            name = "burst-and-day"
            domain = "api"
            descriptor = ["user"]
            policy = "2/10s, 3/1d"
            algorithm = "gcra"

            [[rules]]
            name = "per-route"
            domain = "api"
            descriptor = ["route=/export"]
            policy = "100/min"
            "#,
        )
        .unwrap(),
    );
    let route_limiter = rules.current().limiter("per-route", None).unwrap().clone();
    let mut client = serve(rules).await;
    let both = || {
        request(
            "api",
            vec![
                descriptor(&[("user", "u1")]),
                descriptor(&[("route", "/export")]),
            ],
        )
    };
    assert!(!over(&ask(&mut client, both()).await));
    assert!(!over(&ask(&mut client, both()).await));
    // The burst of two is spent: denied, and the route's count untouched.
    let denied = ask(&mut client, both()).await;
    assert!(over(&denied));
    assert_eq!(denied.statuses[0].code, Code::OverLimit as i32);
    let peek = route_limiter.peek("/export").await.unwrap();
    assert_eq!(
        peek.remaining(),
        100 - 2 - 1,
        "a denied request spent the route's quota"
    );
    // The day's 3 bites after the burst refills.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(!over(&ask(&mut client, both()).await));
    tokio::time::sleep(Duration::from_secs(6)).await;
    let day = ask(&mut client, both()).await;
    assert!(over(&day), "{day:?}");
    let limit = day.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (3, Unit::Day as i32));
}

#[tokio::test]
async fn costs_peeks_overrides_and_hostile_costs() {
    let server = RedisServer::start();
    let mut client = reference_service(&server).await;
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
    // The request's hits_addend: 2 of the address's 3.
    let mut two = request("edge", vec![descriptor(&[("remote_address", "a")])]);
    two.hits_addend = 2;
    assert_eq!(
        ask(&mut client, two.clone()).await.statuses[0].limit_remaining,
        1
    );
    assert!(over(&ask(&mut client, two).await), "2 more than the 1 left");
    // A descriptor's own hits_addend of 0: a peek.
    let mut peek = descriptor(&[("remote_address", "a")]);
    peek.hits_addend = Some(UInt64Value { value: 0 });
    for _ in 0..3 {
        let response = ask(&mut client, request("edge", vec![peek.clone()])).await;
        assert!(!over(&response));
        assert_eq!(response.statuses[0].limit_remaining, 1);
    }
    // A cost no window can hold: refused, and nothing counted.
    let mut hostile = request("edge", vec![descriptor(&[("remote_address", "b")])]);
    hostile.hits_addend = u32::MAX;
    let refused = ask(&mut client, hostile).await;
    assert!(over(&refused));
    assert_eq!(refused.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(refused.statuses[0].limit_remaining, 3, "nothing counted");
    let fresh = ask(
        &mut client,
        request("edge", vec![descriptor(&[("remote_address", "b")])]),
    )
    .await;
    assert_eq!(fresh.statuses[0].limit_remaining, 2);
    // A descriptor's own limit.
    let mut own = descriptor(&[("anything", "x")]);
    own.limit = Some(rate_limit_descriptor::RateLimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute as i32,
    });
    assert!(!over(
        &ask(&mut client, request("edge", vec![own.clone()])).await
    ));
    assert!(over(&ask(&mut client, request("edge", vec![own])).await));
}

/// A settling rule: a descriptor with a `hits_addend` of 0 asks whether
/// any budget is left, one with its own addend (the stream is done) is
/// charged it, past the max if need be.
#[tokio::test]
async fn a_descriptors_own_hits_addend_charges_a_settling_rule() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(
        store,
        RuleSet::from_toml(
            "[[rules]]\nname = \"tokens\"\ndomain = \"edge\"\ndescriptor = [\"api_key\"]\n\
             policy = \"100/1h\"\nalgorithm = \"gcra\"\nsettle = { hits_addend = true }\n",
        )
        .unwrap(),
    );
    let mut client = serve(rules).await;
    let with_addend = |n: u64| {
        let mut d = descriptor(&[("api_key", "k")]);
        d.hits_addend = Some(UInt64Value { value: n });
        request("edge", vec![d])
    };
    let mut admitted = Vec::new();
    for _ in 0..5 {
        let asked = ask(&mut client, with_addend(0)).await;
        admitted.push(!over(&asked));
        if !over(&asked) {
            let charged = ask(&mut client, with_addend(30)).await;
            assert!(!over(&charged), "a charge is never refused: {charged:?}");
        }
    }
    assert_eq!(admitted, [true, true, true, true, false]);
}

/// One rule for both front ends: with a `key` and a `descriptor`, a
/// request through the HTTP layer from 10.0.0.1 and Envoy's descriptor
/// `remote_address=10.0.0.1` spend one count.
#[tokio::test]
async fn a_rule_with_a_key_and_a_descriptor_counts_http_and_envoy_alike() {
    use tower::ServiceExt;
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(
        store,
        RuleSet::from_toml(
            r#"
            [[rules]]
            name = "per-client"
            key = "ip"
            domain = "edge"
            descriptor = ["remote_address"]
            policy = "3/1h"
            "#,
        )
        .unwrap(),
    );
    let mut client = serve(rules.clone()).await;
    let app = axum::Router::new()
        .fallback(|| async { "ok" })
        .layer(tower_redis_ratelimit::rules::RulesLayer::new(rules));
    let http = |app: axum::Router| async move {
        app.oneshot(crate::support::http::request("/", "10.0.0.1"))
            .await
            .unwrap()
            .status()
    };
    let envoy = || request("edge", vec![descriptor(&[("remote_address", "10.0.0.1")])]);
    assert_eq!(http(app.clone()).await, http::StatusCode::OK);
    assert!(!over(&ask(&mut client, envoy()).await));
    assert_eq!(http(app.clone()).await, http::StatusCode::OK);
    // The three spent, whichever front end spent them.
    assert!(over(&ask(&mut client, envoy()).await));
    assert_eq!(http(app.clone()).await, http::StatusCode::TOO_MANY_REQUESTS);
    // Another client: its own count.
    let other = request("edge", vec![descriptor(&[("remote_address", "10.0.0.2")])]);
    assert!(!over(&ask(&mut client, other).await));
}

/// Tiers from a descriptor's entry: the plan's policy, one count across
/// plans (a caller moved to `pro` keeps what it used).
#[tokio::test]
async fn a_descriptor_entry_picks_the_tier_and_tiers_share_the_count() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(
        store,
        RuleSet::from_toml(
            r#"
            [[rules]]
            name = "plans"
            domain = "api"
            descriptor = ["api_key", "plan"]
            tier_entry = "plan"
            policy = "1/1h"
            tiers = { pro = "3/1h" }
            algorithm = "gcra"
            "#,
        )
        .unwrap(),
    );
    let mut client = serve(rules).await;
    let call = |key: &'static str, plan: &'static str| {
        request("api", vec![descriptor(&[("api_key", key), ("plan", plan)])])
    };
    assert!(!over(&ask(&mut client, call("k1", "free")).await));
    assert!(over(&ask(&mut client, call("k1", "free")).await));
    let pro = ask(&mut client, call("k2", "pro")).await;
    assert_eq!(
        pro.statuses[0]
            .current_limit
            .as_ref()
            .unwrap()
            .requests_per_unit,
        3
    );
    assert!(!over(&ask(&mut client, call("k2", "pro")).await));
    assert!(!over(&ask(&mut client, call("k2", "pro")).await));
    assert!(over(&ask(&mut client, call("k2", "pro")).await));
    // k1 upgraded: its one used counts against pro's three.
    assert!(!over(&ask(&mut client, call("k1", "pro")).await));
    assert!(!over(&ask(&mut client, call("k1", "pro")).await));
    assert!(over(&ask(&mut client, call("k1", "pro")).await));
}

#[tokio::test]
async fn bad_requests_get_a_clear_status_and_hold_nothing() {
    let server = RedisServer::start();
    let mut client = reference_service(&server).await;
    let code = |result: Result<tonic::Response<RateLimitResponse>, tonic::Status>| {
        result.map(|_| ()).unwrap_err().code()
    };
    let one = || vec![descriptor(&[("remote_address", "x")])];
    assert_eq!(
        code(client.should_rate_limit(request("", one())).await),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(client.should_rate_limit(request("edge", Vec::new())).await),
        tonic::Code::InvalidArgument
    );
    let many = (0..1000)
        .map(|i| descriptor(&[("k", &*i.to_string())]))
        .collect();
    assert_eq!(
        code(client.should_rate_limit(request("edge", many)).await),
        tonic::Code::InvalidArgument
    );
    let huge = "v".repeat(1024 * 1024);
    let status = code(
        client
            .should_rate_limit(request(
                "edge",
                vec![descriptor(&[("remote_address", &huge)])],
            ))
            .await,
    );
    assert!(
        matches!(
            status,
            tonic::Code::ResourceExhausted | tonic::Code::OutOfRange
        ),
        "{status:?}"
    );
    // Still serving.
    assert!(!over(&ask(&mut client, request("edge", one())).await));
}

/// A request whose domain is not UTF-8 (proto strings must be): refused
/// with a gRPC status, and the service serves on.
#[tokio::test]
async fn a_request_that_is_not_utf8_is_refused() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawRequest {
        #[prost(bytes = "vec", tag = "1")]
        domain: Vec<u8>,
    }
    let server = RedisServer::start();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let set = RuleSet::from_envoy_yaml([("config.yaml", REFERENCE)]).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimitService::new(Rules::new(store, set)).into_server())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let refused = grpc
        .unary::<_, RawRequest, _>(
            tonic::Request::new(RawRequest {
                domain: vec![0xff, 0xfe, b'x'],
            }),
            path,
            tonic_prost::ProstCodec::default(),
        )
        .await;
    let status = refused.map(|_| ()).unwrap_err();
    assert_ne!(status.code(), tonic::Code::Ok, "{status:?}");
    let mut client = RateLimitServiceClient::new(channel);
    assert!(!over(
        &ask(
            &mut client,
            request("edge", vec![descriptor(&[("remote_address", "u")])])
        )
        .await
    ));
}

#[tokio::test]
async fn a_store_down_fails_open_or_closed_as_the_rules_say() {
    let mut server = RedisServer::start();
    let open = || async {
        RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_timeout(Duration::from_millis(200))
    };
    let set = || RuleSet::from_envoy_yaml([("c.yaml", REFERENCE)]).unwrap();
    let mut failing_open =
        serve(Rules::new(open().await, set()).with_fail_mode(FailMode::Open)).await;
    let mut failing_closed =
        serve(Rules::new(open().await, set()).with_fail_mode(FailMode::Closed)).await;
    server.kill();
    let by_address = || request("edge", vec![descriptor(&[("remote_address", "z")])]);
    assert!(!over(&ask(&mut failing_open, by_address()).await));
    let closed = failing_closed.should_rate_limit(by_address()).await;
    assert_eq!(closed.unwrap_err().code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn two_services_on_one_redis_share_one_count_exactly() {
    let server = RedisServer::start();
    let mut a = reference_service(&server).await;
    let mut b = reference_service(&server).await;
    away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
    let by_address = || request("edge", vec![descriptor(&[("remote_address", "shared")])]);
    let mut admitted = 0;
    for i in 0..10 {
        let client = if i % 2 == 0 { &mut a } else { &mut b };
        if !over(&ask(client, by_address()).await) {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3);
}

pub(crate) mod through_envoy {
    //! A real Envoy (the guide's bootstrap), the ready program
    //! (`examples/envoy_rls.rs`) and an upstream.

    use std::time::{Duration, Instant};

    use crate::support::envoy::Envoy;
    use crate::support::{RedisServer, free_port};

    /// The guide's bootstrap, with the test's ports.
    fn bootstrap(listener: u16, upstream: u16, service: u16) -> String {
        guide_block("static_resources:")
            .replace("port_value: 10000", &format!("port_value: {listener}"))
            .replace("port_value: 8080", &format!("port_value: {upstream}"))
            .replace("port_value: 8081", &format!("port_value: {service}"))
    }

    /// The ready program, serving `rules` from `REDIS_URL` on `port`.
    struct Program(std::process::Child);

    impl Program {
        fn start(rules: &std::path::Path, redis: &str, port: u16) -> Self {
            Self::start_with(rules, redis, port, &[])
        }

        fn start_with(
            rules: &std::path::Path,
            redis: &str,
            port: u16,
            vars: &[(&str, &str)],
        ) -> Self {
            let exe = std::env::current_exe().unwrap();
            let binary = exe
                .parent()
                .unwrap()
                .parent()
                .unwrap()
                .join("examples/envoy_rls");
            assert!(
                binary.exists(),
                "{} is missing: `cargo test --all-features` builds it",
                binary.display()
            );
            let child = std::process::Command::new(binary)
                .env_clear()
                .env("RULES", rules)
                .env("REDIS_URL", redis)
                .env("GRPC_BIND", format!("127.0.0.1:{port}"))
                .envs(vars.iter().copied())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "the program did not listen");
                std::thread::sleep(Duration::from_millis(20));
            }
            Self(child)
        }
    }

    impl Drop for Program {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// An upstream answering `hello` on a port of its own.
    fn upstream(runtime: &tokio::runtime::Runtime) -> u16 {
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = axum::Router::new().fallback(|| async { "hello" });
        runtime.spawn(async move { axum::serve(listener, app).await });
        port
    }

    /// `GET /` through Envoy on `port`: the status and the headers.
    fn get(port: u16, api_key: &str) -> (u16, Vec<(String, String)>) {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        write!(
            stream,
            "GET / HTTP/1.1\r\nHost: t\r\nx-api-key: {api_key}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let head = answer.split("\r\n\r\n").next().unwrap();
        let mut lines = head.lines();
        let status = lines.next().unwrap()[9..12].parse().unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(": "))
            .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
            .collect();
        (status, headers)
    }

    /// The program's exit status and stderr with `vars`, when it refuses
    /// to start.
    fn refused(vars: &[(&str, &str)]) -> (Option<i32>, String) {
        let exe = std::env::current_exe().unwrap();
        let binary = exe
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples/envoy_rls");
        let mut command = std::process::Command::new(binary);
        command.env_clear().env("GRPC_BIND", "127.0.0.1:0");
        crate::example_server::refused_by(command, vars)
    }

    #[test]
    fn the_program_refuses_bad_settings_with_status_2_naming_them() {
        let dir = std::env::temp_dir().join(format!("envoy-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.yaml");
        std::fs::write(
            &bad,
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
        )
        .unwrap();
        let good = dir.join("good.yaml");
        std::fs::write(&good, "domain: d\ndescriptors: []\n").unwrap();
        let (bad, good) = (bad.to_str().unwrap(), good.to_str().unwrap());
        for (vars, variable, says) in [
            (vec![], "RULES", "is required"),
            (
                vec![("RULES", bad)],
                "RULES",
                "invalid rate limit unit 'fortnight'",
            ),
            (
                vec![("RULES", good), ("GRPC_BIND", "nowhere")],
                "GRPC_BIND",
                "not an address",
            ),
            (
                vec![("RULES", good), ("HEADERS", "loud")],
                "HEADERS",
                "unknown style",
            ),
            (
                vec![("RULES", good), ("GRPC_THREADS", "0")],
                "GRPC_THREADS",
                "a number of threads, 1 to 1024",
            ),
            (
                vec![("RULES", good), ("FAIL_MODE", "maybe")],
                "FAIL_MODE",
                "unknown fail mode",
            ),
            (vec![("RULES", "redis")], "RULES", "needs REDIS_URL"),
            (
                vec![("RULES", good), ("ADMIN_BIND", "127.0.0.1:0")],
                "ADMIN_TOKEN",
                "ADMIN_BIND needs it",
            ),
        ] {
            let (code, stderr) = refused(&vars);
            assert_eq!(code, Some(2), "{vars:?}: {stderr}");
            assert!(
                stderr.starts_with(variable) && stderr.contains(says),
                "{vars:?}: {stderr}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_program_reports_health_and_stops_gracefully_on_sigterm() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-health-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("config.yaml");
        std::fs::write(&rules, "domain: d\ndescriptors: []\n").unwrap();
        let port = free_port();
        let mut program = Program::start(&rules, &redis.url(), port);
        let serving = runtime.block_on(async {
            let channel =
                tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "envoy.service.ratelimit.v3.RateLimitService".to_owned(),
                })
                .await
                .unwrap()
                .into_inner()
                .status
        });
        assert_eq!(
            serving,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &program.0.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let started = Instant::now();
        let status = loop {
            if let Some(status) = program.0.try_wait().unwrap() {
                break status;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "still running");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Envoy's `failure_mode_deny`, both ways, when the service cannot
    /// answer (here: its store is down and it fails closed).
    #[test]
    fn envoy_failure_mode_deny_decides_when_the_service_fails() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let mut redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("config.yaml");
        std::fs::write(&rules, guide_block("domain: edge")).unwrap();
        let app = upstream(&runtime);
        let service = free_port();
        let _program =
            Program::start_with(&rules, &redis.url(), service, &[("FAIL_MODE", "closed")]);
        let (open, closed) = (free_port(), free_port());
        let _lenient = Envoy::start(&bootstrap(open, app, service), open);
        let strict = bootstrap(closed, app, service)
            .replace("failure_mode_deny: false", "failure_mode_deny: true");
        let _strict = Envoy::start(&strict, closed);
        assert_eq!(get(open, "k").0, 200);
        assert_eq!(get(closed, "k").0, 200);
        redis.kill();
        // The service answers UNAVAILABLE: Envoy lets it through, or not.
        assert_eq!(get(open, "k").0, 200);
        let refused = get(closed, "k").0;
        assert!(refused >= 500, "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A nested descriptor (a route's fixed entry, then the caller's key)
    /// through Envoy, under a rule of two rates and a shadow rule beside it.
    #[test]
    fn envoy_nested_descriptor_with_two_rates_and_a_shadow_rule() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-nested-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("rules.toml");
        std::fs::write(
            &rules,
            r#"
            [[rules]]
            name = "api-burst-and-hour"
            domain = "edge"
            descriptor = ["generic_key=api", "api_key"]
            policy = "2/10s, 3/1h"
            algorithm = "gcra"

            [[rules]]
            name = "api-trial"
            domain = "edge"
            descriptor = ["generic_key=api", "api_key"]
            policy = "1/1h"
            shadow = true
            "#,
        )
        .unwrap();
        let app = upstream(&runtime);
        let service = free_port();
        let _program = Program::start(&rules, &redis.url(), service);
        let edge = free_port();
        let bootstrap = bootstrap(edge, app, service);
        let start = bootstrap.find("                  rate_limits:").unwrap();
        let end = bootstrap.find("          http_filters:").unwrap();
        let nested = "                  rate_limits:\n\
                      \x20                 - actions:\n\
                      \x20                   - generic_key: { descriptor_value: api }\n\
                      \x20                   - request_headers: { header_name: x-api-key, descriptor_key: api_key }\n";
        let bootstrap = format!("{}{nested}{}", &bootstrap[..start], &bootstrap[end..]);
        let _envoy = Envoy::start(&bootstrap, edge);
        // The burst of 2 (the shadow rule's 1 never refuses), then refused
        // by the burst with its fields.
        let statuses: Vec<u16> = (0..3).map(|_| get(edge, "k").0).collect();
        assert_eq!(statuses, [200, 200, 429]);
        let (status, headers) = get(edge, "k");
        assert_eq!(status, 429);
        assert!(
            headers
                .iter()
                .any(|(n, v)| n == "x-ratelimit-limit" && v == "2"),
            "{headers:?}"
        );
        // Another caller's own count.
        assert_eq!(get(edge, "other").0, 200);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A rules file changed under a running service is followed within a
    /// second; Envoy's own `enable_x_ratelimit_headers` writes its fields
    /// from the statuses (with the service's own fields off).
    #[test]
    fn rules_reloaded_under_envoy_and_envoys_own_headers() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("config.yaml");
        let limit = |n: u32| {
            format!(
                "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      \
                 name: per address\n      unit: hour\n      requests_per_unit: {n}\n"
            )
        };
        std::fs::write(&rules, limit(2)).unwrap();
        let app = upstream(&runtime);
        let service = free_port();
        let _program = Program::start_with(&rules, &redis.url(), service, &[("HEADERS", "none")]);
        let edge = free_port();
        let bootstrap = bootstrap(edge, app, service).replace(
            "              domain: edge\n",
            "              domain: edge\n              enable_x_ratelimit_headers: DRAFT_VERSION_03\n",
        );
        assert!(bootstrap.contains("enable_x_ratelimit_headers"));
        let _envoy = Envoy::start(&bootstrap, edge);
        let (status, headers) = get(edge, "k");
        assert_eq!(status, 200);
        let field = |headers: &[(String, String)], name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        // Envoy's draft-03 fields, from the status: the limit, its window,
        // the limit's name (as the reference names it, spaces and all).
        assert_eq!(
            field(&headers, "x-ratelimit-limit").as_deref(),
            Some("2, 2;w=3600;name=\"per address\"")
        );
        assert_eq!(
            field(&headers, "x-ratelimit-remaining").as_deref(),
            Some("1")
        );
        assert_eq!(get(edge, "k").0, 200);
        assert_eq!(get(edge, "k").0, 429);
        // Raised: the count carries over, the new max applies within a second.
        std::fs::write(&rules, limit(5)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while get(edge, "k").0 != 200 {
            assert!(
                Instant::now() < deadline,
                "the raised limit was not followed"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The guide's block of `yaml` or `toml` that holds `marker`.
    pub(crate) fn guide_block(marker: &str) -> String {
        let guide = include_str!("../../src/docs/guide/envoy.md");
        let at = guide.find(marker).unwrap();
        let start = guide[..at].rfind("```").unwrap();
        let start = start + guide[start..].find('\n').unwrap() + 1;
        let end = at + guide[at..].find("```").unwrap();
        guide[start..end].to_owned()
    }

    /// An upstream that reports `tokens` used in `x-usage-tokens`.
    fn metered_upstream(runtime: &tokio::runtime::Runtime, tokens: u64) -> u16 {
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = axum::Router::new().fallback(move || async move {
            ([("x-usage-tokens", tokens.to_string())], "the answer")
        });
        runtime.spawn(async move { axum::serve(listener, app).await });
        port
    }

    #[test]
    fn tokens_are_charged_when_the_stream_is_done() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // The guide's rule, with a budget of 100 tokens an hour.
        let rules = dir.join("rules.toml");
        let rule = guide_block("name = \"tokens\"").replace("100000/1h", "100/1h");
        std::fs::write(&rules, rule).unwrap();
        let app = metered_upstream(&runtime, 30);
        let service = free_port();
        let _program = Program::start(&rules, &redis.url(), service);
        let edge = free_port();
        // The guide's bootstrap with the guide's route for tokens.
        let bootstrap = bootstrap(edge, app, service);
        let start = bootstrap.find("              routes:").unwrap();
        let end = bootstrap.find("          http_filters:").unwrap();
        let route = guide_block("apply_on_stream_done: true");
        let bootstrap = format!("{}{route}{}", &bootstrap[..start], &bootstrap[end..]);
        let _envoy = Envoy::start(&bootstrap, edge);
        // 30 tokens an answer: 100, 70, 40, 10 left before each; the
        // fourth goes 20 into debt, and the fifth is refused.
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(get(edge, "tenant-1").0);
            // The charge is sent once the stream is done.
            std::thread::sleep(Duration::from_millis(300));
        }
        assert_eq!(statuses, [200, 200, 200, 200, 429]);
        // Another key has its own budget.
        assert_eq!(get(edge, "tenant-2").0, 200);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn envoy_answers_429_after_the_limit_with_the_fields_and_two_envoys_share_it() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let dir = std::env::temp_dir().join(format!("envoy-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rules = dir.join("config.yaml");
        // The guide's rules.
        std::fs::write(&rules, guide_block("domain: edge")).unwrap();

        let app = upstream(&runtime);
        let (service_a, service_b) = (free_port(), free_port());
        let _a = Program::start(&rules, &redis.url(), service_a);
        let _b = Program::start(&rules, &redis.url(), service_b);
        let (edge_a, edge_b) = (free_port(), free_port());
        let _envoy_a = Envoy::start(&bootstrap(edge_a, app, service_a), edge_a);
        let _envoy_b = Envoy::start(&bootstrap(edge_b, app, service_b), edge_b);
        runtime.block_on(crate::support::harness::away_from_a_boundary(
            Duration::from_secs(60),
            Duration::from_secs(10),
        ));
        // 5 a minute per address, across both Envoys; 10 a second per key.
        let mut statuses = Vec::new();
        for i in 0..8 {
            let port = if i % 2 == 0 { edge_a } else { edge_b };
            statuses.push(get(port, &format!("key-{i}")));
        }
        let admitted = statuses.iter().filter(|(s, _)| *s == 200).count();
        assert_eq!(admitted, 5, "{statuses:?}");
        let (status, headers) = &statuses[7];
        assert_eq!(*status, 429, "{headers:?}");
        let field = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(field("x-ratelimit-limit").as_deref(), Some("5"));
        assert_eq!(field("x-ratelimit-remaining").as_deref(), Some("0"));
        assert!(field("retry-after").is_some(), "{headers:?}");
        // An admitted answer carries the fields too.
        let (status, headers) = &statuses[0];
        assert_eq!(*status, 200);
        assert!(
            headers
                .iter()
                .any(|(n, v)| n == "x-ratelimit-remaining" && v == "4"),
            "{headers:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The reference server's own example configuration (`examples/ratelimit/
/// config/example.yaml` of envoyproxy/ratelimit, without its two
/// `quota_mode` services) and the cases of its integration tests
/// (`basic.yaml`, `another.yaml`): the same answers.
mod reference_cases {
    use super::*;

    const EXAMPLE: &str = r#"
domain: rl
descriptors:
  - key: category
    value: account
    rate_limit:
      replaces:
        - name: bkthomps
        - name: fake_name
      unit: minute
      requests_per_unit: 4
  - key: source_cluster
    value: proxy
    descriptors:
      - key: destination_cluster
        value: bkthomps
        rate_limit:
          replaces:
            - name: bkthomps
          unit: minute
          requests_per_unit: 2
      - key: destination_cluster
        value: mock
        rate_limit:
          unit: minute
          requests_per_unit: 1
      - key: destination_cluster
        value: override
        rate_limit:
          replaces:
            - name: banned_limit
          unit: minute
          requests_per_unit: 2
      - key: destination_cluster
        value: fake
        rate_limit:
          name: fake_name
          unit: minute
          requests_per_unit: 2
  - key: foo
    rate_limit:
      unit: minute
      requests_per_unit: 2
    descriptors:
      - key: bar
        rate_limit:
          unit: minute
          requests_per_unit: 3
      - key: bar
        value: bkthomps
        rate_limit:
          name: bkthomps
          unit: minute
          requests_per_unit: 1
      - key: bar
        value: banned
        rate_limit:
          name: banned_limit
          unit: minute
          requests_per_unit: 0
      - key: baz
        rate_limit:
          unit: second
          requests_per_unit: 1
      - key: baz
        value: shady
        rate_limit:
          unit: minute
          requests_per_unit: 3
        shadow_mode: true
      - key: bay
        rate_limit:
          unlimited: true
  - key: unspec
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 2
"#;

    const BASIC: &str = "domain: basic\ndescriptors:\n  - key: key1\n    rate_limit:\n      unit: second\n      requests_per_unit: 50\n";
    const ANOTHER: &str = "domain: another\ndescriptors:\n  - key: key2\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n  - key: key3\n    rate_limit:\n      unit: hour\n      requests_per_unit: 10\n";

    async fn service(server: &RedisServer) -> Client {
        let store = RedisStore::connect(&server.url()).await.unwrap();
        let set = RuleSet::from_envoy_yaml([
            ("example.yaml", EXAMPLE),
            ("basic.yaml", BASIC),
            ("another.yaml", ANOTHER),
        ])
        .unwrap();
        serve(Rules::new(store, set)).await
    }

    #[tokio::test]
    async fn the_integration_tests_cases() {
        let server = RedisServer::start();
        let mut client = service(&server).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
        // An unknown domain: OK, no limit, nothing remaining.
        let unknown = ask(
            &mut client,
            request("foo", vec![descriptor(&[("hello", "world")])]),
        )
        .await;
        assert!(!over(&unknown));
        assert_eq!(unknown.statuses[0].current_limit, None);
        assert_eq!(unknown.statuses[0].limit_remaining, 0);
        // 50 a second: 49 left.
        let basic = ask(
            &mut client,
            request("basic", vec![descriptor(&[("key1", "foo")])]),
        )
        .await;
        assert_eq!(basic.statuses[0].limit_remaining, 49);
        let limit = basic.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (50, Unit::Second as i32)
        );
        // 20 a minute: over from the 21st.
        for i in 0..25u32 {
            let response = ask(
                &mut client,
                request("another", vec![descriptor(&[("key2", "r1")])]),
            )
            .await;
            assert_eq!(over(&response), i >= 20, "{i}");
            assert_eq!(
                response.statuses[0].limit_remaining,
                20u32.saturating_sub(i + 1)
            );
        }
        // Two keys: key3's 10 an hour bites, and key2's count stops (the
        // reference's StopCacheKeyIncrementWhenOverlimit: 10 left).
        for i in 0..15u32 {
            let response = ask(
                &mut client,
                request(
                    "another",
                    vec![descriptor(&[("key2", "r2")]), descriptor(&[("key3", "r2")])],
                ),
            )
            .await;
            assert_eq!(over(&response), i >= 10, "{i}");
            if i < 10 {
                assert_eq!(response.statuses[0].limit_remaining, 20 - (i + 1));
                assert_eq!(response.statuses[1].limit_remaining, 10 - (i + 1));
            } else {
                assert_eq!(response.statuses[1].code, Code::OverLimit as i32);
            }
        }
        let key2 = ask(
            &mut client,
            request("another", vec![descriptor(&[("key2", "r2")])]),
        )
        .await;
        assert_eq!(key2.statuses[0].limit_remaining, 20 - 10 - 1);
    }

    #[tokio::test]
    async fn the_example_configuration() {
        let server = RedisServer::start();
        let client = service(&server).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
        let ask_rl = |descriptors: Vec<RateLimitDescriptor>| {
            let mut client = client.clone();
            async move { ask(&mut client, request("rl", descriptors)).await }
        };
        // foo alone: 2 a minute; foo + bar (any value): 3; foo + bar=bkthomps: 1.
        assert!(!over(&ask_rl(vec![descriptor(&[("foo", "f")])]).await));
        assert!(!over(&ask_rl(vec![descriptor(&[("foo", "f")])]).await));
        assert!(over(&ask_rl(vec![descriptor(&[("foo", "f")])]).await));
        let bar = || vec![descriptor(&[("foo", "f"), ("bar", "b")])];
        for _ in 0..3 {
            assert!(!over(&ask_rl(bar()).await));
        }
        assert!(over(&ask_rl(bar()).await));
        // bar=banned: 0 a minute, always over; replaced by override.
        let banned = || descriptor(&[("foo", "f"), ("bar", "banned")]);
        let refused = ask_rl(vec![banned()]).await;
        assert!(over(&refused));
        assert_eq!(refused.statuses[0].code, Code::OverLimit as i32);
        let overriding = descriptor(&[
            ("source_cluster", "proxy"),
            ("destination_cluster", "override"),
        ]);
        assert!(!over(&ask_rl(vec![banned(), overriding]).await));
        // bay: unlimited; baz=shady: shadow (3 a minute, never refusing).
        for _ in 0..5 {
            assert!(!over(
                &ask_rl(vec![descriptor(&[("foo", "f"), ("bay", "x")])]).await
            ));
            assert!(!over(
                &ask_rl(vec![descriptor(&[("foo", "f"), ("baz", "shady")])]).await
            ));
        }
        // bkthomps (1 a minute) is replaced by category=account (4).
        let bkthomps = || descriptor(&[("foo", "f2"), ("bar", "bkthomps")]);
        assert!(!over(&ask_rl(vec![bkthomps()]).await));
        assert!(over(&ask_rl(vec![bkthomps()]).await));
        let account = || descriptor(&[("category", "account")]);
        for _ in 0..3 {
            assert!(!over(&ask_rl(vec![bkthomps(), account()]).await));
        }
        // A deeper request than the configuration: no limit.
        let deep = ask_rl(vec![descriptor(&[("unspec", "u"), ("more", "m")])]).await;
        assert!(!over(&deep) && deep.statuses[0].current_limit.is_none());
    }
}

#[test]
fn reference_yaml_that_cannot_work_is_refused_naming_the_place() {
    for (yaml, says) in [
        ("descriptors: []\n", "empty domain"),
        ("domain: d\ndescriptors:\n  - value: v\n", "empty key"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n",
            "invalid rate limit unit 'fortnight'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, unlimited: true }\n",
            "should not specify rate limit unit when unlimited",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n  - key: k\n",
            "duplicate descriptor composite key 'd.k'",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limt: { unit: second }\n",
            "rate_limt",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
            "quota_mode is not supported",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { name: n, unit: second, requests_per_unit: 1, replaces: [{ name: n }] }\n",
            "replaces should not contain name of same descriptor",
        ),
    ] {
        let error = RuleSet::from_envoy_yaml([("bad.yaml", yaml)])
            .unwrap_err()
            .to_string();
        assert!(error.contains(says), "{yaml}: {error}");
        assert!(error.contains("bad.yaml"), "{yaml}: {error}");
    }
    let twice = RuleSet::from_envoy_yaml([
        ("a.yaml", "domain: d\ndescriptors: []\n"),
        ("b.yaml", "domain: d\ndescriptors: []\n"),
    ])
    .unwrap_err()
    .to_string();
    assert!(twice.contains("duplicate domain 'd'"), "{twice}");
}

#[test]
fn descriptor_rules_that_cannot_work_are_refused_naming_the_field() {
    let rule = |fields: &str| {
        RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"r\"\npolicy = \"10/s\"\n{fields}\n"
        ))
    };
    for (fields, field, says) in [
        ("descriptor = [\"k\"]", "domain", "is missing"),
        ("domain = \"d\"", "descriptor", "is missing"),
        (
            "domain = \"d\"\ndescriptor = []",
            "descriptor",
            "at least one entry",
        ),
        (
            "domain = \"d\"\ndescriptor = [\"=v\"]",
            "descriptor",
            "no key",
        ),
        (
            "domain = \"d\"\ndescriptor = [\"k\"]\npath = \"/x\"",
            "path",
            "give it a `key`",
        ),
        (
            "key = \"ip\"\nshadow = true",
            "shadow",
            "descriptor rules only",
        ),
        (
            "key = \"ip\"\nsettle = { hits_addend = true }",
            "settle.hits_addend",
            "only a descriptor rule",
        ),
        (
            "domain = \"d\"\ndescriptor = [\"k\"]\nsettle = { header = \"x-used\" }",
            "settle",
            "never told its response",
        ),
        (
            "domain = \"d\"\ndescriptor = [\"k\"]\ncount = [\"4xx\"]",
            "count",
            "never told its response",
        ),
        (
            "domain = \"d\"\ndescriptor = [\"k\"]\nunlimited = true",
            "policy",
            "no policy",
        ),
    ]
    .map(|(fields, field, says)| (fields.to_owned(), field, says))
    .into_iter()
    .chain(
        // Answers the HTTP layer would not give: refused on a rule for both.
        [
            "shadow = true",
            "refuse = true",
            "unlimited = true",
            "replaces = [\"other\"]",
            "tier_entry = \"plan\"",
        ]
        .map(|flag| {
            let fields = format!("key = \"ip\"\ndomain = \"d\"\ndescriptor = [\"k\"]\n{flag}");
            let field = flag.split(' ').next().unwrap_or_default();
            (fields, field, "applies to Envoy alone")
        }),
    ) {
        let error = rule(&fields).unwrap_err();
        assert_eq!(error.field(), field, "{fields}: {error}");
        assert!(error.to_string().contains(says), "{fields}: {error}");
    }
    // Unlimited without a policy, and a rule for both front ends, are fine.
    RuleSet::from_toml(
        "[[rules]]\nname = \"r\"\ndomain = \"d\"\ndescriptor = [\"k\"]\nunlimited = true\n",
    )
    .unwrap();
    rule("key = \"ip\"\ndomain = \"d\"\ndescriptor = [\"remote_address\"]").unwrap();
}
