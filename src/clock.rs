//! Where stores read the time: an injectable [`Clock`], as in governor.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time, as a [`Duration`] since the Unix epoch.
///
/// [`MemoryStore`](crate::MemoryStore) decides on this clock;
/// [`RedisStore`][crate::RedisStore] stamps transaction-mode entries with it
/// after correcting it to Redis's own clock. Tests inject a [`ManualClock`].
#[cfg_attr(not(feature = "redis"), doc = links_without!("redis"))]
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time since the Unix epoch.
    fn now(&self) -> Duration;

    /// [`now`](Self::now) in whole microseconds (rounded down, at most
    /// `u64::MAX`): what stores decide on. A clock may give it without
    /// building the `Duration`, as the crate's clocks do; it must agree
    /// with `now`.
    fn now_micros(&self) -> u64 {
        crate::policy::duration_micros(self.now())
    }
}

/// The system clock read once, then advanced by the monotonic clock, so it
/// never jumps backwards when the system time is adjusted.
///
/// The monotonic clock is [quanta](https://docs.rs/quanta)'s, as in governor:
/// the CPU's time-stamp counter, calibrated against the OS's monotonic clock
/// once per process (about a millisecond, at the first `SystemClock::new`),
/// where the CPU has an invariant one; the OS's monotonic clock otherwise.
/// Reading it costs about a third of `std::time::Instant::now` on a virtual
/// machine, where that read is a large part of a `MemoryStore` decision.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    /// The system time when anchored, in ns since the epoch (a `u64` holds
    /// ns until the year 2554).
    anchor_wall: u64,
    /// The monotonic clock's raw reading then.
    anchor: u64,
    monotonic: &'static quanta::Clock,
}

/// One calibrated clock per process.
static MONOTONIC: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();

impl SystemClock {
    /// A clock anchored to the system time now.
    pub fn new() -> Self {
        let monotonic = MONOTONIC.get_or_init(quanta::Clock::new);
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self {
            anchor_wall: u64::try_from(wall.as_nanos()).unwrap_or(u64::MAX),
            anchor: monotonic.raw(),
            monotonic,
        }
    }

    /// The time now in ns since the epoch: the anchor and the monotonic
    /// clock's advance since (never negative).
    #[inline]
    fn nanos(&self) -> u64 {
        let advance = self
            .monotonic
            .delta_as_nanos(self.anchor, self.monotonic.raw());
        self.anchor_wall.saturating_add(advance)
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos())
    }

    #[inline]
    fn now_micros(&self) -> u64 {
        self.nanos() / 1_000
    }
}

/// A clock that moves only when told to; clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new(Duration::from_secs(1_000));
/// clock.advance(Duration::from_millis(1_500));
/// assert_eq!(clock.now(), Duration::from_millis(1_001_500));
/// ```
#[derive(Clone, Default)]
pub struct ManualClock {
    micros: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `start` since the epoch.
    pub fn new(start: Duration) -> Self {
        Self {
            micros: Arc::new(AtomicU64::new(crate::policy::duration_micros(start))),
        }
    }

    /// Move the clock forward.
    pub fn advance(&self, by: Duration) {
        self.micros
            .fetch_add(crate::policy::duration_micros(by), Ordering::SeqCst);
    }

    /// Set the clock.
    pub fn set(&self, to: Duration) {
        self.micros
            .store(crate::policy::duration_micros(to), Ordering::SeqCst);
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.now_micros())
    }

    fn now_micros(&self) -> u64 {
        self.micros.load(Ordering::SeqCst)
    }
}

/// Another clock shifted by a fixed amount: a server whose clock is wrong.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::clock::{Clock, ManualClock, SkewedClock};
///
/// let base = ManualClock::new(Duration::from_secs(100));
/// let ahead = SkewedClock::ahead(base.clone(), Duration::from_secs(5));
/// assert_eq!(ahead.now(), Duration::from_secs(105));
/// ```
#[derive(Debug, Clone)]
pub struct SkewedClock<C> {
    inner: C,
    offset: Duration,
    ahead: bool,
}

impl<C: Clock> SkewedClock<C> {
    /// `inner` plus `by`.
    pub fn ahead(inner: C, by: Duration) -> Self {
        Self {
            inner,
            offset: by,
            ahead: true,
        }
    }

    /// `inner` minus `by`.
    pub fn behind(inner: C, by: Duration) -> Self {
        Self {
            inner,
            offset: by,
            ahead: false,
        }
    }
}

impl<C: Clock> Clock for SkewedClock<C> {
    fn now(&self) -> Duration {
        let now = self.inner.now();
        if self.ahead {
            now + self.offset
        } else {
            now.saturating_sub(self.offset)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::duration_micros;

    /// Each clock's `now_micros` is its `now` in whole µs.
    #[test]
    fn now_micros_agrees_with_now() {
        let clock = SystemClock::new();
        for _ in 0..1_000 {
            let before = clock.now_micros();
            let now = duration_micros(clock.now());
            let after = clock.now_micros();
            assert!(before <= now && now <= after, "{before} {now} {after}");
        }
        let wall = duration_micros(SystemTime::now().duration_since(UNIX_EPOCH).unwrap());
        assert!(clock.now_micros().abs_diff(wall) < 1_000_000);
        let manual = ManualClock::new(Duration::from_nanos(1_500_999));
        assert_eq!(manual.now_micros(), 1_500);
        assert_eq!(duration_micros(manual.now()), manual.now_micros());
    }
}
