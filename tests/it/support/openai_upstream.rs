//! A fake upstream that speaks OpenAI's wire format, served in process by
//! axum on a free loopback port: what an AI gateway forwards to in the
//! tests. Not a model: its answers are made of words (`w0 w1 ...`) and
//! its usage counts words, so a test knows every number in advance.
//!
//! - `POST /v1/chat/completions`: `chat.completion` objects, or (with
//!   `"stream": true`) server-sent `chat.completion.chunk`s: one per word,
//!   then one with `finish_reason: "stop"`, then — only when
//!   `stream_options.include_usage` is true — one with `"choices": []` and
//!   the usage, then `data: [DONE]`. While include_usage is set, every other
//!   chunk carries `"usage": null`, as OpenAI's do.
//! - `POST /v1/completions`: the legacy `text_completion` objects, streamed
//!   alike.
//! - `POST /v1/embeddings`: a `list` of three-number embeddings (`0.0, 0.1,
//!   0.2`), as floats or, when the request's `encoding_format` is `base64`
//!   (the official Python SDK's default), as base64 of little-endian `f32`s.
//!
//! Prompt tokens are the whitespace-separated words of the request's text
//! (the messages' contents, the prompt, the input), at least 1. The answer
//! has [`Behaviour::completion_tokens`] words, by default
//! min(`max_tokens` or `max_completion_tokens`, 5). What it answers is
//! changed at run time with [`OpenAiUpstream::set`]; every request is kept
//! ([`OpenAiUpstream::requests`], [`OpenAiUpstream::received`]).
//!
//! The formats follow openai-python's types (`ChatCompletion`,
//! `ChatCompletionChunk`, `Completion`, `CreateEmbeddingResponse`,
//! `CompletionUsage`); the SDK parses every answer (`tests/it/ai_gateway_sdk.rs`
//! checks it with the SDK itself).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use axum::routing::post;
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// What the upstream reports as a response's usage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Usage {
    /// The real thing: prompt, completion and total tokens, with the
    /// details objects OpenAI sends.
    #[default]
    Normal,
    /// No usage at all: no `usage` field in an answer, and in a stream no
    /// usage chunk (nor `"usage": null`) even when the request asked.
    Missing,
    /// A usage object with strings for numbers:
    /// `"completion_tokens": "lots"`, `"total_tokens": "lots"`.
    Garbage,
    /// `"completion_tokens": 1000000000000000000` (10^18, as a JSON number),
    /// the total likewise huge: a count no budget can hold.
    Huge,
}

/// How the upstream answers; `Default` answers normally and at once.
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    /// The usage it reports.
    pub usage: Usage,
    /// Answer every request with this status and OpenAI's error JSON
    /// (`{"error":{"message":..,"type":"server_error","param":null,"code":null}}`)
    /// instead.
    pub status: Option<u16>,
    /// The pause before each streamed chunk after the first (a
    /// non-streamed answer waits this long per word before it is sent).
    pub token_delay: Duration,
    /// A stream sends this many content chunks, then hangs forever without
    /// ending (until the client goes away); a non-streamed request is
    /// never answered.
    pub stall_after: Option<usize>,
    /// How many words (completion tokens) to answer; by default
    /// min(`max_tokens` or `max_completion_tokens`, 5), 5 when neither is
    /// given.
    pub completion_tokens: Option<u64>,
    /// Reported as `prompt_tokens_details.cached_tokens` (0 by default).
    pub cached_tokens: u64,
    /// Headers added to every answer (an error's too), e.g. the
    /// `x-ratelimit-*` headers OpenAI sends.
    pub headers: Vec<(String, String)>,
}

/// One request as the upstream received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// The request's path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// Its headers (`authorization` among them).
    pub headers: HeaderMap,
    /// Its body parsed as JSON (a JSON string of the raw text when it is
    /// not JSON).
    pub body: Value,
}

/// What the handlers share with the test.
#[derive(Debug, Default)]
struct Shared {
    behaviour: Mutex<Behaviour>,
    received: Mutex<Vec<Received>>,
    ids: AtomicU64,
}

/// A running fake upstream on `127.0.0.1`; it stops when dropped (streams
/// already answering end when their client goes away).
#[derive(Debug)]
pub struct OpenAiUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::AbortHandle,
}

