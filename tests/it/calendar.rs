//! Quotas by the calendar (`"500/day"`, `"1000000/month in Europe/Paris
//! from 15"`): MemoryStore on a manual clock (month ends, a leap year, a
//! daylight-saving change, billing anchors: exact values), and RedisStore
//! against a real redis-server, whose own clock decides: there the
//! boundaries are computed independently with jiff from the system clock
//! (Redis runs on this machine), and a fixed offset is picked so that a
//! day's boundary falls two seconds from now, so a real boundary passes on
//! Redis's clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};
use tower_redis_ratelimit::clock::{ManualClock, SkewedClock, SystemClock};
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::store::Command;
use tower_redis_ratelimit::{Algorithm, Decision, MemoryStore, Policy, RedisStore, Store};

use crate::support::RedisServer;

/// How far a Redis decision's times may be from those computed here: a
/// round trip on loopback, and the wait of a check for its batch.
const MARGIN: Duration = Duration::from_millis(250);

/// An instant in RFC 3339 (`2026-03-28T23:00Z`) as a clock reads it.
fn at(text: &str) -> Duration {
    let instant: Timestamp = text.parse().unwrap();
    Duration::from_micros(u64::try_from(instant.as_microsecond()).unwrap())
}

fn now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

/// The next local midnight in `zone` after the system clock's now, and the
/// first of next month's, computed with jiff's own calendar arithmetic
/// (not the crate's).
fn next_midnight(zone: &TimeZone) -> Duration {
    let today = Timestamp::now()
        .to_zoned_datetime(zone.clone())
        .start_of_day()
        .unwrap();
    let tomorrow = today.checked_add(1.day()).unwrap();
    Duration::from_micros(u64::try_from(tomorrow.timestamp().as_microsecond()).unwrap())
}

fn next_month(zone: &TimeZone) -> Duration {
    let first = Timestamp::now()
        .to_zoned_datetime(zone.clone())
        .first_of_month()
        .unwrap()
        .start_of_day()
        .unwrap();
    let next = first.checked_add(1.month()).unwrap();
    Duration::from_micros(u64::try_from(next.timestamp().as_microsecond()).unwrap())
}

fn assert_near(actual: Duration, expected: Duration, what: &str) {
    let gap = actual.abs_diff(expected);
    assert!(
        gap <= MARGIN,
        "{what}: {actual:?}, expected {expected:?} (off by {gap:?})"
    );
}

/// Wait until at least `room` away from the next UTC midnight, so a test
/// of days in UTC sees one day throughout.
async fn away_from_midnight(room: Duration) {
    let left = next_midnight(&TimeZone::UTC).saturating_sub(now());
    if left < room {
        tokio::time::sleep(left + Duration::from_millis(100)).await;
    }
}

