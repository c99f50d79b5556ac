//! Requests, routers and responses for the tests of the layer on axum (and
//! a raw HTTP/1.1 GET over a real socket).

use std::net::{IpAddr, SocketAddr};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{Service, ServiceExt};
use tower_redis_ratelimit::RateLimitLayer;
use tower_redis_ratelimit::key::KeyExtractor;

/// The client most tests send from.
pub const PEER: &str = "203.0.113.9";

/// `peer` as axum's `ConnectInfo` reports a connection: a socket address
/// (`"10.0.0.1:5000"`, `"[2001:db8::1]:1"`) or a bare IP (port 40000).
pub fn peer_addr(peer: &str) -> SocketAddr {
    peer.parse().unwrap_or_else(|_| {
        let ip: IpAddr = peer
            .parse()
            .unwrap_or_else(|_| panic!("{peer:?} is neither a socket address nor an IP"));
        SocketAddr::new(ip, 40000)
    })
}

/// A GET of `path` from `peer` (see [`peer_addr`]).
pub fn request(path: &str, peer: &str) -> Request<Body> {
    request_with(path, peer, &[])
}

/// A GET of `path` from `peer` (see [`peer_addr`]) with `headers`.
pub fn request_with(path: &str, peer: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = Request::get(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut req = builder.body(Body::empty()).unwrap();
    req.extensions_mut().insert(ConnectInfo(peer_addr(peer)));
    req
}

/// A router whose `/` answers "ok", behind `limiter`.
pub fn ok_router<K: KeyExtractor<Body>>(limiter: RateLimitLayer<K>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limiter)
}

/// The status `service` (a router, or a layered service) answers `req` with.
pub async fn status<S, B>(service: &S, req: Request<Body>) -> StatusCode
where
    S: Service<Request<Body>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    service.clone().oneshot(req).await.unwrap().status()
}

/// Send `req` to `app`: the response's head, and its body as text.
pub async fn send(app: &Router, req: Request<Body>) -> (Response<()>, String) {
    let response = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        Response::from_parts(parts, ()),
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

/// Send a GET of `/` from [`PEER`] to `app` (see [`send`]).
pub async fn get_root(app: &Router) -> (Response<()>, String) {
    send(app, request("/", PEER)).await
}

/// The value of header `name`, as text.
pub fn header<'a>(response: &'a Response<()>, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

/// A GET of `path` over a real socket to `addr` (HTTP/1.1, `Connection:
/// close`): the whole raw response.
pub async fn raw_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}
