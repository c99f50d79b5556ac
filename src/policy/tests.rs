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
    let big: Policy = "20000/s".parse().unwrap();
    assert!(matches!(
        big.with_cost(10_001),
        Err(PolicyError::CostTooLarge { .. })
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
