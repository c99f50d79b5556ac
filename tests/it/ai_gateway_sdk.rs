//! The official OpenAI Python SDK as the AI gateway's client: [`sdk`] runs
//! `tests/it/openai_sdk.py` (the SDK `scripts/test` installs into
//! `target/openai`) on a spec and returns what came of its calls. Here, the
//! SDK against the fake upstream alone (`support::openai_upstream`), no
//! gateway: every answer of the fake parses as OpenAI's own would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

/// The pinned SDK `scripts/test` installs (with its dependencies).
const SDK: &str = "openai==3.57.0";

/// Run the OpenAI SDK driver (`tests/it/openai_sdk.py`) on `spec` (its
/// fields are documented there: `base_url`, `api_key`, `max_retries`,
/// `timeout`, `endpoint`, `model`, `prompt`, `max_tokens`, `stream`,
/// `include_usage`, `headers`, `calls`) and return its answer,
/// `{"results": [one per call]}`.
///
/// The SDK is the one `scripts/test` installs into `target/openai`; when it
/// is missing this panics saying so (the tests never skip). Python runs
/// with `-S` (no site-packages of the machine's), so only what
/// `scripts/test` installed is used, as on a fresh CI machine.
pub(crate) async fn sdk(spec: Value) -> Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let installed = root.join("target/openai");
    assert!(
        installed.join("openai").exists(),
        "no OpenAI Python SDK at {}: run scripts/test, which installs it \
         (`python3 -m pip install --target target/openai {SDK}`)",
        installed.display()
    );
    let child = tokio::process::Command::new("python3")
        .arg("-S")
        .arg(root.join("tests/it/openai_sdk.py"))
        .arg(spec.to_string())
        .env("PYTHONPATH", &installed)
        // The tests' servers are on the loopback: never through a proxy the
        // environment names.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs (scripts/test checks it is there)");
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("the SDK driver ends within 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the SDK driver failed ({}) on {spec}:\n{stderr}",
        output.status
    );
    let line = stdout.lines().last().unwrap_or("");
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!("the SDK driver printed no JSON ({e}) on {spec}:\n{stdout}\n{stderr}")
    })
}

/// [`sdk`] for one call: its result.
pub(crate) async fn sdk_once(spec: Value) -> Value {
    let mut answer = sdk(spec).await;
    answer["results"][0].take()
}

mod upstream_itself {
    use std::time::Duration;

    use serde_json::{Value, json};

    use super::sdk_once;
    use crate::support::openai_upstream::{Behaviour, OpenAiUpstream, Usage};

    /// A spec for `endpoint` on `upstream`, then `extra`'s fields.
    fn spec(upstream: &OpenAiUpstream, endpoint: &str, extra: Value) -> Value {
        let mut spec = json!({
            "base_url": format!("{}/v1", upstream.url()),
            "api_key": "sk-upstream",
            "max_retries": 0,
            "timeout": 20,
            "endpoint": endpoint,
            "model": "gpt-4o-mini",
            "prompt": "say three words",
        });
        for (name, value) in extra.as_object().unwrap() {
            spec[name] = value.clone();
        }
        spec
    }

