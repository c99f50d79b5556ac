//! An LLM gateway: a streamed completion limited per API key to tokens per
//! minute and per month, each request admitted against its `max_tokens`
//! and charged the tokens it really streamed.
//!
//! ```sh
//! cargo run --example llm_gateway                                  # in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example llm_gateway  # shared through Redis
//! ```
//!
//! The simulated model answers by echoing the prompt, a word per token,
//! as server-sent events, then a `usage` event:
//!
//! ```text
//! $ curl -N -H 'authorization: Bearer key-1' -H 'x-max-tokens: 500' \
//!     -d 'the quick brown fox' http://127.0.0.1:3000/v1/completions -i
//! HTTP/1.1 200 OK
//! content-type: text/event-stream
//! x-ratelimit-limit: 20000
//! x-ratelimit-remaining: 19500
//! x-ratelimit-reset: 2
//!
//! data: the
//!
//! data: quick
//!
//! data: brown
//!
//! data: fox
//!
//! event: usage
//! data: {"completion_tokens":4}
//! ```
//!
//! The fields count tokens: the 500 estimated were taken at admission; as
//! the stream ends, the 496 it did not use are given back. A client that
//! disconnects pays for the tokens streamed to it. The key can also be
//! sent as `x-api-key: key-1`; a request with neither is answered `401`.
//! Once a budget is spent (a minute's 20,000 tokens, or a month's
//! 1,000,000 — or less left than `x-max-tokens` asks for):
//!
//! ```text
//! HTTP/1.1 429 Too Many Requests
//! x-ratelimit-limit: 1000000
//! x-ratelimit-remaining: 120
//! x-ratelimit-reset: 1296000
//! retry-after: 1296000
//!
//! Too many requests: the limit is 1000000/month. Retry in 1296000 s.
//! ```
//!
//! `BIND` (default `127.0.0.1:3000`) sets the address; an empty variable
//! counts as unset.

use std::convert::Infallible;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{Next, from_fn};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::{Stream, StreamExt, stream};
use http::{HeaderMap, HeaderValue, StatusCode};
use tower_redis_ratelimit::response::BodyPart;
use tower_redis_ratelimit::rules::{RuleSet, Rules, RulesError, RulesLayer};
use tower_redis_ratelimit::{MemoryStore, RedisStore, Store};

/// The budgets of every API key. One rule set rather than two stacked
/// layers: both rules are checked in one round trip, a request one of them
/// denies takes nothing from the other, and the response shows the budget
/// that matters (the one with the fewest tokens left, or the one that
/// denied). The minute is GCRA (no burst at a window's edge); the month is
/// a calendar month, UTC. A rule's cost is the estimate, here replaced by
/// the request's `x-max-tokens`, and `settle = { body = true }` charges
/// what the body meter counts instead.
const RULES: &str = r#"
[[rules]]
name = "tokens-per-minute"
path = "/v1/completions"
key = "header:x-api-key"
policy = "20000/min"
algorithm = "gcra"
settle = { body = true }

[[rules]]
name = "tokens-per-month"
path = "/v1/completions"
key = "header:x-api-key"
policy = "1000000/month"
algorithm = "fixed-window"
settle = { body = true }
"#;

/// The `max_tokens` of a request without `x-max-tokens`.
const DEFAULT_MAX_TOKENS: u64 = 1000;

/// How long the simulated model takes per token.
const TOKEN_DELAY: Duration = Duration::from_millis(20);

/// The gateway's routes, limited by the rules in `store`.
fn gateway<St: Store>(store: St) -> Result<Router, RulesError> {
    let rules = Rules::new(store, RuleSet::from_toml(RULES)?);
    let limits = RulesLayer::new(rules)
        .with_cost(|_rule, headers| Some(max_tokens(headers)))
        .with_meter(tokens_streamed);
    Ok(Router::new()
        .route("/v1/completions", post(complete))
        .layer(limits)
        // Outermost: a request without a key is refused before it is limited.
        .layer(from_fn(authenticate)))
}

/// The request's `x-max-tokens`, else the default. (An estimate above
/// `policy::MAX_COST`, 10,000, is taken as 10,000: the settlement charges
/// the rest.)
fn max_tokens(headers: &HeaderMap) -> u64 {
    headers
        .get("x-max-tokens")
        .and_then(|value| value.to_str().ok()?.parse().ok())
        .unwrap_or(DEFAULT_MAX_TOKENS)
}

/// The body meter: the tokens in a part of the stream, one per `data:`
/// line, but for the `usage` event's. (Each event is a data frame; a frame
/// without tokens counts 0, so a finished stream always reports.)
fn tokens_streamed(part: BodyPart<'_>) -> Option<u64> {
    let BodyPart::Data(bytes) = part else {
        return None;
    };
    let lines = bytes.split(|&b| b == b'\n');
    let (mut data, mut usage) = (0, 0);
    for line in lines {
        data += u64::from(line.starts_with(b"data:"));
        usage += u64::from(line == b"event: usage");
    }
    Some(data.saturating_sub(usage))
}

/// The API key, from `authorization: Bearer <key>` or `x-api-key`; `401`
/// without one. (A real gateway checks it against its accounts here.)
async fn authenticate(mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok()?.strip_prefix("Bearer "))
        .and_then(|key| HeaderValue::from_str(key.trim()).ok());
    let key = bearer.or_else(|| headers.get("x-api-key").cloned());
    let Some(key) = key.filter(|key| !key.is_empty()) else {
        return (
            StatusCode::UNAUTHORIZED,
            "an API key is needed: `authorization: Bearer <key>` or `x-api-key: <key>`\n",
        )
            .into_response();
    };
    // The rules count per `x-api-key`, however the key was sent.
    request.headers_mut().insert("x-api-key", key);
    next.run(request).await
}

/// `POST /v1/completions`: the prompt is the body; the answer streams.
async fn complete(headers: HeaderMap, prompt: String) -> impl IntoResponse {
    Sse::new(simulated_model(prompt, max_tokens(&headers)))
}

/// A model that echoes the prompt, a word per token and at most
/// `max_tokens`, then reports its usage.
fn simulated_model(
    prompt: String,
    max_tokens: u64,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let words: Vec<String> = prompt
        .split_whitespace()
        .take(usize::try_from(max_tokens).unwrap_or(usize::MAX))
        .map(str::to_owned)
        .collect();
    let usage = format!(r#"{{"completion_tokens":{}}}"#, words.len());
    let tokens = stream::iter(words).then(|word| async move {
        tokio::time::sleep(TOKEN_DELAY).await;
        Ok(Event::default().data(word))
    });
    tokens.chain(stream::once(async move {
        Ok(Event::default().event("usage").data(usage))
    }))
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
    let app = match var("REDIS_URL") {
        None => gateway(MemoryStore::new()),
        Some(url) => match RedisStore::connect(&url).await {
            Ok(store) => gateway(store),
            Err(error) => {
                eprintln!("REDIS_URL: cannot use Redis: {error}");
                return ExitCode::from(2);
            }
        },
    };
    let app = match app {
        Ok(app) => app,
        Err(error) => {
            eprintln!("rules: {error}");
            return ExitCode::from(2);
        }
    };
    let bind = var("BIND").unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    let listener = match tokio::net::TcpListener::bind(&bind).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("BIND: cannot listen on {bind:?}: {error}");
            return ExitCode::from(2);
        }
    };
    match listener.local_addr() {
        Ok(addr) => tracing::info!("listening on http://{addr}"),
        Err(_) => tracing::info!("listening on http://{bind}"),
    }
    if let Err(error) = axum::serve(listener, app).await {
        eprintln!("server error: {error}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
