//! [`Algorithm`]: how requests are counted, and [`Execution`]: how Redis
//! runs the sliding log.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::PolicyError;

/// The default lease of a [`Algorithm::Concurrency`] slot: a request of a
/// crashed process frees its slot after this long.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// How requests are counted. Every algorithm runs in
/// [`MemoryStore`](crate::MemoryStore) and [`RedisStore`][crate::RedisStore]
/// with the same semantics.
///
/// | algorithm | state per key | exact? | choose it for |
/// |---|---|---|---|
/// | [`SlidingLog`](Self::SlidingLog) | one entry per request in the longest window | yes | exact rolling windows, modest limits |
/// | [`FixedWindow`](Self::FixedWindow) | one counter per rate | per window; up to 2× max across a window edge | the cheapest check |
/// | [`SlidingWindow`](Self::SlidingWindow) | two counters per rate | approximate (see below) | very high limits |
/// | [`Gcra`](Self::Gcra) | one timestamp per rate | yes, as a token bucket | smooth rates with bursts |
/// | [`Concurrency`](Self::Concurrency) | one lease per request in flight | yes | at most N requests in flight |
#[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// The sorted-set rolling window: a request is admitted if fewer than
    /// `max` requests were admitted in the last `window`. Exact.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::clock::ManualClock;
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let clock = ManualClock::new(Duration::from_secs(1_000)); // on a window boundary
    /// let store = MemoryStore::with_clock(clock.clone());
    /// let policy: Policy = "2/s".parse()?;
    /// assert!(store.check_now("k", &policy).allowed());
    /// clock.advance(Duration::from_millis(600));
    /// assert!(store.check_now("k", &policy).allowed());
    /// assert!(!store.check_now("k", &policy).allowed());
    /// // The first request leaves the rolling window 1 s after it came.
    /// clock.advance(Duration::from_millis(400));
    /// assert!(store.check_now("k", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    #[default]
    SlidingLog,
    /// A counter per window of wall-clock time (`floor(now / window)`),
    /// reset at each window's start. Exact within a window, but a client can
    /// send `max` at the end of one window and `max` at the start of the
    /// next: up to 2× max in any rolling window.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::clock::ManualClock;
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let clock = ManualClock::new(Duration::from_secs(1_000)); // on a window boundary
    /// let store = MemoryStore::with_clock(clock.clone());
    /// let policy = "2/s".parse::<Policy>()?.fixed_window()?;
    /// clock.advance(Duration::from_millis(900));
    /// assert!(store.check_now("k", &policy).allowed());
    /// assert!(store.check_now("k", &policy).allowed());
    /// let denied = store.check_now("k", &policy);
    /// assert_eq!(denied.retry_after(), Duration::from_millis(100)); // the window's end
    /// clock.advance(Duration::from_millis(100));
    /// // A new window: two more, four within 200 ms (the edge effect).
    /// assert!(store.check_now("k", &policy).allowed());
    /// assert!(store.check_now("k", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    FixedWindow,
    /// The count of the current fixed window plus the previous window's
    /// count weighted by how much of it the rolling window still covers.
    /// O(1) memory. It assumes the previous window's requests were evenly
    /// spread: in any rolling window it admits at most
    /// `max + previous × elapsed fraction` (< 2× max) in the worst case, when
    /// the previous window's traffic all came at its very end, and exactly
    /// `max` once the admitted traffic is evenly spread (measured: 2 × max − 1
    /// for the adversarial pattern; up to +12% while evenly offered overload
    /// settles, then `max`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::clock::ManualClock;
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let clock = ManualClock::new(Duration::from_secs(1_000)); // on a window boundary
    /// let store = MemoryStore::with_clock(clock.clone());
    /// let policy = "10/s".parse::<Policy>()?.sliding_window()?;
    /// for _ in 0..10 {
    ///     assert!(store.check_now("k", &policy).allowed());
    /// }
    /// // Half-way through the next window, half of the previous one counts:
    /// // 10 × 0.5 = 5, so 5 more fit.
    /// clock.advance(Duration::from_millis(1_500));
    /// for _ in 0..5 {
    ///     assert!(store.check_now("k", &policy).allowed());
    /// }
    /// assert!(!store.check_now("k", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    SlidingWindow,
    /// The generic cell rate algorithm: a token bucket of capacity `max`
    /// refilled at `max / window`, kept as one theoretical arrival time per
    /// rate and refilled lazily. Admits bursts of up to `max`, then one
    /// request every `window / max`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::clock::ManualClock;
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let clock = ManualClock::new(Duration::from_secs(1_000)); // on a window boundary
    /// let store = MemoryStore::with_clock(clock.clone());
    /// let policy = "4/s".parse::<Policy>()?.gcra()?;
    /// for _ in 0..4 {
    ///     assert!(store.check_now("k", &policy).allowed()); // a burst of 4
    /// }
    /// let denied = store.check_now("k", &policy);
    /// assert_eq!(denied.retry_after(), Duration::from_millis(250)); // one token per 250 ms
    /// clock.advance(Duration::from_millis(250));
    /// assert!(store.check_now("k", &policy).allowed());
    /// assert!(!store.check_now("k", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    Gcra,
    /// At most `max` requests of one key in flight at once, across every
    /// process: a lease is taken before the inner service is called and
    /// released when the response body is finished or dropped. A lease of
    /// a crashed process expires after the rate's window (the lease time,
    /// see [`Policy::concurrency`](crate::policy::Policy::concurrency)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::clock::ManualClock;
    /// use tower_redis_ratelimit::{MemoryStore, Policy};
    ///
    /// let clock = ManualClock::new(Duration::from_secs(1_000)); // on a window boundary
    /// let store = MemoryStore::with_clock(clock.clone());
    /// let policy = Policy::concurrency(2)?;
    /// let first = store.check_now("k", &policy);
    /// assert!(store.check_now("k", &policy).allowed());
    /// assert!(!store.check_now("k", &policy).allowed()); // two in flight
    /// // The layer gives the lease back when the response is done.
    /// store.release_now("k", &policy, first.lease().unwrap());
    /// assert!(store.check_now("k", &policy).allowed());
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    Concurrency,
}

