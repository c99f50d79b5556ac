//! What a store key is: the one rule for how every store, and every table
//! of this process, holds a key a client may have chosen.
//!
//! A key is held as it is when it is at most [`MAX_RAW_KEY_LEN`] bytes,
//! does not start with `#` and holds no brace; otherwise as `#` and its
//! SHA-1 (a fixed hash, the same in every process). So a client-chosen key
//! bounds the memory it takes, cannot break the Redis key layout (whose
//! hash tags are braces), and a raw key never meets a hashed one (only
//! those start with `#`). Change the rule here: the memory store, the Redis
//! store, the limiter and its tables all take it from this file.

use std::borrow::Cow;

use super::table_key::{KeyHasher, same_key};

/// Keys longer than this many bytes are stored under their hash.
pub const MAX_RAW_KEY_LEN: usize = 128;

/// A key as held, with its hash in one table's [`KeyHasher`]: the rule and
/// the hash are one read of the key.
pub(crate) struct StoreKey<'a> {
    text: Cow<'a, str>,
    hash: u64,
}

impl<'a> StoreKey<'a> {
    /// `key` as held, hashed by `hasher`. Inlined: a store's check reads
    /// the key once, and builds no value in memory to read it back.
    #[inline(always)]
    pub(crate) fn new(key: &'a str, hasher: &KeyHasher) -> Self {
        if fits(key.as_bytes()) {
            let (hash, braces) = hasher.hash_and_braces(key.as_bytes());
            if !braces {
                return Self {
                    text: Cow::Borrowed(key),
                    hash,
                };
            }
        }
        Self::hashed(key, hasher)
    }

    /// `key` not held as it is.
    #[cold]
    #[inline(never)]
    fn hashed(key: &str, hasher: &KeyHasher) -> Self {
        let text = hashed(key);
        let hash = hasher.hash(text.as_bytes());
        Self {
            text: Cow::Owned(text),
            hash,
        }
    }

    /// Whether a store key that is `raw` behind a prefix is read once for
    /// both ([`is_as_given`](Self::is_as_given) of the whole then says
    /// `raw` is held as it is too): a part of a key that fits and holds no
    /// brace fits and holds none too; only a leading `#` is the raw key's
    /// own. The limiter checks its memory store this way.
    #[inline(always)]
    pub(crate) fn raw_follows_whole(raw: &str) -> bool {
        !raw.starts_with('#')
    }

    /// Whether the key is held as it was given (not as its hash).
    #[inline(always)]
    pub(crate) fn is_as_given(&self) -> bool {
        matches!(self.text, Cow::Borrowed(_))
    }

    /// The key as held, for a table to keep (a new key: the only copy).
    pub(crate) fn to_text<T: for<'s> From<&'s str>>(&self) -> T {
        T::from(&self.text)
    }

    /// Its hash in the table's hasher.
    #[inline]
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Whether `held`, a key a table holds, is this one.
    #[inline]
    pub(crate) fn is(&self, held: &str) -> bool {
        same_key(held.as_bytes(), self.text.as_bytes())
    }
}

/// `key` as held, for a store or a table that hashes it no further (Redis,
/// the limiter's own keys, an operator's command).
#[inline]
pub(crate) fn bounded_key(key: &str) -> Cow<'_, str> {
    if fits(key.as_bytes()) && !has_brace(key.as_bytes()) {
        Cow::Borrowed(key)
    } else {
        Cow::Owned(hashed(key))
    }
}

/// `key` as held, owned.
#[inline]
pub(crate) fn bounded(key: String) -> String {
    match bounded_key(&key) {
        Cow::Borrowed(_) => key,
        Cow::Owned(hashed) => hashed,
    }
}

/// Whether `key` is short enough, and not of the hashed form, to be held
/// as it is (when it holds no brace).
#[inline]
fn fits(key: &[u8]) -> bool {
    key.len() <= MAX_RAW_KEY_LEN && key.first() != Some(&b'#')
}

/// Whether `key` holds a `{` or a `}`, for a key not hashed here (what
/// [`KeyHasher::hash_and_braces`] finds while hashing; a test holds the two
/// to every byte value at every place). Every byte looked at: a loop the
/// compiler vectorises, for the long keys clients send (an API key of 38
/// bytes took 231 instructions fewer than a loop stopping at the first).
#[inline]
fn has_brace(key: &[u8]) -> bool {
    key.iter()
        .fold(false, |found, &b| found | (b == b'{') | (b == b'}'))
}

