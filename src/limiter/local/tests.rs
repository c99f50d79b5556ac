//! The tests of `local`.

use super::super::held::{MAX_KEYS_PER_SHARD, MAX_LOCAL_KEYS};
use super::*;

/// Hold usable units of `key`, as a batch just taken would; false when
/// the key is checked in the store instead.
fn hold(local: &Local, key: &str, hold: Duration) -> bool {
    let Some(units) = local.held.units_of(key) else {
        return false;
    };
    let mut units = units.try_lock().unwrap();
    units.left = 5;
    units.until = Some(Instant::now() + hold);
    true
}

#[test]
fn the_keys_held_stay_bounded_and_expired_ones_make_room() {
    let hold_for = Duration::from_millis(300);
    let quota = LocalQuota::new(10, hold_for).unwrap();
    let local = Local::new(quota, &"1000/s".parse().unwrap(), Arc::new(Held::new())).unwrap();
    let held = (0..2 * MAX_LOCAL_KEYS)
        .filter(|i| hold(&local, &format!("k{i}"), hold_for))
        .count();
    assert_eq!(
        local.held.count().0,
        MAX_LOCAL_KEYS,
        "every shard full, none over"
    );
    assert!(held >= MAX_LOCAL_KEYS, "{held}");
    // Past the bound a key is not held, and no held key was dropped
    // for it while its units last.
    assert!(!hold(&local, "one more", hold_for));
    assert_eq!(local.held.count().0, MAX_LOCAL_KEYS);

    // Once the units ran out, new keys take their places.
    std::thread::sleep(hold_for + Duration::from_millis(100));
    let newer = (0..MAX_LOCAL_KEYS / 2)
        .filter(|i| hold(&local, &format!("new{i}"), hold_for))
        .count();
    assert_eq!(newer, MAX_LOCAL_KEYS / 2);
    assert_eq!(local.held.count().0, MAX_LOCAL_KEYS);
}

#[test]
fn a_key_in_use_is_not_dropped_to_make_room() {
    let hold_for = Duration::from_secs(60);
    let local = Local::new(
        LocalQuota::new(10, hold_for).unwrap(),
        &"1000/s".parse().unwrap(),
        Arc::new(Held::new()),
    )
    .unwrap();
    // Units nobody uses, of no value: any may go to make room...
    let in_use: Vec<_> = (0..2 * MAX_LOCAL_KEYS)
        .filter_map(|i| local.held.units_of(&format!("k{i}")))
        .collect();
    assert_eq!(in_use.len(), MAX_LOCAL_KEYS);
    // ...but every one is held by a check in flight.
    assert!(local.held.units_of("another").is_none());
    drop(in_use);
    assert!(local.held.units_of("another").is_some());
}

#[test]
fn forgotten_keys_do_not_grow_the_order_of_a_shard() {
    let hold_for = Duration::from_secs(60);
    let local = Local::new(
        LocalQuota::new(10, hold_for).unwrap(),
        &"1000/s".parse().unwrap(),
        Arc::new(Held::new()),
    )
    .unwrap();
    for _ in 0..5 {
        for i in 0..MAX_LOCAL_KEYS / 4 {
            let key = format!("k{i}");
            assert!(hold(&local, &key, hold_for));
            local.forget(&key);
        }
    }
    for shard in local.held.shards.iter() {
        let shard = shard.lock().unwrap();
        assert!(
            shard.order.len() <= 2 * MAX_KEYS_PER_SHARD,
            "{}",
            shard.order.len()
        );
        assert!(shard.keys.is_empty());
    }
}

/// A key as long as a header allows, many times over: held by its
/// hash, so the bytes the local quota holds do not grow with the keys.
#[tokio::test]
async fn long_keys_are_held_by_their_hash() {
    let limiter = crate::Limiter::new(crate::MemoryStore::new(), "10/s".parse().unwrap())
        .with_local_quota("5/1s".parse().unwrap())
        .unwrap();
    let long = "k".repeat(200_000);
    for i in 0..100 {
        assert!(
            limiter
                .check(&format!("{i}{long}"))
                .await
                .unwrap()
                .allowed()
        );
    }
    let local = limiter.inner.local.as_ref().unwrap();
    let (keys, bytes) = local.held.count();
    assert_eq!(keys, 100);
    // `#` and 40 hex digits a key.
    assert_eq!(bytes, 100 * 41);
}

