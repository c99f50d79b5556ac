//! Adversarial tests of `ai::OpenAiLayer`, in process (upstreams made with
//! `tower::service_fn`, counts in a `MemoryStore`): each test names the
//! promise of the AI gateways guide (or of the code's own docs) it holds
//! the layer to, and the scenario that tries to break it.
//!
//! - settlement: exactly once, and from the usage whenever the usage was
//!   read, however the answer ends (cut, dropped, trailers, polled after
//!   its end, its usage chunk cut into single bytes with `\r\n` endings);
//! - the request passed on: rewritten only to ask for the usage chunk,
//!   with a right `content-length` and every field as written;
//! - hostile bodies: refused before anything is counted;
//! - estimates: token ids, embeddings, `n`, inline media;
//! - a hierarchy: a refusal by one level costs nothing at the others, and
//!   is OpenAI's 429 (`insufficient_quota` or `rate_limit_exceeded`);
//! - money: never under-charged (exact rational arithmetic, rounded up);
//! - notices: once per key, share and period, under concurrency too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, StreamBody};
use serde_json::{Value, json};
use tower::{Layer, ServiceExt, service_fn};
use tower_redis_ratelimit::MemoryStore;
use tower_redis_ratelimit::ai::{Notice, OpenAiLayer, RequestBody, ResponseBody};
use tower_redis_ratelimit::rules::{RuleSet, Rules};

// ---------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------

fn rules(toml: &str) -> Rules {
    Rules::new(MemoryStore::new(), RuleSet::from_toml(toml).unwrap())
}

/// A month of a million tokens for everyone (rule `tokens`, key `global`).
const TOKENS: &str = "[[rules]]\nname = \"tokens\"\nkey = \"global\"\n\
    policy = \"1000000 tokens/month\"\nalgorithm = \"fixed-window\"\n";

/// The units `rule` has counted for `key` (at most its max): a peek
/// answers as a request of one unit would.
async fn used(rules: &Rules, rule: &str, key: &str) -> u64 {
    let limiter = rules.current().limiter(rule, None).cloned().unwrap();
    let d = limiter.peek(key).await.unwrap();
    d.limit() - d.remaining() - u64::from(d.allowed())
}

/// Wait until `rule` has counted `expected` for `key` and stays there (it
/// settled once), or fail after 2 s saying what it counted.
async fn settles_to(rules: &Rules, rule: &str, key: &str, expected: u64) {
    for _ in 0..100 {
        if used(rules, rule, key).await == expected {
            tokio::time::sleep(Duration::from_millis(60)).await;
            assert_eq!(used(rules, rule, key).await, expected, "settled twice");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{rule}/{key}: counted {} units, not the {expected} expected",
        used(rules, rule, key).await
    );
}

/// What the upstream was sent: each request's headers and body.
type Seen = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

/// How an upstream answers a request's body.
type Answer = Arc<dyn Fn(&Bytes) -> Response<Body> + Send + Sync>;

/// An upstream: the answer it makes of each request's body, and what it
/// was sent.
#[derive(Clone)]
struct Upstream {
    answer: Answer,
    seen: Seen,
}

impl Upstream {
    fn new(answer: impl Fn(&Bytes) -> Response<Body> + Send + Sync + 'static) -> Self {
        Self {
            answer: Arc::new(answer),
            seen: Seen::default(),
        }
    }

    fn calls(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

/// Send `request` through `layer` in front of `upstream`.
async fn send(
    layer: &OpenAiLayer,
    upstream: &Upstream,
    request: Request<Body>,
) -> Response<ResponseBody<Body>> {
    let up = upstream.clone();
    let service = layer.layer(service_fn(move |request: Request<RequestBody<Body>>| {
        let up = up.clone();
        async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.unwrap().to_bytes();
            up.seen.lock().unwrap().push((parts.headers, bytes.clone()));
            Ok::<_, Infallible>((up.answer)(&bytes))
        }
    }));
    service.oneshot(request).await.unwrap()
}

fn post(path: &str, body: impl Into<Body>, headers: &[(&str, &str)]) -> Request<Body> {
    let mut request = Request::post(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(body.into()).unwrap()
}

/// A chat request estimated at 7 prompt tokens ("user", "say three
/// words": 19 bytes) and 4 of output: 11 tokens.
const CHAT: &str =
    r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"say three words"}]}"#;

/// The same, streamed, the client not asking for the usage chunk.
const STREAM: &str = r#"{"model":"m","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"say three words"}]}"#;

/// A JSON answer reporting 3 + 2 tokens.
const ANSWER: &str = r#"{"object":"chat.completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;

fn json_answer(text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::from(text));
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

/// A stream's chunks: two of content, the usage chunk (3 prompt tokens,
/// 40 of completion: a chunk may carry many tokens) and `[DONE]`.
const EVENTS: [&str; 6] = [
    r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":null}"#,
    r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}],"usage":null}"#,
    r#"{"choices":[{"index":0,"delta":{"content":"lo"}}],"usage":null}"#,
    r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#,
    r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":40}}"#,
    "[DONE]",
];

