//! What this process last saw of the table: each key's row as it last read
//! or wrote it, and the database's clock. A decision on a key seen before
//! is taken on that row at the clock's estimate and written in one round
//! trip if the row is still as seen; else the row is read and the decision
//! taken again on it (three round trips where reading first takes two).
//! While more than a quarter of these guesses miss (other processes write
//! the same keys), the store reads first, and guesses one decision in 16
//! to see whether they would hit again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A key's row: its state's bytes and when it may be deleted (µs).
pub(super) type SeenRow = (Vec<u8>, i64);

/// Rows seen, bounded in bytes.
pub(super) struct Seen {
    rows: Mutex<Rows>,
    /// The most bytes of keys and states kept (0: none).
    limit: usize,
    /// The latest reading of the database's clock (µs since the epoch)
    /// and when it arrived.
    reading: Mutex<Option<(i64, Instant)>>,
    /// The latest time an estimate gave: estimates never go back.
    estimated: AtomicU64,
    /// Guesses and misses in the current round of [`ROUND`] guesses, in
    /// one word (guesses in the high half); whether the last round hit
    /// enough to go on guessing; decisions since the last probe.
    guesses: AtomicU64,
    guessing: AtomicBool,
    since_probe: AtomicU32,
}

/// Guesses a round judges them by.
const ROUND: u64 = 256;

#[derive(Default)]
struct Rows {
    map: HashMap<Box<[u8]>, SeenRow>,
    bytes: usize,
}

/// What an entry costs beside its key and state: the map's slot, and the
/// two allocations' headers and rounding.
const ENTRY_OVERHEAD: usize = 128;

/// How long a reading of the database's clock is estimated from.
const FRESH: Duration = Duration::from_secs(1);

