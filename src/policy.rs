//! What a limit is: [`Rate`]s, the [`Policy`] that groups them, and how a
//! policy is parsed from text such as `"3/s, 20/min"`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

pub use crate::algorithm::CONCURRENCY_RETRY_CAP;

/// The longest window a [`Rate`] may have: ten years.
pub const MAX_WINDOW: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

/// The shortest window a [`Rate`] may have: one millisecond.
pub const MIN_WINDOW: Duration = Duration::from_millis(1);

/// The largest `max` of a [`Rate`]: 2^53, the largest count Redis's Lua
/// numbers hold exactly.
pub const MAX_MAX: u64 = 1 << 53;

/// The largest cost of one request: the sliding log stores one entry per
/// unit of cost.
pub const MAX_COST: u64 = 10_000;

/// At most `max` requests per `window`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Rate;
///
/// let rate = Rate::new(20, Duration::from_secs(60))?;
/// assert_eq!(rate.to_string(), "20/min");
/// assert_eq!("20/min".parse::<Rate>()?, rate);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    max: u64,
    window: Duration,
}

impl Rate {
    /// `max` requests per `window`.
    ///
    /// # Errors
    /// A zero `max` or one above [`MAX_MAX`], or a window shorter than
    /// [`MIN_WINDOW`] or longer than [`MAX_WINDOW`].
    pub fn new(max: u64, window: Duration) -> Result<Self, PolicyError> {
        if max == 0 {
            return Err(PolicyError::ZeroMax {
                rate: format!("{max}/{}", Window(window)),
            });
        }
        if max > MAX_MAX {
            return Err(PolicyError::MaxTooLarge { max });
        }
        if window.is_zero() {
            return Err(PolicyError::ZeroWindow {
                rate: format!("{max}/0s"),
            });
        }
        if window < MIN_WINDOW || window > MAX_WINDOW {
            return Err(PolicyError::WindowOutOfRange { window });
        }
        Ok(Self { max, window })
    }

    /// `max` requests per second.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_second(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(1))
    }

    /// `max` requests per minute.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_minute(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(60))
    }

    /// `max` requests per hour.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_hour(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(3600))
    }

    /// The most requests admitted in any window.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The length of the window.
    pub fn window(&self) -> Duration {
        self.window
    }

    pub(crate) fn window_micros(&self) -> u64 {
        duration_micros(self.window)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.max, Window(self.window))
    }
}

impl FromStr for Rate {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_rate(s)
    }
}

/// The default lease of a [`Algorithm::Concurrency`] slot: a request of a
/// crashed process frees its slot after this long.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// How requests are counted. Every algorithm runs in
/// [`MemoryStore`](crate::MemoryStore) and [`RedisStore`](crate::RedisStore)
/// with the same semantics.
///
/// | algorithm | state per key | exact? | choose it for |
/// |---|---|---|---|
/// | [`SlidingLog`](Self::SlidingLog) | one entry per request in the longest window | yes | exact rolling windows, modest limits |
/// | [`FixedWindow`](Self::FixedWindow) | one counter per rate | per window; up to 2× max across a window edge | the cheapest check |
/// | [`SlidingWindow`](Self::SlidingWindow) | two counters per rate | approximate (see below) | very high limits |
/// | [`Gcra`](Self::Gcra) | one timestamp per rate | yes, as a token bucket | smooth rates with bursts |
/// | [`Concurrency`](Self::Concurrency) | one lease per request in flight | yes | at most N requests in flight |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
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
    /// see [`Policy::concurrency`]).
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

/// How [`RedisStore`](crate::RedisStore) runs the sliding log. Other stores
/// ignore it: their decisions are the same either way. Only the sliding log
/// takes one ([`Policy::with_execution`] refuses it for another algorithm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Execution {
    /// One `MULTI`/`EXEC` round trip; the decision is taken on the client
    /// from the counts Redis returns, and a denied request's entry is removed
    /// afterwards. Under contention it may deny a request that an exact
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
const EXECUTION_ONLY_FOR_THE_LOG: &str =
    "an execution (only the sliding log runs in more than one way)";

