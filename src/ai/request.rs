//! What an OpenAI-compatible request asks: its model, whether it streams,
//! and the usage it is estimated at before the answer tells.
//!
//! The body is read as its top-level fields, each kept as written: the
//! prompt is measured as it is parsed and never held as a tree of values
//! (whose size in memory a client could make many times its bytes), and a
//! stream's `stream_options` is the one field written anew.

use std::fmt;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

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
    /// The endpoint of a `POST` to `path`, if the layer reads it: the path
    /// ends with the endpoint's (a trailing `/` aside).
    pub(crate) fn of(path: &str) -> Option<Self> {
        let path = path.strip_suffix('/').unwrap_or(path);
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

/// The tokens an image, a sound or a file of a prompt is estimated at:
/// its bytes (base64, or a URL) say little of its tokens (OpenAI prices
/// an image by its tiles, 85 to about 1,100 tokens).
const INLINE_MEDIA: u64 = 1_000;

/// The fields of a chat message's content parts that hold media: OpenAI's
/// `image_url`, `input_audio` and `file`.
const MEDIA: [&str; 3] = ["image_url", "input_audio", "file"];

/// A body's top-level fields as written, each once.
struct Fields(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Fields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut fields: Vec<(String, Box<RawValue>)> = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if fields.iter().any(|(n, _)| *n == name) {
                        return Err(de::Error::custom(format_args!("`{name}` is given twice")));
                    }
                    fields.push((name, map.next_value()?));
                }
                Ok(Fields(fields))
            }
        }
        deserializer.deserialize_map(Object)
    }
}

impl Fields {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.get())
            .filter(|v| *v != "null")
    }

    /// The field `name` read as a `T`, or the message saying it is not
    /// `what`.
    fn read<T: for<'a> Deserialize<'a>>(
        &self,
        name: &str,
        what: &str,
    ) -> Result<Option<T>, String> {
        self.get(name)
            .map(|raw| serde_json::from_str(raw).map_err(|_| format!("`{name}` is not {what}")))
            .transpose()
    }
}

/// What a prompt holds: bytes of text, numbers (token ids) and media.
#[derive(Default)]
struct PromptSize {
    bytes: u64,
    numbers: u64,
    media: u64,
}

impl PromptSize {
    fn add(&mut self, other: PromptSize) {
        self.bytes += other.bytes;
        self.numbers += other.numbers;
        self.media += other.media;
    }

    /// A token per 3 bytes of text (rounded up; English runs about 4, and
    /// CJK text 3 bytes to a token), a token per number.
    fn tokens(&self) -> u64 {
        self.bytes.div_ceil(3) + self.numbers + self.media.saturating_mul(INLINE_MEDIA)
    }
}