/// A fixed offset (`+HH:MM:SS`) whose local midnight falls `ahead` (whole
/// seconds, at least one) after the next whole second of the system clock,
/// and that instant.
fn offset_with_midnight_in(ahead: u64) -> (String, Duration) {
    let boundary = now().as_secs() + 1 + ahead;
    // Local time = UTC + offset; midnight when (boundary + offset) % 86400 == 0.
    let mut offset = (86_400 - (boundary % 86_400) as i64) % 86_400;
    if offset > 43_200 {
        offset -= 86_400;
    }
    let sign = if offset < 0 { '-' } else { '+' };
    let s = offset.unsigned_abs();
    let text = format!("{sign}{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    (text, Duration::from_secs(boundary))
}

// ---- MemoryStore, manual clock ------------------------------------------

/// Through the `Store` trait, as every caller reaches it: a month's end, a
/// leap February, Paris's short and long days, a billing month from the
/// 31st and a week from Wednesday each end at their real boundary.
#[tokio::test]
async fn memory_store_windows_end_at_the_real_boundaries() {
    let cases = [
        ("2/month", "2026-01-31T23:59:59Z", "2026-02-01T00:00Z"),
        ("2/month", "2028-02-29T23:00Z", "2028-03-01T00:00Z"),
        ("2/month", "2026-12-31T23:59Z", "2027-01-01T00:00Z"),
        (
            "2/day in Europe/Paris",
            "2026-03-29T01:30Z",
            "2026-03-29T22:00Z",
        ),
        (
            "2/day in Europe/Paris",
            "2026-10-25T01:30Z",
            "2026-10-25T23:00Z",
        ),
        ("2/month from 31", "2026-02-27T12:00Z", "2026-02-28T00:00Z"),
        ("2/month from 31", "2026-04-29T12:00Z", "2026-04-30T00:00Z"),
        (
            "2/month in Europe/Paris from 15",
            "2026-11-14T22:59Z",
            "2026-11-14T23:00Z",
        ),
        ("2/week from wed", "2026-11-30T12:00Z", "2026-12-02T00:00Z"),
        ("2/day in -08:00", "2026-11-26T07:00Z", "2026-11-26T08:00Z"),
    ];
    for (text, start, boundary) in cases {
        let clock = ManualClock::new(at(start));
        let store = MemoryStore::with_clock(clock.clone());
        let policy: Policy = text.parse().unwrap();
        assert_eq!(policy.algorithm(), Algorithm::FixedWindow);
        let left = at(boundary) - at(start);
        for remaining in [1, 0] {
            let d = store.check("k", &policy).await.unwrap();
            assert!(d.allowed(), "{text} at {start}");
            assert_eq!((d.remaining(), d.reset()), (remaining, left), "{text}");
        }
        let denied = store.check("k", &policy).await.unwrap();
        assert!(!denied.allowed(), "{text} at {start}");
        assert_eq!(denied.retry_after(), left, "{text} at {start}");
        clock.set(at(boundary));
        let d = store.check("k", &policy).await.unwrap();
        assert!(d.allowed(), "{text} at {boundary}");
        assert_eq!(d.remaining(), 1, "{text} at {boundary}");
    }
}

// ---- RedisStore, Redis's clock ------------------------------------------

/// The store checking one check at a time (check.lua) and in batches
/// (batch.lua, the default).
async fn stores(server: &RedisServer) -> [(&'static str, RedisStore); 2] {
    let batched = RedisStore::connect(&server.url()).await.unwrap();
    let alone = RedisStore::connect(&server.url())
        .await
        .unwrap()
        .with_batches(0);
    [("batched", batched), ("alone", alone)]
}

fn pttl(server: &RedisServer, key: &str) -> Duration {
    let reply = server.command(&["PTTL", key]);
    Duration::from_millis(reply.trim().trim_start_matches(':').parse().unwrap())
}

/// A day and a month in UTC on Redis: the count is held across checks,
/// each reset is the time to the real next boundary, and each rate counts
/// in an integer named by its calendar and its window's start, which
/// expires at the window's end.
#[tokio::test]
async fn redis_counts_a_day_and_a_month_to_their_boundaries() {
    let server = RedisServer::start();
    away_from_midnight(Duration::from_secs(10)).await;
    for (how, store) in stores(&server).await {
        let policy: Policy = "3/day, 5/month in UTC".parse().unwrap();
        let key = format!("day-month-{how}");
        for remaining in [2, 1, 0] {
            let d = store.check(&key, &policy).await.unwrap();
            assert!(d.allowed(), "{how}");
            assert_eq!(d.remaining(), remaining, "{how}");
            let [day, month] = d.rates() else { panic!() };
            assert_near(
                day.reset(),
                next_midnight(&TimeZone::UTC) - now(),
                "day's reset",
            );
            assert_near(
                month.reset(),
                next_month(&TimeZone::UTC) - now(),
                "month's reset",
            );
        }
        let denied = store.check(&key, &policy).await.unwrap();
        assert!(!denied.allowed(), "{how}");
        assert_eq!(denied.limit(), 3);
        assert_near(
            denied.retry_after(),
            next_midnight(&TimeZone::UTC) - now(),
            "retry after",
        );
        assert_eq!(
            denied.rates()[1].remaining(),
            2,
            "{how}: a denial counts nowhere"
        );
        // One integer a window, named by its calendar and its start.
        let today = next_midnight(&TimeZone::UTC) - Duration::from_secs(86_400);
        let day = format!("rl:fixed:{{{key}}}:day:UTC:{}", today.as_micros());
        assert_eq!(
            server.command(&["GET", &day]).lines().nth(1),
            Some("3"),
            "{how}"
        );
        assert_near(
            pttl(&server, &day),
            next_midnight(&TimeZone::UTC) - now(),
            "the day's count expires at midnight",
        );
        let months = server.keys(&format!("rl:fixed:{{{key}}}:month:UTC:1:*"));
        let [month] = months.as_slice() else {
            panic!("{how}: {months:?}")
        };
        assert_eq!(
            server.command(&["GET", month]).lines().nth(1),
            Some("3"),
            "{how}"
        );
        assert_near(
            pttl(&server, month),
            next_month(&TimeZone::UTC) - now(),
            "the month's count expires at the month's end",
        );
    }
}

/// A day whose local midnight (a fixed offset with seconds) comes two
/// seconds from now: Redis, on its own clock, denies until the boundary,
/// the count expires at it, and the next day starts from zero; with each
/// check path.
#[tokio::test]
async fn redis_starts_a_new_day_at_a_real_boundary() {
    let server = RedisServer::start();
    for (how, store) in stores(&server).await {
        let (offset, boundary) = offset_with_midnight_in(2);
        let policy: Policy = format!("2/day in {offset}").parse().unwrap();
        // Shown as it reads back (an offset of whole minutes is shown
        // without its seconds: `+02:27`, not `+02:27:00`).
        assert_eq!(policy.to_string().parse::<Policy>().unwrap(), policy);
        let key = format!("edge-{how}");
        for _ in 0..2 {
            let d = store.check(&key, &policy).await.unwrap();
            assert!(d.allowed(), "{how} {offset}");
            assert_near(d.reset(), boundary - now(), "reset");
        }
        let denied = store.check(&key, &policy).await.unwrap();
        assert!(!denied.allowed(), "{how} {offset}");
        assert_near(denied.retry_after(), boundary - now(), "retry after");
        let counts = server.keys(&format!("rl:fixed:{{{key}}}:*"));
        let [count] = counts.as_slice() else {
            panic!("{how}: {counts:?}")
        };
        assert_near(
            pttl(&server, count),
            boundary - now(),
            "the count expires at the boundary",
        );
        tokio::time::sleep((boundary + Duration::from_millis(50)).saturating_sub(now())).await;
        let d = store.check(&key, &policy).await.unwrap();
        assert!(d.allowed(), "{how} {offset}: a new day");
        assert_eq!(d.remaining(), 1, "{how}");
        assert_near(
            d.reset(),
            boundary + Duration::from_secs(86_400) - now(),
            "next reset",
        );
    }
}

/// App servers whose clocks are five seconds ahead and behind pass
/// boundaries around their own time; Redis picks the day on its clock,
/// so both count in the same day, and the one ahead (which thinks the day
/// is over) is still denied until the real boundary.
#[tokio::test]
async fn redis_decides_calendar_windows_on_its_own_clock() {
    let server = RedisServer::start();
    let (ahead, behind) =
        crate::support::contention::skewed_stores(&server, Duration::from_secs(5)).await;
    let behind = behind.with_batches(0);
    let (offset, boundary) = offset_with_midnight_in(2);
    let policy: Policy = format!("2/day in {offset}").parse().unwrap();
    assert!(behind.check("k", &policy).await.unwrap().allowed());
    assert!(ahead.check("k", &policy).await.unwrap().allowed());
    let denied = ahead.check("k", &policy).await.unwrap();
    assert!(
        !denied.allowed(),
        "the client ahead is past the boundary, Redis is not"
    );
    assert_near(denied.retry_after(), boundary - now(), "retry after");
    assert!(!behind.check("k", &policy).await.unwrap().allowed());
    tokio::time::sleep((boundary + Duration::from_millis(50)).saturating_sub(now())).await;
    assert!(
        behind.check("k", &policy).await.unwrap().allowed(),
        "a new day"
    );
    assert!(ahead.check("k", &policy).await.unwrap().allowed());
    assert!(!behind.check("k", &policy).await.unwrap().allowed());
}

/// A client whose clock is days away passes boundaries that do not hold
/// Redis's time: the check fails (its fail mode decides) instead of
/// counting in the wrong window.
#[tokio::test]
async fn a_client_clock_days_away_fails_the_check() {
    let server = RedisServer::start();
    let policy: Policy = "2/day".parse().unwrap();
    for batches in [0, 2] {
        let store = RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_batches(batches)
            .with_clock(SkewedClock::ahead(
                SystemClock::new(),
                Duration::from_secs(3 * 86_400),
            ));
        let error = store.check("k", &policy).await.unwrap_err().to_string();
        assert!(
            error.contains("outside the boundaries the client passed"),
            "{error}"
        );
    }
    // Nothing counted (a batch of plain commands gives back what it
    // counted in the window its clock placed).
    for key in server.keys("rl:fixed:{k}*") {
        assert_eq!(server.command(&["GET", &key]).lines().nth(1), Some("0"));
    }
}

/// Peek, penalty, reward, block and reset on a month's count in
/// Paris, through `Store::command` (what the admin API and the `Limiter`
/// send): each answers with the real time to the boundary.
#[tokio::test]
async fn redis_commands_act_on_the_calendar_window() {
    let server = RedisServer::start();
    let paris = TimeZone::get("Europe/Paris").unwrap();
    for (how, store) in stores(&server).await {
        let policy: Policy = "10/month in Europe/Paris from 1".parse().unwrap();
        let key = format!("commands-{how}");
        let left = || next_month(&paris) - now();
        assert!(store.check(&key, &policy).await.unwrap().allowed());
        // A command answers as a request would after it (one more counts).
        let peek = |command| store.command(&key, &policy, command);
        let d: Decision = peek(Command::Peek).await.unwrap();
        assert_eq!(d.remaining(), 8, "{how}");
        assert_near(d.reset(), left(), "peek's reset");
        let d = peek(Command::Penalty(6)).await.unwrap();
        assert_eq!(d.remaining(), 2, "{how}");
        let d = peek(Command::Reward(3)).await.unwrap();
        assert_eq!(d.remaining(), 5, "{how}");
        let d = peek(Command::Penalty(100)).await.unwrap();
        assert!(!d.allowed(), "{how}");
        assert_near(d.retry_after(), left(), "a penalty waits for the boundary");
        let d = peek(Command::Reset).await.unwrap();
        assert_eq!(d.remaining(), 9, "{how}");
        let d = peek(Command::Block(Duration::from_secs(30))).await.unwrap();
        assert!(d.blocked(), "{how}");
        let d = peek(Command::Block(Duration::ZERO)).await.unwrap();
        assert!(d.allowed(), "{how}");
        let admitted = store.check(&key, &policy).await.unwrap();
        assert_eq!(admitted.remaining(), 9, "{how}");
        // A window counter's admission has no refund id: a reward gives it back.
        assert_eq!(admitted.refund_id(), None);
    }
}

/// Concurrent checks of one key in batches admit exactly the day's max.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_batches_admit_exactly_a_days_max() {
    let server = RedisServer::start();
    away_from_midnight(Duration::from_secs(10)).await;
    let store = Arc::new(
        RedisStore::connect(&server.url())
            .await
            .unwrap()
            .with_batches(1)
            .with_timeout(Duration::from_secs(5)),
    );
    let policy: Policy = "37/day, 1000/min".parse().unwrap();
    let before = server.calls("evalsha");
    let barrier = Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (store, policy, barrier) =
                (Arc::clone(&store), policy.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                store.check("hot", &policy).await.unwrap().allowed()
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    assert_eq!(admitted, 37);
    let calls = server.calls("evalsha") - before;
    assert!(calls < 100, "200 checks took {calls} EVALSHA: not batched");
}

/// A rules file with a calendar policy loads and limits: a monthly quota
/// per key, counted in Redis, with its reset at the month's end.
#[tokio::test]
async fn a_rules_file_limits_by_the_calendar() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let text = r#"
[[rules]]
name = "tokens"
key = "ip"
policy = "3/month in Europe/Paris from 15"
tiers = { pro = "100/min, 1000/month in Europe/Paris from 15" }
"#;
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap()).without_deny_cache();
    let active = rules.current();
    let limiter = active.limiter("tokens", None).unwrap();
    assert_eq!(limiter.policy().algorithm(), Algorithm::FixedWindow);
    assert_eq!(
        limiter.policy().to_string(),
        "3/month in Europe/Paris from 15"
    );
    for _ in 0..3 {
        assert!(limiter.check("203.0.113.9").await.unwrap().allowed());
    }
    let verdict = limiter.check("203.0.113.9").await.unwrap();
    let denied = verdict.decision().unwrap();
    assert!(!denied.allowed());
    let paris = TimeZone::get("Europe/Paris").unwrap();
    let next = {
        let local = Timestamp::now().to_zoned_datetime(paris.clone());
        let fifteenth = local
            .date()
            .first_of_month()
            .checked_add(14.days())
            .unwrap();
        let mut start = fifteenth.to_zoned_datetime(paris.clone()).unwrap();
        if start.timestamp() <= Timestamp::now() {
            start = start.checked_add(1.month()).unwrap();
        }
        Duration::from_micros(u64::try_from(start.timestamp().as_microsecond()).unwrap())
    };
    assert_near(denied.retry_after(), next - now(), "retry after");
    let pro = active.limiter("tokens", Some("pro")).unwrap();
    assert_eq!(pro.policy().algorithm(), Algorithm::FixedWindow);
    // A rule may not ask another algorithm of a calendar rate.
    let error = RuleSet::from_toml(
        r#"
[[rules]]
name = "x"
key = "ip"
policy = "5/day"
algorithm = "gcra"
"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("does not support a calendar rate"),
        "{error}"
    );
}

/// The admin API's peek of a calendar rule shows its count and its reset
/// at the real boundary.
#[cfg(feature = "admin")]
#[tokio::test]
async fn the_admin_peek_shows_a_calendar_window() {
    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;
    use tower_redis_ratelimit::admin::Admin;

    const TOKEN: &str = "an-admin-token-of-32-bytes-long!";
    let server = RedisServer::start();
    away_from_midnight(Duration::from_secs(10)).await;
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let text = "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"5/day\"\n";
    let rules = Rules::new(store, RuleSet::from_toml(text).unwrap()).without_deny_cache();
    let limiter = rules.current().limiter("api", None).unwrap().clone();
    assert!(limiter.check("203.0.113.9").await.unwrap().allowed());
    let router = Admin::new(TOKEN, "127.0.0.1:9000".parse().unwrap())
        .unwrap()
        .with_rules(&rules)
        .into_router();
    let request = Request::get("/api/limits/api/keys/203.0.113.9")
        .header("host", "127.0.0.1:9000")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    // A peek answers as a request would: one more counts.
    assert_eq!(body["state"]["remaining"], 3, "{body}");
    eprintln!("{body}");
}
