//! Envoy's reference rate limit server (`envoyproxy/ratelimit`) as an
//! operator moving from it tries this crate: its own test configurations
//! (`test/config/*.yaml` and their config tests), the examples of its
//! README, and the answers its service gives, asked over gRPC of a
//! service in memory and one on Redis. The differences the guide lists
//! ("From the reference server") are asserted as this crate answers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tower_redis_ratelimit::envoy::envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use tower_redis_ratelimit::envoy::envoy_types::pb::google::protobuf::UInt64Value;
use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{MemoryStore, RedisStore};

use crate::envoy::{descriptor, over, serve};
use crate::support::RedisServer;
use crate::support::harness::away_from_a_boundary;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// Where a service counts.
#[derive(Debug, Clone, Copy)]
enum On {
    Memory,
    Redis,
}

/// A service answering `set`, counting `on` a store (with the Redis
/// server it needs), and a client of it.
struct Service {
    client: Client,
    _server: Option<RedisServer>,
}

impl Service {
    async fn start(set: RuleSet, on: On) -> Self {
        let (rules, server) = match on {
            On::Memory => (Rules::new(MemoryStore::new(), set), None),
            On::Redis => {
                let server = RedisServer::start();
                let store = RedisStore::connect(&server.url()).await.unwrap();
                (Rules::new(store, set), Some(server))
            }
        };
        let client = serve(rules).await;
        Self {
            client,
            _server: server,
        }
    }

    async fn yaml(files: &[(&str, &str)], on: On) -> Self {
        Self::start(RuleSet::from_envoy_yaml(files.iter().copied()).unwrap(), on).await
    }

    async fn ask(
        &mut self,
        domain: &str,
        descriptors: Vec<RateLimitDescriptor>,
    ) -> RateLimitResponse {
        self.client
            .should_rate_limit(RateLimitRequest {
                domain: domain.to_owned(),
                descriptors,
                hits_addend: 0,
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// The status of one descriptor of `entries`, asked alone.
    async fn status(&mut self, domain: &str, entries: &[(&str, &str)]) -> DescriptorStatus {
        let response = self.ask(domain, vec![descriptor(entries)]).await;
        assert_eq!(response.statuses.len(), 1);
        response.statuses[0].clone()
    }
}

/// `descriptor(entries)` at a cost of `hits`.
fn costing(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(UInt64Value { value: hits }),
        ..descriptor(entries)
    }
}

/// `descriptor(entries)` with its own limit.
fn own(entries: &[(&str, &str)], requests_per_unit: u32, unit: Unit) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(rate_limit_descriptor::RateLimitOverride {
            requests_per_unit,
            unit: unit as i32,
        }),
        ..descriptor(entries)
    }
}

/// The limit a status reports: its requests per unit, unit and name.
fn limit(status: &DescriptorStatus) -> Option<(u32, Unit, String)> {
    status.current_limit.as_ref().map(|l| {
        (
            l.requests_per_unit,
            Unit::try_from(l.unit).unwrap(),
            l.name.clone(),
        )
    })
}

fn rate(requests: u32, unit: Unit) -> Option<(u32, Unit, String)> {
    Some((requests, unit, String::new()))
}

const BOTH: [On; 2] = [On::Memory, On::Redis];

/// `test/config/basic_config.yaml`.
const BASIC_CONFIG: &str = r#"
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit:
          unit: second
          requests_per_unit: 5
      - key: subkey1
        value: subvalue1
        rate_limit:
          unit: second
          requests_per_unit: 10
  - key: key2
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: key2
    value: value2
    rate_limit:
      unit: minute
      requests_per_unit: 30
  # First level override with no limit. This effectively whitelists the value.
  - key: key2
    value: value3
  - key: key3
    rate_limit:
      unit: hour
      requests_per_unit: 1
  - key: key4
    rate_limit:
      name: key4_rate_limit
      unit: day
      requests_per_unit: 1
  - key: key5
    value: value5
    rate_limit:
      unit: day
      requests_per_unit: 15
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit:
          unit: day
          requests_per_unit: 25
  - key: key6
    rate_limit:
      unlimited: true
  - key: key7
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 70
"#;

