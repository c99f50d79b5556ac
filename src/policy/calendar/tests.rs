//! The calendar's periods, anchors and boundaries on known instants.

use super::*;

/// An instant written in RFC 3339 (`2026-03-28T23:00Z`), µs since the
/// epoch.
fn at(text: &str) -> u64 {
    let instant: Timestamp = text.parse().unwrap();
    u64::try_from(instant.as_microsecond()).unwrap()
}

fn window(calendar: Calendar, now: &str) -> (u64, u64) {
    calendar.window_at(at(now))
}

fn span(from: &str, to: &str) -> (u64, u64) {
    (at(from), at(to))
}

const HOUR: u64 = 3_600_000_000;

#[test]
fn months_follow_their_lengths_and_leap_years() {
    let month = Calendar::month();
    assert_eq!(
        window(month, "2026-01-31T23:59:59Z"),
        span("2026-01-01T00:00Z", "2026-02-01T00:00Z")
    );
    assert_eq!(
        window(month, "2026-02-01T00:00Z"),
        span("2026-02-01T00:00Z", "2026-03-01T00:00Z")
    );
    // 2028 is a leap year: February has 29 days.
    let (start, end) = window(month, "2028-02-28T12:00Z");
    assert_eq!((start, end), span("2028-02-01T00:00Z", "2028-03-01T00:00Z"));
    assert_eq!(end - start, 29 * 24 * HOUR);
    assert_eq!(
        window(month, "2028-02-29T23:00Z"),
        span("2028-02-01T00:00Z", "2028-03-01T00:00Z")
    );
    // December to January: a new year.
    assert_eq!(
        window(month, "2026-12-31T23:59:59.999999Z"),
        span("2026-12-01T00:00Z", "2027-01-01T00:00Z")
    );
    assert_eq!(
        window(month, "2027-01-01T00:00Z"),
        span("2027-01-01T00:00Z", "2027-02-01T00:00Z")
    );
}

#[test]
fn days_across_daylight_saving_changes_last_23_and_25_hours() {
    let paris = Calendar::day().in_zone("Europe/Paris").unwrap();
    // 2026-03-29: clocks go from 02:00 to 03:00 (+01:00 to +02:00).
    let (start, end) = window(paris, "2026-03-29T12:00Z");
    assert_eq!((start, end), span("2026-03-28T23:00Z", "2026-03-29T22:00Z"));
    assert_eq!(end - start, 23 * HOUR);
    // 2026-10-25: clocks go from 03:00 back to 02:00.
    let (start, end) = window(paris, "2026-10-25T12:00Z");
    assert_eq!((start, end), span("2026-10-24T22:00Z", "2026-10-25T23:00Z"));
    assert_eq!(end - start, 25 * HOUR);
    // A month in Paris starts at local midnight.
    let month = Calendar::month().in_zone("Europe/Paris").unwrap();
    assert_eq!(
        window(month, "2026-03-31T22:30Z"),
        span("2026-03-31T22:00Z", "2026-04-30T22:00Z")
    );
    assert_eq!(
        window(month, "2026-03-31T21:30Z"),
        span("2026-02-28T23:00Z", "2026-03-31T22:00Z")
    );
}