/// Each event as a frame of its own, ended by `separator`.
fn event_frames(separator: &str) -> Vec<Bytes> {
    EVENTS
        .iter()
        .map(|e| Bytes::from(format!("data: {e}{separator}")))
        .collect()
}

/// A streamed answer of `frames`, then `tail` (an error, nothing, or a
/// stream that never ends).
fn sse(
    frames: Vec<Bytes>,
    tail: impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Send + 'static,
) -> Response<Body> {
    let head = stream::iter(frames.into_iter().map(|b| Ok(Frame::data(b))));
    let mut response = Response::new(Body::new(StreamBody::new(head.chain(tail))));
    response
        .headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    response
}

/// The body of an error answer, and its status and headers.
async fn error_of(response: Response<ResponseBody<Body>>) -> (StatusCode, HeaderMap, Value) {
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let value: Value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)));
    (parts.status, parts.headers, value)
}

// ---------------------------------------------------------------------
// Settlement, however an answer ends
// ---------------------------------------------------------------------

/// The upstream streams its content, its usage chunk and `[DONE]`, then
/// its connection fails before the body's end. The usage was read: the
/// guide settles "to its real usage" (the stream-cut row is for a stream
/// "stopped before its usage came", as `Ended::Cut` says), so 3 + 40.
#[tokio::test]
async fn a_stream_failing_after_its_usage_chunk_is_charged_the_usage_it_reported() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        sse(
            event_frames("\n\n"),
            stream::iter([Err(std::io::Error::other("connection reset"))]),
        )
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    let mut body = response.into_body();
    let mut seen = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        seen.extend_from_slice(&frame.into_data().unwrap());
    }
    assert!(String::from_utf8_lossy(&seen).contains("[DONE]"));
    drop(body);
    settles_to(&rules, "tokens", "global", 43).await;
}

/// The client reads the stream to `data: [DONE]` and goes away (as many
/// clients do) before the upstream has ended its body. The usage chunk
/// had been read: 3 + 40 tokens, not the prompt's estimate and 2 chunks.
#[tokio::test]
async fn a_stream_dropped_after_done_is_charged_the_usage_it_reported() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| sse(event_frames("\n\n"), stream::pending()));
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    let mut body = response.into_body();
    let mut seen = String::new();
    while !seen.contains("[DONE]") {
        let frame = body.frame().await.unwrap().unwrap();
        seen.push_str(std::str::from_utf8(&frame.into_data().unwrap()).unwrap());
    }
    assert!(
        !seen.contains("prompt_tokens"),
        "the client did not ask: {seen}"
    );
    drop(body);
    settles_to(&rules, "tokens", "global", 43).await;
}

/// A stream cut before its usage came (the upstream fails after one
/// chunk of content): the prompt's estimate (7) and the chunks streamed
/// (1), once.
#[tokio::test]
async fn a_stream_failing_before_its_usage_is_charged_the_prompt_estimate_and_its_chunks() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        sse(
            event_frames("\n\n")[..2].to_vec(),
            stream::iter([Err(std::io::Error::other("connection reset"))]),
        )
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    let mut body = response.into_body();
    while let Some(Ok(_)) = body.frame().await {}
    // Polled again after the error: nothing more, nothing charged again.
    assert!(body.frame().await.is_none());
    drop(body);
    settles_to(&rules, "tokens", "global", 8).await;
}

/// The usage chunk arrives one byte a frame, its events ended by
/// `\r\n\r\n`, and the upstream claims a `content-length`: the usage is
/// read, kept from the client (who did not ask), the length removed and
/// the body's size hint not exact (bytes were removed), and its end is
/// told truly.
#[tokio::test]
async fn a_usage_chunk_in_single_bytes_with_crlf_endings_is_read_and_kept_from_the_client() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let text: String = event_frames("\r\n\r\n")
        .iter()
        .map(|b| std::str::from_utf8(b).unwrap().to_owned())
        .collect();
    let length = text.len();
    let upstream = Upstream::new(move |_| {
        let bytes: Vec<Bytes> = text
            .as_bytes()
            .iter()
            .map(|b| Bytes::copy_from_slice(&[*b]))
            .collect();
        let mut response = sse(bytes, stream::empty());
        response
            .headers_mut()
            .insert("content-length", length.into());
        response
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    assert!(response.headers().get("content-length").is_none());
    let mut body = response.into_body();
    assert_eq!(body.size_hint().exact(), None);
    assert!(!body.is_end_stream());
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        out.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    assert!(body.is_end_stream());
    assert!(body.frame().await.is_none(), "polled after its end");
    let out = String::from_utf8(out).unwrap();
    assert!(!out.contains("prompt_tokens"), "{out}");
    assert!(out.ends_with("data: [DONE]\r\n\r\n"), "{out}");
    assert!(out.contains("\"content\":\"lo\""), "{out}");
    settles_to(&rules, "tokens", "global", 43).await;
}

/// A stream that ends with trailers right after its usage chunk (no
/// `[DONE]`, the last event without its blank line): settled from the
/// usage, the chunk kept from the client, the trailers passed on last.
#[tokio::test]
async fn a_stream_ending_in_trailers_after_an_unterminated_usage_event_is_settled_from_it() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        let mut frames = event_frames("\n\n")[..4].to_vec();
        frames.push(Bytes::from(format!("data: {}", EVENTS[4])));
        let mut trailers = HeaderMap::new();
        trailers.insert("x-done", "yes".parse().unwrap());
        sse(frames, stream::iter([Ok(Frame::trailers(trailers))]))
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    let mut body = response.into_body();
    let mut out = String::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame.unwrap().into_data() {
            Ok(data) => {
                assert!(trailers.is_none(), "data after the trailers");
                out.push_str(std::str::from_utf8(&data).unwrap());
            }
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    assert_eq!(trailers.unwrap()["x-done"], "yes");
    assert!(!out.contains("prompt_tokens"), "{out}");
    settles_to(&rules, "tokens", "global", 43).await;
}

/// A JSON answer of known length is read to its last byte and dropped,
/// its reader never asking for the end (hyper stops at the length): it
/// is settled from its usage, once; its size hint is exact and true, and
/// a poll after the end answers nothing.
#[tokio::test]
async fn a_json_answer_of_known_length_settles_at_its_last_frame_exactly_once() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    let mut body = response.into_body();
    assert_eq!(body.size_hint().exact(), Some(ANSWER.len() as u64));
    let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(data, ANSWER.as_bytes());
    assert!(body.is_end_stream());
    assert!(body.frame().await.is_none());
    assert!(body.frame().await.is_none());
    drop(body);
    settles_to(&rules, "tokens", "global", 5).await;
}