/// The limits a key is held to: one or more [`Rate`]s checked all-or-nothing,
/// an optional minimum spacing between admitted requests, and the cost of
/// one request.
///
/// A request is admitted only if every rate admits it, and only then does it
/// count against any of them.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Policy;
/// use tower_redis_ratelimit::policy::Execution;
///
/// let policy = "3/s, 20/min".parse::<Policy>()?
///     .with_min_spacing(Duration::from_millis(100))?
///     .with_execution(Execution::Script)?;
/// assert_eq!(policy.rates().len(), 2);
/// assert_eq!(policy.to_string(), "3/s, 20/min");
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Sorted by window, shortest first; windows are distinct.
    rates: Vec<Rate>,
    min_spacing: Option<Duration>,
    cost: u64,
    execution: Execution,
    algorithm: Algorithm,
}

impl Policy {
    /// A policy of these rates.
    ///
    /// # Errors
    /// No rates, or two rates with the same window.
    pub fn new(rates: impl IntoIterator<Item = Rate>) -> Result<Self, PolicyError> {
        let mut rates: Vec<Rate> = rates.into_iter().collect();
        if rates.is_empty() {
            return Err(PolicyError::Empty);
        }
        rates.sort_by_key(|r| r.window);
        for pair in rates.windows(2) {
            if pair[0].window == pair[1].window {
                return Err(PolicyError::DuplicateWindow {
                    first: pair[0],
                    second: pair[1],
                });
            }
        }
        Ok(Self {
            rates,
            min_spacing: None,
            cost: 1,
            execution: Execution::default(),
            algorithm: Algorithm::default(),
        })
    }

    /// At most `max_in_flight` requests of one key in flight at once
    /// ([`Algorithm::Concurrency`]), with leases of [`DEFAULT_LEASE`]: a
    /// request still running after its lease expired no longer holds its
    /// slot, so set the lease above your longest request
    /// ([`with_lease`](Self::with_lease)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::{Algorithm, Policy};
    ///
    /// let policy = Policy::concurrency(10)?.with_lease(Duration::from_secs(30))?;
    /// assert_eq!(policy.algorithm(), Algorithm::Concurrency);
    /// assert_eq!(policy.rates()[0].max(), 10);
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A zero `max_in_flight`.
    pub fn concurrency(max_in_flight: u64) -> Result<Self, PolicyError> {
        let mut policy = Self::new([Rate::new(max_in_flight, DEFAULT_LEASE)?])?;
        policy.algorithm = Algorithm::Concurrency;
        Ok(policy)
    }

    /// The lease of a [`Algorithm::Concurrency`] slot.
    ///
    /// # Errors
    /// The policy is not a concurrency limit, or the lease is outside
    /// [`MIN_WINDOW`]..=[`MAX_WINDOW`].
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, PolicyError> {
        if self.algorithm != Algorithm::Concurrency {
            return Err(PolicyError::Unsupported {
                algorithm: self.algorithm,
                what: "a lease (use Policy::concurrency)",
            });
        }
        let max = self.rates[0].max();
        self.rates = vec![Rate::new(max, lease)?];
        Ok(self)
    }

