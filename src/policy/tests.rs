//! Rates and policies: parsed, written, validated.

use super::*;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn parses_the_documented_forms() {
    let p: Policy = "3/s, 20/min, 100/15m".parse().unwrap();
    let got: Vec<(u64, Duration)> = p.rates().iter().map(|r| (r.max(), r.window())).collect();
    assert_eq!(got, vec![(3, secs(1)), (20, secs(60)), (100, secs(900))]);
    let p: Policy = " 5/10s ,1/250ms, 7/2h,9/d , 4/m".parse().unwrap();
    let got: Vec<(u64, Duration)> = p.rates().iter().map(|r| (r.max(), r.window())).collect();
    assert_eq!(
        got,
        vec![
            (1, Duration::from_millis(250)),
            (5, secs(10)),
            (4, secs(60)),
            (7, secs(7200)),
            (9, secs(86_400)),
        ]
    );
}

#[test]
fn display_round_trips() {
    for text in ["3/s, 20/min, 100/15m", "1/250ms", "5/10s", "7/2h, 9/d"] {
        let p: Policy = text.parse().unwrap();
        assert_eq!(p.to_string().parse::<Policy>().unwrap(), p, "{text}");
    }
    assert_eq!("100/15m".parse::<Rate>().unwrap().to_string(), "100/15m");
    assert_eq!("1/1500ms".parse::<Rate>().unwrap().to_string(), "1/1500ms");
}

#[test]
fn errors_name_the_problem() {
    let msg = |s: &str| s.parse::<Policy>().unwrap_err().to_string();
    assert!(
        msg("0/s").contains("max must be at least 1"),
        "{}",
        msg("0/s")
    );
    assert!(msg("3/0s").contains("longer than zero"), "{}", msg("3/0s"));
    assert!(
        msg("3/s, 5/1s").contains("same window"),
        "{}",
        msg("3/s, 5/1s")
    );
    assert!(msg("3/fortnight").contains("unknown time unit \"fortnight\""));
    assert!(msg("hello").contains("expected <max>/<window>"));
    assert!(msg("").contains("at least one rate"));
    assert!(msg("3/s,").contains("stray comma"));
    assert!(msg("-3/s").contains("whole number"));
    assert!(msg("3/").contains("needs a unit"));
    assert!(
        msg("3/99999999999999d").contains("too long")
            || msg("3/99999999999999d").contains("out of range")
    );
    assert!(msg("99999999999999999999999/s").contains("too large"));
    assert!(msg("1/20000d").contains("out of range"));
}

#[test]
fn cost_is_validated_against_every_rate() {
    let p: Policy = "3/s, 20/min".parse().unwrap();
    assert_eq!(p.clone().with_cost(0).unwrap_err(), PolicyError::ZeroCost);
    let err = p.clone().with_cost(4).unwrap_err();
    assert!(
        err.to_string()
            .contains("cost 4 is above the max of rate 3/s"),
        "{err}"
    );
    assert_eq!(p.with_cost(3).unwrap().cost(), 3);
    // The sliding log keeps one entry per unit: at most MAX_COST; the
    // other algorithms count any cost up to the smallest max.
    let big: Policy = "20000/s".parse().unwrap();
    assert!(matches!(
        big.clone().with_cost(10_001),
        Err(PolicyError::CostTooLarge { .. })
    ));
    assert_eq!(big.max_cost(), 10_000);
    let gcra = big.gcra().unwrap();
    assert_eq!(gcra.max_cost(), 20_000);
    let costly = gcra.with_cost(15_000).unwrap();
    assert!(matches!(
        costly.with_algorithm(crate::Algorithm::SlidingLog),
        Err(PolicyError::CostTooLarge { cost: 15_000 })
    ));
}

#[test]
fn spacing_and_max_are_bounded() {
    let p: Policy = "3/s".parse().unwrap();
    assert!(
        p.clone()
            .with_min_spacing(Duration::ZERO)
            .unwrap()
            .min_spacing()
            .is_none()
    );
    let err = p
        .clone()
        .with_min_spacing(Duration::from_nanos(10))
        .unwrap_err();
    assert!(err.to_string().contains("minimum spacing"), "{err}");
    assert!(p.with_min_spacing(Duration::MAX).is_err());
    let err = Rate::new(MAX_MAX + 1, Duration::from_secs(1)).unwrap_err();
    assert!(err.to_string().contains("too large"), "{err}");
    assert!(Rate::new(MAX_MAX, Duration::from_secs(1)).is_ok());
}

#[test]
fn sub_millisecond_windows_are_rejected() {
    let err = Rate::new(1, Duration::from_micros(10)).unwrap_err();
    assert!(matches!(err, PolicyError::WindowOutOfRange { .. }));
}

