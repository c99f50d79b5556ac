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

    pub(super) fn refresh(&self) -> Duration {
        self.refresh
    }

    /// Local time, µs.
    pub(super) fn local_micros(&self) -> u64 {
        duration_micros(self.local.now())
    }

    /// Redis time now, µs, and whether the offset should be measured again;
    /// `None` before the first measurement.
    pub(super) fn now(&self) -> Option<(u64, bool)> {
        let sample = (*self.sample.lock().unwrap_or_else(PoisonError::into_inner))?;
        let now = self.local_micros().saturating_add_signed(sample.offset);
        Some((now, sample.taken.elapsed() >= self.refresh))
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
