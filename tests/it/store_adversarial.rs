//! Adversarial tests of RedisStore's fault handling (issue 12), each
//! against a real `redis-server`, through the fault proxy of
//! `tests/support/proxy.rs` where the network must misbehave:
//!
//! - `Transaction`: an entry written under a stale clock offset is dated
//!   outside its window until its restamp lands;
//! - the pool's connection attempt beside a slow checkout: abandoned, it
//!   stops refusals from being seen; with `from_pool`, slow checkouts open
//!   a connection each;
//! - the clean-up guard bound to a connection that is already closed;
//! - a denied `Transaction` check outlasting the store timeout;
//! - a local clock stepped back while the offset is measured;
//! - never over with cost 2 over two rates and with a min spacing, for
//!   both executions and three connection sources, under random faults;
//! - RESP3 replies.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::faults::{
    self, Connections, FaultSpans, SteppingClock, admitted, fault_seed, millis, panic_message,
    random_fault, show,
};
use crate::support::proxy::{AfterDrop, FaultProxy, Match};
use crate::support::{RedisServer, zcard};
use tower_redis_ratelimit::clock::{Clock, SystemClock};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Policy, RedisStore, Store, StoreError};

/// The store timeout of these tests.
const TIMEOUT: Duration = Duration::from_millis(250);

/// A check of every sliding-log execution: scripts loaded, offset measured.
async fn warm(store: &RedisStore) {
    let policies = [Execution::Transaction, Execution::Script].map(|execution| {
        "1000000/1s"
            .parse::<Policy>()
            .unwrap()
            .with_execution(execution)
            .unwrap()
    });
    faults::warm(store, policies).await;
}

// ---------------------------------------------------------------------------
// Transaction: an estimate behind Redis dates the entry outside its window
// until the restamp.

