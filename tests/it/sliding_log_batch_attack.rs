//! Attacks on the sliding log's two newest paths: the `Script` execution's
//! checks decided in batches (one `EVALSHA` of many checks, each with its
//! own request id, sent again once after a lost reply with each check
//! looking for its own entries first), and the `Transaction` execution's
//! keys held full (`FullKeys`), whose checks first read the log and, denied
//! on that read, write nothing. Real redis-server processes, the fault
//! proxy for lost, cut and stalled replies, `MemoryStore` for the exact
//! decisions where time allows.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use crate::support::faults::SteppingClock;
use crate::support::harness::MS;
use crate::support::proxy::{AfterDrop, FaultProxy, Match};
use crate::support::{RedisServer, contention, zcard};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Decision, Policy, RedisStore, Store, StoreError};

/// A store on `url` (batching on, the default) with a generous timeout.
async fn store(url: &str) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(5))
}

/// `text` as a sliding-log policy in the `Script` execution.
fn script(text: &str) -> Policy {
    text.parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Script)
        .unwrap()
}

/// `text` as a sliding-log policy in the `Transaction` execution (the
/// default).
fn transaction(text: &str) -> Policy {
    text.parse::<Policy>()
        .unwrap()
        .with_execution(Execution::Transaction)
        .unwrap()
}

fn show(outcome: &Result<Decision, StoreError>) -> String {
    match outcome {
        Ok(d) => crate::support::faults::show_decision(d),
        Err(e) => format!("error {e}"),
    }
}

/// The `EVALSHA` calls Redis saw (one per batch).
fn evalshas(server: &RedisServer) -> u64 {
    server.calls("evalsha")
}

// ---------------------------------------------------------------------------
// 1. The Transaction execution's keys held full.

/// The units of the admitted decisions among `outcomes`, each check's cost
/// given by `cost`.
fn admitted_units(outcomes: &[Result<Decision, StoreError>], cost: impl Fn(usize) -> u64) -> u64 {
    outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Ok(d) if d.allowed()))
        .map(|(i, _)| cost(i))
        .sum()
}

/// `checks` through `store` (one batch in flight) as one batch: a first
/// check of `gate` has its reply held 300 ms by `proxy`, so that the
/// checks asked meanwhile queue behind it and go out together.
async fn behind_a_gate(
    store: &RedisStore,
    proxy: &FaultProxy,
    gate: &str,
    checks: Vec<(String, Policy)>,
) -> Vec<Result<Decision, StoreError>> {
    let gate_key = store.redis_key("log", gate);
    proxy.stall_next_reply(Match::command("EVALSHA").arg(&gate_key), 300 * MS);
    let first = {
        let (store, gate, policy) = (store.clone(), gate.to_owned(), script("1000/60s"));
        tokio::spawn(async move { store.check(&gate, &policy).await })
    };
    tokio::time::sleep(50 * MS).await;
    let out = contention::all_at_once(store, checks).await;
    assert!(first.await.unwrap().unwrap().allowed());
    out
}

/// A store on `proxy` with one batch in flight, its scripts loaded.
async fn one_in_flight(proxy: &FaultProxy) -> RedisStore {
    let store = store(&proxy.url()).await.with_batches(1);
    assert!(
        store
            .check("warm", &script("9/60s"))
            .await
            .unwrap()
            .allowed()
    );
    store
}

// ---------------------------------------------------------------------------
// 1. The Transaction execution's keys held full.

