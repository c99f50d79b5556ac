//! `MemoryStore`'s own tests: keys across algorithms and forms, lease
//! ids, and the bound and sweep of the keys held.

use super::*;
use crate::clock::{Clock, ManualClock};
use crate::store::MAX_RAW_KEY_LEN;
use std::time::Duration;

/// Two policies counting one key keep each other's counters, as Redis
/// keeps each window's count.
#[test]
fn policies_sharing_a_key_keep_each_others_counters() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let store = MemoryStore::with_clock(clock);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let short = "2/1s"
            .parse::<Policy>()
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap();
        let long = "100/min"
            .parse::<Policy>()
            .unwrap()
            .with_algorithm(algorithm)
            .unwrap();
        let mut admitted = 0;
        for _ in 0..10 {
            admitted += usize::from(store.check_now("k", &short).allowed());
            store.check_now("k", &long);
        }
        assert_eq!(admitted, 2, "{algorithm}");
    }
}

/// A key the store holds hashed (a brace, `#` first, too long) is
/// found by a check, which hashes it while reading it, as by an
/// operator's command, which bounds it first: a block of it bites, and
/// it counts apart from the keys it resembles.
#[test]
fn keys_held_hashed_are_found_by_checks_and_commands_alike() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let store = MemoryStore::with_clock(clock);
    let policy: Policy = "2/s".parse().unwrap();
    let long = "k".repeat(MAX_RAW_KEY_LEN + 1);
    // At the bound, its only brace in the last word.
    let brace_last = format!("{}}}", "j".repeat(MAX_RAW_KEY_LEN - 1));
    let pairs = [
        ("{k}", "k"),
        ("l}", "l"),
        ("a{", "a"),
        ("#m", "m"),
        ("ab{cdefgh}ijklmnopq", "abcdefghijklmnopq"),
        ("ключ{", "ключ"),
        (&brace_last, &brace_last[1..]),
        (&long, &long[1..]),
    ];
    let block = Command::Block(Duration::from_secs(60));
    for (key, look_alike) in pairs {
        assert!(store.check_now(key, &policy).allowed(), "{key}");
        store.command_now(key, &policy, block);
        assert!(store.check_now(key, &policy).blocked(), "{key}");
        // A look-alike held as it is counts on its own.
        let other = store.check_now(look_alike, &policy);
        assert!(other.allowed() && !other.blocked(), "{key}");
    }
    // Keys held as they are (the empty key, non-ASCII, exactly at the
    // bound) are found alike too.
    let at_bound = "i".repeat(MAX_RAW_KEY_LEN);
    for key in ["", "ключ", &at_bound] {
        assert!(store.check_now(key, &policy).allowed(), "{key}");
        store.command_now(key, &policy, block);
        assert!(store.check_now(key, &policy).blocked(), "{key}");
    }
}

/// A concurrency check takes a lease id only when admitted: ids are
/// unique across new and held keys, and a denial takes none.
#[test]
fn lease_ids_are_taken_by_admissions_alone() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let store = MemoryStore::with_clock(clock);
    let policy = Policy::concurrency(1).unwrap();
    let first = store.check_now("a", &policy).lease().unwrap();
    let denied = store.check_now("a", &policy);
    assert!(!denied.allowed() && denied.lease().is_none());
    store.release_now("a", &policy, first);
    let second = store.check_now("a", &policy).lease().unwrap();
    // The denial between them took no id from the shard's count.
    assert_eq!(second.id(), first.id() + 1);
    let mut ids = std::collections::HashSet::from([first.id(), second.id()]);
    for i in 0..100 {
        let lease = store.check_now(&format!("k{i}"), &policy).lease().unwrap();
        assert!(ids.insert(lease.id()), "{i}");
    }
}

#[test]
fn idle_keys_are_swept_and_the_key_count_is_bounded() {
    let clock = ManualClock::new(Duration::from_secs(1_000));
    let store = MemoryStore::with_clock(clock.clone()).with_max_keys(160);
    let policy: Policy = "5/s".parse().unwrap();
    // A flood of 100,000 distinct keys, some of them long (held hashed).
    for i in 0..100_000 {
        let key = if i % 10 == 0 {
            format!("{i}{}", "x".repeat(500))
        } else {
            format!("k{i}")
        };
        store.check_now(&key, &policy);
        if i % 1_000 == 0 {
            assert!(store.len() <= 160);
        }
    }
    assert!(store.len() <= 160);
    assert!(store.len() >= 150, "{}", store.len());
    // Every key goes idle. A store in use on one key (one shard)
    // sweeps a shard a period, in turn: within a period per shard,
    // every idle key is gone, and not before.
    store.check_now("busy", &policy);
    clock.advance(Duration::from_secs(2));
    let (idle, per_shard) = (store.len(), 160 / SHARDS);
    for turn in 1..=SHARDS {
        store.check_now("busy", &policy);
        // One shard a period, at most.
        assert!(
            store.len() + per_shard * turn >= idle,
            "{turn}: {}",
            store.len()
        );
        clock.advance(Duration::from_micros(SWEEP_PERIOD));
    }
    assert!(store.len() <= 16, "{}", store.len());
    // By the clock, not by the checks: a shard sweeps once a period,
    // however many checks it takes; a clock moved back counts as a
    // period passed.
    let store = MemoryStore::with_clock(clock.clone());
    let index = MemoryStore::shard_of(StoreKey::new("busy", &store.inner.hasher).hash());
    let sweeps = |store: &MemoryStore| store.lock(index).sweeps;
    store.check_now("busy", &policy);
    let first = sweeps(&store);
    for _ in 0..10_000 {
        store.check_now("busy", &policy);
    }
    assert_eq!(sweeps(&store), first);
    clock.advance(Duration::from_micros(SWEEP_PERIOD - 1));
    store.check_now("busy", &policy);
    assert_eq!(sweeps(&store), first);
    clock.advance(Duration::from_micros(1));
    store.check_now("busy", &policy);
    assert_eq!(sweeps(&store), first + 1);
    clock.set(clock.now() - Duration::from_secs(1));
    store.check_now("busy", &policy);
    assert_eq!(sweeps(&store), first + 2);
    store.check_now("busy", &policy);
    assert_eq!(sweeps(&store), first + 2);
}
