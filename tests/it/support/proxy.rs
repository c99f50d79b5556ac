//! A fault-injecting TCP proxy between a Redis client and a real
//! `redis-server`, and a Redis Cluster whose nodes sit behind such proxies.
//!
//! [`FaultProxy::start`] listens on a free loopback port and forwards bytes
//! both ways to a `redis-server` on `upstream_port`: one upstream connection
//! per client connection, opened when the client connects. Nothing of Redis
//! is mocked: every command reaches the real server, and every fault is one
//! a production network can produce.
//!
//! The proxy reads the RESP frames going through it (requests and replies),
//! so a fault can target *the reply to a given command* (an `EVALSHA`, the
//! `EXEC` of a transaction, any command naming a given key), although the
//! store also sends `TIME`, `PING`, `SCRIPT LOAD`, `CLIENT SETINFO` and
//! `CLUSTER SLOTS` on the same connections. Replies are paired with requests
//! in order, one reply per request (RESP3 push frames excepted), as Redis
//! answers them; bytes it cannot parse are forwarded untouched, and that
//! connection is no longer targeted.
//!
//! The faults, all controllable from the test through a thread-safe handle
//! (`&self` methods, usable from any thread and from async tests; none of
//! them blocks for more than a few milliseconds):
//!
//! - **Lost reply** ([`drop_next_reply`](FaultProxy::drop_next_reply)):
//!   the request reaches Redis, which runs it; its reply is discarded, then
//!   the client connection is closed ([`AfterDrop::Close`]: the client sees
//!   a dropped connection) or left open with every later reply on it
//!   discarded too ([`AfterDrop::Hang`]: the client sees a timeout, as on a
//!   half-open TCP connection; [`AfterDrop::HangFor`] closes it after a
//!   while, as TCP keepalive or a retransmission timeout would).
//! - **Cut mid-reply** ([`cut_next_reply`](FaultProxy::cut_next_reply)):
//!   the first half of the reply is delivered, then the connection closes.
//! - **Stall** ([`stall`](FaultProxy::stall) for every connection and a
//!   duration; [`stall_next_request`](FaultProxy::stall_next_request) and
//!   [`stall_next_reply`](FaultProxy::stall_next_reply) from one targeted
//!   frame on): bytes in one direction are held, then delivered in order.
//!   Towards Redis, the request reaches Redis late (and runs late); towards
//!   the client, Redis ran it on time but the client hears late.
//! - **Refused connections** ([`refuse`](FaultProxy::refuse)): the listening
//!   socket is closed, so `connect()` fails with `ECONNREFUSED`, and every
//!   open connection is cut; [`accept`](FaultProxy::accept) listens on the
//!   same port again. [`cut_all`](FaultProxy::cut_all) cuts the open
//!   connections only.
//!
//! The `*_next_*` faults are one-shot: each fires once, on the first frame
//! (on any connection) that its [`Match`] selects, in the order they were
//! armed. [`armed`](FaultProxy::armed) says how many have not fired yet, so
//! a test can assert that its fault really happened. [`stats`](FaultProxy::stats)
//! counts connections, bytes and faults; [`commands`](FaultProxy::commands)
//! counts the requests of one command that went through.
//!
//! ```ignore
//! let server = RedisServer::start();
//! let proxy = FaultProxy::start(server.port());
//! let store = RedisStore::connect(&proxy.url()).await?;
//! // Redis runs the next EVALSHA naming the key, the client never hears.
//! proxy.drop_next_reply(Match::command("EVALSHA").arg("rl:log:{k}"), AfterDrop::Close);
//! let outcome = store.check("k", &policy).await;
//! assert_eq!(proxy.armed(), 0, "the fault fired");
//! ```
//!
//! Each proxy runs on a runtime of its own (one thread), so it keeps
//! forwarding whatever the test's runtime does, and a test can build one
//! outside any runtime (the cluster below is started before the test's
//! stores). Dropping the proxy closes its port and every connection.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::AbortHandle;

use super::RedisServer;

/// Which way bytes flow through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Requests: client → Redis.
    ToRedis,
    /// Replies: Redis → client.
    ToClient,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Self::ToRedis => 0,
            Self::ToClient => 1,
        }
    }
}

/// What happens to a connection after one of its replies was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterDrop {
    /// Close the client connection (and the upstream one): the client sees a
    /// dropped connection, with its request run by Redis or not.
    Close,
    /// Keep the connection open and discard every later reply on it (the
    /// requests still reach Redis): the client sees a timeout, and so does
    /// everything else it sends on that connection, until it or the test
    /// ([`FaultProxy::cut_all`]) closes it.
    Hang,
    /// As [`Hang`](Self::Hang), then close the connection after this long.
    HangFor(Duration),
}

