//! `examples/llm_gateway.rs` run as processes on a real Redis: streamed
//! tokens charged exactly against a `max_tokens` estimate, a client that
//! disconnects halfway charged what was streamed, two gateways sharing a
//! key's budgets, and a spent monthly budget answered 429 until the next
//! month.
//!
//! The example's binary is built by `cargo test` (every target); run alone,
//! build it first with `cargo build --all-features --example llm_gateway`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tower_redis_ratelimit::{Limiter, Policy, RedisStore};

use crate::support::RedisServer;

/// A running gateway on a free port, sharing `REDIS_URL`; killed when dropped.
struct Gateway {
    child: Child,
    addr: String,
}

impl Gateway {
    fn start(redis: &RedisServer) -> Self {
        let exe = std::env::current_exe().unwrap();
        let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
        let binary: PathBuf = debug.join("examples").join("llm_gateway");
        assert!(
            binary.exists(),
            "{} is missing: build it with `cargo build --all-features --example llm_gateway` \
             (`cargo test` builds it)",
            binary.display()
        );
        let mut child = Command::new(binary)
            .env_clear()
            .env("BIND", "127.0.0.1:0")
            .env("REDIS_URL", redis.url())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
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
            .expect("the gateway says where it listens");
        Self { child, addr }
    }

    /// `POST /v1/completions` with `headers` and the prompt `prompt`, its
    /// head read: the answer streams on.
    fn complete(&self, headers: &[(&str, &str)], prompt: &str) -> Completion {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut request = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\
             Content-Length: {}\r\n",
            prompt.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(prompt);
        stream.write_all(request.as_bytes()).unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            let Some((name, value)) = line.trim_end().split_once(':') else {
                break;
            };
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        Completion {
            status,
            headers,
            reader,
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer whose head was read; its events read as the test asks.
struct Completion {
    status: u16,
    headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
}

impl Completion {
    fn header(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(|| panic!("no {name} in {:?}", self.headers), |(_, v)| v)
    }

    /// The next token, `None` once the usage event (or the end) came. (The
    /// chunk-size lines of the chunked encoding are skipped with the
    /// events' blank lines.)
    fn token(&mut self) -> Option<String> {
        let mut usage = false;
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line).unwrap() == 0 {
                return None;
            }
            let line = line.trim_end();
            if line == "event: usage" {
                usage = true;
            } else if let Some(data) = line.strip_prefix("data: ") {
                return (!usage).then(|| data.to_owned());
            }
        }
    }

    /// Every token to the end.
    fn tokens(mut self) -> Vec<String> {
        std::iter::from_fn(|| self.token()).collect()
    }

    /// The body, for an answer that is not a stream.
    fn text(mut self) -> String {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut self.reader, &mut text).unwrap();
        text
    }
}

/// A prompt of `words` words: the simulated model streams one token per word.
fn prompt(words: usize) -> String {
    (0..words)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The example's monthly budget as a limiter of the same name, algorithm and
/// policy: it reads (and spends) the counts the gateways keep.
struct Month {
    runtime: tokio::runtime::Runtime,
    limiter: Limiter,
}

impl Month {
    const MAX: u64 = 1_000_000;

    fn of(redis: &RedisServer) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = runtime.block_on(RedisStore::connect(&redis.url())).unwrap();
        let policy: Policy = "1000000/month".parse().unwrap();
        let limiter = Limiter::new(store, policy).with_name("tokens-per-month");
        Self { runtime, limiter }
    }

    /// The tokens `key` used this month (a peek answers what a check at
    /// the policy's cost, 1, would leave).
    fn used(&self, key: &str) -> u64 {
        let peek = self.runtime.block_on(self.limiter.peek(key)).unwrap();
        Self::MAX - (peek.remaining() + 1)
    }

    /// Wait until `key` used `expected` tokens this month (the gateway
    /// settles in a task after the stream ends), at most 2 s.
    fn settles_to(&self, key: &str, expected: u64) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let used = self.used(key);
            if used == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{key} used {used} tokens, expected {expected}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn streamed_tokens_are_charged_exactly_against_the_estimate() {
    let redis = RedisServer::start();
    let month = Month::of(&redis);
    let gateway = Gateway::start(&redis);

    // No key: refused before anything is counted.
    let refused = gateway.complete(&[("x-max-tokens", "500")], "hello");
    assert_eq!(refused.status, 401);
    assert!(refused.text().contains("API key"));
    assert_eq!(redis.command(&["DBSIZE"]).trim(), ":0");

    // Admitted against its 500 estimate, in tokens...
    let auth = [("authorization", "Bearer key-1"), ("x-max-tokens", "500")];
    let mut answer = gateway.complete(&auth, &prompt(120));
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), "text/event-stream");
    assert_eq!(answer.header("x-ratelimit-limit"), "20000");
    assert_eq!(answer.header("x-ratelimit-remaining"), "19500");
    assert_eq!(answer.token().as_deref(), Some("w0"));
    assert_eq!(month.used("key-1"), 500, "the estimate, while it streams");
    // ...and charged the 120 it streamed.
    assert_eq!(answer.tokens().len(), 119);
    month.settles_to("key-1", 120);

    // The same key through `x-api-key`: the same budget.
    let answer = gateway.complete(&[("x-api-key", "key-1")], &prompt(30));
    assert_eq!(answer.tokens().len(), 30);
    month.settles_to("key-1", 150);
    assert_eq!(month.used("key-2"), 0);
}