impl<'de> Deserialize<'de> for PromptSize {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Walk;
        impl<'de> Visitor<'de> for Walk {
            type Value = PromptSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<PromptSize, E> {
                Ok(PromptSize {
                    bytes: text.len() as u64,
                    ..PromptSize::default()
                })
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<PromptSize, E> {
                Ok(PromptSize {
                    numbers: 1,
                    ..PromptSize::default()
                })
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<PromptSize, E> {
                self.visit_u64(n.unsigned_abs())
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<PromptSize, E> {
                self.visit_u64(0)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<PromptSize, E> {
                Ok(PromptSize::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<PromptSize, E> {
                Ok(PromptSize::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptSize, A::Error> {
                let mut size = PromptSize::default();
                while let Some(item) = seq.next_element::<PromptSize>()? {
                    size.add(item);
                }
                Ok(size)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PromptSize, A::Error> {
                let mut size = PromptSize::default();
                while let Some(name) = map.next_key::<String>()? {
                    if MEDIA.contains(&name.as_str()) {
                        // An image, a sound or a file, inline or linked:
                        // its bytes say nothing of its tokens.
                        map.next_value::<IgnoredAny>()?;
                        size.media += 1;
                    } else {
                        size.add(map.next_value::<PromptSize>()?);
                    }
                }
                Ok(size)
            }
        }
        deserializer.deserialize_any(Walk)
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

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
    let fields: Fields =
        serde_json::from_slice(body).map_err(|e| format!("the body is not a JSON object: {e}"))?;
    let model: String = fields
        .read("model", "a string")?
        .ok_or("`model` is missing")?;
    if model.is_empty() || model.len() > MAX_MODEL {
        return Err(format!("`model` must be 1 to {MAX_MODEL} bytes"));
    }
    let field = endpoint.prompt_field();
    let prompt = fields
        .get(field)
        .ok_or_else(|| format!("`{field}` is missing"))?;
    if endpoint == Endpoint::Chat && !prompt.starts_with('[') {
        return Err("`messages` is not an array".to_owned());
    }
    let input = serde_json::from_str::<PromptSize>(prompt)
        .map_err(|e| format!("`{field}` does not read: {e}"))?
        .tokens();
    let stream = endpoint != Endpoint::Embeddings
        && fields.read::<bool>("stream", "a boolean")?.unwrap_or(false);
    let wants_usage = fields
        .read::<StreamOptions>("stream_options", "an object")?
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let count = |name: &str, most: u64| -> Result<Option<u64>, String> {
        let what = format!("a whole number from 0 to {most}");
        match fields.read::<u64>(name, &what)? {
            Some(n) if n > most => Err(format!("`{name}` is not {what}")),
            n => Ok(n),
        }
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
    let rewritten = (stream && !wants_usage)
        .then(|| asking_for_usage(&fields))
        .transpose()?;
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

/// The body with `stream_options.include_usage` set: every other field
/// as written.
fn asking_for_usage(fields: &Fields) -> Result<Bytes, String> {
    let options = match fields.get("stream_options") {
        None => r#"{"include_usage":true}"#.to_owned(),
        Some(raw) => {
            let mut options: Vec<(String, Box<RawValue>)> = serde_json::from_str::<Fields>(raw)
                .map_err(|_| "`stream_options` is not an object".to_owned())?
                .0;
            options.retain(|(name, _)| name != "include_usage");
            let mut text = String::from(r#"{"include_usage":true"#);
            for (name, value) in &options {
                text.push(',');
                text.push_str(&quoted(name)?);
                text.push(':');
                text.push_str(value.get());
            }
            text.push('}');
            text
        }
    };
    let mut body = String::from("{");
    for (name, value) in fields.0.iter().filter(|(n, _)| n != "stream_options") {
        body.push_str(&quoted(name)?);
        body.push(':');
        body.push_str(value.get());
        body.push(',');
    }
    body.push_str(r#""stream_options":"#);
    body.push_str(&options);
    body.push('}');
    Ok(Bytes::from(body))
}

fn quoted(name: &str) -> Result<String, String> {
    serde_json::to_string(name).map_err(|e| format!("cannot write the body: {e}"))
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    #[test]
    fn a_chat_request_is_estimated_and_a_stream_asks_for_its_usage() {
        let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello there"}],
            "max_tokens":100,"n":2,"stream":true,"seed":12345678901234567890123}"#;
        let (asked, rewritten) = read(Endpoint::Chat, body, 4096).unwrap();
        assert_eq!(asked.model, "gpt-4o");
        assert!(asked.stream && !asked.wants_usage);
        // "user" and "hello there": 15 bytes, 5 tokens; 100 tokens × 2 choices.
        assert_eq!(asked.estimate.get("input"), 5);
        assert_eq!(asked.estimate.get("output"), 200);
        let rewritten = rewritten.unwrap();
        let sent: Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true);
        assert_eq!(sent["messages"][0]["content"], "hello there");
        // Every other field as written, even a number no u64 holds.
        assert!(
            std::str::from_utf8(&rewritten)
                .unwrap()
                .contains(r#""seed":12345678901234567890123"#)
        );
        let (_, kept) = read(
            Endpoint::Chat,
            br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":false,"x":[1]}}"#,
            1,
        )
        .unwrap();
        let sent: Value = serde_json::from_slice(&kept.unwrap()).unwrap();
        assert_eq!(
            sent["stream_options"],
            serde_json::json!({"include_usage": true, "x": [1]})
        );
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
        // Token ids, and an inline image.
        let (asked, _) = read(
            Endpoint::Completions,
            br#"{"model":"m","prompt":[1,2,3]}"#,
            0,
        )
        .unwrap();
        assert_eq!(asked.estimate.get("input"), 3);
        let image = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}]}}]}}"#,
            "A".repeat(100_000)
        );
        let (asked, _) = read(Endpoint::Chat, image.as_bytes(), 0).unwrap();
        assert!(asked.estimate.get("input") < 1_100, "{:?}", asked.estimate);
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
            (
                Endpoint::Chat,
                br#"{"model":"m","model":"n","messages":[]}"#,
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[],"stream_options":5}"#,
            ),
            (Endpoint::Completions, br#"{"model":"m","prompt":null}"#),
        ] {
            assert!(
                read(endpoint, body, 16).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // Nested past serde_json's depth: refused, not a stack overflow.
        let deep = format!(
            r#"{{"model":"m","prompt":{}1{}}}"#,
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert!(read(Endpoint::Completions, deep.as_bytes(), 1).is_err());
    }
}