/// `TestBasicConfig`: the limit each descriptor finds.
#[tokio::test]
async fn the_basic_config_finds_the_reference_limits() {
    for on in BOTH {
        let mut service = Service::yaml(&[("basic_config.yaml", BASIC_CONFIG)], on).await;
        for (domain, entries, expected) in [
            ("foo_domain", vec![("key1", "value1")], None),
            ("test-domain", vec![], None),
            ("test-domain", vec![("key1", "something")], None),
            ("test-domain", vec![("key1", "value1")], None),
            (
                "test-domain",
                vec![("key2", "value2"), ("subkey", "subvalue")],
                None,
            ),
            (
                "test-domain",
                vec![("key5", "value5"), ("subkey5", "subvalue")],
                None,
            ),
            (
                "test-domain",
                vec![("key1", "value1"), ("subkey1", "something")],
                rate(5, Unit::Second),
            ),
            (
                "test-domain",
                vec![("key1", "value1"), ("subkey1", "subvalue1")],
                rate(10, Unit::Second),
            ),
            (
                "test-domain",
                vec![("key2", "something")],
                rate(20, Unit::Minute),
            ),
            (
                "test-domain",
                vec![("key2", "value2")],
                rate(30, Unit::Minute),
            ),
            ("test-domain", vec![("key2", "value3")], None),
            ("test-domain", vec![("key3", "foo")], rate(1, Unit::Hour)),
            (
                "test-domain",
                vec![("key4", "foo")],
                Some((1, Unit::Day, "key4_rate_limit".to_owned())),
            ),
            ("test-domain", vec![("key5", "value5")], rate(15, Unit::Day)),
            (
                "test-domain",
                vec![("key5", "value5"), ("subkey5", "subvalue5")],
                rate(25, Unit::Day),
            ),
            (
                "test-domain",
                vec![("key7", "unspecified_value")],
                rate(70, Unit::Minute),
            ),
            (
                "test-domain",
                vec![("key7", "another_value")],
                rate(70, Unit::Minute),
            ),
        ] {
            let status = service.status(domain, &entries).await;
            assert_eq!(limit(&status), expected, "{on:?} {domain} {entries:?}");
            assert_eq!(status.code, Code::Ok as i32, "{on:?} {entries:?}");
            if expected.is_none() {
                assert_eq!(status.limit_remaining, 0, "{on:?} {entries:?}");
            }
        }
        // key6 is unlimited: OK, no limit, every unit left.
        let unlimited = service.status("test-domain", &[("key6", "foo")]).await;
        assert_eq!(limit(&unlimited), None);
        assert_eq!(unlimited.limit_remaining, u32::MAX);
    }
}