/// A key this store holds full gets room again (here a reward by another
/// store). The next check reads, finds room and writes in its transaction,
/// whose reply is lost (the connection closed, or cut mid-reply, after
/// Redis ran it). The transaction is sent again (a repeat is harmless: the
/// same entries), but the key is still held full, so the repeat first
/// reads the log, which now holds the request's own entries. Whatever the
/// check answers, the log must agree with it: admitted with its entry
/// counted, or denied with nothing of it left in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_transaction_reply_of_a_key_held_full_never_leaves_a_denied_entry() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let held = store(&proxy.url()).await;
    let other = store(&server.url()).await;
    let mut failures = Vec::new();
    for (fault, cut, cost) in [
        ("lost", false, 1),
        ("cut", true, 1),
        ("lost-cost-2", false, 2),
    ] {
        let policy = transaction("4/60s").with_cost(cost).unwrap();
        let one = transaction("4/60s");
        let key = format!("held-{fault}");
        let redis_key = held.redis_key("log", &key);
        for _ in 0..4 {
            assert!(held.check(&key, &one).await.unwrap().allowed());
        }
        // The transaction finds it full: held from now on.
        assert!(!held.check(&key, &policy).await.unwrap().allowed());
        assert!(!held.check(&key, &policy).await.unwrap().allowed());
        assert_eq!(zcard(&server, &redis_key), 4);
        // Room for this check, made by another process.
        other
            .command(&key, &policy, Command::Reward(cost))
            .await
            .unwrap();
        assert_eq!(zcard(&server, &redis_key), 4 - cost as usize);
        let target = Match::command("EXEC").arg(&redis_key);
        if cut {
            proxy.cut_next_reply(target);
        } else {
            proxy.drop_next_reply(target, AfterDrop::Close);
        }
        let outcome = held.check(&key, &policy).await;
        assert_eq!(proxy.armed(), 0, "{fault}: the fault did not fire");
        // Let any clean-up run.
        tokio::time::sleep(100 * MS).await;
        let entries = zcard(&server, &redis_key);
        let fine = match &outcome {
            Ok(d) if d.allowed() => entries == 4,
            Ok(_) => entries == 4 - cost as usize,
            Err(_) => entries <= 4,
        };
        if !fine {
            failures.push(format!(
                "{fault}: the check answered {}, and the log holds {entries} entries \
                 ({} before the check)",
                show(&outcome),
                4 - cost
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A key held full by store A gets room from other stores: a reset (A
/// admits at once), a block (A's check is blocked), the block lifted (A
/// is denied on the full log again), a penalty while held (denied, its
/// wait honest: no admission before it, one after), a reward (admitted).
/// Each of A's decisions is the one a store that never held it makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_full_follows_what_other_stores_do_to_it() {
    let server = RedisServer::start();
    let [a, b] = contention::two_stores(&server).await;
    let policy = transaction("2/60s");
    let key = "others";
    let redis_key = a.redis_key("log", key);
    let fill = |n: usize| {
        let (a, policy) = (a.clone(), policy.clone());
        async move {
            for _ in 0..n {
                assert!(a.check(key, &policy).await.unwrap().allowed());
            }
        }
    };
    fill(2).await;
    assert!(!a.check(key, &policy).await.unwrap().allowed());
    // Reset by B: room at once.
    b.command(key, &policy, Command::Reset).await.unwrap();
    assert!(
        a.check(key, &policy).await.unwrap().allowed(),
        "a reset by another store"
    );
    fill(1).await;
    assert!(!a.check(key, &policy).await.unwrap().allowed());
    // Blocked by B: blocked, whatever A holds.
    b.command(key, &policy, Command::Block(Duration::from_secs(30)))
        .await
        .unwrap();
    let blocked = a.check(key, &policy).await.unwrap();
    assert!(!blocked.allowed() && blocked.blocked(), "{blocked:?}");
    assert!(
        blocked.retry_after() > Duration::from_secs(29),
        "{blocked:?}"
    );
    b.command(key, &policy, Command::Block(Duration::ZERO))
        .await
        .unwrap();
    let denied = a.check(key, &policy).await.unwrap();
    assert!(!denied.allowed() && !denied.blocked(), "{denied:?}");
    assert_eq!(zcard(&server, &redis_key), 2);
    // A reward of both by B: two admissions, then full.
    b.command(key, &policy, Command::Reward(2)).await.unwrap();
    assert!(a.check(key, &policy).await.unwrap().allowed());
    assert!(b.check(key, &policy).await.unwrap().allowed());
    assert!(!a.check(key, &policy).await.unwrap().allowed());
    assert!(!b.check(key, &policy).await.unwrap().allowed());
    assert_eq!(zcard(&server, &redis_key), 2);
    // A penalty by B while A holds it: still denied, the same as B says.
    b.command(key, &policy, Command::Penalty(1)).await.unwrap();
    let from_a = a.check(key, &policy).await.unwrap();
    let from_b = b.check(key, &policy).await.unwrap();
    assert!(!from_a.allowed() && !from_b.allowed());
    assert!(
        from_a.retry_after().abs_diff(from_b.retry_after()) < 100 * MS,
        "A {from_a:?}, B {from_b:?}"
    );
    assert_eq!(zcard(&server, &redis_key), 3);
}

/// A lone client that waits each `Retry-After` it gets is admitted then
/// (one more short denial is allowed at the window's end, as the
/// transaction's padding documents), and never admitted over the max:
/// under costs of 1, 2 and the max, a spacing and two rates, on short
/// windows. Each denial is asked again at once (a transaction's key is
/// then held full: the check is decided on its read alone), and the wait
/// of that second answer is the one waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_client_waiting_retry_after_is_admitted() {
    let server = RedisServer::start();
    let redis = store(&server.url()).await;
    let cases = [
        ("transaction cost 1", transaction("3/600ms")),
        (
            "transaction cost 2",
            transaction("4/600ms").with_cost(2).unwrap(),
        ),
        ("script cost 1", script("3/600ms")),
        ("script cost 2", script("4/600ms").with_cost(2).unwrap()),
        (
            "transaction cost the max",
            transaction("2/600ms").with_cost(2).unwrap(),
        ),
        (
            "script cost the max",
            script("2/600ms").with_cost(2).unwrap(),
        ),
        (
            "script two rates, spacing",
            script("2/300ms,3/900ms").with_min_spacing(50 * MS).unwrap(),
        ),
    ];
    let tasks: Vec<_> = cases
        .into_iter()
        .map(|(label, policy)| {
            let redis = redis.clone();
            tokio::spawn(async move { lone_client(&redis, label, &policy).await })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.unwrap());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One client of [`a_lone_client_waiting_retry_after_is_admitted`] for
/// 2.5 s: what went wrong.
async fn lone_client(redis: &RedisStore, label: &str, policy: &Policy) -> Vec<String> {
    let key = format!("lone-{label}");
    let started = std::time::Instant::now();
    let mut waited = false;
    let mut admitted_at: Vec<std::time::Instant> = Vec::new();
    let mut failures = Vec::new();
    while started.elapsed() < Duration::from_millis(2500) {
        let d = redis.check(&key, policy).await.unwrap();
        if d.allowed() {
            admitted_at.push(std::time::Instant::now());
            waited = false;
            continue;
        }
        if waited && d.retry_after() > 30 * MS {
            failures.push(format!(
                "{label}: denied after waiting the Retry-After it was given: {d:?}"
            ));
            break;
        }
        // Asked again at once: the same denial, a wait no longer.
        let again = redis.check(&key, policy).await.unwrap();
        if again.allowed() && d.retry_after() < 20 * MS {
            // The wait was over by then.
            admitted_at.push(std::time::Instant::now());
            waited = false;
            continue;
        }
        if again.allowed() || again.retry_after() > d.retry_after() + 20 * MS {
            failures.push(format!(
                "{label}: denied with {d:?}, then at once {again:?}"
            ));
            break;
        }
        if again.retry_after().is_zero() || again.retry_after() > Duration::from_millis(900) {
            failures.push(format!("{label}: a wait out of range: {again:?}"));
            break;
        }
        tokio::time::sleep(again.retry_after()).await;
        waited = true;
    }
    // Never more than the max units in any window of the first rate
    // (checked on the admissions' local times, with a margin for the round
    // trips).
    let window = policy.rates()[0].window();
    let max = policy.rates()[0].max() / policy.cost();
    for (i, t) in admitted_at.iter().enumerate() {
        let inside = admitted_at[i..]
            .iter()
            .filter(|u| u.duration_since(*t) + 20 * MS < window)
            .count();
        if u64::try_from(inside).unwrap() > max {
            failures.push(format!("{label}: {inside} admissions within {window:?}"));
        }
    }
    // About 2.5 s / 600 ms windows of `max` admissions each.
    if u64::try_from(admitted_at.len()).unwrap() < 3 * max {
        failures.push(format!("{label}: {} admissions", admitted_at.len()));
    }
    failures
}

/// A key held full by a store whose clock steps (the offset to Redis is
/// measured again only every 30 s): ahead, its read would count from the
/// future; behind, from the past. Either way it must decide as Redis's
/// log says: denied while full, admitted once the window passed, and
/// never over the max with another store counting too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_full_under_a_stepped_clock_decides_as_the_log_says() {
    let server = RedisServer::start();
    let other = store(&server.url()).await;
    for (step, ahead) in [
        (Duration::from_millis(700), true),
        (Duration::from_millis(700), false),
        (Duration::from_secs(5), true),
        (Duration::from_secs(5), false),
    ] {
        let clock = SteppingClock::new();
        let stepping = store(&server.url()).await.with_clock(clock.clone());
        let policy = transaction("2/1s");
        let key = format!("stepped-{}-{ahead}", step.as_millis());
        let redis_key = stepping.redis_key("log", &key);
        assert!(stepping.check(&key, &policy).await.unwrap().allowed());
        assert!(stepping.check(&key, &policy).await.unwrap().allowed());
        assert!(!stepping.check(&key, &policy).await.unwrap().allowed());
        clock.step(step, ahead);
        for i in 0..3 {
            let outcome = stepping.check(&key, &policy).await;
            assert!(
                matches!(&outcome, Ok(d) if !d.allowed()) || outcome.is_err(),
                "step {step:?} ahead {ahead} check {i}: {}",
                show(&outcome)
            );
            assert!(!other.check(&key, &policy).await.unwrap().allowed());
        }
        tokio::time::sleep(50 * MS).await;
        assert_eq!(zcard(&server, &redis_key), 2, "step {step:?} ahead {ahead}");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        // The window passed: room for two, whoever asks.
        let mut admitted = 0;
        for _ in 0..3 {
            if let Ok(d) = stepping.check(&key, &policy).await {
                admitted += usize::from(d.allowed());
            }
            admitted += usize::from(other.check(&key, &policy).await.unwrap().allowed());
        }
        tokio::time::sleep(50 * MS).await;
        assert!(
            admitted <= 2,
            "step {step:?} ahead {ahead}: {admitted} admitted"
        );
        assert!(admitted >= 1, "step {step:?} ahead {ahead}: none admitted");
    }
}

// ---------------------------------------------------------------------------
// 2. The Script execution's batches.

/// A batch whose reply is lost after Redis ran it, mixing two policies of
/// one key (costs 1 and 2, two rates each: P > 1, each check's policy
/// index before the retry flag and the ids), is sent again: each check
/// counts once, the binding rate admits exactly its max in units, and the
/// log holds exactly the units admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_batch_reply_with_two_policies_counts_each_check_once() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let one = script("6/60s,10/30s");
    let two = one.clone().with_cost(2).unwrap();
    for (fault, cut) in [("lost", false), ("cut", true)] {
        let key = format!("two-policies-{fault}");
        let redis_key = store.redis_key("log", &key);
        let target = Match::command("EVALSHA").arg(&redis_key);
        if cut {
            proxy.cut_next_reply(target);
        } else {
            proxy.drop_next_reply(target, AfterDrop::Close);
        }
        let before = evalshas(&server);
        let checks: Vec<_> = (0..20)
            .map(|i| {
                (
                    key.clone(),
                    if i % 2 == 0 { two.clone() } else { one.clone() },
                )
            })
            .collect();
        let outcomes = behind_a_gate(&store, &proxy, &format!("gate-{fault}"), checks).await;
        assert_eq!(proxy.armed(), 0, "{fault}: the fault did not fire");
        assert!(evalshas(&server) - before <= 4, "{fault}: not batched");
        let errors: Vec<_> = outcomes.iter().filter(|o| o.is_err()).map(show).collect();
        assert!(errors.is_empty(), "{fault}: {errors:?}");
        let units = admitted_units(&outcomes, |i| if i % 2 == 0 { 2 } else { 1 });
        assert_eq!(
            units,
            6,
            "{fault}: {:?}",
            outcomes.iter().map(show).collect::<Vec<_>>()
        );
        assert_eq!(zcard(&server, &redis_key), 6, "{fault}");
        // And nothing more later.
        assert!(!store.check(&key, &one).await.unwrap().allowed());
    }
}

/// One batch (its reply lost, then sent again with the retry flag) of
/// four keys, each under a policy of its own (one rate; two rates; cost 2;
/// a spacing of 10 s): each arguments' table of its own in the script.
/// Each key admits what it alone would, and its log holds exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_batch_of_four_policies_decides_each_key_as_alone() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let policies = [
        ("plain", script("3/60s"), 3, 1),
        ("two-rates", script("2/1s,9/60s"), 2, 1),
        ("cost-two", script("5/60s").with_cost(2).unwrap(), 2, 2),
        (
            "spaced",
            script("100/60s")
                .with_min_spacing(Duration::from_secs(10))
                .unwrap(),
            1,
            1,
        ),
    ];
    for lost in [false, true] {
        let suffix = if lost { "lost" } else { "kept" };
        // The reply lost is the one of the batch naming the first key.
        if lost {
            let plain = store.redis_key("log", &format!("plain-{suffix}"));
            proxy.drop_next_reply(Match::command("EVALSHA").arg(&plain), AfterDrop::Close);
        }
        let checks: Vec<_> = (0..24)
            .map(|i| {
                let (name, policy, _, _) = &policies[i % 4];
                (format!("{name}-{suffix}"), policy.clone())
            })
            .collect();
        let before = evalshas(&server);
        let outcomes = behind_a_gate(&store, &proxy, &format!("gate-{suffix}"), checks).await;
        assert_eq!(proxy.armed(), 0, "{suffix}: the fault did not fire");
        assert!(evalshas(&server) - before <= 4, "{suffix}: not batched");
        for (k, (name, _, admits, cost)) in policies.iter().enumerate() {
            let mine: Vec<_> = outcomes.iter().skip(k).step_by(4).collect();
            let admitted = mine
                .iter()
                .filter(|o| matches!(o, Ok(d) if d.allowed()))
                .count();
            assert_eq!(
                admitted,
                *admits,
                "{suffix} {name}: {:?}",
                mine.iter().map(|o| show(o)).collect::<Vec<_>>()
            );
            let redis_key = store.redis_key("log", &format!("{name}-{suffix}"));
            assert_eq!(zcard(&server, &redis_key), admits * cost, "{suffix} {name}");
        }
    }
}

/// A batch with a key of another type under the prefix, its reply lost:
/// sent again, the foreign key's checks fail alone (on the retry's own
/// look for their entries too), the others count once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_batch_reply_with_a_foreign_key_fails_that_check_alone() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let policy = script("5/60s").with_cost(1).unwrap();
    let foreign = store.redis_key("log", "foreign");
    server.command(&["SET", &foreign, "not a sorted set"]);
    let hot = store.redis_key("log", "hot");
    proxy.drop_next_reply(Match::command("EVALSHA").arg(&hot), AfterDrop::Close);
    let checks: Vec<_> = (0..16)
        .map(|i| {
            let key = if i % 4 == 0 { "foreign" } else { "hot" };
            (key.to_owned(), policy.clone())
        })
        .collect();
    let outcomes = behind_a_gate(&store, &proxy, "gate", checks).await;
    assert_eq!(proxy.armed(), 0, "the fault did not fire");
    for (i, outcome) in outcomes.iter().enumerate() {
        if i % 4 == 0 {
            assert!(outcome.is_err(), "foreign check {i}: {}", show(outcome));
        } else {
            assert!(outcome.is_ok(), "hot check {i}: {}", show(outcome));
        }
    }
    assert_eq!(admitted_units(&outcomes, |_| 1), 5);
    assert_eq!(zcard(&server, &hot), 5);
    assert_eq!(
        server.command(&["GET", &foreign]).trim(),
        "$16\r\nnot a sorted set".trim()
    );
}

