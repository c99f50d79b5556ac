//! [`ResponseFuture`]: a request read, checked, passed on, and its answer
//! watched.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::header::{ACCEPT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::{RequestBody, ResponseBody, Watch};
use super::charge::{Bill, Ended, Unanswered};
use super::error::{decisions, error, refusal, unavailable};
use super::layer::Settings;
use super::request::{Asked, Endpoint, read};
use super::stream::Events;
use crate::http::{rule_key, tier_of};
use crate::key::KeyError;
use crate::rules::{ActiveRules, Call, NotPriced, RulesCheck, Unit};

pin_project! {
    /// The future of [`OpenAi`](super::OpenAi).
    pub struct ResponseFuture<S: Service<Request<RequestBody<ReqBody>>>, ReqBody> {
        #[pin]
        state: State<S, ReqBody>,
    }
}

/// A request read, waiting for its check's verdict.
struct Pending<S, B> {
    inner: S,
    request: Request<RequestBody<B>>,
    asked: Asked,
    active: Arc<ActiveRules>,
}

/// Set on the answer of an admitted request.
struct Admitted {
    bill: Bill,
    headers: HeaderMap,
    /// Whether the usage chunk of a stream is kept from the client.
    strip_usage: bool,
}

pin_project! {
    #[project = StateProj]
    enum State<S: Service<Request<RequestBody<ReqBody>>>, ReqBody> {
        Reading {
            #[pin]
            body: ReqBody,
            buf: BytesMut,
            read: Option<(Parts, S, Endpoint, Arc<Settings>)>,
        },
        Checking {
            #[pin]
            check: RulesCheck,
            pending: Option<Pending<S, ReqBody>>,
            shared: Arc<Settings>,
        },
        Calling {
            #[pin]
            future: S::Future,
            admitted: Option<Admitted>,
        },
        Passing {
            #[pin]
            future: S::Future,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S: Service<Request<RequestBody<ReqBody>>>, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResponseFuture")
    }
}

impl<S: Service<Request<RequestBody<ReqBody>>>, ReqBody> ResponseFuture<S, ReqBody> {
    pub(crate) fn passing(future: S::Future) -> Self {
        Self {
            state: State::Passing { future },
        }
    }

    pub(crate) fn reading(
        body: ReqBody,
        parts: Parts,
        inner: S,
        endpoint: Endpoint,
        buf: BytesMut,
        shared: Arc<Settings>,
    ) -> Self {
        Self {
            state: State::Reading {
                body,
                buf,
                read: Some((parts, inner, endpoint, shared)),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Reading {
                    mut body,
                    buf,
                    read,
                } => {
                    let next = match ready!(body.as_mut().poll_frame(cx)) {
                        Some(Ok(frame)) => {
                            let Ok(data) = frame.into_data() else {
                                continue;
                            };
                            let max = read.as_ref().map_or(0, |r| r.3.max_body);
                            if buf.len() + data.len() > max {
                                answered(error(
                                    StatusCode::PAYLOAD_TOO_LARGE,
                                    &format!("The request body is over {max} bytes."),
                                    "invalid_request_error",
                                    None,
                                ))
                            } else {
                                buf.extend_from_slice(&data);
                                continue;
                            }
                        }
                        Some(Err(_)) => answered(error(
                            StatusCode::BAD_REQUEST,
                            "The request body could not be read.",
                            "invalid_request_error",
                            None,
                        )),
                        None => match read.take() {
                            Some((parts, inner, endpoint, shared)) => {
                                check(parts, inner, endpoint, std::mem::take(buf).freeze(), shared)
                            }
                            None => answered(unavailable()),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Checking {
                    check,
                    pending,
                    shared,
                } => {
                    let admission = ready!(check.poll(cx));
                    let Some(Pending {
                        mut inner,
                        request,
                        asked,
                        active,
                    }) = pending.take()
                    else {
                        this.state.set(answered(unavailable()));
                        continue;
                    };
                    let admission = match admission {
                        Ok(admission) => admission,
                        Err(error) => {
                            tracing::warn!(%error, "ai: a check failed");
                            this.state.set(answered(unavailable()));
                            continue;
                        }
                    };
                    if !admission.allowed() {
                        this.state.set(answered(refusal(&admission, &active)));
                        continue;
                    }
                    let mut headers = HeaderMap::new();
                    super::headers::set(&mut headers, decisions(&admission, &active));
                    let (permits, charges) = admission.into_charges();
                    let strip_usage = asked.stream && !asked.wants_usage;
                    let bill = Bill::new(
                        charges,
                        permits,
                        active,
                        asked.model,
                        asked.estimate,
                        Arc::clone(&shared.notices),
                    );
                    let future = inner.call(request);
                    this.state.set(State::Calling {
                        future,
                        admitted: Some(Admitted {
                            bill,
                            headers,
                            strip_usage,
                        }),
                    });
                }
                StateProj::Calling { future, admitted } => {
                    let result = ready!(future.poll(cx));
                    let admitted = admitted.take();
                    this.state.set(answered(unavailable()));
                    let Some(Admitted {
                        bill,
                        headers,
                        strip_usage,
                    }) = admitted
                    else {
                        return Poll::Ready(result.map(|r| r.map(ResponseBody::untouched)));
                    };
                    let response = match result {
                        Ok(response) => response,
                        Err(error) => {
                            // No answer: what it cost cannot be known.
                            bill.settle(Ended::Unknown);
                            return Poll::Ready(Err(error));
                        }
                    };
                    let (mut parts, body) = response.into_parts();
                    for (name, value) in headers {
                        if let Some(name) = name {
                            parts.headers.insert(name, value);
                        }
                    }
                    if parts.extensions.get::<Unanswered>().is_some() {
                        // Not the upstream's answer (the proxy's own 502,
                        // 504): its estimate stands.
                        bill.settle(Ended::Unknown);
                        let body = ResponseBody::untouched(body);
                        return Poll::Ready(Ok(Response::from_parts(parts, body)));
                    }
                    let streamed = parts
                        .headers
                        .get(CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.split(';').next())
                        .is_some_and(|media| {
                            media.trim().eq_ignore_ascii_case("text/event-stream")
                        });
                    let mut bill = bill;
                    let watch = if !parts.status.is_success() {
                        bill.if_dropped = Ended::Refused;
                        Watch::Refused
                    } else if streamed {
                        // Events removed: the length is no longer known.
                        parts.headers.remove(CONTENT_LENGTH);
                        bill.if_dropped = Ended::Cut { output: 0 };
                        Watch::Stream(Events::new(strip_usage))
                    } else {
                        Watch::Json(Some(BytesMut::new()))
                    };
                    return Poll::Ready(Ok(Response::from_parts(
                        parts,
                        ResponseBody::watched(body, watch, bill),
                    )));
                }
                StateProj::Passing { future } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(response.map(ResponseBody::untouched)));
                }
                StateProj::Answered { response } => {
                    let response = response.take().unwrap_or_else(unavailable);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

fn answered<S: Service<Request<RequestBody<B>>>, B>(response: Response<Bytes>) -> State<S, B> {
    State::Answered {
        response: Some(response),
    }
}

/// Why a request is refused before it is checked.
enum Unchecked {
    Key(KeyError),
    NotPriced(NotPriced),
}

/// The read request checked by every matching rule at its estimate.
fn check<S, B>(
    mut parts: Parts,
    inner: S,
    endpoint: Endpoint,
    body: Bytes,
    shared: Arc<Settings>,
) -> State<S, B>
where
    S: Service<Request<RequestBody<B>>>,
{
    let (asked, rewritten) = match read(endpoint, &body, shared.default_output) {
        Ok(read) => read,
        Err(message) => {
            return answered(error(
                StatusCode::BAD_REQUEST,
                &message,
                "invalid_request_error",
                None,
            ));
        }
    };
    let body = match rewritten {
        Some(body) => {
            parts.headers.remove(TRANSFER_ENCODING);
            parts
                .headers
                .insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
            body
        }
        None => body,
    };
    // The answer is read for its usage: it must come uncompressed.
    parts
        .headers
        .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    let request = Request::from_parts(parts, RequestBody::read(body));
    let active = shared.rules.current();
    let tier = tier_of(&request, active.set().tier(), &shared.client_ip);
    let checked = active.check(
        request.method(),
        request.uri().path(),
        tier.as_deref(),
        |rule| {
            let key = rule_key(rule, &request, &shared.client_ip).map_err(Unchecked::Key)?;
            let cost = match rule.unit() {
                // At least a unit: an estimate of 0 would skip the rule,
                // and admit the request past a spent budget.
                Unit::Tokens => Some(asked.estimate.total().max(1)),
                Unit::Money => match active.set().catalog() {
                    Some(catalog) => Some(
                        catalog
                            .cost(&asked.model, &asked.estimate)
                            .map_err(Unchecked::NotPriced)?
                            .max(1),
                    ),
                    None => None,
                },
                _ => None,
            };
            let call = Call::new(key);
            Ok(Some(match cost {
                Some(cost) => call.with_cost(cost),
                None => call,
            }))
        },
    );
    match checked {
        Ok(check) => State::Checking {
            check,
            pending: Some(Pending {
                inner,
                request,
                asked,
                active,
            }),
            shared,
        },
        Err(Unchecked::NotPriced(not_priced)) => answered(error(
            StatusCode::NOT_FOUND,
            &format!("{not_priced}."),
            "invalid_request_error",
            Some("model_not_found"),
        )),
        Err(Unchecked::Key(failure)) => {
            tracing::error!(%failure, "ai: cannot pick a rule's key; answering 500");
            answered(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("The rate limiter cannot pick this request's key: {failure}"),
                "server_error",
                None,
            ))
        }
    }
}
