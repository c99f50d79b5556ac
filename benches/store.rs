//! Decisions per second through `RedisStore`, and the ceiling of the same
//! Redis commands sent by a client that does nothing else.
//!
//! Run by `scripts/bench`, which starts the redis-server and prints the
//! table; by hand:
//!
//! ```sh
//! BENCH_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench store -- store
//! BENCH_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench store -- ceiling-transaction
//! BENCH_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench store -- memory
//! BENCH_REDIS_URL=redis://127.0.0.1:6379 cargo bench --bench store -- settle
//! ```
//!
//! Every measurement prints one line `RESULT <name> <value>`; the `settle`
//! mode also prints `CLIENT_CPU <name> <µs>`, this process's CPU per
//! decision.
//!
//! Settings (environment): `BENCH_REDIS_URL` (required), `BENCH_SECONDS`
//! (each measurement, default 5), `BENCH_CONCURRENCY` (checks in flight,
//! default 50), `BENCH_KEYS` (distinct keys, default 10,000), `BENCH_BATCHES`
//! (batches in flight per algorithm, `RedisStore::with_batches`), `BENCH_ONLY`
//! (run only the store and settle measurements whose name contains it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bb8_redis::bb8::Pool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::store::TrackedManager;
use tower_redis_ratelimit::{Limiter, Policy, RedisStore, Store};

/// A limit no key of the run reaches: every check is admitted and writes.
const GENEROUS: &str = "1000000/s";
/// A limit that denies every check of a key after its first.
const STRICT: &str = "1/h";

struct Settings {
    url: String,
    seconds: Duration,
    concurrency: usize,
    keys: u64,
    only: Option<String>,
}

impl Settings {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let number = |name: &str, default: u64| {
            var(name).map_or(default, |v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
            })
        };
        Self {
            url: var("BENCH_REDIS_URL").expect(
                "set BENCH_REDIS_URL to a redis-server the bench may fill (scripts/bench does)",
            ),
            seconds: Duration::from_secs_f64(
                var("BENCH_SECONDS").map_or(5.0, |v| v.parse().expect("BENCH_SECONDS")),
            ),
            concurrency: usize::try_from(number("BENCH_CONCURRENCY", 50)).unwrap(),
            keys: number("BENCH_KEYS", 10_000),
            only: var("BENCH_ONLY"),
        }
    }
}

#[tokio::main]
async fn main() {
    let settings = Settings::from_env();
    // `cargo bench` passes `--bench`; the first other argument is the mode.
    let mode = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_else(|| "store".to_owned());
    match mode.as_str() {
        "store" => store(&settings).await,
        "ceiling-transaction" => ceiling_transaction(&settings).await,
        "ceiling-script" => ceiling_script(&settings).await,
        "memory" => memory(&settings).await,
        "settle" => settle(&settings).await,
        other => panic!(
            "unknown mode {other:?}: use store, ceiling-transaction, ceiling-script, memory or settle"
        ),
    }
}

