//! Request bodies bounded in bytes and in time, for the routes that read
//! one: a body is read whole before its handler runs, at most `BODY_LIMIT`
//! bytes of it (`413` past that, or at once when its `content-length` says
//! so), within `BODY_TIMEOUT` of its first byte asked for (`408`), and
//! every body held at once shares `BODY_MEMORY` bytes (`503` with
//! `Retry-After` when they are taken). A body's bytes stay counted until
//! its response has been sent (the demo answers the body back).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// `BODY_LIMIT`, `BODY_MEMORY` and `BODY_TIMEOUT`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BodyBounds {
    /// The most one body may hold, in bytes: one request at a time per
    /// connection (HTTP/1.1), so also the most a connection holds.
    pub(crate) limit: usize,
    /// The most every body held at once may hold, in bytes.
    pub(crate) memory: usize,
    /// How long a body may take to arrive.
    pub(crate) timeout: Duration,
}

/// The default `BODY_LIMIT`: 64 KiB, a long prompt.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// The default `BODY_MEMORY`: 64 MiB, a thousand bodies at the limit.
pub(crate) const DEFAULT_BODY_MEMORY: usize = 64 * 1024 * 1024;
/// The default `BODY_TIMEOUT`.
pub(crate) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds, and the bytes every body held now has taken of `memory`.
#[derive(Clone)]
pub(crate) struct Bodies {
    bounds: BodyBounds,
    memory: Arc<Semaphore>,
}

impl Bodies {
    pub(crate) fn new(bounds: BodyBounds) -> Self {
        Self {
            bounds,
            memory: Arc::new(Semaphore::new(bounds.memory)),
        }
    }
}

/// Why a body was not read.
enum Refused {
    TooLarge,
    Busy,
    TooSlow,
    Broken,
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let (status, text) = match self {
            Self::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n"),
            Self::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                "too many request bodies held at once; retry\n",
            ),
            Self::TooSlow => (StatusCode::REQUEST_TIMEOUT, "request body too slow\n"),
            Self::Broken => (StatusCode::BAD_REQUEST, "request body cut off\n"),
        };
        // The rest of the body is never read: the connection closes.
        let mut response = (status, [(header::CONNECTION, "close")], text).into_response();
        if matches!(self, Self::Busy) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
        }
        response
    }
}

/// The middleware: reads the body under the bounds, then calls the route
/// with it; its bytes stay counted until the response's body is sent or
/// dropped.
pub(crate) async fn bounded(
    State(bodies): State<Bodies>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > bodies.bounds.limit as u64) {
        return Refused::TooLarge.into_response();
    }
    let read = tokio::time::timeout(bodies.bounds.timeout, read(&bodies, body, declared));
    let (bytes, held) = match read.await {
        Ok(Ok(read)) => read,
        Ok(Err(refused)) => return refused.into_response(),
        Err(_) => return Refused::TooSlow.into_response(),
    };
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    // The permit goes with the response's body, dropped when it is done.
    response.map(|body| {
        Body::new(body.map_frame(move |frame| {
            let _held = &held;
            frame
        }))
    })
}

/// The body whole, and its bytes' share of the memory (never more than
/// twice the bytes received).
async fn read(
    bodies: &Bodies,
    mut body: Body,
    declared: Option<u64>,
) -> Result<(Vec<u8>, Option<OwnedSemaphorePermit>), Refused> {
    let limit = bodies.bounds.limit;
    let mut bytes: Vec<u8> = Vec::new();
    let mut held: Option<OwnedSemaphorePermit> = None;
    // Room taken as the bytes come (doubling, up to what was declared),
    // each byte of it counted before it is allocated: a head that declares
    // a large body and sends none of it holds nothing.
    let ceiling = declared
        .and_then(|d| usize::try_from(d).ok())
        .map_or(limit, |d| d.min(limit));
    let mut grow = |bytes: &mut Vec<u8>, needed: usize| -> Result<(), Refused> {
        if needed > limit {
            return Err(Refused::TooLarge);
        }
        if needed <= bytes.capacity() {
            return Ok(());
        }
        let room = needed.max((bytes.capacity() * 2).min(ceiling));
        let more = u32::try_from(room - bytes.capacity()).map_err(|_| Refused::TooLarge)?;
        let permit = Arc::clone(&bodies.memory)
            .try_acquire_many_owned(more)
            .map_err(|_| Refused::Busy)?;
        match &mut held {
            Some(held) => held.merge(permit),
            None => held = Some(permit),
        }
        bytes
            .try_reserve_exact(room - bytes.len())
            .map_err(|_| Refused::Busy)
    };
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| Refused::Broken)?;
        if let Ok(data) = frame.into_data() {
            let needed = bytes.len() + data.len();
            grow(&mut bytes, needed)?;
            bytes.extend_from_slice(&data);
        }
    }
    Ok((bytes, held))
}
