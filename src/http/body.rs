//! [`ResponseBody`]: the inner service's body, or the short body of a
//! response the layer wrote itself.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::settlement::Meter;
use crate::limiter::Permit;

pin_project! {
    /// The body of every response of [`RateLimit`](crate::RateLimit).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        // A concurrency slot is held until the body ends or is dropped;
        // a cost the body reports is settled then.
        Inner { #[pin] body: B, leases: Vec<Permit>, meters: Vec<Meter> },
        Full { whole: Whole },
    }
}

/// Bytes held whole: an answer the layer wrote, a request body read.
#[derive(Debug)]
pub(crate) struct Whole(Option<Bytes>);

impl Whole {
    pub(crate) fn new(data: Bytes) -> Self {
        Self((!data.is_empty()).then_some(data))
    }

    pub(crate) fn poll<E>(&mut self) -> Poll<Option<Result<Frame<Bytes>, E>>> {
        Poll::Ready(self.0.take().map(|d| Ok(Frame::data(d))))
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.as_ref().map_or(0, |d| d.len() as u64))
    }
}

impl<B> ResponseBody<B> {
    /// The inner body, holding concurrency slots and metering its cost
    /// until it ends.
    pub(crate) fn metered(body: B, leases: Vec<Permit>, meters: Vec<Meter>) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                leases,
                meters,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                whole: Whole::new(data),
            },
        }
    }
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
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner {
                body,
                leases,
                meters,
            } => {
                let mut frame = ready!(body.poll_frame(cx));
                match &mut frame {
                    Some(Ok(frame)) if !meters.is_empty() => {
                        if let Some(data) = frame.data_ref() {
                            meters.iter_mut().for_each(|m| m.data(data));
                        } else if let Some(trailers) = frame.trailers_mut() {
                            // Every meter reads the trailers before any
                            // strips its header from them.
                            meters.iter_mut().for_each(|m| m.trailers(trailers));
                            meters.iter().for_each(|m| m.strip(trailers));
                        }
                    }
                    Some(Ok(_)) => {}
                    _ => {
                        // The body is done (or failed): give the slot back
                        // and settle the cost now.
                        leases.clear();
                        meters.clear();
                    }
                }
                Poll::Ready(frame)
            }
            KindProj::Full { whole } => whole.poll(),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Full { whole } => whole.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Full { whole } => whole.size_hint(),
        }
    }
}