/// The policies measured: every algorithm, and both executions of the
/// sliding log.
fn policies() -> Vec<(&'static str, Policy)> {
    let base: Policy = GENEROUS.parse().unwrap();
    vec![
        (
            "sliding-log/transaction",
            base.clone().with_execution(Execution::Transaction).unwrap(),
        ),
        (
            "sliding-log/script",
            base.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("fixed-window", base.clone().fixed_window().unwrap()),
        ("sliding-window", base.clone().sliding_window().unwrap()),
        ("gcra", base.gcra().unwrap()),
        (
            "concurrency",
            // A lease of 1 s: the run's leases expire as it goes.
            Policy::concurrency(1_000_000)
                .unwrap()
                .with_lease(Duration::from_secs(1))
                .unwrap(),
        ),
    ]
}

async fn tracked_pool(url: &str, size: u32) -> RedisStore {
    let manager = TrackedManager::new(url).unwrap();
    let pool = Pool::builder()
        .max_size(size)
        .min_idle(Some(size))
        .test_on_check_out(false)
        .build(manager)
        .await
        .unwrap();
    RedisStore::from_tracked_pool(pool)
}

async fn bb8_redis_pool(url: &str, size: u32) -> RedisStore {
    let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
    let pool = Pool::builder()
        .max_size(size)
        .min_idle(Some(size))
        .build(manager)
        .await
        .unwrap();
    RedisStore::from_pool(pool)
}

async fn connection_manager(url: &str) -> RedisStore {
    let manager = redis::Client::open(url)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    RedisStore::from_connection_manager(manager)
}

/// Every algorithm through the default source (`RedisStore::connect`, a
/// pool of 16), then the connection sources compared on GCRA and the
/// sliding log's transaction.
async fn store(settings: &Settings) {
    let mut runs: Vec<(String, RedisStore, Policy)> = Vec::new();
    let mut default = RedisStore::connect(&settings.url).await.unwrap();
    if let Some(batches) = std::env::var("BENCH_BATCHES")
        .ok()
        .filter(|v| !v.is_empty())
    {
        default = default.with_batches(batches.parse().expect("BENCH_BATCHES"));
    }
    for (name, policy) in policies() {
        runs.push((format!("store/{name}/connect"), default.clone(), policy));
    }
    // The same algorithms at one request an hour: after each key's first
    // check, every check is a denial.
    let strict: Policy = STRICT.parse().unwrap();
    for (name, policy) in [
        (
            "sliding-log/transaction",
            strict
                .clone()
                .with_execution(Execution::Transaction)
                .unwrap(),
        ),
        (
            "sliding-log/script",
            strict.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("fixed-window", strict.clone().fixed_window().unwrap()),
        ("sliding-window", strict.clone().sliding_window().unwrap()),
        ("gcra", strict.clone().gcra().unwrap()),
    ] {
        runs.push((
            format!("store/{name}/denied/connect"),
            default.clone(),
            policy,
        ));
    }
    for (name, policy) in policies()
        .into_iter()
        .filter(|(name, _)| *name == "gcra" || *name == "sliding-log/transaction")
    {
        for size in [4, 8, 50] {
            runs.push((
                format!("store/{name}/tracked-pool-{size}"),
                tracked_pool(&settings.url, size).await,
                policy.clone(),
            ));
        }
        runs.push((
            format!("store/{name}/bb8-redis-pool-16"),
            bb8_redis_pool(&settings.url, 16).await,
            policy.clone(),
        ));
        runs.push((
            format!("store/{name}/connection-manager"),
            connection_manager(&settings.url).await,
            policy,
        ));
    }
    for (name, store, policy) in runs {
        if settings
            .only
            .as_ref()
            .is_some_and(|only| !name.contains(only))
        {
            continue;
        }
        // A `/denied` case denies every check of a key after its first.
        let admits = !name.contains("/denied/");
        let rate = decisions_per_second(settings, store, policy, admits).await;
        println!("RESULT {name} {rate:.0}");
    }
    let name = "store/floor-incrby-expire/connect";
    if settings
        .only
        .as_ref()
        .is_none_or(|only| name.contains(only))
    {
        let rate = floor_decisions_per_second(settings).await;
        println!("RESULT {name} {rate:.0}");
    }
    for (name, script) in PEERS {
        let name = format!("store/{name}/connect");
        if settings
            .only
            .as_ref()
            .is_some_and(|only| !name.contains(only))
        {
            continue;
        }
        let rate = peer_decisions_per_second(settings, &name, script).await;
        println!("RESULT {name} {rate:.0}");
    }
}

/// What the peers' Redis work per decision is measured against: their
/// scripts as they run them, sent the way `RedisStore` sends its own (a
/// bb8 pool of 16 multiplexed connections, each checked out, cloned and
/// given back at once; 50 checks in flight over 10,000 keys), so the
/// socket reads per decision are alike and the scripts' work differs.
/// `KEYS[1]` the key; `ARGV`: the cost, the window (ms), the max, the time
/// (µs) and a unique member.
const PEERS: [(&str, &str); 2] = [
    // rate-limiter-flexible 11's fixed window (RateLimiterRedis): set the
    // key to 0 with its expiry if it is new, add the points, read the TTL.
    (
        "peer-rlf-fixed-window",
        r"
        redis.call('set', KEYS[1], 0, 'PX', ARGV[2], 'NX')
        local consumed = redis.call('incrby', KEYS[1], ARGV[1])
        local ttl = redis.call('pttl', KEYS[1])
        return {consumed, ttl}
        ",
    ),
    // The minimal one-rate sliding log: trim, count, add when under the
    // max, expire.
    (
        "peer-minimal-sliding-log",
        r"
        local now = tonumber(ARGV[4])
        local window = tonumber(ARGV[2]) * 1000
        redis.call('zremrangebyscore', KEYS[1], '-inf', now - window)
        if redis.call('zcard', KEYS[1]) < tonumber(ARGV[3]) then
          redis.call('zadd', KEYS[1], now, ARGV[5])
          redis.call('pexpire', KEYS[1], ARGV[2])
          return 1
        end
        return 0
        ",
    ),
];

/// The floor Redis allows a fixed window: per check the reference rate
/// limit server's two plain commands, pipelined (`INCRBY` of the key's
/// count in the current 1 s window and `PEXPIRE`), from every caller over
/// one multiplexed connection, so Redis reads many per wake-up. What
/// Redis spends on it is what a decision cannot cost less than.
async fn floor_decisions_per_second(settings: &Settings) -> f64 {
    let connection = redis::Client::open(settings.url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let check = move |k: u64| {
        let mut connection = connection.clone();
        async move {
            let second = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let key = format!("floor:{{k{k}}}:1000000:{second}");
            let _: (u64, u64) = redis::pipe()
                .cmd("INCRBY")
                .arg(&key)
                .arg(1)
                .cmd("PEXPIRE")
                .arg(&key)
                .arg(1000)
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    };
    // Warm up, as the other cases do.
    for k in 0..200 {
        check(k).await;
    }
    run_for(settings, check).await
}

/// Decisions per second of a peer's script, as [`decisions_per_second`].
async fn peer_decisions_per_second(settings: &Settings, name: &str, script: &str) -> f64 {
    let manager = bb8_redis::RedisConnectionManager::new(settings.url.as_str()).unwrap();
    let pool = Pool::builder()
        .max_size(16)
        .test_on_check_out(false)
        .build(manager)
        .await
        .unwrap();
    // As the store does: a clone of a pooled connection, which goes back.
    let connection = {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { (*pool.get().await.unwrap()).clone() }
        }
    };
    let script = Arc::new(redis::Script::new(script));
    // Warm up: the script loaded.
    for i in 0..200 {
        peer_check(&mut connection().await, &script, name, i).await;
    }
    let name: Arc<str> = Arc::from(name);
    run_for(settings, move |k| {
        let (script, connection, name) = (script.clone(), connection.clone(), name.clone());
        async move { peer_check(&mut connection().await, &script, &name, k).await }
    })
    .await
}

/// One check of key `k` by a peer's script: cost 1, a window of 1 s, a
/// max no key reaches. Each peer case has keys of its own (`name`): the
/// peers keep different types under them.
async fn peer_check(
    connection: &mut redis::aio::MultiplexedConnection,
    script: &redis::Script,
    name: &str,
    k: u64,
) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros();
    let member = format!("{now:x}{k:x}");
    let _: redis::Value = script
        .key(format!("peer:{name}:{{k{k}}}"))
        .arg(1)
        .arg(1000)
        .arg(1_000_000)
        .arg(now.to_string())
        .arg(member)
        .invoke_async(connection)
        .await
        .unwrap();
}

/// `settings.concurrency` tasks checking random keys of `settings.keys` for
/// `settings.seconds`; the decisions per second, each one admitted if
/// `admits`. Concurrency leases are released (a second round trip, not
/// counted as a decision).
async fn decisions_per_second(
    settings: &Settings,
    store: RedisStore,
    policy: Policy,
    admits: bool,
) -> f64 {
    let store = Arc::new(store);
    let policy = Arc::new(policy);
    // Warm up: scripts loaded, clock measured, connections open.
    for i in 0..200 {
        store.check(&format!("k{i}"), &policy).await.unwrap();
    }
    run_for(settings, move |k| {
        let (store, policy) = (store.clone(), policy.clone());
        async move {
            let key = format!("k{k}");
            let decision = store.check(&key, &policy).await.unwrap();
            assert!(
                decision.allowed() || !admits,
                "the bench's limit was reached"
            );
            if let Some(lease) = decision.lease() {
                store.release(&key, &policy, lease).await.unwrap();
            }
        }
    })
    .await
}

/// The estimate a settled request reserves, which is also the cost of
/// the plain check beside it (the same policy): the sliding log writes an
/// entry per unit.
const ESTIMATE: u64 = 10;

/// Per decision: a plain `Limiter::check` (`None`), or `reserve` of
/// [`ESTIMATE`] then `settle` at the real cost given.
const SETTLES: [(&str, Option<u64>); 4] = [
    ("check", None),
    // Nothing sent after the check.
    ("as-estimated", Some(ESTIMATE)),
    // A penalty of 5.
    ("up", Some(ESTIMATE + 5)),
    // A refund of 5.
    ("down", Some(ESTIMATE - 5)),
];

/// A cost settled after the response beside a plain check, through the
/// engine (`Limiter` over `RedisStore::connect`, as the HTTP layer runs
/// it), for GCRA and both executions of the sliding log: `settle/<algo>/`
/// followed by a name of [`SETTLES`]. Prints the decisions per second and
/// this process's CPU per decision (the client's time).
async fn settle(settings: &Settings) {
    let store = RedisStore::connect(&settings.url).await.unwrap();
    let algorithms = ["gcra", "sliding-log/transaction", "sliding-log/script"];
    for (algo, policy) in policies()
        .into_iter()
        .filter(|(name, _)| algorithms.contains(name))
    {
        let policy = policy.with_cost(ESTIMATE).unwrap();
        for (variant, cost) in SETTLES {
            let name = format!("settle/{algo}/{variant}");
            if settings
                .only
                .as_ref()
                .is_some_and(|only| !name.contains(only))
            {
                continue;
            }
            let limiter = Limiter::new(store.clone(), policy.clone()).with_name(algo);
            let decide = move |k: u64| {
                let limiter = limiter.clone();
                async move {
                    let key = format!("k{k}");
                    let allowed = match cost {
                        None => limiter.check(&key).await.unwrap().allowed(),
                        Some(cost) => {
                            let reservation = limiter.reserve(&key, ESTIMATE).await.unwrap();
                            let allowed = reservation.allowed();
                            reservation.settle(cost).await.unwrap();
                            allowed
                        }
                    };
                    assert!(allowed, "the bench's limit was reached");
                }
            };
            // Warm up: scripts loaded, clock measured, connections open.
            for i in 0..200 {
                decide(i).await;
            }
            let (cpu, started) = (cpu_seconds(), Instant::now());
            let rate = run_for(settings, decide).await;
            let decisions = rate * started.elapsed().as_secs_f64();
            println!("RESULT {name} {rate:.0}");
            if let (Some(before), Some(after)) = (cpu, cpu_seconds()) {
                let micros = (after - before) * 1e6 / decisions;
                println!("CLIENT_CPU {name} {micros:.2}");
            }
        }
    }
}

/// This process's CPU time so far (user + system, every thread), from
/// `/proc/self/stat` (Linux; in clock ticks of 1/100 s, the `USER_HZ` of
/// every Linux architecture).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name in parentheses: state, then fields 4 to 52;
    // utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// `settings.concurrency` tasks each running `check` of random keys of
/// `settings.keys` one after another for `settings.seconds`: the checks
/// per second.
async fn run_for<F, Fut>(settings: &Settings, check: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..settings.concurrency {
        let (check, stop, done) = (check.clone(), stop.clone(), done.clone());
        let keys = settings.keys;
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (task as u64 + 1));
            let mut checked = 0u64;
            while !stop.load(Ordering::Relaxed) {
                check(rng.next() % keys).await;
                checked += 1;
            }
            done.fetch_add(checked, Ordering::Relaxed);
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(settings.seconds).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6D_4F1D)
    }
}