impl Drop for OpenAiUpstream {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl OpenAiUpstream {
    /// Start one on a free loopback port, answering normally.
    pub async fn start() -> Self {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route(
                "/v1/chat/completions",
                post(|state, uri, headers, body| answer(Endpoint::Chat, state, uri, headers, body)),
            )
            .route(
                "/v1/completions",
                post(|state, uri, headers, body| {
                    answer(Endpoint::Completions, state, uri, headers, body)
                }),
            )
            .route(
                "/v1/embeddings",
                post(|state, uri, headers, body| {
                    answer(Endpoint::Embeddings, state, uri, headers, body)
                }),
            )
            .fallback(|state, uri, headers, body| {
                answer(Endpoint::Unknown, state, uri, headers, body)
            })
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        })
        .abort_handle();
        Self {
            addr,
            shared,
            server,
        }
    }

    /// Its base URL, `http://127.0.0.1:PORT` (an SDK's `base_url` is this
    /// plus `/v1`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answer the requests from now on as `behaviour` says.
    pub fn set(&self, behaviour: Behaviour) {
        *self.shared.behaviour.lock().unwrap() = behaviour;
    }

    /// Every request's body received so far, parsed, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.received().into_iter().map(|r| r.body).collect()
    }

    /// Every request received so far (path, headers, body), in order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().unwrap().clone()
    }

    /// How many requests it has received (any path, answered or not).
    pub fn count(&self) -> usize {
        self.shared.received.lock().unwrap().len()
    }
}

/// The routes it answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
    Embeddings,
    Unknown,
}

/// One request: kept, then answered as the behaviour of the moment says.
async fn answer(
    endpoint: Endpoint,
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = serde_json::from_slice::<Value>(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    shared.received.lock().unwrap().push(Received {
        path: uri.path().to_owned(),
        headers,
        body: parsed.clone(),
    });
    let behaviour = shared.behaviour.lock().unwrap().clone();
    let n = shared.ids.fetch_add(1, Ordering::Relaxed);
    let mut response = respond(endpoint, &behaviour, &parsed, n).await;
    let extra = response.headers_mut();
    extra.insert(
        HeaderName::from_static("x-request-id"),
        HeaderValue::from_str(&format!("req_fake{n}")).unwrap(),
    );
    for (name, value) in &behaviour.headers {
        extra.append(
            HeaderName::try_from(name.as_str()).unwrap(),
            HeaderValue::try_from(value.as_str()).unwrap(),
        );
    }
    response
}

/// The answer to a request of `endpoint` whose body is `request`; `n`
/// numbers it (its id).
async fn respond(endpoint: Endpoint, behaviour: &Behaviour, request: &Value, n: u64) -> Response {
    if let Some(status) = behaviour.status {
        let status = StatusCode::from_u16(status).expect("an HTTP status");
        return error(
            status,
            "server_error",
            &format!("the fake upstream answers {status}"),
        );
    }
    if endpoint == Endpoint::Unknown {
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no such route",
        );
    }
    if !request.is_object() {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body is not a JSON object",
        );
    }
    let model = request["model"].as_str().unwrap_or("unknown").to_owned();
    if endpoint == Endpoint::Embeddings {
        return embeddings(request, &model);
    }
    let prompt_tokens = if endpoint == Endpoint::Chat {
        chat_words(&request["messages"])
    } else {
        words(&request["prompt"])
    }
    .max(1);
    let completion_tokens = behaviour.completion_tokens.unwrap_or_else(|| {
        request["max_tokens"]
            .as_u64()
            .or_else(|| request["max_completion_tokens"].as_u64())
            .map_or(5, |max| max.min(5))
    });
    let usage = usage(behaviour, prompt_tokens, completion_tokens);
    let answer = Answer {
        endpoint,
        id: format!(
            "{}-fake{n}",
            if endpoint == Endpoint::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
        model,
        words: completion_tokens,
    };
    if request["stream"].as_bool() == Some(true) {
        let include_usage = request["stream_options"]["include_usage"].as_bool() == Some(true);
        return stream(answer, behaviour.clone(), include_usage.then_some(usage));
    }
    if behaviour.stall_after.is_some() {
        std::future::pending::<()>().await;
    }
    let pause = behaviour
        .token_delay
        .saturating_mul(completion_tokens.try_into().unwrap_or(u32::MAX));
    tokio::time::sleep(pause).await;
    let text = (0..answer.words)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let choice = if endpoint == Endpoint::Chat {
        json!({
            "index": 0,
            "message": {
                "role": "assistant",
                "content": text,
                "refusal": null,
                "annotations": [],
            },
            "logprobs": null,
            "finish_reason": "stop",
        })
    } else {
        json!({"text": text, "index": 0, "logprobs": null, "finish_reason": "stop"})
    };
    let mut object = answer.object(vec![choice]);
    if let Some(usage) = usage {
        object["usage"] = usage;
    }
    json_response(StatusCode::OK, &object)
}

/// A completion being answered.
struct Answer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    words: u64,
}

impl Answer {
    /// The object (or a stream's chunk) holding `choices`, without usage.
    fn object(&self, choices: Vec<Value>) -> Value {
        let chat = self.endpoint == Endpoint::Chat;
        json!({
            "id": self.id,
            "object": if chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": "fp_fake",
        })
    }