    /// Count requests with `algorithm` (default [`Algorithm::SlidingLog`]).
    ///
    /// ```
    /// use tower_redis_ratelimit::{Algorithm, Policy};
    ///
    /// let policy = "100/s, 1000/min".parse::<Policy>()?.with_algorithm(Algorithm::Gcra)?;
    /// assert_eq!(policy.algorithm(), Algorithm::Gcra);
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A combination the algorithm cannot enforce: minimum spacing or the
    /// [`Execution::Script`] execution outside the sliding log; for [`Algorithm::Concurrency`] (better built with
    /// [`Policy::concurrency`]), more than one rate or a cost above 1.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Result<Self, PolicyError> {
        self.algorithm = algorithm;
        self.validate()?;
        Ok(self)
    }

    /// A token bucket ([`Algorithm::Gcra`]) refilled at `refill` and holding
    /// up to `burst` tokens: `token_bucket(10/s, 50)` admits a burst of 50,
    /// then 10 a second. It is the rate `burst` per `burst / refill` (here
    /// `50/5s`), the window rounded to the microsecond.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_redis_ratelimit::{Policy, Rate};
    ///
    /// let policy = Policy::token_bucket(Rate::per_second(10)?, 50)?;
    /// assert_eq!(policy.rates()[0].max(), 50);
    /// assert_eq!(policy.rates()[0].window(), Duration::from_secs(5));
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A zero burst, or a bucket whose window falls outside
    /// [`MIN_WINDOW`]..=[`MAX_WINDOW`].
    pub fn token_bucket(refill: Rate, burst: u64) -> Result<Self, PolicyError> {
        if burst == 0 {
            return Err(PolicyError::ZeroMax {
                rate: format!("token bucket of {refill} with burst 0"),
            });
        }
        let micros =
            u128::from(refill.window_micros()) * u128::from(burst) / u128::from(refill.max());
        let window = Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX));
        Self::new([Rate::new(burst, window)?])?.gcra()
    }

    /// This policy for one of `instances` processes enforcing it separately:
    /// each rate's max divided by `instances`, rounded down, at least the
    /// cost (the fallback of a shared limit).
    pub(crate) fn shared_by(&self, instances: u32) -> Self {
        let instances = u64::from(instances.max(1));
        let mut shared = self.clone();
        shared.rates = self
            .rates
            .iter()
            .map(|r| Rate {
                max: (r.max / instances).max(self.cost),
                window: r.window,
            })
            .collect();
        shared
    }

    /// [`Algorithm::FixedWindow`]: `policy.fixed_window()?`.
    ///
    /// # Errors
    /// As [`with_algorithm`](Self::with_algorithm).
    pub fn fixed_window(self) -> Result<Self, PolicyError> {
        self.with_algorithm(Algorithm::FixedWindow)
    }

    /// [`Algorithm::SlidingWindow`]: `policy.sliding_window()?`.
    ///
    /// # Errors
    /// As [`with_algorithm`](Self::with_algorithm).
    pub fn sliding_window(self) -> Result<Self, PolicyError> {
        self.with_algorithm(Algorithm::SlidingWindow)
    }

    /// [`Algorithm::Gcra`]: `policy.gcra()?`.
    ///
    /// # Errors
    /// As [`with_algorithm`](Self::with_algorithm).
    pub fn gcra(self) -> Result<Self, PolicyError> {
        self.with_algorithm(Algorithm::Gcra)
    }

    fn validate(&self) -> Result<(), PolicyError> {
        let unsupported = |what| {
            Err(PolicyError::Unsupported {
                algorithm: self.algorithm,
                what,
            })
        };
        if self.execution != Execution::default() && self.algorithm != Algorithm::SlidingLog {
            return unsupported(EXECUTION_ONLY_FOR_THE_LOG);
        }
        if self.min_spacing.is_some() && self.algorithm != Algorithm::SlidingLog {
            return unsupported(
                "a minimum spacing (only the sliding log keeps the last request's time)",
            );
        }
        if self.algorithm == Algorithm::Concurrency {
            if self.rates.len() != 1 {
                return unsupported("more than one rate");
            }
            if self.cost != 1 {
                return unsupported("a cost above 1");
            }
        }
        Ok(())
    }

    /// Require at least `spacing` between two admitted requests of one key
    /// (`minDifference` in rolling-rate-limiter). Zero turns it off.
    ///
    /// # Errors
    /// A spacing under one microsecond (other than zero) or above
    /// [`MAX_WINDOW`].
    pub fn with_min_spacing(mut self, spacing: Duration) -> Result<Self, PolicyError> {
        if !spacing.is_zero() && (spacing < Duration::from_micros(1) || spacing > MAX_WINDOW) {
            return Err(PolicyError::SpacingOutOfRange { spacing });
        }
        self.min_spacing = (!spacing.is_zero()).then_some(spacing);
        self.validate()?;
        Ok(self)
    }

    /// Count every request as `cost` requests (default 1).
    ///
    /// # Errors
    /// A zero cost, a cost above [`MAX_COST`], or a cost above the `max` of
    /// some rate (no request could ever be admitted).
    pub fn with_cost(mut self, cost: u64) -> Result<Self, PolicyError> {
        if cost == 0 {
            return Err(PolicyError::ZeroCost);
        }
        if cost > MAX_COST {
            return Err(PolicyError::CostTooLarge { cost });
        }
        if let Some(rate) = self.rates.iter().find(|r| r.max < cost) {
            return Err(PolicyError::CostAboveMax { cost, rate: *rate });
        }
        self.cost = cost;
        self.validate()?;
        Ok(self)
    }

    /// Run the sliding log with this [`Execution`] on Redis (default
    /// [`Execution::Transaction`]).
    ///
    /// # Errors
    /// The policy's algorithm is not the sliding log: only it runs in more
    /// than one way, so an execution set for another algorithm would be
    /// ignored. Set the algorithm first.
    pub fn with_execution(mut self, execution: Execution) -> Result<Self, PolicyError> {
        if self.algorithm != Algorithm::SlidingLog {
            return Err(PolicyError::Unsupported {
                algorithm: self.algorithm,
                what: EXECUTION_ONLY_FOR_THE_LOG,
            });
        }
        self.execution = execution;
        Ok(self)
    }

    /// The rates, shortest window first.
    pub fn rates(&self) -> &[Rate] {
        &self.rates
    }

    /// The minimum gap between two admitted requests of one key, if any.
    pub fn min_spacing(&self) -> Option<Duration> {
        self.min_spacing
    }

    /// How many requests one request counts as.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// How Redis runs this policy (the sliding log only).
    pub fn execution(&self) -> Execution {
        self.execution
    }

    /// How requests are counted.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The longest window of the policy: state older than this is dead.
    pub fn longest_window(&self) -> Duration {
        // `new` guarantees at least one rate; sorted shortest first.
        self.rates
            .last()
            .map_or(Duration::ZERO, |r| r.window)
            .max(self.min_spacing.unwrap_or(Duration::ZERO))
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, rate) in self.rates.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{rate}")?;
        }
        Ok(())
    }
}