/// The ceiling of the sliding log's `Transaction` execution:
/// `redis-benchmark` sends one command at a time, so this client sends the
/// store's exact `MULTI` … `EXEC` batch (ZREMRANGEBYSCORE, ZADD, ZCOUNT,
/// ZREVRANGE ×2, PEXPIRE, TIME) from `settings.concurrency` raw connections,
/// one batch in flight on each, and only counts the replies.
async fn ceiling_transaction(settings: &Settings) {
    let rate = raw_ceiling(settings, |rng, now, out| {
        let key = format!("rl:log:{{k{}}}", rng.next() % 10_000);
        let member = format!("{:032x}", u128::from(rng.next()));
        let window = 1_000_000u64;
        let commands: [&[&str]; 9] = [
            &["MULTI"],
            &[
                "ZREMRANGEBYSCORE",
                &key,
                "-inf",
                &(now - window).to_string(),
            ],
            &["ZADD", &key, &now.to_string(), &member],
            &["ZCOUNT", &key, &format!("({}", now - window), "+inf"],
            &["ZREVRANGE", &key, "1000000", "1000000", "WITHSCORES"],
            &["ZREVRANGE", &key, "0", "1", "WITHSCORES"],
            &["PEXPIRE", &key, "1000"],
            &["TIME"],
            &["EXEC"],
        ];
        for command in commands {
            encode(out, command);
        }
        commands.len()
    })
    .await;
    println!("RESULT ceiling/sliding-log/transaction {rate:.0}");
}

