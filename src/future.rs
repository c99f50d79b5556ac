//! [`ResponseFuture`]: waits for the store's decision (and, when delaying,
//! for the key's turn), then for the inner service.

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

use crate::body::ResponseBody;
use crate::breaker::Ticket;
use crate::decision::{Decision, Lease};
use crate::layer::{Check, FailMode, Origin, Rejection, Settings};
use crate::metrics::Outcome;
use crate::policy::Policy;
use crate::response;
use crate::store::{DynStore, StoreError};

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

/// What a request waiting for a decision carries from state to state.
struct Pending<S, ReqBody> {
    request: Request<ReqBody>,
    service: S,
    /// Whether `service` is ready (holding whatever its readiness reserves,
    /// such as a concurrency-limit permit or a buffer slot). A request that
    /// is delayed gives that up while it sleeps, and drives a clone to
    /// readiness once it is admitted.
    ready: bool,
    settings: Arc<Settings>,
    /// The key in the store, to check again after a delay or release a lease
    /// (held by the check while it waits for the store).
    key: String,
    /// Time spent delayed so far.
    waited: Duration,
    /// When the current check was sent.
    sent: Instant,
    /// The breaker's ticket for the current check, if it let it through.
    ticket: Option<Ticket>,
    /// A gRPC call: denials are trailers-only gRPC statuses.
    grpc: bool,
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Checking {
            check: Check,
            pending: Option<Pending<S, ReqBody>>,
        },
        Delaying {
            sleep: Pin<Box<Sleep>>,
            pending: Option<Pending<S, ReqBody>>,
        },
        /// Admitted after a delay: waiting for the inner service to be ready.
        Readying {
            admitted: Option<Admitted<S, ReqBody>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<(Decision, Arc<Settings>, Origin)>,
            lease: Option<LeaseGuard>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

/// An admitted request waiting for its service to be ready.
struct Admitted<S, ReqBody> {
    service: S,
    request: Request<ReqBody>,
    decision: Option<(Decision, Arc<Settings>, Origin)>,
    lease: Option<LeaseGuard>,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn unlimited(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                decision: None,
                lease: None,
            },
        }
    }

    pub(crate) fn answered(response: Response<Bytes>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn checking(
        request: Request<ReqBody>,
        service: S,
        settings: Arc<Settings>,
        mut key: String,
        grpc: bool,
    ) -> Self {
        let (check, ticket) = settings.check(&mut key);
        Self {
            state: State::Checking {
                check,
                pending: Some(Pending {
                    request,
                    service,
                    ready: true,
                    settings,
                    key,
                    waited: Duration::ZERO,
                    sent: Instant::now(),
                    ticket,
                    grpc,
                }),
            },
        }
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

/// A key in logs: the first 12 hex digits of its SHA-1, the same in every
/// process, so events of one client can be followed without logging its
/// address or API key. Computed only when an event is written.
pub(crate) struct KeyHash<'a>(pub(crate) &'a str);

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let digest = sha1_smol::Sha1::from(self.0.as_bytes())
            .digest()
            .to_string();
        f.write_str(&digest[..12])
    }
}

/// What to do after a decision.
enum Next {
    Call(Option<Decision>, Origin),
    Wait(Duration),
    Answer(Response<Bytes>),
}

