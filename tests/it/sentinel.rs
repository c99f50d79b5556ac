//! Redis Sentinel (`sentinel` feature), with real processes on loopback:
//! one primary, one replica, three Sentinels. A store built from the
//! Sentinels follows a failover without a restart, under every fail mode;
//! a primary demoted to a replica (`READONLY`) is left for the new one; and
//! counts the old primary never replicated are lost, which over-admits a
//! key by at most those counts, at most one window's limit.
//!
//! Each test prints its figures (`--nocapture`): BENCHMARKS.md's
//! "Redis Sentinel" section quotes them.
#![cfg(feature = "sentinel")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::{Duration, Instant};

use crate::support::every_algorithm;
use crate::support::proxy::{Direction, FaultProxy};
use crate::support::sentinel::{Deployment, SERVICE, wait_for};
use tower_redis_ratelimit::limiter::DecidedBy;
use tower_redis_ratelimit::{
    FailMode, LimitError, Limiter, MemoryStore, Policy, RedisStore, Store,
};

/// What a stream of checks saw from the primary's death until limiting
/// worked again.
#[derive(Debug, Default)]
struct Outage {
    /// From the kill to the first decision by the store.
    until_store: Duration,
    /// From the kill until a Sentinel named the new primary (as first seen
    /// between two checks).
    until_named: Option<Duration>,
    /// Verdicts meanwhile, by who gave them.
    fail_open: u32,
    fallback: u32,
    errors: u32,
    /// Decisions by the store after the kill that went to the dead primary
    /// (none: they fail).
    store_before_failover: u32,
}