impl Algorithm {
    /// The name used in settings and in Redis keys' documentation:
    /// `sliding-log`, `fixed-window`, `sliding-window`, `gcra`, `concurrency`.
    pub fn name(self) -> &'static str {
        match self {
            Self::SlidingLog => "sliding-log",
            Self::FixedWindow => "fixed-window",
            Self::SlidingWindow => "sliding-window",
            Self::Gcra => "gcra",
            Self::Concurrency => "concurrency",
        }
    }

    /// The algorithm's part of a Redis key (`rl:<tag>:{key}`).
    #[cfg(feature = "redis")]
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Self::SlidingLog => "log",
            Self::FixedWindow => "fixed",
            Self::SlidingWindow => "swc",
            Self::Gcra => "gcra",
            Self::Concurrency => "conc",
        }
    }

    pub(crate) const ALL: [Algorithm; 5] = [
        Self::SlidingLog,
        Self::FixedWindow,
        Self::SlidingWindow,
        Self::Gcra,
        Self::Concurrency,
    ];

    pub(crate) fn index(self) -> usize {
        match self {
            Self::SlidingLog => 0,
            Self::FixedWindow => 1,
            Self::SlidingWindow => 2,
            Self::Gcra => 3,
            Self::Concurrency => 4,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|a| a.name() == wanted)
            .ok_or_else(|| PolicyError::UnknownAlgorithm {
                input: s.to_owned(),
            })
    }
}

/// How [`RedisStore`][crate::RedisStore] runs the sliding log. Other stores
/// ignore it: their decisions are the same either way. Only the sliding log
/// takes one ([`Policy::with_execution`](crate::policy::Policy::with_execution) refuses it for another algorithm).
#[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Execution {
    /// One `MULTI`/`EXEC` round trip; the decision is taken on the client
    /// from the counts Redis returns, and a denied request's entry is removed
    /// afterwards (a key found full is read first, and a request denied on
    /// that read is never written). Under contention it may deny a request that an exact
    /// limiter would admit (a concurrent denied request is briefly counted),
    /// but it never admits more than the limit.
    #[default]
    Transaction,
    /// One Lua script (`EVALSHA`) that decides inside Redis on Redis's own
    /// clock. Exact under any concurrency; denied requests are never written.
    Script,
}

impl fmt::Display for Execution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Transaction => "transaction",
            Self::Script => "script",
        })
    }
}

impl FromStr for Execution {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "transaction" | "multi" => Ok(Self::Transaction),
            "script" | "lua" => Ok(Self::Script),
            _ => Err(PolicyError::UnknownExecution {
                input: s.to_owned(),
            }),
        }
    }
}

/// Why an execution is refused for an algorithm other than the sliding log
/// (the one check behind [`Policy::with_execution`] and
/// [`Policy::with_algorithm`], so code and rule sets refuse it alike).
pub(super) const EXECUTION_ONLY_FOR_THE_LOG: &str =
    "an execution (only the sliding log runs in more than one way)";
