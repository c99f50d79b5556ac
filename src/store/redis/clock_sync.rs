//! This process's clock corrected to Redis's clock (`TIME`), so app servers
//! whose clocks disagree still stamp sliding-log entries on one time line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use crate::clock::Clock;
use crate::policy::duration_micros;
use crate::store::StoreError;

/// Samples taken when the offset is first measured; the one with the
/// shortest round trip wins.
const INITIAL_SAMPLES: usize = 3;

/// How far (µs) a transaction's reading may be from the time Redis ran it,
/// beyond the offset's own error, before the transaction execution corrects
/// for it: the time a healthy round trip takes to reach Redis and wait in
/// its queue.
pub(super) const BASE_TOLERANCE: u64 = 5_000;

/// The largest error (half the round trip, µs) of a sample that may replace
/// one in force because the latter is old. Samples taken under a stall
/// never replace a good offset.
pub(super) const MAX_SAMPLE_ERROR: u64 = BASE_TOLERANCE;

pub(super) struct ClockSync {
    local: Arc<dyn Clock>,
    refresh: Duration,
    sample: Mutex<Option<Sample>>,
    /// The latest Redis time (µs) any reply showed: a time Redis's clock has
    /// certainly passed, whatever the local clock does.
    seen: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Redis time minus local time, µs.
    offset: i64,
    /// Round trip of the measurement, µs: the offset is good to half of it.
    rtt: u64,
    taken: Instant,
}

impl std::fmt::Debug for ClockSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClockSync")
            .field("local", &self.local)
            .field("refresh", &self.refresh)
            .finish_non_exhaustive()
    }
}

impl ClockSync {
    pub(super) fn new(local: Arc<dyn Clock>, refresh: Duration) -> Self {
        Self {
            local,
            refresh,
            sample: Mutex::new(None),
            seen: AtomicU64::new(0),
        }
    }

