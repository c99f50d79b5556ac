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
    /// Whether the usage chunk is kept from the client.
    strip_usage: bool,
    /// Chunks that carried content: about a token each.
    pub(crate) content_chunks: u64,
    /// The usage the stream reported, if it did.
    pub(crate) usage: Reported,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Value,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

impl Events {
    pub(crate) fn new(strip_usage: bool) -> Self {
        Self {
            partial: BytesMut::new(),
            strip_usage,
            content_chunks: 0,
            usage: Reported::Missing,
        }
    }

    /// Read `data`; what to pass on now (whole events).
    pub(crate) fn feed(&mut self, data: &[u8]) -> Bytes {
        self.partial.extend_from_slice(data);
        let mut out = BytesMut::new();
        while let Some(end) = event_end(&self.partial) {
            let event = self.partial.split_to(end).freeze();
            if self.read(&event) {
                out.extend_from_slice(&event);
            }
        }
        if self.partial.len() > MAX_EVENT {
            // Never ends: passed on unread, as it came.
            out.extend_from_slice(&self.partial);
            self.partial.clear();
        }
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
        if chunk.choices.iter().any(|c| {
            let text = c.delta.as_ref().and_then(|d| d.content.as_deref());
            text.or(c.text.as_deref()).is_some_and(|t| !t.is_empty())
        }) {
            self.content_chunks += 1;
        }
        if chunk.usage.is_null() {
            return true;
        }
        self.usage = reported(Some(&chunk.usage));
        // The usage chunk itself (no choices) goes only to a client that
        // asked for it.
        !(self.strip_usage && chunk.choices.is_empty())
    }
}

/// Where the first event of `buf` ends (after its blank line).
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = find(buf, b"\n\n").map(|i| i + 2);
    let crlf = find(buf, b"\r\n\r\n").map(|i| i + 4);
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
        let mut events = Events::new(true);
        let endless = vec![b'x'; MAX_EVENT + 1];
        assert_eq!(events.feed(&endless).len(), endless.len());
        let crlf = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\r\n\r\n";
        assert!(events.feed(crlf.as_bytes()).is_empty());
        assert!(matches!(events.usage, Reported::Usage(_)));
    }
}