impl Seen {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            rows: Mutex::new(Rows::default()),
            limit,
            reading: Mutex::new(None),
            estimated: AtomicU64::new(0),
            guesses: AtomicU64::new(0),
            guessing: AtomicBool::new(true),
            since_probe: AtomicU32::new(0),
        }
    }

    /// Whether to decide on a row as seen: while guesses hit, and one
    /// decision in 16 while they miss.
    pub(super) fn guessing(&self) -> bool {
        self.guessing.load(Ordering::Relaxed)
            || self.since_probe.fetch_add(1, Ordering::Relaxed) % 16 == 15
    }

    /// A guess hit (the row was as seen) or missed.
    pub(super) fn guessed(&self, hit: bool) {
        let add = (1 << 32) | u64::from(!hit);
        let now = self.guesses.fetch_add(add, Ordering::AcqRel) + add;
        if now >> 32 == ROUND {
            self.guesses.fetch_sub(now, Ordering::AcqRel);
            let missed = now & u64::from(u32::MAX);
            self.guessing.store(missed * 4 <= ROUND, Ordering::Relaxed);
        }
    }

    /// The row of `key` as last seen.
    pub(super) fn row(&self, key: &[u8]) -> Option<SeenRow> {
        if self.limit == 0 {
            return None;
        }
        let rows = self.rows.lock().unwrap_or_else(PoisonError::into_inner);
        rows.map.get(key).cloned()
    }

    /// `key`'s row is now `row` (`None`: there is none, or it is not known).
    pub(super) fn saw(&self, key: &[u8], row: Option<(&[u8], i64)>) {
        if self.limit == 0 {
            return;
        }
        let mut rows = self.rows.lock().unwrap_or_else(PoisonError::into_inner);
        let rows = &mut *rows;
        let cost = |key: &[u8], state: &[u8]| key.len() + state.len() + ENTRY_OVERHEAD;
        if let Some((state, _)) = rows.map.remove(key) {
            rows.bytes -= cost(key, &state);
        }
        let Some((state, deletable_at)) = row else {
            return;
        };
        let added = cost(key, state);
        if added > self.limit {
            return;
        }
        while rows.bytes + added > self.limit {
            // Room made by forgetting about half the rows, whichever the
            // map's order gives, until it fits (an empty map does): a
            // forgotten key is read first next time.
            let mut keep = false;
            let mut bytes = 0;
            rows.map.retain(|key, (state, _)| {
                keep = !keep;
                if keep {
                    bytes += cost(key, state);
                }
                keep
            });
            rows.bytes = bytes;
        }
        rows.bytes += added;
        rows.map.insert(key.into(), (state.to_vec(), deletable_at));
    }

    /// The database's clock read as `micros`, just now. A reading that
    /// arrives late (its task waited) does not replace a later one, and no
    /// estimate after it gives an earlier time.
    pub(super) fn read_clock(&self, micros: i64) {
        let now = Instant::now();
        {
            let mut reading = self.reading.lock().unwrap_or_else(PoisonError::into_inner);
            let later = match *reading {
                None => true,
                Some((kept, at)) => {
                    let since = now.duration_since(at);
                    let implied = kept.saturating_add(since.as_micros() as i64);
                    micros >= implied || since > FRESH
                }
            };
            if later {
                *reading = Some((micros, now));
            }
        }
        if let Ok(micros) = u64::try_from(micros) {
            self.estimated.fetch_max(micros, Ordering::AcqRel);
        }
    }

    /// The database's time now, estimated from its latest reading and the
    /// time since on this process's monotonic clock (it runs behind the
    /// database's by the reading's way back, tens of µs); `None` before any
    /// reading, or when the latest is a second old.
    pub(super) fn clock(&self) -> Option<Duration> {
        let reading = *self.reading.lock().unwrap_or_else(PoisonError::into_inner);
        let (micros, at) = reading?;
        let since = at.elapsed();
        if since > FRESH {
            return None;
        }
        let micros = u64::try_from(micros).ok()?;
        let estimate = micros.saturating_add(since.as_micros() as u64);
        let latest = self.estimated.fetch_max(estimate, Ordering::AcqRel);
        Some(Duration::from_micros(estimate.max(latest)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_seen_stay_within_their_bytes() {
        let seen = Seen::new(10 * (ENTRY_OVERHEAD + 19));
        for i in 0..1000u32 {
            let key = format!("key-{i:05}");
            seen.saw(key.as_bytes(), Some((b"0123456789", 7)));
            let rows = seen.rows.lock().unwrap();
            assert!(rows.bytes <= seen.limit, "{} bytes", rows.bytes);
            assert_eq!(
                rows.bytes,
                rows.map.len() * (ENTRY_OVERHEAD + 19),
                "the count of bytes follows the map"
            );
        }
        assert_eq!(seen.row(b"key-00999"), Some((b"0123456789".to_vec(), 7)));
        seen.saw(b"key-00999", None);
        assert_eq!(seen.row(b"key-00999"), None);
        let off = Seen::new(0);
        off.saw(b"k", Some((b"s", 1)));
        assert_eq!(off.row(b"k"), None);
    }

    #[test]
    fn guesses_stop_while_they_miss_and_come_back_when_they_hit() {
        let seen = Seen::new(0);
        assert!(seen.guessing());
        for i in 0..ROUND {
            seen.guessed(i % 2 == 0);
        }
        let guessed = (0..160).filter(|_| seen.guessing()).count();
        assert_eq!(guessed, 10, "one decision in 16 while half miss");
        for _ in 0..ROUND {
            seen.guessed(true);
        }
        assert!((0..16).all(|_| seen.guessing()), "back once they hit");
    }

    #[test]
    fn the_clock_estimate_never_goes_back() {
        let seen = Seen::new(0);
        assert_eq!(seen.clock(), None, "no reading yet");
        seen.read_clock(2_000_000);
        let first = seen.clock().unwrap();
        assert!(first >= Duration::from_secs(2));
        seen.read_clock(1_000_000);
        assert!(
            seen.clock().unwrap() >= first,
            "an older reading does not go back"
        );
    }
}