/// A batch whose reply is stalled past the store's timeout: its checks
/// fail (Redis decided them; nobody heard), and whatever they counted, no
/// later check is admitted over the max, and the log never holds more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_batch_reply_never_lets_the_key_over_its_max() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_batches(1)
        .with_timeout(400 * MS);
    let policy = script("8/60s").with_cost(2).unwrap();
    assert!(store.check("warm", &policy).await.unwrap().allowed());
    let key = "stalled";
    let redis_key = store.redis_key("log", key);
    proxy.stall_next_reply(Match::command("EVALSHA").arg(&redis_key), 900 * MS);
    let checks: Vec<_> = (0..10).map(|_| (key.to_owned(), policy.clone())).collect();
    let outcomes = contention::all_at_once(&store, checks).await;
    let admitted = admitted_units(&outcomes, |_| 2);
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    assert!(failed > 0, "the stall made no check fail: {outcomes:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let counted = zcard(&server, &redis_key);
    assert!(counted <= 8, "{counted}");
    assert!(counted >= usize::try_from(admitted).unwrap());
    let other = store.clone().with_timeout(Duration::from_secs(5));
    let mut later = 0;
    for _ in 0..6 {
        later += u64::from(other.check(key, &policy).await.unwrap().allowed()) * 2;
    }
    assert_eq!(
        later,
        8 - u64::try_from(counted).unwrap(),
        "later admissions fill exactly what the log has room for"
    );
    assert!(zcard(&server, &redis_key) <= 8);
}