/// The high bit of each byte of `word` that is `{` or `}`, and maybe of
/// bytes above such a byte: zero exactly when no byte is a brace. The
/// rule's braces eight bytes at a time, for [`KeyHasher`] to find them in
/// the pass that hashes a key ([`has_brace`] is the same, a byte at a
/// time; a test holds the two together). (A byte
/// equal to `b` is a zero byte of `word ^ b…b`, which the borrow of
/// subtracting 1 from each byte finds.)
#[inline(always)]
pub(super) fn brace_bytes(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let zero_bytes = |x: u64| x.wrapping_sub(ONES) & !x;
    (zero_bytes(word ^ (ONES * u64::from(b'{'))) | zero_bytes(word ^ (ONES * u64::from(b'}'))))
        & (ONES * 0x80)
}

/// The form of a key not held as it is.
#[cold]
fn hashed(key: &str) -> String {
    format!("#{}", sha1_smol::Sha1::from(key.as_bytes()).digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule, read both ways: hashed with a table's hasher and bounded
    /// alone, every key is held alike.
    #[test]
    fn a_key_is_held_alike_with_and_without_its_hash() {
        let hasher = KeyHasher::new();
        let at_bound = "i".repeat(MAX_RAW_KEY_LEN);
        let over = "o".repeat(MAX_RAW_KEY_LEN + 1);
        let brace_last = format!("{}}}", "j".repeat(MAX_RAW_KEY_LEN - 1));
        for (key, as_is) in [
            ("", true),
            ("k", true),
            ("ключ", true),
            (at_bound.as_str(), true),
            (over.as_str(), false),
            ("#k", false),
            ("{k}", false),
            ("a{", false),
            ("l}", false),
            (brace_last.as_str(), false),
        ] {
            let held = StoreKey::new(key, &hasher);
            let text: String = held.to_text();
            assert_eq!(text, bounded_key(key), "{key}");
            assert_eq!(text == key, as_is, "{key}");
            assert_eq!(held.hash(), hasher.hash(text.as_bytes()), "{key}");
            assert!(held.is(&bounded(key.to_owned())), "{key}");
            if !as_is {
                assert!(text.starts_with('#') && text.len() == 41);
                // A hashed key is hashed again, never held as it is.
                assert_ne!(bounded_key(&text), text);
            }
        }
    }

    /// A prefixed key is read once only when that is what bounding its raw
    /// key first, then the whole, gives: for every prefix and raw key
    /// above, and the ones that reach the bound together.
    #[test]
    fn a_prefixed_key_is_read_once_only_when_its_raw_key_is_held_as_is() {
        let hasher = KeyHasher::new();
        let raws = [
            "",
            "k",
            "#k",
            "k#",
            "{k}",
            "a{",
            &"i".repeat(MAX_RAW_KEY_LEN - 4),
        ];
        for prefix in ["api:", "{api}:", "#api:", ":", ""] {
            for raw in raws
                .iter()
                .copied()
                .chain([&*"r".repeat(MAX_RAW_KEY_LEN - prefix.len() + 1)])
            {
                let key = format!("{prefix}{raw}");
                let held = StoreKey::new(&key, &hasher);
                let read_once = StoreKey::raw_follows_whole(raw) && held.is_as_given();
                let bounded_twice =
                    bounded_key(&format!("{prefix}{}", bounded_key(raw))).into_owned();
                let as_is = bounded_key(raw) == raw && bounded_twice == key;
                assert_eq!(read_once, as_is, "{prefix} {raw}");
                if read_once {
                    assert!(held.is(&bounded_twice) && held.hash() == hasher.hash(key.as_bytes()));
                }
            }
        }
    }

    /// A brace is found at any place of a key of any length to 40 bytes,
    /// and only a brace, by the scan and by the hasher alike.
    #[test]
    fn braces_are_found_wherever_they_are() {
        let hasher = KeyHasher::new();
        for len in 0..40usize {
            let key = vec![b'a'; len];
            assert!(!hasher.hash_and_braces(&key).1, "{len}");
            for at in 0..len {
                for byte in 0..=255u8 {
                    let mut other = key.clone();
                    other[at] = byte;
                    let brace = byte == b'{' || byte == b'}';
                    let found = hasher.hash_and_braces(&other).1;
                    assert_eq!(found, brace, "{len} at {at}: {byte}");
                    assert_eq!(has_brace(&other), brace, "{len} at {at}: {byte}");
                }
            }
        }
    }
}
