//! [`ResponseFuture`]: a small state machine over the engine's verdict —
//! wait for it (and, when delaying, for the key's turn), then for the inner
//! service, or answer the denial.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::body::ResponseBody;
use super::denial;
use super::fields::Fields;
use super::settings::{Rejection, Shared};
use super::settlement::{Settlement, settle_response};
use crate::decision::Decision;
use crate::key::KeyHash;
use crate::limiter::{Check, DecidedBy, LimitError, Permit, Unsettled, Verdict};
use crate::policy::Policy;
use crate::store::bounded_key;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
    }
}

/// What a request waiting for a verdict carries from state to state.
struct Pending<S, ReqBody> {
    request: Request<ReqBody>,
    service: S,
    /// Whether `service` is ready (holding whatever its readiness reserves,
    /// such as a concurrency-limit permit or a buffer slot). A request that
    /// is delayed gives that up while it sleeps, and drives a clone to
    /// readiness once it is admitted.
    ready: bool,
    shared: Arc<Shared>,
    /// The key, to check again after a delay, to log a shadowed denial
    /// and to settle the cost (kept only by layers that delay, shadow or
    /// settle).
    key: Option<String>,
    /// Time spent delayed so far.
    waited: Duration,
    /// Settled after the response: the policy counting the estimate, and
    /// when the last check was sent.
    estimate: Option<(Arc<Policy>, Instant)>,
}

/// The rate-limit fields of an admitted request's response, rendered when
/// it was admitted (none when nothing limited it).
type Shown = Option<Fields>;

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        // What waits is boxed: the future stays the size of the usual
        // `Calling` state (it moves a few times per request).
        Checking {
            check: Check,
            pending: Option<Box<Pending<S, ReqBody>>>,
        },
        Delaying {
            sleep: Pin<Box<Sleep>>,
            pending: Option<Box<Pending<S, ReqBody>>>,
        },
        /// Admitted after a delay: waiting for the inner service to be ready.
        Readying {
            admitted: Option<Box<Admitted<S, ReqBody>>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            shown: Shown,
            permit: Option<Box<Permit>>,
            unsettled: Settling,
        },
        Answered {
            response: Option<Box<Response<Bytes>>>,
        },
    }
}

/// An admitted request waiting for its service to be ready.
struct Admitted<S, ReqBody> {
    service: S,
    request: Request<ReqBody>,
    shown: Shown,
    permit: Option<Box<Permit>>,
    unsettled: Settling,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// A request nothing limits (its response's cost header is still
    /// stripped when the layer says so).
    pub(crate) fn unlimited(future: S::Future, shared: &Shared) -> Self {
        Self {
            state: State::Calling {
                future,
                shown: None,
                permit: None,
                unsettled: unsettled(shared, None, None, None, DecidedBy::AllowedKey),
            },
        }
    }