/// One key many times in one batch under a spacing of 200 ms: one check
/// admitted, every other denied with a wait no longer than the spacing
/// (and more than nothing); waited, a check is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_many_times_in_a_batch_under_a_spacing_admits_one() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let policy = script("100/60s,1000/600s")
        .with_min_spacing(200 * MS)
        .unwrap();
    let checks: Vec<_> = (0..20)
        .map(|_| ("spaced".to_owned(), policy.clone()))
        .collect();
    let outcomes = behind_a_gate(&store, &proxy, "gate-spaced", checks).await;
    assert_eq!(admitted_units(&outcomes, |_| 1), 1, "{outcomes:?}");
    let mut longest = Duration::ZERO;
    for outcome in &outcomes {
        let d = outcome.as_ref().unwrap();
        if !d.allowed() {
            assert!(d.retry_after() > Duration::ZERO, "{d:?}");
            assert!(d.retry_after() <= 200 * MS, "{d:?}");
            assert_eq!(d.remaining(), 99, "{d:?}");
            longest = longest.max(d.retry_after());
        }
    }
    tokio::time::sleep(longest + 5 * MS).await;
    assert!(store.check("spaced", &policy).await.unwrap().allowed());
    assert_eq!(zcard(&server, &store.redis_key("log", "spaced")), 2);
}

