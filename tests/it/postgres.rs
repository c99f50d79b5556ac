//! `PostgresStore` against a real PostgreSQL server started by each test:
//! the conformance kit, two stores on one key, a connection dropped in the
//! middle of a transaction, and the server restarted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::support::postgres::{PostgresServer, every_algorithm};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::store::conformance;
use tower_redis_ratelimit::{Policy, PostgresStore, Store};

/// A store on a table of its own (each kit sequence starts empty).
fn kit_store(url: &str, clock: ManualClock) -> PostgresStore {
    static TABLES: AtomicU32 = AtomicU32::new(0);
    let table = format!("kit_{}", TABLES.fetch_add(1, Ordering::Relaxed));
    let builder = PostgresStore::builder(url).table(&table).clock(clock);
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(builder.connect()))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_passes_the_conformance_kit() {
    let server = PostgresServer::start();
    let url = server.url();
    if let Err(mismatch) = conformance::check_store(|clock| kit_store(&url, clock)).await {
        panic!("{mismatch}");
    }
}

/// Two stores (two pools, as two processes have) checking one key at
/// once on the database's clock: exactly the limit is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_checking_one_key_at_once_admit_exactly_the_limit() {
    let server = PostgresServer::start();
    let first = PostgresStore::connect(&server.url()).await.unwrap();
    let second = PostgresStore::connect(&server.url()).await.unwrap();
    for policy in every_algorithm(20) {
        let key = format!("shared-{}", policy.algorithm());
        let mut tasks = Vec::new();
        for i in 0..60 {
            let store = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            let (key, policy) = (key.clone(), policy.clone());
            tasks.push(tokio::spawn(async move {
                store.check(&key, &policy).await.unwrap().allowed()
            }));
        }
        let mut admitted = 0;
        for task in tasks {
            admitted += usize::from(task.await.unwrap());
        }
        assert_eq!(admitted, 20, "{policy} ({:?})", policy.algorithm());
    }
}

/// A 100/min key hit 1,000 times at 50 in flight, through one store that
/// keeps the rows it saw (its guesses race each other): exactly 100
/// admitted, and no check fails (none waits out the store's timeout, which
/// is long here only for a loaded machine). A frozen clock keeps the
/// windows from turning during the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_hit_1000_times_at_50_in_flight_admits_exactly_its_limit() {
    let server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .pool_size(50)
        .timeout(Duration::from_secs(10))
        .clock(ManualClock::new(Duration::from_secs(1_700_000_000)))
        .connect()
        .await
        .unwrap();
    for policy in every_algorithm(100) {
        let key = format!("hot-{}", policy.algorithm());
        let left = std::sync::Arc::new(AtomicU32::new(1000));
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let (store, key, policy, left) =
                (store.clone(), key.clone(), policy.clone(), left.clone());
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0;
                while left
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                    .is_ok()
                {
                    let decision = store.check(&key, &policy).await.unwrap();
                    admitted += u32::from(decision.allowed());
                }
                admitted
            }));
        }
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        assert_eq!(admitted, 100, "{policy} ({:?})", policy.algorithm());
    }
}

/// Two stores taking turns on one key: each finds the row the other wrote
/// since it last saw it (its guess misses), reads it, and counts on it:
/// every answer is the exact count. A frozen clock: nothing is given back
/// while the test runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_taking_turns_on_a_key_count_on_each_others_writes() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
    let store = || {
        PostgresStore::builder(&server.url())
            .clock(clock.clone())
            .connect()
    };
    let stores = [store().await.unwrap(), store().await.unwrap()];
    for policy in every_algorithm(600) {
        let key = format!("turns-{}", policy.algorithm());
        for i in 0..600u64 {
            let decision = stores[(i % 2) as usize].check(&key, &policy).await.unwrap();
            assert!(
                decision.allowed(),
                "{policy} ({:?}): check {i}",
                policy.algorithm()
            );
            assert_eq!(
                decision.remaining(),
                599 - i,
                "{policy} ({:?}): check {i}",
                policy.algorithm()
            );
        }
        let denied = stores[0].check(&key, &policy).await.unwrap();
        assert!(!denied.allowed(), "{policy} ({:?})", policy.algorithm());
    }
}

