//! Tokens priced behind Envoy: descriptor rules naming their usage
//! (`usage = { model = "model", kind = "token_kind" }`) charged the price
//! catalog's price of each descriptor's `hits_addend`, as Envoy sends it
//! when a stream is done (Envoy AI Gateway's way), against a real Redis;
//! the service alone over gRPC, and behind a real Envoy with the guide's
//! bootstrap and route.
#![cfg(feature = "envoy")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tower_redis_ratelimit::RedisStore;
use tower_redis_ratelimit::envoy::RateLimitService;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::google::protobuf::UInt64Value;
use tower_redis_ratelimit::rules::{RuleSet, Rules};

use crate::envoy::through_envoy::guide_block;
use crate::envoy::{descriptor, over};
use crate::support::RedisServer;
use crate::support::harness::away_from_a_boundary;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

const DAY: Duration = Duration::from_secs(86_400);

/// The guide's catalog and rules, with a budget of `budget` a day (a
/// fixed window, exact between two midnights) and a token rate of
/// `tokens` a day.
fn guide_rules(budget: &str, tokens: &str) -> RuleSet {
    let text = guide_block("name = \"spend\"")
        .replace("\"100 USD/month\"", &format!("\"{budget}/1d\""))
        .replace(
            "\"20000 tokens/min\"\nalgorithm = \"gcra\"",
            &format!("\"{tokens} tokens/1d\"\nalgorithm = \"fixed-window\""),
        );
    assert!(text.contains(budget) && text.contains(tokens), "{text}");
    RuleSet::from_toml(&text).unwrap()
}

/// The service answering `rules`, on a port of its own (of `runtime`).
async fn serve(rules: Rules) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimitService::new(rules).into_server())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    port
}

/// The units of rule `rule` that `key` has left (0 when none, or in debt).
async fn left(rules: &Rules, rule: &str, key: &str) -> u64 {
    let active = rules.current();
    let limiter = active.limiter(rule, None).unwrap();
    let decision = limiter.peek(key).await.unwrap();
    // A peek tells what a check of the policy's cost would leave.
    if decision.allowed() {
        decision.remaining() + limiter.policy().cost()
    } else {
        0
    }
}

/// The descriptor of `key`'s tokens of `kind` of `model`, with its own
/// `hits_addend` of `tokens`.
fn usage(key: &str, model: &str, kind: &str, tokens: u64) -> RateLimitDescriptor {
    let mut d = descriptor(&[("api_key", key), ("model", model), ("token_kind", kind)]);
    d.hits_addend = Some(UInt64Value { value: tokens });
    d
}

