//! A bench's load: calls from many tasks at once for a while, and what
//! came of them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Run `call` from `concurrency` tasks for `seconds`: calls per second,
/// and the p50 and p99 latency in µs.
pub(crate) async fn load<F, Fut>(seconds: Duration, concurrency: usize, call: F) -> (f64, f64, f64)
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let counter = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (call, counter, stop) = (call.clone(), Arc::clone(&counter), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let at = Instant::now();
                    call(n).await;
                    latencies.push(at.elapsed().as_micros() as u32);
                }
                latencies
            })
        })
        .collect();
    tokio::time::sleep(seconds).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: f64| f64::from(all[((all.len() - 1) as f64 * q) as usize]);
    (all.len() as f64 / elapsed, at(0.5), at(0.99))
}
