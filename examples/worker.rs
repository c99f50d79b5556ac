//! Workers sharing one outgoing rate to a slow third-party API, through the
//! `Limiter` engine (no HTTP server): each worker waits its turn with
//! `until_ready`, so together they never exceed the API's quota, however
//! many processes run them.
//!
//! ```sh
//! cargo run --example worker                                   # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example worker  # shared through Redis
//! REDIS_URL=redis://127.0.0.1:6379 MODE=throughput cargo run --release --example worker
//! ```
//!
//! | variable      | default   | meaning                                                     |
//! |---------------|-----------|-------------------------------------------------------------|
//! | `REDIS_URL`   | unset     | unset: the rate is held in this process; set: in Redis       |
//! | `MODE`        | `jobs`    | `jobs`: run `JOBS` calls; `throughput`: measure `check` at 1, 10 and 100 tasks |
//! | `WORKERS`     | `10`      | concurrent workers (`jobs`)                                  |
//! | `JOBS`        | `200`     | calls to make in all (`jobs`)                                |
//! | `RATE_LIMIT`  | `50/s`    | the third-party API's quota, such as `50/s` or `10/s, 300/min` |
//! | `LATENCY_MS`  | `40`      | how long the simulated API takes per call                    |
//! | `SECONDS`     | `3`       | how long each throughput case runs (`throughput`)            |
//!
//! `jobs` prints the calls made, the rate achieved, the most calls admitted
//! in any window of the policy (its max on a quiet machine: the times are
//! read by the workers after the store decided, so on a loaded machine a
//! worker descheduled in between can make a window look fuller than the
//! store counted it), and how long workers waited. `throughput` prints checks per second with 1, 10 and 100
//! concurrent tasks, every check admitted (a limit far above the load), so
//! it measures the limiter's round trip, not the quota.
//!
//! A bad setting is reported on stderr and the program exits with status 2.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_redis_ratelimit::limiter::DecidedBy;
use tower_redis_ratelimit::{FailMode, Limiter, MemoryStore, Policy, RedisStore};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let redis_url = var("REDIS_URL");
    let mode = var("MODE").unwrap_or_else(|| "jobs".into());
    match mode.as_str() {
        "jobs" => jobs(redis_url).await,
        "throughput" => throughput(redis_url).await,
        other => Err(format!("MODE: {other:?} is not `jobs` or `throughput`")),
    }
}

/// An environment variable; empty counts as unset.
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn number(name: &str, default: u64) -> Result<u64, String> {
    match var(name) {
        None => Ok(default),
        Some(text) => text
            .parse()
            .map_err(|_| format!("{name}: {text:?} is not a whole number")),
    }
}

/// A limiter on `policy`, in Redis when `redis_url` is set.
async fn limiter(redis_url: Option<&str>, policy: Policy) -> Result<Limiter, String> {
    Ok(match redis_url {
        None => Limiter::new(MemoryStore::new(), policy),
        Some(url) => {
            let store = RedisStore::connect(url)
                .await
                .map_err(|e| format!("REDIS_URL: cannot connect to {url}: {e}"))?;
            Limiter::new(store, policy)
        }
    })
    // One name whatever the policy text: every worker of every process
    // shares the count of the third-party API.
    .map(|limiter| limiter.with_name("worker-example"))
}

/// The simulated third-party API: takes `latency` per call and records
/// when each call was admitted by the limiter (the moment `until_ready`
/// returned: on a loaded machine a task may run later than that, so the
/// API itself can see calls bunched closer than the limiter let them go).
#[derive(Clone)]
struct ThirdPartyApi {
    latency: Duration,
    arrivals: Arc<Mutex<Vec<Instant>>>,
}

impl ThirdPartyApi {
    async fn call(&self, job: u64, admitted: Instant) -> u64 {
        self.arrivals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(admitted);
        tokio::time::sleep(self.latency).await;
        job * 2
    }

    /// The most calls admitted within any `window`.
    fn busiest(&self, window: Duration) -> usize {
        let mut arrivals = self
            .arrivals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        arrivals.sort();
        let mut most = 0;
        let mut start = 0;
        for (end, at) in arrivals.iter().enumerate() {
            while *at - arrivals[start] >= window {
                start += 1;
            }
            most = most.max(end + 1 - start);
        }
        most
    }
}