/// A connection cut while its write waits for the key's row (another
/// session holds it locked): the check fails, nothing is counted, and the
/// next check works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_while_its_write_waits_counts_nothing() {
    let server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1min".parse().unwrap();
    assert_eq!(store.check("k", &policy).await.unwrap().remaining(), 4);
    // Another session holds the key's row...
    let holder = server.client().await;
    holder
        .batch_execute("BEGIN; SELECT * FROM rate_limits WHERE key = 'k' FOR UPDATE")
        .await
        .unwrap();
    // ...so the store's write waits for it, and its connection is cut.
    let waiting = tokio::spawn({
        let (store, policy) = (store.clone(), policy.clone());
        async move { store.check("k", &policy).await }
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(4);
    let pid = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the store's write never waited for the lock"
        );
        let rows = holder
            .query(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap();
        if let Some(row) = rows.first() {
            break row.get::<_, i32>(0);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    holder
        .query("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let error = waiting.await.unwrap().expect_err("the cut check failed");
    eprintln!("{error}");
    holder.batch_execute("ROLLBACK").await.unwrap();
    // Nothing counted: the next check is the second.
    assert_eq!(store.check("k", &policy).await.unwrap().remaining(), 3);
}

/// The server restarted: checks fail while it is down, and its counts
/// are there when it is back (they are in its tables).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_outlive_a_restart_of_the_server() {
    let mut server = PostgresServer::start();
    let store = PostgresStore::builder(&server.url())
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1h".parse().unwrap();
    for _ in 0..3 {
        assert!(store.check("k", &policy).await.unwrap().allowed());
    }
    server.stop();
    assert!(
        store.check("k", &policy).await.is_err(),
        "a check while the server is down"
    );
    server.restart();
    let mut decision = store.check("k", &policy).await;
    // The pool's connections died with the server: the first checks after
    // it may fail until the pool has opened new ones.
    for _ in 0..20 {
        if decision.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        decision = store.check("k", &policy).await;
    }
    assert_eq!(
        decision.unwrap().remaining(),
        1,
        "the fourth request of five"
    );
}

/// What a client reads of the example server's answer: the status, the
/// header names, the limit and remaining, whether a `Retry-After` came.
fn answered(server: &crate::example_server::Server) -> (u16, Vec<String>, Vec<String>) {
    let (status, headers) = server.get("/", &[]);
    let mut names: Vec<String> = headers
        .iter()
        .map(|(name, _)| name.to_ascii_lowercase())
        .filter(|name| name != "date")
        .collect();
    names.sort();
    let values = headers
        .iter()
        .filter(|(name, _)| {
            let name = name.to_ascii_lowercase();
            name == "x-ratelimit-limit" || name == "x-ratelimit-remaining"
        })
        .map(|(name, value)| format!("{}: {value}", name.to_ascii_lowercase()))
        .collect();
    (status, names, values)
}

/// The example server on `DATABASE_URL` answers as on `REDIS_URL`: two
/// servers share one count, with the same statuses and headers; with the
/// database stopped, the fail modes answer as with Redis down.
#[test]
fn the_example_server_on_postgres_answers_as_on_redis() {
    use crate::example_server::Server;
    let postgres = PostgresServer::start();
    let redis = crate::support::RedisServer::start();
    let two_servers = |var: &str, url: &str| {
        let first = Server::start(&[("RATE_LIMIT", "3/min"), (var, url)]);
        let second = Server::start(&[("RATE_LIMIT", "3/min"), (var, url)]);
        (0..5)
            .map(|i| answered(if i % 2 == 0 { &first } else { &second }))
            .collect::<Vec<_>>()
    };
    let on_postgres = two_servers("DATABASE_URL", &postgres.url());
    let on_redis = two_servers("REDIS_URL", &redis.url());
    assert_eq!(on_postgres, on_redis);
    let statuses: Vec<u16> = on_postgres.iter().map(|a| a.0).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert!(
        on_postgres[3].1.contains(&"retry-after".to_owned()),
        "{on_postgres:?}"
    );

    // A database of its own: the first one holds the counts above.
    let mut postgres = PostgresServer::start();
    let url = postgres.url();
    let closed = Server::start(&[
        ("RATE_LIMIT", "1/min"),
        ("DATABASE_URL", &url),
        ("FAIL_MODE", "closed"),
    ]);
    let open = Server::start(&[("RATE_LIMIT", "1/min"), ("DATABASE_URL", &url)]);
    assert_eq!(closed.status(&[]), 200, "PostgreSQL up: limited as usual");
    postgres.stop();
    assert_eq!(closed.status(&[]), 503);
    assert_eq!(
        open.status(&[]),
        200,
        "open admits while PostgreSQL is down"
    );
    assert_eq!(closed.get("/health", &[]).0, 200, "health is never limited");
}

/// Rows whose state stopped mattering are deleted as the store writes, a
/// bounded batch at a time; rows that still count stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_deleted_in_bounded_batches() {
    let server = PostgresServer::start();
    let clock = ManualClock::new(Duration::from_secs(1_700_000_000));
    let store = PostgresStore::builder(&server.url())
        .clock(clock.clone())
        .connect()
        .await
        .unwrap();
    let client = server.client().await;
    let rows = || async {
        let row = client
            .query_one("SELECT count(*) FROM rate_limits", &[])
            .await
            .unwrap();
        row.get::<_, i64>(0)
    };
    let short: Policy = "1/1s".parse().unwrap();
    let long: Policy = "1/1h".parse().unwrap();
    // `n` writes of the long key: a cleanup every 256.
    let busy: Policy = "1000/1h".parse().unwrap();
    let writes = |n| {
        let (store, busy) = (&store, &busy);
        async move {
            for _ in 0..n {
                store.check("long", busy).await.unwrap();
            }
        }
    };
    for i in 0..600 {
        store.check(&format!("short-{i}"), &short).await.unwrap();
    }
    store.check("long", &long).await.unwrap();
    assert_eq!(rows().await, 601);
    // Past the short rows' states: their rows are kept five minutes more
    // (rounded up to the minute), for a key used again to write in place.
    clock.advance(Duration::from_secs(5 * 60));
    writes(256).await;
    assert_eq!(rows().await, 601, "expired, but kept a while");
    clock.advance(Duration::from_secs(61));
    // The next writes delete 256 expired rows each 256 decisions.
    writes(256).await;
    let left = rows().await;
    assert!(
        (601 - 2 * 256..=601 - 256).contains(&left),
        "{left} rows left after one or two cleanups"
    );
    writes(512).await;
    assert_eq!(rows().await, 1, "only the row that still counts");
}

/// Any key a client sends is a key: a NUL, bytes of any script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_any_characters_are_counted() {
    let server = PostgresServer::start();
    let store = PostgresStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "1/1min".parse().unwrap();
    for key in [
        "nul\0key",
        "ключ",
        "{brace}",
        "'; DROP TABLE rate_limits; --",
    ] {
        assert!(
            store.check(key, &policy).await.unwrap().allowed(),
            "{key:?}"
        );
        assert!(
            !store.check(key, &policy).await.unwrap().allowed(),
            "{key:?}"
        );
    }
}

