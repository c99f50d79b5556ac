//! A streamed answer's server-sent events, watched as they pass: the
//! content chunks counted, the usage chunk read (and kept from a client
//! that did not ask for it).

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::Value;

use super::usage::{Reported, reported};

/// The longest event read: a longer one is passed on unread.
const MAX_EVENT: usize = 1 << 20;

/// The events of one streamed answer.
#[derive(Debug)]
pub(crate) struct Events {
    /// Bytes of an event not yet ended.
    partial: BytesMut,
    /// How far into `partial` no event's end was found.
    scanned: usize,
    /// Whether the usage chunk is kept from the client.
    strip_usage: bool,
    /// Chunks that carried content: about a token each.
    pub(crate) content_chunks: u64,
    /// The usage the stream reported, if it did.
    pub(crate) usage: Reported,
}

/// A chunk, read leniently: a field of an unexpected shape costs that
/// field, not the chunk's usage.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Value,
    #[serde(default)]
    usage: Value,
}

/// Whether a chunk's choice carries output: any field of its `delta`
/// but the role (content, tool calls, a refusal, reasoning, audio), or a
/// completion's `text`.
fn has_output(choice: &Value) -> bool {
    let given = |v: &Value| !v.is_null() && v.as_str() != Some("");
    let delta = choice
        .get("delta")
        .and_then(Value::as_object)
        .is_some_and(|delta| delta.iter().any(|(name, v)| name != "role" && given(v)));
    delta || choice.get("text").is_some_and(given)
}

impl Events {
    pub(crate) fn new(strip_usage: bool) -> Self {
        Self {
            partial: BytesMut::new(),
            scanned: 0,
            strip_usage,
            content_chunks: 0,
            usage: Reported::Missing,
        }
    }

    /// Read `data`; what to pass on now (whole events).
    pub(crate) fn feed(&mut self, data: &[u8]) -> Bytes {
        self.partial.extend_from_slice(data);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.partial, self.scanned) {
            let event = self.partial.split_to(end).freeze();
            self.scanned = 0;
            if self.read(&event) {
                out.extend_from_slice(&event);
            }
        }
        if self.partial.len() > MAX_EVENT {
            // Never ends: passed on unread, as it came.
            out.extend_from_slice(&self.partial);
            self.partial.clear();
        }
        // What is held has no event's end: the next search starts near its
        // end (an end's 4 bytes may straddle two frames).
        self.scanned = self.partial.len().saturating_sub(3);
        out.freeze()
    }

    /// What is left when the stream ends (an event without its blank line).
    pub(crate) fn finish(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.partial).freeze();
        if !rest.is_empty() && self.read(&rest) {
            return rest;
        }
        Bytes::new()
    }

    /// Read one event; whether to pass it on.
    fn read(&mut self, event: &[u8]) -> bool {
        let mut data = Vec::new();
        for line in event.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(rest) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
            }
        }
        if data.is_empty() || data == b"[DONE]" {
            return true;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(&data) else {
            return true;
        };
        let choices = chunk.choices.as_array().map_or(&[][..], Vec::as_slice);
        if choices.iter().any(has_output) {
            self.content_chunks += 1;
        }
        if chunk.usage.is_null() {
            return true;
        }
        self.usage = reported(Some(&chunk.usage));
        // The usage chunk itself (no choices) goes only to a client that
        // asked for it.
        !(self.strip_usage && choices.is_empty())
    }
}

/// Where the first event of `buf` ends (after its blank line), searched
/// from `from`.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let buf_from = &buf[from.min(buf.len())..];
    let lf = find(buf_from, b"\n\n").map(|i| from + i + 2);
    let crlf = find(buf_from, b"\r\n\r\n").map(|i| from + i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::Usage;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn the_usage_chunk_is_read_and_kept_from_a_client_that_did_not_ask() {
        for strip in [true, false] {
            // Cut anywhere: events are read whole.
            for cut in [1, 7, 50, STREAM.len()] {
                let mut events = Events::new(strip);
                let mut out = Vec::new();
                for piece in STREAM.as_bytes().chunks(cut) {
                    out.extend_from_slice(&events.feed(piece));
                }
                out.extend_from_slice(&events.finish());
                let out = String::from_utf8(out).unwrap();
                assert_eq!(events.content_chunks, 2);
                assert_eq!(
                    events.usage,
                    Reported::Usage(
                        Usage::new()
                            .with("input", 9)
                            .with("cached_input", 0)
                            .with("output", 2)
                    )
                );
                assert_eq!(out.contains("prompt_tokens"), !strip, "{out}");
                assert!(out.ends_with("data: [DONE]\n\n"));
                let usage_event = STREAM.lines().nth(8).unwrap().len() + 2;
                assert_eq!(
                    out.len() + if strip { usage_event } else { 0 },
                    STREAM.len()
                );
            }
        }
    }

    #[test]
    fn a_stream_cut_short_counts_its_content_and_an_endless_event_passes() {
        let mut events = Events::new(true);
        let half = &STREAM[..STREAM.find("finish_reason").unwrap()];
        let out = events.feed(half.as_bytes());
        assert_eq!(events.content_chunks, 2);
        assert_eq!(events.usage, Reported::Missing);
        assert!(half.starts_with(std::str::from_utf8(&out).unwrap()));
        // A tool call and a refusal are output too; a role alone is not.
        let mut events = Events::new(true);
        events.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n");
        events.feed(b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n");
        events.feed(b"data: {\"choices\":[{\"delta\":{\"refusal\":\"no\"}}]}\n\n");
        assert_eq!(events.content_chunks, 2);
        let mut events = Events::new(true);
        let endless = vec![b'x'; MAX_EVENT + 1];
        assert_eq!(events.feed(&endless).len(), endless.len());
        let crlf = "data: {\"choices\":null,\"usage\":{\"prompt_tokens\":1}}\r\n\r\n";
        assert!(events.feed(crlf.as_bytes()).is_empty());
        assert!(matches!(events.usage, Reported::Usage(_)));
    }
}