#[test]
fn a_billing_anchor_clamps_to_short_months() {
    let fifteenth = Calendar::month().from_day(15).unwrap();
    assert_eq!(
        window(fifteenth, "2026-02-10T00:00Z"),
        span("2026-01-15T00:00Z", "2026-02-15T00:00Z")
    );
    assert_eq!(
        window(fifteenth, "2026-02-15T00:00Z"),
        span("2026-02-15T00:00Z", "2026-03-15T00:00Z")
    );
    assert_eq!(
        window(fifteenth, "2026-12-20T00:00Z"),
        span("2026-12-15T00:00Z", "2027-01-15T00:00Z")
    );
    let last = Calendar::month().from_day(31).unwrap();
    assert_eq!(
        window(last, "2026-02-10T00:00Z"),
        span("2026-01-31T00:00Z", "2026-02-28T00:00Z")
    );
    assert_eq!(
        window(last, "2026-03-05T00:00Z"),
        span("2026-02-28T00:00Z", "2026-03-31T00:00Z")
    );
    assert_eq!(
        window(last, "2026-04-29T23:00Z"),
        span("2026-03-31T00:00Z", "2026-04-30T00:00Z")
    );
    assert_eq!(
        window(last, "2026-04-30T05:00Z"),
        span("2026-04-30T00:00Z", "2026-05-31T00:00Z")
    );
    assert_eq!(
        window(last, "2028-02-15T00:00Z"),
        span("2028-01-31T00:00Z", "2028-02-29T00:00Z")
    );
}

#[test]
fn weeks_start_on_their_weekday() {
    // 2026-11-26 is a Thursday.
    assert_eq!(
        window(Calendar::week(), "2026-11-26T10:00Z"),
        span("2026-11-23T00:00Z", "2026-11-30T00:00Z")
    );
    let wednesday = Calendar::week().from_weekday(Weekday::Wednesday).unwrap();
    assert_eq!(
        window(wednesday, "2026-11-26T10:00Z"),
        span("2026-11-25T00:00Z", "2026-12-02T00:00Z")
    );
    assert_eq!(
        window(wednesday, "2026-11-24T23:59Z"),
        span("2026-11-18T00:00Z", "2026-11-25T00:00Z")
    );
    let sunday = Calendar::week().from_weekday(Weekday::Sunday).unwrap();
    assert_eq!(
        window(sunday, "2026-11-29T00:00Z"),
        span("2026-11-29T00:00Z", "2026-12-06T00:00Z")
    );
}

#[test]
fn fixed_offsets_move_midnight() {
    let india = Calendar::day().in_zone("+05:30").unwrap();
    assert_eq!(
        window(india, "2026-11-26T20:00Z"),
        span("2026-11-26T18:30Z", "2026-11-27T18:30Z")
    );
    let west = Calendar::day().in_zone("-08:00").unwrap();
    assert_eq!(
        window(west, "2026-11-26T07:59Z"),
        span("2026-11-25T08:00Z", "2026-11-26T08:00Z")
    );
}

#[test]
fn boundaries_surround_the_window() {
    let month = Calendar::month();
    assert_eq!(
        month.boundaries(at("2026-03-10T00:00Z")),
        [
            at("2026-02-01T00:00Z"),
            at("2026-03-01T00:00Z"),
            at("2026-04-01T00:00Z"),
            at("2026-05-01T00:00Z"),
        ]
    );
}

#[test]
fn the_cache_follows_the_clock_backwards_and_forwards() {
    let day = Calendar::day();
    for now in [
        "2026-05-02T10:00Z",
        "2026-05-01T10:00Z",
        "2026-05-03T00:00Z",
    ] {
        let (start, end) = window(day, now);
        assert!(start <= at(now) && at(now) < end, "{now}");
        assert_eq!(end - start, 24 * HOUR);
    }
    // A clock beyond jiff's range still gets a window, not a panic.
    let (start, end) = day.window_at(u64::MAX - 1);
    assert!(start <= end);
}

#[test]
fn slots_name_calendars_and_never_windows() {
    let paris = Calendar::month()
        .in_zone("Europe/Paris")
        .unwrap()
        .from_day(15)
        .unwrap();
    assert_eq!(Calendar::from_slot(paris.slot()), Some(paris));
    assert_eq!(Calendar::from_slot(86_400_000_000), None);
    assert_ne!(paris.slot(), Calendar::month().slot());
    assert_eq!(paris.field(), "month:Europe/Paris:15");
    assert_eq!(Calendar::day().field(), "day:UTC");
    let wed = Calendar::week().from_weekday(Weekday::Wednesday).unwrap();
    assert_eq!(wed.field(), "week:UTC:wed");
}