/// Kill the primary while checking a key every 10 ms through `limiter`;
/// return what the checks saw until the store decided again.
async fn failover_under(limiter: &Limiter, deployment: &mut Deployment, key: &str) -> Outage {
    // Limiting works, on the primary.
    for _ in 0..5 {
        let verdict = limiter.check(key).await.unwrap();
        assert_eq!(verdict.decided_by(), DecidedBy::Store);
    }
    let old = deployment.primary.port();
    assert_eq!(deployment.named_primary(), Some(old));
    let killed = Instant::now();
    deployment.primary.kill();
    let mut outage = Outage::default();
    loop {
        let result = limiter.check(key).await;
        let failed_over = deployment.any_names_other_than(old);
        if failed_over && outage.until_named.is_none() {
            outage.until_named = Some(killed.elapsed());
        }
        match result {
            Ok(verdict) => match verdict.decided_by() {
                DecidedBy::Store if failed_over => {
                    outage.until_store = killed.elapsed();
                    break;
                }
                DecidedBy::Store => outage.store_before_failover += 1,
                DecidedBy::FailOpen => outage.fail_open += 1,
                DecidedBy::Fallback => outage.fallback += 1,
                other => panic!("unexpected verdict source {other:?}"),
            },
            Err(LimitError::Store(_)) => outage.errors += 1,
            Err(other) => panic!("unexpected error {other}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "limiting did not work again within 60 s: {outage:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    outage
}

async fn follows_a_failover(fail_mode: FailMode, name: &str) {
    let _slot = support::sentinel::one_of_three().await;
    let mut deployment = Deployment::start();
    // Any process would: connect through the Sentinels, with the URL form.
    let store = RedisStore::connect(&deployment.url()).await.unwrap();
    let policy: Policy = "100000/60s".parse().unwrap();
    let limiter = Limiter::new(store.clone(), policy.clone()).with_fail_mode(fail_mode);
    let key = format!("failover-{name}");
    let outage = failover_under(&limiter, &mut deployment, &key).await;
    eprintln!("FIGURE sentinel failover, fail mode {name}: {outage:?}");

    // The new primary is the old replica, and the checks count there: the
    // store was not rebuilt.
    let new = deployment.replica.port();
    assert_eq!(deployment.named_primary(), Some(new));
    assert!(
        deployment
            .replica
            .command(&["INFO", "replication"])
            .contains("role:master")
    );
    let before = deployment.replica.command(&["DBSIZE"]);
    for i in 0..3 {
        let verdict = limiter.check(&format!("{key}-after-{i}")).await.unwrap();
        assert_eq!(verdict.decided_by(), DecidedBy::Store);
    }
    let after = deployment.replica.command(&["DBSIZE"]);
    assert_ne!(before, after, "checks did not reach the new primary");
    assert_eq!(outage.store_before_failover, 0, "{outage:?}");
    match name {
        "open" => assert!(outage.fail_open > 0 && outage.errors == 0, "{outage:?}"),
        "closed" => assert!(outage.errors > 0 && outage.fail_open == 0, "{outage:?}"),
        _ => assert!(outage.fallback > 0 && outage.errors == 0, "{outage:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_failover_fail_open() {
    follows_a_failover(FailMode::Open, "open").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_failover_fail_closed() {
    follows_a_failover(FailMode::Closed, "closed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_failover_with_a_fallback() {
    follows_a_failover(FailMode::fallback(MemoryStore::new(), 2), "fallback").await;
}

/// Counts written to the primary after its last replication die with it:
/// on the new primary a key admits that many more, never more than its
/// limit again (at most 2 × max in the window of the failover), and the
/// next window is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreplicated_counts_are_lost_with_the_primary_and_over_admit_by_them_only() {
    let _slot = support::sentinel::one_of_three().await;
    let into_day = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 86_400;
    // The fixed and sliding windows of support::every_algorithm are
    // aligned to the UTC day: the test (a failover, up to a minute or two)
    // must not cross a day's end.
    if into_day > 86_400 - 300 {
        tokio::time::sleep(Duration::from_secs(86_400 - into_day + 1)).await;
    }
    let mut deployment = Deployment::start_with_link();
    let store = RedisStore::connect_sentinel(&deployment.sentinel_addresses(), SERVICE)
        .await
        .unwrap();
    // 2 of 5 counted and replicated.
    for (name, policy) in every_algorithm() {
        for _ in 0..2 {
            assert!(
                store.check(name, &policy).await.unwrap().allowed(),
                "{name}"
            );
        }
    }
    deployment.wait_replicated();
    // The replication stream is held from now on: 3 more counted on the
    // primary only.
    let link = deployment.link.take().unwrap();
    link.stall(Direction::ToClient, Duration::from_secs(600));
    for (name, policy) in every_algorithm() {
        admits_then_denies(&store, name, &policy, 3).await;
    }
    // The primary dies with them; the held bytes never arrive.
    let killed = Instant::now();
    deployment.primary.kill();
    link.refuse();
    link.cut_all();
    let mut failed_checks = 0;
    let probe: Policy = "100000/60s".parse().unwrap();
    while store.check("probe", &probe).await.is_err() {
        failed_checks += 1;
        assert!(killed.elapsed() < Duration::from_secs(60), "no failover");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let recovered = killed.elapsed();
    assert_eq!(deployment.named_primary(), Some(deployment.replica.port()));
    let mut over = Vec::new();
    for (name, policy) in every_algorithm() {
        let mut admitted = 0;
        for _ in 0..10 {
            if store.check(name, &policy).await.unwrap().allowed() {
                admitted += 1;
            }
        }
        // Exactly the 3 lost counts come back: 5 + 3 in this window, within
        // one limit of 5 over it.
        assert_eq!(admitted, 3, "{name}");
        over.push((name, admitted));
    }
    eprintln!(
        "FIGURE sentinel loss: store back after {recovered:?} ({failed_checks} failed checks); \
         admitted again on the new primary (of 3 unreplicated, limit 5): {over:?}"
    );
}

/// A primary frozen past the failover and then resumed is demoted by the
/// Sentinels to a replica of the new primary, about ten seconds later.
/// Meanwhile it would take every check sent on the connections the pool
/// holds to it (a split brain, discarded by its demotion): the store's
/// Sentinel watch retires them within a second. After the demotion its
/// `READONLY` answers would retire them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_left_for_the_new_one() {
    a_demoted_primary_is_left(FirstSentinel::Reachable).await;
}

/// The same with the first Sentinel the store knows unreachable: it
/// accepts connections and never answers (a frozen link). The store and
/// its watch ask the next ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_left_with_the_first_sentinel_unreachable() {
    a_demoted_primary_is_left(FirstSentinel::Frozen).await;
}

/// The same again, and the watch's connection to the Sentinel it asks (the
/// second) is cut before the freeze: the watch goes on to the third, not
/// back to the unreachable first one. (Through redis-rs's
/// `async_get_sentinel_client`, which checks every Sentinel on one cached
/// connection, it named the first and stayed blind: all checks in the
/// split brain were lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_left_when_the_watch_loses_its_sentinel() {
    a_demoted_primary_is_left(FirstSentinel::FrozenAndWatchCut).await;
}

/// The first Sentinel the store knows, in the demotion tests.
#[derive(Debug, Clone, Copy, PartialEq)]
enum FirstSentinel {
    Reachable,
    /// It accepts connections and never answers.
    Frozen,
    /// Frozen, and the watch's connection to the next one is cut.
    FrozenAndWatchCut,
}

/// The ids of the clients of `sentinel` whose last command was the watch's
/// question (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
fn watch_clients(sentinel: &support::sentinel::Sentinel) -> Vec<String> {
    sentinel
        .command(&["CLIENT", "LIST"])
        .lines()
        .filter(|line| line.to_lowercase().contains("get-master-addr-by-name"))
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("id="))
                .map(str::to_owned)
        })
        .collect()
}

async fn a_demoted_primary_is_left(first: FirstSentinel) {
    let _slot = support::sentinel::one_of_three().await;
    let deployment = Deployment::start();
    // The store reaches the first Sentinel through a proxy (the tests ask
    // it directly).
    let link = FaultProxy::start(deployment.sentinels[0].port());
    if first != FirstSentinel::Reachable {
        link.freeze(Duration::from_secs(3600));
    }
    let mut sentinels = deployment.sentinel_addresses();
    sentinels[0] = format!("127.0.0.1:{}", link.port());
    let store = RedisStore::connect_sentinel(&sentinels, SERVICE)
        .await
        .unwrap();
    let policy: Policy = "100000/60s".parse().unwrap();
    for (name, policy) in every_algorithm() {
        store.check(name, &policy).await.unwrap();
    }
    if first == FirstSentinel::FrozenAndWatchCut {
        let [_, second, third] = &deployment.sentinels[..] else {
            panic!("three Sentinels");
        };
        // The tests' own questions come on connections that close at once.
        wait_for(
            "the watch to ask the second Sentinel",
            Duration::from_secs(20),
            || !watch_clients(second).is_empty(),
        );
        for id in watch_clients(second) {
            second.command(&["CLIENT", "KILL", "ID", &id]);
        }
        wait_for(
            "the watch to ask the third Sentinel",
            Duration::from_secs(20),
            || !watch_clients(third).is_empty(),
        );
    }
    let old = deployment.primary.port();
    deployment.primary.signal("STOP");
    let stopped = Instant::now();
    wait_for("the failover", Duration::from_secs(60), || {
        deployment.named_primary() == Some(deployment.replica.port())
    });
    deployment.primary.signal("CONT");
    // The Sentinels demote the old primary when they see it again; until
    // then it takes writes on the connections the pool still holds to it
    // (a split brain), which its demotion discards.
    let resumed = Instant::now();
    let mut split = 0;
    // Checks once the store's Sentinel watch (every 0.5 s) has had time to
    // retire the connections to the old primary: each must count on the
    // new one (a key of their own), those that failed at most once. With
    // the first Sentinel unreachable, a question may first wait out its
    // 1 s budget there: one full run (two deployments at once on two
    // loaded cores) took 2.3 s, past the 1.5 s allowed before.
    let settled = if first == FirstSentinel::Reachable {
        Duration::from_millis(1500)
    } else {
        Duration::from_secs(3)
    };
    let mut late = 0;
    let mut late_failed = 0;
    // The demotion closes the primary's clients: a reset reply is "not yet".
    while !deployment
        .primary
        .try_command(&["INFO", "replication"])
        .is_ok_and(|reply| reply.contains("role:slave"))
    {
        let key = if resumed.elapsed() > settled {
            "split-late"
        } else {
            "split"
        };
        match store.check(key, &policy).await {
            Ok(decision) => {
                assert!(decision.allowed());
                split += 1;
                if key == "split-late" {
                    late += 1;
                }
            }
            Err(_) if key == "split-late" => late_failed += 1,
            Err(_) => {}
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(30),
            "the old primary was not demoted within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let since_resumed = resumed.elapsed();
    let demoted = stopped.elapsed();
    let kept = support::zcard(&deployment.replica, &store.redis_key("log", "split"));
    let kept_late = support::zcard(&deployment.replica, &store.redis_key("log", "split-late"));
    assert!(late > 0, "no check after the watch settled: {split} in all");
    assert!(
        (late..=late + late_failed).contains(&kept_late),
        "the old primary took checks {settled:?} after it came back: {kept_late} counted on \
         the new primary, of {late} admitted and {late_failed} failed then"
    );
    let kept = kept + kept_late;
    // Every check now counts on the new primary, whatever connections the
    // pool held to the old one.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut failed = 0;
    let mut ok_in_a_row = 0;
    while ok_in_a_row < 50 {
        match store.check("after-demotion", &policy).await {
            Ok(decision) => {
                assert!(decision.allowed());
                ok_in_a_row += 1;
            }
            Err(error) => {
                failed += 1;
                ok_in_a_row = 0;
                eprintln!("after demotion: {error}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "checks still fail after the demotion"
        );
    }
    for (name, policy) in every_algorithm() {
        store.check(name, &policy).await.unwrap();
    }
    let redis_key = store.redis_key("log", "after-demotion");
    let on_new = support::zcard(&deployment.replica, &redis_key);
    assert!(on_new >= 50, "{on_new} counted on the new primary");
    assert_ne!(deployment.named_primary(), Some(old));
    eprintln!(
        "FIGURE sentinel demotion (first Sentinel: {first:?}): demoted \
         {demoted:?} after the freeze, {since_resumed:?} after it resumed; admitted meanwhile \
         {split}, of which the new primary kept {kept}; {failed} checks failed after the demotion"
    );
}

/// `admitted` checks of `key` admitted, then one denied.
async fn admits_then_denies(store: &RedisStore, key: &str, policy: &Policy, admitted: usize) {
    for _ in 0..admitted {
        assert!(store.check(key, policy).await.unwrap().allowed(), "{key}");
    }
    assert!(!store.check(key, policy).await.unwrap().allowed(), "{key}");
}

/// Kill the primary and check through `store` every 10 ms until a check
/// is decided again (on the promoted replica): how long that took.
async fn kill_the_primary(store: &RedisStore, deployment: &mut Deployment) -> Duration {
    let killed = Instant::now();
    deployment.primary.kill();
    let probe: Policy = "100000/60s".parse().unwrap();
    while store.check("probe", &probe).await.is_err() {
        assert!(killed.elapsed() < Duration::from_secs(60), "no failover");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    killed.elapsed()
}

/// Without any Sentinel that knows the service, connecting fails and says so.
#[tokio::test]
async fn an_unknown_service_is_refused() {
    let _slot = support::sentinel::one_of_three().await;
    let deployment = Deployment::start();
    let error = RedisStore::connect_sentinel(&deployment.sentinel_addresses(), "no-such-service")
        .await
        .expect_err("connected to a service no Sentinel knows");
    eprintln!("{error}");
    assert!(
        error.to_string().to_lowercase().contains("master"),
        "{error}"
    );
    // A `Store` still works for the right one.
    let store = RedisStore::connect_sentinel(&deployment.sentinel_addresses(), SERVICE)
        .await
        .unwrap();
    store.ping().await.unwrap();
    let _ = store
        .check("k", &"1/1s".parse::<Policy>().unwrap())
        .await
        .unwrap();
}

/// `rediss+sentinel://`: TLS to the Sentinels and to Redis, with the
/// builder's root certificate, through a failover.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sentinel_urls_follow_a_failover() {
    let _slot = support::sentinel::one_of_three().await;
    use support::tls::Ca;

    let ca = Ca::new("sentinel CA");
    let mut deployment = Deployment::start_tls(&ca);
    let store = RedisStore::builder()
        .root_certificate(ca.pem())
        .connect(&deployment.tls_url())
        .await
        .unwrap();
    let (primary_tls, replica_tls) = deployment.tls_ports.unwrap();
    assert_eq!(deployment.named_primary(), Some(primary_tls));
    for (name, policy) in every_algorithm() {
        admits_then_denies(&store, name, &policy, 5).await;
    }
    // Untrusted: the system's roots do not know the test CA.
    let error = RedisStore::connect(&deployment.tls_url())
        .await
        .expect_err("connected to Sentinels whose CA is not trusted");
    assert!(error.to_string().contains("UnknownIssuer"), "{error}");

    deployment.wait_replicated();
    let back_after = kill_the_primary(&store, &mut deployment).await;
    assert_eq!(deployment.named_primary(), Some(replica_tls));
    // Over TLS on the new primary, the replicated counts hold.
    for (name, policy) in every_algorithm() {
        assert!(
            !store.check(name, &policy).await.unwrap().allowed(),
            "{name}"
        );
    }
    eprintln!("FIGURE sentinel over TLS: store back after {back_after:?}");
}

/// A least-privileged user (`RedisStore::acl_rules`, created on the primary
/// and the replica: ACLs are not replicated) is enough behind Sentinel,
/// across a failover: the primary's `ROLE` is in the rules. A wrong
/// password is refused, and does not show in the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acl_user_is_enough_behind_sentinel() {
    let _slot = support::sentinel::one_of_three().await;
    let mut deployment = Deployment::start();
    deployment.primary.least_privileged_url("rl");
    deployment.replica.least_privileged_url("rl");
    let with_user = |userinfo: &str| {
        deployment.url().replace(
            "redis+sentinel://",
            &format!("redis+sentinel://{userinfo}@"),
        )
    };
    let error = RedisStore::connect(&with_user("ratelimit:not-the-password"))
        .await
        .expect_err("connected with a wrong password");
    assert!(!error.to_string().contains("not-the-password"), "{error}");
    let store = RedisStore::connect(&with_user("ratelimit:least-privilege"))
        .await
        .unwrap();
    assert!(!format!("{store:?}").contains("least-privilege"));
    for (name, policy) in every_algorithm() {
        assert!(
            store.check(name, &policy).await.unwrap().allowed(),
            "{name}"
        );
    }
    kill_the_primary(&store, &mut deployment).await;
    assert_eq!(deployment.named_primary(), Some(deployment.replica.port()));
    for (name, policy) in every_algorithm() {
        store.check(name, &policy).await.unwrap();
    }
}

/// Connections opened at once in a new epoch (the pool's connections all
/// failed: `CLIENT KILL`) ask the Sentinels once, not once each: the
/// others wait for the first one's answer. A question asks one Sentinel
/// and has the primary it names confirmed by one `ROLE` there. (Each
/// connection asking in turn through redis-rs, which asks the three
/// Sentinels at once: 9 `ROLE` in this test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_opened_at_once_ask_the_sentinels_once() {
    let _slot = support::sentinel::one_of_three().await;
    let deployment = Deployment::start();
    let store = RedisStore::connect(&deployment.url()).await.unwrap();
    let policy: Policy = "1000000/60s".parse().unwrap();
    let burst = |round: usize| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let (store, policy) = (store.clone(), policy.clone());
                tokio::spawn(async move { store.check(&format!("{round}-{i}"), &policy).await })
            })
            .collect();
        async move {
            let mut failed = 0;
            for handle in handles {
                failed += usize::from(handle.await.unwrap().is_err());
            }
            failed
        }
    };
    assert_eq!(burst(0).await, 0);
    let roles = deployment.primary.calls("role");
    let opened = connections_received(&deployment.primary);
    // The checks that take a killed connection fail (and are retried on a
    // new one): a new epoch begins, in which the pool opens connections
    // for all the checks at once.
    let killed = deployment
        .primary
        .command(&["CLIENT", "KILL", "TYPE", "normal"]);
    assert!(killed.starts_with(':'), "CLIENT KILL: {killed}");
    let failed = burst(1).await;
    let asked = deployment.primary.calls("role") - roles;
    let opened = connections_received(&deployment.primary) - opened;
    eprintln!(
        "FIGURE sentinel: {opened} connections opened at once in a new epoch, {asked} ROLE, \
         {failed} of 64 checks failed"
    );
    assert!(
        opened >= 4,
        "only {opened} connections opened: no concurrency to test"
    );
    assert_eq!(
        asked, 1,
        "{opened} connections sent the primary {asked} ROLE: more than one question"
    );
    assert_eq!(burst(2).await, 0);
}

/// `total_connections_received` of `server`'s `INFO stats`.
fn connections_received(server: &support::RedisServer) -> u64 {
    server
        .command(&["INFO", "stats"])
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats has total_connections_received")
}

/// Sentinels that need a password (`requirepass`) get it from the
/// builder's `sentinel_credentials`, for the first lookup, the watch and
/// the lookups after a failover. Without it connecting fails with
/// Sentinel's reason; a wrong one shows neither in the error nor in the
/// builder's `Debug`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_with_a_password_take_the_builders_credentials() {
    let _slot = support::sentinel::one_of_three().await;
    let mut deployment = Deployment::start_with_sentinel_password("sentinel-secret");
    let error = RedisStore::connect(&deployment.url())
        .await
        .expect_err("connected to Sentinels that need a password without one");
    eprintln!("without credentials: {error}");
    assert!(error.to_string().to_lowercase().contains("auth"), "{error}");
    let wrong = RedisStore::builder().sentinel_credentials(None, "not-the-secret");
    assert!(
        !format!("{wrong:?}").contains("not-the-secret"),
        "{wrong:?}"
    );
    let error = wrong
        .connect(&deployment.url())
        .await
        .expect_err("connected with a wrong Sentinel password");
    assert!(!error.to_string().contains("not-the-secret"), "{error}");

    let builder = RedisStore::builder().sentinel_credentials(None, "sentinel-secret");
    assert!(
        !format!("{builder:?}").contains("sentinel-secret"),
        "{builder:?}"
    );
    let store = builder.connect(&deployment.url()).await.unwrap();
    for (name, policy) in every_algorithm() {
        admits_then_denies(&store, name, &policy, 5).await;
    }
    deployment.wait_replicated();
    kill_the_primary(&store, &mut deployment).await;
    assert_eq!(deployment.named_primary(), Some(deployment.replica.port()));
    for (name, policy) in every_algorithm() {
        assert!(
            !store.check(name, &policy).await.unwrap().allowed(),
            "{name}: the counts replicated before the kill"
        );
    }
}