/// A descriptor entry without a `rate_limit` whitelists its value: never
/// limited by its key's own limit (1 an hour), nor beside wildcards, nor
/// nested.
#[tokio::test]
async fn a_value_without_a_rate_limit_is_whitelisted() {
    let yaml = r#"
domain: d
descriptors:
  - key: key2
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: key2
    value: value3
  - key: path
    value: /api/*
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: path
    value: /api/health
  - key: user
    descriptors:
      - key: plan
        rate_limit: { unit: hour, requests_per_unit: 1 }
      - key: plan
        value: internal
"#;
    for on in BOTH {
        let mut service = Service::yaml(&[("whitelist.yaml", yaml)], on).await;
        for entries in [
            vec![("key2", "value3")],
            vec![("path", "/api/health")],
            vec![("user", "u"), ("plan", "internal")],
        ] {
            for _ in 0..3 {
                let response = service.ask("d", vec![descriptor(&entries)]).await;
                assert!(!over(&response), "{on:?} {entries:?}");
                assert_eq!(limit(&response.statuses[0]), None, "{on:?} {entries:?}");
            }
        }
        // Their neighbours are limited.
        for entries in [
            vec![("key2", "other")],
            vec![("path", "/api/items")],
            vec![("user", "u"), ("plan", "free")],
        ] {
            assert!(!over(&service.ask("d", vec![descriptor(&entries)]).await));
            assert!(
                over(&service.ask("d", vec![descriptor(&entries)]).await),
                "{on:?} {entries:?}"
            );
        }
    }
}

/// Limit names load as the reference loads them: the same name twice (in
/// one file and in two domains), names with spaces, `:` and `/`, names
/// over 64 characters; each status reports its limit's name, an unnamed
/// limit none, and `replaces` names them.
#[tokio::test]
async fn limit_names_load_and_report_as_the_reference() {
    let long = "n".repeat(100);
    let one = format!(
        r#"
domain: one
descriptors:
  - key: a
    rate_limit: {{ name: shared, unit: minute, requests_per_unit: 5 }}
  - key: b
    rate_limit: {{ name: shared, unit: minute, requests_per_unit: 6 }}
  - key: c
    rate_limit: {{ name: "with spaces: and/slashes", unit: minute, requests_per_unit: 7 }}
  - key: d
    rate_limit: {{ name: {long}, unit: minute, requests_per_unit: 8 }}
  - key: e
    rate_limit: {{ unit: minute, requests_per_unit: 9 }}
  - key: f
    rate_limit:
      unit: minute
      requests_per_unit: 10
      replaces: [{{ name: "with spaces: and/slashes" }}]
"#
    );
    let two = "domain: two\ndescriptors:\n  - key: a\n    rate_limit: { name: shared, unit: hour, requests_per_unit: 11 }\n";
    for on in BOTH {
        let mut service = Service::yaml(&[("one.yaml", &one), ("two.yaml", two)], on).await;
        for (domain, key, expected) in [
            ("one", "a", Some((5, Unit::Minute, "shared".to_owned()))),
            ("one", "b", Some((6, Unit::Minute, "shared".to_owned()))),
            (
                "one",
                "c",
                Some((7, Unit::Minute, "with spaces: and/slashes".to_owned())),
            ),
            ("one", "d", Some((8, Unit::Minute, long.clone()))),
            ("one", "e", rate(9, Unit::Minute)),
            ("two", "a", Some((11, Unit::Hour, "shared".to_owned()))),
        ] {
            let status = service.status(domain, &[(key, "v")]).await;
            assert_eq!(limit(&status), expected, "{on:?} {domain} {key}");
        }
        // The two limits named alike count apart.
        let a = service.status("one", &[("a", "v")]).await;
        assert_eq!(a.limit_remaining, 3, "{on:?}: a's own count (second call)");
        // `f` replaces the limit of `c` by its name.
        let replaced = service
            .ask(
                "one",
                vec![descriptor(&[("c", "w")]), descriptor(&[("f", "w")])],
            )
            .await;
        assert_eq!(limit(&replaced.statuses[0]), None, "{on:?}");
        assert_eq!(limit(&replaced.statuses[1]), rate(10, Unit::Minute));
    }
}

/// `requests_per_unit: 0` refuses every request, and its status reports
/// the configured unit, its name and the time to the window's end.
#[tokio::test]
async fn a_limit_of_zero_reports_its_unit_name_and_reset() {
    let yaml = r#"
domain: d
descriptors:
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { name: banned, unit: hour, requests_per_unit: 0 }
  - key: anon
    rate_limit: { unit: minute, requests_per_unit: 0 }
"#;
    for on in BOTH {
        let mut service = Service::yaml(&[("zero.yaml", yaml)], on).await;
        let banned = service
            .ask("d", vec![descriptor(&[("remote_address", "50.0.0.5")])])
            .await;
        assert!(over(&banned));
        let status = &banned.statuses[0];
        assert_eq!(status.code, Code::OverLimit as i32);
        assert_eq!(limit(status), Some((0, Unit::Hour, "banned".to_owned())));
        assert_eq!(status.limit_remaining, 0);
        let reset = status.duration_until_reset.unwrap();
        assert!(
            (1..=3600).contains(&reset.seconds) || reset.nanos > 0,
            "{reset:?}"
        );
        let anon = service.status("d", &[("anon", "x")]).await;
        assert_eq!(limit(&anon), rate(0, Unit::Minute));
        assert!(anon.duration_until_reset.unwrap().seconds <= 60);
        // Another address: 10 a second.
        let other = service.status("d", &[("remote_address", "50.0.0.1")]).await;
        assert_eq!(limit(&other), rate(10, Unit::Second));
    }
}

/// `TestConfigLimitOverride`: a descriptor's own `limit` is looked up in a
/// domain the configuration knows (no limit in another), counted by the
/// domain and every entry's key and value, and a limit of 0 refuses.
#[tokio::test]
async fn a_descriptors_own_limit_as_the_reference() {
    for on in BOTH {
        let mut service = Service::yaml(&[("basic_config.yaml", BASIC_CONFIG)], on).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
        // No matching domain: no limit, however often.
        for _ in 0..3 {
            let response = service
                .ask("foo_domain", vec![own(&[("k", "v")], 1, Unit::Minute)])
                .await;
            assert!(!over(&response), "{on:?}");
            assert_eq!(limit(&response.statuses[0]), None);
        }
        // A known domain: the override's rate, with no name.
        let entries = [("key1", "value1"), ("subkey1", "something")];
        let first = service
            .ask("test-domain", vec![own(&entries, 10, Unit::Day)])
            .await;
        assert_eq!(limit(&first.statuses[0]), rate(10, Unit::Day));
        assert_eq!(first.statuses[0].limit_remaining, 9);
        // A different value, a different count.
        let other = service
            .ask(
                "test-domain",
                vec![own(
                    &[("key1", "value1"), ("subkey1", "something_else")],
                    10,
                    Unit::Day,
                )],
            )
            .await;
        assert_eq!(other.statuses[0].limit_remaining, 9, "{on:?}");
        // Keys count too: user=alice and api_key=alice apart; and the
        // domain's dots do not run into the entries.
        let by = |entries: &[(&str, &str)]| own(entries, 2, Unit::Minute);
        for _ in 0..2 {
            assert!(!over(
                &service
                    .ask("test-domain", vec![by(&[("user", "alice")])])
                    .await
            ));
        }
        assert!(over(
            &service
                .ask("test-domain", vec![by(&[("user", "alice")])])
                .await
        ));
        let api_key = service
            .ask("test-domain", vec![by(&[("api_key", "alice")])])
            .await;
        assert!(!over(&api_key), "{on:?}: api_key=alice is not user=alice");
        assert_eq!(api_key.statuses[0].limit_remaining, 1);
        // A limit of 0: over, with its unit.
        let zero = service
            .ask("test-domain", vec![own(&[("k", "v")], 0, Unit::Hour)])
            .await;
        assert!(over(&zero), "{on:?}: a limit of 0 closes the route");
        assert_eq!(zero.statuses[0].code, Code::OverLimit as i32);
        assert_eq!(limit(&zero.statuses[0]), rate(0, Unit::Hour));
        assert!(zero.statuses[0].duration_until_reset.is_some());
    }
    // Domains that read alike with the entries: `x.y` + k=z, `x` + k=y.z.
    let two = [
        ("x.yaml", "domain: x\ndescriptors: []\n"),
        ("xy.yaml", "domain: x.y\ndescriptors: []\n"),
    ];
    for on in BOTH {
        let mut service = Service::yaml(&two, on).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
        let first = service
            .ask("x.y", vec![own(&[("k", "z")], 1, Unit::Minute)])
            .await;
        assert!(!over(&first));
        let second = service
            .ask("x", vec![own(&[("k", "y.z")], 1, Unit::Minute)])
            .await;
        assert!(!over(&second), "{on:?}: another domain's count");
    }
}

/// A peek (`hits_addend: 0`) on a key spent exactly to its limit is `OK`
/// with 0 left; a count past the limit refuses: under every algorithm
/// that counts units.
#[tokio::test]
async fn a_peek_at_the_limit_is_ok_and_past_it_refuses() {
    for algorithm in ["fixed-window", "sliding-window", "sliding-log", "gcra"] {
        let set = RuleSet::from_toml(&format!(
            r#"
[[rules]]
name = "tokens"
domain = "d"
descriptor = ["api_key"]
policy = "3/1h"
algorithm = "{algorithm}"
settle = {{ hits_addend = true }}
"#
        ))
        .unwrap();
        for on in BOTH {
            let mut service = Service::start(set.clone(), on).await;
            let peek = || costing(&[("api_key", "k")], 0);
            let charge = |hits| costing(&[("api_key", "k")], hits);
            let fresh = service.ask("d", vec![peek()]).await;
            assert_eq!(fresh.statuses[0].limit_remaining, 3, "{algorithm} {on:?}");
            service.ask("d", vec![charge(3)]).await;
            let at = service.ask("d", vec![peek()]).await;
            assert!(!over(&at), "{algorithm} {on:?}: spent exactly to the limit");
            assert_eq!(at.statuses[0].code, Code::Ok as i32);
            assert_eq!(at.statuses[0].limit_remaining, 0);
            assert_eq!(
                limit(&at.statuses[0]),
                Some((3, Unit::Hour, "tokens".to_owned()))
            );
            service.ask("d", vec![charge(1)]).await;
            let past = service.ask("d", vec![peek()]).await;
            assert!(over(&past), "{algorithm} {on:?}: past the limit");
            assert_eq!(past.statuses[0].code, Code::OverLimit as i32);
        }
    }
}

const COUNTED: &str = r#"
domain: d
descriptors:
  - key: a
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: three
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: closed
    rate_limit: { unit: minute, requests_per_unit: 0 }
  - key: one
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: soft
    shadow_mode: true
    rate_limit: { name: soft, unit: minute, requests_per_unit: 5 }
"#;

/// The same descriptor twice in one request: each its own status and
/// limit, each counted (2 left and 1 left).
#[tokio::test]
async fn the_same_descriptor_twice_gets_two_statuses() {
    for on in BOTH {
        let mut service = Service::yaml(&[("counted.yaml", COUNTED)], on).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
        let twice = service
            .ask(
                "d",
                vec![descriptor(&[("three", "x")]), descriptor(&[("three", "x")])],
            )
            .await;
        assert!(!over(&twice));
        let mut statuses: Vec<_> = twice
            .statuses
            .iter()
            .map(|s| (limit(s), s.limit_remaining))
            .collect();
        // The two checks are sent together: on a pool of connections
        // Redis may run either first, so the order of 2 and 1 is not
        // promised; that each is counted, with its limit, is.
        statuses.sort_by_key(|(_, remaining)| std::cmp::Reverse(*remaining));
        assert_eq!(
            statuses,
            [(rate(3, Unit::Minute), 2), (rate(3, Unit::Minute), 1)],
            "{on:?}"
        );
    }
}

/// In a refused request, every status tells the count as it stands once
/// the units are given back, and a shadow rule counts nowhere.
#[tokio::test]
async fn a_refused_request_reports_counts_as_they_stand_and_counts_no_shadow() {
    for on in BOTH {
        let mut service = Service::yaml(&[("counted.yaml", COUNTED)], on).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(5)).await;
        // `one` spent: the next request with it is refused.
        service.ask("d", vec![descriptor(&[("one", "x")])]).await;
        let refused = service
            .ask(
                "d",
                vec![
                    descriptor(&[("a", "x")]),
                    descriptor(&[("a", "x")]),
                    descriptor(&[("soft", "x")]),
                    descriptor(&[("one", "x")]),
                ],
            )
            .await;
        assert!(over(&refused), "{on:?}");
        let remaining: Vec<u32> = refused.statuses.iter().map(|s| s.limit_remaining).collect();
        assert_eq!(
            remaining,
            [10, 10, 5, 0],
            "{on:?}: the counts as they stand"
        );
        assert_eq!(
            refused.statuses[2].code,
            Code::Ok as i32,
            "a shadow never refuses"
        );
        // Nothing was counted: a's 10 and soft's 5 are whole.
        assert_eq!(service.status("d", &[("a", "x")]).await.limit_remaining, 9);
        assert_eq!(
            service.status("d", &[("soft", "x")]).await.limit_remaining,
            4
        );
        // Refused by a limit of 0: the same.
        let closed = service
            .ask(
                "d",
                vec![descriptor(&[("a", "y")]), descriptor(&[("closed", "y")])],
            )
            .await;
        assert!(over(&closed));
        assert_eq!(service.status("d", &[("a", "y")]).await.limit_remaining, 9);
    }
}

/// A shadow rule asked for more than its whole limit answers `OK` with its
/// limit and 0 left.
#[tokio::test]
async fn a_shadow_asked_past_its_whole_limit_is_ok_with_nothing_left() {
    for on in BOTH {
        let mut service = Service::yaml(&[("counted.yaml", COUNTED)], on).await;
        let response = service.ask("d", vec![costing(&[("soft", "x")], 50)]).await;
        assert!(!over(&response), "{on:?}");
        let status = &response.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        assert_eq!(limit(status), Some((5, Unit::Minute, "soft".to_owned())));
        assert_eq!(status.limit_remaining, 0);
    }
}

/// `test/config/shadowmode_config.yaml`: the shadow limits never refuse,
/// the others do.
#[tokio::test]
async fn the_shadow_mode_config_refuses_only_outside_shadows() {
    let yaml = r#"
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: { unit: minute, requests_per_unit: 5 }
      - key: subkey1
        value: subvalue1
        rate_limit: { unit: minute, requests_per_unit: 10 }
        shadow_mode: true
  - key: key2
    rate_limit: { unit: minute, requests_per_unit: 2 }
    shadow_mode: true
  - key: key2
    value: value2
    rate_limit: { unit: minute, requests_per_unit: 3 }
"#;
    for on in BOTH {
        let mut service = Service::yaml(&[("shadowmode_config.yaml", yaml)], on).await;
        away_from_a_boundary(Duration::from_secs(60), Duration::from_secs(10)).await;
        for (entries, max, shadow) in [
            (vec![("key1", "value1"), ("subkey1", "x")], 5, false),
            (vec![("key1", "value1"), ("subkey1", "subvalue1")], 10, true),
            (vec![("key2", "x")], 2, true),
            (vec![("key2", "value2")], 3, false),
        ] {
            for i in 0..=max {
                let response = service.ask("test-domain", vec![descriptor(&entries)]).await;
                assert_eq!(
                    over(&response),
                    !shadow && i == max,
                    "{on:?} {entries:?} {i}"
                );
                assert_eq!(limit(&response.statuses[0]).unwrap().0, max);
            }
        }
    }
}

/// `test/config/wildcard.yaml` (`TestWildcardConfig`): trailing, middle
/// and several `*`, nested; the exact value first.
#[tokio::test]
async fn the_wildcard_config_matches_as_the_reference() {
    let yaml = r#"
domain: test-domain
descriptors:
  - key: wild
    value: foo*
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: noWild
    value: foo
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: noVal
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: midWild
    value: bar*b
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: multiWild
    value: foo*bar*baz
    rate_limit: { unit: minute, requests_per_unit: 10 }
  - key: nestedWild
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: { unit: minute, requests_per_unit: 20 }
"#;
    for on in BOTH {
        let mut service = Service::yaml(&[("wildcard.yaml", yaml)], on).await;
        for (entries, expected) in [
            (vec![("wild", "foo1")], rate(20, Unit::Minute)),
            (vec![("wild", "foo")], rate(20, Unit::Minute)),
            (vec![("wild", "fo")], None),
            (vec![("wild", "bar")], None),
            (vec![("noWild", "foo")], rate(20, Unit::Minute)),
            (vec![("noWild", "foo1")], None),
            (vec![("noVal", "foo")], rate(20, Unit::Minute)),
            (vec![("midWild", "barb")], rate(20, Unit::Minute)),
            (vec![("midWild", "bar123b")], rate(20, Unit::Minute)),
            (vec![("midWild", "bar123")], None),
            (vec![("multiWild", "foobarbaz")], rate(10, Unit::Minute)),
            (vec![("multiWild", "foo1bar2baz")], rate(10, Unit::Minute)),
            (vec![("multiWild", "foobaz")], None),
            (
                vec![("nestedWild", "val1"), ("wild", "goo2")],
                rate(20, Unit::Minute),
            ),
            (vec![("nestedWild", "val1"), ("wild", "foo")], None),
            (vec![("nestedWild", "val2"), ("wild", "goo2")], None),
        ] {
            let status = service.status("test-domain", &entries).await;
            assert_eq!(limit(&status), expected, "{on:?} {entries:?}");
        }
    }
}

/// The examples of the reference server's README, 1 to 10.
#[tokio::test]
async fn the_readme_examples_answer_as_the_readme_says() {
    let files: &[(&str, &str)] = &[
        (
            "1.yaml",
            "domain: mongo_cps\ndescriptors:\n  - key: database\n    value: users\n    rate_limit: { unit: second, requests_per_unit: 500 }\n  - key: database\n    value: default\n    rate_limit: { unit: second, requests_per_unit: 500 }\n",
        ),
        (
            "2.yaml",
            "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit: { unit: day, requests_per_unit: 5 }\n  - key: to_number\n    rate_limit: { unit: day, requests_per_unit: 100 }\n",
        ),
        (
            "3.yaml",
            "domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit: { unit: second, requests_per_unit: 10 }\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit: { unit: second, requests_per_unit: 0 }\n",
        ),
        (
            "4a.yaml",
            "domain: example4\ndescriptors:\n  - key: key\n    value: value\n    rate_limit: { requests_per_unit: 300, unit: second }\n",
        ),
        (
            "4b.yaml",
            "domain: example4b\ndescriptors:\n  - key: key\n    value: value\n    descriptors:\n      - key: subkey\n        rate_limit: { requests_per_unit: 300, unit: second }\n",
        ),
        (
            "5.yaml",
            "domain: internal\ndescriptors:\n  - key: ldap\n    rate_limit: { unlimited: true }\n  - key: azure\n    rate_limit: { unit: minute, requests_per_unit: 100 }\n",
        ),
        (
            "6.yaml",
            "domain: example6\ndescriptors:\n  - key: service\n    descriptors:\n      - key: user\n        value: user-a\n        rate_limit: { requests_per_unit: 10, unit: second }\n        shadow_mode: true\n      - key: user\n        value: user-b\n        rate_limit: { requests_per_unit: 20, unit: second }\n",
        ),
        (
            "7.yaml",
            "domain: example7\ndescriptors:\n  - key: key_1\n    value: value_1\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit: { name: specific_limit, requests_per_unit: 5, unit: second }\n  - key: key_2\n    value: value_2\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          replaces:\n            - name: specific_limit\n          requests_per_unit: 10\n          unit: second\n",
        ),
        (
            "8.yaml",
            "domain: example8\ndescriptors:\n  - key: key1\n    detailed_metric: true\n    rate_limit: { unit: minute, requests_per_unit: 10 }\n  - key: key1\n    value: value1\n    rate_limit: { unit: minute, requests_per_unit: 20 }\n",
        ),
        (
            "9.yaml",
            "domain: example9\ndescriptors:\n  - key: key1\n    value: value*\n    rate_limit: { unit: minute, requests_per_unit: 20 }\n  - key: path\n    value: /api/*/action\n    rate_limit: { unit: minute, requests_per_unit: 21 }\n  - key: route\n    value: /api/*/resource/*/action\n    rate_limit: { unit: minute, requests_per_unit: 22 }\n",
        ),
        (
            "10.yaml",
            "domain: example10\ndescriptors:\n  - key: route\n    value_to_metric: true\n    descriptors:\n      - key: http_method\n        value_to_metric: true\n        descriptors:\n          - key: subject_id\n            rate_limit: { unit: minute, requests_per_unit: 60 }\n",
        ),
    ];
    for on in BOTH {
        let mut s = Service::yaml(files, on).await;
        let mut check = async |domain: &str, entries: &[(&str, &str)], expected| {
            let status = s.status(domain, entries).await;
            assert_eq!(limit(&status), expected, "{on:?} {domain} {entries:?}");
            status
        };
        check(
            "mongo_cps",
            &[("database", "users")],
            rate(500, Unit::Second),
        )
        .await;
        check("mongo_cps", &[("database", "other")], None).await;
        check(
            "messaging",
            &[("message_type", "marketing"), ("to_number", "2061111111")],
            rate(5, Unit::Day),
        )
        .await;
        check(
            "messaging",
            &[("to_number", "2061111111")],
            rate(100, Unit::Day),
        )
        .await;
        let ip = check(
            "edge_proxy_per_ip",
            &[("remote_address", "50.0.0.5")],
            rate(0, Unit::Second),
        )
        .await;
        assert_eq!(ip.code, Code::OverLimit as i32);
        check(
            "edge_proxy_per_ip",
            &[("remote_address", "50.0.0.1")],
            rate(10, Unit::Second),
        )
        .await;
        check(
            "example4",
            &[("key", "value"), ("subkey", "subvalue")],
            None,
        )
        .await;
        check(
            "example4b",
            &[("key", "value"), ("subkey", "subvalue")],
            rate(300, Unit::Second),
        )
        .await;
        let ldap = check("internal", &[("ldap", "x")], None).await;
        assert_eq!(ldap.limit_remaining, u32::MAX);
        check("internal", &[("azure", "x")], rate(100, Unit::Minute)).await;
        check(
            "example6",
            &[("service", "auth"), ("user", "user-a")],
            rate(10, Unit::Second),
        )
        .await;
        check(
            "example6",
            &[("service", "auth"), ("user", "user-b")],
            rate(20, Unit::Second),
        )
        .await;
        check(
            "example8",
            &[("key1", "unspecified_value")],
            rate(10, Unit::Minute),
        )
        .await;
        check("example8", &[("key1", "value1")], rate(20, Unit::Minute)).await;
        check("example9", &[("key1", "valueXYZ")], rate(20, Unit::Minute)).await;
        check(
            "example9",
            &[("path", "/api/123/action")],
            rate(21, Unit::Minute),
        )
        .await;
        check("example9", &[("path", "/api/123/other")], None).await;
        check(
            "example9",
            &[("route", "/api/v1/resource/123/action")],
            rate(22, Unit::Minute),
        )
        .await;
        check(
            "example10",
            &[
                ("route", "api"),
                ("http_method", "GET"),
                ("subject_id", "123"),
            ],
            rate(60, Unit::Minute),
        )
        .await;
        // Example 6: user-a (shadow, 10 a second) is never refused.
        for _ in 0..15 {
            let response = s
                .ask(
                    "example6",
                    vec![descriptor(&[("service", "auth"), ("user", "user-a")])],
                )
                .await;
            assert!(!over(&response), "{on:?}");
        }
        // Example 7: with both, specific_limit (5) is replaced by 10.
        let both = s
            .ask(
                "example7",
                vec![
                    descriptor(&[("key_1", "value_1"), ("user", "bkthomps")]),
                    descriptor(&[("key_2", "value_2"), ("user", "bkthomps")]),
                ],
            )
            .await;
        assert_eq!(limit(&both.statuses[0]), None, "{on:?}: replaced");
        assert_eq!(limit(&both.statuses[1]), rate(10, Unit::Second));
        let alone = s
            .status("example7", &[("key_1", "value_1"), ("user", "bkthomps")])
            .await;
        assert_eq!(
            limit(&alone),
            Some((5, Unit::Second, "specific_limit".to_owned()))
        );
    }
}