/// An upstream's error answer, dropped unread: nothing billable.
#[tokio::test]
async fn an_error_answer_dropped_unread_costs_nothing() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        let mut response = json_answer(r#"{"error":{"message":"overloaded"}}"#);
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(response);
    settles_to(&rules, "tokens", "global", 0).await;
}

/// An upstream that sends its stream as `Text/Event-Stream` (media types
/// are case-insensitive, RFC 9110 §8.3.1): still a stream, so the usage
/// chunk the layer asked for is kept from a client that never asked (an
/// SDK reading `choices[0]` of every chunk would fail on it).
#[tokio::test]
async fn a_stream_of_a_media_type_not_in_lower_case_has_its_usage_chunk_kept_from_the_client() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        let mut response = sse(event_frames("\n\n"), stream::empty());
        response.headers_mut().insert(
            "content-type",
            "Text/Event-Stream; charset=utf-8".parse().unwrap(),
        );
        response
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", STREAM, &[])).await;
    let out = response.into_body().collect().await.unwrap().to_bytes();
    let out = String::from_utf8(out.to_vec()).unwrap();
    assert!(
        !out.contains("prompt_tokens"),
        "the client did not ask for the usage chunk: {out}"
    );
    settles_to(&rules, "tokens", "global", 43).await;
}

// ---------------------------------------------------------------------
// The request passed on
// ---------------------------------------------------------------------

/// A streamed request whose client did not ask for the usage: rewritten
/// to ask, with a `content-length` that is the new body's, no
/// `transfer-encoding`, valid JSON and every other field as written
/// (escaped names, a number no u64 holds, nested objects, the client's
/// other `stream_options`).
#[tokio::test]
async fn a_rewritten_request_has_its_length_and_every_field_as_written() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| sse(event_frames("\n\n"), stream::empty()));
    let original = r#"{"model":"m", "messages":[{"role":"user","content":"h\u00e9llo \"q\" \ud83d\ude00"}],
        "stream" : true, "seed": 12345678901234567890123, "temperature": 0.7,
        "t\u00e9st": {"a\"b": [1, {"c": null}]}, "stream_options": {"include_usage": false, "x": [1, {"y": null}]},
        "max_tokens": 4}"#;
    let response = send(
        &layer,
        &upstream,
        post(
            "/v1/chat/completions",
            original,
            &[("transfer-encoding", "chunked")],
        ),
    )
    .await;
    response.into_body().collect().await.unwrap();
    let (headers, sent) = upstream.seen.lock().unwrap()[0].clone();
    assert_eq!(
        headers["content-length"].to_str().unwrap(),
        sent.len().to_string()
    );
    assert!(headers.get("transfer-encoding").is_none());
    let sent_value: Value = serde_json::from_slice(&sent).unwrap();
    let original_value: Value = serde_json::from_str(original).unwrap();
    for (name, value) in original_value.as_object().unwrap() {
        if name == "stream_options" {
            continue;
        }
        assert_eq!(&sent_value[name], value, "field {name}");
    }
    assert_eq!(
        sent_value["stream_options"],
        json!({"include_usage": true, "x": [1, {"y": null}]})
    );
    assert!(
        std::str::from_utf8(&sent)
            .unwrap()
            .contains("12345678901234567890123"),
        "a big number kept as written"
    );
    assert_eq!(
        sent_value.as_object().unwrap().len(),
        original_value.as_object().unwrap().len()
    );
    settles_to(&rules, "tokens", "global", 43).await;
}