/// Store A's offset to Redis went stale by 3 s (its clock stepped back after
/// measuring, as in redis_store.rs's
/// `a_clock_stepped_after_measuring_changes_no_decision`; or Redis failed
/// over to a node whose clock is ahead). A's transaction is admitted on a
/// fresh key and its entry is written stamped `now + tolerance`, 3 s in
/// Redis's past: outside every window (and pruned by the next check) until
/// the `ZADD XX` restamp lands. The restamp is held 400 ms on its way, a
/// stall shorter than the window, so A's admission is returned. Store B,
/// correct clock, checks meanwhile: with `1/1s` it must be denied. The same
/// with a min spacing of 300 ms, an offset 500 ms stale and the restamp
/// held 150 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_dated_in_the_past_by_a_stale_offset_still_counts_before_its_restamp() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let clock = SteppingClock::new();
    let a = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2))
        .with_clock(clock.clone());
    let b = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    warm(&a).await;
    warm(&b).await;
    let mut failures = Vec::new();
    // (policy, how stale A's offset is, how long its restamp is held)
    let cases = [
        ("1/1s", Duration::from_secs(3), 400),
        // min_spacing: a smaller error suffices.
        ("100/1s", Duration::from_millis(500), 150),
    ];
    for (i, (text, stale, hold)) in cases.into_iter().enumerate() {
        let mut policy: Policy = text.parse().unwrap();
        if i == 1 {
            policy = policy.with_min_spacing(Duration::from_millis(300)).unwrap();
        }
        assert_eq!(policy.execution(), Execution::Transaction);
        let key = format!("k{i}");
        let redis_key = a.redis_key("log", &key);
        // A's offset is measured again whenever a transaction shows it off:
        // make it stale again for each case.
        clock.step(Duration::ZERO, true);
        warm(&a).await;
        clock.step(stale, false);
        // The restamp: a ZADD outside MULTI with XX (the keys have no "XX").
        proxy.stall_next_request(
            Match::command("ZADD").arg("XX"),
            Duration::from_millis(hold),
        );
        let first = {
            let (a, policy, key) = (a.clone(), policy.clone(), key.clone());
            tokio::spawn(async move { a.check(&key, &policy).await })
        };
        // B checks as soon as A's restamp is held: A's transaction ran.
        let waiting = Instant::now();
        while proxy.armed() != 0 && waiting.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let second = b.check(&key, &policy).await;
        let first = first.await.unwrap();
        assert_eq!(
            proxy.armed(),
            0,
            "{text}: A's restamp was not sent (A: {})",
            show(&first)
        );
        if admitted(&first) && admitted(&second) {
            failures.push(format!(
                "{text}{}: A's request (offset {stale:?} stale, restamp held {hold} ms) and B's, \
                 sent while A's restamp was held, both admitted; the log holds {} entries",
                if i == 1 { " + min spacing 300 ms" } else { "" },
                zcard(&server, &redis_key)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "A's entry was dated outside the window (spacing) until its restamp landed:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// Refused connections: the pool's one-at-a-time connection attempt.

/// How long a check may take to fail while Redis refuses connections (as
/// tests/network_faults.rs asks).
const AT_ONCE: Duration = Duration::from_millis(50);

/// A pooled store (`connect`) through `proxy`, checked once.
async fn pooled(proxy: &FaultProxy, policy: &Policy) -> RedisStore {
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(TIMEOUT);
    store.check("k", policy).await.unwrap();
    store
}

/// Refuse connections and time three checks of each store (each must
/// fail); the durations, per store.
async fn checks_while_refused(
    proxy: &FaultProxy,
    stores: &[&RedisStore],
    policy: &Policy,
) -> Vec<Vec<Duration>> {
    proxy.refuse();
    let mut took = Vec::new();
    for store in stores {
        let mut each = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let outcome = store.check("refused", policy).await;
            each.push(started.elapsed());
            assert!(
                outcome.is_err(),
                "admitted through a closed port: {}",
                show(&outcome)
            );
        }
        took.push(each);
    }
    took
}

/// The refused checks of [`checks_while_refused`] for the control (`took[0]`)
/// and the store (`took[1]`) all failed at once; `after`: what the store
/// went through before.
#[track_caller]
fn assert_refused_at_once(took: &[Vec<Duration>], after: &str) {
    assert!(
        took[0].iter().all(|&t| t < AT_ONCE),
        "control: refused checks took {:?}",
        took[0]
    );
    assert!(
        took[1].iter().all(|&t| t < AT_ONCE),
        "refused checks failed after {:?} (store timeout {TIMEOUT:?}), not at once \
         (< {AT_ONCE:?}; the control's: {:?}), once {after}",
        took[1],
        took[0]
    );
}

fn script_policy() -> Policy {
    "1000000/1s"
        .parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap()
}

/// The store's own connection attempt beside a slow pool checkout is
/// abandoned when the checkout wins the race (the pool's new connection
/// was ready first): nothing went wrong, the check succeeds. Afterwards,
/// while Redis refuses connections, its checks must still fail at once, as
/// those of a store (the control) that saw no such race do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_still_seen_after_a_connection_attempt_lost_the_race() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let policy = script_policy();
    let store = pooled(&proxy, &policy).await;
    let control = pooled(&proxy, &policy).await;
    // Every connection dies; the next check needs a new one. The pool's
    // (asked for first) is ready after 30 ms, the store's own attempt (5 ms
    // later) after 150 ms: the checkout wins.
    proxy.cut_all();
    let setup = || Match::command("CLIENT").arg("LIB-NAME");
    proxy.stall_next_reply(setup(), Duration::from_millis(30));
    proxy.stall_next_reply(setup(), Duration::from_millis(150));
    let outcome = store.check("k", &policy).await;
    assert!(admitted(&outcome), "after the cut: {}", show(&outcome));
    assert_eq!(proxy.armed(), 0, "two new connections were expected");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let took = checks_while_refused(&proxy, &[&control, &store], &policy).await;
    assert_refused_at_once(
        &took,
        "the store's connection attempt had lost the race to a pool checkout",
    );
}

/// As above, the attempt abandoned because its check timed out (the link
/// froze while the pool reconnected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_still_seen_after_a_connection_attempt_timed_out() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let policy = script_policy();
    let store = pooled(&proxy, &policy).await;
    let control = pooled(&proxy, &policy).await;
    proxy.cut_all();
    proxy.freeze(TIMEOUT + Duration::from_millis(200));
    let outcome = store.check("k", &policy).await;
    assert!(
        matches!(outcome, Err(StoreError::Timeout(_))),
        "during the freeze: {}",
        show(&outcome)
    );
    proxy.heal();
    let back = Instant::now();
    while store.check("k", &policy).await.is_err() {
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "the store never answered again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = checks_while_refused(&proxy, &[&control, &store], &policy).await;
    assert_refused_at_once(
        &took,
        "a check had timed out while the store opened a connection",
    );
}

// ---------------------------------------------------------------------------
// The clean-up guard: bound to a connection that is already dead.

/// `Transaction`, `1/min`: the client's only request reaches Redis (its
/// entry is written), the reply is lost and the connection closed; the
/// store retries, but the new connection takes longer than the store
/// timeout to open, so the check fails. The request's entry must be taken
/// back out (the store's own rule: an error takes the entries out): the
/// clean-up is bound to the first attempt's connection, closed, so its
/// `ZREM` can never be sent, and the client is locked out for the minute
/// by its own failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_retry_does_not_leave_the_first_attempts_entry_behind() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(TIMEOUT);
    let other = RedisStore::connect(&server.url()).await.unwrap();
    warm(&store).await;
    let policy: Policy = "1/min".parse().unwrap();
    assert_eq!(policy.execution(), Execution::Transaction);
    let redis_key = store.redis_key("log", "client");
    proxy.drop_next_reply(Match::command("EXEC").arg(&redis_key), AfterDrop::Close);
    // Both new connections (the pool's and the store's own attempt) hang in
    // their setup past the timeout.
    let setup = || Match::command("CLIENT").arg("LIB-NAME");
    proxy.stall_next_reply(setup(), TIMEOUT * 2);
    proxy.stall_next_reply(setup(), TIMEOUT * 2);
    let outcome = store.check("client", &policy).await;
    assert_eq!(
        proxy.stats().replies_dropped,
        1,
        "the reply was not dropped: {}",
        show(&outcome)
    );
    assert!(
        outcome.is_err(),
        "the retry was expected to fail: {}",
        show(&outcome)
    );
    proxy.heal();
    // Every clean-up has had time to run.
    tokio::time::sleep(TIMEOUT * 3).await;
    let entries = zcard(&server, &redis_key);
    let next = other.check("client", &policy).await;
    assert!(
        entries == 0 && admitted(&next),
        "after the check failed ({}), its entry is still in the log ({entries} entries) and \
         the client's next request is {}",
        show(&outcome),
        show(&next)
    );
}

/// `from_pool` with bb8's defaults (the docs ask to keep
/// `test_on_check_out(true)`: a `PING` per checkout), at most 2 connections.
/// Redis answers slowly for a while: each of 20 checks in a row finds its
/// checkout `PING` held 20 ms (a busy Redis, a long round trip). Nothing is
/// refused, so the store has no reason to open connections beyond the
/// pool's 2; it opened one per slow checkout, used it for one check and
/// closed it (under load, 300 tasks on a plain loopback Redis, about 950
/// connections a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_checkout_does_not_open_connections_beyond_the_pool() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let manager = bb8_redis::RedisConnectionManager::new(proxy.url()).unwrap();
    let pool = bb8_redis::bb8::Pool::builder()
        .max_size(2)
        .build(manager)
        .await
        .unwrap();
    let store = RedisStore::from_pool(pool).with_timeout(TIMEOUT);
    let policy = script_policy();
    for _ in 0..3 {
        store.check("k", &policy).await.unwrap();
    }
    let before = proxy.stats().accepted;
    let checks = 20;
    for _ in 0..checks {
        if proxy.armed() == 0 {
            proxy.stall_next_reply(Match::command("PING"), Duration::from_millis(20));
        }
        let outcome = store.check("k", &policy).await;
        assert!(admitted(&outcome), "{}", show(&outcome));
    }
    proxy.heal();
    let held = proxy.stats().stalls;
    let opened = proxy.stats().accepted - before;
    assert!(held >= 5, "only {held} checkout PINGs were held");
    assert!(
        opened <= 2,
        "{opened} connections opened for {checks} checks, {held} of whose checkout PING took \
         20 ms, with a pool of 2 and Redis accepting connections all along ({store:?})"
    );
}