/// The same raw client sending one `EVALSHA` of GCRA per request, to compare
/// it with `redis-benchmark` running the same command.
async fn ceiling_script(settings: &Settings) {
    let sha = script_sha(settings, tower_redis_ratelimit::store::scripts::GCRA_SCRIPT).await;
    let rate = raw_ceiling(settings, move |rng, _now, out| {
        let k = rng.next() % 10_000;
        let key = format!("rl:gcra:{{k{k}}}");
        let block = format!("rl:block:{{k{k}}}");
        encode(
            out,
            &[
                "EVALSHA", &sha, "2", &key, &block, "1", "1000000", "1000000",
            ],
        );
        1
    })
    .await;
    println!("RESULT ceiling-raw/gcra {rate:.0}");
}

async fn script_sha(settings: &Settings, script: &str) -> String {
    let client = redis::Client::open(settings.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Batches per second from `settings.concurrency` connections, each with one
/// batch (made by `batch`, which returns how many replies it asks for) in
/// flight.
async fn raw_ceiling(
    settings: &Settings,
    batch: impl Fn(&mut Rng, u64, &mut Vec<u8>) -> usize + Send + Sync + 'static,
) -> f64 {
    let batch = Arc::new(batch);
    let addr = settings
        .url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..settings.concurrency {
        let (stop, done, addr, batch) = (stop.clone(), done.clone(), addr.clone(), batch.clone());
        tasks.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(&addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (task as u64 + 1));
            let mut out = Vec::with_capacity(512);
            let mut input = Vec::with_capacity(4096);
            let mut batches = 0u64;
            while !stop.load(Ordering::Relaxed) {
                out.clear();
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_micros() as u64;
                let mut want = batch(&mut rng, now, &mut out);
                stream.write_all(&out).await.unwrap();
                input.clear();
                let mut parsed = 0;
                while want > 0 {
                    if let Some(len) = reply_len(&input[parsed..]) {
                        assert_ne!(
                            input[parsed],
                            b'-',
                            "redis error: {:?}",
                            String::from_utf8_lossy(&input[parsed..parsed + len])
                        );
                        parsed += len;
                        want -= 1;
                        continue;
                    }
                    let mut chunk = [0u8; 4096];
                    let n = stream.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "redis closed the connection");
                    input.extend_from_slice(&chunk[..n]);
                }
                batches += 1;
            }
            done.fetch_add(batches, Ordering::Relaxed);
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(settings.seconds).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// One command in RESP.
fn encode(out: &mut Vec<u8>, args: &[&str]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// The length of the first complete RESP2 reply in `buf`, if it is all there.
fn reply_len(buf: &[u8]) -> Option<usize> {
    let line_end = buf.windows(2).position(|w| w == b"\r\n")?;
    let header = std::str::from_utf8(&buf[1..line_end]).ok()?;
    let after = line_end + 2;
    match buf.first()? {
        b'+' | b'-' | b':' => Some(after),
        b'$' => {
            let len: i64 = header.parse().ok()?;
            if len < 0 {
                return Some(after);
            }
            let end = after + usize::try_from(len).ok()? + 2;
            (buf.len() >= end).then_some(end)
        }
        b'*' => {
            let count: i64 = header.parse().ok()?;
            let mut at = after;
            for _ in 0..count.max(0) {
                at += reply_len(&buf[at..])?;
            }
            Some(at)
        }
        other => panic!("unexpected RESP type byte {other}"),
    }
}

/// `MEMORY USAGE` of one key filled with `max` admitted requests, for each
/// algorithm and max 10, 100 and 1000.
async fn memory(settings: &Settings) {
    let store = RedisStore::connect(&settings.url)
        .await
        .unwrap()
        .with_prefix("bench-memory");
    let client = redis::Client::open(settings.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for max in [10u64, 100, 1000] {
        let base: Policy = format!("{max}/min").parse().unwrap();
        let cases = [
            (
                "sliding-log",
                "log",
                base.clone().with_execution(Execution::Script).unwrap(),
            ),
            (
                "fixed-window",
                "fixed",
                base.clone().fixed_window().unwrap(),
            ),
            (
                "sliding-window",
                "swc",
                base.clone().sliding_window().unwrap(),
            ),
            ("gcra", "gcra", base.clone().gcra().unwrap()),
            (
                "concurrency",
                "conc",
                Policy::concurrency(max)
                    .unwrap()
                    .with_lease(Duration::from_secs(60))
                    .unwrap(),
            ),
        ];
        // `tag`: the algorithm's part of the Redis key (`rl:<tag>:{key}`).
        for (name, tag, policy) in cases {
            let key = format!("memory-{max}");
            for _ in 0..max {
                let decision = store.check(&key, &policy).await.unwrap();
                assert!(decision.allowed());
            }
            // The key, and the window counters' counts beside it
            // (`<key>:<window>:<index>`).
            let redis_key = store.redis_key(tag, &key);
            let mut keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{redis_key}:*"))
                .query_async(&mut conn)
                .await
                .unwrap();
            keys.push(redis_key);
            let mut bytes = 0;
            for key in keys {
                let used: Option<u64> = redis::cmd("MEMORY")
                    .arg("USAGE")
                    .arg(&key)
                    .arg("SAMPLES")
                    .arg(0)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                bytes += used.unwrap_or(0);
            }
            println!("RESULT memory/{name}/{max} {bytes}");
        }
    }
}
