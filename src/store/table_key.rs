//! How the tables this process holds keys in find a key: its hash and
//! its comparison.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// Hashes keys for the in-process tables (a [`MemoryStore`](crate::MemoryStore)'s
/// shards, a local quota's held units, the deny cache): SipHash-1-3 under a
/// random key, as std's `HashMap`, so a client who picks its keys cannot
/// make them collide.
///
/// Over the key's bytes alone: `hash_one` of a `str` also writes a 0xff
/// terminator, which keeps the hashes of composite values apart (`("a",
/// "bc")` and `("ab", "c")`) and costs a second `write` (75 of the 167
/// instructions of a 5-byte key's hash); every key of these tables is one
/// string, whose length the hash already takes in.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyHasher(RandomState);

impl KeyHasher {
    pub(crate) fn new() -> Self {
        Self(RandomState::new())
    }

    /// The hash of `key`.
    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        let mut hasher = self.0.build_hasher();
        hasher.write(key);
        hasher.finish()
    }
}

/// Whether two keys of a table are the same: short keys compared as two
/// overlapping words each (no call; a table compares a key once per
/// check), longer ones as slices.
#[inline]
pub(crate) fn same_key(a: &[u8], b: &[u8]) -> bool {
    #[inline(always)]
    fn word<const N: usize>(key: &[u8], at: usize) -> Option<[u8; N]> {
        key.get(at..at + N).and_then(|w| w.try_into().ok())
    }
    let len = a.len();
    if len != b.len() {
        return false;
    }
    match len {
        0..4 => a.iter().zip(b).all(|(x, y)| x == y),
        4..=8 => {
            word::<4>(a, 0) == word::<4>(b, 0) && word::<4>(a, len - 4) == word::<4>(b, len - 4)
        }
        9..=16 => {
            word::<8>(a, 0) == word::<8>(b, 0) && word::<8>(a, len - 8) == word::<8>(b, len - 8)
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_hash_apart_and_alike() {
        let hasher = KeyHasher::new();
        assert_eq!(hasher.hash(b"api:k"), hasher.hash(b"api:k"));
        assert_eq!(hasher.clone().hash(b"api:k"), hasher.hash(b"api:k"));
        // The length counts: a key and the same key with a NUL byte more.
        assert_ne!(hasher.hash(b"k"), hasher.hash(b"k\0"));
        assert_ne!(hasher.hash(b""), hasher.hash(b"\0"));
        // Keyed at random: two hashers disagree.
        assert_ne!(KeyHasher::new().hash(b"k"), KeyHasher::new().hash(b"k"));
    }

    /// Every length up to 40 bytes, a key against itself and against the
    /// same key with any one byte changed or one byte more.
    #[test]
    fn keys_compare_as_slices_do() {
        for len in 0..40usize {
            let key: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            assert!(same_key(&key, &key.clone()), "{len}");
            for at in 0..len {
                let mut other = key.clone();
                other[at] ^= 0x20;
                assert!(!same_key(&key, &other), "{len} at {at}");
            }
            let mut longer = key.clone();
            longer.push(b'a');
            assert!(!same_key(&key, &longer), "{len}");
            assert!(!same_key(&longer, &key), "{len}");
        }
    }
}
