//! What an OpenAI-compatible request asks: its model, whether it streams,
//! and the usage it is estimated at before the answer tells.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::usage::MAX_TOKENS;
use crate::rules::Usage;

/// The endpoints the layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/embeddings`.
    Embeddings,
}

impl Endpoint {
    /// The endpoint of a `POST` to `path`, if the layer reads it.
    pub(crate) fn of(path: &str) -> Option<Self> {
        if path.ends_with("/chat/completions") {
            Some(Self::Chat)
        } else if path.ends_with("/completions") {
            Some(Self::Completions)
        } else if path.ends_with("/embeddings") {
            Some(Self::Embeddings)
        } else {
            None
        }
    }

    /// The field holding what the model reads.
    fn prompt_field(self) -> &'static str {
        match self {
            Self::Chat => "messages",
            Self::Completions => "prompt",
            Self::Embeddings => "input",
        }
    }
}

/// A request read.
#[derive(Debug, Clone)]
pub(crate) struct Asked {
    /// The model asked for.
    pub(crate) model: String,
    /// Whether the answer streams (server-sent events).
    pub(crate) stream: bool,
    /// Whether the client asked for the usage chunk of a stream
    /// (`stream_options.include_usage`).
    pub(crate) wants_usage: bool,
    /// The usage estimated before the answer: the prompt's size, and the
    /// most output it may get.
    pub(crate) estimate: Usage,
}

/// The longest model name read.
const MAX_MODEL: usize = 256;

/// The most choices (`n`) a request may ask for.
const MAX_CHOICES: u64 = 128;

/// Read a request to `endpoint` (its JSON `body`), with `default_output`
/// tokens when it names no `max_tokens`. Returns what it asks and, for a
/// stream whose client did not ask for the usage chunk, the body to send
/// upstream instead (asking for it). A body that is not the JSON the
/// endpoint takes is refused with the message to answer.
pub(crate) fn read(
    endpoint: Endpoint,
    body: &[u8],
    default_output: u64,
) -> Result<(Asked, Option<Bytes>), String> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let object = value
        .as_object_mut()
        .ok_or("the body is not a JSON object")?;
    let model = match object.get("model") {
        Some(Value::String(m)) if !m.is_empty() && m.len() <= MAX_MODEL => m.clone(),
        Some(Value::String(_)) => {
            return Err(format!("`model` must be 1 to {MAX_MODEL} bytes"));
        }
        _ => return Err("`model` is missing or not a string".to_owned()),
    };
    let prompt = object
        .get(endpoint.prompt_field())
        .filter(|p| !p.is_null())
        .ok_or_else(|| format!("`{}` is missing", endpoint.prompt_field()))?;
    if endpoint == Endpoint::Chat && !prompt.is_array() {
        return Err("`messages` is not an array".to_owned());
    }
    let input = prompt_tokens(prompt);
    let flag = |object: &Map<String, Value>, name: &str| match object.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("`{name}` is not a boolean")),
    };
    let stream = endpoint != Endpoint::Embeddings && flag(object, "stream")?;
    let wants_usage = match object.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) => flag(options, "include_usage")?,
        Some(_) => return Err("`stream_options` is not an object".to_owned()),
    };
    let count = |name: &str, most: u64| match object.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|n| *n <= most)
            .map(Some)
            .ok_or_else(|| format!("`{name}` is not a whole number from 0 to {most}")),
    };
    let max_output = match count("max_completion_tokens", MAX_TOKENS)? {
        Some(n) => Some(n),
        None => count("max_tokens", MAX_TOKENS)?,
    };
    let choices = count("n", MAX_CHOICES)?.unwrap_or(1).max(1);
    let output = match endpoint {
        Endpoint::Embeddings => 0,
        _ => max_output.unwrap_or(default_output).saturating_mul(choices),
    };
    let rewritten = if stream && !wants_usage {
        let options = object
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        }
        Some(Bytes::from(
            serde_json::to_vec(&value).map_err(|e| format!("cannot write the body: {e}"))?,
        ))
    } else {
        None
    };
    Ok((
        Asked {
            model,
            stream,
            wants_usage,
            estimate: Usage::new().with("input", input).with("output", output),
        },
        rewritten,
    ))
}

/// The tokens a prompt is estimated at: a token per 3 bytes of its text
/// (rounded up; English runs about 4, and CJK text 3 bytes to a token),
/// and a token per number (a prompt given as token ids).
fn prompt_tokens(prompt: &Value) -> u64 {
    fn walk(value: &Value, bytes: &mut u64, numbers: &mut u64) {
        match value {
            Value::String(s) => *bytes += s.len() as u64,
            Value::Number(_) => *numbers += 1,
            Value::Array(items) => items.iter().for_each(|v| walk(v, bytes, numbers)),
            Value::Object(fields) => fields.values().for_each(|v| walk(v, bytes, numbers)),
            Value::Bool(_) | Value::Null => {}
        }
    }
    let (mut bytes, mut numbers) = (0, 0);
    walk(prompt, &mut bytes, &mut numbers);
    bytes.div_ceil(3) + numbers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_request_is_estimated_and_a_stream_asks_for_its_usage() {
        let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello there"}],
            "max_tokens":100,"n":2,"stream":true}"#;
        let (asked, rewritten) = read(Endpoint::Chat, body, 4096).unwrap();
        assert_eq!(asked.model, "gpt-4o");
        assert!(asked.stream && !asked.wants_usage);
        // "user" and "hello there": 15 bytes, 5 tokens; 100 tokens × 2 choices.
        assert_eq!(asked.estimate.get("input"), 5);
        assert_eq!(asked.estimate.get("output"), 200);
        let sent: Value = serde_json::from_slice(&rewritten.unwrap()).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true);
        assert_eq!(sent["messages"][0]["content"], "hello there");
    }

    #[test]
    fn what_the_client_asked_is_sent_unchanged() {
        let body =
            br#"{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}"#;
        let (asked, rewritten) = read(Endpoint::Completions, body, 16).unwrap();
        assert!(asked.wants_usage && rewritten.is_none());
        assert_eq!(asked.estimate.get("output"), 16);
        let (asked, rewritten) = read(
            Endpoint::Embeddings,
            br#"{"model":"e","input":["ab","cd"]}"#,
            16,
        )
        .unwrap();
        assert!(!asked.stream && rewritten.is_none());
        assert_eq!(asked.estimate.get("output"), 0);
        assert_eq!(asked.estimate.get("input"), 2);
    }

    #[test]
    fn bodies_that_are_not_the_json_expected_are_refused() {
        for (endpoint, body) in [
            (Endpoint::Chat, &b"not json"[..]),
            (Endpoint::Chat, b"[1]"),
            (Endpoint::Chat, br#"{"messages":[]}"#),
            (Endpoint::Chat, br#"{"model":"","messages":[]}"#),
            (Endpoint::Chat, br#"{"model":"m"}"#),
            (Endpoint::Chat, br#"{"model":"m","messages":"hi"}"#),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[],"stream":"yes"}"#,
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[],"max_tokens":-5}"#,
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[],"max_tokens":100000000000}"#,
            ),
            (Endpoint::Chat, br#"{"model":"m","messages":[],"n":1000}"#),
            (Endpoint::Completions, br#"{"model":"m","prompt":null}"#),
        ] {
            assert!(
                read(endpoint, body, 16).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