    pub(super) fn local(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.local)
    }

    #[cfg(feature = "test-util")]
    pub(super) fn refresh(&self) -> Duration {
        self.refresh
    }

    /// Local time, µs.
    pub(super) fn local_micros(&self) -> u64 {
        duration_micros(self.local.now())
    }

    /// Redis time now, µs, and whether the offset should be measured again
    /// (it is old, or was taken over a slow round trip: a sample forced in
    /// by [`replace`](Self::replace) during a stall is improved on at once);
    /// `None` before the first measurement.
    pub(super) fn now(&self) -> Option<(u64, bool)> {
        let sample = (*self.sample.lock().unwrap_or_else(PoisonError::into_inner))?;
        let now = self.local_micros().saturating_add_signed(sample.offset);
        let refresh = sample.taken.elapsed() >= self.refresh || sample.rtt / 2 > MAX_SAMPLE_ERROR;
        Some((now, refresh))
    }

    /// How far (µs) a reading may be from Redis's time and still be used as
    /// it is: [`BASE_TOLERANCE`] plus the error of the offset in force (half
    /// its round trip).
    pub(super) fn tolerance(&self) -> u64 {
        let sample = *self.sample.lock().unwrap_or_else(PoisonError::into_inner);
        BASE_TOLERANCE + sample.map_or(0, |s| s.rtt / 2)
    }

    /// Redis's clock showed `redis` (µs).
    pub(super) fn saw(&self, redis: u64) {
        self.seen.fetch_max(redis, Ordering::Relaxed);
    }

    /// The latest Redis time any reply showed (µs; 0 before the first).
    pub(super) fn seen(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }

    /// Record a `TIME` reply (`redis`, µs) read between local times `sent`
    /// and `received`.
    pub(super) fn record(&self, sent: u64, received: u64, redis: u64) {
        self.saw(redis);
        let rtt = received.saturating_sub(sent);
        let midpoint = sent + rtt / 2;
        let offset =
            i64::try_from(redis).unwrap_or(i64::MAX) - i64::try_from(midpoint).unwrap_or(i64::MAX);
        let candidate = Sample {
            offset,
            rtt,
            taken: Instant::now(),
        };
        let mut slot = self.sample.lock().unwrap_or_else(PoisonError::into_inner);
        let accept = match *slot {
            None => true,
            // A sample taken under load (a long round trip) is less precise:
            // keep the old one, unless the offset moved by more than both
            // samples' errors together (a clock step, a failover), or the
            // old one is getting stale and this one's error is bounded.
            // (The transaction execution does not rely on the offset being
            // right: it checks every transaction against Redis's `TIME`.)
            Some(old) => {
                rtt <= old.rtt.saturating_mul(2).max(1_000)
                    || old.offset.abs_diff(offset) > rtt / 2 + old.rtt / 2
                    || (old.taken.elapsed() >= self.refresh.saturating_mul(10)
                        && rtt / 2 <= MAX_SAMPLE_ERROR)
            }
        };
        if accept {
            *slot = Some(candidate);
        }
    }

    /// Measure the offset with a few `TIME` round trips.
    pub(super) async fn measure<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), StoreError> {
        let mut best: Option<(u64, u64, u64)> = None;
        for _ in 0..INITIAL_SAMPLES {
            let sent = self.local_micros();
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
            let received = self.local_micros();
            let redis = secs.saturating_mul(1_000_000).saturating_add(micros);
            // A local clock that stepped back inside a sample gives a
            // round trip of 0: such a sample is kept only if nothing better.
            if best.is_none_or(|(s, r, _)| received.saturating_sub(sent) < r.saturating_sub(s)) {
                best = Some((sent, received, redis));
            }
        }
        if let Some((sent, received, redis)) = best {
            self.replace(sent, received, redis);
        }
        Ok(())
    }

    /// Replace the offset with this sample, whatever its round trip: it is
    /// a deliberate measurement, or proof that the one in force is wrong.
    pub(super) fn replace(&self, sent: u64, received: u64, redis: u64) {
        *self.sample.lock().unwrap_or_else(PoisonError::into_inner) = None;
        self.record(sent, received, redis);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    const S: u64 = 1_000_000;

    fn sync(refresh: Duration) -> (ClockSync, ManualClock) {
        let clock = ManualClock::new(Duration::from_secs(1_000));
        (ClockSync::new(Arc::new(clock.clone()), refresh), clock)
    }

    /// The offset in force, µs.
    fn offset(sync: &ClockSync) -> i64 {
        let local = i64::try_from(sync.local_micros()).unwrap();
        i64::try_from(sync.now().unwrap().0).unwrap() - local
    }

    #[test]
    fn the_first_sample_sets_the_offset_and_the_tolerance() {
        let (sync, _) = sync(Duration::from_secs(30));
        assert!(sync.now().is_none());
        // Sent at 1000 s, answered 200 µs later, Redis 5 s ahead.
        sync.record(1_000 * S, 1_000 * S + 200, 1_005 * S + 100);
        assert_eq!(offset(&sync), 5 * S as i64);
        assert_eq!(sync.tolerance(), BASE_TOLERANCE + 100);
        assert_eq!(sync.seen(), 1_005 * S + 100);
        assert_eq!(sync.now().map(|(_, refresh)| refresh), Some(false));
    }

    #[test]
    fn a_slow_sample_never_replaces_a_good_one_for_being_old() {
        // Every sample is "old" at once: only its error decides.
        let (sync, _) = sync(Duration::ZERO);
        sync.record(1_000 * S, 1_000 * S + 200, 1_005 * S + 100);
        // A stall: 400 ms round trip, whose midpoint would put the offset
        // 150 ms off (Redis answered at the very start of it).
        sync.record(1_000 * S, 1_000 * S + 400_000, 1_005 * S + 50_000);
        assert_eq!(
            offset(&sync),
            5 * S as i64,
            "a 400 ms sample replaced the offset"
        );
        // A sample whose error is bounded replaces a stale one.
        sync.record(1_001 * S, 1_001 * S + 4_000, 1_006 * S + 2_000 + 300);
        assert_eq!(offset(&sync), 5 * S as i64 + 300);
    }

    #[test]
    fn a_clock_that_moved_by_more_than_both_errors_is_followed() {
        let (sync, _) = sync(Duration::from_secs(30));
        sync.record(1_000 * S, 1_000 * S + 200, 1_005 * S + 100);
        // 20 ms round trip (not better than the old), but the offset moved
        // by 3 s: the old offset is provably wrong.
        sync.record(1_000 * S, 1_000 * S + 20_000, 1_008 * S + 10_000);
        assert_eq!(offset(&sync), 8 * S as i64);
        // A slower sample that moved by less than the errors together: kept.
        sync.record(1_000 * S, 1_000 * S + 50_000, 1_008 * S + 25_000 + 9_000);
        assert_eq!(offset(&sync), 8 * S as i64);
    }

    #[test]
    fn a_forced_slow_sample_asks_to_be_measured_again() {
        let (sync, _) = sync(Duration::from_secs(30));
        sync.record(1_000 * S, 1_000 * S + 200, 1_005 * S + 100);
        sync.replace(1_000 * S, 1_000 * S + 400_000, 1_003 * S + 200_000);
        assert_eq!(offset(&sync), 3 * S as i64);
        assert_eq!(sync.tolerance(), BASE_TOLERANCE + 200_000);
        assert_eq!(sync.now().map(|(_, refresh)| refresh), Some(true));
        // The next sample with a fast round trip replaces it.
        sync.record(1_001 * S, 1_001 * S + 300, 1_004 * S + 150);
        assert_eq!(offset(&sync), 3 * S as i64);
        assert_eq!(sync.tolerance(), BASE_TOLERANCE + 150);
        assert_eq!(sync.now().map(|(_, refresh)| refresh), Some(false));
    }
}
