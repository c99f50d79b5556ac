//! GCRA (token bucket) on every store: MemoryStore on a manual clock (exact
//! values) and RedisStore's Lua script against a real redis-server (real
//! time, margins), plus Redis-only checks of exactness under contention and
//! of the key's layout and expiry. Only what is its own: the refill
//! arithmetic. What every algorithm does is in conformance.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::RedisServer;
use crate::support::contention::admitted_under_contention;
use crate::support::harness::{Harness, MS, now_us};
use tower_redis_ratelimit::{Algorithm, Policy, RedisStore, Store};

/// `max` admitted at once (remaining and reset counting down), then denied
/// until one interval (`window / max`) has passed.
async fn burst_then_denied(h: Harness) {
    let p = h.policy_of("4/1s", Algorithm::Gcra);
    let t0 = h.mark();
    for (remaining, reset_ms) in [(3, 250), (2, 500), (1, 750), (0, 1000)] {
        let d = h.check("k", &p).await;
        assert!(d.allowed(), "request {} of the burst", 4 - remaining);
        assert_eq!(d.algorithm(), Algorithm::Gcra);
        assert_eq!((d.limit(), d.remaining()), (4, remaining));
        assert_eq!(d.retry_after(), Duration::ZERO);
        h.assert_near(
            d.reset(),
            (reset_ms * MS).saturating_sub(h.since(t0)),
            "reset",
        );
    }
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    assert_eq!((d.limit(), d.remaining()), (4, 0));
    h.assert_near(
        d.retry_after(),
        (250 * MS).saturating_sub(h.since(t0)),
        "retry_after",
    );
    h.assert_near(
        d.reset(),
        Duration::from_secs(1).saturating_sub(h.since(t0)),
        "reset of a denied request",
    );
    // Denied requests take nothing: still denied, still the same wait.
    assert!(!h.check("k", &p).await.allowed());
}

/// After the burst, one more request every `window / max`, never two.
async fn steady_refill(h: Harness) {
    let p = h.policy_of("4/1s", Algorithm::Gcra);
    for _ in 0..4 {
        assert!(h.check("k", &p).await.allowed());
    }
    assert!(!h.check("k", &p).await.allowed());
    for round in 0..3 {
        h.advance_past(250 * MS).await;
        let d = h.check("k", &p).await;
        assert!(d.allowed(), "round {round}: one token came back");
        assert_eq!(d.remaining(), 0, "round {round}");
        let d = h.check("k", &p).await;
        assert!(!d.allowed(), "round {round}: only one token came back");
    }
    // A full window idle refills the whole bucket, and no more.
    h.advance_past(Duration::from_secs(1)).await;
    for remaining in [3, 2, 1, 0] {
        let d = h.check("k", &p).await;
        assert!(d.allowed());
        assert_eq!(d.remaining(), remaining);
    }
    assert!(!h.check("k", &p).await.allowed());
}

/// A request of cost `c` takes `c` tokens: its reset is `c` intervals
/// later, and a denied one waits until `c` tokens are back.
async fn cost_takes_several_tokens(h: Harness) {
    let p = h.policy_of("5/1s", Algorithm::Gcra).with_cost(2).unwrap();
    let t0 = h.mark();
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    h.assert_near(d.reset(), 400 * MS, "reset after cost 2");
    assert_eq!(h.check("k", &p).await.remaining(), 1);
    let d = h.check("k", &p).await;
    assert!(!d.allowed());
    // Two tokens are back one interval (200 ms) after the bucket had one.
    h.assert_near(
        d.retry_after(),
        (200 * MS).saturating_sub(h.since(t0)),
        "retry_after of cost 2",
    );
}

/// Remaining and reset follow the partial refill between requests.
async fn remaining_and_reset_follow_the_refill(h: Harness) {
    let p = h.policy_of("4/1s", Algorithm::Gcra);
    let t0 = h.mark();
    assert!(h.check("k", &p).await.allowed());
    let d = h.check("k", &p).await;
    assert_eq!(d.remaining(), 2);
    h.assert_near(d.reset(), 500 * MS, "reset after two");
    h.advance(100 * MS).await;
    // 2.4 tokens, one taken: 1.4 left; full 750 ms after t0.
    let d = h.check("k", &p).await;
    assert!(d.allowed());
    assert_eq!(d.remaining(), 1);
    h.assert_near(
        d.reset(),
        (750 * MS).saturating_sub(h.since(t0)),
        "reset after a partial refill",
    );
    h.advance_past(Duration::from_secs(1)).await;
    let d = h.check("k", &p).await;
    assert_eq!(d.remaining(), 3, "a full bucket again");
    h.assert_near(d.reset(), 250 * MS, "reset of a fresh bucket");
}