/// A database that refuses connections fails a decision at once, with its
/// error, not after the store's timeout; so does a store connecting to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_fails_at_once_with_its_error() {
    let mut server = PostgresServer::start();
    let url = server.url();
    let store = PostgresStore::builder(&url)
        .timeout(Duration::from_secs(20))
        .connect()
        .await
        .unwrap();
    let policy: Policy = "5/1min".parse().unwrap();
    assert!(store.check("k", &policy).await.unwrap().allowed());
    server.stop();
    for attempt in 0..3 {
        let asked = std::time::Instant::now();
        let error = store
            .check("k", &policy)
            .await
            .expect_err("the server is stopped");
        // Well within the store's 20 s timeout (a refusal takes
        // milliseconds); not a pool timeout.
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "attempt {attempt}: {error}"
        );
        assert!(
            !matches!(error, tower_redis_ratelimit::StoreError::PoolTimeout),
            "{error}"
        );
    }
    let error = PostgresStore::builder(&url)
        .timeout(Duration::from_secs(20))
        .connect()
        .await
        .expect_err("the server is stopped");
    assert!(error.to_string().contains("postgres"), "{error}");
    server.restart();
    assert!(
        store.check("k", &policy).await.unwrap().allowed(),
        "back with the server"
    );
}

/// The rules' engine and the deny cache on PostgreSQL: a rule counts in
/// the database, and a flood after a denial is answered without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_the_deny_cache_work_on_postgres() {
    use http::Method;
    use tower_redis_ratelimit::rules::{Call, RuleSet, Rules};

    let server = PostgresServer::start();
    let store = PostgresStore::connect(&server.url()).await.unwrap();
    let text = "[[rules]]\nname = \"jobs\"\ngrpc = \"/jobs.Queue/*\"\nkey = \"global\"\n\
                policy = \"2/h\"\nalgorithm = \"fixed_window\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap());
    let check = || {
        rules
            .current()
            .check(&Method::POST, "/jobs.Queue/Run", None, |_| {
                Ok::<_, std::convert::Infallible>(Some(Call::new("tenant-1")))
            })
            .unwrap()
    };
    let client = server.client().await;
    // Write transactions of the server so far.
    let writes = || async {
        let row = client
            .query_one(
                "SELECT txid_snapshot_xmax(txid_current_snapshot())::bigint",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0)
    };
    assert!(check().await.unwrap().allowed());
    assert!(check().await.unwrap().allowed());
    assert!(!check().await.unwrap().allowed(), "the third of 2/h");
    let before = writes().await;
    for _ in 0..50 {
        assert!(!check().await.unwrap().allowed());
    }
    assert_eq!(
        writes().await,
        before,
        "the flood was answered by the deny cache"
    );
}

/// The example server with `DATABASE_URL` refuses Redis's own settings,
/// exiting 2 with a message naming each, before it connects anywhere.
#[test]
fn redis_settings_beside_database_url_exit_2_naming_them() {
    use crate::example_server::{command, refused_by};
    for (name, value) in [
        ("EXECUTION", "script"),
        ("REDIS_CA_CERT", "/etc/ssl/redis-ca.pem"),
        ("REDIS_CLIENT_CERT", "/etc/ssl/client.pem"),
        ("REDIS_CLIENT_KEY", "/etc/ssl/client.key"),
    ] {
        let vars = [
            ("DATABASE_URL", "host=127.0.0.1 port=1 user=app"),
            (name, value),
        ];
        let (status, stderr) = refused_by(command(None), &vars);
        assert_eq!(status, Some(2), "{name}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("{name}: ")),
            "{name}={value}: the message names the variable: {stderr}"
        );
    }
}
