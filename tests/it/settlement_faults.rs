//! Costs settled after the response ([`Reservation::settle`]) under network
//! faults, through the fault-injecting proxy of `tests/support/proxy.rs`,
//! for every algorithm that settles (both sliding-log executions, the
//! fixed window, the sliding window counter, GCRA) and every connection
//! source: `connect` (the tracked pool), `from_pool` (bb8-redis),
//! `from_connection_manager` with redis-rs's default retries and without,
//! and `connect_cluster` (a client of `.retries(0)`, as the fault tests'
//! `ClusterNoRetries` builds one):
//!
//! 1. a settle whose reply is lost after Redis ran it (dropped with the
//!    connection closed or hung, cut mid-way, or held beyond the store
//!    timeout) answers an error within the store timeout, and the key,
//!    read through a second store once the fault is over, shows the
//!    difference applied exactly once: charged once (a penalty), given
//!    back once (a refund or a reward), never twice;
//! 2. a settle whose request reaches Redis only after the client timed out
//!    answers an error within the store timeout, and counts at most once
//!    once the stall is over;
//! 3. a settle while Redis refuses connections fails at once (a
//!    ConnectionManager with redis-rs's default retries waits for them,
//!    within the store timeout, as its rustdoc says) and applies nothing:
//!    the estimate stands.
//!
//! And once over HTTP: a layer settling from a header answers at once
//! while its settle stalls, and counts the settle `failed` in
//! `ratelimit_settlements_total`.
//!
//! [`Reservation::settle`]: tower_redis_ratelimit::limiter::Reservation::settle
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use tower_redis_ratelimit::limiter::{Reservation, Settled};
use tower_redis_ratelimit::{Limiter, Policy, RedisStore, StoreError};

use crate::support::faults::{Algo, Connections, Loss, Rig, each_algorithm};
use crate::support::harness::away_from_a_boundary;
use crate::support::proxy::Match;

/// The store timeout.
const TIMEOUT: Duration = Duration::from_millis(300);
/// Every policy allows 1,000 units a day: nothing refills during a test
/// (GCRA refills a unit every 86.4 s, and a key made during the test
/// gains its first one only that long after), and the window counters'
/// counts stay in one window.
const MAX: u64 = 1000;
const WINDOW: Duration = Duration::from_secs(86_400);
/// Units another process took from the key before the reservation (so a
/// give-back applied twice shows, not floored at an empty state).
const TAKEN: u64 = 200;
/// The reservation's estimate.
const ESTIMATE: u64 = 100;

/// Which way a settle moves the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// The real cost is above the estimate: a penalty charges the excess.
    Up,
    /// Below: a refund (the sliding log: that check's entries) or a reward
    /// (the counters, GCRA) gives the rest back.
    Down,
}

impl Way {
    const BOTH: [Self; 2] = [Self::Up, Self::Down];

    /// The real cost settled.
    fn cost(self) -> u64 {
        match self {
            Self::Up => ESTIMATE + 30,
            Self::Down => ESTIMATE - 60,
        }
    }

    /// The units the key has used after the settle ran `times` times.
    fn used_after(self, times: u64) -> u64 {
        let before = TAKEN + ESTIMATE;
        match self {
            Self::Up => before + times * (self.cost() - ESTIMATE),
            Self::Down => before.saturating_sub(times * (ESTIMATE - self.cost())),
        }
    }

    /// The name of the settle's command among the command script's
    /// arguments (`ARGV[1]`), for `reservation`: a penalty, or a refund when
    /// its decision names the entries it counted, else a reward.
    fn command(self, reservation: &Reservation) -> &'static str {
        let refund_id = reservation
            .verdict()
            .decision()
            .and_then(|decision| decision.refund_id());
        match (self, refund_id) {
            (Self::Up, _) => "penalty",
            (Self::Down, Some(_)) => "refund",
            (Self::Down, None) => "reward",
        }
    }
}

/// What befalls a settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Its reply is lost this way.
    Lost(Loss),
    /// Every proxy refuses connections (and cuts the open ones).
    Refused,
}

impl Fault {
    const ALL: [Self; 6] = [
        Self::Lost(Loss::DropClose),
        Self::Lost(Loss::DropHang),
        Self::Lost(Loss::Cut),
        Self::Lost(Loss::Stalled),
        Self::Lost(Loss::Late),
        Self::Refused,
    ];

    /// The key of a case: ASCII, no braces (stored as given).
    fn key(self, way: Way) -> String {
        match self {
            Self::Lost(loss) => format!("{way:?}-{loss:?}"),
            Self::Refused => format!("{way:?}-Refused"),
        }
    }