    /// The usage the fake reports normally.
    fn usage(prompt: u64, completion: u64, cached: u64) -> Value {
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        })
    }

    #[tokio::test]
    async fn a_chat_completion_parses_with_the_usage_reported() {
        let upstream = OpenAiUpstream::start().await;
        upstream.set(Behaviour {
            cached_tokens: 2,
            ..Behaviour::default()
        });
        let result = sdk_once(spec(&upstream, "chat", json!({"max_tokens": 4}))).await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["status"], 200);
        assert_eq!(result["text"], "w0 w1 w2 w3");
        assert_eq!(result["usage"], usage(3, 4, 2));
        assert_eq!(result["headers"]["content-type"], "application/json");
        assert_eq!(result["headers"]["x-request-id"], "req_fake0");
        let requests = upstream.received();
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].path, "/v1/chat/completions");
        assert_eq!(requests[0].headers["authorization"], "Bearer sk-upstream");
        assert_eq!(requests[0].body["max_tokens"], 4);
        assert_eq!(
            requests[0].body["messages"],
            json!([{"role": "user", "content": "say three words"}])
        );
        // Without max_tokens: five words.
        let result = sdk_once(spec(&upstream, "chat", json!({}))).await;
        assert_eq!(result["text"], "w0 w1 w2 w3 w4", "{result}");
        assert_eq!(result["usage"]["completion_tokens"], 5);
    }

    #[tokio::test]
    async fn a_stream_with_include_usage_has_exactly_one_usage_chunk() {
        let upstream = OpenAiUpstream::start().await;
        let result = sdk_once(spec(
            &upstream,
            "chat",
            json!({"stream": true, "include_usage": true, "max_completion_tokens": 3}),
        ))
        .await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["text"], "w0 w1 w2");
        // A chunk a word, the finish, the usage.
        assert_eq!(result["chunks"], 5, "{result}");
        assert_eq!(result["usage_chunks"], 1, "{result}");
        assert_eq!(result["usage"], usage(3, 3, 0));
        assert!(
            result["headers"]["content-type"]
                .as_str()
                .unwrap()
                .starts_with("text/event-stream"),
            "{result}"
        );
        let request = &upstream.requests()[0];
        assert_eq!(request["stream"], true);
        assert_eq!(request["stream_options"], json!({"include_usage": true}));
        assert_eq!(request["max_completion_tokens"], 3);
    }

    #[tokio::test]
    async fn a_stream_without_include_usage_has_no_usage_chunk() {
        let upstream = OpenAiUpstream::start().await;
        let result = sdk_once(spec(&upstream, "chat", json!({"stream": true}))).await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["text"], "w0 w1 w2 w3 w4");
        assert_eq!(result["chunks"], 6, "{result}");
        assert_eq!(result["usage_chunks"], 0, "{result}");
        assert_eq!(result["usage"], Value::Null);
        assert!(upstream.requests()[0].get("stream_options").is_none());
    }

    #[tokio::test]
    async fn legacy_completions_and_embeddings_parse() {
        let upstream = OpenAiUpstream::start().await;
        let result = sdk_once(spec(&upstream, "completions", json!({"max_tokens": 2}))).await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["text"], "w0 w1");
        assert_eq!(result["usage"], usage(3, 2, 0));
        let result = sdk_once(spec(
            &upstream,
            "completions",
            json!({"max_tokens": 2, "stream": true, "include_usage": true}),
        ))
        .await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["text"], "w0 w1");
        assert_eq!(result["chunks"], 4, "{result}");
        assert_eq!(result["usage_chunks"], 1, "{result}");
        assert_eq!(result["usage"], usage(3, 2, 0));

        // The SDK asks for base64 (its default) and decodes the vectors.
        let result = sdk_once(spec(
            &upstream,
            "embeddings",
            json!({"prompt": ["one two", "three four five"]}),
        ))
        .await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(
            result["usage"],
            json!({"prompt_tokens": 5, "total_tokens": 5})
        );
        let vectors = result["embeddings"].as_array().unwrap();
        assert_eq!(vectors.len(), 2);
        for vector in vectors {
            let vector: Vec<f64> = serde_json::from_value(vector.clone()).unwrap();
            assert_eq!(vector.len(), 3);
            for (got, want) in vector.iter().zip([0.0, 0.1, 0.2]) {
                assert!((got - want).abs() < 1e-6, "{vector:?}");
            }
        }
        let requests = upstream.received();
        assert_eq!(requests[2].path, "/v1/embeddings");
        assert_eq!(requests[2].body["encoding_format"], "base64");
    }

    #[tokio::test]
    async fn a_500_is_retried_then_raised_as_a_status_error() {
        let upstream = OpenAiUpstream::start().await;
        upstream.set(Behaviour {
            status: Some(500),
            ..Behaviour::default()
        });
        let result = sdk_once(spec(&upstream, "chat", json!({"max_retries": 1}))).await;
        assert_eq!(result["ok"], false, "{result}");
        assert_eq!(result["status"], 500);
        // InternalServerError, the SDK's APIStatusError for 5xx.
        assert_eq!(result["error_class"], "InternalServerError", "{result}");
        assert_eq!(result["error_type"], "server_error");
        assert_eq!(result["error_code"], Value::Null);
        assert_eq!(result["headers"]["x-request-id"], "req_fake1");
        assert_eq!(upstream.count(), 2, "max_retries + 1 requests");
    }

    #[tokio::test]
    async fn missing_garbage_and_huge_usage_still_parse() {
        let upstream = OpenAiUpstream::start().await;
        for (report, completion) in [
            (Usage::Missing, None),
            (Usage::Garbage, Some(json!("lots"))),
            (Usage::Huge, Some(json!(1_000_000_000_000_000_000_u64))),
        ] {
            upstream.set(Behaviour {
                usage: report,
                ..Behaviour::default()
            });
            for stream in [false, true] {
                let extra = if stream {
                    json!({"stream": true, "include_usage": true})
                } else {
                    json!({})
                };
                let result = sdk_once(spec(&upstream, "chat", extra)).await;
                assert_eq!(result["ok"], true, "{report:?} {stream}: {result}");
                assert_eq!(result["text"], "w0 w1 w2 w3 w4");
                match &completion {
                    None => {
                        assert_eq!(result["usage"], Value::Null, "{result}");
                        assert_eq!(result["usage_chunks"], 0, "{result}");
                    }
                    Some(completion) => {
                        assert_eq!(
                            &result["usage"]["completion_tokens"], completion,
                            "{result}"
                        );
                        assert_eq!(result["usage"]["prompt_tokens"], 3);
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn a_stalled_stream_times_out_after_its_words() {
        let upstream = OpenAiUpstream::start().await;
        upstream.set(Behaviour {
            stall_after: Some(2),
            ..Behaviour::default()
        });
        let result = sdk_once(spec(
            &upstream,
            "chat",
            json!({"stream": true, "timeout": 1}),
        ))
        .await;
        assert_eq!(result["ok"], false, "{result}");
        assert_eq!(result["status"], 200);
        assert_eq!(result["error_class"], "APITimeoutError", "{result}");
        assert_eq!(result["text"], "w0 w1");
        assert_eq!(result["chunks"], 2);
        assert_eq!(upstream.count(), 1, "a stream is not retried once it began");
    }

    #[tokio::test]
    async fn tokens_are_paced_by_the_token_delay() {
        let upstream = OpenAiUpstream::start().await;
        upstream.set(Behaviour {
            token_delay: Duration::from_millis(100),
            completion_tokens: Some(4),
            ..Behaviour::default()
        });
        let result = sdk_once(spec(&upstream, "chat", json!({"stream": true}))).await;
        assert_eq!(result["ok"], true, "{result}");
        assert_eq!(result["text"], "w0 w1 w2 w3");
        // Four pauses: between the four words, the finish and [DONE].
        let elapsed = result["elapsed"].as_f64().unwrap();
        assert!(elapsed >= 0.4, "{elapsed} s");
    }
}