async fn ask(client: &mut Client, descriptors: Vec<RateLimitDescriptor>) -> RateLimitResponse {
    client
        .should_rate_limit(RateLimitRequest {
            domain: "edge".to_owned(),
            descriptors,
            hits_addend: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

/// The service alone: each kind's tokens priced by the catalog, one
/// budget per API key whatever the model and kind, an unpriced model or
/// kind refused on the request path and charged at the dearest price at a
/// stream's end, a spent budget over the limit.
#[tokio::test]
async fn descriptors_per_kind_are_charged_the_catalogs_price_under_one_key() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    // 5 cents a day, and 100,000 tokens.
    let rules = Rules::new(store, guide_rules("0.05 USD", "100000"));
    let port = serve(rules.clone()).await;
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    away_from_a_boundary(DAY, Duration::from_secs(10)).await;

    // The request path: priced, and a budget left.
    let asked = ask(&mut client, vec![usage("k1", "gpt-4o", "input", 0)]).await;
    assert!(!over(&asked), "{asked:?}");
    // The stream's end: 1,000 input tokens at $2.50 a million and 500
    // output tokens at $10 a million, 2,500 + 5,000 micro-USD.
    let charged = ask(
        &mut client,
        vec![
            usage("k1", "gpt-4o", "input", 1000),
            usage("k1", "gpt-4o", "output", 500),
        ],
    )
    .await;
    assert!(!over(&charged), "a charge is never refused: {charged:?}");
    assert_eq!(left(&rules, "spend", "k1").await, 50_000 - 7_500);
    assert_eq!(left(&rules, "token-rate", "k1").await, 100_000 - 1_500);

    // Another model of the same key spends the same budget (the model and
    // kind are not part of the key): 10,000 tokens each of gpt-4o-mini's
    // $0.15 and $0.60 a million.
    ask(
        &mut client,
        vec![
            usage("k1", "gpt-4o-mini", "input", 10_000),
            usage("k1", "gpt-4o-mini", "output", 10_000),
        ],
    )
    .await;
    assert_eq!(left(&rules, "spend", "k1").await, 50_000 - 7_500 - 7_500);
    assert_eq!(left(&rules, "token-rate", "k1").await, 100_000 - 21_500);
    // The request path's status tells the shared budget, whichever model.
    let asked = ask(&mut client, vec![usage("k1", "gpt-4o-mini", "output", 0)]).await;
    let spend = asked
        .statuses
        .iter()
        .map(|s| {
            (
                s.current_limit.as_ref().map(|l| l.name.clone()),
                s.limit_remaining,
            )
        })
        .collect::<Vec<_>>();
    assert!(
        spend.contains(&(Some("spend".to_owned()), 35_000)),
        "{spend:?}"
    );
    // Another key has a budget of its own.
    assert_eq!(left(&rules, "spend", "k2").await, 50_000);

    // A model the catalog does not price (no default price), or a kind
    // its model has no price for: over the limit on the request path (the
    // upstream is never asked), and never charged.
    for unpriced in [
        usage("k1", "llama-3", "input", 0),
        usage("k1", "gpt-4o", "audio", 0),
    ] {
        let answer = ask(&mut client, vec![unpriced.clone()]).await;
        assert!(over(&answer), "{unpriced:?}: {answer:?}");
        let status = &answer.statuses[0];
        assert_eq!(status.code, Code::OverLimit as i32);
        let limit = status.current_limit.as_ref().unwrap();
        // The rule and its rate, nothing left, no reset: waiting cures
        // nothing, and Envoy is asked for no Retry-After.
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit),
            ("spend", 50_000)
        );
        assert_eq!(status.limit_remaining, 0);
        assert!(status.duration_until_reset.is_none(), "{status:?}");
        assert!(
            !answer
                .response_headers_to_add
                .iter()
                .any(|h| h.key.eq_ignore_ascii_case("retry-after")),
            "{answer:?}"
        );
    }
    assert_eq!(left(&rules, "spend", "k1").await, 35_000);
    // A request carrying an unpriced descriptor counts nowhere.
    let mixed = ask(
        &mut client,
        vec![
            descriptor(&[
                ("api_key", "k1"),
                ("model", "gpt-4o"),
                ("token_kind", "input"),
            ]),
            usage("k1", "llama-3", "input", 0),
        ],
    )
    .await;
    assert!(over(&mixed), "{mixed:?}");
    assert_eq!(left(&rules, "spend", "k1").await, 35_000);

    // Spending the rest and past it: 3,600 output tokens, 36,000
    // micro-USD, 1,000 into debt; the request path is then refused.
    ask(&mut client, vec![usage("k1", "gpt-4o", "output", 3_600)]).await;
    for model in ["gpt-4o", "gpt-4o-mini"] {
        let asked = ask(&mut client, vec![usage("k1", model, "input", 0)]).await;
        assert!(over(&asked), "{model}: {asked:?}");
    }
    let other = ask(&mut client, vec![usage("k2", "gpt-4o", "input", 0)]).await;
    assert!(!over(&other), "{other:?}");
    // At a stream's end nothing can be refused: a usage the catalog
    // cannot price is charged at its dearest price (gpt-4o's output, $10 a
    // million), never free.
    let late = ask(&mut client, vec![usage("k3", "llama-3", "output", 2_000)]).await;
    assert!(!over(&late), "{late:?}");
    assert_eq!(left(&rules, "spend", "k3").await, 50_000 - 20_000);
}

/// A rule counted in tokens naming only the model's entry: every model's
/// tokens (priced or not: there is no catalog) spend one count per key.
#[tokio::test]
async fn a_tokens_rule_counts_every_models_tokens_under_one_key() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let rules = Rules::new(
        store,
        RuleSet::from_toml(
            "[[rules]]\nname = \"tokens\"\ndomain = \"edge\"\n\
             descriptor = [\"api_key\", \"model\"]\nusage = { model = \"model\" }\n\
             policy = \"1000 tokens/1d\"\nalgorithm = \"fixed-window\"\n\
             settle = { hits_addend = true }\n",
        )
        .unwrap(),
    );
    let port = serve(rules.clone()).await;
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    away_from_a_boundary(DAY, Duration::from_secs(10)).await;
    let tokens = |model: &str, n: u64| {
        let mut d = descriptor(&[("api_key", "k"), ("model", model)]);
        d.hits_addend = Some(UInt64Value { value: n });
        d
    };
    for (model, n) in [("gpt-4o", 300), ("llama-3", 300), ("anything", 300)] {
        let answer = ask(&mut client, vec![tokens(model, n)]).await;
        assert!(!over(&answer), "{answer:?}");
    }
    assert_eq!(left(&rules, "tokens", "k").await, 100);
    // Past the count, now in debt: every model is refused.
    ask(&mut client, vec![tokens("gpt-4o", 300)]).await;
    for model in ["gpt-4o", "llama-3"] {
        assert!(over(&ask(&mut client, vec![tokens(model, 0)]).await));
    }
}

mod through_envoy {
    //! A real Envoy with the guide's bootstrap and its route for priced
    //! tokens, the service, and an upstream reporting its tokens.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tower_redis_ratelimit::RedisStore;
    use tower_redis_ratelimit::rules::Rules;

    use super::{DAY, guide_block, guide_rules, left, serve};
    use crate::support::envoy::Envoy;
    use crate::support::eventually::eventually;
    use crate::support::harness::away_from_a_boundary;
    use crate::support::{RedisServer, free_port};