    /// How many times the settle may have run in Redis, when the fault
    /// fired: a reply lost after Redis ran the request, once; a request
    /// held past the timeout, once or never (the client may have closed
    /// its connection meanwhile); a refused connection, never.
    fn runs(self) -> &'static [u64] {
        match self {
            Self::Lost(Loss::Late) => &[0, 1],
            Self::Lost(_) => &[1],
            Self::Refused => &[0],
        }
    }
}

/// A limiter of `policy` on `store`, named after the algorithm.
fn limiter(store: &RedisStore, policy: &Policy, algo: Algo) -> Limiter {
    Limiter::new(store.clone(), policy.clone()).with_name(format!("tokens-{algo:?}"))
}

/// The scripts sent through every proxy of `rig` so far.
fn evalsha(rig: &Rig) -> u64 {
    rig.all_proxies()
        .iter()
        .map(|p| p.commands("EVALSHA"))
        .sum()
}

/// The units `key` has used, peeked through `limiter`.
async fn used(limiter: &Limiter, key: &str) -> Result<u64, String> {
    let peek = limiter
        .peek(key)
        .await
        .map_err(|e| format!("the other store's peek failed: {e}"))?;
    if !peek.allowed() {
        return Err(format!("the other store's peek is a denial: {peek:?}"));
    }
    Ok(MAX - peek.remaining() - limiter.policy().cost())
}

fn show(outcome: &Result<Settled, StoreError>) -> String {
    match outcome {
        Ok(settled) => format!("Ok({settled:?})"),
        Err(e) => format!("Err({e})"),
    }
}

/// Store A reserves [`ESTIMATE`] of a key store B took [`TAKEN`] of, then
/// settles it `way` under `fault`; once the fault is over, B reads the
/// key.
async fn settle_under(
    rig: &Rig,
    algo: Algo,
    policy: &Policy,
    way: Way,
    fault: Fault,
) -> Result<(), String> {
    let (a, b) = (
        limiter(rig.store(0), policy, algo),
        limiter(rig.store(1), policy, algo),
    );
    let key = fault.key(way);
    let taken = b.reserve(&key, TAKEN).await.unwrap();
    assert_eq!(taken.settle(TAKEN).await.unwrap(), Settled::AsEstimated);
    let reservation = a.reserve(&key, ESTIMATE).await.unwrap();
    assert!(reservation.allowed() && reservation.estimate() == ESTIMATE);
    // B's peek also loads the command script into Redis (the node), so A's
    // settle runs at its first send: the reply lost is its result, not a
    // `NOSCRIPT` of a request Redis did not run.
    let before = used(&b, &key).await?;
    if before != way.used_after(0) {
        return Err(format!(
            "the key starts at {before} used, not {}",
            way.used_after(0)
        ));
    }

    let redis_key = rig
        .store(0)
        .redis_key(algo.tag(), &format!("{}:{key}", a.name()));
    let proxy = rig.proxy(0, &redis_key);
    let target = Match::command("EVALSHA")
        .arg(&redis_key)
        .arg_is(way.command(&reservation));
    let sent = match fault {
        Fault::Lost(loss) => {
            loss.arm(proxy, target, TIMEOUT);
            None
        }
        Fault::Refused => {
            for proxy in rig.all_proxies() {
                proxy.refuse();
            }
            Some(evalsha(rig))
        }
    };
    let started = Instant::now();
    let outcome = reservation.settle(way.cost()).await;
    let took = started.elapsed();
    let case = format!(
        "A's settle at {}: {} after {took:?}",
        way.cost(),
        show(&outcome)
    );
    let reached_redis = match sent {
        None => proxy.armed() == 0,
        Some(before) => {
            let reached = evalsha(rig) != before;
            for proxy in rig.all_proxies() {
                proxy.accept();
            }
            reached
        }
    };
    match fault {
        Fault::Lost(_) if !reached_redis => return Err(format!("{case}: the fault never fired")),
        Fault::Refused if reached_redis => {
            return Err(format!("{case}: sent through a closed port"));
        }
        _ => {}
    }
    // When the answer came, by what it means rather than by a margin over
    // the timeout (a loaded machine answered 549 ms after a 300 ms timeout):
    // a reply lost in silence is answered from the timeout path, once one
    // timeout has passed and before a second would end (the settle was not
    // sent again, to wait out another); a refused connection without
    // waiting out the timeout, except where redis-rs's default retries wait
    // for a connection (its rustdoc), within one timeout and before a
    // second would end too.
    let timed_out = matches!(outcome, Err(StoreError::Timeout(_)));
    let when = match fault {
        Fault::Refused if rig.source != Connections::Manager => {
            (!timed_out && took < TIMEOUT).then_some(())
        }
        Fault::Lost(loss) if !loss.fails_the_connection() => {
            (timed_out && took >= TIMEOUT && took < 2 * TIMEOUT).then_some(())
        }
        _ => (took < 2 * TIMEOUT).then_some(()),
    };
    if when.is_none() {
        return Err(format!(
            "{case}: not when a store timeout of {TIMEOUT:?} answers it"
        ));
    }
    // Lost before A heard: the settle cannot know it ran.
    if outcome.is_ok() {
        return Err(format!("{case}: answered through a lost reply"));
    }

    // The fault over: a held request or reply delivered, connections
    // accepted and answering again.
    if matches!(fault, Fault::Lost(Loss::Stalled | Loss::Late)) {
        let held = TIMEOUT + Duration::from_millis(200);
        tokio::time::sleep_until((started + held + Duration::from_millis(100)).into()).await;
    }
    if fault == Fault::Refused {
        rig.reset().await;
    }
    let after = used(&b, &key).await.map_err(|e| format!("{case}; {e}"))?;
    let times = (0..=2).find(|&times| way.used_after(times) == after);
    if times.is_some_and(|times| fault.runs().contains(&times)) {
        return Ok(());
    }
    Err(format!(
        "{case}; then B reads {after} used: {}, expected {}",
        match times {
            Some(0) => "the settle was not applied".to_owned(),
            Some(1) => "the settle was applied".to_owned(),
            Some(_) => "the settle was applied TWICE".to_owned(),
            None => format!(
                "neither none ({}), once ({}) nor twice ({})",
                way.used_after(0),
                way.used_after(1),
                way.used_after(2)
            ),
        },
        fault
            .runs()
            .iter()
            .map(|&n| format!(
                "{} ({} used)",
                if n == 0 { "none" } else { "once" },
                way.used_after(n)
            ))
            .collect::<Vec<_>>()
            .join(" or ")
    ))
}