/// A rule's tiers share one count, and so one batch of each key: the
/// bound `max + N × batch` holds whatever tiers a key is checked
/// under. (The store's clock is moved by hand past the window while
/// the units, held in real time, still last.)
#[tokio::test]
async fn the_tiers_of_a_count_hold_one_batch_of_a_key() {
    let clock = crate::clock::ManualClock::new(Duration::from_secs(1_000));
    let store = crate::MemoryStore::with_clock(clock.clone());
    let template = crate::Limiter::new(store, "100/s".parse().unwrap())
        .with_local_quota("5/1h".parse().unwrap())
        .unwrap();
    let free = template.for_rule("api", "10/3s".parse().unwrap());
    let pro = template.for_rule("api", "10/3s".parse().unwrap());
    let admitted = |verdicts: Vec<bool>| verdicts.into_iter().filter(|a| *a).count();
    // One request under each tier: one batch of 5 is taken.
    let mut first = Vec::new();
    for tier in [&free, &pro] {
        first.push(tier.check("k").await.unwrap().allowed());
    }
    // The window passes in the store; the units held still last.
    clock.advance(Duration::from_secs(3));
    let mut then = Vec::new();
    for i in 0..40 {
        let tier = if i % 2 == 0 { &free } else { &pro };
        then.push(tier.check("k").await.unwrap().allowed());
    }
    // max + one batch in the window ending now (each tier holding a
    // batch of its own admitted 20).
    assert_eq!(admitted(first) + admitted(then), 15);
}

/// A rule's higher tier uses a lower tier's units; a lower tier gives
/// a higher one's back and takes its own: a key alternating between
/// tiers is mostly admitted locally, not with two round trips a check.
#[tokio::test]
async fn tiers_alternating_on_a_key_are_mostly_admitted_locally() {
    let template = crate::Limiter::new(crate::MemoryStore::new(), "100/s".parse().unwrap())
        .with_local_quota("5/10s".parse().unwrap())
        .unwrap();
    let free = template.for_rule("api", "100/10s".parse().unwrap());
    let pro = template.for_rule("api", "200/10s".parse().unwrap());
    let mut local = 0;
    for i in 0..40 {
        let tier = if i % 2 == 0 { &free } else { &pro };
        let verdict = tier.check("k").await.unwrap();
        assert!(verdict.allowed());
        if verdict.decided_by() == DecidedBy::LocalQuota {
            local += 1;
        }
    }
    assert!(local >= 20, "{local} of 40 admitted locally");
}

/// Units a tier gives back go back under the policy that took them: a
/// GCRA key's state after a lower tier gave a higher tier's units back
/// is that of a twin key that took only what was used.
#[tokio::test]
async fn units_go_back_under_the_policy_that_took_them() {
    let store = crate::MemoryStore::new();
    let template = crate::Limiter::new(store.clone(), "100/s".parse().unwrap())
        .with_local_quota("5/1h".parse().unwrap())
        .unwrap();
    let free: Policy = "10/1m".parse::<Policy>().unwrap().gcra().unwrap();
    let pro: Policy = "1000/1m".parse::<Policy>().unwrap().gcra().unwrap();
    let (free_limiter, pro_limiter) = (
        template.for_rule("api", free.clone()),
        template.for_rule("api", pro.clone()),
    );
    // The key: pro takes a batch of 5 and uses one; free gives the
    // other 4 back (at pro's interval) and takes a batch of its own.
    assert!(pro_limiter.check("k").await.unwrap().allowed());
    assert!(free_limiter.check("k").await.unwrap().allowed());
    // The twin: one unit at pro's interval, 5 at free's.
    let twin = crate::Limiter::new(store.clone(), free.clone()).with_name("twin");
    let pro_twin = crate::Limiter::new(store.clone(), pro.clone()).with_name("twin");
    assert!(pro_twin.check_n("t", 1).await.unwrap().allowed());
    assert!(twin.check_n("t", 5).await.unwrap().allowed());
    let key = free_limiter.peek("k").await.unwrap();
    let expected = twin.peek("t").await.unwrap();
    assert_eq!(key.remaining(), expected.remaining());
    assert!(key.reset().abs_diff(expected.reset()) < Duration::from_millis(50));
}
