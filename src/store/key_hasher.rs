//! The hash of a key in the tables this process holds keys in.

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
}