/// A client that asked for the usage chunk: its request is sent byte for
/// byte, and it sees the chunk.
#[tokio::test]
async fn a_client_that_asked_for_the_usage_chunk_sees_it_and_its_request_is_unchanged() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| sse(event_frames("\n\n"), stream::empty()));
    let asked = r#"{"model":"m","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"say three words"}]}"#;
    let response = send(&layer, &upstream, post("/v1/chat/completions", asked, &[])).await;
    let out = response.into_body().collect().await.unwrap().to_bytes();
    let expected: String = event_frames("\n\n")
        .iter()
        .map(|b| std::str::from_utf8(b).unwrap().to_owned())
        .collect();
    assert_eq!(out, expected.as_bytes());
    assert_eq!(upstream.seen.lock().unwrap()[0].1, asked.as_bytes());
    settles_to(&rules, "tokens", "global", 43).await;
}

// ---------------------------------------------------------------------
// Hostile requests
// ---------------------------------------------------------------------

/// Bodies that are not the JSON the endpoint takes: `400` in OpenAI's
/// format, before anything is counted and without calling the upstream.
#[tokio::test]
async fn hostile_bodies_are_refused_before_anything_is_counted() {
    let rules = rules(
        "[[rules]]\nname = \"requests\"\nkey = \"global\"\npolicy = \"1000000/month\"\n\
         algorithm = \"fixed-window\"\n",
    );
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let long_model = format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(257));
    let deep = format!(
        r#"{{"model":"m","messages":[{}1{}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let deep_object = format!(
        r#"{{"model":"m","messages":[{}1{}]}}"#,
        r#"{"a":"#.repeat(50_000),
        "}".repeat(50_000)
    );
    let mut bodies: Vec<(&str, Vec<u8>)> = vec![
        (
            "duplicate model",
            br#"{"model":"m","model":"n","messages":[]}"#.to_vec(),
        ),
        (
            "duplicate by escape",
            br#"{"model":"m","mod\u0065l":"n","messages":[]}"#.to_vec(),
        ),
        (
            "duplicate messages",
            br#"{"model":"m","messages":[],"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "duplicate stream",
            br#"{"model":"m","messages":[],"stream":false,"stream":true}"#.to_vec(),
        ),
        (
            "duplicate in stream_options",
            br#"{"model":"m","messages":[],"stream":true,"stream_options":{"x":1,"x":2}}"#.to_vec(),
        ),
        ("not UTF-8 in a string", {
            let mut b = br#"{"model":"m","messages":[{"role":"user","content":"#.to_vec();
            b.extend_from_slice(b"\"\xff\xfe\"}]}");
            b
        }),
        ("not UTF-8 in a name", {
            let mut b = br#"{"model":"m","messages":[],"#.to_vec();
            b.extend_from_slice(b"\"\xc3\x28\":1}");
            b
        }),
        (
            "a lone surrogate",
            br#"{"model":"m","messages":[],"\ud800":1}"#.to_vec(),
        ),
        ("deep arrays", deep.into_bytes()),
        ("deep objects", deep_object.into_bytes()),
        ("a long model", long_model.into_bytes()),
        (
            "n over 128",
            br#"{"model":"m","messages":[],"n":129}"#.to_vec(),
        ),
        (
            "a float max_tokens",
            br#"{"model":"m","messages":[],"max_tokens":1e3}"#.to_vec(),
        ),
        (
            "a huge max_tokens",
            br#"{"model":"m","messages":[],"max_tokens":18446744073709551616}"#.to_vec(),
        ),
        (
            "a number past f64",
            br#"{"model":"m","messages":[1e400]}"#.to_vec(),
        ),
        (
            "messages an object",
            br#"{"model":"m","messages":{"a":1}}"#.to_vec(),
        ),
        ("an array", b"[]".to_vec()),
        ("empty", Vec::new()),
        (
            "trailing garbage",
            br#"{"model":"m","messages":[]} x"#.to_vec(),
        ),
    ];
    bodies.push(("two objects", br#"{"model":"m","messages":[]}{}"#.to_vec()));
    for (what, body) in bodies {
        let response = send(&layer, &upstream, post("/v1/chat/completions", body, &[])).await;
        let (status, _, error) = error_of(response).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{what}");
    }
    assert_eq!(upstream.calls(), 0);
    assert_eq!(used(&rules, "requests", "global").await, 0);

    // A model name at the bound is read, and counted.
    let at_bound = format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(256));
    let response = send(
        &layer,
        &upstream,
        post("/v1/chat/completions", at_bound, &[]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "requests", "global", 1).await;
}

/// A body over `with_max_body`: `413`, nothing counted, the upstream not
/// called; a body of exactly the bound passes.
#[tokio::test]
async fn a_body_over_the_bound_is_413_and_counts_nothing_and_one_at_the_bound_passes() {
    let rules = rules(TOKENS);
    let layer = OpenAiLayer::new(rules.clone()).with_max_body(1000);
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let pad = |n: usize| format!("{CHAT:<n$}");
    // Sent in pieces, as a client streams it.
    let pieces = |text: String| {
        let chunks: Vec<Result<Frame<Bytes>, Infallible>> = text
            .into_bytes()
            .chunks(97)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        Body::new(StreamBody::new(stream::iter(chunks)))
    };
    let response = send(
        &layer,
        &upstream,
        post("/v1/chat/completions", pieces(pad(1001)), &[]),
    )
    .await;
    let (status, _, error) = error_of(response).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{error}");
    assert_eq!(upstream.calls(), 0);
    settles_to(&rules, "tokens", "global", 0).await;
    let response = send(
        &layer,
        &upstream,
        post("/v1/chat/completions", pieces(pad(1000)), &[]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "tokens", "global", 5).await;
}

// ---------------------------------------------------------------------
// Estimates
// ---------------------------------------------------------------------

/// A rate of tokens per key (fixed-window, under a day: its fields are
/// shown), so `x-ratelimit-remaining-tokens` tells each request's
/// estimate.
const ESTIMATES: &str = "[[rules]]\nname = \"tpm\"\nkey = \"header:x-k\"\n\
    policy = \"100000000 tokens/min\"\nalgorithm = \"fixed-window\"\n";

/// The estimate of `body` at `path`, as the tokens' remaining field says
/// (each request a key of its own).
async fn estimate_of(layer: &OpenAiLayer, path: &str, body: &str) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let key = format!(
        "k{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let response = send(
        layer,
        &upstream,
        post(path, body.to_owned(), &[("x-k", key.as_str())]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
    let remaining: u64 = response.headers()["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    response.into_body().collect().await.unwrap();
    100_000_000 - remaining
}

/// Token ids (a token a number), embeddings (no output), `n` choices,
/// `max_completion_tokens` before `max_tokens`, the default output, and
/// an inline image (1,000 tokens whatever its bytes).
#[tokio::test]
async fn requests_are_estimated_as_the_guide_says() {
    let layer = OpenAiLayer::new(rules(ESTIMATES)).with_default_max_output(100);
    for (path, body, expected) in [
        (
            "/v1/completions",
            r#"{"model":"m","prompt":[[1,2,3],[4,5]],"max_tokens":10,"n":3}"#,
            5 + 30,
        ),
        (
            "/v1/embeddings",
            r#"{"model":"e","input":["abc","defgh"],"max_tokens":50}"#,
            3,
        ),
        ("/v1/embeddings", r#"{"model":"e","input":[[1,2],[3]]}"#, 3),
        (
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"abc"}]}"#,
            3 + 100,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"m","max_tokens":9,"max_completion_tokens":5,"n":128,"messages":[]}"#,
            5 * 128,
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"m","max_tokens":0,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}}]}]}"#,
            // "user", "image_url": 13 bytes, 5 tokens; the image 1,000.
            1005,
        ),
    ] {
        assert_eq!(estimate_of(&layer, path, body).await, expected, "{body}");
    }
}