    /// An upstream reporting 1,000 input and 1,000 output tokens for
    /// every answer, and how many requests it served.
    fn metered_upstream(runtime: &tokio::runtime::Runtime) -> (u16, Arc<AtomicUsize>) {
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&served);
        let app = axum::Router::new().fallback(move || {
            count.fetch_add(1, Ordering::SeqCst);
            async {
                (
                    [
                        ("x-usage-input-tokens", "1000"),
                        ("x-usage-output-tokens", "1000"),
                    ],
                    "the answer",
                )
            }
        });
        runtime.spawn(async move { axum::serve(listener, app).await });
        (port, served)
    }

    /// The guide's bootstrap, with the guide's route for priced tokens and
    /// the test's ports.
    fn bootstrap(listener: u16, upstream: u16, service: u16) -> String {
        let bootstrap = guide_block("static_resources:")
            .replace("port_value: 10000", &format!("port_value: {listener}"))
            .replace("port_value: 8080", &format!("port_value: {upstream}"))
            .replace("port_value: 8081", &format!("port_value: {service}"));
        let start = bootstrap.find("              routes:").unwrap();
        let end = bootstrap.find("          http_filters:").unwrap();
        let route = guide_block("%RESP(x-usage-output-tokens)%");
        format!("{}{route}{}", &bootstrap[..start], &bootstrap[end..])
    }

    /// `GET /` through Envoy on `port` with these headers: the status.
    fn get(port: u16, headers: &[(&str, &str)]) -> u16 {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let fields: String = headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}\r\n"))
            .collect();
        write!(
            stream,
            "GET / HTTP/1.1\r\nHost: t\r\n{fields}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer[9..12].parse().unwrap()
    }

    #[test]
    fn envoy_sends_each_kinds_tokens_at_the_streams_end_and_the_catalog_prices_them() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let redis = RedisServer::start();
        let store = runtime.block_on(RedisStore::connect(&redis.url())).unwrap();
        // 4 cents a day.
        let rules = Rules::new(store, guide_rules("0.04 USD", "100000"));
        let service = runtime.block_on(serve(rules.clone()));
        let (app, served) = metered_upstream(&runtime);
        let edge = free_port();
        let _envoy = Envoy::start(&bootstrap(edge, app, service), edge);
        runtime.block_on(away_from_a_boundary(DAY, Duration::from_secs(30)));

        let spend = |key: &'static str, expected: u64| {
            runtime.block_on(eventually(
                Duration::from_secs(5),
                Duration::from_millis(20),
                &format!("the budget {key} has left"),
                expected,
                || left(&rules, "spend", key),
            ));
        };
        let ask = |key: &str, model: &str| get(edge, &[("x-api-key", key), ("x-model", model)]);
        // 1,000 input and 1,000 output tokens an answer: 12,500 micro-USD
        // of gpt-4o, 750 of gpt-4o-mini, from one budget of 40,000.
        let mut expected = 40_000;
        for (model, price) in [
            ("gpt-4o", 12_500),
            ("gpt-4o-mini", 750),
            ("gpt-4o", 12_500),
            ("gpt-4o", 12_500),
        ] {
            assert_eq!(ask("tenant-1", model), 200, "{model} with {expected} left");
            expected -= price;
            // The charge comes once the stream is done.
            spend("tenant-1", expected);
        }
        assert_eq!(expected, 1_750);
        // Admitted with 1,750 left, it costs 12,500: the budget is in debt,
        // and every model of the key is refused before its upstream.
        assert_eq!(ask("tenant-1", "gpt-4o"), 200);
        runtime.block_on(eventually(
            Duration::from_secs(5),
            Duration::from_millis(20),
            "the answer charged past the budget",
            0,
            || async {
                let active = rules.current();
                let limiter = active.limiter("spend", None).unwrap();
                u64::from(limiter.peek("tenant-1").await.unwrap().allowed())
            },
        ));
        assert_eq!(served.load(Ordering::SeqCst), 5);
        assert_eq!(ask("tenant-1", "gpt-4o-mini"), 429);
        assert_eq!(ask("tenant-1", "gpt-4o"), 429);
        // A model the catalog does not price is refused before the
        // upstream; so is a request naming no model.
        assert_eq!(ask("tenant-2", "llama-3"), 429);
        assert_eq!(get(edge, &[("x-api-key", "tenant-2")]), 400);
        assert_eq!(served.load(Ordering::SeqCst), 5);
        spend("tenant-2", 40_000);
        // Another key has its own budget.
        assert_eq!(ask("tenant-2", "gpt-4o"), 200);
        spend("tenant-2", 40_000 - 12_500);
        assert_eq!(served.load(Ordering::SeqCst), 6);
        // The token rate counted both kinds: 2,000 tokens an answer.
        assert_eq!(
            runtime.block_on(left(&rules, "token-rate", "tenant-1")),
            100_000 - 5 * 2_000
        );
    }
}
