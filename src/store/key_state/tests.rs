//! `KeyState`'s own tests: one state per key across algorithms, and its
//! bytes.

use std::time::Duration;

use super::*;
use crate::store::MemoryStore;

const NOW: Duration = Duration::from_secs(1_700_000_000);

fn policy(text: &str) -> Policy {
    text.parse().unwrap()
}

/// The policies of every algorithm, with two rates where they take them.
fn every_algorithm() -> Vec<Policy> {
    vec![
        policy("3/s, 10/min"),
        policy("3/s, 10/min").fixed_window().unwrap(),
        policy("2/s, 100/day in Europe/Paris"),
        policy("3/s, 10/min").sliding_window().unwrap(),
        policy("3/s, 10/min").gcra().unwrap(),
        Policy::concurrency(3).unwrap(),
    ]
}

/// What a caller reads of a decision.
fn read(d: &Decision) -> impl PartialEq + std::fmt::Debug {
    (
        d.allowed(),
        d.blocked(),
        d.algorithm(),
        d.rates().to_vec(),
        d.retry_after(),
    )
}

/// The case: one key checked alternately under a fixed window and
/// GCRA counts each apart, as `MemoryStore` does (one state per key and
/// algorithm used to admit every request).
#[test]
fn one_state_per_key_counts_each_algorithm_apart() {
    let fixed = policy("4/min").fixed_window().unwrap();
    let gcra = policy("4/min").gcra().unwrap();
    let clock = crate::clock::ManualClock::new(NOW);
    let memory = MemoryStore::with_clock(clock);
    let mut state = KeyState::new();
    for i in 0..12 {
        let policy = if i % 2 == 0 { &fixed } else { &gcra };
        let got = state.check(NOW, policy);
        let expected = memory.check_now("k", policy);
        assert_eq!(read(&got), read(&expected), "request {i}");
    }
    assert!(!state.check(NOW, &fixed).allowed());
}

/// A block holds under every algorithm; a reset under any lifts it and
/// clears that algorithm's counts only.
#[test]
fn a_block_covers_every_algorithm_and_a_reset_lifts_it() {
    let fixed = policy("2/min").fixed_window().unwrap();
    let gcra = policy("2/min").gcra().unwrap();
    let mut state = KeyState::new();
    for p in [&fixed, &fixed, &gcra] {
        assert!(state.check(NOW, p).allowed());
    }
    state.command(NOW, &gcra, Command::Block(Duration::from_secs(30)));
    assert!(state.check(NOW, &fixed).blocked());
    assert!(state.check(NOW, &gcra).blocked());
    // The fixed window's minute ends at 1_700_000_040 s, after the block.
    assert_eq!(state.expires_at(), NOW + Duration::from_secs(40));
    state.command(NOW, &gcra, Command::Reset);
    assert!(
        !state.check(NOW, &fixed).allowed(),
        "the fixed window's counts stay"
    );
    assert!(
        state.check(NOW, &gcra).allowed(),
        "GCRA's counts are cleared"
    );
}

/// Written to bytes and read back at any step, a state decides as the one
/// kept in memory, for every algorithm, commands and slots given back.
#[test]
fn a_state_read_back_from_bytes_decides_the_same() {
    for policy in every_algorithm() {
        let mut kept = KeyState::new();
        let mut stored = KeyState::new().to_bytes();
        let mut now = NOW;
        for step in 0..60u64 {
            let mut read_back = KeyState::from_bytes(&stored).unwrap();
            let (got, expected) = match step % 7 {
                3 => (
                    read_back.command(now, &policy, Command::Penalty(1)),
                    kept.command(now, &policy, Command::Penalty(1)),
                ),
                5 => (
                    read_back.command(now, &policy, Command::Reward(2)),
                    kept.command(now, &policy, Command::Reward(2)),
                ),
                _ => (read_back.check(now, &policy), kept.check(now, &policy)),
            };
            assert_eq!(read(&got), read(&expected), "{policy}, step {step}");
            if let (Some(a), Some(b)) = (got.lease(), expected.lease())
                && step % 4 == 0
            {
                read_back.release(a);
                kept.release(b);
            }
            assert_eq!(
                read_back.expires_at(),
                kept.expires_at(),
                "{policy}, step {step}"
            );
            stored = read_back.to_bytes();
            now += Duration::from_millis(130 * (step % 5));
        }
    }
}

