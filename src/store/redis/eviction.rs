//! How a map of keyed hashes held in process ([`FullKeys`], the sliding
//! window's [`PreviousCounts`]) stays within its bound: past it, the
//! entries that have ended go, and if too few did, about half of the
//! others (the hashes are random: one bit of them picks about half).
//!
//! [`FullKeys`]: super::full_keys::FullKeys
//! [`PreviousCounts`]: super::previous_counts::PreviousCounts

use std::collections::HashMap;

/// Make room in `map` for `incoming` more entries within `max`, at `now`
/// (µs): an entry ends at `ends(entry)`.
pub(super) fn make_room<V>(
    map: &mut HashMap<u64, V>,
    incoming: usize,
    max: usize,
    now: u64,
    ends: impl Fn(&V) -> u64,
) {
    if map.len() + incoming <= max {
        return;
    }
    map.retain(|_, entry| ends(entry) > now);
    if map.len() + incoming > max / 2 {
        let bit = 1 << (now % 64);
        map.retain(|&hash, _| hash & bit == 0);
    }
}
