//! `examples/ai_gateway` run as processes in front of a fake upstream that
//! speaks OpenAI's wire format, driven by the official `openai` Python SDK:
//! its retries follow `retry-after` on a rate and stop on a spent budget,
//! the headers it reads are right, streams are settled from the usage chunk
//! the gateway asks for, bad answers cost their estimate, and two gateways
//! on one Redis (and on one PostgreSQL) keep three teams of one
//! organisation within their budgets, each threshold told once.
//!
//! The example's binary is built by `cargo test` (every target); run alone,
//! build it first with `cargo build --all-features --examples`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;

use serde_json::{Value, json};
use tower_redis_ratelimit::{Limiter, Policy, RedisStore};

use crate::ai_gateway_sdk::{sdk, sdk_once};
use crate::support::RedisServer;
use crate::support::openai_upstream::{Behaviour, OpenAiUpstream, Usage};

/// The catalog of every test: a micro-dollar per input token, two per
/// output token, half a one per cached token.
const CATALOG: &str = r#"
[catalog]
currency = "USD"
[catalog.models."gpt-4o-mini"]
input = 1_000_000
cached_input = 500_000
output = 2_000_000
"#;

/// The keys of every test: two keys of team red, one each of green and
/// blue, all of organisation acme.
const KEYS: &str = r#"
[keys."sk-red-one-secret"]
name = "red-1"
user = "ann"
team = "red"
org = "acme"

[keys."sk-red-two-secret"]
name = "red-2"
user = "bob"
team = "red"
org = "acme"

[keys."sk-green-secret"]
name = "green-1"
user = "cat"
team = "green"
org = "acme"

[keys."sk-blue-secret"]
name = "blue-1"
user = "dan"
team = "blue"
org = "acme"
"#;

/// A directory of its own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ai-gateway-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running gateway on a free port; killed when dropped.
struct Gateway {
    child: Child,
    addr: String,
    /// Every line it has written.
    lines: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    fn start(upstream: &OpenAiUpstream, rules: &str, env: &[(&str, String)]) -> (Self, Scratch) {
        let dir = Scratch::new();
        let rules = dir.file("rules.toml", &format!("{CATALOG}\n{rules}"));
        let keys = dir.file("keys.toml", KEYS);
        let mut env: Vec<(&str, String)> = env.to_vec();
        env.extend([
            ("RULES", rules),
            ("KEYS", keys),
            ("UPSTREAM_URL", upstream.url()),
            ("UPSTREAM_KEY", "sk-upstream-of-the-gateway".to_owned()),
        ]);
        (Self::spawn(&env), dir)
    }