// ---------------------------------------------------------------------------
// Arithmetic on the local clock.

/// The system clock, stepped back 1 s from its `at`-th reading on (a wall
/// clock that NTP stepped while the store measured its offset).
#[derive(Debug)]
struct StepsBackAt {
    inner: SystemClock,
    reads: AtomicU64,
    at: u64,
}

impl Clock for StepsBackAt {
    fn now(&self) -> Duration {
        let read = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
        let now = self.inner.now();
        if read >= self.at {
            now - Duration::from_secs(1)
        } else {
            now
        }
    }
}

/// A store's first transaction measures the offset to Redis with three
/// `TIME` round trips, each between two readings of the local clock. The
/// clock steps back between the two readings of the first round trip: the
/// check must not panic (it may fail, or decide).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_back_while_measuring_does_not_panic() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_clock(StepsBackAt {
            inner: SystemClock::new(),
            reads: AtomicU64::new(0),
            at: 2,
        });
    let policy: Policy = "10/1s".parse().unwrap();
    let outcome = tokio::spawn(async move { store.check("k", &policy).await.map(|_| ()) }).await;
    if let Err(error) = outcome {
        let message = panic_message(error.into_panic());
        panic!("the check panicked: {message}");
    }
}

// ---------------------------------------------------------------------------
// Never over, for cost > 1, several rates and min spacing, under faults.