/// A text message that merely starts with `data:` is text, not an inline
/// image or sound: 300 KB of it is about 100,000 tokens, and estimated
/// so. (Estimated as "1,000 tokens per inline image", a client gets a
/// prompt of any size admitted at 1,000 tokens, and a budget overrun by
/// far more than "the prompt's estimate error" a text prompt can have.)
#[tokio::test]
async fn a_text_prompt_starting_with_data_colon_is_estimated_by_its_bytes() {
    let layer = OpenAiLayer::new(rules(ESTIMATES));
    let text = format!("data: {}", "the quick brown fox ".repeat(15_000));
    let body = json!({
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    })
    .to_string();
    let estimate = estimate_of(&layer, "/v1/chat/completions", &body).await;
    assert!(
        estimate >= 100_000,
        "300 KB of text estimated at {estimate} tokens"
    );
}

/// An inline sound in OpenAI's chat format (`input_audio.data`: raw
/// base64, no `data:` prefix) is "1,000 tokens per inline image or sound"
/// as the guide says, not its bytes over 3 (300 KB of base64 would be
/// estimated at 100,000 tokens, and refused by a budget it fits).
#[tokio::test]
async fn an_inline_sound_in_openais_chat_format_is_estimated_as_inline_media() {
    let layer = OpenAiLayer::new(rules(ESTIMATES));
    let body = json!({
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "UklGR".repeat(60_000), "format": "wav"}}
        ]}],
    })
    .to_string();
    let estimate = estimate_of(&layer, "/v1/chat/completions", &body).await;
    assert!(
        estimate < 2_000,
        "an inline sound estimated at {estimate} tokens"
    );
}

// ---------------------------------------------------------------------
// A hierarchy
// ---------------------------------------------------------------------

/// A micro-dollar per input token, two per output token.
const CATALOG: &str = "[catalog]\ncurrency = \"USD\"\n[catalog.models.\"m\"]\n\
    input = 1_000_000\noutput = 2_000_000\n";

fn hierarchy(key_policy: &str, key_algorithm: &str, org_budget: &str) -> Rules {
    rules(&format!(
        "{CATALOG}
[[rules]]
name = \"key-requests\"
key = \"header:x-gateway-key\"
policy = \"{key_policy}\"
algorithm = \"{key_algorithm}\"

[[rules]]
name = \"team-tokens\"
key = \"header:x-gateway-team\"
policy = \"1000000 tokens/month\"
algorithm = \"fixed-window\"

[[rules]]
name = \"org-spend\"
key = \"header:x-gateway-org\"
policy = \"{org_budget} USD/month\"
algorithm = \"fixed-window\"
"
    ))
}

const WHO: [(&str, &str); 3] = [
    ("x-gateway-key", "alice"),
    ("x-gateway-team", "red"),
    ("x-gateway-org", "acme"),
];

