//! The same cases run on every store and every algorithm.

use std::time::Duration;

/// One module of tests per backend, each with one `#[tokio::test]` per case
/// that runs the case (an `async fn(Harness)` of the calling file) on a
/// fresh harness made by that backend's expression:
///
/// ```ignore
/// support::suite! {
///     cases: [admits_max_then_denies, cost],
///     memory: Harness::memory(),
///     redis: Harness::redis(Execution::Script).await,
/// }
/// ```
///
/// makes `memory::admits_max_then_denies`, `memory::cost`,
/// `redis::admits_max_then_denies` and `redis::cost`. Attributes before a
/// backend (`#[cfg(feature = "cluster")]`) apply to its module.
#[allow(unused_macros)]
macro_rules! suite {
    (cases: $cases:tt, $($(#[$attr:meta])* $backend:ident: $make:expr),+ $(,)?) => {
        $(
            $crate::support::suite!(@backend [$(#[$attr])*] $backend, $make, $cases);
        )+
    };
    (@backend [$(#[$attr:meta])*] $backend:ident, $make:expr, [$($case:ident),* $(,)?]) => {
        $(#[$attr])*
        mod $backend {
            #[allow(unused_imports)]
            use super::*;

            $(
                #[tokio::test]
                async fn $case() {
                    super::$case($make).await;
                }
            )*
        }
    };
}

#[allow(unused_imports)]
pub(crate) use suite;

/// [`suite!`] on every store in both executions: `memory`, then
/// `redis_transaction`, `redis_script` (a pool), `manager_transaction`,
/// `manager_script` (a ConnectionManager), `cluster_transaction`,
/// `cluster_script` (a Redis Cluster, with the `cluster` feature). For the
/// sliding log, the one algorithm with two executions in Redis.
#[allow(unused_macros)]
macro_rules! every_store_and_execution {
    ($cases:tt) => {
        $crate::support::suite! {
            cases: $cases,
            memory: $crate::support::harness::Harness::memory(),
            redis_transaction: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            redis_script: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            manager_transaction: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            manager_script: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster_transaction: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Transaction,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster_script: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
        }
    };
}

#[allow(unused_imports)]
pub(crate) use every_store_and_execution;

/// [`suite!`] on every store, for the algorithms that always run as one
/// Lua script in Redis whatever the policy's execution: `memory`, `redis`
/// (a pool), `manager` (a ConnectionManager), `cluster` (a Redis Cluster,
/// with the `cluster` feature).
#[allow(unused_macros)]
macro_rules! every_store {
    ($cases:tt) => {
        $crate::support::suite! {
            cases: $cases,
            memory: $crate::support::harness::Harness::memory(),
            redis: $crate::support::harness::Harness::redis(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            manager: $crate::support::harness::Harness::redis_manager(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
            #[cfg(feature = "cluster")]
            cluster: $crate::support::harness::Harness::redis_cluster(
                tower_redis_ratelimit::policy::Execution::Script,
            )
            .await,
        }
    };
}

#[allow(unused_imports)]
pub(crate) use every_store;

/// The store's algorithms, each limiting a key to 5 a day (so no count
/// expires during a test). The fixed and sliding windows are aligned to
/// the UTC day: a test that must not cross a window boundary first waits
/// out the end of the day.
pub fn every_algorithm() -> Vec<(&'static str, tower_redis_ratelimit::Policy)> {
    use tower_redis_ratelimit::Policy;
    use tower_redis_ratelimit::policy::Execution;
    let base: Policy = "5/86400s".parse().unwrap();
    vec![
        (
            "log-transaction",
            base.clone().with_execution(Execution::Transaction).unwrap(),
        ),
        (
            "log-script",
            base.clone().with_execution(Execution::Script).unwrap(),
        ),
        ("fixed", base.clone().fixed_window().unwrap()),
        ("sliding", base.clone().sliding_window().unwrap()),
        ("gcra", base.gcra().unwrap()),
    ]
}

/// Wait until 10–60 ms past a whole second of the system clock (Redis runs
/// on this machine's clock): a burst that starts then stays in one window
/// of a fixed window of a second.
pub async fn start_of_a_second() {
    loop {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_millis();
        if (10..60).contains(&ms) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(
            u64::from((1_010 - ms) % 1_000).max(1),
        ))
        .await;
    }
}