/// Version 1's bytes, written down: a build that reads them otherwise
/// (or no longer reads them) fails here. A GCRA key blocked until
/// 1_700_000_030 s, its TAT 1_700_000_000.5 s for 2/s (a 1 s window).
#[test]
fn version_1_bytes_read_back_as_written() {
    let mut bytes = vec![1];
    bytes.extend_from_slice(&1_700_000_030_000_000u64.to_le_bytes());
    bytes.extend_from_slice(&7u64.to_le_bytes());
    bytes.push(1);
    bytes.push(4);
    bytes.extend_from_slice(&1_700_000_001_000_000u64.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes());
    for word in [1_000_000u64, 1_700_000_000_500_000, 0f64.to_bits(), 2] {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    let mut state = KeyState::from_bytes(&bytes).unwrap();
    assert_eq!(state.to_bytes(), bytes);
    assert_eq!(state.expires_at(), Duration::from_secs(1_700_000_030));
    let gcra = policy("2/s").gcra().unwrap();
    assert!(state.check(NOW, &gcra).blocked());
    state.command(NOW, &gcra, Command::Reset);
    assert!(state.check(NOW, &gcra).allowed());
    // Before the reset, the TAT held one request of two.
    let mut state = KeyState::from_bytes(&bytes).unwrap();
    state.blocked_until = 0;
    assert!(state.check(NOW, &gcra).allowed());
    assert!(!state.check(NOW, &gcra).allowed());
}

/// Bytes of another version, cut, grown or corrupt are an error, never a
/// state; no input panics or allocates past its length.
#[test]
fn bad_bytes_are_an_error() {
    let mut state = KeyState::new();
    for policy in every_algorithm() {
        state.check(NOW, &policy);
    }
    let good = state.to_bytes();
    KeyState::from_bytes(&good).unwrap();
    assert_eq!(
        KeyState::from_bytes(&[]).unwrap_err(),
        StateError::Version { found: 0 }
    );
    let mut other = good.clone();
    other[0] = 2;
    let error = KeyState::from_bytes(&other).unwrap_err();
    assert_eq!(error, StateError::Version { found: 2 });
    assert!(error.to_string().contains("version 2"), "{error}");
    for cut in 1..good.len() {
        assert!(KeyState::from_bytes(&good[..cut]).is_err(), "cut at {cut}");
    }
    let mut longer = good.clone();
    longer.push(0);
    assert!(KeyState::from_bytes(&longer).is_err());
    // A record count far past the bytes.
    let mut huge = vec![1];
    huge.extend_from_slice(&[0; 16]);
    huge.extend_from_slice(&[1, 1]);
    huge.extend_from_slice(&[0; 8]);
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        KeyState::from_bytes(&huge).unwrap_err(),
        StateError::Length("shorter than the state")
    );
    // Every byte flipped: an error or a state, never a panic.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for at in 0..good.len() {
        for _ in 0..8 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let mut flipped = good.clone();
            flipped[at] ^= (rng as u8).max(1);
            if let Ok(mut state) = KeyState::from_bytes(&flipped) {
                for policy in every_algorithm() {
                    state.check(NOW, &policy);
                }
            }
        }
    }
}

/// Each record of each algorithm with its words at the extremes: an error,
/// or a state every policy checks without overflowing.
#[test]
fn extreme_words_are_refused_or_harmless() {
    // (tag, record bytes) of one record whose words are all `word`.
    let records = |word: u64| {
        let w = word.to_le_bytes();
        let words = |n: usize| w.repeat(n);
        let mut fixed = vec![0];
        fixed.extend(words(3));
        let mut lease = u128::from(word).to_le_bytes().to_vec();
        lease.extend(words(1));
        [
            (1u8, words(1)),
            (2, fixed),
            (3, words(4)),
            (4, words(4)),
            (5, lease),
        ]
    };
    for word in [0, 1, 1 << 53, (1 << 53) + 1, u64::MAX / 2, u64::MAX] {
        for (tag, record) in records(word) {
            let mut bytes = vec![1];
            bytes.extend_from_slice(&[0; 16]);
            bytes.extend_from_slice(&[1, tag]);
            bytes.extend_from_slice(&u64::MAX.to_le_bytes());
            bytes.extend_from_slice(&1u32.to_le_bytes());
            bytes.extend_from_slice(&record);
            if let Ok(state) = KeyState::from_bytes(&bytes) {
                for policy in every_algorithm() {
                    let mut state = state.clone();
                    state.check(NOW, &policy);
                    state.command(NOW, &policy, Command::Penalty(3));
                    state.command(NOW, &policy, Command::Reward(3));
                    state.check(NOW, &policy);
                }
            }
        }
    }
}

/// Version 1's bytes of every other algorithm, written down as the
/// encoding's documentation says: each reads back as written, and holds a
/// full quota at `NOW` (a whole second, 1_699_920_000 s the day's start).
#[test]
fn version_1_bytes_of_every_algorithm_read_back_as_written() {
    let us = |s: u64| s * 1_000_000;
    let now = us(1_700_000_000);
    let state = |tag: u8, expires: u64, records: &[&[u8]]| {
        let mut bytes = vec![1];
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&9u64.to_le_bytes());
        bytes.extend_from_slice(&[1, tag]);
        bytes.extend_from_slice(&expires.to_le_bytes());
        bytes.extend_from_slice(&(records.len() as u32).to_le_bytes());
        for record in records {
            bytes.extend_from_slice(record);
        }
        bytes
    };
    let words = |ws: &[u64]| ws.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
    let window = |kind: u8, head: &[u8], index: u64, count: u64| {
        let mut record = vec![kind];
        record.extend_from_slice(head);
        record.extend(words(&[index, count]));
        record
    };
    let calendar = [&[7u8][..], b"day:UTC"].concat();
    let lease = |id: u128, expiry: u64| [&id.to_le_bytes()[..], &expiry.to_le_bytes()].concat();
    let cases: Vec<(Policy, Vec<u8>)> = vec![
        (
            policy("2/s"),
            state(
                1,
                now + us(1),
                &[&words(&[now - 500_000]), &words(&[now - 200_000])],
            ),
        ),
        (
            policy("2/s").fixed_window().unwrap(),
            state(
                2,
                now + us(1),
                &[&window(0, &us(1).to_le_bytes(), 1_700_000_000, 2)],
            ),
        ),
        (
            policy("2/day"),
            state(
                2,
                now + us(6_400),
                &[&window(1, &calendar, us(1_699_920_000), 2)],
            ),
        ),
        (
            policy("2/s").sliding_window().unwrap(),
            state(3, now + us(2), &[&words(&[us(1), 1_700_000_000, 2, 0])]),
        ),
        (
            Policy::concurrency(2).unwrap(),
            state(
                5,
                now + us(30),
                &[&lease(1, now + us(30)), &lease(2, now + us(30))],
            ),
        ),
    ];
    for (policy, bytes) in cases {
        let mut state = KeyState::from_bytes(&bytes).unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert_eq!(state.to_bytes(), bytes, "{policy}");
        let denied = state.check(NOW, &policy);
        assert!(!denied.allowed(), "{policy}: the stored quota is full");
    }
}