    pub(crate) fn answered(response: Response<Bytes>) -> Self {
        Self {
            state: State::Answered {
                response: Some(Box::new(response)),
            },
        }
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>> + Clone,
{
    /// Check `key` for `request`, bound for `service` (ready: it goes with
    /// the request and a clone stays, unless the request is answered at
    /// once, as a denial from the deny cache is).
    pub(crate) fn start(
        request: Request<ReqBody>,
        service: &mut S,
        shared: &Arc<Shared>,
        key: String,
    ) -> Self {
        // Only a layer that settles costs estimates them (the request is
        // not moved otherwise).
        let (request, estimate) = if shared.settlement.is_some() {
            let (request, policy) = shared.estimated(request);
            (request, policy.map(|policy| (policy, Instant::now())))
        } else {
            (request, None)
        };
        let kept = (shared.rendering.keeps_keys() || estimate.is_some()).then(|| key.clone());
        let mut check = check(shared, key, estimate.as_ref());
        let step = match check.now() {
            Some(verdict) => {
                match next_step(verdict, shared, kept.as_deref(), Duration::ZERO, &request) {
                    Next::Answer(response) => return Self::answered(response),
                    step => Some(step),
                }
            }
            None => None,
        };
        let clone = service.clone();
        let service = std::mem::replace(service, clone);
        if let Some(Next::Call(decision, decided_by, permit)) = step {
            // Admitted at once (an in-process store): nothing to keep but
            // the rendered fields (and what settles the cost).
            let unsettled = unsettled(shared, kept, estimate, decision.as_ref(), decided_by);
            let state = admit(
                request, service, true, shared, decision, decided_by, permit, unsettled,
            );
            return Self { state };
        }
        let pending = Box::new(Pending {
            request,
            service,
            ready: true,
            shared: Arc::clone(shared),
            key: kept,
            waited: Duration::ZERO,
            estimate,
        });
        let state = match step {
            Some(step) => step.into_state(pending),
            None => State::Checking {
                check,
                pending: Some(pending),
            },
        };
        Self { state }
    }
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Checking { .. } => "checking",
            State::Delaying { .. } => "delaying",
            State::Readying { .. } => "readying",
            State::Calling { .. } => "calling",
            State::Answered { .. } => "answered",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

/// The check of `key` (estimated when the cost is settled after the
/// response).
fn check(shared: &Shared, key: String, estimate: Option<&(Arc<Policy>, Instant)>) -> Check {
    match estimate {
        Some((policy, _)) => shared.deciding.check_estimated(key, policy),
        None => shared.deciding.check_owned(key),
    }
}

/// Where the real cost of a request comes from after its response, and
/// its count to settle (`None` there: nothing counted it, but the
/// settlement still strips its header). `None`: the layer settles nothing.
/// (Boxed: most layers settle nothing, and the future of every request
/// carries this field.)
type Settling = Option<Box<(Arc<Settlement>, Option<Unsettled>)>>;

/// What settles the cost of a request admitted with `decision` by
/// `decided_by`, when the layer settles costs.
fn unsettled(
    shared: &Shared,
    key: Option<String>,
    estimate: Option<(Arc<Policy>, Instant)>,
    decision: Option<&Decision>,
    decided_by: DecidedBy,
) -> Settling {
    let settlement = Arc::clone(shared.settlement.as_ref()?);
    let counted = || {
        let ((policy, at), key, decision) = (estimate?, key?, decision?);
        let key = bounded_key(&key).into_owned();
        shared
            .deciding
            .unsettled(key, policy, decided_by, decision, at)
    };
    Some(Box::new((settlement, counted())))
}

/// What to do after a verdict. (Unboxed: it moves once per request.)
#[allow(clippy::large_enum_variant)]
enum Next {
    Call(Option<Decision>, DecidedBy, Option<Box<Permit>>),
    Wait(Duration),
    Answer(Response<Bytes>),
}

/// The step a verdict of the engine leads to, under the layer's rejection.
/// (Whether `request` is a gRPC call, whose denials are trailers-only gRPC
/// statuses, is read only to answer it.)
fn next_step<ReqBody>(
    verdict: Result<Verdict, LimitError>,
    shared: &Shared,
    key: Option<&str>,
    waited: Duration,
    request: &Request<ReqBody>,
) -> Next {
    let grpc = || denial::is_grpc(request.headers());
    let verdict = match verdict {
        Ok(verdict) => verdict,
        // The store failed under FailMode::Closed (the engine logged it).
        Err(_) => {
            return Next::Answer(denial::unavailable(grpc()));
        }
    };
    let (decision, decided_by, permit) = verdict.into_boxed_parts();
    let decision = match decision {
        Some(decision) if !decision.allowed() => decision,
        decision => return Next::Call(decision, decided_by, permit),
    };
    let retry_after_ms = decision.retry_after().as_millis() as u64;
    match &shared.rendering.rejection {
        Rejection::Shadow => {
            tracing::info!(key = %KeyHash::of(shared.limiter.name(), key.unwrap_or_default()), retry_after_ms, policy = %shared.limiter.policy(), "rate limit (shadow): would deny; letting through");
            Next::Call(Some(decision), decided_by, None)
        }
        Rejection::Delay { max_wait }
            if waited.saturating_add(decision.retry_after()) <= *max_wait =>
        {
            tracing::debug!(key = %KeyHash::of(shared.limiter.name(), key.unwrap_or_default()), retry_after_ms, "rate limit: delaying");
            // At least 1 ms: a store that answers a zero wait must not make
            // the request check again in a tight loop.
            Next::Wait(decision.retry_after().max(Duration::from_millis(1)))
        }
        _ => Next::Answer(shared.denial(&decision, grpc(), decided_by)),
    }
}

impl Next {
    /// The state of a request `pending` after this step.
    fn into_state<S, ReqBody>(self, mut p: Box<Pending<S, ReqBody>>) -> State<S, ReqBody>
    where
        S: Service<Request<ReqBody>> + Clone,
    {
        match self {
            Next::Call(decision, decided_by, permit) => {
                let p = *p;
                let unsettled =
                    unsettled(&p.shared, p.key, p.estimate, decision.as_ref(), decided_by);
                admit(
                    p.request, p.service, p.ready, &p.shared, decision, decided_by, permit,
                    unsettled,
                )
            }
            Next::Wait(wait) => {
                p.waited += wait;
                if p.ready {
                    // Give up what the inner service's readiness holds while
                    // sleeping: a fresh clone takes its place, made ready
                    // once admitted.
                    p.service = p.service.clone();
                    p.ready = false;
                }
                State::Delaying {
                    sleep: Box::pin(tokio::time::sleep(wait)),
                    pending: Some(p),
                }
            }
            Next::Answer(response) => State::Answered {
                response: Some(Box::new(response)),
            },
        }
    }
}

/// The state of an admitted request: its decision (if something limited
/// it) goes to the request's extensions and its fields are rendered; the
/// inner service is called at once when `ready`, else made ready first.
#[allow(clippy::too_many_arguments)]
fn admit<S, ReqBody>(
    mut request: Request<ReqBody>,
    mut service: S,
    ready: bool,
    shared: &Shared,
    decision: Option<Decision>,
    decided_by: DecidedBy,
    permit: Option<Box<Permit>>,
    unsettled: Settling,
) -> State<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    let shown = decision.map(|decision| {
        let mut fields = Fields::default();
        shared.set_headers(&mut fields, &decision, decided_by);
        request.extensions_mut().insert(decision);
        fields
    });
    if ready {
        State::Calling {
            future: service.call(request),
            shown,
            permit,
            unsettled,
        }
    } else {
        State::Readying {
            admitted: Some(Box::new(Admitted {
                service,
                request,
                shown,
                permit,
                unsettled,
            })),
        }
    }
}

impl<S, ReqBody> Pending<S, ReqBody> {
    /// The state of a delayed request whose sleep is over: its key is
    /// checked again, and an estimate counts from this check.
    fn check_again(mut self: Box<Self>) -> State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        let key = self.key.clone().unwrap_or_default();
        if let Some((_, at)) = &mut self.estimate {
            *at = Instant::now();
        }
        State::Checking {
            check: check(&self.shared, key, self.estimate.as_ref()),
            pending: Some(self),
        }
    }
}

impl<S, ReqBody> Admitted<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// The state of an admitted request once its service is ready: called.
    fn call(mut self) -> State<S, ReqBody> {
        let future = self.service.call(self.request);
        State::Calling {
            future,
            shown: self.shown,
            permit: self.permit,
            unsettled: self.unsettled,
        }
    }
}