/// One admitted check: when it was sent and when its answer came (local
/// monotonic clock); Redis decided it somewhere in between.
#[derive(Debug, Clone, Copy)]
struct Admission {
    sent: Instant,
    answered: Instant,
    store: usize,
}

/// Admissions that certainly broke `rate` (`per` admissions allowed per
/// `window`): `per + 1` admissions that Redis must have decided within less
/// than `window` of each other.
fn over_rate(admissions: &[Admission], per: usize, window: Duration) -> Option<String> {
    let margin = Duration::from_millis(2);
    for (i, first) in admissions.iter().enumerate() {
        let Some(group) = admissions.get(i..=i + per) else {
            break;
        };
        let last = group.iter().map(|a| a.answered).max().unwrap();
        if last.duration_since(first.sent) + margin < window {
            return Some(format!(
                "{} admissions (stores {:?}) within {:?}, at most {per} per {window:?}",
                per + 1,
                group.iter().map(|a| a.store).collect::<Vec<_>>(),
                last.duration_since(first.sent)
            ));
        }
    }
    None
}

/// Two admissions that Redis must have decided less than `spacing` apart.
fn too_close(admissions: &[Admission], spacing: Duration) -> Option<String> {
    let margin = Duration::from_millis(2);
    for (i, a) in admissions.iter().enumerate() {
        for b in &admissions[i + 1..] {
            let widest = b
                .answered
                .duration_since(a.sent)
                .max(a.answered.saturating_duration_since(b.sent));
            if widest + margin < spacing {
                return Some(format!(
                    "stores {} and {} admitted within {widest:?}, min spacing {spacing:?}",
                    a.store, b.store
                ));
            }
        }
    }
    None
}