/// A blocked key's checks in a batch: all denied as blocked, nothing
/// written; the block lifted, the batch admits exactly the max (cost 3
/// and cost 1 mixed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_key_in_a_batch_writes_nothing() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let one = script("7/60s");
    let three = one.clone().with_cost(3).unwrap();
    store
        .command("blocked", &one, Command::Block(Duration::from_secs(30)))
        .await
        .unwrap();
    let checks = |n| -> Vec<(String, Policy)> {
        (0..n)
            .map(|i| {
                (
                    "blocked".to_owned(),
                    if i % 3 == 0 {
                        three.clone()
                    } else {
                        one.clone()
                    },
                )
            })
            .collect()
    };
    let outcomes = behind_a_gate(&store, &proxy, "gate-1", checks(12)).await;
    for outcome in &outcomes {
        let d = outcome.as_ref().unwrap();
        assert!(!d.allowed() && d.blocked(), "{d:?}");
    }
    let redis_key = store.redis_key("log", "blocked");
    assert_eq!(zcard(&server, &redis_key), 0);
    store
        .command("blocked", &one, Command::Block(Duration::ZERO))
        .await
        .unwrap();
    let outcomes = behind_a_gate(&store, &proxy, "gate-2", checks(12)).await;
    let units = admitted_units(&outcomes, |i| if i % 3 == 0 { 3 } else { 1 });
    assert_eq!(units, 7, "{outcomes:?}");
    assert_eq!(zcard(&server, &redis_key), 7);
}