/// The response of an admitted request: its rate-limit fields shown, its
/// cost settled now when the response gives it (else when its body ends),
/// and its lease held by the body.
#[inline]
fn finish<B>(
    mut response: Response<B>,
    shown: Shown,
    permit: Option<Box<Permit>>,
    unsettled: Settling,
) -> Response<ResponseBody<B>> {
    if let Some(fields) = shown {
        fields.apply(response.headers_mut());
    }
    let meters = match unsettled {
        Some(settling) => {
            let (settlement, unsettled) = *settling;
            settle_response([(settlement, unsettled)], &mut response)
        }
        // No vector unless there is something to hold.
        None => Vec::new(),
    };
    let leases = permit.map_or_else(Vec::new, |permit| vec![*permit]);
    response.map(|body| ResponseBody::metered(body, leases, meters))
}

/// The answer of a future polled again after a panic inside poll.
fn poisoned<B>() -> Response<ResponseBody<B>> {
    denial::store_unavailable().map(ResponseBody::full)
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking { check, pending } => {
                    let verdict = ready!(Pin::new(check).poll(cx));
                    let Some(p) = pending.take() else {
                        return Poll::Ready(Ok(poisoned()));
                    };
                    let step =
                        next_step(verdict, &p.shared, p.key.as_deref(), p.waited, &p.request);
                    this.state.set(step.into_state(p));
                }
                StateProj::Delaying { sleep, pending } => {
                    ready!(sleep.as_mut().poll(cx));
                    let Some(p) = pending.take() else {
                        return Poll::Ready(Ok(poisoned()));
                    };
                    this.state.set(p.check_again());
                }
                StateProj::Readying { admitted } => {
                    if let Some(a) = admitted.as_mut() {
                        ready!(a.service.poll_ready(cx))?;
                    }
                    let Some(a) = admitted.take() else {
                        return Poll::Ready(Ok(poisoned()));
                    };
                    this.state.set((*a).call());
                }
                StateProj::Calling {
                    future,
                    shown,
                    permit,
                    unsettled,
                } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(finish(
                        response,
                        shown.take(),
                        permit.take(),
                        unsettled.take(),
                    )));
                }
                StateProj::Answered { response } => {
                    let response = response
                        .take()
                        .map_or_else(denial::store_unavailable, |response| *response);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}