/// The organisation's budget (100 micro-dollars) is spent by a first
/// request (3 + 60 tokens: 123 micro-dollars, in debt); the next is
/// refused by the organisation alone: `429 insufficient_quota` with
/// `x-should-retry: false`, and the key's and the team's units are given
/// back (they still count the first request only).
#[tokio::test]
async fn a_budget_refused_one_level_up_costs_nothing_below_and_says_do_not_retry() {
    let rules = hierarchy("100/h", "fixed-window", "0.0001");
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        json_answer(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":60}}"#)
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &WHO)).await;
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "team-tokens", "red", 63).await;
    settles_to(&rules, "org-spend", "acme", 100).await;

    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &WHO)).await;
    let (status, headers, error) = error_of(response).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{error}");
    assert_eq!(error["error"]["code"], "insufficient_quota", "{error}");
    assert_eq!(error["error"]["type"], "insufficient_quota", "{error}");
    assert!(error["error"]["param"].is_null());
    assert!(error["error"]["message"].as_str().unwrap().contains("USD"));
    assert_eq!(headers["x-should-retry"], "false");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(upstream.calls(), 1);
    settles_to(&rules, "key-requests", "alice", 1).await;
    settles_to(&rules, "team-tokens", "red", 63).await;
}

/// The key's rate (2 a minute, GCRA) refuses a third request: `429
/// rate_limit_exceeded` of type `requests`, `retry-after` (whole seconds,
/// rounded up) agreeing with `retry-after-ms`, OpenAI's fields of the
/// rate, no `x-should-retry: false`; the team's tokens and the
/// organisation's money are given back.
#[tokio::test]
async fn a_rate_refused_at_the_key_gives_the_budgets_back_and_says_how_long_to_wait() {
    let rules = hierarchy("2/min", "gcra", "100");
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    for _ in 0..2 {
        let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &WHO)).await;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
    }
    // 2 × (3 + 2) tokens; 2 × (3 + 4) micro-dollars.
    settles_to(&rules, "team-tokens", "red", 10).await;
    settles_to(&rules, "org-spend", "acme", 14).await;
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &WHO)).await;
    let (status, headers, error) = error_of(response).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{error}");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
    assert_eq!(error["error"]["type"], "requests", "{error}");
    assert!(headers.get("x-should-retry").is_none());
    let seconds: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    let millis: u64 = headers["retry-after-ms"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&seconds), "{seconds}");
    assert!(millis > 29_000 && millis <= 30_000, "{millis}");
    assert_eq!(seconds, millis.div_ceil(1000));
    assert_eq!(headers["x-ratelimit-limit-requests"], "2");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "0");
    assert_eq!(upstream.calls(), 2);
    settles_to(&rules, "team-tokens", "red", 10).await;
    settles_to(&rules, "org-spend", "acme", 14).await;
}

/// A rate of tokens refuses: `429 rate_limit_exceeded` of type `tokens`.
#[tokio::test]
async fn a_token_rate_refusal_is_typed_tokens() {
    let rules = rules(
        "[[rules]]\nname = \"tpm\"\nkey = \"global\"\npolicy = \"20 tokens/min\"\n\
         algorithm = \"gcra\"\n",
    );
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| {
        json_answer(r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5}}"#)
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    let (status, headers, error) = error_of(response).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{error}");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    assert_eq!(error["error"]["type"], "tokens");
    assert!(headers.contains_key("retry-after"));
    assert!(headers.contains_key("retry-after-ms"));
}

/// Rules of several rates: each field is the rate with the fewest left
/// among the rates (a day or more is a budget, not shown).
#[tokio::test]
async fn openai_fields_of_multi_rate_rules_show_the_rate_with_the_fewest_left() {
    let rules = rules(
        "[[rules]]\nname = \"rpm\"\nkey = \"global\"\npolicy = \"1000/min, 3/day\"\n\
         algorithm = \"fixed-window\"\n\
         [[rules]]\nname = \"tpm\"\nkey = \"global\"\n\
         policy = \"100 tokens/h, 200000 tokens/min, 20 tokens/day\"\n\
         algorithm = \"fixed-window\"\n",
    );
    let layer = OpenAiLayer::new(rules.clone());
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers().clone();
    response.into_body().collect().await.unwrap();
    // The day's 3 requests are a budget: the minute's rate is shown.
    assert_eq!(headers["x-ratelimit-limit-requests"], "1000");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "999");
    // The hour's 100 tokens have the fewest left after the estimate of 11.
    assert_eq!(headers["x-ratelimit-limit-tokens"], "100");
    assert_eq!(headers["x-ratelimit-remaining-tokens"], "89");
    let reset = headers["x-ratelimit-reset-tokens"].to_str().unwrap();
    assert!(reset.ends_with('s') && reset.contains('m'), "{reset}");
}

// ---------------------------------------------------------------------
// Money
// ---------------------------------------------------------------------