/// Which frames a targeted fault fires on: a command name, an argument
/// containing a needle, an argument equal to a value, or several of them
/// (every condition given must hold).
///
/// A reply is matched by the request it answers. The reply to `EXEC` is
/// matched by `EXEC` and by the arguments of every command queued in its
/// transaction, so `Match::command("EXEC").arg(key)` selects the result of a
/// `MULTI`/`EXEC` pipeline on `key`.
#[derive(Debug, Clone, Default)]
pub struct Match {
    command: Option<String>,
    arg: Option<Vec<u8>>,
    arg_is: Option<Vec<u8>>,
}

impl Match {
    /// Any frame.
    pub fn any() -> Self {
        Self::default()
    }

    /// Frames of (replies to) the command `name`, in any case.
    pub fn command(name: &str) -> Self {
        Self {
            command: Some(name.to_ascii_uppercase()),
            ..Self::default()
        }
    }

    /// Only frames with an argument containing `needle` (a Redis key, say).
    pub fn arg(mut self, needle: impl AsRef<[u8]>) -> Self {
        self.arg = Some(needle.as_ref().to_vec());
        self
    }

    /// Only frames with an argument equal to `value` (an operator command's
    /// name, say, which other arguments such as a block's key may contain).
    pub fn arg_is(mut self, value: impl AsRef<[u8]>) -> Self {
        self.arg_is = Some(value.as_ref().to_vec());
        self
    }

    fn matches(&self, request: &Request) -> bool {
        if let Some(name) = &self.command
            && *name != request.name
        {
            return false;
        }
        let mut args = request
            .args
            .iter()
            .chain(request.queued.iter().flat_map(|q| q.args.iter()));
        let contained = match &self.arg {
            None => true,
            Some(needle) => args.clone().any(|arg| contains(arg, needle)),
        };
        contained
            && match &self.arg_is {
                None => true,
                Some(value) => args.any(|arg| arg == value),
            }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// What the proxy has seen and done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Client connections accepted.
    pub accepted: u64,
    /// Client connections open now.
    pub open: u64,
    /// Bytes forwarded to Redis.
    pub bytes_to_redis: u64,
    /// Bytes forwarded to clients.
    pub bytes_to_client: u64,
    /// Replies dropped ([`FaultProxy::drop_next_reply`]), not counting the
    /// replies discarded afterwards on a hung connection.
    pub replies_dropped: u64,
    /// Replies cut mid-way ([`FaultProxy::cut_next_reply`]).
    pub replies_cut: u64,
    /// Targeted stalls that fired, and timed stalls started.
    pub stalls: u64,
    /// Connections cut by [`FaultProxy::cut_all`] or [`FaultProxy::refuse`].
    pub connections_cut: u64,
    /// Times the listening socket was closed by [`FaultProxy::refuse`].
    pub refusals: u64,
}

impl Stats {
    /// Every fault that fired: replies dropped or cut, stalls, connections
    /// cut, refusals.
    pub fn faults(&self) -> u64 {
        self.replies_dropped + self.replies_cut + self.stalls + self.connections_cut + self.refusals
    }
}

/// A fault waiting for the frame it targets.
#[derive(Debug, Clone)]
enum Fault {
    DropReply(AfterDrop),
    CutReply,
    Stall(Direction, Duration),
}

impl Fault {
    fn direction(&self) -> Direction {
        match self {
            Self::DropReply(_) | Self::CutReply => Direction::ToClient,
            Self::Stall(direction, _) => *direction,
        }
    }
}

#[derive(Debug)]
struct Armed {
    target: Match,
    fault: Fault,
}

/// One request as the proxy parsed it: its command name (upper case), its
/// arguments, and for `EXEC` the commands of its transaction.
#[derive(Debug, Clone, Default)]
struct Request {
    name: String,
    args: Vec<Vec<u8>>,
    queued: Vec<Request>,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    open: AtomicU64,
    bytes_to_redis: AtomicU64,
    bytes_to_client: AtomicU64,
    replies_dropped: AtomicU64,
    replies_cut: AtomicU64,
    stalls: AtomicU64,
    connections_cut: AtomicU64,
    refusals: AtomicU64,
}

/// State shared by the handle and the proxy's tasks.
#[derive(Debug)]
struct Shared {
    upstream_port: u16,
    counters: Counters,
    armed: Mutex<Vec<Armed>>,
    /// Per direction: hold bytes until then.
    stalled_until: Mutex<[Option<Instant>; 2]>,
    connections: Mutex<HashMap<u64, AbortHandle>>,
    commands: Mutex<HashMap<String, u64>>,
    next_id: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// The first armed fault for `direction` that `request` matches, taken
    /// out (it fires once).
    fn take_fault(&self, direction: Direction, request: Option<&Request>) -> Option<Fault> {
        let request = request?;
        let mut armed = lock(&self.armed);
        let i = armed
            .iter()
            .position(|a| a.fault.direction() == direction && a.target.matches(request))?;
        Some(armed.remove(i).fault)
    }