    /// A stream's chunk holding one choice whose text is `text` (a chat
    /// chunk's `delta`: the role goes in the first) and whose finish
    /// reason is `finish_reason`.
    fn chunk(&self, text: Option<&str>, first: bool, finish_reason: Option<&str>) -> Value {
        let choice = if self.endpoint == Endpoint::Chat {
            let mut delta = json!({});
            if first {
                delta["role"] = json!("assistant");
            }
            if let Some(text) = text {
                delta["content"] = json!(text);
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
        } else {
            json!({
                "text": text.unwrap_or(""),
                "index": 0,
                "logprobs": null,
                "finish_reason": finish_reason,
            })
        };
        let mut chunk = self.object(vec![choice]);
        if self.endpoint == Endpoint::Chat {
            chunk["object"] = json!("chat.completion.chunk");
        }
        chunk
    }
}

/// A streamed answer: server-sent events fed by a task, which waits
/// `token_delay` before each chunk after the first, and stops (the stream
/// hanging) after `stall_after` words, or when the client goes away.
/// `usage`, when the request asked for it (`Some(None)` when the usage is
/// [`Usage::Missing`]).
fn stream(answer: Answer, behaviour: Behaviour, usage: Option<Option<Value>>) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    // `"usage": null` on every chunk but the usage chunk, as OpenAI does
    // when asked for usage (not when its usage is missing altogether).
    let null_usage = matches!(usage, Some(Some(_)));
    let event = move |mut chunk: Value| {
        if null_usage && chunk.get("usage").is_none() {
            chunk["usage"] = Value::Null;
        }
        Bytes::from(format!("data: {chunk}\n\n"))
    };
    tokio::spawn(async move {
        let mut events = Vec::new();
        for i in 0..answer.words {
            let word = if i == 0 {
                "w0".to_owned()
            } else {
                format!(" w{i}")
            };
            events.push(event(answer.chunk(Some(&word), i == 0, None)));
        }
        events.push(event(answer.chunk(None, answer.words == 0, Some("stop"))));
        if let Some(Some(usage)) = usage {
            let mut chunk = answer.chunk(None, false, None);
            chunk["choices"] = json!([]);
            chunk["usage"] = usage;
            events.push(event(chunk));
        }
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        for (i, event) in events.into_iter().enumerate() {
            if behaviour.stall_after == Some(i) {
                // Hang, the stream open, until the client goes away.
                tx.closed().await;
                return;
            }
            if i > 0 && !behaviour.token_delay.is_zero() {
                tokio::time::sleep(behaviour.token_delay).await;
            }
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|event| (Ok::<_, Infallible>(event), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap()
}

/// The usage object `behaviour` reports (`None` when it is missing).
fn usage(behaviour: &Behaviour, prompt_tokens: u64, completion_tokens: u64) -> Option<Value> {
    let (completion, total) = match behaviour.usage {
        Usage::Missing => return None,
        Usage::Normal => (
            json!(completion_tokens),
            json!(prompt_tokens + completion_tokens),
        ),
        Usage::Garbage => (json!("lots"), json!("lots")),
        Usage::Huge => {
            let huge: u64 = 1_000_000_000_000_000_000;
            (json!(huge), json!(huge + prompt_tokens))
        }
    };
    Some(json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": behaviour.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }))
}

/// The answer to an embeddings request: one embedding per input.
fn embeddings(request: &Value, model: &str) -> Response {
    let input = &request["input"];
    let inputs = match input {
        Value::Array(items) if items.iter().all(Value::is_number) => 1,
        Value::Array(items) => items.len(),
        _ => 1,
    };
    let prompt_tokens = words(input).max(1);
    let vector = [0.0_f32, 0.1, 0.2];
    let embedding = if request["encoding_format"].as_str() == Some("base64") {
        let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
        json!(base64::engine::general_purpose::STANDARD.encode(bytes))
    } else {
        json!([0.0, 0.1, 0.2])
    };
    let data: Vec<Value> = (0..inputs)
        .map(|index| json!({"object": "embedding", "index": index, "embedding": embedding}))
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }),
    )
}

/// The words of a chat request's messages: their string contents, and the
/// text of their content parts.
fn chat_words(messages: &Value) -> u64 {
    let Some(messages) = messages.as_array() else {
        return 0;
    };
    messages
        .iter()
        .map(|message| match &message["content"] {
            Value::Array(parts) => parts.iter().map(|part| words(&part["text"])).sum(),
            content => words(content),
        })
        .sum()
}

/// The whitespace-separated words of a string, of an array's strings, or
/// the count of an array of token numbers (arrays of them too).
fn words(text: &Value) -> u64 {
    match text {
        Value::String(text) => text.split_whitespace().count() as u64,
        Value::Number(_) => 1,
        Value::Array(items) => items.iter().map(words).sum(),
        _ => 0,
    }
}

/// OpenAI's error JSON with `status`.
fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": null}}),
    )
}

/// `body` as `application/json` with `status`.
fn json_response(status: StatusCode, body: &Value) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}