impl FromStr for Policy {
    type Err = PolicyError;

    /// Parse rates separated by commas: `"3/s, 20/min, 100/15m"`.
    ///
    /// Units: `ms`, `s`, `m` or `min`, `h`, `d`, each optionally preceded by
    /// a count (`15m`). Whitespace is ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().is_empty() {
            return Err(PolicyError::Empty);
        }
        let rates = s
            .split(',')
            .map(parse_rate)
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(rates)
    }
}

/// Why a [`Rate`] or [`Policy`] cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy holds no rate.
    #[error("a policy needs at least one rate, such as \"10/s\"")]
    Empty,
    /// A rate admits nothing.
    #[error("rate {rate}: max must be at least 1")]
    ZeroMax {
        /// The rate as written.
        rate: String,
    },
    /// A rate's window is empty.
    #[error("rate {rate}: the window must be longer than zero")]
    ZeroWindow {
        /// The rate as written.
        rate: String,
    },
    /// A window outside [`MIN_WINDOW`]..=[`MAX_WINDOW`].
    #[error("window {window:?} is out of range: it must be between 1ms and 10 years")]
    WindowOutOfRange {
        /// The window given.
        window: Duration,
    },
    /// Two rates share a window.
    #[error("rates {first} and {second} have the same window; keep one rate per window")]
    DuplicateWindow {
        /// One rate.
        first: Rate,
        /// The other rate with the same window.
        second: Rate,
    },
    /// A unit the parser does not know.
    #[error("unknown time unit {unit:?} in {input:?}: use ms, s, m (or min), h or d")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The rate it was in.
        input: String,
    },
    /// Text that is not a rate.
    #[error("cannot read {input:?} as a rate: {reason}")]
    Invalid {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An algorithm name the parser does not know.
    #[error(
        "unknown algorithm {input:?}: use sliding-log, fixed-window, sliding-window, gcra or concurrency"
    )]
    UnknownAlgorithm {
        /// The text given.
        input: String,
    },
    /// A setting the policy's algorithm cannot enforce.
    #[error("the {algorithm} algorithm does not support {what}")]
    Unsupported {
        /// The policy's algorithm.
        algorithm: Algorithm,
        /// What it does not support.
        what: &'static str,
    },
    /// An execution other than `transaction` or `script`.
    #[error("unknown execution {input:?}: use `transaction` or `script`")]
    UnknownExecution {
        /// The text given.
        input: String,
    },
    /// A `max` above [`MAX_MAX`].
    #[error("max {max} is too large: at most 2^53 (9007199254740992)")]
    MaxTooLarge {
        /// The max given.
        max: u64,
    },
    /// A minimum spacing outside 1µs..=[`MAX_WINDOW`].
    #[error(
        "minimum spacing {spacing:?} is out of range: it must be zero (none) or between 1µs and 10 years"
    )]
    SpacingOutOfRange {
        /// The spacing given.
        spacing: Duration,
    },
    /// A cost above [`MAX_COST`].
    #[error("cost {cost} is too large: at most 10000 (the sliding log keeps one entry per unit)")]
    CostTooLarge {
        /// The cost given.
        cost: u64,
    },
    /// A zero cost.
    #[error("cost must be at least 1")]
    ZeroCost,
    /// A request would cost more than a rate ever admits.
    #[error("cost {cost} is above the max of rate {rate}: no request could ever be admitted")]
    CostAboveMax {
        /// The cost given.
        cost: u64,
        /// The rate it exceeds.
        rate: Rate,
    },
}

