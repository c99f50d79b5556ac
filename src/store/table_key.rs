//! How the tables this process holds keys in find a key: its hash and
//! its comparison.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use super::store_key::brace_bytes;

/// Hashes keys for the in-process tables (a [`MemoryStore`](crate::MemoryStore)'s
/// shards, a local quota's held units, the deny cache): SipHash-1-3 under a
/// random key, as std's `HashMap`, so a client who picks its keys cannot
/// make them collide.
///
/// Over the key's bytes alone, in one pass that also finds whether the key
/// holds a brace (which [`StoreKey`](crate::store::StoreKey) must
/// rewrite): a key is read once per check, where std's hasher (which
/// buffers whatever a `write` leaves over, and terminates a `str` with a
/// second `write`) and a separate scan read it twice. Every key of these
/// tables is one string, whose length the hash takes in.
#[derive(Debug, Clone)]
pub(crate) struct KeyHasher {
    keys: [u64; 2],
}

impl Default for KeyHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyHasher {
    /// A hasher under a random key: two words hashed under std's random
    /// per-process key (what a `HashMap` is keyed with), which no client
    /// sees.
    pub(crate) fn new() -> Self {
        let random = RandomState::new();
        Self {
            keys: [random.hash_one(0u64), random.hash_one(1u64)],
        }
    }

    /// The hash of `key`.
    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        sip::<1, 3>(self.keys, key).0
    }

    /// The hash of `key`, and whether it holds a `{` or a `}`.
    #[inline]
    pub(crate) fn hash_and_braces(&self, key: &[u8]) -> (u64, bool) {
        let (hash, braces) = sip::<1, 3>(self.keys, key);
        (hash, braces != 0)
    }
}

/// SipHash-`C`-`D` of `bytes` under `keys` (Aumasson and Bernstein's
/// reference: 8-byte little-endian words, the last one padded and topped by
/// the length's low byte), and a word whose high bits are set where a byte
/// of `bytes` is a brace (zero when none is; the key rule's
/// [`brace_bytes`]).
#[inline(always)]
fn sip<const C: usize, const D: usize>(keys: [u64; 2], bytes: &[u8]) -> (u64, u64) {
    let [k0, k1] = keys;
    let mut v = [
        k0 ^ 0x736f_6d65_7073_6575,
        k1 ^ 0x646f_7261_6e64_6f6d,
        k0 ^ 0x6c79_6765_6e65_7261,
        k1 ^ 0x7465_6462_7974_6573,
    ];
    let mut braces = 0;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let m = word_of(word);
        braces |= brace_bytes(m);
        v[3] ^= m;
        rounds::<C>(&mut v);
        v[0] ^= m;
    }
    let tail = tail(words.remainder());
    braces |= brace_bytes(tail);
    let m = tail | ((bytes.len() as u64) << 56);
    v[3] ^= m;
    rounds::<C>(&mut v);
    v[0] ^= m;
    v[2] ^= 0xff;
    rounds::<D>(&mut v);
    (v[0] ^ v[1] ^ v[2] ^ v[3], braces)
}

/// An 8-byte chunk as a little-endian word.
#[inline(always)]
fn word_of(chunk: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(chunk);
    u64::from_le_bytes(word)
}

#[inline(always)]
fn rounds<const N: usize>(v: &mut [u64; 4]) {
    for _ in 0..N {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }
}

/// The last 0 to 7 bytes as a little-endian word padded with zeros, read
/// as at most three loads (overlapping ones agree on the bytes they share).
#[inline(always)]
fn tail(rest: &[u8]) -> u64 {
    let n = rest.len();
    if n >= 4 {
        let low = u64::from(u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]));
        let high = u64::from(u32::from_le_bytes([
            rest[n - 4],
            rest[n - 3],
            rest[n - 2],
            rest[n - 1],
        ]));
        low | (high << (8 * (n - 4)))
    } else if n > 0 {
        u64::from(rest[0])
            | (u64::from(rest[n / 2]) << (8 * (n / 2)))
            | (u64::from(rest[n - 1]) << (8 * (n - 1)))
    } else {
        0
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

    /// The same rounds as SipHash-2-4 give std's `SipHasher` (the
    /// reference, with known keys) for every length to 40 bytes: the words,
    /// the tail and the length are read as the reference reads them.
    #[test]
    #[allow(deprecated)]
    fn the_rounds_are_siphash() {
        use std::hash::Hasher as _;
        let keys = [0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908];
        let bytes: Vec<u8> = (0u8..40).map(|b| b.wrapping_mul(37) ^ 0x5a).collect();
        for len in 0..=bytes.len() {
            let mut reference = std::hash::SipHasher::new_with_keys(keys[0], keys[1]);
            reference.write(&bytes[..len]);
            assert_eq!(
                sip::<2, 4>(keys, &bytes[..len]).0,
                reference.finish(),
                "{len}"
            );
        }
        // The paper's first test vector: the empty message.
        assert_eq!(sip::<2, 4>(keys, b"").0, 0x726f_db47_dd0e_0e31);
    }

    /// SipHash-1-3, the rounds the tables use, gives the `siphasher`
    /// crate's SipHash-1-3 for every length to 40 bytes under several keys.
    #[test]
    fn the_tables_hash_is_siphash_1_3() {
        use std::hash::Hasher as _;
        let bytes: Vec<u8> = (0u8..40).map(|b| b.wrapping_mul(73) ^ 0xa5).collect();
        for keys in [[0, 0], [1, 2], [u64::MAX, 0x0123_4567_89ab_cdef]] {
            for len in 0..=bytes.len() {
                let mut reference = siphasher::sip::SipHasher13::new_with_keys(keys[0], keys[1]);
                reference.write(&bytes[..len]);
                assert_eq!(
                    sip::<1, 3>(keys, &bytes[..len]).0,
                    reference.finish(),
                    "{len}"
                );
            }
        }
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
