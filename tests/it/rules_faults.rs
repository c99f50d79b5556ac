//! The rules engine (limits as data: `Rules`, `RulesLayer`) under network
//! faults, through the fault-injecting proxy of `tests/support/proxy.rs`
//! between each store and a real redis-server, for every algorithm a rule
//! can name and every connection source of `tests/support/faults.rs`:
//!
//! 1. never over: two processes (one behind the `RulesLayer`, one calling
//!    the engine) check requests against two rules at once (a global rule
//!    and a per-client rule, both refunding 5xx answers) while a seeded
//!    random schedule of faults hits the checks, the refunds and the
//!    connections; each rule's admissions that were not refunded stay within
//!    its max (concurrency: requests in flight);
//! 2. a lost refund gives back at most once, and exactly what the request
//!    took: a refund (of a 5xx answer, or of a rule whose request another
//!    rule denied) whose reply is dropped, cut, stalled or whose request is
//!    late is never sent again, and the key holds what the other process
//!    spent before;
//! 3. no lockout: once faults end, every rule's key has expired within its
//!    windows (and its block), and each rule admits its whole quota again;
//! 4. refused connections: under `FailMode::Open` a request is admitted and
//!    no refund is sent for its fail-open admission (not even once the
//!    store is back when the response is settled); under `FailMode::Closed`
//!    it fails; either way nothing is counted; on a cluster where one node
//!    refuses, the rules whose nodes answered are given back (`Closed`) or
//!    refunded alone (`Open`);
//!
//! then the regression test of the circuit breaker the rules share: the
//! first request after an outage is decided by the store for every rule
//! (its checks were sent together, and the breaker let one through as its
//! probe and failed the others).
//!
//! A rule set cannot choose the sliding log's `Script` execution (rules run
//! the default, `Transaction`): the `Script` execution's refund is held to
//! invariant 2 at the store level, with the same `Command::Refund` the
//! engine sends.
//!
//! Sampled to keep the file's run short: the single-server sources run
//! every case; a cluster source starts one proxied cluster per test and
//! runs a sample of invariant 2's cases (each loss on each path at least
//! once, see [`sampled`]); the cluster client without retries, the
//! workaround for lost replies, runs invariant 2 only (as in
//! tests/network_faults.rs). Invariants 1 and 3 run every algorithm at once
//! on one rig per source, sharing its fault schedule.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::faults::{
    Algo, Connections, FaultSpans, Loss, Rig, fault_seed, millis, panic_message, random_fault,
};
use crate::support::harness::away_from_a_boundary;
use crate::support::proxy::{FaultProxy, Match};
use crate::support::rng::Rng;
use axum::Router;
use axum::body::Body;
use http::{Method, Request, StatusCode};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_redis_ratelimit::limiter::CircuitBreaker;
use tower_redis_ratelimit::rules::RulesLayer;
use tower_redis_ratelimit::rules::{Admission, Call, RuleSet, Rules};
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{FailMode, LimitError, RedisStore, Store};

/// The store timeout.
const TIMEOUT: Duration = Duration::from_millis(300);

/// The algorithms a rule can name (the sliding log in its default,
/// `Transaction`, execution).
const RULE_ALGOS: [Algo; 5] = [
    Algo::LogTransaction,
    Algo::FixedWindow,
    Algo::SlidingWindow,
    Algo::Gcra,
    Algo::Concurrency,
];

/// An algorithm's name in a rule set.
fn algorithm(algo: Algo) -> &'static str {
    match algo {
        Algo::LogTransaction | Algo::LogScript => "sliding-log",
        Algo::FixedWindow => "fixed-window",
        Algo::SlidingWindow => "sliding-window",
        Algo::Gcra => "gcra",
        Algo::Concurrency => "concurrency",
    }
}

/// A rule's fields: `policy`, `algorithm`, and for a counting algorithm
/// `refund = ["5xx"]` (a concurrency limit does not count outcomes).
fn counted(algo: Algo, policy: &str) -> String {
    let refund = if algo == Algo::Concurrency {
        ""
    } else {
        "refund = [\"5xx\"]\n"
    };
    format!(
        "policy = \"{policy}\"\nalgorithm = \"{}\"\n{refund}",
        algorithm(algo)
    )
}

/// `rules` on `store`, failing as `mode` says; no circuit breaker (every
/// check asks the store, so every fault is seen) and no deny cache.
fn bare(store: &RedisStore, rules: &str, mode: FailMode) -> Rules {
    Rules::new(store.clone(), RuleSet::from_toml(rules).unwrap())
        .with_fail_mode(mode)
        .without_circuit_breaker()
        .without_deny_cache()
}

/// Check a GET of `path` against `rules`, every matching rule counting
/// `key` at `cost` units, except rules named `*global*`, which count the
/// key `global`.
async fn check(rules: &Rules, path: &str, key: &str, cost: u64) -> Result<Admission, LimitError> {
    rules
        .current()
        .check(&Method::GET, path, None, |rule| {
            let key = if rule.name().contains("global") {
                "global"
            } else {
                key
            };
            Ok::<_, Infallible>(Some(Call::new(key).with_cost(cost)))
        })
        .unwrap()
        .await
}