/// Odd prices and many usages: each is charged exactly the ceiling of its
/// rational price (never under), compared with u128 arithmetic.
#[tokio::test]
async fn money_is_charged_the_exact_price_rounded_up() {
    let (input, cached, output) = (333_333_u64, 1_u64, 7_777_777_u64);
    let rules = rules(&format!(
        "[catalog]\ncurrency = \"USD\"\n[catalog.models.\"m\"]\ninput = {input}\n\
         cached_input = {cached}\noutput = {output}\n\
         [[rules]]\nname = \"spend\"\nkey = \"header:x-k\"\npolicy = \"100000 USD/month\"\n\
         algorithm = \"fixed-window\"\n"
    ));
    let layer = OpenAiLayer::new(rules.clone());
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = |bound: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % bound
    };
    let mut cases: Vec<(u64, u64, u64)> = vec![(1, 0, 0), (0, 0, 1), (1, 1, 0), (3, 0, 0)];
    for _ in 0..24 {
        let prompt = next(200_000);
        let cached_tokens = next(prompt + 1);
        cases.push((prompt, cached_tokens, next(50_000)));
    }
    for (i, (prompt, cached_tokens, completion)) in cases.into_iter().enumerate() {
        let answer: &'static str = Box::leak(
            json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}})
            .to_string()
            .into_boxed_str(),
        );
        let upstream = Upstream::new(move |_| json_answer(answer));
        let key = format!("k{i}");
        let response = send(
            &layer,
            &upstream,
            post("/v1/chat/completions", CHAT, &[("x-k", key.as_str())]),
        )
        .await;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
        let exact = u128::from(prompt - cached_tokens) * u128::from(input)
            + u128::from(cached_tokens) * u128::from(cached)
            + u128::from(completion) * u128::from(output);
        let expected = u64::try_from(exact.div_ceil(1_000_000)).unwrap();
        settles_to(&rules, "spend", &key, expected).await;
    }
}