/// Admissions of cost 1 in a batch carry their entries: a refund of one
/// takes exactly its entry back out, and the room is there at once (for
/// the transaction of another store too).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batched_admission_of_cost_one_can_be_refunded() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let store = one_in_flight(&proxy).await;
    let other = store_on(&server).await;
    let policy = script("3/60s");
    let checks: Vec<_> = (0..8)
        .map(|_| ("refund".to_owned(), policy.clone()))
        .collect();
    let outcomes = behind_a_gate(&store, &proxy, "gate-refund", checks).await;
    let admitted: Vec<_> = outcomes
        .into_iter()
        .map(Result::unwrap)
        .filter(Decision::allowed)
        .collect();
    assert_eq!(admitted.len(), 3);
    let redis_key = store.redis_key("log", "refund");
    assert_eq!(zcard(&server, &redis_key), 3);
    // The transaction of another store finds it full (and holds it).
    let tx = transaction("3/60s");
    assert!(!other.check("refund", &tx).await.unwrap().allowed());
    for (i, d) in admitted.iter().enumerate() {
        let id = d.refund_id().expect("an admission carries its entries");
        store
            .command("refund", &policy, Command::Refund { id, units: 1 })
            .await
            .unwrap();
        assert_eq!(zcard(&server, &redis_key), 2, "refund {i}");
        assert!(
            other.check("refund", &tx).await.unwrap().allowed(),
            "refund {i}: the room a refund made"
        );
        assert!(!other.check("refund", &tx).await.unwrap().allowed());
    }
}