/// Three stores (a `connect` pool, a `from_pool` pool, a ConnectionManager),
/// each through a proxy of its own, three checkers each, hammer one key
/// with `policy` for 3 s while a seeded schedule of faults hits the
/// proxies: replies dropped (closed, or hung a while), cut mid-way,
/// requests or replies held, a direction of the link stalled, connections
/// refused a while, all cut. No admission pattern may prove the limit
/// broken (see [`over_rate`], [`too_close`]).
async fn stress(policy: Policy, seed: u64) -> String {
    let server = RedisServer::start();
    let mut proxies = Vec::new();
    let mut stores = Vec::new();
    for source in [
        Connections::Pool,
        Connections::Bb8,
        Connections::ManagerNoRetries,
    ] {
        let proxy = FaultProxy::start(server.port());
        let store = faults::open(source, &proxy.url(), Duration::from_millis(300)).await;
        warm(&store).await;
        stores.push(store);
        proxies.push(proxy);
    }
    let proxies = Arc::new(proxies);
    let key = "stress";
    let redis_key = stores[0].redis_key("log", key);
    let run = Duration::from_secs(3);
    let deadline = Instant::now() + run;
    let admissions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let outcomes = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let mut jobs = tokio::task::JoinSet::new();
    for (s, store) in stores.iter().enumerate() {
        for c in 0..3u64 {
            let (store, policy) = (store.clone(), policy.clone());
            let (admissions, outcomes) = (Arc::clone(&admissions), Arc::clone(&outcomes));
            let mut rng = support::rng::Rng::new(seed ^ (s as u64 * 8 + c + 1));
            jobs.spawn(async move {
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    let outcome = store.check(key, &policy).await;
                    let answered = Instant::now();
                    let slot = match &outcome {
                        Ok(d) if d.allowed() => {
                            admissions.lock().unwrap().push(Admission {
                                sent,
                                answered,
                                store: s,
                            });
                            0
                        }
                        Ok(_) => 1,
                        Err(_) => 2,
                    };
                    outcomes[slot].fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5 + rng.below(25))).await;
                }
            });
        }
    }
    let faults = {
        let proxies = Arc::clone(&proxies);
        let redis_key = redis_key.clone();
        let mut rng = support::rng::Rng::new(seed);
        tokio::spawn(async move {
            const SPANS: FaultSpans = FaultSpans {
                hang: (100, 500),
                held: (20, 450),
                stall: (20, 400),
                refused: (20, 200),
            };
            while Instant::now() + Duration::from_millis(200) < deadline {
                tokio::time::sleep(millis(&mut rng, 20, 120)).await;
                let proxy = &proxies[rng.below(3) as usize];
                let target = match rng.below(3) {
                    0 => Match::any(),
                    1 => Match::command("EXEC").arg(&redis_key),
                    _ => Match::any().arg(&redis_key),
                };
                random_fault(proxy, target, &mut rng, &SPANS).await;
            }
        })
    };
    while let Some(done) = jobs.join_next().await {
        done.unwrap();
    }
    faults.await.unwrap();
    let fired: u64 = proxies.iter().map(|p| p.stats().faults()).sum();
    for proxy in proxies.iter() {
        proxy.heal();
        proxy.accept();
    }
    let mut admissions = admissions.lock().unwrap().clone();
    admissions.sort_by_key(|a| a.sent);
    let [ok, no, err] = &*outcomes;
    let what = format!(
        "{policy:?}, seed {seed:#x}: {} admitted, {} denied, {} errors, {fired} faults",
        ok.load(Ordering::Relaxed),
        no.load(Ordering::Relaxed),
        err.load(Ordering::Relaxed)
    );
    assert!(fired >= 10, "too few faults fired: {what}");
    assert!(
        no.load(Ordering::Relaxed) > 0,
        "the limit was never reached: {what}"
    );
    let cost = usize::try_from(policy.cost()).unwrap();
    for rate in policy.rates() {
        let per = usize::try_from(rate.max()).unwrap() / cost;
        if let Some(broken) = over_rate(&admissions, per, rate.window()) {
            panic!("{broken}: {what}");
        }
    }
    if let Some(spacing) = policy.min_spacing()
        && let Some(broken) = too_close(&admissions, spacing)
    {
        panic!("{broken}: {what}");
    }
    what
}

/// [`stress`] for both executions with cost 2 over two rates, and with a
/// min spacing, all four at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_over_with_cost_rates_and_spacing_under_faults() {
    let seed = fault_seed(0x05ee_da11);
    let mut jobs = tokio::task::JoinSet::new();
    for execution in [Execution::Transaction, Execution::Script] {
        let costly = "4/500ms, 6/2s"
            .parse::<Policy>()
            .unwrap()
            .with_cost(2)
            .unwrap()
            .with_execution(execution)
            .unwrap();
        let spaced = "1000/10s"
            .parse::<Policy>()
            .unwrap()
            .with_min_spacing(Duration::from_millis(150))
            .unwrap()
            .with_execution(execution)
            .unwrap();
        for (i, policy) in [costly, spaced].into_iter().enumerate() {
            let seed = seed
                .wrapping_mul(31)
                .wrapping_add(i as u64 * 2 + execution as u64)
                | 1;
            jobs.spawn(stress(policy, seed));
        }
    }
    let mut failures = Vec::new();
    while let Some(done) = jobs.join_next().await {
        match done {
            Ok(what) => eprintln!("{what}"),
            Err(error) => failures.push(panic_message(error.into_panic())),
        }
    }
    assert!(failures.is_empty(), "\n  {}", failures.join("\n  "));
}