/// The reference's test configurations that cannot load are refused,
/// naming the file and saying what the reference says.
#[test]
fn the_reference_configs_that_cannot_load_are_refused_as_there() {
    for (file, yaml, says) in [
        (
            "bad_limit_unit.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: foo\n      requests_per_unit: 5\n",
            "invalid rate limit unit 'foo'",
        ),
        ("bad_yaml.yaml", "'''\n", ""),
        (
            "empty_domain.yaml",
            "descriptors:\n",
            "config file cannot have empty domain",
        ),
        (
            "empty_key.yaml",
            "domain: test-domain\ndescriptors:\n  - value: value1\n",
            "descriptor has empty key",
        ),
        (
            "duplicate_key.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n\n  - key: key1\n    value: value1\n",
            "duplicate descriptor composite key 'test-domain.key1_value1'",
        ),
        (
            "misspelled_key.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    ratelimit:\n      unit: day\n      requests_per_unit: 5\n",
            "ratelimit",
        ),
        (
            "misspelled_key2.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: day\n      requestsperunit: 5\n",
            "requestsperunit",
        ),
        (
            "non_map_list.yaml",
            "domain: test-domain\ndescriptors:\n  - a\n  - b\n  - c\n",
            "",
        ),
        (
            "non_string_key.yaml",
            "0.25: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: day\n      requests_per_unit: 5\n",
            "",
        ),
        (
            "replaces_empty.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    descriptors:\n      - key: subkey1\n        rate_limit:\n          name: self\n          replaces:\n            - name:\n          unit: second\n          requests_per_unit: 5\n",
            "should not have an empty replaces entry",
        ),
        (
            "replaces_self.yaml",
            "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    descriptors:\n      - key: subkey1\n        rate_limit:\n          name: self\n          replaces:\n            - name: self\n          unit: second\n          requests_per_unit: 5\n",
            "replaces should not contain name of same descriptor",
        ),
        (
            "unlimited_with_unit.yaml",
            "domain: test-domain\ndescriptors:\n  - key: foo\n    rate_limit:\n      unlimited: true\n      unit: day\n      requests_per_unit: 25\n",
            "should not specify rate limit unit when unlimited",
        ),
    ] {
        let error = RuleSet::from_envoy_yaml([(file, yaml)])
            .unwrap_err()
            .to_string();
        assert!(error.contains(file), "{file}: {error}");
        assert!(error.contains(says), "{file}: {error}");
    }
    // Two files of one domain (`duplicate_domain.yaml` beside the basic
    // config; the reference merges them only when told to).
    let error = RuleSet::from_envoy_yaml([
        ("basic_config.yaml", BASIC_CONFIG),
        (
            "duplicate_domain.yaml",
            "domain: test-domain\ndescriptors:\n",
        ),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("duplicate_domain.yaml") && error.contains("duplicate domain 'test-domain'"),
        "{error}"
    );
}