async fn store_on(server: &RedisServer) -> RedisStore {
    store(&server.url()).await
}

// ---------------------------------------------------------------------------
// 3. Both executions on one key.

/// Three stores on one Redis, two checking in `Script` batches and one in
/// `Transaction`s (whose keys held full are read first), hit one key at
/// once with costs 1 and 2: never over the max in units, and the log holds
/// exactly the admitted units once the denied transactions' entries are
/// out; then the key fills to exactly its max one unit at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_executions_on_one_key_never_admit_over_the_max() {
    let server = RedisServer::start();
    let stores = [
        store_on(&server).await,
        store_on(&server).await,
        store_on(&server).await,
    ];
    for round in 0..4 {
        let key = format!("mixed-{round}");
        let redis_key = stores[0].redis_key("log", &key);
        // Store 2 (transactions) holds the key full before the rush, in
        // every other round: its checks then read first.
        let max = 12;
        if round % 2 == 1 {
            let tx = transaction(&format!("{max}/60s"));
            stores[2]
                .command(&key, &tx, Command::Penalty(max))
                .await
                .unwrap();
            assert!(!stores[2].check(&key, &tx).await.unwrap().allowed());
            stores[0].command(&key, &tx, Command::Reset).await.unwrap();
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(60));
        let tasks: Vec<_> = (0..60)
            .map(|i| {
                let store = stores[i % 3].clone();
                let cost = 1 + u64::try_from(i % 2).unwrap();
                let text = format!("{max}/60s");
                let policy = if i % 3 == 2 {
                    transaction(&text)
                } else {
                    script(&text)
                }
                .with_cost(cost)
                .unwrap();
                let (barrier, key) = (Arc::clone(&barrier), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let d = store.check(&key, &policy).await.unwrap();
                    if d.allowed() { cost } else { 0 }
                })
            })
            .collect();
        let mut units = 0;
        for task in tasks {
            units += task.await.unwrap();
        }
        assert!(
            units <= max,
            "round {round}: {units} units admitted of {max}"
        );
        tokio::time::sleep(200 * MS).await;
        assert_eq!(
            zcard(&server, &redis_key) as u64,
            units,
            "round {round}: the log and the admissions disagree"
        );
        let mut more = 0;
        for i in 0..(max + 3) {
            let policy = if i % 2 == 0 {
                script(&format!("{max}/60s"))
            } else {
                transaction(&format!("{max}/60s"))
            };
            more += u64::from(
                stores[usize::try_from(i % 3).unwrap()]
                    .check(&key, &policy)
                    .await
                    .unwrap()
                    .allowed(),
            );
        }
        assert_eq!(
            units + more,
            max,
            "round {round}: {units} in the rush, {more} after"
        );
    }
}

