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

    /// Refuses a header that can never carry a cost.
    pub(crate) fn usable(&self) -> Result<(), crate::PolicyError> {
        let Some(header) = &self.header else {
            return Ok(());
        };
        match unusable_cost_header(header) {
            Some(reason) => Err(crate::PolicyError::UnusableCostHeader {
                header: header.to_string(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Whether anything after the response's head (its trailers, its
    /// body) can give the cost.
    fn body_can_tell(&self) -> bool {
        self.header.is_some() || self.meter.is_some()
    }

    /// The cost in the header of `headers`, left in place.
    fn header_cost(&self, headers: &HeaderMap) -> Option<u64> {
        let name = self.header.as_ref()?;
        let value = headers.get(name)?;
        let cost = value.to_str().ok().and_then(|v| v.trim().parse().ok());
        if cost.is_none() {
            tracing::debug!(header = %name, "rate limit: a cost header that is not a whole number; ignored");
        }
        cost
    }

    /// Whether a header is stripped.
    fn strips(&self) -> bool {
        self.strip && self.header.is_some()
    }

    /// Remove the header from `headers`, when it is stripped.
    fn strip(&self, headers: &mut HeaderMap) {
        if let (true, Some(name)) = (self.strip, &self.header) {
            headers.remove(name);
        }
    }
}

/// Settle the checks of one response, each under the settlement that says
/// where its cost comes from (a settlement with no check: the request was
/// not counted, as under an `allow` list or a failed-open store; its header
/// is still stripped). Every cost is read before any header is stripped,
/// so settlements reading one header all see it, and a stripped header
/// never reaches the client, whatever the verdict. The cost is settled at
/// once when the response's extension or head gives it; otherwise the
/// returned meters settle it when the body ends, and strip the trailers.
pub(crate) fn settle_response<B>(
    settlements: impl IntoIterator<Item = (Arc<Settlement>, Option<Unsettled>)>,
    response: &mut Response<B>,
) -> Vec<Meter> {
    let extension = response.extensions().get::<ActualCost>().map(|cost| cost.0);
    let mut meters: Vec<Meter> = settlements
        .into_iter()
        .map(|(settlement, unsettled)| {
            let reported = extension.or_else(|| settlement.header_cost(response.headers()));
            Meter {
                settlement,
                unsettled,
                reported,
            }
        })
        .collect();
    for meter in &meters {
        meter.settlement.strip(response.headers_mut());
    }
    meters.retain_mut(Meter::waits_for_body);
    meters
}

/// Why `name` can never carry a request's cost (`None`: it can): the
/// fields of the connection (hop-by-hop, RFC 9110 §7.6.1), which HTTP
/// servers and proxies consume and never pass on, and those framing the
/// body, which say its length, not a cost.
pub(crate) fn unusable_cost_header(name: &HeaderName) -> Option<&'static str> {
    use http::header::{CONNECTION, CONTENT_LENGTH, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};
    if [CONNECTION, TE, UPGRADE].contains(name)
        || ["keep-alive", "proxy-connection"].contains(&name.as_str())
    {
        return Some(
            "it is a hop-by-hop field of the connection, consumed before a settlement sees it",
        );
    }
    if [CONTENT_LENGTH, TRANSFER_ENCODING, TRAILER].contains(name) {
        return Some(
            "it frames the body (its length or coding), so it is set by the server, not by the upstream's accounting",
        );
    }
    None
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

/// A check of one request waiting for the cost its body reports: settled
/// when the body ends, fails or is dropped (whichever comes first), in a
/// task (the response never waits for the store). A meter with no check
/// left only strips its header from the trailers.
pub(crate) struct Meter {
    settlement: Arc<Settlement>,
    unsettled: Option<Unsettled>,
    /// The cost reported so far (`None`: nothing yet).
    reported: Option<u64>,
}

impl Meter {
    /// After the response's head: settle now what the head gave (or what
    /// nothing later can give), and whether the body is still to be seen
    /// (checks left to settle from it, or a header to strip from its
    /// trailers).
    fn waits_for_body(&mut self) -> bool {
        if self.reported.is_some() || !self.settlement.body_can_tell() {
            self.settle_now();
        }
        self.unsettled.is_some() || self.settlement.strips()
    }

    /// A data frame went to the client.
    pub(crate) fn data(&mut self, data: &[u8]) {
        if let (true, Some(meter)) = (self.unsettled.is_some(), &self.settlement.meter) {
            self.add(meter(BodyPart::Data(data)));
        }
    }

    /// The trailers are about to go to the client: read the cost they
    /// give (every meter reads them before any [strips](Self::strip)).
    pub(crate) fn trailers(&mut self, trailers: &HeaderMap) {
        if self.unsettled.is_none() {
            return;
        }
        if let Some(cost) = self.settlement.header_cost(trailers) {
            // The header gives the whole cost.
            self.reported = Some(cost);
        }
        if let Some(meter) = &self.settlement.meter {
            self.add(meter(BodyPart::Trailers(trailers)));
        }
    }

    /// Remove the header from the trailers, when it is stripped.
    pub(crate) fn strip(&self, trailers: &mut HeaderMap) {
        self.settlement.strip(trailers);
    }

    fn add(&mut self, units: Option<u64>) {
        if let Some(units) = units {
            self.reported = Some(self.reported.unwrap_or(0).saturating_add(units));
        }
    }

    /// Settle the check left with the cost reported (none: the estimate
    /// stands), in a task.
    fn settle_now(&mut self) {
        let Some(unsettled) = self.unsettled.take() else {
            return;
        };
        let Some(cost) = self.reported else {
            crate::metrics::settlement(unsettled.limit_name(), "unreported");
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("rate limit: no runtime to settle a cost in; the estimate stands");
            crate::metrics::settlement(unsettled.limit_name(), "failed");
            return;
        };
        // Logged and counted by the settlement itself.
        runtime.spawn(async move {
            let _settled = unsettled.settle(cost).await;
        });
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.settle_now();
    }
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter")
            .field("unsettled", &self.unsettled.is_some())
            .field("reported", &self.reported)
            .finish()
    }
}