    fn stalled_until(&self, direction: Direction) -> Option<Instant> {
        lock(&self.stalled_until)[direction.index()].filter(|&t| t > Instant::now())
    }

    /// Wait while a timed stall holds `direction`.
    async fn wait_while_stalled(&self, direction: Direction) {
        while let Some(until) = self.stalled_until(direction) {
            tokio::time::sleep_until(until.into()).await;
        }
    }
}

/// A fault-injecting TCP proxy to a `redis-server` (see the module
/// documentation). Dropping it closes its port and every connection.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    runtime: tokio::runtime::Handle,
    listener: Mutex<Option<Listening>>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The accept loop, and word from it once its socket is closed.
#[derive(Debug)]
struct Listening {
    task: AbortHandle,
    closed: std::sync::mpsc::Receiver<()>,
}

/// Owns the listening socket; says so when it has closed it.
struct ListenerGuard {
    listener: Option<TcpListener>,
    closed: std::sync::mpsc::Sender<()>,
}

impl Drop for ListenerGuard {
    fn drop(&mut self) {
        drop(self.listener.take());
        let _ = self.closed.send(());
    }
}

/// Counts an open connection and forgets its abort handle when it ends.
struct ConnectionGuard {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        lock(&self.shared.connections).remove(&self.id);
        self.shared.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl FaultProxy {
    /// Listen on a free loopback port and forward every connection to the
    /// `redis-server` on `127.0.0.1:upstream_port` (which need not be up
    /// yet: each client connection opens its upstream connection when it
    /// is accepted, and is closed at once if that fails).
    pub fn start(upstream_port: u16) -> Self {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("fault-proxy-{upstream_port}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("building the fault proxy's runtime");
                handle_tx.send(runtime.handle().clone()).unwrap();
                runtime.block_on(async {
                    let _ = stop.await;
                });
                // Dropping the runtime drops every task: sockets close.
            })
            .expect("spawning the fault proxy's thread");
        let runtime = handle_rx.recv().expect("the fault proxy's runtime");
        let shared = Arc::new(Shared {
            upstream_port,
            counters: Counters::default(),
            armed: Mutex::new(Vec::new()),
            stalled_until: Mutex::new([None, None]),
            connections: Mutex::new(HashMap::new()),
            commands: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        });
        let listener = {
            let _entered = runtime.enter();
            let std_listener =
                std::net::TcpListener::bind("127.0.0.1:0").expect("binding the fault proxy's port");
            std_listener.set_nonblocking(true).unwrap();
            TcpListener::from_std(std_listener).unwrap()
        };
        let port = listener.local_addr().unwrap().port();
        let proxy = Self {
            port,
            shared,
            runtime,
            listener: Mutex::new(None),
            shutdown: Some(shutdown),
            thread: Some(thread),
        };
        proxy.listen(listener);
        proxy
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port of the `redis-server` behind the proxy.
    pub fn upstream_port(&self) -> u16 {
        self.shared.upstream_port
    }

    /// Let the request of the next reply that `target` matches reach Redis,
    /// drop that reply, then do `after` with its connection. One-shot.
    pub fn drop_next_reply(&self, target: Match, after: AfterDrop) {
        self.arm(target, Fault::DropReply(after));
    }

    /// Deliver the first half of the next reply that `target` matches (at
    /// least one byte, never all of it), then close its connection. One-shot.
    pub fn cut_next_reply(&self, target: Match) {
        self.arm(target, Fault::CutReply);
    }

    /// Hold the next request that `target` matches, and everything sent
    /// after it on its connection, for `duration`, then deliver them in
    /// order: Redis runs it late. One-shot.
    pub fn stall_next_request(&self, target: Match, duration: Duration) {
        self.arm(target, Fault::Stall(Direction::ToRedis, duration));
    }

    /// Hold the next reply that `target` matches, and everything after it
    /// on its connection, for `duration`, then deliver them in order: Redis
    /// ran the request on time, the client hears late. One-shot.
    pub fn stall_next_reply(&self, target: Match, duration: Duration) {
        self.arm(target, Fault::Stall(Direction::ToClient, duration));
    }

    /// Hold every byte flowing in `direction`, on every connection (open or
    /// opened meanwhile), for `duration` from now, then deliver them in
    /// order. Overlapping stalls extend each other.
    pub fn stall(&self, direction: Direction, duration: Duration) {
        let until = Instant::now() + duration;
        let mut stalled = lock(&self.shared.stalled_until);
        let slot = &mut stalled[direction.index()];
        *slot = Some(slot.map_or(until, |t| t.max(until)));
        self.shared.counters.stalls.fetch_add(1, Ordering::Relaxed);
    }

    /// [`stall`](Self::stall) both directions: the link freezes.
    pub fn freeze(&self, duration: Duration) {
        self.stall(Direction::ToRedis, duration);
        self.stall(Direction::ToClient, duration);
    }

    /// Forget every armed fault that has not fired, and end the timed stalls
    /// (held bytes are delivered at once).
    pub fn heal(&self) {
        lock(&self.shared.armed).clear();
        *lock(&self.shared.stalled_until) = [None, None];
    }

    /// How many one-shot faults have not fired yet.
    pub fn armed(&self) -> usize {
        lock(&self.shared.armed).len()
    }

    /// Close the listening socket, so new connections are refused
    /// (`ECONNREFUSED`), and cut every open connection. Returns once the
    /// port is closed and the connections are gone. Does nothing if already
    /// refusing.
    pub fn refuse(&self) {
        let listening = lock(&self.listener).take();
        if let Some(listening) = listening {
            listening.task.abort();
            listening
                .closed
                .recv_timeout(Duration::from_secs(5))
                .expect("the fault proxy's listener did not close");
            self.shared
                .counters
                .refusals
                .fetch_add(1, Ordering::Relaxed);
        }
        self.cut_all();
    }

    /// Listen on the same port again after [`refuse`](Self::refuse). Does
    /// nothing if already listening.
    pub fn accept(&self) {
        if lock(&self.listener).is_some() {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            let bound = {
                let _entered = self.runtime.enter();
                TcpSocket::new_v4().and_then(|socket| {
                    socket.set_reuseaddr(true)?;
                    socket.bind(([127, 0, 0, 1], self.port).into())?;
                    socket.listen(1024)
                })
            };
            match bound {
                Ok(listener) => break listener,
                Err(error) if Instant::now() > deadline => {
                    panic!(
                        "the fault proxy could not listen on port {} again: {error}",
                        self.port
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        self.listen(listener);
    }

    /// Whether the proxy accepts connections (not [`refuse`](Self::refuse)d).
    pub fn accepting(&self) -> bool {
        lock(&self.listener).is_some()
    }

    /// Cut every open connection (both sides closed at once); new ones are
    /// still accepted. Returns once they are gone.
    pub fn cut_all(&self) {
        let cut: Vec<(u64, AbortHandle)> = lock(&self.shared.connections)
            .iter()
            .map(|(id, handle)| (*id, handle.clone()))
            .collect();
        for (_, handle) in &cut {
            handle.abort();
        }
        self.shared
            .counters
            .connections_cut
            .fetch_add(cut.len() as u64, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let open = lock(&self.shared.connections);
            if cut.iter().all(|(id, _)| !open.contains_key(id)) {
                return;
            }
            drop(open);
            assert!(
                Instant::now() < deadline,
                "the fault proxy's connections did not close"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// What the proxy has seen and done so far.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            accepted: c.accepted.load(Ordering::Relaxed),
            open: c.open.load(Ordering::Relaxed),
            bytes_to_redis: c.bytes_to_redis.load(Ordering::Relaxed),
            bytes_to_client: c.bytes_to_client.load(Ordering::Relaxed),
            replies_dropped: c.replies_dropped.load(Ordering::Relaxed),
            replies_cut: c.replies_cut.load(Ordering::Relaxed),
            stalls: c.stalls.load(Ordering::Relaxed),
            connections_cut: c.connections_cut.load(Ordering::Relaxed),
            refusals: c.refusals.load(Ordering::Relaxed),
        }
    }

    /// How many requests of the command `name` (any case) went through
    /// (commands queued in a transaction included).
    pub fn commands(&self, name: &str) -> u64 {
        lock(&self.shared.commands)
            .get(&name.to_ascii_uppercase())
            .copied()
            .unwrap_or(0)
    }

    fn arm(&self, target: Match, fault: Fault) {
        lock(&self.shared.armed).push(Armed { target, fault });
    }

    fn listen(&self, listener: TcpListener) {
        let (closed_tx, closed_rx) = std::sync::mpsc::channel();
        let guard = ListenerGuard {
            listener: Some(listener),
            closed: closed_tx,
        };
        let shared = Arc::clone(&self.shared);
        let task = self.runtime.spawn(accept_loop(guard, shared));
        *lock(&self.listener) = Some(Listening {
            task: task.abort_handle(),
            closed: closed_rx,
        });
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(guard: ListenerGuard, shared: Arc<Shared>) {
    let Some(listener) = guard.listener.as_ref() else {
        return;
    };
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // EMFILE and the like: try again shortly.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
        shared.counters.open.fetch_add(1, Ordering::Relaxed);
        let connection = ConnectionGuard {
            id,
            shared: Arc::clone(&shared),
        };
        // Registered before the task can end, so its guard finds it.
        let mut connections = lock(&shared.connections);
        let task = tokio::spawn(serve(client, Arc::clone(&shared), connection));
        connections.insert(id, task.abort_handle());
    }
}

/// Forward one client connection until either side closes or a fault ends
/// it. Dropping this future (the connection cut) closes both sockets.
async fn serve(client: TcpStream, shared: Arc<Shared>, _guard: ConnectionGuard) {
    let Ok(upstream) = TcpStream::connect(("127.0.0.1", shared.upstream_port)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let link = Link {
        shared,
        pending: Mutex::new(VecDeque::new()),
        raw: AtomicBool::new(false),
    };
    tokio::select! {
        () = requests(&link, client_read, upstream_write) => {}
        () = replies(&link, upstream_read, client_write) => {}
    }
}

/// One proxied connection's state shared by its two directions.
struct Link {
    shared: Arc<Shared>,
    /// The requests sent to Redis and not answered yet, oldest first.
    pending: Mutex<VecDeque<Request>>,
    /// Bytes that did not parse went through: no more pairing on this
    /// connection.
    raw: AtomicBool,
}

const READ_SIZE: usize = 16 * 1024;

/// One direction of a link: the bytes read and not yet forwarded, cut into
/// whole frames (RESP requests or replies) that go through the faults one
/// by one, then forwarded together.
struct Pump<'a> {
    link: &'a Link,
    direction: Direction,
    /// `request_len` or `reply_len`.
    frame_len: fn(&[u8]) -> Result<Option<usize>, ()>,
    to: OwnedWriteHalf,
    buf: Vec<u8>,
    /// `buf[..start]` is forwarded already.
    start: usize,
    /// `buf[..consumed]` is whole frames that went through the faults.
    consumed: usize,
}

impl<'a> Pump<'a> {
    fn new(
        link: &'a Link,
        direction: Direction,
        frame_len: fn(&[u8]) -> Result<Option<usize>, ()>,
        to: OwnedWriteHalf,
    ) -> Self {
        Self {
            link,
            direction,
            frame_len,
            to,
            buf: Vec::with_capacity(READ_SIZE),
            start: 0,
            consumed: 0,
        }
    }

    /// Read more bytes; false once the peer is gone.
    async fn read(&mut self, from: &mut OwnedReadHalf) -> bool {
        matches!(from.read_buf(&mut self.buf).await, Ok(n) if n > 0)
    }

    /// The length of the next whole frame; `None` if it is not all read
    /// yet, or the link went raw (bytes that do not parse make it raw).
    fn next_frame(&mut self) -> Option<usize> {
        if self.link.raw.load(Ordering::Relaxed) {
            return None;
        }
        match (self.frame_len)(&self.buf[self.consumed..]) {
            Ok(len) => len,
            Err(()) => {
                self.link.raw.store(true, Ordering::Relaxed);
                None
            }
        }
    }

    /// The next frame, `len` bytes.
    fn frame(&self, len: usize) -> &[u8] {
        &self.buf[self.consumed..self.consumed + len]
    }

    /// The next frame went through the faults.
    fn pass(&mut self, len: usize) {
        self.consumed += len;
    }

    /// Forward the frames before the next one and the first `part` bytes of
    /// it; false if the peer is gone.
    async fn forward_into_frame(&mut self, part: usize) -> bool {
        let end = self.consumed + part;
        let sent = forward(
            &self.link.shared,
            self.direction,
            &mut self.to,
            &self.buf[self.start..end],
        )
        .await;
        self.start = end;
        sent
    }

    /// Forward the frames before the next one, then hold the link for
    /// `duration`; false if the peer is gone.
    async fn hold(&mut self, duration: Duration) -> bool {
        if !self.forward_into_frame(0).await {
            return false;
        }
        tokio::time::sleep(duration).await;
        true
    }

    /// Forward what is left of the whole frames (of every byte read, once
    /// the link is raw) and keep the rest for the next read; false if the
    /// peer is gone.
    async fn flush(&mut self) -> bool {
        if self.link.raw.load(Ordering::Relaxed) {
            self.consumed = self.buf.len();
        }
        if !self.forward_into_frame(0).await {
            return false;
        }
        self.buf.drain(..self.consumed);
        self.start = 0;
        self.consumed = 0;
        true
    }
}

/// Client → Redis: parse requests, remember them for their replies, apply
/// the request faults, forward.
async fn requests(link: &Link, mut from: OwnedReadHalf, to: OwnedWriteHalf) {
    let shared = &link.shared;
    let mut pump = Pump::new(link, Direction::ToRedis, request_len, to);
    // The commands of an open MULTI.
    let mut transaction: Option<Vec<Request>> = None;
    while pump.read(&mut from).await {
        while let Some(len) = pump.next_frame() {
            let Some(mut request) = parse_request(pump.frame(len)) else {
                link.raw.store(true, Ordering::Relaxed);
                break;
            };
            *lock(&shared.commands)
                .entry(request.name.clone())
                .or_default() += 1;
            match request.name.as_str() {
                "MULTI" => transaction = Some(Vec::new()),
                "EXEC" | "DISCARD" => request.queued = transaction.take().unwrap_or_default(),
                _ => {
                    if let Some(queued) = &mut transaction {
                        queued.push(request.clone());
                    }
                }
            }
            if let Some(Fault::Stall(_, duration)) =
                shared.take_fault(Direction::ToRedis, Some(&request))
            {
                shared.counters.stalls.fetch_add(1, Ordering::Relaxed);
                if !pump.hold(duration).await {
                    return;
                }
            }
            // Remembered before it is sent: its reply cannot come first.
            lock(&link.pending).push_back(request);
            pump.pass(len);
        }
        if !pump.flush().await {
            return;
        }
    }
}

/// Redis → client: pair replies with requests, apply the reply faults,
/// forward.
async fn replies(link: &Link, mut from: OwnedReadHalf, to: OwnedWriteHalf) {
    let shared = &link.shared;
    let mut pump = Pump::new(link, Direction::ToClient, reply_len, to);
    while pump.read(&mut from).await {
        while let Some(len) = pump.next_frame() {
            // RESP3 pushes answer no request.
            let request = if pump.frame(len)[0] == b'>' {
                None
            } else {
                lock(&link.pending).pop_front()
            };
            match shared.take_fault(Direction::ToClient, request.as_ref()) {
                None => {}
                Some(Fault::DropReply(after)) => {
                    shared
                        .counters
                        .replies_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    if !pump.forward_into_frame(0).await {
                        return;
                    }
                    match after {
                        AfterDrop::Close => return,
                        AfterDrop::Hang => return blackhole(from, None).await,
                        AfterDrop::HangFor(d) => return blackhole(from, Some(d)).await,
                    }
                }
                Some(Fault::CutReply) => {
                    shared.counters.replies_cut.fetch_add(1, Ordering::Relaxed);
                    pump.forward_into_frame((len / 2).max(1).min(len - 1)).await;
                    return;
                }
                Some(Fault::Stall(_, duration)) => {
                    shared.counters.stalls.fetch_add(1, Ordering::Relaxed);
                    if !pump.hold(duration).await {
                        return;
                    }
                }
            }
            pump.pass(len);
        }
        if !pump.flush().await {
            return;
        }
    }
}

/// Read and discard every reply until the connection closes (or `close_after`
/// has passed: then close it).
async fn blackhole(mut from: OwnedReadHalf, close_after: Option<Duration>) {
    let deadline = close_after.map(|d| tokio::time::Instant::now() + d);
    let mut sink = vec![0u8; READ_SIZE];
    loop {
        let read = from.read(&mut sink);
        let outcome = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, read).await {
                Ok(outcome) => outcome,
                Err(_) => return,
            },
            None => read.await,
        };
        match outcome {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Write `bytes` once no timed stall holds `direction`; false if the peer
/// is gone.
async fn forward(
    shared: &Shared,
    direction: Direction,
    to: &mut OwnedWriteHalf,
    bytes: &[u8],
) -> bool {
    if bytes.is_empty() {
        return true;
    }
    shared.wait_while_stalled(direction).await;
    if to.write_all(bytes).await.is_err() {
        return false;
    }
    let counter = match direction {
        Direction::ToRedis => &shared.counters.bytes_to_redis,
        Direction::ToClient => &shared.counters.bytes_to_client,
    };
    counter.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    true
}

// RESP framing. `Ok(Some(len))`: a whole frame of `len` bytes starts the
// buffer; `Ok(None)`: not all of it has arrived; `Err(())`: not RESP.

/// The length of the request at the start of `buf`: a RESP array, or an
/// inline command (a line).
fn request_len(buf: &[u8]) -> Result<Option<usize>, ()> {
    match buf.first() {
        None => Ok(None),
        Some(b'*') => frame_len(buf, 0),
        Some(b) if b.is_ascii_alphabetic() => Ok(line_end(buf, 0).map(|end| end + 2)),
        // Not Redis's protocol (TLS, say): forwarded untouched.
        Some(_) => Err(()),
    }
}

/// The length of the reply (any RESP2 or RESP3 frame) at the start of `buf`.
fn reply_len(buf: &[u8]) -> Result<Option<usize>, ()> {
    if buf.is_empty() {
        return Ok(None);
    }
    frame_len(buf, 0)
}

/// The index of the `\r` of the line that starts at `from`.
fn line_end(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|i| from + i)
}

/// The integer on the line from `from` (after the type byte) and the index
/// just past that line.
fn header(buf: &[u8], from: usize) -> Result<Option<(i64, usize)>, ()> {
    let Some(end) = line_end(buf, from) else {
        return Ok(None);
    };
    let text = std::str::from_utf8(&buf[from..end]).map_err(|_| ())?;
    let n = text.parse::<i64>().map_err(|_| ())?;
    Ok(Some((n, end + 2)))
}

/// The end (exclusive) of the frame starting at `at`, relative to `buf`'s
/// start: `frame_len(buf, 0)` is the first frame's length.
fn frame_len(buf: &[u8], at: usize) -> Result<Option<usize>, ()> {
    frame_end(buf, at, 0)
}

fn frame_end(buf: &[u8], at: usize, depth: usize) -> Result<Option<usize>, ()> {
    if depth > 64 {
        return Err(());
    }
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    match kind {
        // Simple string, error, integer, null, double, boolean, big number.
        b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => {
            Ok(line_end(buf, at + 1).map(|end| end + 2))
        }
        // Bulk string, bulk error, verbatim string.
        b'$' | b'!' | b'=' => {
            let Some((n, body)) = header(buf, at + 1)? else {
                return Ok(None);
            };
            if n < 0 {
                return Ok(Some(body));
            }
            let end = body + usize::try_from(n).map_err(|_| ())? + 2;
            Ok((buf.len() >= end).then_some(end))
        }
        // Array, set, push; map and attribute (two frames per entry).
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let Some((n, mut next)) = header(buf, at + 1)? else {
                return Ok(None);
            };
            if n < 0 {
                return Ok(Some(next));
            }
            let per = if matches!(kind, b'%' | b'|') { 2 } else { 1 };
            let items = usize::try_from(n).map_err(|_| ())? * per;
            for _ in 0..items {
                match frame_end(buf, next, depth + 1)? {
                    Some(end) => next = end,
                    None => return Ok(None),
                }
            }
            if kind == b'|' {
                // An attribute precedes the reply it describes.
                return frame_end(buf, next, depth + 1);
            }
            Ok(Some(next))
        }
        _ => Err(()),
    }
}

/// A whole request frame as a command: a RESP array of bulk strings, or an
/// inline command.
fn parse_request(frame: &[u8]) -> Option<Request> {
    let mut words: Vec<Vec<u8>> = Vec::new();
    if frame.first() == Some(&b'*') {
        let (n, mut at) = header(frame, 1).ok()??;
        for _ in 0..n.max(0) {
            if frame.get(at) != Some(&b'$') {
                return None;
            }
            let (len, body) = header(frame, at + 1).ok()??;
            let end = body + usize::try_from(len).ok()?;
            words.push(frame.get(body..end)?.to_vec());
            at = end + 2;
        }
    } else {
        let line = frame.strip_suffix(b"\r\n")?;
        words = line
            .split(|b| b.is_ascii_whitespace())
            .filter(|w| !w.is_empty())
            .map(<[u8]>::to_vec)
            .collect();
    }
    let mut words = words.into_iter();
    let name = String::from_utf8_lossy(&words.next().unwrap_or_default()).to_ascii_uppercase();
    Some(Request {
        name,
        args: words.collect(),
        queued: Vec::new(),
    })
}

/// A Redis Cluster of three masters (no replicas), each `redis-server` behind
/// a [`FaultProxy`] and announcing the proxy's address
/// (`--cluster-announce-ip/-port`), so `CLUSTER SLOTS` and `MOVED` send
/// clients through the proxies; the cluster bus goes direct. All killed on
/// drop.
pub struct ProxiedCluster {
    // Proxies first: dropped before the servers.
    proxies: Vec<FaultProxy>,
    nodes: Vec<RedisServer>,
}

impl std::fmt::Debug for ProxiedCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxiedCluster")
            .field("proxies", &self.urls())
            .finish_non_exhaustive()
    }
}

impl ProxiedCluster {
    /// Start three proxied cluster nodes, join them at the addresses they
    /// announce, their proxies ([`create_cluster`](super::create_cluster)),
    /// and wait until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        let mut proxies = Vec::new();
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let (proxy, node) = start_proxied_node();
            proxies.push(proxy);
            nodes.push(node);
        }
        let ports: Vec<u16> = proxies.iter().map(FaultProxy::port).collect();
        // Every node announces its proxy.
        let announces_proxies = |node: &RedisServer| {
            let slots = node.command(&["CLUSTER", "SLOTS"]);
            ports
                .iter()
                .all(|port| slots.contains(&format!(":{port}\r\n")))
        };
        super::create_cluster(&ports, "proxied Redis Cluster", &nodes, announces_proxies);
        Self { proxies, nodes }
    }

    /// The proxies' URLs: what clients are given.
    pub fn urls(&self) -> Vec<String> {
        self.proxies.iter().map(FaultProxy::url).collect()
    }

    /// The proxies, in the order of [`nodes`](Self::nodes).
    pub fn proxies(&self) -> &[FaultProxy] {
        &self.proxies
    }

    /// The servers (their own ports, for commands that bypass the proxies).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The proxy of the master that owns `key`'s slot (each node's own
    /// line of `CLUSTER NODES` lists its slot ranges).
    pub fn proxy_of(&self, key: &str) -> &FaultProxy {
        let slot = super::cluster::key_slot(&self.nodes[0], key);
        for (proxy, node) in self.proxies.iter().zip(&self.nodes) {
            let nodes = node.command(&["CLUSTER", "NODES"]);
            let owns = nodes.lines().any(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                fields.len() >= 9
                    && fields[2].contains("myself")
                    && super::cluster::in_slot_ranges(&fields[8..], slot)
            });
            if owns {
                return proxy;
            }
        }
        panic!("no master owns slot {slot} of {key}");
    }

    /// Every proxy refuses connections ([`FaultProxy::refuse`]).
    pub fn refuse(&self) {
        for proxy in &self.proxies {
            proxy.refuse();
        }
    }

    /// Every proxy accepts connections again ([`FaultProxy::accept`]).
    pub fn accept(&self) {
        for proxy in &self.proxies {
            proxy.accept();
        }
    }
}

/// A proxy, then a cluster node behind it announcing the proxy's port (on
/// fresh ports until one starts).
fn start_proxied_node() -> (FaultProxy, RedisServer) {
    let mut last_error = String::new();
    for _ in 0..5 {
        let port = super::free_port();
        let bus = super::free_port();
        if bus == port {
            continue;
        }
        let proxy = FaultProxy::start(port);
        let dir = super::server::server_dir(port);
        let (proxy_port, bus) = (proxy.port().to_string(), bus.to_string());
        let mut args = super::CLUSTER_NODE_ARGS.to_vec();
        args.extend([
            "--cluster-port",
            &bus,
            "--cluster-announce-ip",
            "127.0.0.1",
            "--cluster-announce-port",
            &proxy_port,
            "--cluster-announce-bus-port",
            &bus,
        ]);
        match super::server::spawn_ready(port, &args, &dir) {
            Ok(child) => return (proxy, RedisServer { child, port, dir }),
            Err(error) => last_error = error,
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    panic!("could not start a proxied cluster node: {last_error}");
}