/// A sequence of checks (both executions, costs 1 to 3, two stores) and
/// commands (rewards, penalties, refunds, resets) on one key, each
/// compared with `MemoryStore`'s decision: allowed and remaining equal,
/// waits within 100 ms. The transaction's keys held full are read first
/// (one rate, no spacing): their decisions must not differ; the script
/// takes its one-rate path or its general one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_on_both_executions_decides_as_the_memory_store() {
    let server = RedisServer::start();
    let seed = crate::support::faults::fault_seed(0x05ee_d109);
    let mut failures = Vec::new();
    for (label, rates, spacing) in [
        ("one rate", "6/60s", None),
        ("two rates", "4/30s,7/60s", None),
        (
            "two rates and a spacing",
            "4/30s,7/60s",
            Some(Duration::from_secs(20)),
        ),
    ] {
        failures.extend(sequence(&server, seed, label, rates, spacing).await);
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// One run of [`a_sequence_on_both_executions_decides_as_the_memory_store`]:
/// the differences.
async fn sequence(
    server: &RedisServer,
    seed: u64,
    label: &str,
    rates: &str,
    spacing: Option<Duration>,
) -> Vec<String> {
    use crate::support::rng::Rng;
    use tower_redis_ratelimit::MemoryStore;
    let [a, b] = contention::two_stores(server).await;
    let mut rng = Rng::new(seed);
    let memory = MemoryStore::new();
    let key = format!("sequence-{label}");
    let mut failures = Vec::new();
    // Admissions: (redis refund id, memory refund id, units).
    let mut admitted = Vec::new();
    for step in 0..150 {
        let cost = 1 + rng.below(3);
        let mut policy = if rng.below(2) == 0 {
            transaction(rates)
        } else {
            script(rates)
        }
        .with_cost(cost)
        .unwrap();
        if let Some(spacing) = spacing {
            policy = policy.with_min_spacing(spacing).unwrap();
        }
        let redis = if rng.below(2) == 0 { &a } else { &b };
        let roll = rng.below(20);
        let (r, m, what) = if roll < 14 {
            let r = redis.check(&key, &policy).await.unwrap();
            let m = memory.check(&key, &policy).await.unwrap();
            if r.allowed()
                && m.allowed()
                && let (Some(rid), Some(mid)) = (r.refund_id(), m.refund_id())
            {
                admitted.push((rid, mid, cost));
            }
            (r, m, format!("check {:?} cost {cost}", policy.execution()))
        } else {
            // A refund carries each store's own id of the check.
            let (rc, mc) = match roll {
                14 | 15 => {
                    let c = Command::Reward(1 + rng.below(2));
                    (c, c)
                }
                16 => {
                    let c = Command::Penalty(1 + rng.below(2));
                    (c, c)
                }
                17 => (Command::Reset, Command::Reset),
                _ => match admitted.pop() {
                    Some((rid, mid, units)) => (
                        Command::Refund { id: rid, units },
                        Command::Refund { id: mid, units },
                    ),
                    None => (Command::Peek, Command::Peek),
                },
            };
            if matches!(rc, Command::Reset | Command::Reward(_)) {
                // The entries a refund would take may be gone.
                admitted.clear();
            }
            let r = redis.command(&key, &policy, rc).await.unwrap();
            let m = memory.command(&key, &policy, mc).await.unwrap();
            let command = rc;
            (r, m, format!("{command:?}"))
        };
        let same = r.allowed() == m.allowed()
            && r.remaining() == m.remaining()
            && r.retry_after().abs_diff(m.retry_after()) <= 100 * MS;
        if !same {
            failures.push(format!(
                "{label} step {step} {what}:\n  redis  {}\n  memory {}",
                show(&Ok(r)),
                show(&Ok(m))
            ));
        }
    }
    failures
}

/// A batched admission of a large cost (9,000 entries, under the sliding
/// log's most of 10,000) refunded: every one of its entries comes out, and
/// the room is there at once. (The refund names each of its members.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_admission_of_a_large_cost_can_be_refunded() {
    let server = RedisServer::start();
    let store = store_on(&server).await;
    let mut failures = Vec::new();
    for (label, policy) in [
        ("script", script("10000/60s").with_cost(9000).unwrap()),
        (
            "transaction",
            transaction("10000/60s").with_cost(9000).unwrap(),
        ),
    ] {
        let key = format!("large-{label}");
        let redis_key = store.redis_key("log", &key);
        let d = store.check(&key, &policy).await.unwrap();
        assert!(d.allowed(), "{label}: {d:?}");
        assert_eq!(zcard(&server, &redis_key), 9000, "{label}");
        let id = d.refund_id().expect("an admission carries its entries");
        let refunded = store
            .command(&key, &policy, Command::Refund { id, units: 9000 })
            .await;
        let left = zcard(&server, &redis_key);
        if refunded.is_err() || left != 0 {
            failures.push(format!(
                "{label}: the refund of 9000 units answered {}, and {left} entries are left",
                show(&refunded)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