/// [`settle_under`] each fault, both ways, on a rig of two stores. A
/// concurrency limit settles nothing: its reservation is refused before
/// anything is sent.
async fn settles(rig: Rig, algo: Algo) {
    if algo == Algo::Concurrency {
        let policy = algo.policy(MAX, WINDOW);
        let sent = evalsha(&rig);
        let refused = limiter(rig.store(0), &policy, algo)
            .reserve("k", ESTIMATE)
            .await;
        assert!(refused.is_err(), "a concurrency reservation: {refused:?}");
        assert_eq!(evalsha(&rig), sent, "sent for a concurrency limit");
        return;
    }
    away_from_a_boundary(WINDOW, Duration::from_secs(30)).await;
    let policy = algo.policy(MAX, WINDOW);
    let mut failures = Vec::new();
    for fault in Fault::ALL {
        for way in Way::BOTH {
            rig.reset().await;
            if let Err(failure) = settle_under(&rig, algo, &policy, way, fault).await {
                failures.push(format!("{way:?}, {fault:?}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

mod a_settle_counts_at_most_once {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pool() {
        each_algorithm(Connections::Pool, 2, TIMEOUT, settles).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bb8() {
        each_algorithm(Connections::Bb8, 2, TIMEOUT, settles).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn manager() {
        each_algorithm(Connections::Manager, 2, TIMEOUT, settles).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn manager_no_retries() {
        each_algorithm(Connections::ManagerNoRetries, 2, TIMEOUT, settles).await;
    }

    #[cfg(feature = "cluster")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster() {
        each_algorithm(Connections::Cluster, 2, TIMEOUT, settles).await;
    }
}

// ---------------------------------------------------------------------------
// Over HTTP.

/// The header the handler reports its cost in.
#[cfg(feature = "metrics")]
const USAGE: http::HeaderName = http::HeaderName::from_static("x-usage-tokens");

/// The counts of `ratelimit_settlements_total` of one rule, by result,
/// from a [`DebuggingRecorder`](metrics_util::debugging::DebuggingRecorder)
/// (whose snapshots take the counts they show).
#[cfg(feature = "metrics")]
struct Settlements {
    snapshotter: metrics_util::debugging::Snapshotter,
    rule: &'static str,
    counts: std::collections::HashMap<String, u64>,
}

#[cfg(feature = "metrics")]
impl Settlements {
    /// The settlements of `rule` counted with `result` so far.
    fn count(&mut self, result: &str) -> u64 {
        use metrics_util::debugging::DebugValue;
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let label = |name: &str| {
                key.labels()
                    .find(|label| label.key() == name)
                    .map(|label| label.value().to_owned())
            };
            if key.name() != "ratelimit_settlements_total"
                || label("rule").as_deref() != Some(self.rule)
            {
                continue;
            }
            if let (Some(result), DebugValue::Counter(n)) = (label("result"), value) {
                *self.counts.entry(result).or_default() += n;
            }
        }
        self.counts.get(result).copied().unwrap_or(0)
    }

    /// Wait until `result` has been counted `n` times, at most `within`.
    async fn reach(&mut self, result: &str, n: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while self.count(result) < n {
            assert!(
                Instant::now() < deadline,
                "{} settlements counted {result} after {within:?}, expected {n}: {:?}",
                self.count(result),
                self.counts
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A layer settling from the header `x-usage-tokens` (GCRA, estimate
/// 100, a store timeout of 1 s), whose handler reports 130: while the
/// proxy holds the settle's reply past the store timeout, the response
/// comes back at once (the settle runs in a task); the settle fails after
/// the store timeout and is counted `failed`; once the reply is through,
/// the penalty Redis ran counts once. An unfaulted request is then
/// counted `charged`.
///
/// A current-thread runtime: the settle's task runs on the test's thread,
/// where the recorder is set.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_layer_answers_at_once_while_its_settle_stalls_and_counts_it_failed() {
    use axum::Router;
    use axum::body::Body;
    use axum::routing::get;
    use http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_redis_ratelimit::response::Settlement;
    use tower_redis_ratelimit::{RateLimitLayer, key};

    const STORE_TIMEOUT: Duration = Duration::from_secs(1);
    const RULE: &str = "tokens-http";
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let mut settlements = Settlements {
        snapshotter: recorder.snapshotter(),
        rule: RULE,
        counts: std::collections::HashMap::new(),
    };
    let _recorder = metrics::set_default_local_recorder(&recorder);

    away_from_a_boundary(WINDOW, Duration::from_secs(30)).await;
    let rig = Rig::start(Connections::Pool, 2, STORE_TIMEOUT).await;
    let policy = Algo::Gcra.policy(MAX, WINDOW).with_cost(ESTIMATE).unwrap();
    let [a, b] = [0, 1].map(|i| Limiter::new(rig.store(i).clone(), policy.clone()).with_name(RULE));
    let layer = RateLimitLayer::from_limiter(a, key::global())
        .with_settlement(Settlement::new().from_header(USAGE))
        .unwrap();
    let cost = Way::Up.cost();
    let app = Router::new()
        .route(
            "/",
            get(move || async move { ([(USAGE, cost.to_string())], "answer") }),
        )
        .layer(layer);
    let request = || async {
        let started = Instant::now();
        let response = app
            .clone()
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        response.into_body().collect().await.unwrap();
        started.elapsed()
    };

    // Nothing used yet (and the command script loaded: the settle's
    // request runs at once, it meets no `NOSCRIPT`).
    assert_eq!(used(&b, "global").await.unwrap(), 0);
    let redis_key = rig
        .store(0)
        .redis_key(Algo::Gcra.tag(), &format!("{RULE}:global"));
    let proxy = rig.proxy(0, &redis_key);
    Loss::Stalled.arm(
        proxy,
        Match::command("EVALSHA").arg(&redis_key).arg_is("penalty"),
        STORE_TIMEOUT,
    );
    let started = Instant::now();
    let took = request().await;
    // Had it waited for the settle, it would have waited out the store
    // timeout.
    assert!(
        took < STORE_TIMEOUT,
        "the response waited {took:?} for a settle held past the store timeout ({STORE_TIMEOUT:?})"
    );
    // Failed by the store timeout, before a second one would end.
    settlements.reach("failed", 1, 2 * STORE_TIMEOUT).await;
    let failed_after = started.elapsed();
    assert_eq!(proxy.armed(), 0, "the settle's reply was never held");
    assert!(
        failed_after >= STORE_TIMEOUT,
        "the settle failed after {failed_after:?}, before the store timeout"
    );
    assert_eq!(settlements.count("charged"), 0);

    // The held reply delivered: Redis ran the penalty once.
    let held = STORE_TIMEOUT + Duration::from_millis(200);
    tokio::time::sleep_until((started + held + Duration::from_millis(100)).into()).await;
    assert_eq!(
        used(&b, "global").await.unwrap(),
        Way::Up.used_after(1) - TAKEN
    );

    // No fault: charged.
    rig.reset().await;
    request().await;
    // By then charged, or else failed by the store timeout.
    settlements.reach("charged", 1, 2 * STORE_TIMEOUT).await;
    assert_eq!(settlements.count("failed"), 1);
    assert_eq!(
        used(&b, "global").await.unwrap(),
        2 * (Way::Up.used_after(1) - TAKEN)
    );
}
