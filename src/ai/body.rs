//! The bodies of [`OpenAi`](super::OpenAi): the request as read (or as it
//! came, for a request the layer does not read), and the answer, watched
//! for its usage as it passes.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use serde::Deserialize;

use super::charge::{Bill, Ended};
use super::stream::Events;
use super::usage::{Reported, reported};
use crate::http::Whole;

pin_project! {
    /// The body of a request passed to the inner service: read whole by
    /// the layer, or, for a request it does not read, as it came.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    #[derive(Debug)]
    enum RequestKind<B> {
        Read { whole: Whole },
        Untouched { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn read(data: Bytes) -> Self {
        Self {
            kind: RequestKind::Read {
                whole: Whole::new(data),
            },
        }
    }

    pub(crate) fn untouched(body: B) -> Self {
        Self {
            kind: RequestKind::Untouched { body },
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Read { whole } => whole.poll(),
            RequestKindProj::Untouched { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Read { whole } => whole.is_end_stream(),
            RequestKind::Untouched { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Read { whole } => whole.size_hint(),
            RequestKind::Untouched { body } => body.size_hint(),
        }
    }
}

/// The most bytes of an answer that is not streamed kept to read its
/// usage: a longer one is charged its estimate.
const MAX_ANSWER: usize = 8 << 20;

/// How an answer is watched.
#[derive(Debug)]
pub(crate) enum Watch {
    /// Server-sent events.
    Stream(Events),
    /// One JSON object, kept (up to [`MAX_ANSWER`]) to read at its end.
    Json(Option<BytesMut>),
    /// An error answer: charged nothing billable.
    Refused,
}

pin_project! {
    /// The body of every answer of [`OpenAi`](super::OpenAi).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    #[derive(Debug)]
    enum ResponseKind<B> {
        Watched {
            #[pin]
            body: B,
            watch: Watch,
            // Settled when the body ends; dropped before, as it says.
            bill: Option<Bill>,
            // The end of a stream's events, and the trailers, still to
            // pass on once the body has ended.
            rest: Option<Bytes>,
            trailers: Option<HeaderMap>,
        },
        Untouched { #[pin] body: B },
        Full { whole: Whole },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn watched(body: B, watch: Watch, bill: Bill) -> Self {
        Self {
            kind: ResponseKind::Watched {
                body,
                watch,
                bill: Some(bill),
                rest: None,
                trailers: None,
            },
        }
    }

    pub(crate) fn untouched(body: B) -> Self {
        Self {
            kind: ResponseKind::Untouched { body },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: ResponseKind::Full {
                whole: Whole::new(data),
            },
        }
    }
}

/// The part of an answer read for its cost.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    usage: serde_json::Value,
}

impl Watch {
    /// How the answer ended, once its body has.
    fn ended(&mut self) -> Ended {
        match self {
            Watch::Stream(events) => Ended::Reported(events.usage.clone()),
            Watch::Json(Some(kept)) => {
                let usage = serde_json::from_slice::<Answer>(kept)
                    .map(|answer| reported(Some(&answer.usage)))
                    .unwrap_or(Reported::Bad("the answer is not a JSON object"));
                Ended::Reported(usage)
            }
            Watch::Json(None) => Ended::Reported(Reported::Bad("the answer is too long to read")),
            Watch::Refused => Ended::Refused,
        }
    }

    /// Watch `data` as it passes; what to pass on.
    fn data(&mut self, data: Bytes, bill: Option<&mut Bill>) -> Bytes {
        match self {
            Watch::Stream(events) => {
                let out = events.feed(&data);
                if let Some(bill) = bill {
                    // A stream cut after its usage came is charged it.
                    bill.if_dropped = match &events.usage {
                        usage @ Reported::Usage(_) => Ended::Reported(usage.clone()),
                        _ => Ended::Cut {
                            output: events.content_chunks,
                        },
                    };
                }
                out
            }
            Watch::Json(kept) => {
                if let Some(buf) = kept {
                    if buf.len() + data.len() > MAX_ANSWER {
                        *kept = None;
                    } else {
                        buf.extend_from_slice(&data);
                    }
                }
                data
            }
            Watch::Refused => data,
        }
    }
}

/// The answer's body has ended: its bill settled, and the end of a
/// stream's events still to pass on.
fn end(watch: &mut Watch, bill: &mut Option<Bill>) -> Option<Bytes> {
    let tail = match watch {
        Watch::Stream(events) => Some(events.finish()).filter(|tail| !tail.is_empty()),
        _ => None,
    };
    if let Some(bill) = bill.take() {
        bill.settle(watch.ended());
    }
    tail
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Watched {
                mut body,
                watch,
                bill,
                rest,
                trailers,
            } => loop {
                if let Some(rest) = rest.take() {
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
                if let Some(trailers) = trailers.take() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                if bill.is_none() {
                    return Poll::Ready(None);
                }
                match ready!(body.as_mut().poll_frame(cx)) {
                    Some(Ok(frame)) => {
                        let frame = match frame.into_data() {
                            Ok(data) => data,
                            Err(frame) => {
                                // Trailers end the body: its reader asks for
                                // nothing after them.
                                *rest = end(watch, bill);
                                *trailers = frame.into_trailers().ok();
                                continue;
                            }
                        };
                        let ended = body.is_end_stream();
                        let mut data = watch.data(frame, bill.as_mut());
                        // A body that knows its length ends with its last
                        // frame: its reader may never ask for more.
                        if ended && let Some(tail) = end(watch, bill) {
                            if data.is_empty() {
                                data = tail;
                            } else {
                                *rest = Some(tail);
                            }
                        }
                        if data.is_empty() {
                            continue;
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    Some(Err(error)) => {
                        // A stream cut: dropping the bill settles it as
                        // it says (what was streamed, for a stream).
                        drop(bill.take());
                        return Poll::Ready(Some(Err(error)));
                    }
                    None => *rest = end(watch, bill),
                }
            },
            ResponseKindProj::Untouched { body } => body.poll_frame(cx),
            ResponseKindProj::Full { whole } => whole.poll(),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Watched {
                bill,
                rest,
                trailers,
                ..
            } => bill.is_none() && rest.is_none() && trailers.is_none(),
            ResponseKind::Untouched { body } => body.is_end_stream(),
            ResponseKind::Full { whole } => whole.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Watched { body, watch, .. } => match watch {
                // Passed on unchanged: the inner body's length.
                Watch::Json(_) | Watch::Refused => body.size_hint(),
                Watch::Stream(_) => SizeHint::default(),
            },
            ResponseKind::Untouched { body } => body.size_hint(),
            ResponseKind::Full { whole } => whole.size_hint(),
        }
    }
}