/// A model the catalog cannot price: `404 model_not_found` before
/// anything is counted (the rule counting requests too), the upstream not
/// called; a catalog's default prices it.
#[tokio::test]
async fn an_unknown_model_is_404_and_counts_nothing_and_a_default_prices_it() {
    let rules_text = |default: &str| {
        format!(
            "{CATALOG}{default}
[[rules]]
name = \"requests\"
key = \"global\"
policy = \"1000/h\"
algorithm = \"fixed-window\"

[[rules]]
name = \"spend\"
key = \"global\"
policy = \"10 USD/month\"
algorithm = \"fixed-window\"
"
        )
    };
    let strict = rules(&rules_text(""));
    let layer = OpenAiLayer::new(strict.clone());
    let upstream = Upstream::new(|_| json_answer(ANSWER));
    let unknown = CHAT.replace(r#""model":"m""#, r#""model":"m2""#);
    let response = send(
        &layer,
        &upstream,
        post("/v1/chat/completions", unknown.clone(), &[]),
    )
    .await;
    let (status, _, error) = error_of(response).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    assert_eq!(error["error"]["code"], "model_not_found");
    assert_eq!(upstream.calls(), 0);
    assert_eq!(used(&strict, "requests", "global").await, 0);
    assert_eq!(used(&strict, "spend", "global").await, 0);

    let priced = rules(&rules_text(
        "[catalog.default]\ninput = 10_000_000\noutput = 10_000_000\n",
    ));
    let layer = OpenAiLayer::new(priced.clone());
    let response = send(
        &layer,
        &upstream,
        post("/v1/chat/completions", unknown, &[]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    response.into_body().collect().await.unwrap();
    // 5 tokens at $10 a million: 50 micro-dollars.
    settles_to(&priced, "spend", "global", 50).await;
    settles_to(&priced, "requests", "global", 1).await;
}

// ---------------------------------------------------------------------
// Notices
// ---------------------------------------------------------------------

type Told = Arc<Mutex<Vec<(String, u8, u64)>>>;

fn telling(rules: &Rules) -> (OpenAiLayer, Told) {
    let told = Told::default();
    let kept = Arc::clone(&told);
    let layer = OpenAiLayer::new(rules.clone()).on_notice(move |n: &Notice| {
        kept.lock()
            .unwrap()
            .push((n.key.clone(), n.threshold, n.used));
    });
    (layer, told)
}

/// Every notice told, by key and share: how many times.
fn counted(told: &Told) -> BTreeMap<(String, u8), usize> {
    let mut map = BTreeMap::new();
    for (key, threshold, _) in told.lock().unwrap().iter() {
        *map.entry((key.clone(), *threshold)).or_insert(0) += 1;
    }
    map
}

/// Wait until `told` holds `n` notices (and no more arrive for a while).
async fn told_count(told: &Told, n: usize) {
    for _ in 0..100 {
        if told.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = told.lock().unwrap().clone();
    assert_eq!(got.len(), n, "{got:?}");
}

/// Forty concurrent requests of each of two keys (one with characters a
/// key encoding might trip on), each reporting 100 tokens of a 1,000-token
/// budget with `notify = [50, 80, 100]`: each share told once per key,
/// whatever the interleaving, with the key as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_share_is_told_once_per_key_under_concurrent_requests() {
    let rules = rules(
        "[[rules]]\nname = \"budget\"\nkey = \"header:x-k\"\npolicy = \"1000 tokens/month\"\n\
         algorithm = \"fixed-window\"\nnotify = [50, 80, 100]\n",
    );
    let (layer, told) = telling(&rules);
    let upstream = Upstream::new(|_| {
        json_answer(r#"{"choices":[],"usage":{"prompt_tokens":60,"completion_tokens":40}}"#)
    });
    let keys = ["plain", "a|b:c/ d%+50|x"];
    let mut tasks = Vec::new();
    for i in 0..80 {
        let (layer, upstream) = (layer.clone(), upstream.clone());
        let key = keys[i % 2];
        tasks.push(tokio::spawn(async move {
            let response = send(
                &layer,
                &upstream,
                post("/v1/chat/completions", CHAT, &[("x-k", key)]),
            )
            .await;
            let status = response.status();
            response.into_body().collect().await.unwrap();
            status
        }));
    }
    for task in tasks {
        let status = task.await.unwrap();
        assert!(
            status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
            "{status}"
        );
    }
    told_count(&told, 6).await;
    let counted = counted(&told);
    for key in keys {
        for share in [50, 80, 100] {
            assert_eq!(
                counted.get(&(key.to_owned(), share)),
                Some(&1),
                "{key} {share}: {counted:?}"
            );
        }
    }
    for (_, threshold, used) in told.lock().unwrap().iter() {
        assert!(
            *used * 100 >= u64::from(*threshold) * 1000 && *used <= 1000,
            "told {threshold}% at {used}"
        );
    }
}

/// Below the share nothing is told (499 of 1,000 at 50 %); the request
/// that reaches it tells it, once.
#[tokio::test]
async fn a_share_is_not_told_below_it_and_is_told_when_reached() {
    let rules = rules(
        "[[rules]]\nname = \"budget\"\nkey = \"global\"\npolicy = \"1000 tokens/month\"\n\
         algorithm = \"fixed-window\"\nnotify = [50]\n",
    );
    let (layer, told) = telling(&rules);
    let usage = Arc::new(Mutex::new(499_u64));
    let current = Arc::clone(&usage);
    let upstream = Upstream::new(move |_| {
        let prompt = *current.lock().unwrap();
        let answer = format!(r#"{{"choices":[],"usage":{{"prompt_tokens":{prompt}}}}}"#);
        let mut response = Response::new(Body::from(answer));
        response
            .headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        response
    });
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "budget", "global", 499).await;
    told_count(&told, 0).await;
    *usage.lock().unwrap() = 1;
    let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "budget", "global", 500).await;
    told_count(&told, 1).await;
    assert_eq!(told.lock().unwrap()[0], ("global".to_owned(), 50, 500));
    for _ in 0..3 {
        let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
        response.into_body().collect().await.unwrap();
    }
    settles_to(&rules, "budget", "global", 503).await;
    told_count(&told, 1).await;
}

/// The common case of the previous test: a request naming no
/// `max_tokens` (estimated at its prompt and 4,096 tokens of output)
/// reports 46,000 tokens of a 100,000-token budget: 46 % spent, and the
/// 50 % share must not be told (nor a `used` above what was spent).
#[tokio::test]
async fn a_request_settled_below_a_share_does_not_tell_it_whatever_its_estimate() {
    let rules = rules(
        "[[rules]]\nname = \"budget\"\nkey = \"global\"\npolicy = \"100000 tokens/month\"\n\
         algorithm = \"fixed-window\"\nnotify = [50]\n",
    );
    let (layer, told) = telling(&rules);
    let upstream = Upstream::new(|_| {
        json_answer(r#"{"choices":[],"usage":{"prompt_tokens":6000,"completion_tokens":40000}}"#)
    });
    let no_max = r#"{"model":"m","messages":[{"role":"user","content":"say three words"}]}"#;
    let response = send(&layer, &upstream, post("/v1/chat/completions", no_max, &[])).await;
    response.into_body().collect().await.unwrap();
    settles_to(&rules, "budget", "global", 46_000).await;
    told_count(&told, 0).await;
}

/// A short window (1,000 tokens per 2 s, fixed): the share told in one
/// window, not again in it, and again in the next.
#[tokio::test]
async fn a_share_is_told_again_in_the_next_period() {
    let rules = rules(
        "[[rules]]\nname = \"budget\"\nkey = \"global\"\npolicy = \"1000 tokens/2s\"\n\
         algorithm = \"fixed-window\"\nnotify = [50]\n",
    );
    let (layer, told) = telling(&rules);
    let upstream = Upstream::new(|_| {
        json_answer(r#"{"choices":[],"usage":{"prompt_tokens":300,"completion_tokens":0}}"#)
    });
    // Start just after a window begins.
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let into = u64::try_from(since.as_millis() % 2000).unwrap();
    tokio::time::sleep(Duration::from_millis(2000 - into + 50)).await;
    for _ in 0..4 {
        let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
    }
    told_count(&told, 1).await;
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let into = u64::try_from(since.as_millis() % 2000).unwrap();
    assert!(into < 1500, "the test ran too slowly to stay in its window");
    tokio::time::sleep(Duration::from_millis(2000 - into + 50)).await;
    for _ in 0..2 {
        let response = send(&layer, &upstream, post("/v1/chat/completions", CHAT, &[])).await;
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
    }
    told_count(&told, 2).await;
}