#[test]
fn a_client_that_disconnects_halfway_pays_for_what_was_streamed() {
    let redis = RedisServer::start();
    let month = Month::of(&redis);
    let gateway = Gateway::start(&redis);
    let mut answer = gateway.complete(
        &[("x-api-key", "key-1"), ("x-max-tokens", "500")],
        &prompt(200),
    );
    for i in 0..60 {
        assert_eq!(answer.token(), Some(format!("w{i}")));
    }
    drop(answer);
    // The gateway sees the connection close (hyper reads its end) while
    // the next token is 20 ms away, and drops the stream: charged the 60
    // received (a token or two more only if they were already on their
    // way when the client closed, on a loaded machine).
    std::thread::sleep(Duration::from_millis(500));
    let used = month.used("key-1");
    eprintln!("charged {used} tokens for 60 received");
    assert!((60..=62).contains(&used), "charged {used} for 60 received");
    // Settled once: nothing moves after.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(month.used("key-1"), used);
}

#[test]
fn two_gateways_share_a_keys_budgets_through_redis() {
    let redis = RedisServer::start();
    let month = Month::of(&redis);
    let (a, b) = (Gateway::start(&redis), Gateway::start(&redis));
    // Estimates of 10,000 each (the most one request is estimated at) on
    // both gateways: the minute's 20,000 is taken, in both.
    let key = [("x-api-key", "key-1"), ("x-max-tokens", "10000")];
    let mut on_a = a.complete(&key, &prompt(50));
    assert_eq!(on_a.status, 200);
    assert_eq!(on_a.header("x-ratelimit-remaining"), "10000");
    let on_b = b.complete(&key, &prompt(40));
    assert_eq!(on_b.status, 200);
    let remaining: u64 = on_b.header("x-ratelimit-remaining").parse().unwrap();
    assert!(remaining < 1000, "B sees A's estimate: {remaining} left");
    let denied = a.complete(&[("x-api-key", "key-1"), ("x-max-tokens", "2000")], "hi");
    assert_eq!(denied.status, 429);
    let retry: u64 = denied.header("retry-after").parse().unwrap();
    assert!((1..=6).contains(&retry), "retry-after {retry}");
    assert_eq!(month.used("key-1"), 20_000, "two estimates, not the denied");

    // Both settle to what they streamed: the month holds 90 tokens.
    assert_eq!(on_a.token().as_deref(), Some("w0"));
    assert_eq!(on_a.tokens().len(), 49);
    assert_eq!(on_b.tokens().len(), 40);
    month.settles_to("key-1", 90);
    // And the minute has room again, in either gateway.
    let answer = b.complete(&key, "hi");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.tokens().len(), 1);
    month.settles_to("key-1", 91);
}

#[test]
fn a_key_over_its_monthly_budget_gets_429_with_retry_after() {
    let redis = RedisServer::start();
    let month = Month::of(&redis);
    let gateway = Gateway::start(&redis);
    // 999,900 of the month's tokens spent (as an operator's penalty would).
    month
        .runtime
        .block_on(month.limiter.penalty("key-1", 999_900))
        .unwrap();

    let denied = gateway.complete(&[("x-api-key", "key-1"), ("x-max-tokens", "500")], "hi");
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("x-ratelimit-limit"), "1000000");
    // Until the month ends (UTC).
    let utc = jiff::tz::TimeZone::UTC;
    let now = jiff::Timestamp::now();
    let this_month = now.to_zoned_datetime(utc.clone()).date().first_of_month();
    let next_month = this_month.checked_add(jiff::Span::new().months(1)).unwrap();
    let boundary = next_month.to_zoned_datetime(utc).unwrap().timestamp();
    let expected = boundary.as_second() - now.as_second();
    let retry: i64 = denied.header("retry-after").parse().unwrap();
    assert!(
        (expected..=expected + 2).contains(&retry),
        "retry-after {retry}, {expected} s to the month's end"
    );
    assert!(
        denied
            .text()
            .contains(&format!("the limit is 1000000/month. Retry in {retry} s")),
    );
    assert_eq!(month.used("key-1"), 999_900, "a denial costs nothing");

    // The 100 left admit an estimate of 100, which settles to what streamed.
    let answer = gateway.complete(&[("x-api-key", "key-1"), ("x-max-tokens", "100")], "a b c");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.tokens().len(), 3);
    month.settles_to("key-1", 999_903);
    // Another key has its own month.
    let other = gateway.complete(&[("x-api-key", "key-2"), ("x-max-tokens", "500")], "hi");
    assert_eq!(other.status, 200);
}
