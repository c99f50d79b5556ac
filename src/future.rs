//! [`ResponseFuture`]: waits for the store's decision, then for the inner
//! service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::decision::Decision;
use crate::layer::{FailMode, Settings};
use crate::response;
use crate::store::{BoxFuture, StoreError};

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

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Checking {
            check: BoxFuture<Result<Decision, StoreError>>,
            request: Option<Request<ReqBody>>,
            service: Option<S>,
            settings: Arc<Settings>,
        },
        Calling {
            #[pin]
            future: S::Future,
            decision: Option<Decision>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
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
        check: BoxFuture<Result<Decision, StoreError>>,
        request: Request<ReqBody>,
        service: S,
        settings: Arc<Settings>,
    ) -> Self {
        Self {
            state: State::Checking {
                check,
                request: Some(request),
                service: Some(service),
                settings,
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
            State::Calling { .. } => "calling",
            State::Answered { .. } => "answered",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Checking {
                    check,
                    request,
                    service,
                    settings,
                } => {
                    let outcome = ready!(check.as_mut().poll(cx));
                    let (Some(mut request), Some(mut service)) = (request.take(), service.take())
                    else {
                        // Only reachable if polled again after a panic inside poll.
                        return Poll::Ready(Ok(
                            response::store_unavailable().map(ResponseBody::full)
                        ));
                    };
                    let decision = match outcome {
                        Ok(decision) if decision.allowed() => {
                            tracing::debug!(
                                remaining = decision.remaining(),
                                "rate limit: admitted"
                            );
                            request.extensions_mut().insert(decision.clone());
                            Some(decision)
                        }
                        Ok(decision) => {
                            tracing::debug!(
                                retry_after_ms = decision.retry_after().as_millis() as u64,
                                "rate limit: denied"
                            );
                            let denial = response::too_many_requests(&decision);
                            this.state.set(State::Answered {
                                response: Some(denial),
                            });
                            continue;
                        }
                        Err(error) => match settings.fail_mode {
                            FailMode::Open => {
                                tracing::warn!(%error, "rate limit store failed; admitting the request (FailMode::Open)");
                                None
                            }
                            FailMode::Closed => {
                                tracing::warn!(%error, "rate limit store failed; answering 503 (FailMode::Closed)");
                                this.state.set(State::Answered {
                                    response: Some(response::store_unavailable()),
                                });
                                continue;
                            }
                        },
                    };
                    let future = service.call(request);
                    this.state.set(State::Calling { future, decision });
                }
                StateProj::Calling { future, decision } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(decision) = decision {
                        response::set_headers(response.headers_mut(), decision);
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Answered { response } => {
                    let response = response.take().unwrap_or_else(response::store_unavailable);
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}