fn parse_rate(input: &str) -> Result<Rate, PolicyError> {
    let text = input.trim();
    let invalid = |reason: &str| PolicyError::Invalid {
        input: text.to_owned(),
        reason: reason.to_owned(),
    };
    if text.is_empty() {
        return Err(invalid(
            "empty rate (a stray comma?); write rates as \"10/s\"",
        ));
    }
    let (max, per) = text
        .split_once('/')
        .ok_or_else(|| invalid("expected <max>/<window>, such as \"10/s\" or \"100/15m\""))?;
    let max = max.trim();
    if max.is_empty() || !max.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("the max must be a whole number, such as \"10/s\""));
    }
    let max: u64 = max.parse().map_err(|_| invalid("the max is too large"))?;
    let per = per.trim();
    let digits = per.bytes().take_while(u8::is_ascii_digit).count();
    let (count, unit) = per.split_at(digits);
    let count: u64 = if count.is_empty() {
        1
    } else {
        count
            .parse()
            .map_err(|_| invalid("the window count is too large"))?
    };
    let unit = unit.trim();
    let unit_micros: u64 = match unit {
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" | "min" => 60_000_000,
        "h" => 3_600_000_000,
        "d" => 86_400_000_000,
        "" => {
            return Err(invalid(
                "the window needs a unit: ms, s, m (or min), h or d",
            ));
        }
        other => {
            return Err(PolicyError::UnknownUnit {
                unit: other.to_owned(),
                input: text.to_owned(),
            });
        }
    };
    if count == 0 {
        return Err(PolicyError::ZeroWindow {
            rate: text.to_owned(),
        });
    }
    let micros = count
        .checked_mul(unit_micros)
        .ok_or_else(|| invalid("the window is too long"))?;
    if max == 0 {
        return Err(PolicyError::ZeroMax {
            rate: text.to_owned(),
        });
    }
    Rate::new(max, Duration::from_micros(micros))
}

