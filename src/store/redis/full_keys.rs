//! Keys found full: the window counters' (by their batch script, or by a
//! batch's reading), and the sliding log's (by its transaction). A check of
//! a window counter's is read in its batch's transaction, not counted
//! ([`plain`](super::plain)), and denied on the counts read, which are what
//! the script would read at that moment; with room again it goes to the
//! script. A check of a sliding log's reads the log before its transaction
//! writes ([`sliding_log`](super::sliding_log)), and is denied on what it
//! read; with room it goes on to the transaction. Without them, a denial
//! was counted (or written), given back and decided again. Which way a
//! check goes never changes its decision; it changes what a denial costs
//! Redis: less than an admission.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::eviction::make_room;
use crate::decision::Decision;
use crate::policy::{Policy, duration_micros};
use crate::store::KeyHasher;

/// The most keys held (about 2 MiB: two words each and the map's
/// overhead, whatever the keys' lengths); past it, those whose denial ended
/// go, and if too few did, about half of the others
/// ([`make_room`]; a key dropped is a check counted once more).
const MAX_FULL_KEYS: usize = 1 << 16;

/// Keys found full under a policy, by the hash of their Redis key, the
/// policy's cost and its rates (a key with no room for a batch of 10 may
/// have room for 1; one full under 4/s is not under 9/s, and an admission
/// under 9/s leaves it full under 4/s), each until the end of its denial
/// (this process's time, µs): at most [`MAX_FULL_KEYS`].
pub(super) struct FullKeys {
    hasher: KeyHasher,
    until: Mutex<HashMap<u64, u64>>,
}

impl FullKeys {
    pub(super) fn new() -> Self {
        Self {
            hasher: KeyHasher::new(),
            until: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `state` was found full under `policy`, and its denial may
    /// last to `now`.
    pub(super) fn holds(&self, state: &str, policy: &Policy, now: u64) -> bool {
        let hash = self.hash(state, policy);
        self.until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&hash)
            .is_some_and(|&until| until > now)
    }

    /// A `decision` on `state` under `policy` (a script's, a batch's on
    /// the counts it read, a transaction's), asked at `now`: a denial holds the key until
    /// it ends; an admission lets it go.
    pub(super) fn learn(&self, state: &str, policy: &Policy, decision: &Decision, now: u64) {
        let hash = self.hash(state, policy);
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if decision.allowed() || decision.blocked() {
            until.remove(&hash);
            return;
        }
        let incoming = usize::from(!until.contains_key(&hash));
        make_room(&mut until, incoming, MAX_FULL_KEYS, now, |&end| end);
        until.insert(
            hash,
            now.saturating_add(duration_micros(decision.retry_after())),
        );
    }
}

impl FullKeys {
    /// The map's key of `state` under `policy`: its hash, mixed with the
    /// policy's cost and each rate's max and window.
    fn hash(&self, state: &str, policy: &Policy) -> u64 {
        const MIX: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut mixed = policy.cost().wrapping_mul(MIX);
        for rate in policy.rates() {
            mixed = (mixed.rotate_left(23) ^ rate.max()).wrapping_mul(MIX);
            mixed = (mixed.rotate_left(23) ^ rate.window_micros()).wrapping_mul(MIX);
        }
        self.hasher.hash(state.as_bytes()) ^ mixed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::fixed_window;

    #[test]
    fn a_denial_holds_its_key_until_it_ends_and_an_admission_frees_it() {
        let policy: Policy = "1/1s".parse::<Policy>().unwrap().fixed_window().unwrap();
        let now = 1_700_000_000_250_000;
        let admitted = fixed_window::decided_after_adding(&policy, now, &[(1, now + 750_000)]);
        let denied = fixed_window::decided_after_adding(&policy, now, &[(2, now + 750_000)]);
        assert!(admitted.allowed() && !denied.allowed());
        let full = FullKeys::new();
        full.learn("k", &policy, &denied, now);
        assert!(full.holds("k", &policy, now + 749_999));
        assert!(!full.holds("k", &policy, now + 750_000));
        assert!(!full.holds("other", &policy, now));
        // Full under 1/1s is not full under 9/1s, and an admission under
        // 9/1s leaves it full under 1/1s; full for a cost of 9 is not for 1.
        let nine: Policy = "9/1s".parse::<Policy>().unwrap().fixed_window().unwrap();
        full.learn("k", &nine, &admitted, now);
        assert!(full.holds("k", &policy, now) && !full.holds("k", &nine, now));
        full.learn("k", &nine.clone().with_cost(9).unwrap(), &denied, now);
        assert!(!full.holds("k", &nine, now));
        assert!(full.holds("k", &nine.clone().with_cost(9).unwrap(), now));
        full.learn("k", &policy, &admitted, now);
        assert!(!full.holds("k", &policy, now));
        // Bounded: past the most keys, about half go, the newest kept.
        for i in 0..MAX_FULL_KEYS + 10 {
            full.learn(&format!("k{i}"), &policy, &denied, now);
        }
        let held = full.until.lock().unwrap().len();
        assert!((MAX_FULL_KEYS / 4..MAX_FULL_KEYS).contains(&held), "{held}");
        assert!(full.holds(&format!("k{}", MAX_FULL_KEYS + 9), &policy, now));
    }
}