fn next_step(
    outcome: Result<Decision, StoreError>,
    settings: &Settings,
    key: &str,
    waited: Duration,
    sent: Instant,
    ticket: Option<Ticket>,
    grpc: bool,
) -> Next {
    // Only the store's own denials may be cached: a fallback's would
    // outlive the outage and refuse requests the store admits.
    let from_store = outcome.is_ok();
    let origin = if from_store {
        Origin::Store
    } else {
        Origin::Fallback
    };
    if !matches!(outcome, Err(StoreError::CircuitOpen)) {
        crate::metrics::store_latency(&settings.name, sent);
    }
    if outcome.is_err() {
        crate::metrics::decision(&settings.name, Outcome::StoreError);
    }
    let decision = match outcome {
        Ok(decision) => {
            settings.store_answered(ticket, true);
            decision
        }
        Err(error) => {
            // While the circuit is open nothing was asked: no news for the
            // breaker, and no warning per request.
            let circuit_open = matches!(error, StoreError::CircuitOpen);
            if !circuit_open {
                settings.store_answered(ticket, false);
            }
            match &settings.fail_mode {
                FailMode::Open => {
                    if circuit_open {
                        tracing::debug!(
                            "rate limit: circuit open; admitting the request (FailMode::Open)"
                        );
                    } else {
                        tracing::warn!(%error, "rate limit store failed; admitting the request (FailMode::Open)");
                    }
                    return Next::Call(None, Origin::Store);
                }
                FailMode::Fallback { .. } => {
                    if circuit_open {
                        tracing::debug!(
                            "rate limit: circuit open; limiting in process (FailMode::Fallback)"
                        );
                    } else {
                        tracing::warn!(%error, "rate limit store failed; limiting in process (FailMode::Fallback)");
                    }
                    match settings.fallback_decision(key) {
                        Some(decision) => decision,
                        None => return Next::Call(None, Origin::Store),
                    }
                }
                _ => {
                    if circuit_open {
                        tracing::debug!(
                            "rate limit: circuit open; answering 503 (FailMode::Closed)"
                        );
                    } else {
                        tracing::warn!(%error, "rate limit store failed; answering 503 (FailMode::Closed)");
                    }
                    return Next::Answer(if grpc {
                        response::grpc(
                            response::grpc_status::UNAVAILABLE,
                            "rate limiter unavailable: its store does not answer",
                        )
                    } else {
                        response::store_unavailable()
                    });
                }
            }
        }
    };
    if !from_store {
        // Counted as a store error above; the fallback's decision is not
        // counted again.
    } else if decision.allowed() {
        crate::metrics::decision(&settings.name, Outcome::Allowed);
    } else {
        crate::metrics::decision(&settings.name, Outcome::Limited);
    }
    if decision.allowed() {
        tracing::debug!(key = %KeyHash(key), remaining = decision.remaining(), "rate limit: admitted");
        return Next::Call(Some(decision), origin);
    }
    let retry_after_ms = decision.retry_after().as_millis() as u64;
    match &settings.rejection {
        Rejection::Shadow => {
            tracing::info!(key = %KeyHash(key), retry_after_ms, policy = %settings.policy, "rate limit (shadow): would deny; letting through");
            Next::Call(Some(decision), origin)
        }
        Rejection::Delay { max_wait } if waited + decision.retry_after() <= *max_wait => {
            tracing::debug!(key = %KeyHash(key), retry_after_ms, "rate limit: delaying");
            // At least 1 ms: a store that answers a zero wait must not make
            // the request check again in a tight loop.
            Next::Wait(decision.retry_after().max(Duration::from_millis(1)))
        }
        _ => {
            tracing::debug!(key = %KeyHash(key), retry_after_ms, "rate limit: denied");
            if from_store {
                settings.remember_denial(key, &decision, sent);
            }
            Next::Answer(settings.denial(&decision, grpc, origin))
        }
    }
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
                    let (key, outcome) = match check {
                        Check::Done(outcome) => (None, outcome.take()),
                        Check::Waiting(future) => {
                            let (key, outcome) = ready!(future.as_mut().poll(cx));
                            (Some(key), Some(outcome))
                        }
                    };
                    let (Some(mut p), Some(outcome)) = (pending.take(), outcome) else {
                        // Only reachable if polled again after a panic inside poll.
                        return Poll::Ready(Ok(
                            response::store_unavailable().map(ResponseBody::full)
                        ));
                    };
                    if let Some(key) = key {
                        p.key = key;
                    }
                    let step = next_step(
                        outcome,
                        &p.settings,
                        &p.key,
                        p.waited,
                        p.sent,
                        p.ticket,
                        p.grpc,
                    );
                    match step {
                        Next::Call(decision, origin) => {
                            // A concurrency slot, held until the response is done.
                            let lease = decision
                                .as_ref()
                                .filter(|d| d.allowed())
                                .and_then(Decision::lease)
                                .map(|lease| LeaseGuard::new(&p.settings, &p.key, lease, origin));
                            if let Some(decision) = &decision {
                                p.request.extensions_mut().insert(decision.clone());
                            }
                            let decision = decision.map(|d| (d, p.settings, origin));
                            if p.ready {
                                let future = p.service.call(p.request);
                                this.state.set(State::Calling {
                                    future,
                                    decision,
                                    lease,
                                });
                            } else {
                                this.state.set(State::Readying {
                                    admitted: Some(Admitted {
                                        service: p.service,
                                        request: p.request,
                                        decision,
                                        lease,
                                    }),
                                });
                            }
                        }
                        Next::Wait(wait) => {
                            p.waited += wait;
                            if p.ready {
                                // Give up what the inner service's readiness
                                // holds while sleeping: a fresh clone takes
                                // its place, made ready once admitted.
                                p.service = p.service.clone();
                                p.ready = false;
                            }
                            this.state.set(State::Delaying {
                                sleep: Box::pin(tokio::time::sleep(wait)),
                                pending: Some(p),
                            });
                        }
                        Next::Answer(response) => {
                            this.state.set(State::Answered {
                                response: Some(response),
                            });
                        }
                    }
                }
                StateProj::Delaying { sleep, pending } => {
                    ready!(sleep.as_mut().poll(cx));
                    let Some(mut p) = pending.take() else {
                        return Poll::Ready(Ok(
                            response::store_unavailable().map(ResponseBody::full)
                        ));
                    };
                    p.sent = Instant::now();
                    let (check, ticket) = p.settings.check(&mut p.key);
                    p.ticket = ticket;
                    this.state.set(State::Checking {
                        check,
                        pending: Some(p),
                    });
                }
                StateProj::Readying { admitted } => {
                    if let Some(a) = admitted.as_mut() {
                        ready!(a.service.poll_ready(cx))?;
                    }
                    let Some(mut a) = admitted.take() else {
                        // Only reachable if polled again after a panic inside poll.
                        return Poll::Ready(Ok(
                            response::store_unavailable().map(ResponseBody::full)
                        ));
                    };
                    let future = a.service.call(a.request);
                    this.state.set(State::Calling {
                        future,
                        decision: a.decision,
                        lease: a.lease,
                    });
                }
                StateProj::Calling {
                    future,
                    decision,
                    lease,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some((decision, settings, origin)) = decision {
                        settings.set_headers(response.headers_mut(), decision, *origin);
                    }
                    let lease = lease.take();
                    return Poll::Ready(Ok(response.map(|body| ResponseBody::inner(body, lease))));
                }
                StateProj::Answered { response } => {
                    let response = response.take().unwrap_or_else(response::store_unavailable);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

/// A concurrency slot held by a request: given back when dropped (the
/// response body finished or dropped, the handler failed or panicked, the
/// client went away).
pub(crate) struct LeaseGuard {
    /// The store that granted the lease (the fallback's, during an outage).
    store: Arc<dyn DynStore>,
    policy: Arc<Policy>,
    key: String,
    lease: Lease,
}

impl LeaseGuard {
    fn new(settings: &Settings, key: &str, lease: Lease, origin: Origin) -> Self {
        let (store, policy) = match origin {
            Origin::Store => (Arc::clone(&settings.store), Arc::clone(&settings.policy)),
            Origin::Fallback => settings
                .fallback_release_target()
                .unwrap_or_else(|| (Arc::clone(&settings.store), Arc::clone(&settings.policy))),
        };
        Self {
            store,
            policy,
            key: key.to_owned(),
            lease,
        }
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        // Outside a runtime nothing can run the release (and polling a
        // Redis release there would panic): the lease expires on its own.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "no tokio runtime to release a concurrency lease; it frees itself when it expires"
            );
            return;
        };
        let mut release = Arc::clone(&self.store).release_owned(
            std::mem::take(&mut self.key),
            Arc::clone(&self.policy),
            self.lease,
        );
        // Poll once here: an in-process store releases at once, so the slot
        // is free before the next request is checked. A store that must wait
        // (Redis) goes on in a task.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match release.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(error)) => {
                tracing::warn!(%error, "could not release a concurrency lease; it frees itself when it expires");
            }
            Poll::Pending => {
                runtime.spawn(async move {
                    if let Err(error) = release.await {
                        tracing::warn!(%error, "could not release a concurrency lease; it frees itself when it expires");
                    }
                });
            }
        }
    }
}
