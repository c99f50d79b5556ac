//! What a limit is: [`Rate`]s, the [`Policy`] that groups them, and how a
//! policy is parsed from text such as `"3/s, 20/min"` or
//! `"100/min, 1000000/month in Europe/Paris from 15"` (windows of the
//! calendar: [`Calendar`]).

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

/// The largest cost of one request under the sliding log, which stores one
/// entry per unit of cost. (Under the other counting algorithms a cost is
/// bounded only by the smallest max: see [`Policy::max_cost`].)
pub const MAX_COST: u64 = 10_000;

mod algorithm;
mod calendar;
mod error;
mod rate;
#[cfg(test)]
mod tests;
mod zone;

pub use algorithm::{Algorithm, DEFAULT_LEASE, Execution};
pub use calendar::{Calendar, Period, Weekday};
pub use error::PolicyError;
pub use rate::Rate;
pub(crate) use rate::{duration_micros, duration_text, parse_duration};

use algorithm::EXECUTION_ONLY_FOR_THE_LOG;
use rate::parse_rate;

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
///
/// Quotas by the calendar count in fixed windows from one boundary to the
/// next (see [`Calendar`] and the guide's calendar page):
///
/// ```
/// use tower_redis_ratelimit::{Algorithm, Policy};
///
/// let policy = "1000000/month in Europe/Paris from 15".parse::<Policy>()?;
/// assert_eq!(policy.algorithm(), Algorithm::FixedWindow);
/// assert_eq!(policy.to_string(), "1000000/month in Europe/Paris from 15");
/// // Beside a rolling rate: both count in fixed windows.
/// let policy = "100/min, 1000000/month".parse::<Policy>()?;
/// assert_eq!(policy.algorithm(), Algorithm::FixedWindow);
/// // Other algorithms refuse calendar rates.
/// assert!(policy.gcra().is_err());
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
    /// A policy of these rates, counted with the sliding log, or with the
    /// fixed window when a rate follows the calendar.
    ///
    /// # Errors
    /// No rates, or two rates with the same window (a calendar rate's is
    /// the longest its window lasts: one calendar rate per period).
    pub fn new(rates: impl IntoIterator<Item = Rate>) -> Result<Self, PolicyError> {
        let mut rates: Vec<Rate> = rates.into_iter().collect();
        if rates.is_empty() {
            return Err(PolicyError::Empty);
        }
        rates.sort_by_key(Rate::window);
        for pair in rates.windows(2) {
            if pair[0].window() == pair[1].window() {
                return Err(PolicyError::DuplicateWindow {
                    first: pair[0],
                    second: pair[1],
                });
            }
        }
        // Calendar rates count in fixed windows.
        let algorithm = if rates.iter().any(|r| r.calendar.is_some()) {
            Algorithm::FixedWindow
        } else {
            Algorithm::default()
        };
        Ok(Self {
            rates,
            min_spacing: None,
            cost: 1,
            execution: Execution::default(),
            algorithm,
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

    /// Count requests with `algorithm` (default [`Algorithm::SlidingLog`];
    /// [`Algorithm::FixedWindow`] for a policy with a calendar rate).
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
    /// [`Execution::Script`] execution outside the sliding log; a calendar
    /// rate outside the fixed window; for [`Algorithm::Concurrency`] (better built with
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
    /// A zero burst, a refill on the calendar, or a bucket whose window
    /// falls outside [`MIN_WINDOW`]..=[`MAX_WINDOW`].
    pub fn token_bucket(refill: Rate, burst: u64) -> Result<Self, PolicyError> {
        if refill.calendar.is_some() {
            return Err(PolicyError::Unsupported {
                algorithm: Algorithm::Gcra,
                what: CALENDAR_ONLY_FOR_FIXED_WINDOWS,
            });
        }
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
                ..*r
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
        if self.algorithm != Algorithm::FixedWindow
            && self.rates.iter().any(|r| r.calendar.is_some())
        {
            return unsupported(CALENDAR_ONLY_FOR_FIXED_WINDOWS);
        }
        if self.algorithm == Algorithm::SlidingLog && self.cost > MAX_COST {
            return Err(PolicyError::CostTooLarge { cost: self.cost });
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

    /// The largest cost one request may have under this policy: its
    /// smallest max, and at most [`MAX_COST`] under the sliding log (one
    /// entry per unit).
    pub fn max_cost(&self) -> u64 {
        let smallest = self.rates.iter().map(|r| r.max).min().unwrap_or(1);
        if self.algorithm == Algorithm::SlidingLog {
            smallest.min(MAX_COST)
        } else {
            smallest
        }
    }

    /// This policy with every rate's max one higher, a cost of 1 and no
    /// spacing: its check admits exactly when the count this policy keeps
    /// is at most its max (what a request of no cost asks: is the key past
    /// its limit?). `None` where a max is already the largest, or for a
    /// concurrency limit.
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    pub(crate) fn one_past_the_max(&self) -> Option<Self> {
        if self.algorithm == Algorithm::Concurrency {
            return None;
        }
        let rates = self
            .rates
            .iter()
            .map(|r| (r.max < MAX_MAX).then(|| Rate::of(r.max + 1, r.window(), r.calendar)))
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            rates,
            min_spacing: None,
            cost: 1,
            execution: self.execution,
            algorithm: self.algorithm,
        })
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
    /// A zero cost, a cost above the `max` of some rate (no request could
    /// ever be admitted), or, under the sliding log, above [`MAX_COST`].
    pub fn with_cost(mut self, cost: u64) -> Result<Self, PolicyError> {
        if cost == 0 {
            return Err(PolicyError::ZeroCost);
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
            .map_or(Duration::ZERO, Rate::window)
            .max(self.min_spacing.unwrap_or(Duration::ZERO))
    }

    /// [`longest_window`](Self::longest_window) in whole µs (the windows'
    /// cached µs: no `Duration` arithmetic per check).
    #[inline]
    pub(crate) fn longest_window_micros(&self) -> u64 {
        let longest = self.rates.last().map_or(0, Rate::window_micros);
        match self.min_spacing {
            None => longest,
            Some(spacing) => longest.max(duration_micros(spacing)),
        }
    }
}

/// Why an algorithm other than the fixed window refuses a calendar rate.
const CALENDAR_ONLY_FOR_FIXED_WINDOWS: &str = "a calendar rate (a day, week or month of the calendar counts in \
     fixed windows, from one boundary to the next: use the fixed-window algorithm, or a rolling window such as \"1d\")";

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
    /// a count (`15m`): rolling windows (`d` is 24 hours). Calendar windows:
    /// `day`, `week`, `month`, then optionally ` in <zone>` and
    /// ` from <anchor>` (`"1000000/month in Europe/Paris from 15"`; see
    /// [`Rate`]). Whitespace around rates is ignored.
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