    fn spawn(env: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
        let binary: PathBuf = debug.join("examples").join("ai_gateway");
        assert!(
            binary.exists(),
            "{} is missing: build it with `cargo build --all-features --examples` \
             (`cargo test` builds it)",
            binary.display()
        );
        let mut command = Command::new(binary);
        command
            .env_clear()
            .env("BIND", "127.0.0.1:0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        for output in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (tx, lines) = (tx.clone(), Arc::clone(&lines));
            std::thread::spawn(move || {
                for line in BufReader::new(output).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                    }
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| {
                panic!(
                    "the gateway says where it listens: {:?}",
                    lines.lock().unwrap()
                )
            });
        Self { child, addr, lines }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn logged(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gateway with `rules` on a Redis of its own, in front of a fake
/// upstream.
async fn on_redis(rules: &str) -> (RedisServer, OpenAiUpstream, Gateway, Scratch) {
    let redis = RedisServer::start();
    let upstream = OpenAiUpstream::start().await;
    let (gateway, dir) = Gateway::start(&upstream, rules, &[("REDIS_URL", redis.url())]);
    (redis, upstream, gateway, dir)
}

/// A spec of a chat call through `gateway` with `key`, then `extra`'s fields.
fn spec(gateway: &Gateway, key: &str, extra: Value) -> Value {
    let mut spec = json!({
        "base_url": gateway.base_url(),
        "api_key": key,
        "max_retries": 2,
        "timeout": 20,
        "endpoint": "chat",
        "model": "gpt-4o-mini",
        "prompt": "say three words",
        "max_tokens": 4,
    });
    for (name, value) in extra.as_object().unwrap() {
        spec[name] = value.clone();
    }
    spec
}

/// What `key` has spent of a fixed-window budget of `max` per month,
/// named `rule`, on `redis` (a peek answers what a check at cost 1 would
/// leave).
async fn spent(redis: &RedisServer, rule: &str, max: u64, key: &str) -> u64 {
    let store = RedisStore::connect(&redis.url()).await.unwrap();
    let policy = format!("{max}/month")
        .parse::<Policy>()
        .unwrap()
        .fixed_window()
        .unwrap();
    let limiter = Limiter::new(store, policy).with_name(rule);
    let peek = limiter.peek(key).await.unwrap();
    max - (peek.remaining() + 1)
}

/// Wait until `done` holds, or fail after 5 s saying `what`.
async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    mut done: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_waits_out_a_rate_and_reads_the_headers() {
    let (_redis, upstream, gateway, _dir) = on_redis(
        r#"
        [[rules]]
        name = "key-requests"
        key = "header:x-gateway-key"
        policy = "1/s"
        algorithm = "gcra"

        [[rules]]
        name = "key-tokens"
        key = "header:x-gateway-key"
        policy = "1000 tokens/min"
        algorithm = "gcra"
        "#,
    )
    .await;
    let answer = sdk(spec(&gateway, "sk-red-one-secret", json!({"calls": 2}))).await;
    let [first, second] = [&answer["results"][0], &answer["results"][1]];
    assert_eq!(first["ok"], true, "{first}");
    let headers = &first["headers"];
    assert_eq!(headers["x-ratelimit-limit-requests"], "1", "{headers}");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "0", "{headers}");
    assert_eq!(headers["x-ratelimit-reset-requests"], "1s", "{headers}");
    assert_eq!(headers["x-ratelimit-limit-tokens"], "1000", "{headers}");
    // The estimate: "user" and "say three words" (19 bytes, 7 tokens) and
    // max_tokens 4.
    assert_eq!(headers["x-ratelimit-remaining-tokens"], "989", "{headers}");
    // The second call was refused `rate_limit_exceeded` with a
    // `retry-after-ms`, which the SDK waited before retrying it.
    assert_eq!(second["ok"], true, "{second}");
    assert!(second["elapsed"].as_f64().unwrap() > 0.5, "{second}");
    assert_eq!(
        upstream.count(),
        2,
        "a refused call never reaches the upstream"
    );
    // The refusal itself, as OpenAI writes it (two calls back to back, in
    // one SDK process: the second within the first's second).
    let answer = sdk(spec(
        &gateway,
        "sk-green-secret",
        json!({"calls": 2, "max_retries": 0}),
    ))
    .await;
    let refused = &answer["results"][1];
    assert_eq!(refused["status"], 429, "{refused}");
    assert_eq!(refused["error_class"], "RateLimitError");
    assert_eq!(refused["error_code"], "rate_limit_exceeded");
    assert_eq!(refused["error_type"], "requests");
    assert_eq!(refused["headers"]["retry-after"], "1", "{refused}");
    assert!(
        refused["headers"]["retry-after-ms"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            <= 1000
    );
    // Another key has its own.
    let other = sdk_once(spec(
        &gateway,
        "sk-red-two-secret",
        json!({"max_retries": 0}),
    ))
    .await;
    assert_eq!(other["ok"], true, "{other}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_budget_stops_the_sdk_and_is_charged_the_real_price() {
    let (redis, upstream, gateway, _dir) = on_redis(
        r#"
        [[rules]]
        name = "team-spend"
        key = "header:x-gateway-team"
        policy = "0.00005 USD/month"
        algorithm = "fixed-window"
        "#,
    )
    .await;
    // Each call is estimated at 7 + 2 × 4 = 15 micro-dollars and costs
    // 3 + 2 × 4 = 11: four fit in 50 (the fourth at 33 + 15 = 48), each
    // once the one before is settled.
    for n in 1..=4 {
        let ok = sdk_once(spec(&gateway, "sk-red-one-secret", json!({}))).await;
        assert_eq!(ok["ok"], true, "{ok}");
        eventually("the budget is charged the real price", || async {
            spent(&redis, "team-spend", 50, "red").await == 11 * n
        })
        .await;
    }
    let answer = sdk(spec(&gateway, "sk-red-one-secret", json!({"calls": 2}))).await;
    for refused in answer["results"].as_array().unwrap() {
        assert_eq!(refused["status"], 429, "{refused}");
        assert_eq!(refused["error_code"], "insufficient_quota", "{refused}");
        assert_eq!(refused["error_type"], "insufficient_quota");
        assert_eq!(refused["headers"]["x-should-retry"], "false");
        assert!(refused["headers"].get("retry-after").is_none(), "{refused}");
        // Not retried: no wait.
        assert!(refused["elapsed"].as_f64().unwrap() < 0.5, "{refused}");
    }
    assert_eq!(upstream.count(), 4, "a refused call is not retried");
    assert_eq!(spent(&redis, "team-spend", 50, "red").await, 44);
    // The other team's budget is its own.
    let green = sdk_once(spec(&gateway, "sk-green-secret", json!({}))).await;
    assert_eq!(green["ok"], true, "{green}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_settled_from_the_usage_chunk_the_client_did_not_ask_for() {
    let (redis, upstream, gateway, _dir) = on_redis(
        r#"
        [[rules]]
        name = "team-tokens"
        key = "header:x-gateway-team"
        policy = "100000 tokens/month"
        algorithm = "fixed-window"
        "#,
    )
    .await;
    let plain = sdk_once(spec(
        &gateway,
        "sk-red-one-secret",
        json!({"stream": true, "max_tokens": 8}),
    ))
    .await;
    assert_eq!(plain["ok"], true, "{plain}");
    assert_eq!(plain["text"], "w0 w1 w2 w3 w4");
    assert_eq!(plain["usage_chunks"], 0, "{plain}");
    assert_eq!(
        upstream.requests()[0]["stream_options"]["include_usage"],
        true
    );
    // 3 prompt tokens and 5 completion tokens, not the estimate of 7 + 8.
    eventually("the stream is charged its usage", || async {
        spent(&redis, "team-tokens", 100_000, "red").await == 8
    })
    .await;
    let asked = sdk_once(spec(
        &gateway,
        "sk-red-one-secret",
        json!({"stream": true, "include_usage": true}),
    ))
    .await;
    assert_eq!(asked["usage_chunks"], 1, "{asked}");
    assert_eq!(asked["usage"]["completion_tokens"], 4, "{asked}");
    eventually("the second stream too", || async {
        spent(&redis, "team-tokens", 100_000, "red").await == 15
    })
    .await;
    assert!(
        plain["headers"]["x-ratelimit-remaining-tokens"].is_null(),
        "a month is a budget, not a rate: no rate fields for it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_answers_cost_their_estimate_and_upstream_errors_nothing() {
    let (redis, upstream, gateway, _dir) = on_redis(
        r#"
        [[rules]]
        name = "team-tokens"
        key = "header:x-gateway-team"
        policy = "100000 tokens/month"
        algorithm = "fixed-window"
        "#,
    )
    .await;
    let mut expected = 0;
    for (usage, stream) in [
        (Usage::Missing, false),
        (Usage::Missing, true),
        (Usage::Garbage, false),
        (Usage::Huge, true),
    ] {
        upstream.set(Behaviour {
            usage,
            ..Behaviour::default()
        });
        let result = sdk_once(spec(&gateway, "sk-blue-secret", json!({"stream": stream}))).await;
        assert_eq!(result["ok"], true, "{result}");
        // The estimate: 7 prompt tokens and max_tokens 4.
        expected += 11;
        eventually("a bad answer is charged its estimate", || async {
            spent(&redis, "team-tokens", 100_000, "blue").await == expected
        })
        .await;
    }
    let logged = gateway.logged();
    assert!(
        logged.contains("reported no usage; charging its estimate"),
        "{logged}"
    );
    assert!(
        logged.contains("usage does not read; charging its estimate"),
        "{logged}"
    );
    // An upstream error: nothing billable was produced.
    upstream.set(Behaviour {
        status: Some(500),
        ..Behaviour::default()
    });
    let failed = sdk_once(spec(&gateway, "sk-blue-secret", json!({"max_retries": 0}))).await;
    assert_eq!(failed["status"], 500, "{failed}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        spent(&redis, "team-tokens", 100_000, "blue").await,
        expected
    );
    // A stream cut after two words by a silent upstream (the client
    // times out and goes): the prompt's estimate and what was streamed.
    upstream.set(Behaviour {
        stall_after: Some(2),
        ..Behaviour::default()
    });
    let cut = sdk_once(spec(
        &gateway,
        "sk-blue-secret",
        json!({"stream": true, "max_retries": 0, "timeout": 1}),
    ))
    .await;
    assert_eq!(cut["ok"], false, "{cut}");
    eventually("a cut stream is charged what it streamed", || async {
        spent(&redis, "team-tokens", 100_000, "blue").await == expected + 7 + 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_unknown_keys_and_models_are_refused_before_anything_is_spent() {
    let (redis, upstream, gateway, _dir) = on_redis(
        r#"
        [[rules]]
        name = "team-spend"
        key = "header:x-gateway-team"
        policy = "1 USD/month"
        algorithm = "fixed-window"
        "#,
    )
    .await;
    let unknown_key = sdk_once(spec(&gateway, "sk-nobody-secret", json!({}))).await;
    assert_eq!(unknown_key["status"], 401, "{unknown_key}");
    assert_eq!(unknown_key["error_code"], "invalid_api_key");
    let unknown_model = sdk_once(spec(
        &gateway,
        "sk-red-one-secret",
        json!({"model": "gpt-9"}),
    ))
    .await;
    assert_eq!(unknown_model["status"], 404, "{unknown_model}");
    assert_eq!(unknown_model["error_code"], "model_not_found");
    let client = reqwest_free_client();
    for body in [
        "not json",
        r#"{"model": "gpt-4o-mini"}"#,
        r#"{"model": "gpt-4o-mini", "messages": [], "max_tokens": -1}"#,
    ] {
        let (status, text) = post(
            &client,
            &gateway,
            "/chat/completions",
            "sk-red-one-secret",
            &[],
            body,
        )
        .await;
        assert_eq!(status, 400, "{body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error", "{text}");
    }
    assert_eq!(upstream.count(), 0);
    assert_eq!(spent(&redis, "team-spend", 1_000_000, "red").await, 0);
    // A client naming another team spends its own team's budget: the
    // gateway sets the hierarchy from the keys file, whatever it sent.
    // Nor can it reach what the gateway does not limit.
    for path in ["/responses", "/images/generations", "/chat/complet%69ons"] {
        let (status, _) = post(&client, &gateway, path, "sk-red-one-secret", &[], "{}").await;
        assert_eq!(status, 404, "{path}");
    }
    assert_eq!(upstream.count(), 0);
    let (status, _) = post(
        &client,
        &gateway,
        "/chat/completions",
        "sk-red-one-secret",
        &[("x-gateway-team", "blue"), ("openai-organization", "org-theirs")],
        r#"{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#,
    )
    .await;
    assert_eq!(status, 200);
    eventually("the red team paid", || async {
        spent(&redis, "team-spend", 1_000_000, "red").await > 0
    })
    .await;
    assert_eq!(spent(&redis, "team-spend", 1_000_000, "blue").await, 0);
    let received = upstream.received();
    assert_eq!(
        received[0].headers["authorization"],
        "Bearer sk-upstream-of-the-gateway"
    );
    assert!(received[0].headers.get("x-gateway-team").is_none());
    assert!(received[0].headers.get("openai-organization").is_none());
    let logged = gateway.logged();
    for secret in ["sk-red-one-secret", "sk-nobody-secret"] {
        assert!(!logged.contains(secret), "a key in the logs: {logged}");
    }
}

/// An HTTP/1 client of the tests' own requests.
fn reqwest_free_client()
-> hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, String> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// `POST /v1{path}` with `body`: the status and the body.
async fn post(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        String,
    >,
    gateway: &Gateway,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    use http_body_util::BodyExt;
    let mut request = http::Request::post(format!("{}{path}", gateway.base_url()))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = client
        .request(request.body(body.to_owned()).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A webhook receiver: every notice POSTed to it.
struct Webhook {
    url: String,
    notices: Arc<Mutex<Vec<Value>>>,
}

impl Webhook {
    async fn start() -> Self {
        let notices = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&notices);
        let app = Router::new().route(
            "/notices",
            axum::routing::post(move |axum::Json(notice): axum::Json<Value>| {
                let kept = Arc::clone(&kept);
                async move {
                    kept.lock().unwrap().push(notice);
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/notices", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, notices }
    }
}

/// The budgets of the two-gateway test (micro-dollars a month).
const TEAM_BUDGET: u64 = 400;
const ORG_BUDGET: u64 = 1_000;
const THRESHOLDS: [u64; 4] = [50, 80, 95, 100];

/// Two gateways on one store, 50 concurrent streams across three teams
/// of one organisation: the spend of each team and of the organisation
/// stays within its budget but for the overrun of requests in flight past
/// their estimates, and every threshold crossed is told exactly once.
async fn two_gateways_keep_three_teams_within_budget(store: (&'static str, String)) {
    let upstream = OpenAiUpstream::start().await;
    // Every answer overruns its estimate: 20 words for max_tokens 10.
    upstream.set(Behaviour {
        completion_tokens: Some(20),
        token_delay: Duration::from_millis(10),
        ..Behaviour::default()
    });
    let webhook = Webhook::start().await;
    let rules = format!(
        r#"
        [[rules]]
        name = "team-spend"
        key = "header:x-gateway-team"
        policy = "{} USD/month"
        algorithm = "fixed-window"
        notify = [50, 80, 95, 100]

        [[rules]]
        name = "org-spend"
        key = "header:x-gateway-org"
        policy = "{} USD/month"
        algorithm = "fixed-window"
        notify = [50, 80, 95, 100]
        "#,
        TEAM_BUDGET as f64 / 1e6,
        ORG_BUDGET as f64 / 1e6,
    );
    let env = [store, ("WEBHOOK_URL", webhook.url.clone())];
    let (first, _dir) = Gateway::start(&upstream, &rules, &env);
    let (second, _dir2) = Gateway::start(&upstream, &rules, &env);
    let keys = [
        "sk-red-one-secret",
        "sk-red-two-secret",
        "sk-green-secret",
        "sk-blue-secret",
    ];
    let teams = ["red", "red", "green", "blue"];
    let specs: Vec<Value> = (0..50)
        .map(|i| {
            let gateway = if i % 2 == 0 { &first } else { &second };
            spec(
                gateway,
                keys[i % 4],
                json!({"stream": true, "include_usage": true, "max_tokens": 10, "max_retries": 0}),
            )
        })
        .collect();
    // One SDK process, a thread a call: all 50 at once.
    let answer = sdk(json!({ "concurrent": specs })).await;
    let calls = answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .cloned()
        .enumerate();
    // Each answer's price: prompt tokens and twice the completion tokens.
    let mut spent: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut admitted, mut refused, mut overrun) = (0, 0, 0u64);
    for (i, result) in calls {
        let k = i % 4;
        if result["ok"] == true {
            let usage = &result["usage"];
            let price = usage["prompt_tokens"].as_u64().unwrap()
                + 2 * usage["completion_tokens"].as_u64().unwrap();
            *spent.entry(teams[k]).or_default() += price;
            *spent.entry("acme").or_default() += price;
            admitted += 1;
            // The estimate: 7 prompt tokens and 10 of output.
            overrun = overrun.max(price.saturating_sub(7 + 20));
        } else {
            assert_eq!(result["error_code"], "insufficient_quota", "{result}");
            refused += 1;
        }
    }
    assert!(
        admitted > 0 && refused > 0,
        "{admitted} admitted, {refused} refused"
    );
    // At most every request in flight at once overran past its estimate.
    for (who, budget) in [
        ("red", TEAM_BUDGET),
        ("green", TEAM_BUDGET),
        ("blue", TEAM_BUDGET),
        ("acme", ORG_BUDGET),
    ] {
        let spent = spent.get(who).copied().unwrap_or(0);
        eprintln!(
            "{}: {who} spent {spent} of {budget} micro-dollars (overspend {})",
            env[0].0,
            spent.saturating_sub(budget)
        );
        assert!(spent <= budget + 50 * overrun, "{who}: {spent} of {budget}");
    }
    // Every threshold crossed told once, across both gateways: told
    // within 5 s, and none more 300 ms later.
    let crossings: Vec<(&str, &str, u64)> = [
        ("team-spend", "red", TEAM_BUDGET),
        ("team-spend", "green", TEAM_BUDGET),
        ("team-spend", "blue", TEAM_BUDGET),
        ("org-spend", "acme", ORG_BUDGET),
    ]
    .into_iter()
    .flat_map(|(rule, who, budget)| {
        let spent = spent.get(who).copied().unwrap_or(0);
        THRESHOLDS
            .into_iter()
            .filter(move |t| spent * 100 >= t * budget)
            .map(move |t| (rule, who, t))
    })
    .collect();
    let told = |notices: &[Value], (rule, who, threshold): (&str, &str, u64)| {
        notices
            .iter()
            .filter(|n| n["rule"] == rule && n["key"] == who && n["threshold"] == threshold)
            .count()
    };
    eventually("every threshold crossed is told", || async {
        let notices = webhook.notices.lock().unwrap().clone();
        crossings.iter().all(|c| told(&notices, *c) > 0)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let notices = webhook.notices.lock().unwrap().clone();
    for (rule, who, budget) in [
        ("team-spend", "red", TEAM_BUDGET),
        ("team-spend", "green", TEAM_BUDGET),
        ("team-spend", "blue", TEAM_BUDGET),
        ("org-spend", "acme", ORG_BUDGET),
    ] {
        let spent = spent.get(who).copied().unwrap_or(0);
        for threshold in THRESHOLDS {
            let told = told(&notices, (rule, who, threshold));
            let crossed = spent * 100 >= threshold * budget;
            eprintln!("{rule} {who} {threshold}%: crossed {crossed}, told {told}");
            // A share the spend crossed is told once. One it did not may
            // have been told once too: a notice counts the estimates of
            // requests in flight, and a request the organisation denied
            // held its estimate at its team for a round trip.
            if crossed {
                assert_eq!(told, 1, "{rule} {who} {threshold}%: {notices:?}");
            } else {
                assert!(told <= 1, "{rule} {who} {threshold}%: {notices:?}");
            }
        }
    }
    assert_eq!(upstream.count(), admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_redis_keep_three_teams_within_budget() {
    let redis = RedisServer::start();
    two_gateways_keep_three_teams_within_budget(("REDIS_URL", redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_postgres_keep_three_teams_within_budget() {
    let postgres = crate::support::postgres::PostgresServer::start();
    two_gateways_keep_three_teams_within_budget(("DATABASE_URL", postgres.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_rules_and_keys_serve_in_memory() {
    let upstream = OpenAiUpstream::start().await;
    let root = env!("CARGO_MANIFEST_DIR");
    let gateway = Gateway::spawn(&[
        ("RULES", format!("{root}/examples/ai_gateway/rules.toml")),
        ("KEYS", format!("{root}/examples/ai_gateway/keys.toml")),
        ("UPSTREAM_URL", upstream.url()),
    ]);
    let result = sdk_once(spec(
        &gateway,
        "sk-demo-alice-0001",
        json!({"stream": true}),
    ))
    .await;
    assert_eq!(result["ok"], true, "{result}");
    assert_eq!(result["headers"]["x-ratelimit-limit-requests"], "60");
    assert_eq!(result["headers"]["x-ratelimit-remaining-requests"], "59");
    assert_eq!(result["headers"]["x-ratelimit-limit-tokens"], "200000");
}

#[test]
fn a_bad_setting_exits_2_naming_it() {
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join("examples/ai_gateway");
    let dir = Scratch::new();
    let rules = dir.file(
        "rules.toml",
        "[[rules]]\nname = \"spend\"\nkey = \"global\"\npolicy = \"5 USD/day\"\n",
    );
    let keys = dir.file("keys.toml", KEYS);
    for (env, named) in [
        (vec![], "UPSTREAM_URL"),
        (vec![("UPSTREAM_URL", "ftp://x")], "UPSTREAM_URL"),
        (vec![("UPSTREAM_URL", "http://127.0.0.1:1")], "RULES"),
        (
            vec![
                ("UPSTREAM_URL", "http://127.0.0.1:1"),
                ("RULES", rules.as_str()),
            ],
            "KEYS",
        ),
        (
            vec![
                ("UPSTREAM_URL", "http://127.0.0.1:1"),
                ("RULES", rules.as_str()),
                ("KEYS", keys.as_str()),
            ],
            "RULES",
        ),
    ] {
        let output = Command::new(&binary)
            .env_clear()
            .envs(env.clone())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.starts_with(named), "{env:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_router_shows_each_levels_spend() {
    let redis = RedisServer::start();
    let upstream = OpenAiUpstream::start().await;
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let token = "3f9c2a7e1b8d4c6f0a5e9d2b7c4f1a8e6d3b0c9f2e5a8d1c4b7e0f3a6d9c2b5e";
    let (gateway, _dir) = Gateway::start(
        &upstream,
        r#"
        [[rules]]
        name = "team-spend"
        key = "header:x-gateway-team"
        policy = "1 USD/month"
        algorithm = "fixed-window"
        "#,
        &[
            ("REDIS_URL", redis.url()),
            ("ADMIN_BIND", format!("127.0.0.1:{admin_port}")),
            ("ADMIN_TOKEN", token.to_owned()),
        ],
    );
    let result = sdk_once(spec(&gateway, "sk-red-two-secret", json!({}))).await;
    assert_eq!(result["ok"], true, "{result}");
    let client = reqwest_free_client();
    let url = format!("http://127.0.0.1:{admin_port}/api/limits/team-spend/keys/red");
    let mut peeked = Value::Null;
    for _ in 0..50 {
        use http_body_util::BodyExt;
        let request = http::Request::get(&url)
            .header("authorization", format!("Bearer {token}"))
            .body(String::new())
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        peeked = serde_json::from_slice(&bytes).unwrap();
        if peeked["spent"] == 11 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // 3 prompt tokens at a micro-dollar and 4 answered at two.
    assert_eq!(peeked["spent"], 11, "{peeked}");
    assert_eq!(peeked["unit"], "money");
    assert_eq!(peeked["currency"], "USD");
    assert_eq!(peeked["state"]["limit"], 1_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_from_the_keys_file_is_refused_within_seconds() {
    let upstream = OpenAiUpstream::start().await;
    let (gateway, dir) = Gateway::start(
        &upstream,
        "[[rules]]\nname = \"key-requests\"\nkey = \"header:x-gateway-key\"\npolicy = \"100/min\"\n",
        &[],
    );
    let blue = || sdk_once(spec(&gateway, "sk-blue-secret", json!({"max_retries": 0})));
    assert_eq!(blue().await["ok"], true);
    // A file that does not read: the keys in force stay.
    dir.file("keys.toml", "[keys.\"sk-blue-secret\"\nbroken");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(blue().await["ok"], true);
    assert!(
        gateway
            .logged()
            .contains("does not read; the keys in force stay")
    );
    assert!(
        !gateway.logged().contains("sk-blue-secret"),
        "a key in the logs"
    );
    // Blue revoked.
    let without_blue = KEYS.split("[keys.\"sk-blue-secret\"]").next().unwrap();
    dir.file("keys.toml", without_blue);
    let start = Instant::now();
    loop {
        let result = blue().await;
        if result["status"] == 401 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still admitted: {result}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let red = sdk_once(spec(&gateway, "sk-red-one-secret", json!({}))).await;
    assert_eq!(red["ok"], true, "{red}");
}