/// A refund (a reward of what one check took) after the key's debt has
/// drained, wholly or in part, leaves exactly the state of a twin key
/// that never took that check: never a unit more. (A refund of a drained
/// unit gives nothing back: the bucket cannot be fuller than full.)
async fn a_refund_after_a_drained_debt_is_exact(h: Harness) {
    use tower_redis_ratelimit::store::Command;
    let p = h.policy_of("4/1s", Algorithm::Gcra);
    // `taken` checks once and takes a penalty of 6 (1.75 s: 0.75 s of
    // debt past the window); `twin` only takes the penalty.
    for (after, key) in [(1_000, "partly"), (1_900, "wholly"), (600, "in-debt")] {
        let (taken, twin) = (format!("{key}-taken"), format!("{key}-twin"));
        assert!(h.check(&taken, &p).await.allowed());
        h.command(&taken, &p, Command::Penalty(6)).await;
        h.command(&twin, &p, Command::Penalty(6)).await;
        h.advance(after * MS).await;
        let refunded = h.command(&taken, &p, Command::Reward(1)).await;
        let untaken = h.command(&twin, &p, Command::Peek).await;
        assert_eq!(
            refunded.remaining(),
            untaken.remaining(),
            "{key}: remaining"
        );
        h.assert_near(refunded.reset(), untaken.reset(), &format!("{key}: reset"));
        h.assert_near(
            refunded.retry_after(),
            untaken.retry_after(),
            &format!("{key}: retry after"),
        );
        // And as many checks admitted from here on.
        let mut admitted = [0, 0];
        for (i, k) in [&taken, &twin].into_iter().enumerate() {
            while h.check(k, &p).await.allowed() {
                admitted[i] += 1;
                assert!(admitted[i] <= 4, "{key}: more than a full bucket");
            }
        }
        assert_eq!(admitted[0], admitted[1], "{key}: admitted after the refund");
    }
}

support::every_store!([
    a_refund_after_a_drained_debt_is_exact,
    burst_then_denied,
    steady_refill,
    cost_takes_several_tokens,
    remaining_and_reset_follow_the_refill,
]);

/// Two independent stores (two pools, as two processes would have) send 500
/// checks of one key at once: exactly the burst is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_admits_exactly_the_limit_under_contention() {
    let server = RedisServer::start();
    let policy = "100/60s".parse::<Policy>().unwrap().gcra().unwrap();
    let admitted = admitted_under_contention(&server, policy, "hot", 500).await;
    assert_eq!(admitted, 100);
}

