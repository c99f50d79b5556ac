//! `ai::OpenAiLayer` in process, in front of services that answer as no
//! well-behaved upstream does: trailers after the usage, no answer at all,
//! an answer dropped halfway, an error, a proxy's own timeout. Each is
//! charged what the guide's table says, exactly once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tower::{Layer, ServiceExt, service_fn};
use tower_redis_ratelimit::MemoryStore;
use tower_redis_ratelimit::ai::{OpenAiLayer, Unanswered};
use tower_redis_ratelimit::rules::{RuleSet, Rules};

/// A month of a million tokens, for everyone.
fn rules() -> Rules {
    Rules::new(
        MemoryStore::new(),
        RuleSet::from_toml(
            "[[rules]]\nname = \"tokens\"\nkey = \"global\"\npolicy = \"1000000 tokens/month\"\n\
             algorithm = \"fixed-window\"\n",
        )
        .unwrap(),
    )
}

/// The tokens spent so far (a peek answers as a request of one would).
async fn spent(rules: &Rules) -> u64 {
    let limiter = rules.current().limiter("tokens", None).cloned().unwrap();
    1_000_000 - (limiter.peek("global").await.unwrap().remaining() + 1)
}

/// Wait until `spent` is `expected`, or fail after 2 s.
async fn settles_to(rules: &Rules, expected: u64) {
    for _ in 0..100 {
        if spent(rules).await == expected {
            // And stays so: settled once.
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(spent(rules).await, expected, "settled twice");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("spent {} tokens, not {expected}", spent(rules).await);
}

/// A chat request estimated at 7 prompt tokens and 4 of output.
fn chat(path: &str) -> Request<Body> {
    Request::post(path)
        .header("accept-encoding", "gzip, br")
        .body(Body::from(
            r#"{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"say three words"}]}"#,
        ))
        .unwrap()
}

const ANSWER: &str = r#"{"object":"chat.completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;

type Frames = Vec<Result<Frame<Bytes>, Infallible>>;

fn answer(frames: Frames) -> Response<Body> {
    let mut response = Response::new(Body::new(StreamBody::new(stream::iter(frames))));
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

#[tokio::test]
async fn an_answer_with_trailers_is_settled_from_its_usage() {
    let rules = rules();
    let app = OpenAiLayer::new(rules.clone()).layer(service_fn(|_: Request<_>| async {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-done", "yes".parse().unwrap());
        Ok::<_, Infallible>(answer(vec![
            Ok(Frame::data(Bytes::from_static(ANSWER.as_bytes()))),
            Ok(Frame::trailers(trailers)),
        ]))
    }));
    let response = app.oneshot(chat("/v1/chat/completions")).await.unwrap();
    // Read as hyper reads it: nothing is asked for after the trailers.
    let mut body = response.into_body();
    let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(data, ANSWER.as_bytes());
    let trailers = body
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_trailers()
        .unwrap();
    assert_eq!(trailers["x-done"], "yes");
    drop(body);
    settles_to(&rules, 5).await;
}

#[tokio::test]
async fn a_request_dropped_before_its_answer_is_charged_its_estimate() {
    let rules = rules();
    let app = OpenAiLayer::new(rules.clone()).layer(service_fn(|_: Request<_>| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(answer(Vec::new()))
    }));
    let called = tokio::time::timeout(
        Duration::from_millis(100),
        app.oneshot(chat("/v1/chat/completions")),
    );
    assert!(called.await.is_err(), "never answered");
    settles_to(&rules, 11).await;
}

#[tokio::test]
async fn an_answer_dropped_halfway_is_charged_its_estimate() {
    let rules = rules();
    let app = OpenAiLayer::new(rules.clone()).layer(service_fn(|_: Request<_>| async {
        let half = stream::iter([Ok::<_, Infallible>(Frame::data(Bytes::from_static(
            &ANSWER.as_bytes()[..20],
        )))]);
        let body = StreamBody::new(half.chain(stream::pending()));
        Ok::<_, Infallible>(Response::new(Body::new(body)))
    }));
    let response = app.oneshot(chat("/v1/chat/completions")).await.unwrap();
    let mut body = response.into_body();
    assert!(body.frame().await.unwrap().unwrap().is_data());
    drop(body);
    settles_to(&rules, 11).await;
}

#[tokio::test]
async fn an_upstream_error_costs_nothing_and_a_proxys_own_timeout_its_estimate() {
    let rules = rules();
    let error = OpenAiLayer::new(rules.clone()).layer(service_fn(|_: Request<_>| async {
        let mut response = answer(vec![Ok(Frame::data(Bytes::from_static(b"{\"error\":{}}")))]);
        *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        Ok::<_, Infallible>(response)
    }));
    let response = error.oneshot(chat("/v1/chat/completions")).await.unwrap();
    response.into_body().collect().await.unwrap();
    settles_to(&rules, 0).await;
    let timed_out = OpenAiLayer::new(rules.clone()).layer(service_fn(|_: Request<_>| async {
        let mut response = answer(Vec::new());
        *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
        response.extensions_mut().insert(Unanswered);
        Ok::<_, Infallible>(response)
    }));
    let response = timed_out
        .oneshot(chat("/v1/chat/completions"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    settles_to(&rules, 11).await;
}

#[tokio::test]
async fn the_upstream_is_asked_for_an_uncompressed_answer_on_every_endpoint_path() {
    let rules = rules();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&seen);
    let app = OpenAiLayer::new(rules.clone()).layer(service_fn(move |request: Request<_>| {
        let kept = Arc::clone(&kept);
        async move {
            kept.lock()
                .unwrap()
                .push(request.headers()["accept-encoding"].clone());
            Ok::<_, Infallible>(answer(vec![Ok(Frame::data(Bytes::from_static(
                ANSWER.as_bytes(),
            )))]))
        }
    }));
    // A trailing `/` is the same endpoint: read, and counted.
    let response = app.oneshot(chat("/v1/chat/completions/")).await.unwrap();
    response.into_body().collect().await.unwrap();
    settles_to(&rules, 5).await;
    assert_eq!(seen.lock().unwrap()[0], "identity");
}