/// `1s` → `"s"`, `15 min` → `"15m"`, `1500ms` → `"1500ms"`; written
/// straight to the formatter (a 429's text names the rate on every denial).
struct Window(Duration);

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u128, &str); 5] = [
            (86_400_000_000, "d"),
            (3_600_000_000, "h"),
            (60_000_000, "min"),
            (1_000_000, "s"),
            (1_000, "ms"),
        ];
        let micros = self.0.as_micros();
        for (size, name) in UNITS {
            if micros >= size && micros.is_multiple_of(size) {
                let n = micros / size;
                return match (n, name) {
                    (1, _) => f.write_str(name),
                    (_, "min") => write!(f, "{n}m"),
                    _ => write!(f, "{n}{name}"),
                };
            }
        }
        write!(f, "{micros}us")
    }
}

/// A duration as a rate's window is written, with its count even when it
/// is 1 (`1s`, `10s`, `250ms`, `15m`, `1500us`): exact to the microsecond,
/// as stores count.
pub(crate) fn duration_text(d: Duration) -> String {
    let text = Window(d).to_string();
    if text.starts_with(|c: char| c.is_ascii_digit()) {
        text
    } else {
        format!("1{text}")
    }
}

pub(crate) fn duration_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn parses_the_documented_forms() {
        let p: Policy = "3/s, 20/min, 100/15m".parse().unwrap();
        let got: Vec<(u64, Duration)> = p.rates().iter().map(|r| (r.max(), r.window())).collect();
        assert_eq!(got, vec![(3, secs(1)), (20, secs(60)), (100, secs(900))]);
        let p: Policy = " 5/10s ,1/250ms, 7/2h,9/d , 4/m".parse().unwrap();
        let got: Vec<(u64, Duration)> = p.rates().iter().map(|r| (r.max(), r.window())).collect();
        assert_eq!(
            got,
            vec![
                (1, Duration::from_millis(250)),
                (5, secs(10)),
                (4, secs(60)),
                (7, secs(7200)),
                (9, secs(86_400)),
            ]
        );
    }

    #[test]
    fn display_round_trips() {
        for text in ["3/s, 20/min, 100/15m", "1/250ms", "5/10s", "7/2h, 9/d"] {
            let p: Policy = text.parse().unwrap();
            assert_eq!(p.to_string().parse::<Policy>().unwrap(), p, "{text}");
        }
        assert_eq!("100/15m".parse::<Rate>().unwrap().to_string(), "100/15m");
        assert_eq!("1/1500ms".parse::<Rate>().unwrap().to_string(), "1/1500ms");
    }

    #[test]
    fn errors_name_the_problem() {
        let msg = |s: &str| s.parse::<Policy>().unwrap_err().to_string();
        assert!(
            msg("0/s").contains("max must be at least 1"),
            "{}",
            msg("0/s")
        );
        assert!(msg("3/0s").contains("longer than zero"), "{}", msg("3/0s"));
        assert!(
            msg("3/s, 5/1s").contains("same window"),
            "{}",
            msg("3/s, 5/1s")
        );
        assert!(msg("3/fortnight").contains("unknown time unit \"fortnight\""));
        assert!(msg("hello").contains("expected <max>/<window>"));
        assert!(msg("").contains("at least one rate"));
        assert!(msg("3/s,").contains("stray comma"));
        assert!(msg("-3/s").contains("whole number"));
        assert!(msg("3/").contains("needs a unit"));
        assert!(
            msg("3/99999999999999d").contains("too long")
                || msg("3/99999999999999d").contains("out of range")
        );
        assert!(msg("99999999999999999999999/s").contains("too large"));
        assert!(msg("1/20000d").contains("out of range"));
    }

    #[test]
    fn cost_is_validated_against_every_rate() {
        let p: Policy = "3/s, 20/min".parse().unwrap();
        assert_eq!(p.clone().with_cost(0).unwrap_err(), PolicyError::ZeroCost);
        let err = p.clone().with_cost(4).unwrap_err();
        assert!(
            err.to_string()
                .contains("cost 4 is above the max of rate 3/s"),
            "{err}"
        );
        assert_eq!(p.with_cost(3).unwrap().cost(), 3);
        let big: Policy = "20000/s".parse().unwrap();
        assert!(matches!(
            big.with_cost(10_001),
            Err(PolicyError::CostTooLarge { .. })
        ));
    }

    #[test]
    fn spacing_and_max_are_bounded() {
        let p: Policy = "3/s".parse().unwrap();
        assert!(
            p.clone()
                .with_min_spacing(Duration::ZERO)
                .unwrap()
                .min_spacing()
                .is_none()
        );
        let err = p
            .clone()
            .with_min_spacing(Duration::from_nanos(10))
            .unwrap_err();
        assert!(err.to_string().contains("minimum spacing"), "{err}");
        assert!(p.with_min_spacing(Duration::MAX).is_err());
        let err = Rate::new(MAX_MAX + 1, Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
        assert!(Rate::new(MAX_MAX, Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn sub_millisecond_windows_are_rejected() {
        let err = Rate::new(1, Duration::from_micros(10)).unwrap_err();
        assert!(matches!(err, PolicyError::WindowOutOfRange { .. }));
    }

    #[test]
    fn algorithms_parse_and_reject_what_they_cannot_enforce() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
        }
        assert!(
            "leaky"
                .parse::<Algorithm>()
                .unwrap_err()
                .to_string()
                .contains("unknown algorithm")
        );
        let spaced = "3/s"
            .parse::<Policy>()
            .unwrap()
            .with_min_spacing(Duration::from_millis(10))
            .unwrap();
        let err = spaced.gcra().unwrap_err().to_string();
        assert!(
            err.contains("gcra algorithm does not support a minimum spacing"),
            "{err}"
        );
        let two: Policy = "3/s, 10/min".parse().unwrap();
        assert!(two.clone().gcra().is_ok());
        let err = two
            .with_algorithm(Algorithm::Concurrency)
            .unwrap_err()
            .to_string();
        assert!(err.contains("more than one rate"), "{err}");
        let c = Policy::concurrency(5).unwrap();
        assert_eq!(c.rates()[0].window(), DEFAULT_LEASE);
        assert!(c.clone().with_cost(2).is_err());
        assert!(c.with_lease(Duration::ZERO).is_err());
        assert!(
            "3/s"
                .parse::<Policy>()
                .unwrap()
                .with_lease(Duration::from_secs(1))
                .is_err()
        );
        assert!(Policy::concurrency(0).is_err());
    }

    #[test]
    fn execution_parses() {
        assert_eq!("script".parse::<Execution>().unwrap(), Execution::Script);
        assert_eq!(
            "Transaction".parse::<Execution>().unwrap(),
            Execution::Transaction
        );
        let err = "both".parse::<Execution>().unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown execution \"both\": use `transaction` or `script`"
        );
        assert_eq!(Execution::Script.to_string(), "script");
    }

    #[test]
    fn an_execution_is_refused_for_every_algorithm_but_the_sliding_log() {
        let log: Policy = "3/s".parse().unwrap();
        for execution in [Execution::Transaction, Execution::Script] {
            assert_eq!(
                log.clone().with_execution(execution).unwrap().execution(),
                execution
            );
            for algorithm in [
                Algorithm::FixedWindow,
                Algorithm::SlidingWindow,
                Algorithm::Gcra,
                Algorithm::Concurrency,
            ] {
                let other = log.clone().with_algorithm(algorithm).unwrap();
                let err = other.with_execution(execution).unwrap_err().to_string();
                assert!(
                    err.contains(&format!(
                        "the {algorithm} algorithm does not support an execution"
                    )),
                    "{err}"
                );
            }
        }
        // Either order: a script policy does not become another algorithm.
        let script = log.with_execution(Execution::Script).unwrap();
        let err = script.gcra().unwrap_err().to_string();
        assert!(err.contains("only the sliding log"), "{err}");
    }
}
