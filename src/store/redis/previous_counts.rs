//! The sliding window counter's previous windows' counts, as this process
//! last read them: a batch of plain commands
//! ([`plain`](super::plain)) reads a previous count once per key and
//! window, not once per check.
//!
//! Once a window has ended, what its count holds of admitted requests can
//! only shrink: a check, a penalty and the scripts count into the window
//! Redis's clock is in, and a reward, a reset or a give-back takes off. A
//! count read after its window ended is therefore at least what it holds
//! later, and deciding on it is exact where it admits: the count as it is
//! then admits too. A check it denies goes to the batch script, which
//! reads the counts as they are and decides exactly, and its entry is
//! dropped, so that the next check reads the count again.
//!
//! Until then, a count another process rewarded, reset or gave back is
//! read here as it was: a check admitted meanwhile is told fewer remaining
//! requests than there are, never more. This process's own penalties,
//! rewards and resets drop the key's entries. Counts are kept only from
//! transactions that wrote (so ran on a primary, not on a replica a
//! connection was left on), and only while Redis's clock does not step
//! back across a window's end (which would open an ended window again, for
//! every window counter).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::eviction::make_room;
use crate::store::KeyHasher;

/// The most counts held (about 4 MiB: four words each and the map's
/// overhead, whatever the keys' lengths); past it, those whose window ended
/// go, and if too few did, about half of the others ([`make_room`]; a
/// count dropped is read once more).
const MAX_PREVIOUS_COUNTS: usize = 1 << 16;

/// A count as read: its Redis key's second hash (two independent 64-bit
/// hashes name a key, so that no two keys held are taken for one), the
/// count, and until when (Redis time, µs) it may be asked for.
#[derive(Clone, Copy)]
struct Held {
    check: u64,
    count: u64,
    until: u64,
}

/// Previous windows' counts by their Redis key: at most
/// [`MAX_PREVIOUS_COUNTS`].
pub(super) struct PreviousCounts {
    hashers: [KeyHasher; 2],
    counts: Mutex<HashMap<u64, Held>>,
}

impl PreviousCounts {
    pub(super) fn new() -> Self {
        Self {
            hashers: [KeyHasher::new(), KeyHasher::new()],
            counts: Mutex::new(HashMap::new()),
        }
    }

    fn hashes(&self, key: &str) -> (u64, u64) {
        (
            self.hashers[0].hash(key.as_bytes()),
            self.hashers[1].hash(key.as_bytes()),
        )
    }

    /// The counts held of `keys`, in order (`None`: not held).
    pub(super) fn known<'a>(&self, keys: impl Iterator<Item = &'a str>) -> Vec<Option<u64>> {
        let hashes: Vec<(u64, u64)> = keys.map(|key| self.hashes(key)).collect();
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        hashes
            .iter()
            .map(|(hash, check)| {
                counts
                    .get(hash)
                    .filter(|held| held.check == *check)
                    .map(|held| held.count)
            })
            .collect()
    }

    /// Hold the counts `read` (each a key, its count read after its window
    /// ended, and until when it is a previous count: Redis time, µs), at
    /// Redis time `now`.
    pub(super) fn learn(&self, read: &[(&str, u64, u64)], now: u64) {
        if read.is_empty() {
            return;
        }
        let hashed: Vec<(u64, Held)> = read
            .iter()
            .map(|&(key, count, until)| {
                let (hash, check) = self.hashes(key);
                (
                    hash,
                    Held {
                        check,
                        count,
                        until,
                    },
                )
            })
            .collect();
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        make_room(
            &mut counts,
            hashed.len(),
            MAX_PREVIOUS_COUNTS,
            now,
            |held| held.until,
        );
        for (hash, held) in hashed {
            if counts.len() < MAX_PREVIOUS_COUNTS {
                counts.insert(hash, held);
            }
        }
    }

    /// Drop the counts held of `keys`: they are read again.
    pub(super) fn forget<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let hashes: Vec<u64> = keys.map(|key| self.hashes(key).0).collect();
        if hashes.is_empty() {
            return;
        }
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        for hash in hashes {
            counts.remove(&hash);
        }
    }

    /// How many counts are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_learned_is_known_until_forgotten_and_no_other_key_reads_it() {
        let counts = PreviousCounts::new();
        counts.learn(
            &[("s:1000000:7", 5, 2_000), ("s:1000000:8", 0, 3_000)],
            1_000,
        );
        assert_eq!(
            counts.known(["s:1000000:7", "s:1000000:8", "s:1000000:9"].into_iter()),
            vec![Some(5), Some(0), None]
        );
        counts.forget(["s:1000000:7"].into_iter());
        assert_eq!(
            counts.known(["s:1000000:7", "s:1000000:8"].into_iter()),
            vec![None, Some(0)]
        );
    }

    #[test]
    fn the_counts_held_are_bounded_and_ended_ones_go_first() {
        let counts = PreviousCounts::new();
        let keys: Vec<String> = (0..MAX_PREVIOUS_COUNTS).map(|i| format!("k:{i}")).collect();
        // Every count but the last ten ends at 100.
        let read: Vec<(&str, u64, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let until = if i + 10 >= keys.len() { 1_000 } else { 100 };
                (key.as_str(), 1, until)
            })
            .collect();
        counts.learn(&read, 50);
        assert_eq!(counts.len(), MAX_PREVIOUS_COUNTS);
        counts.learn(&[("new", 3, 1_000)], 200);
        assert_eq!(counts.len(), 11, "only the counts still current are kept");
        assert_eq!(counts.known(["new"].into_iter()), vec![Some(3)]);
        // Full of current counts: about half go.
        let more: Vec<String> = (0..MAX_PREVIOUS_COUNTS).map(|i| format!("m:{i}")).collect();
        let read: Vec<(&str, u64, u64)> = more.iter().map(|key| (key.as_str(), 1, 1_000)).collect();
        counts.learn(&read, 300);
        assert!(counts.len() <= MAX_PREVIOUS_COUNTS);
        counts.learn(&[("last", 4, 1_000)], 301);
        assert!(counts.len() <= MAX_PREVIOUS_COUNTS);
        assert!(counts.len() > MAX_PREVIOUS_COUNTS / 4);
        assert_eq!(counts.known(["last"].into_iter()), vec![Some(4)]);
    }
}
