//! [`Settlement`]: where the real cost of a request comes from once its
//! response is known (the [`ActualCost`] extension, a header or trailer,
//! the streamed body), and the [`Meter`] that settles it when the body
//! ends.

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, Response};

use crate::limiter::Unsettled;

/// The real cost of a request, in units of its limit (tokens, credits),
/// which a handler puts in its response's extensions for a layer with a
/// [`Settlement`] to settle.
///
/// ```
/// use axum::response::IntoResponse;
/// use tower_redis_ratelimit::response::ActualCost;
///
/// async fn completion() -> impl IntoResponse {
///     let usage = 1_250; // what the model reported
///     (axum::Extension(ActualCost(usage)), "...the answer...")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActualCost(pub u64);

/// A part of a streamed response body, as a [`Settlement::from_body`]
/// meter sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum BodyPart<'a> {
    /// A data frame.
    Data(&'a [u8]),
    /// The trailers (a gRPC call's trailing metadata).
    Trailers(&'a HeaderMap),
}

/// A meter of a streamed body: the units a part adds to the request's
/// cost (`None`: this part says nothing of the cost).
pub type MeterFn = dyn Fn(BodyPart<'_>) -> Option<u64> + Send + Sync;

/// Where the real cost of an admitted request comes from, to settle it
/// after the response: the request is admitted against an estimate (the
/// policy's cost, or [`RateLimitLayer::with_estimate`](crate::RateLimitLayer::with_estimate)),
/// and the difference is charged or given back in the store when the cost
/// is known (see [`Reservation::settle`](crate::limiter::Reservation::settle)).
///
/// The cost is, first found: the response's [`ActualCost`] extension; the
/// [header](Self::from_header), in the response's headers and then in its
/// trailers (a gRPC call's trailing metadata); the sum of what the
/// [meter](Self::from_body) counted over the body's frames and trailers,
/// settled when the body ends, fails, or is dropped (a client that
/// disconnects is charged what was streamed). A response that reports no
/// cost leaves the estimate standing.
///
/// ```
/// use tower_redis_ratelimit::response::{BodyPart, Settlement};
///
/// // The upstream says how many tokens it used in `x-usage-tokens`, which
/// // the client does not see; a stream counts one token per data frame.
/// let settlement = Settlement::new()
///     .from_header(http::HeaderName::from_static("x-usage-tokens"))
///     .strip_header()
///     .from_body(|part| match part {
///         BodyPart::Data(_) => Some(1),
///         _ => None,
///     });
/// ```
#[derive(Clone, Default)]
pub struct Settlement {
    header: Option<HeaderName>,
    strip: bool,
    meter: Option<Arc<MeterFn>>,
}

impl Settlement {
    /// Settle from the [`ActualCost`] response extension only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also read the cost (a whole number of units) from the header
    /// `name`, in the response's headers or, when they lack it, in its
    /// trailers. A value that is not a whole number is ignored (logged at
    /// debug).
    #[must_use]
    pub fn from_header(mut self, name: HeaderName) -> Self {
        self.header = Some(name);
        self
    }

    /// Remove the [header](Self::from_header) before the client sees it.
    #[must_use]
    pub fn strip_header(mut self) -> Self {
        self.strip = true;
        self
    }

    /// Also meter the streamed body: `meter` sees each data frame and the
    /// trailers, and the cost is the sum of what it returns, settled when
    /// the body ends, fails or is dropped. Frames it returns `None` for
    /// add nothing; if it never returns a number, the estimate stands.
    #[must_use]
    pub fn from_body(
        mut self,
        meter: impl Fn(BodyPart<'_>) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.meter = Some(Arc::new(meter));
        self
    }

    /// A settlement from the header `header` (removed when `strip`) and
    /// the body `meter`.
    pub(crate) fn of(header: Option<HeaderName>, strip: bool, meter: Option<Arc<MeterFn>>) -> Self {
        Self {
            header,
            strip,
            meter,
        }
    }

    /// Settle `unsettled` (the counted checks of one request) from
    /// `response`: at once when its extension or headers give the cost,
    /// else a meter for its body (when a trailer or the body may give it),
    /// else the estimate stands.
    pub(crate) fn at_response<B>(
        self: &Arc<Self>,
        unsettled: Vec<Unsettled>,
        response: &mut Response<B>,
    ) -> Option<Meter> {
        if unsettled.is_empty() {
            return None;
        }
        let cost = match response.extensions().get::<ActualCost>() {
            Some(cost) => Some(cost.0),
            None => self.header_cost(response.headers_mut()),
        };
        let meter = Meter {
            settlement: Arc::clone(self),
            unsettled,
            reported: cost,
        };
        if cost.is_some() || (self.meter.is_none() && self.header.is_none()) {
            // Known now, or nothing later can tell: settle (or leave the
            // estimate) as the meter is dropped.
            drop(meter);
            return None;
        }
        Some(meter)
    }

    /// The cost in the header of `headers`, removed when stripped.
    fn header_cost(&self, headers: &mut HeaderMap) -> Option<u64> {
        let name = self.header.as_ref()?;
        let value = if self.strip {
            headers.remove(name)
        } else {
            headers.get(name).cloned()
        }?;
        let cost = value.to_str().ok().and_then(|v| v.trim().parse().ok());
        if cost.is_none() {
            tracing::debug!(header = %name, "rate limit: a cost header that is not a whole number; ignored");
        }
        cost
    }
}

impl fmt::Debug for Settlement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settlement")
            .field("header", &self.header)
            .field("strip", &self.strip)
            .field("meter", &self.meter.is_some())
            .finish()
    }
}

/// The checks of one request waiting for the cost its body reports:
/// settled when the body ends, fails or is dropped (whichever comes first),
/// in a task (the response never waits for the store).
pub(crate) struct Meter {
    settlement: Arc<Settlement>,
    unsettled: Vec<Unsettled>,
    /// The cost reported so far (`None`: nothing yet).
    reported: Option<u64>,
}

impl Meter {
    /// A data frame went to the client.
    pub(crate) fn data(&mut self, data: &[u8]) {
        if let Some(meter) = &self.settlement.meter {
            self.add(meter(BodyPart::Data(data)));
        }
    }

    /// The trailers went to the client (stripped of the cost header when
    /// asked).
    pub(crate) fn trailers(&mut self, trailers: &mut HeaderMap) {
        if let Some(cost) = self.settlement.header_cost(trailers) {
            // The header gives the whole cost.
            self.reported = Some(cost);
        }
        if let Some(meter) = &self.settlement.meter {
            self.add(meter(BodyPart::Trailers(trailers)));
        }
    }

    fn add(&mut self, units: Option<u64>) {
        if let Some(units) = units {
            self.reported = Some(self.reported.unwrap_or(0).saturating_add(units));
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        let unsettled = std::mem::take(&mut self.unsettled);
        let Some(cost) = self.reported else {
            for u in &unsettled {
                crate::metrics::settlement(u.limit_name(), "unreported");
            }
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            for u in &unsettled {
                tracing::warn!("rate limit: no runtime to settle a cost in; the estimate stands");
                crate::metrics::settlement(u.limit_name(), "failed");
            }
            return;
        };
        for u in unsettled {
            // Logged and counted by the settlement itself.
            runtime.spawn(async move {
                let _settled = u.settle(cost).await;
            });
        }
    }
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter")
            .field("checks", &self.unsettled.len())
            .field("reported", &self.reported)
            .finish()
    }
}