// ---------------------------------------------------------------------------
// The store timeout bounds a denied check too.

/// The production guide: "Every Redis call (pool checkout and commands together) is
/// bounded by a timeout". A `Transaction` denial then takes its entry back
/// out with a `ZREM`, awaited outside the timeout, within a timeout of its
/// own: a link that slows down during a denied check (the `EXEC` reply held
/// 200 ms, the `ZREM` reply 1 s) makes it last about twice the store
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_transaction_check_answers_within_the_store_timeout() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_timeout(TIMEOUT);
    warm(&store).await;
    let policy: Policy = "1/min".parse().unwrap();
    assert_eq!(policy.execution(), Execution::Transaction);
    assert!(admitted(&store.check("k", &policy).await));
    let redis_key = store.redis_key("log", "k");
    proxy.stall_next_reply(
        Match::command("EXEC").arg(&redis_key),
        Duration::from_millis(200),
    );
    proxy.stall_next_reply(
        Match::command("ZREM").arg(&redis_key),
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let outcome = store.check("k", &policy).await;
    let took = started.elapsed();
    assert!(
        matches!(&outcome, Ok(d) if !d.allowed()) || outcome.is_err(),
        "1/min, second request: {}",
        show(&outcome)
    );
    assert_eq!(proxy.armed(), 0, "both replies were held");
    assert!(
        took < TIMEOUT + Duration::from_millis(50),
        "the check answered ({}) after {took:?}, store timeout {TIMEOUT:?}",
        show(&outcome)
    );
}

// ---------------------------------------------------------------------------
// Reply shapes: RESP3.

/// A connection that speaks RESP3 (`?protocol=resp3`) gets other reply
/// shapes (`WITHSCORES` as pairs of a member and a double): every algorithm
/// and both executions, with cost 2 over two rates and with a spacing,
/// still admit exactly what they should and then deny with a wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_decides_over_resp3() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&format!("{}/?protocol=resp3", server.url()))
        .await
        .unwrap();
    let log = |execution| {
        "4/1s, 6/2s"
            .parse::<Policy>()
            .unwrap()
            .with_cost(2)
            .unwrap()
            .with_execution(execution)
            .unwrap()
    };
    let spaced = |execution| {
        "10/1s"
            .parse::<Policy>()
            .unwrap()
            .with_min_spacing(Duration::from_secs(5))
            .unwrap()
            .with_execution(execution)
            .unwrap()
    };
    let cases = [
        (log(Execution::Transaction), 2),
        (log(Execution::Script), 2),
        (spaced(Execution::Transaction), 1),
        (spaced(Execution::Script), 1),
        ("2/1s".parse::<Policy>().unwrap().fixed_window().unwrap(), 2),
        (
            "2/1s".parse::<Policy>().unwrap().sliding_window().unwrap(),
            2,
        ),
        ("2/1s".parse::<Policy>().unwrap().gcra().unwrap(), 2),
        (Policy::concurrency(2).unwrap(), 2),
    ];
    for (i, (policy, admits)) in cases.into_iter().enumerate() {
        let key = format!("resp3-{i}");
        let mut seen = Vec::new();
        for _ in 0..=admits {
            seen.push(store.check(&key, &policy).await);
        }
        let shown: Vec<String> = seen.iter().map(show).collect();
        assert!(seen[..admits].iter().all(admitted), "{policy:?}: {shown:?}");
        assert!(
            matches!(&seen[admits], Ok(d) if !d.allowed() && !d.retry_after().is_zero()),
            "{policy:?}: {shown:?}"
        );
    }
}