async fn jobs(redis_url: Option<String>) -> Result<(), String> {
    let workers = number("WORKERS", 10)?.max(1);
    let total = number("JOBS", 200)?;
    let latency = Duration::from_millis(number("LATENCY_MS", 40)?);
    let text = var("RATE_LIMIT").unwrap_or_else(|| "50/s".into());
    let policy: Policy = text
        .parse()
        .map_err(|e| format!("RATE_LIMIT: {text:?}: {e}"))?;
    let windows: Vec<(u64, Duration)> = policy
        .rates()
        .iter()
        .map(|r| (r.max(), r.window()))
        .collect();
    let limiter = limiter(redis_url.as_deref(), policy).await?;
    let api = ThirdPartyApi {
        latency,
        arrivals: Arc::default(),
    };
    let next_job = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (limiter, api, next_job) = (limiter.clone(), api.clone(), Arc::clone(&next_job));
        tasks.push(tokio::spawn(async move {
            let mut waited = Duration::ZERO;
            loop {
                let job = next_job.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if job >= total {
                    return Ok::<_, String>(waited);
                }
                let asked = Instant::now();
                // Wait for the shared quota (at most a minute per call).
                let _admitted = limiter
                    .until_ready("third-party-api", Duration::from_secs(60))
                    .await
                    .map_err(|e| format!("job {job}: {e}"))?;
                let admitted = Instant::now();
                waited += admitted - asked;
                api.call(job, admitted).await;
            }
        }));
    }
    let mut waited = Duration::ZERO;
    for task in tasks {
        waited += task.await.map_err(|e| format!("a worker failed: {e}"))??;
    }
    let elapsed = started.elapsed();
    println!(
        "{total} calls by {workers} workers in {:.2} s: {:.1} calls/s; {} store",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        if redis_url.is_some() {
            "Redis"
        } else {
            "in-memory"
        }
    );
    for (max, window) in windows {
        println!(
            "most calls admitted in any {window:?}: {} (limit {max})",
            api.busiest(window)
        );
    }
    println!(
        "mean wait for the quota: {:.1} ms per call",
        waited.as_secs_f64() * 1000.0 / total.max(1) as f64
    );
    Ok(())
}

async fn throughput(redis_url: Option<String>) -> Result<(), String> {
    let seconds = Duration::from_secs(number("SECONDS", 3)?.max(1));
    // Far above any load: every check is admitted and counted.
    let policy: Policy = "1000000000/s".parse().map_err(|e| format!("policy: {e}"))?;
    // A store failure is an error here, not an uncounted admission.
    let limiter = limiter(redis_url.as_deref(), policy)
        .await?
        .with_fail_mode(FailMode::Closed);
    println!("| concurrent tasks | checks/s | published (reference design) |");
    println!("|---:|---:|---:|");
    for (tasks, published) in [(1u64, 250u64), (10, 2_000), (100, 5_000)] {
        let deadline = Instant::now() + seconds;
        let mut handles = Vec::new();
        for task in 0..tasks {
            let limiter = limiter.clone();
            handles.push(tokio::spawn(async move {
                let key = format!("api-{}", task % 10);
                let mut admitted = 0u64;
                while Instant::now() < deadline {
                    match limiter.check(&key).await {
                        Ok(verdict) if verdict.allowed() && verdict.decided_by() == DecidedBy::Store => {
                            admitted += 1
                        }
                        Ok(verdict) => {
                            return Err(format!(
                                "a check was not admitted by the store under a huge limit: {verdict:?}"
                            ));
                        }
                        Err(e) => return Err(format!("check failed: {e}")),
                    }
                }
                Ok(admitted)
            }));
        }
        let mut admitted = 0;
        for handle in handles {
            admitted += handle.await.map_err(|e| format!("a task failed: {e}"))??;
        }
        println!(
            "| {tasks} | {:.0} | {published} |",
            admitted as f64 / seconds.as_secs_f64()
        );
    }
    Ok(())
}