/// One hash per key, one field per rate (the window in µs), gone once every
/// TAT is in the past.
#[tokio::test]
async fn redis_key_holds_one_tat_per_rate_and_expires() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy: Policy = "2/200ms, 5/400ms"
        .parse::<Policy>()
        .unwrap()
        .gcra()
        .unwrap();
    assert!(store.check("k", &policy).await.unwrap().allowed());
    let key = store.redis_key("gcra", "k");
    assert_eq!(key, "rl:gcra:{k}");
    assert!(server.command(&["TYPE", &key]).contains("hash"));
    let fields = server.command(&["HKEYS", &key]);
    assert!(
        fields.contains("200000") && fields.contains("400000"),
        "{fields}"
    );
    let mut conn = ::redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut value = async |field: &str| -> Vec<u8> {
        ::redis::cmd("HGET")
            .arg(&key)
            .arg(field)
            .query_async(&mut conn)
            .await
            .unwrap()
    };
    let short = value("200000").await;
    // 'b', then the whole µs, the fraction, the max and the key's expiry
    // (ms) as little-endian doubles: 200 ms / 2 = 100000 µs exactly, no
    // fraction, under a max of 2.
    assert_eq!((short.len(), short[0]), (33, b'b'), "{short:?}");
    let double = |bytes: &[u8], i: usize| {
        f64::from_le_bytes(bytes[1 + 8 * i..9 + 8 * i].try_into().unwrap())
    };
    let (whole, frac, written, expiry) = (
        double(&short, 0),
        double(&short, 1),
        double(&short, 2),
        double(&short, 3),
    );
    assert_eq!(written, 2.0, "{short:?}");
    assert!(
        whole > 1e15 && whole.fract() == 0.0,
        "a TAT in whole µs since the epoch: {short:?}"
    );
    assert_eq!(frac, 0.0, "{short:?}");
    let pttl: i64 = server
        .command(&["PTTL", &key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    // The latest TAT is 100 ms ahead (200 ms / 2; the other is 400 ms / 5);
    // a check sets the expiry one longest window (400 ms) beyond it, so that
    // the next checks need not set it again, and records it in every value.
    // (Expiries are whole milliseconds, rounded up.)
    assert!(pttl > 200 && pttl <= 502, "PTTL {pttl}");
    // The expiry recorded is the key's (ms since the epoch; Redis 7).
    let expires_at: f64 = server
        .command(&["PEXPIRETIME", &key])
        .trim()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    assert_eq!(expiry, expires_at);
    assert_eq!(double(&value("400000").await, 3), expiry);
    // A second admission within the window leaves the expiry as it was.
    assert!(store.check("k", &policy).await.unwrap().allowed());
    assert_eq!(double(&value("200000").await, 3), expiry);
    assert_eq!(double(&value("400000").await, 3), expiry);
    tokio::time::sleep(600 * MS).await;
    assert!(server.command(&["EXISTS", &key]).starts_with(":0"));
    // Denied requests write nothing.
    let one: Policy = "1/1s".parse::<Policy>().unwrap().gcra().unwrap();
    assert!(store.check("d", &one).await.unwrap().allowed());
    let key = store.redis_key("gcra", "d");
    let before = server.command(&["HGET", &key, "1000000"]);
    assert!(!store.check("d", &one).await.unwrap().allowed());
    assert_eq!(server.command(&["HGET", &key, "1000000"]), before);
    // A flushed script cache (a Redis restart, a failover) is reloaded.
    assert!(server.command(&["SCRIPT", "FLUSH"]).starts_with("+OK"));
    assert!(store.check("e", &one).await.unwrap().allowed());
}

/// Awkward intervals (10 s / 7) at real timestamps: a burst of exactly max,
/// on Redis as in memory (the TAT is kept as an offset, not a raw double).
#[tokio::test]
async fn redis_bursts_are_exact_for_awkward_intervals() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    for max in [7u64, 49] {
        let policy: Policy = format!("{max}/10s")
            .parse::<Policy>()
            .unwrap()
            .gcra()
            .unwrap();
        let key = format!("burst-{max}");
        for i in 0..max {
            let d = store.check(&key, &policy).await.unwrap();
            assert!(d.allowed(), "request {i} of {max}");
        }
        assert!(!store.check(&key, &policy).await.unwrap().allowed());
    }
}

/// A TAT an earlier version wrote as text ("<whole> <fraction> <max>") is
/// counted by a check (batched) as it was, and written back in the
/// current form: an upgrade carries every key's count over.
#[tokio::test]
async fn a_tat_written_as_text_by_an_earlier_version_carries_over() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = "10/10s".parse::<Policy>().unwrap().gcra().unwrap();
    let now_us = now_us();
    // 8 of 10 units used (T = 1 s): the TAT 8 s ahead; 2 are left.
    let key = store.redis_key("gcra", "text");
    let tat = format!("{} 0.25 10", now_us + 8_000_000);
    server.command(&["HSET", &key, "10000000", &tat]);
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += u32::from(store.check("text", &policy).await.unwrap().allowed());
    }
    assert_eq!(admitted, 2);
    let mut conn = ::redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let value: Vec<u8> = ::redis::cmd("HGET")
        .arg(&key)
        .arg("10000000")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        (value.len(), value[0]),
        (33, b'b'),
        "written back as {value:?}"
    );
}

/// A TAT written before the interval was stored ("<whole> <fraction>") is
/// read under the rate's interval: counts of keys written by an earlier
/// version carry over.
#[tokio::test]
async fn a_tat_without_its_interval_reads_under_the_current_one() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let policy = "10/10s".parse::<Policy>().unwrap().gcra().unwrap();
    let now_us = now_us();
    // 8 units used under T = 1 s: the TAT 8 s ahead.
    let key = store.redis_key("gcra", "old");
    let tat = format!("{} 0", now_us + 8_000_000);
    server.command(&["HSET", &key, "10000000", &tat]);
    let decision = store
        .command("old", &policy, tower_redis_ratelimit::store::Command::Peek)
        .await
        .unwrap();
    assert!(decision.allowed());
    assert!(
        (1..=2).contains(&decision.remaining()),
        "{}",
        decision.remaining()
    );
}