#[test]
fn algorithms_parse_and_reject_what_they_cannot_enforce() {
    for a in Algorithm::ALL {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
    assert!(
        "leaky"
            .parse::<Algorithm>()
            .unwrap_err()
            .to_string()
            .contains("unknown algorithm")
    );
    let spaced = "3/s"
        .parse::<Policy>()
        .unwrap()
        .with_min_spacing(Duration::from_millis(10))
        .unwrap();
    let err = spaced.gcra().unwrap_err().to_string();
    assert!(
        err.contains("gcra algorithm does not support a minimum spacing"),
        "{err}"
    );
    let two: Policy = "3/s, 10/min".parse().unwrap();
    assert!(two.clone().gcra().is_ok());
    let err = two
        .with_algorithm(Algorithm::Concurrency)
        .unwrap_err()
        .to_string();
    assert!(err.contains("more than one rate"), "{err}");
    let c = Policy::concurrency(5).unwrap();
    assert_eq!(c.rates()[0].window(), DEFAULT_LEASE);
    assert!(c.clone().with_cost(2).is_err());
    assert!(c.with_lease(Duration::ZERO).is_err());
    assert!(
        "3/s"
            .parse::<Policy>()
            .unwrap()
            .with_lease(Duration::from_secs(1))
            .is_err()
    );
    assert!(Policy::concurrency(0).is_err());
}

#[test]
fn execution_parses() {
    assert_eq!("script".parse::<Execution>().unwrap(), Execution::Script);
    assert_eq!(
        "Transaction".parse::<Execution>().unwrap(),
        Execution::Transaction
    );
    let err = "both".parse::<Execution>().unwrap_err().to_string();
    assert_eq!(
        err,
        "unknown execution \"both\": use `transaction` or `script`"
    );
    assert_eq!(Execution::Script.to_string(), "script");
}

#[test]
fn an_execution_is_refused_for_every_algorithm_but_the_sliding_log() {
    let log: Policy = "3/s".parse().unwrap();
    for execution in [Execution::Transaction, Execution::Script] {
        assert_eq!(
            log.clone().with_execution(execution).unwrap().execution(),
            execution
        );
        for algorithm in [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::Gcra,
            Algorithm::Concurrency,
        ] {
            let other = log.clone().with_algorithm(algorithm).unwrap();
            let err = other.with_execution(execution).unwrap_err().to_string();
            assert!(
                err.contains(&format!(
                    "the {algorithm} algorithm does not support an execution"
                )),
                "{err}"
            );
        }
    }
    // Either order: a script policy does not become another algorithm.
    let script = log.with_execution(Execution::Script).unwrap();
    let err = script.gcra().unwrap_err().to_string();
    assert!(err.contains("only the sliding log"), "{err}");
}

#[test]
fn calendar_rates_parse_and_round_trip() {
    for (text, shown) in [
        ("500/day", "500/day"),
        ("10000/week", "10000/week"),
        ("1000000/month", "1000000/month"),
        (
            "1000000/month in Europe/Paris from 15",
            "1000000/month in Europe/Paris from 15",
        ),
        (
            "1000000/month from 15 in Europe/Paris",
            "1000000/month in Europe/Paris from 15",
        ),
        ("10000/week from wed", "10000/week from wed"),
        ("10000/week from Wednesday", "10000/week from wed"),
        ("10000/week from mon", "10000/week"),
        ("5/month from 1", "5/month"),
        ("500/day in +05:30", "500/day in +05:30"),
        ("500/day in -08", "500/day in -08:00"),
        ("500/day in UTC", "500/day"),
        ("500/day in +00:00", "500/day"),
        ("500/day in america/new_york", "500/day in America/New_York"),
        ("  7/ month   in  Asia/Tokyo  ", "7/month in Asia/Tokyo"),
    ] {
        let rate: Rate = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(rate.to_string(), shown, "{text}");
        assert_eq!(shown.parse::<Rate>().unwrap(), rate, "{text}");
        let policy: Policy = text.parse().unwrap();
        assert_eq!(policy.algorithm(), Algorithm::FixedWindow, "{text}");
        assert_eq!(policy.to_string().parse::<Policy>().unwrap(), policy);
    }
    let rate: Rate = "1000000/month in Europe/Paris from 15".parse().unwrap();
    let calendar = rate.calendar().unwrap();
    assert_eq!(calendar.period(), Period::Month);
    assert_eq!(calendar.zone(), "Europe/Paris");
    assert_eq!(calendar.anchor_day(), Some(15));
    assert_eq!(calendar.anchor_weekday(), None);
    assert_eq!(rate.window(), Duration::from_secs(31 * 86_400 + 3_600));
    let week: Rate = "3/week from fri".parse().unwrap();
    assert_eq!(
        week.calendar().unwrap().anchor_weekday(),
        Some(Weekday::Friday)
    );
    assert_eq!(week.window(), Duration::from_secs(7 * 86_400 + 3_600));
    assert_eq!("3/day".parse::<Rate>().unwrap().window(), secs(25 * 3_600));
    // Code builds the same rates.
    let built = Rate::on_calendar(
        1_000_000,
        Calendar::month()
            .in_zone("Europe/Paris")
            .unwrap()
            .from_day(15)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(built, rate);
    assert_eq!(Rate::daily(500).unwrap(), "500/day".parse().unwrap());
    assert_eq!(Rate::weekly(5).unwrap(), "5/week".parse().unwrap());
    assert_eq!(Rate::monthly(5).unwrap(), "5/month".parse().unwrap());
    assert_eq!(
        Rate::on_calendar(
            5,
            Calendar::week().from_weekday(Weekday::Wednesday).unwrap()
        )
        .unwrap(),
        "5/week from wed".parse().unwrap()
    );
}

#[test]
fn rolling_days_stay_rolling() {
    for text in ["9/d", "9/1d", "9/24h"] {
        let rate: Rate = text.parse().unwrap();
        assert_eq!(rate.calendar(), None, "{text}");
        assert_eq!(rate.window(), secs(86_400));
        assert_eq!(
            text.parse::<Policy>().unwrap().algorithm(),
            Algorithm::SlidingLog
        );
    }
}

#[test]
fn calendar_errors_name_the_problem() {
    let msg = |s: &str| s.parse::<Policy>().unwrap_err().to_string();
    let m = msg("5/day in Mars/Olympus");
    assert!(m.contains("unknown time zone \"Mars/Olympus\""), "{m}");
    assert!(m.contains("IANA name"), "{m}");
    let m = msg("5/day in +27:00");
    assert!(m.contains("unknown time zone \"+27:00\""), "{m}");
    let m = msg("5/month from 32");
    assert!(
        m.contains("anchor \"32\" for a calendar month: a month starts on a day from 1 to 31"),
        "{m}"
    );
    let m = msg("5/month from 0");
    assert!(m.contains("anchor \"0\""), "{m}");
    let m = msg("5/month from wed");
    assert!(m.contains("anchor \"wed\" for a calendar month"), "{m}");
    let m = msg("5/week from 15");
    assert!(
        m.contains("anchor \"15\" for a calendar week: a week starts on a weekday"),
        "{m}"
    );
    let m = msg("5/day from 3");
    assert!(
        m.contains("a calendar day starts at midnight and takes no anchor"),
        "{m}"
    );
    let m = msg("5/day in");
    assert!(m.contains("\"in\" needs a value"), "{m}");
    let m = msg("5/day in UTC in UTC");
    assert!(m.contains("written twice"), "{m}");
    let m = msg("5/day at noon");
    assert!(m.contains("unexpected \"at\""), "{m}");
    let m = msg("5/2day");
    assert!(m.contains("a calendar period takes no count"), "{m}");
    let m = msg("0/month");
    assert!(m.contains("max must be at least 1"), "{m}");
    // One calendar rate per period; a rolling 25 hours has a day's window.
    let m = msg("5/day, 9/day in Europe/Paris");
    assert!(m.contains("same window"), "{m}");
    assert!(Calendar::day().from_day(3).is_err());
    assert!(Calendar::month().from_weekday(Weekday::Monday).is_err());
    assert!(Calendar::month().from_day(31).is_ok());
}

#[test]
fn calendar_rates_count_in_fixed_windows_only() {
    let policy: Policy = "100/min, 1000000/month".parse().unwrap();
    assert_eq!(policy.algorithm(), Algorithm::FixedWindow);
    assert_eq!(policy.rates()[0].max(), 100);
    assert_eq!(policy.clone().fixed_window().unwrap(), policy);
    for algorithm in [
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::Gcra,
        Algorithm::Concurrency,
    ] {
        let err = policy
            .clone()
            .with_algorithm(algorithm)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "the {algorithm} algorithm does not support a calendar rate"
            )),
            "{err}"
        );
    }
    let err = Policy::token_bucket(Rate::monthly(10).unwrap(), 5).unwrap_err();
    assert!(err.to_string().contains("calendar rate"), "{err}");
    // The fallback's share keeps the calendar.
    let shared = policy.shared_by(4);
    assert_eq!(shared.rates()[1].calendar(), policy.rates()[1].calendar());
    assert_eq!(shared.rates()[1].max(), 250_000);
    assert_eq!(policy.longest_window(), secs(31 * 86_400 + 3_600));
}

/// The longest window in µs is that of the `Duration`, spacing included.
#[test]
fn the_longest_window_in_micros_is_the_durations() {
    let sub_micro = Policy::new([Rate::new(10, Duration::from_nanos(1_500_500)).unwrap()]).unwrap();
    let parsed =
        ["3/s", "3/s, 20/min", "7/1500ms", "5/2h, 1/300ms"].map(|text| text.parse().unwrap());
    for policy in parsed.into_iter().chain([sub_micro]) {
        let policy: Policy = policy;
        for policy in [
            policy.clone(),
            policy
                .clone()
                .with_min_spacing(Duration::from_millis(1))
                .unwrap(),
            policy
                .with_min_spacing(Duration::from_secs(3 * 3600) + Duration::from_nanos(999))
                .unwrap(),
        ] {
            assert_eq!(
                policy.longest_window_micros(),
                duration_micros(policy.longest_window()),
                "{policy:?}"
            );
        }
    }
}