/// The units rule `rule` has left for `key` (peeked: nothing counted;
/// asked again after a failure, up to 5 times, 50 ms apart: a peek changes
/// nothing, and the observer's connection may still be recovering from an
/// earlier cut).
async fn left(rules: &Rules, rule: &str, key: &str) -> Result<u64, String> {
    let active = rules.current();
    let limiter = active.limiter(rule, None).unwrap();
    let mut tries = 0;
    let peeked = loop {
        match limiter.peek(key).await {
            Ok(peeked) => break peeked,
            Err(e) if tries == 4 => return Err(format!("the peek of {rule}/{key} failed: {e}")),
            Err(_) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    Ok(if peeked.allowed() {
        peeked.remaining() + limiter.policy().cost()
    } else {
        peeked.remaining()
    })
}

/// The Redis key holding rule `rule`'s count of `key` on `store`.
fn redis_key(rules: &Rules, store: &RedisStore, rule: &str, algo: Algo, key: &str) -> String {
    let active = rules.current();
    let limiter = active.limiter(rule, None).unwrap();
    store.redis_key(algo.tag(), &format!("{}:{key}", limiter.name()))
}

/// What gives a rule's units back for `redis_key`: the command script's
/// refund of the request's own entries (the sliding log: the decision
/// names them), its reward of the units (the window counters and GCRA,
/// whose decisions name no request), or the `ZREM` of a concurrency lease.
fn give_back(algo: Algo, redis_key: &str) -> Match {
    let evalsha = Match::command("EVALSHA").arg(redis_key);
    match algo {
        Algo::Concurrency => Match::command("ZREM").arg(redis_key),
        Algo::LogTransaction | Algo::LogScript => evalsha.arg_is("refund"),
        _ => evalsha.arg_is("reward"),
    }
}

/// A fault per source and scenario, different for each; `FAULT_SEED`
/// changes them all.
fn seed(source: Connections, scenario: &str) -> u64 {
    let mut h = fault_seed(0x5eed_0014) ^ 0x9e37_79b9_7f4a_7c15;
    for b in format!("{source:?}/{scenario}").bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

/// Faults over ([`Rig::reset`]), then until every store answered three
/// peeks in a row, 30 ms apart (a `ConnectionManager` may drop the
/// connection it made after the cut once more when the old one's
/// disconnection notice comes in late): a case starts on quiet stores.
async fn steady(rig: &Rig) {
    rig.reset().await;
    let policy = Algo::FixedWindow.policy(1_000_000, Duration::from_secs(1));
    let started = Instant::now();
    for (i, store) in rig.stores.iter().enumerate() {
        let mut in_a_row = 0;
        while in_a_row < 3 {
            match store.command("steady", &policy, Command::Peek).await {
                Ok(_) => in_a_row += 1,
                Err(_) => in_a_row = 0,
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{:?}: store {i} does not answer steadily after a reset",
                rig.source
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
}

/// Wait for every task of `jobs`; fail with every panic's message.
async fn join_all(mut jobs: JoinSet<()>, what: &str) {
    let mut failures = Vec::new();
    while let Some(done) = jobs.join_next().await {
        if let Err(error) = done {
            failures.push(match error.try_into_panic() {
                Ok(panic) => panic_message(panic),
                Err(error) => error.to_string(),
            });
        }
    }
    assert!(failures.is_empty(), "{what}:\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// The random fault schedule of invariants 1 and 3.

/// One algorithm's two rules in a scenario: a global one and one per
/// client (`header:x-client` behind the layer, `Call::new("cN")` through
/// the engine), as process A (store 0, behind the `RulesLayer`) and
/// process B (store 1, calling the engine) serve them.
struct Pair {
    algo: Algo,
    global: String,
    client: String,
    a: Rules,
    b: Rules,
}

impl Pair {
    /// `prefix{global,client}-{tag}` with those policies (concurrency: in
    /// flight, leases of the window), each refunding 5xx answers, and
    /// `extra` added to the client rule.
    fn new(
        rig: &Rig,
        algo: Algo,
        prefix: &str,
        (global, client): (&str, &str),
        extra: &str,
        mode: impl Fn(Rules) -> Rules,
    ) -> Self {
        let tag = algo.tag();
        let (global_name, client_name) = (
            format!("{prefix}global-{tag}"),
            format!("{prefix}client-{tag}"),
        );
        let text = format!(
            "[[rules]]\nname = \"{global_name}\"\nkey = \"global\"\n{}\
             [[rules]]\nname = \"{client_name}\"\nkey = \"header:x-client\"\n{}{extra}",
            counted(algo, global),
            counted(algo, client),
        );
        let serve = |store: &RedisStore| {
            mode(Rules::new(
                store.clone(),
                RuleSet::from_toml(&text).unwrap(),
            ))
        };
        Self {
            algo,
            a: serve(rig.store(0)),
            b: serve(rig.store(1)),
            global: global_name,
            client: client_name,
        }
    }

    /// The Redis keys of the global rule and of the client rule's `clients`.
    fn redis_keys(&self, rig: &Rig, clients: usize) -> Vec<String> {
        let mut keys = vec![redis_key(
            &self.a,
            rig.store(0),
            &self.global,
            self.algo,
            "global",
        )];
        for c in 0..clients {
            keys.push(redis_key(
                &self.a,
                rig.store(0),
                &self.client,
                self.algo,
                &format!("c{c}"),
            ));
        }
        keys
    }
}

/// Until `deadline`, every 30 to 120 ms, one random fault (of
/// [`random_fault`]'s nine) on a random proxy: on any frame, or targeted at
/// a rule's check, at its refund (a concurrency slot's release), at any
/// refund, or at any command naming its key. Returns the faults picked.
async fn fault_schedule(
    rig: Arc<Rig>,
    targets: Vec<(Algo, String)>,
    seed: u64,
    deadline: Instant,
) -> Vec<u64> {
    const SPANS: FaultSpans = FaultSpans {
        hang: (100, 600),
        held: (50, 500),
        stall: (50, 400),
        refused: (50, 300),
    };
    let mut rng = Rng::new(seed);
    let mut schedule = Vec::new();
    while Instant::now() + Duration::from_millis(200) < deadline {
        tokio::time::sleep(millis(&mut rng, 30, 120)).await;
        let (algo, key) = &targets[rng.below(targets.len() as u64) as usize];
        let store = rng.below(2) as usize;
        let (proxy, target) = match rng.below(5) {
            0 => {
                let proxies = rig.all_proxies();
                let proxy = proxies[rng.below(proxies.len() as u64) as usize];
                (proxy, Match::any())
            }
            1 => (rig.proxy(store, key), algo.decisive(key)),
            2 => (rig.proxy(store, key), give_back(*algo, key)),
            3 => (
                rig.proxy(store, key),
                Match::command("EVALSHA").arg_is(["refund", "reward"][rng.below(2) as usize]),
            ),
            _ => (rig.proxy(store, key), Match::any().arg(key)),
        };
        schedule.push(random_fault(proxy, target, &mut rng, &SPANS).await);
    }
    schedule
}

/// Faults over: every proxy healed, accepting, its connections cut, and
/// every store answering again ([`steady`]).
async fn end_faults(rig: &Rig) {
    steady(rig).await;
}

/// A GET of `/` from client `c`, answered with `status` by the app of
/// [`app`], which holds it `hold` ms first.
fn http_request(c: usize, status: u16, hold: u64) -> Request<Body> {
    Request::get("/")
        .header("x-client", format!("c{c}"))
        .header("x-status", status.to_string())
        .header("x-hold", hold.to_string())
        .body(Body::empty())
        .unwrap()
}

fn header_number(req: &Request<Body>, name: &str) -> u64 {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start_matches('c').parse().ok())
        .unwrap()
}

/// A router answering every request with its `x-status`, after holding it
/// `x-hold` ms, counted in flight in `tally` meanwhile, behind `rules`.
fn app(rules: Rules, tally: Arc<Tally>) -> Router {
    Router::new()
        .fallback(move |req: Request<Body>| {
            let tally = Arc::clone(&tally);
            async move {
                let c = header_number(&req, "x-client") as usize;
                let hold = header_number(&req, "x-hold");
                tally.enter(c);
                tokio::time::sleep(Duration::from_millis(hold)).await;
                tally.leave(c);
                StatusCode::from_u16(header_number(&req, "x-status") as u16).unwrap()
            }
        })
        .layer(RulesLayer::new(rules))
}

// ---------------------------------------------------------------------------
// Invariant 1: never over.

/// How long the checkers run.
const RUN: Duration = Duration::from_secs(2);
/// Clients of the per-client rule.
const CLIENTS: usize = 4;

/// What the checkers of one algorithm saw.
#[derive(Debug, Default)]
struct Tally {
    /// Admitted requests, per client.
    admitted: [AtomicU64; CLIENTS],
    /// Admitted requests answered 5xx (their refund sent), per client.
    refunded: [AtomicU64; CLIENTS],
    denied: AtomicU64,
    errors: AtomicU64,
    /// Requests in flight (admitted, not answered yet), per client and in
    /// all, and the most seen at once.
    in_flight: [AtomicU64; CLIENTS],
    most: [AtomicU64; CLIENTS],
    in_flight_all: AtomicU64,
    most_all: AtomicU64,
}

impl Tally {
    fn enter(&self, c: usize) {
        let now = self.in_flight[c].fetch_add(1, Ordering::SeqCst) + 1;
        self.most[c].fetch_max(now, Ordering::SeqCst);
        let now = self.in_flight_all.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_all.fetch_max(now, Ordering::SeqCst);
    }

    fn leave(&self, c: usize) {
        self.in_flight[c].fetch_sub(1, Ordering::SeqCst);
        self.in_flight_all.fetch_sub(1, Ordering::SeqCst);
    }

    fn admit(&self, c: usize, status: u16) {
        self.admitted[c].fetch_add(1, Ordering::SeqCst);
        if status >= 500 {
            self.refunded[c].fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counted(&self, c: usize) -> u64 {
        self.admitted[c].load(Ordering::SeqCst) - self.refunded[c].load(Ordering::SeqCst)
    }
}

/// A random answer: 500 (refunded) `in_six` times in six; 200 always for
/// a concurrency limit (which counts requests in flight, not answers).
fn pick_status(algo: Algo, rng: &mut Rng, in_six: u64) -> u16 {
    if algo != Algo::Concurrency && rng.below(6) < in_six {
        500
    } else {
        200
    }
}

/// Process A: requests through the `RulesLayer` (FailMode::Closed: a store
/// failure is a 503, never an admission), until `deadline`.
async fn layer_checker(app: Router, algo: Algo, tally: Arc<Tally>, seed: u64, deadline: Instant) {
    let mut rng = Rng::new(seed);
    while Instant::now() < deadline {
        let c = rng.below(CLIENTS as u64) as usize;
        let status = pick_status(algo, &mut rng, REFUNDED);
        let hold = 5 + rng.below(40);
        let response = app
            .clone()
            .oneshot(http_request(c, status, hold))
            .await
            .unwrap();
        match response.status() {
            StatusCode::OK | StatusCode::INTERNAL_SERVER_ERROR => {
                tally.admit(c, response.status().as_u16());
            }
            StatusCode::TOO_MANY_REQUESTS => {
                tally.denied.fetch_add(1, Ordering::SeqCst);
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                tally.errors.fetch_add(1, Ordering::SeqCst);
            }
            other => panic!("{algo:?}: the layer answered {other}"),
        }
        // The response (and any concurrency slot its body holds) is done.
        drop(response);
        tokio::time::sleep(millis(&mut rng, 5, 25)).await;
    }
}

/// Process B: requests through the engine (`check`, then `settle` with the
/// answer), until `deadline`.
async fn engine_checker(rules: Rules, algo: Algo, tally: Arc<Tally>, seed: u64, deadline: Instant) {
    let mut rng = Rng::new(seed);
    while Instant::now() < deadline {
        let c = rng.below(CLIENTS as u64) as usize;
        let status = pick_status(algo, &mut rng, REFUNDED);
        match check(&rules, "/", &format!("c{c}"), 1).await {
            Ok(admission) if admission.allowed() => {
                tally.admit(c, status);
                tally.enter(c);
                tokio::time::sleep(millis(&mut rng, 5, 45)).await;
                tally.leave(c);
                let permits = admission.settle(Some(status));
                drop(permits);
            }
            Ok(_) => {
                tally.denied.fetch_add(1, Ordering::SeqCst);
            }
            Err(_) => {
                tally.errors.fetch_add(1, Ordering::SeqCst);
            }
        }
        tokio::time::sleep(millis(&mut rng, 5, 25)).await;
    }
}

/// How many answers in six are 500s, refunded: most, so units keep coming
/// back (under faults) and the checkers keep being admitted near the limit
/// for a while before the counted ones fill it.
const REFUNDED: u64 = 5;

/// The global rule's max, and the client rule's (concurrency: in flight).
fn never_over_limits(algo: Algo) -> (u64, u64) {
    if algo == Algo::Concurrency {
        (2, 1)
    } else {
        (8, 3)
    }
}

/// For every algorithm at once (each its own two rules on one rig of two
/// stores), two checkers per process and algorithm check random clients
/// for [`RUN`] under [`fault_schedule`], inside one window of a minute:
/// per rule and key, admissions less refunds stay within the max (GCRA:
/// plus what it refilled); concurrency: requests in flight stay within it.
async fn never_over(source: Connections) {
    let window = Duration::from_secs(60);
    let rig = Arc::new(Rig::start(source, 2, TIMEOUT).await);
    let pairs: Vec<Arc<Pair>> = RULE_ALGOS
        .iter()
        .map(|&algo| {
            let (g, c) = never_over_limits(algo);
            Arc::new(Pair::new(
                &rig,
                algo,
                "",
                (&format!("{g}/1m"), &format!("{c}/1m")),
                "",
                |rules| {
                    rules
                        .with_fail_mode(FailMode::Closed)
                        .without_circuit_breaker()
                },
            ))
        })
        .collect();
    let targets = pairs
        .iter()
        .flat_map(|p| {
            p.redis_keys(&rig, CLIENTS)
                .into_iter()
                .map(move |k| (p.algo, k))
        })
        .collect();
    let seed = seed(source, "never-over");
    away_from_a_boundary(window, RUN + Duration::from_secs(3)).await;
    let started = Instant::now();
    let deadline = started + RUN;
    let tallies: Vec<Arc<Tally>> = pairs.iter().map(|_| Arc::default()).collect();
    let mut jobs = JoinSet::new();
    for (i, (pair, tally)) in pairs.iter().zip(&tallies).enumerate() {
        for j in 0..2u64 {
            let s = seed.wrapping_add(16 * i as u64 + 2 * j + 1);
            let app = app(pair.a.clone(), Arc::clone(tally));
            jobs.spawn(layer_checker(
                app,
                pair.algo,
                Arc::clone(tally),
                s,
                deadline,
            ));
            jobs.spawn(engine_checker(
                pair.b.clone(),
                pair.algo,
                Arc::clone(tally),
                s + 1,
                deadline,
            ));
        }
    }
    let faults = tokio::spawn(fault_schedule(Arc::clone(&rig), targets, seed, deadline));
    join_all(jobs, "a checker panicked").await;
    let elapsed = started.elapsed();
    let schedule = faults.await.unwrap();
    let fired = rig.faults();
    end_faults(&rig).await;
    let mut failures = Vec::new();
    for (pair, tally) in pairs.iter().zip(&tallies) {
        let algo = pair.algo;
        let (global, client) = never_over_limits(algo);
        let admitted: u64 = tally
            .admitted
            .iter()
            .map(|a| a.load(Ordering::SeqCst))
            .sum();
        let denied = tally.denied.load(Ordering::SeqCst);
        let what = format!(
            "{algo:?}: {admitted} admitted ({:?} per client, {:?} of them refunded), {denied} denied, \
             {} errors in {elapsed:?}",
            tally.admitted,
            tally.refunded,
            tally.errors.load(Ordering::SeqCst)
        );
        eprintln!("{source:?} never over: {what}");
        if admitted == 0 || denied == 0 {
            failures.push(format!("{what}: the limits were never reached"));
        }
        if algo == Algo::Concurrency {
            let most_all = tally.most_all.load(Ordering::SeqCst);
            let most: Vec<u64> = tally
                .most
                .iter()
                .map(|m| m.load(Ordering::SeqCst))
                .collect();
            if most_all > global || most.iter().any(|&m| m > client) {
                failures.push(format!(
                    "{what}: {most_all} in flight at once (max {global}), per client {most:?} (max {client})"
                ));
            }
            continue;
        }
        // GCRA refills one unit every window / max.
        let refill = |max: u64| {
            if algo == Algo::Gcra {
                (elapsed.as_micros() / (window / max as u32).as_micros()) as u64
            } else {
                0
            }
        };
        let all: u64 = (0..CLIENTS).map(|c| tally.counted(c)).sum();
        if all > global + refill(global) {
            failures.push(format!(
                "{what}: the global rule counted {all} (admitted less refunded), max {}",
                global + refill(global)
            ));
        }
        for c in 0..CLIENTS {
            if tally.counted(c) > client + refill(client) {
                failures.push(format!(
                    "{what}: client c{c} counted {} (admitted less refunded), max {}",
                    tally.counted(c),
                    client + refill(client)
                ));
            }
        }
    }
    eprintln!("{source:?} never over: {fired} faults fired (schedule {schedule:?})");
    assert!(
        fired >= 5,
        "{source:?}: too few faults fired to mean anything ({fired}; seed {seed:#x})"
    );
    assert!(
        failures.is_empty(),
        "{source:?}, seed {seed:#x}, {fired} faults fired (schedule {schedule:?}):\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// Invariant 2: a lost refund gives back at most once.

/// The rule every case gives back (`taken`) allows this many per window
/// (concurrency: in flight).
const MAX: u64 = 10;
/// What the other process spent on `taken` before (concurrency: slots held).
const PRE: u64 = 4;
/// What the faulted request costs under `taken` (concurrency: one slot).
const COST: u64 = 3;
/// The window of invariant 2 and 4's rules: no case outlives it.
const LONG: Duration = Duration::from_secs(600);

/// The ways a refund is lost: its reply dropped with the connection closed
/// or hung, cut mid-way, or held past the timeout (Redis ran it), or the
/// request itself held past the timeout (Redis runs it late).
const LOSSES: [Loss; 5] = [
    Loss::DropClose,
    Loss::DropHang,
    Loss::Cut,
    Loss::Stalled,
    Loss::Late,
];

/// Why a refund is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The request was admitted and answered 500 (`refund = ["5xx"]`):
    /// `Admission::settle`, in a spawned task.
    Outcome,
    /// Another rule (`gate`) denied the request: the engine gives back what
    /// `taken` took before answering.
    Denial,
}

/// `taken` counts every request (cost [`COST`] here), refunding 5xx
/// answers; `gate`, on `/deny` only, allows one per window.
fn refund_rules(algo: Algo) -> String {
    let policy = format!("{MAX}/10m");
    format!(
        "[[rules]]\nname = \"taken\"\nkey = \"global\"\n{}\
         [[rules]]\nname = \"gate\"\npath = \"/deny\"\nkey = \"global\"\npolicy = \"1/10m\"\n\
         algorithm = \"fixed-window\"\n",
        counted(algo, &policy)
    )
}

/// Arm, after a loss on `target`, a harmless one-shot fault (a 1 ms stall
/// in the loss's direction) that fires only on the next frame `target`
/// matches: a refund sent again.
fn arm_sentinel(loss: Loss, proxy: &FaultProxy, target: Match) {
    let tick = Duration::from_millis(1);
    if loss == Loss::Late {
        proxy.stall_next_request(target, tick);
    } else {
        proxy.stall_next_reply(target, tick);
    }
}

/// After a lost refund: the loss fired, the sentinel did not (nothing was
/// sent again), and the key holds `PRE` units used (a loss after Redis ran
/// the refund), or between `PRE` and `PRE + cost` (a late request: at most
/// once).
async fn judge(
    proxy: &FaultProxy,
    loss: Loss,
    used: impl Future<Output = Result<u64, String>>,
    cost: u64,
) -> Result<(), String> {
    // The give-back may still be under way (a spawned refund): wait for
    // the fault, then past the store timeout (the call, any resend
    // included, is over) and, for a late request, past its arrival.
    let waited = Instant::now();
    while proxy.armed() > 1 && waited.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let after = if loss == Loss::Late { 250 } else { 50 };
    tokio::time::sleep(TIMEOUT + Duration::from_millis(after)).await;
    let mut problems = Vec::new();
    match proxy.armed() {
        2 => return Err("the refund was never sent (the fault never fired)".to_owned()),
        0 => problems.push("the refund was sent again after its reply was lost".to_owned()),
        _ => {}
    }
    let used = used.await?;
    let expected = if loss == Loss::Late {
        PRE..=PRE + cost
    } else {
        PRE..=PRE
    };
    if !expected.contains(&used) {
        problems.push(format!(
            "{used} units used after the refund, expected {expected:?} (the other process \
             spent {PRE}, the request took {cost}{})",
            if used < PRE {
                ": given back more than the request took"
            } else {
                ": a refund Redis ran was not applied"
            }
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// One case: process B spends [`PRE`] of `taken` (and fills `gate`); the
/// request of process A takes [`COST`] more; its give-back (by `path`) is
/// lost by `loss`.
async fn lost_refund(rig: &Rig, algo: Algo, path: Path, loss: Loss) -> Result<(), String> {
    if algo == Algo::LogScript {
        return lost_refund_in_store(rig, loss).await;
    }
    steady(rig).await;
    let text = refund_rules(algo);
    let (a, b) = (
        bare(rig.store(0), &text, FailMode::Closed),
        bare(rig.store(1), &text, FailMode::Closed),
    );
    let key = format!("{path:?}-{loss:?}");
    let conc = algo == Algo::Concurrency;
    let cost = if conc { 1 } else { COST };
    // B's admissions stay alive until the end (a concurrency slot each).
    let mut held = Vec::new();
    for _ in 0..(if conc { PRE } else { 1 }) {
        let spent = check(&b, "/", &key, PRE)
            .await
            .map_err(|e| format!("B's check failed: {e}"))?;
        if !spent.allowed() {
            return Err("B's check was denied".to_owned());
        }
        held.push(spent);
    }
    if path == Path::Denial {
        let gate = b.current().limiter("gate", None).unwrap().clone();
        gate.penalty(&key, 1)
            .await
            .map_err(|e| format!("B's penalty failed: {e}"))?;
    }
    // (B's peek also loads the command script: a refund answered
    // `NOSCRIPT` would not have run.)
    let used = MAX - left(&b, "taken", &key).await?;
    if used != PRE {
        return Err(format!("B's requests left {used} used, not {PRE}"));
    }
    let redis_key = redis_key(&a, rig.store(0), "taken", algo, &key);
    let proxy = rig.proxy(0, &redis_key);
    let target = give_back(algo, &redis_key);
    loss.arm(proxy, target.clone(), TIMEOUT);
    arm_sentinel(loss, proxy, target);
    let uri = match path {
        Path::Outcome => "/",
        Path::Denial => "/deny",
    };
    let admission = check(&a, uri, &key, cost)
        .await
        .map_err(|e| format!("A's check failed: {e}"))?;
    match path {
        Path::Outcome => {
            if !admission.allowed() {
                return Err("A's request was denied".to_owned());
            }
            let used = MAX - left(&b, "taken", &key).await?;
            if used != PRE + cost {
                return Err(format!(
                    "A's admitted request left {used} used, not {}",
                    PRE + cost
                ));
            }
            drop(admission.settle(Some(500)));
        }
        Path::Denial => {
            let shown = admission.shown().map(|(rule, ..)| rule.to_owned());
            if admission.allowed() || shown.as_deref() != Some("gate") {
                return Err(format!(
                    "A's request was not denied by gate (shown: {shown:?})"
                ));
            }
        }
    }
    let result = judge(
        proxy,
        loss,
        async { Ok(MAX - left(&b, "taken", &key).await?) },
        cost,
    )
    .await;
    drop(held);
    result
}

/// [`lost_refund`] of the sliding log's `Script` execution, which a rule
/// set cannot choose: the store's `Command::Refund` (what the engine sends)
/// of A's admitted check of cost [`COST`], after B's check of [`PRE`].
async fn lost_refund_in_store(rig: &Rig, loss: Loss) -> Result<(), String> {
    steady(rig).await;
    let (a, b) = (rig.store(0), rig.store(1));
    let policy = Algo::LogScript.policy(MAX, LONG);
    let key = format!("store-{loss:?}");
    let spent = b
        .check(&key, &policy.clone().with_cost(PRE).unwrap())
        .await
        .map_err(|e| format!("B's check failed: {e}"))?;
    let taken = a
        .check(&key, &policy.clone().with_cost(COST).unwrap())
        .await
        .map_err(|e| format!("A's check failed: {e}"))?;
    if !spent.allowed() || !taken.allowed() {
        return Err("a check was denied".to_owned());
    }
    // (B's peek also loads the command script: a refund answered
    // `NOSCRIPT` would not have run.)
    let peeked = b
        .command(&key, &policy, Command::Peek)
        .await
        .map_err(|e| format!("B's peek failed: {e}"))?;
    if peeked.remaining() + 1 != MAX - PRE - COST {
        return Err(format!("B's peek: {peeked:?}, not {} used", PRE + COST));
    }
    let id = taken
        .refund_id()
        .ok_or("an admitted sliding-log check names no entries")?;
    let redis_key = a.redis_key("log", &key);
    let proxy = rig.proxy(0, &redis_key);
    let target = give_back(Algo::LogScript, &redis_key);
    loss.arm(proxy, target.clone(), TIMEOUT);
    arm_sentinel(loss, proxy, target);
    let _ = a
        .command(&key, &policy, Command::Refund { id, units: COST })
        .await;
    let used = async {
        let peeked = b
            .command(&key, &policy, Command::Peek)
            .await
            .map_err(|e| format!("B's peek failed: {e}"))?;
        Ok(MAX
            - if peeked.allowed() {
                peeked.remaining() + 1
            } else {
                0
            })
    };
    judge(proxy, loss, used, COST).await
}

/// Every case of `algo`: each loss on each path (a concurrency slot is
/// given back on a denial only; `Script` is a store-level refund).
fn every_case(algo: Algo) -> Vec<(Path, Loss)> {
    let paths: &[Path] = match algo {
        Algo::Concurrency => &[Path::Denial],
        Algo::LogScript => &[Path::Outcome],
        _ => &[Path::Outcome, Path::Denial],
    };
    paths
        .iter()
        .flat_map(|&p| LOSSES.iter().map(move |&l| (p, l)))
        .collect()
}

/// The cluster's sample: algorithm `i` (of [`Algo::ALL`]) loses its
/// outcome refund by loss `i` and its denial refund by loss `i + 2` (of
/// [`LOSSES`]), so each loss hits each path at least once.
fn sampled(i: usize, algo: Algo) -> Vec<(Path, Loss)> {
    every_case(algo)
        .into_iter()
        .filter(|&(path, loss)| {
            let at = match path {
                Path::Outcome => i,
                Path::Denial => i + 2,
            };
            loss == LOSSES[at % LOSSES.len()]
        })
        .collect()
}

/// Run `cases` of `algo` on `rig` one after the other.
async fn run_cases(rig: &Rig, algo: Algo, cases: Vec<(Path, Loss)>) -> Vec<String> {
    let mut failures = Vec::new();
    for (path, loss) in cases {
        if let Err(failure) = lost_refund(rig, algo, path, loss).await {
            failures.push(format!("{algo:?}, {path:?}, {loss:?}: {failure}"));
        }
    }
    failures
}

/// Single server: every case, each algorithm and path on a rig of its
/// own, all at once. Cluster: [`sampled`] cases on one rig.
async fn lost_refunds(source: Connections) {
    away_from_a_boundary(LONG, Duration::from_secs(15)).await;
    let mut failures = Vec::new();
    if source.is_cluster() {
        let rig = Rig::start(source, 2, TIMEOUT).await;
        for (i, algo) in Algo::ALL.into_iter().enumerate() {
            failures.extend(run_cases(&rig, algo, sampled(i, algo)).await);
        }
    } else {
        let mut jobs = JoinSet::new();
        for algo in Algo::ALL {
            for path in [Path::Outcome, Path::Denial] {
                let cases: Vec<_> = every_case(algo)
                    .into_iter()
                    .filter(|&(p, _)| p == path)
                    .collect();
                if cases.is_empty() {
                    continue;
                }
                jobs.spawn(async move {
                    let rig = Rig::start(source, 2, TIMEOUT).await;
                    run_cases(&rig, algo, cases).await
                });
            }
        }
        while let Some(done) = jobs.join_next().await {
            failures.extend(done.unwrap());
        }
    }
    failures.sort();
    assert!(
        failures.is_empty(),
        "{source:?}:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// Invariant 3: no lockout.

/// How long invariant 3's faults last.
const STORM: Duration = Duration::from_millis(1500);
/// The clients of invariant 3.
const LOCKOUT_CLIENTS: usize = 3;

/// Every algorithm at once, the default circuit breaker and deny cache,
/// `FailMode::Closed`: a global rule (4 per second; concurrency: 2 in
/// flight, leases of 1 s) and a per-client one (2 per second, blocking a
/// client 1 s after a breach; concurrency: 1 in flight) take requests
/// from both processes for [`STORM`] under [`fault_schedule`]. Then the
/// faults end and nobody asks for 3 s (two windows, the block, and a
/// margin): no Redis key of the rules is left, and each algorithm's rules
/// admit their whole quota again (first through the breaker and the deny
/// cache that saw the faults).
async fn no_lockout(source: Connections) {
    let rig = Arc::new(Rig::start(source, 2, TIMEOUT).await);
    let pairs: Vec<Arc<Pair>> = RULE_ALGOS
        .iter()
        .map(|&algo| {
            let (limits, block) = if algo == Algo::Concurrency {
                (("2/1s", "1/1s"), "")
            } else {
                (("4/1s", "2/1s"), "block = \"1s\"\n")
            };
            Arc::new(Pair::new(&rig, algo, "lockout-", limits, block, |rules| {
                rules.with_fail_mode(FailMode::Closed)
            }))
        })
        .collect();
    let targets = pairs
        .iter()
        .flat_map(|p| {
            p.redis_keys(&rig, LOCKOUT_CLIENTS)
                .into_iter()
                .map(move |k| (p.algo, k))
        })
        .collect();
    let seed = seed(source, "no-lockout");
    let deadline = Instant::now() + STORM;
    let mut jobs = JoinSet::new();
    for (i, pair) in pairs.iter().enumerate() {
        for (j, rules) in [pair.a.clone(), pair.b.clone()].into_iter().enumerate() {
            let algo = pair.algo;
            let mut rng = Rng::new(seed.wrapping_add(4 * i as u64 + j as u64 + 1));
            jobs.spawn(async move {
                while Instant::now() < deadline {
                    let c = rng.below(LOCKOUT_CLIENTS as u64);
                    let status = pick_status(algo, &mut rng, 2);
                    if let Ok(admission) = check(&rules, "/", &format!("c{c}"), 1).await {
                        if admission.allowed() {
                            tokio::time::sleep(millis(&mut rng, 0, 40)).await;
                        }
                        drop(admission.settle(Some(status)));
                    }
                    tokio::time::sleep(millis(&mut rng, 2, 15)).await;
                }
            });
        }
    }
    let faults = tokio::spawn(fault_schedule(Arc::clone(&rig), targets, seed, deadline));
    join_all(jobs, "a checker panicked").await;
    let schedule = faults.await.unwrap();
    let fired = rig.faults();
    end_faults(&rig).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut failures = Vec::new();
    // Every Redis (each node of a cluster), straight, not through a proxy.
    for proxy in rig.all_proxies() {
        let url = format!("redis://127.0.0.1:{}", proxy.upstream_port());
        let mut conn = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*lockout-*")
            .query_async(&mut conn)
            .await
            .unwrap();
        for key in keys {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            failures.push(format!(
                "{key} is still there 3 s after the faults ended (PTTL {ttl} ms)"
            ));
        }
    }
    for pair in &pairs {
        let algo = pair.algo;
        let (a, b) = (&pair.a, &pair.b);
        // The client rule's quota for c0 and c1, through A then B, fills
        // the global quota; then c2 is denied by it, and c0 by both. All
        // within one fixed window of the rules' 1 s: a script across a
        // boundary would find the counts started again (on a loaded
        // machine, 1 in 10 or so did).
        away_from_a_boundary(Duration::from_secs(1), Duration::from_millis(600)).await;
        let mut seen = Vec::new();
        let mut held = Vec::new();
        let script: &[(&Rules, &str, bool)] = if algo == Algo::Concurrency {
            &[
                (a, "c0", true),
                (b, "c1", true),
                (a, "c2", false),
                (b, "c0", false),
            ]
        } else {
            &[
                (a, "c0", true),
                (a, "c0", true),
                (b, "c1", true),
                (b, "c1", true),
                (a, "c2", false),
                (b, "c0", false),
            ]
        };
        for &(rules, client, expected) in script {
            let outcome = check(rules, "/", client, 1).await;
            let admitted = matches!(&outcome, Ok(a) if a.allowed());
            seen.push(match &outcome {
                Ok(a) if a.allowed() => format!("{client}: admitted"),
                Ok(_) => format!("{client}: denied"),
                Err(e) => format!("{client}: error ({e})"),
            });
            if admitted != expected || outcome.is_err() {
                failures.push(format!(
                    "{algo:?}: after the faults ended, {seen:?} (expected {})",
                    if expected { "admitted" } else { "denied" }
                ));
                break;
            }
            if let Ok(admission) = outcome {
                held.push(admission);
            }
        }
    }
    assert!(
        fired >= 5,
        "{source:?}: too few faults fired to mean anything ({fired}; seed {seed:#x})"
    );
    assert!(
        failures.is_empty(),
        "{source:?}, seed {seed:#x}, {fired} faults fired (schedule {schedule:?}):\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// Invariant 4: refused connections.

/// One rule per algorithm (`refused-{tag}`), all matching every request,
/// [`MAX`] per window (concurrency: in flight), the counting ones
/// refunding 5xx answers.
fn refused_rules() -> String {
    RULE_ALGOS
        .iter()
        .map(|&algo| {
            format!(
                "[[rules]]\nname = \"refused-{}\"\nkey = \"global\"\n{}",
                algo.tag(),
                counted(algo, &format!("{MAX}/10m"))
            )
        })
        .collect()
}

/// What each rule is to have left: what B spent before (2 units; a
/// concurrency slot).
fn expected_left(algo: Algo) -> u64 {
    if algo == Algo::Concurrency {
        MAX - 1
    } else {
        MAX - 2
    }
}

/// Every rule's units left for `key`, through B, compared with
/// [`expected_left`]: the failures.
async fn unchanged(b: &Rules, key: &str, case: &str) -> Vec<String> {
    let mut failures = Vec::new();
    for algo in RULE_ALGOS {
        let rule = format!("refused-{}", algo.tag());
        match left(b, &rule, key).await {
            Ok(n) if n == expected_left(algo) => {}
            Ok(n) => failures.push(format!(
                "{case}: {rule} has {n} left, expected {} (counted, or given back, for nothing)",
                expected_left(algo)
            )),
            Err(e) => failures.push(format!("{case}: {e}")),
        }
    }
    failures
}

/// Arm, on every proxy, a harmless one-shot stall on any refund or reward:
/// the sentinels, which must not fire. Returns how many are armed in all.
/// (Not on `ZREM`: a failed sliding-log or concurrency check takes its own
/// entries back out, retrying in the background until the store answers,
/// which removes nothing that was not its own.)
fn arm_give_back_sentinels(rig: &Rig) -> usize {
    let tick = Duration::from_millis(1);
    for proxy in rig.all_proxies() {
        proxy.stall_next_request(Match::command("EVALSHA").arg_is("refund"), tick);
        proxy.stall_next_request(Match::command("EVALSHA").arg_is("reward"), tick);
    }
    armed(rig)
}

fn refuse_all(rig: &Rig) {
    for proxy in rig.all_proxies() {
        proxy.refuse();
    }
}

fn accept_all(rig: &Rig) {
    for proxy in rig.all_proxies() {
        proxy.accept();
    }
}

/// How many one-shot faults are armed on every proxy.
fn armed(rig: &Rig) -> usize {
    rig.all_proxies().iter().map(|p| p.armed()).sum()
}

/// A router answering 500 behind `rules`, after ending the outage (every
/// store answering again) and arming [`arm_give_back_sentinels`]: the
/// response is settled with the store back.
fn reopening_app(rules: Rules, rig: Arc<Rig>) -> Router {
    Router::new()
        .fallback(move |_: Request<Body>| {
            let rig = Arc::clone(&rig);
            async move {
                steady(&rig).await;
                arm_give_back_sentinels(&rig);
                StatusCode::INTERNAL_SERVER_ERROR
            }
        })
        .layer(RulesLayer::new(rules))
}

/// Whether `outcome` is what `open` (else `Closed`) answers while every
/// connection is refused: an admission with no rule deciding, or an error.
fn refused_outcome(open: bool, outcome: &Result<Admission, LimitError>) -> Result<(), String> {
    match (open, outcome) {
        (true, Ok(admission)) => {
            let decided: Vec<&str> = admission
                .decisions()
                .filter(|(_, d)| d.is_some())
                .map(|(rule, _)| rule)
                .collect();
            if admission.allowed() && decided.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "admitted {}, decided by {decided:?} through a closed port",
                    admission.allowed()
                ))
            }
        }
        (false, Err(_)) => Ok(()),
        (true, Err(e)) => Err(format!("failed ({e}) instead of admitting")),
        (false, Ok(a)) => Err(format!(
            "answered (admitted {}) instead of failing",
            a.allowed()
        )),
    }
}

/// B (process 2, unfaulted) spends 2 units of every rule (holding the
/// concurrency slot); then, with every connection of A refused, A's
/// requests through the engine and through the layer: under Open admitted,
/// with no decision, and settled as 500 once the store answers A again,
/// with no refund or reward sent; under Closed an error (503); and every
/// rule's count is what B left. On a cluster, then one node refuses: under
/// Closed the request fails and the rules on the other nodes are given
/// back; under Open it is admitted, and a 500 refunds those rules only.
async fn refused(source: Connections) {
    away_from_a_boundary(LONG, Duration::from_secs(15)).await;
    let rig = Arc::new(Rig::start(source, 2, TIMEOUT).await);
    let text = refused_rules();
    let b = bare(rig.store(1), &text, FailMode::Open);
    let key = "k";
    let spent = check(&b, "/", key, 2).await.unwrap();
    assert!(spent.allowed(), "{source:?}: B's check was denied");
    let mut failures = unchanged(&b, key, "B's check").await;
    for mode in [FailMode::Open, FailMode::Closed] {
        let open = matches!(mode, FailMode::Open);
        // A with its defaults (circuit breaker, deny cache), fresh each time.
        let a = || {
            Rules::new(rig.store(0).clone(), RuleSet::from_toml(&text).unwrap())
                .with_fail_mode(mode.clone())
        };

        // Through the engine.
        let case = format!("{mode:?}, engine");
        rig.reset().await;
        refuse_all(&rig);
        let outcome = check(&a(), "/", key, 1).await;
        // Every store answering again (on a cluster, the refusal cut B's
        // connections too).
        steady(&rig).await;
        let sentinels = arm_give_back_sentinels(&rig);
        if let Err(e) = refused_outcome(open, &outcome) {
            failures.push(format!("{case}: {e}"));
        }
        if let Ok(admission) = outcome {
            let permits = admission.settle(Some(500));
            if !permits.is_empty() {
                failures.push(format!("{case}: {} slots held", permits.len()));
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        if armed(&rig) != sentinels {
            failures.push(format!(
                "{case}: {} refunds or rewards sent for a request nothing counted",
                sentinels - armed(&rig)
            ));
        }
        failures.extend(unchanged(&b, key, &case).await);

        // Through the layer (the app ends the outage before answering).
        let case = format!("{mode:?}, layer");
        rig.reset().await;
        refuse_all(&rig);
        let app = reopening_app(a(), Arc::clone(&rig));
        let status = app.oneshot(http_request(0, 500, 0)).await.unwrap().status();
        let expected = if open {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            steady(&rig).await;
            StatusCode::SERVICE_UNAVAILABLE
        };
        if status != expected {
            failures.push(format!("{case}: answered {status}, expected {expected}"));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sentinels = if open { 2 * rig.all_proxies().len() } else { 0 };
        if armed(&rig) != sentinels {
            failures.push(format!(
                "{case}: {} refunds or rewards sent for a request nothing counted",
                sentinels.saturating_sub(armed(&rig))
            ));
        }
        failures.extend(unchanged(&b, key, &case).await);
    }
    if source.is_cluster() {
        failures.extend(one_node_refuses(&rig, &text, &b, key).await);
    }
    drop(spent);
    assert!(
        failures.is_empty(),
        "{source:?}:\n  {}",
        failures.join("\n  ")
    );
}

/// On a cluster, the node of one rule's key refuses connections.
async fn one_node_refuses(rig: &Rig, text: &str, b: &Rules, key: &str) -> Vec<String> {
    let mut failures = Vec::new();
    let keys: Vec<(Algo, String)> = RULE_ALGOS
        .iter()
        .map(|&algo| {
            let rule = format!("refused-{}", algo.tag());
            (algo, redis_key(b, rig.store(0), &rule, algo, key))
        })
        .collect();
    // The node of the first rule whose key is not on every rule's node.
    let port = |k: &str| rig.proxy(0, k).port();
    let Some((_, down_key)) = keys
        .iter()
        .find(|(_, k)| keys.iter().any(|(_, other)| port(other) != port(k)))
    else {
        return vec!["every rule's key is on one node".to_owned()];
    };
    let down = rig.proxy(0, down_key);
    // Every rule whose key is on that node: (rule, Redis key).
    let on_down: Vec<(String, &str)> = keys
        .iter()
        .filter(|(_, k)| port(k) == down.port())
        .map(|(a, k)| (format!("refused-{}", a.tag()), k.as_str()))
        .collect();
    let names: Vec<&str> = on_down.iter().map(|(r, _)| r.as_str()).collect();

    // Closed: the request fails, and what the rules on the other nodes
    // took is given back before the error is returned.
    let case = format!("Closed, the node of {names:?} refusing");
    rig.reset().await;
    let a = bare(rig.store(0), text, FailMode::Closed);
    down.refuse();
    let outcome = check(&a, "/", key, 1).await;
    down.accept();
    steady(rig).await;
    if let Ok(admission) = &outcome {
        failures.push(format!(
            "{case}: the request was answered (admitted {}), not failed",
            admission.allowed()
        ));
    }
    drop(outcome);
    failures.extend(unchanged(b, key, &case).await);

    // Open: admitted; settled as 500 once the node answers again, the
    // rules that counted are refunded, the fail-open ones are not.
    let case = format!("Open, the node of {names:?} refusing");
    rig.reset().await;
    let a = bare(rig.store(0), text, FailMode::Open);
    down.refuse();
    let outcome = check(&a, "/", key, 1).await;
    down.accept();
    steady(rig).await;
    let tick = Duration::from_millis(1);
    for (_, k) in &on_down {
        for give_back in ["refund", "reward"] {
            down.stall_next_request(Match::command("EVALSHA").arg(k).arg_is(give_back), tick);
        }
    }
    let sentinels = down.armed();
    match outcome {
        Ok(admission) if admission.allowed() => {
            for (rule, decision) in admission.decisions() {
                if names.contains(&rule) != decision.is_none() {
                    failures.push(format!(
                        "{case}: {rule} decided {:?}",
                        decision.map(|d| d.allowed())
                    ));
                }
            }
            drop(admission.settle(Some(500)));
        }
        other => failures.push(format!("{case}: {other:?}, expected an admission")),
    }
    // The refunds of the rules that counted run in tasks: wait for them.
    let waited = Instant::now();
    let mut now = unchanged(b, key, &case).await;
    while !now.is_empty() && waited.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        now = unchanged(b, key, &case).await;
    }
    failures.extend(now);
    if down.armed() != sentinels {
        failures.push(format!(
            "{case}: a refund or reward was sent for a fail-open admission"
        ));
    }
    down.heal();
    failures
}

// ---------------------------------------------------------------------------
// The circuit breaker's probe, shared by the rules of one request.

/// Redis refuses connections long enough to open the circuit breaker that
/// a rule set's rules share (one failure, cooldown 200 ms), then accepts
/// again; once the cooldown passed, the next request, checked against two
/// rules, is decided by the store for both: not failed (`Closed`) nor
/// admitted unchecked by one rule (`Open`) because the breaker let the
/// other rule's check through as its probe and held this one back.
async fn probe_after_outage(source: Connections) {
    let rig = Rig::start(source, 1, TIMEOUT).await;
    let text = "[[rules]]\nname = \"global\"\nkey = \"global\"\npolicy = \"100/10m\"\n\
                [[rules]]\nname = \"client\"\nkey = \"header:x-client\"\npolicy = \"100/10m\"\n";
    let mut failures = Vec::new();
    for mode in [FailMode::Closed, FailMode::Open] {
        let rules = Rules::new(rig.store(0).clone(), RuleSet::from_toml(text).unwrap())
            .with_fail_mode(mode.clone())
            .with_circuit_breaker(CircuitBreaker::new(1, Duration::from_millis(200)));
        let decided = |outcome: &Result<Admission, LimitError>| match outcome {
            Ok(a) => a.allowed() && a.decisions().all(|(_, d)| d.is_some()),
            Err(_) => false,
        };
        let show = |outcome: &Result<Admission, LimitError>| match outcome {
            Ok(a) => format!(
                "admitted {}, decided by {:?}",
                a.allowed(),
                a.decisions()
                    .filter(|(_, d)| d.is_some())
                    .map(|(r, _)| r)
                    .collect::<Vec<_>>()
            ),
            Err(e) => format!("error ({e})"),
        };
        let before = check(&rules, "/", "c0", 1).await;
        assert!(
            decided(&before),
            "{mode:?}: before the outage: {}",
            show(&before)
        );
        refuse_all(&rig);
        let during = check(&rules, "/", "c0", 1).await;
        accept_all(&rig);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let after = check(&rules, "/", "c0", 1).await;
        if !decided(&after) {
            failures.push(format!(
                "{mode:?}: during the outage {}; the first request after it (Redis answering, \
                 the cooldown over): {}",
                show(&during),
                show(&after)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{source:?}:\n  {}",
        failures.join("\n  ")
    );
}

/// The breaker is the engine's, whatever the source: one source suffices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_after_an_outage_is_decided_by_the_store() {
    probe_after_outage(Connections::Pool).await;
}

// ---------------------------------------------------------------------------
// The matrix.

/// For each source, a module with one test per scenario (a scenario takes
/// the source).
macro_rules! sources {
    ($($(#[$attr:meta])* $name:ident: $source:expr => [$($test:ident = $scenario:path),+ $(,)?]),+ $(,)?) => {
        $(
            $(#[$attr])*
            mod $name {
                use super::*;

                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        $scenario($source).await;
                    }
                )+
            }
        )+
    };
}

sources! {
    pool: Connections::Pool => [
        never_over = crate::rules_faults::never_over,
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
        no_lockout_after_faults = crate::rules_faults::no_lockout,
        refused_connections_count_nothing = crate::rules_faults::refused,
    ],
    bb8: Connections::Bb8 => [
        never_over = crate::rules_faults::never_over,
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
        no_lockout_after_faults = crate::rules_faults::no_lockout,
        refused_connections_count_nothing = crate::rules_faults::refused,
    ],
    manager: Connections::Manager => [
        never_over = crate::rules_faults::never_over,
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
        no_lockout_after_faults = crate::rules_faults::no_lockout,
        refused_connections_count_nothing = crate::rules_faults::refused,
    ],
    manager_no_retries: Connections::ManagerNoRetries => [
        never_over = crate::rules_faults::never_over,
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
        no_lockout_after_faults = crate::rules_faults::no_lockout,
        refused_connections_count_nothing = crate::rules_faults::refused,
    ],
    #[cfg(feature = "cluster")]
    cluster: Connections::Cluster => [
        never_over = crate::rules_faults::never_over,
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
        no_lockout_after_faults = crate::rules_faults::no_lockout,
        refused_connections_count_nothing = crate::rules_faults::refused,
    ],
    // The workaround `connect_cluster`'s rustdoc gives for lost replies.
    #[cfg(feature = "cluster")]
    cluster_no_retries: Connections::ClusterNoRetries => [
        a_lost_refund_gives_back_at_most_once = crate::rules_faults::lost_refunds,
    ],
}
