//! The rule schema as users write it: what is accepted, what is refused
//! and how the refusal names the rule and field, and what rules match.

use super::fields::parse_key;
use super::target::{parse_path, path_matches};
use super::*;
use crate::policy::Algorithm;

fn error(text: &str) -> RulesError {
    RuleSet::from_toml(text).unwrap_err()
}

#[test]
fn a_bad_rule_is_named_with_its_field() {
    let e = error(
        "[[rules]]\nname = \"ok\"\nkey = \"global\"\npolicy = \"1/s\"\n\
         [[rules]]\nname = \"login\"\nkey = \"ip\"\npolicy = \"5 per minute\"\n",
    );
    assert_eq!(e.rule(), Some("\"login\" (#2)"));
    assert_eq!(e.field(), "policy");
    assert!(
        e.to_string()
            .starts_with("rule \"login\" (#2), field policy: "),
        "{e}"
    );

    let e = error(
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\ntiers = { pro = \"0/s\" }\n",
    );
    assert_eq!((e.field(), e.rule()), ("tiers.pro", Some("\"a\" (#1)")));
    let e = error("[[rules]]\nkey = \"ip\"\npolicy = \"1/s\"\n");
    assert_eq!((e.field(), e.rule()), ("name", Some("#1")));
    let e = error("[[rules]]\nname = \"a\"\nkey = \"cookie\"\npolicy = \"1/s\"\n");
    assert_eq!(e.field(), "key");
    let e =
        error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\npath = \"/a/{*rest}/b\"\n");
    assert_eq!(e.field(), "path");
    let e =
        error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"pkg.Svc/M\"\n");
    assert_eq!(e.field(), "grpc");
    let e = error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\ncost = 9\n");
    assert_eq!(e.field(), "policy", "a cost above the max: {e}");
    let e =
        error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\nmethods = [\"G ET\"]\n");
    assert_eq!(e.field(), "methods");
    let e = error(
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\n\
         [[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"2/s\"\n",
    );
    assert_eq!((e.field(), e.rule()), ("name", Some("\"a\" (#2)")));
    // Unknown fields are errors, not silently ignored.
    let e = error("[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"1/s\"\npolcy = \"2/s\"\n");
    assert_eq!(e.field(), "TOML");
    assert!(e.problem().contains("polcy"), "{e}");
}

#[test]
fn the_example_rule_set_is_valid() {
    let rules = RuleSet::from_toml(include_str!("../../examples/rules.toml")).unwrap();
    assert_eq!(rules.version(), Some(1));
    let names = |method: &Method, path| {
        rules
            .matching(method, path)
            .map(Rule::name)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&Method::GET, "/api/users"), ["global", "api"]);
    assert_eq!(
        names(&Method::GET, "/api/reports/7"),
        ["global", "api", "reports"]
    );
    assert_eq!(names(&Method::POST, "/login"), ["global", "login"]);
    assert_eq!(names(&Method::GET, "/login"), ["global"]);
    let api = &rules.rules()[1];
    assert_eq!(api.policy(Some("pro")).to_string(), "5000/min");
    assert_eq!(api.policy(Some("enterprise")).to_string(), "100/min");
    assert!(api.allows("10.0.0.5"));
    assert_eq!(rules.rules()[3].policy(None).cost(), 10);
}

#[test]
fn outcome_counting_and_blocks_are_validated() {
    let rule = |extra: &str| {
        RuleSet::from_toml(&format!(
            "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\n{extra}"
        ))
    };
    let counting = rule("count = [\"4xx\", \"500\"]\n").unwrap();
    let counting = counting.rules()[0].counting();
    assert!(counting.counts(Some(404)) && counting.counts(Some(500)));
    assert!(!counting.counts(Some(200)) && !counting.counts(Some(503)));
    let refund = rule("refund = [\"5xx\"]\n").unwrap();
    assert!(
        !refund.rules()[0].counting().counts(None),
        "an inner error is a 500"
    );
    assert_eq!(
        rule("count = [\"4xx\"]\nrefund = [\"5xx\"]\n")
            .unwrap_err()
            .field(),
        "refund"
    );
    assert_eq!(rule("count = [\"6xx\"]\n").unwrap_err().field(), "count");
    assert_eq!(rule("count = []\n").unwrap_err().field(), "count");
    let grpc = rule("grpc = \"/pkg.Svc/*\"\ncount = [\"4xx\"]\n").unwrap_err();
    assert!(grpc.problem().contains("trailers"), "{grpc}");
    let concurrency = rule("algorithm = \"concurrency\"\nrefund = [\"5xx\"]\n").unwrap_err();
    assert_eq!(concurrency.field(), "refund");
    assert_eq!(
        rule("block = \"15m\"\n").unwrap().rules()[0].block(),
        Some(Duration::from_secs(900))
    );
    assert_eq!(rule("block = \"forever\"\n").unwrap_err().field(), "block");
    assert_eq!(rule("only = []\n").unwrap_err().field(), "only");
    let e = RuleSet::from_toml("[[rules]]\nname = \"a:b\"\nkey = \"ip\"\npolicy = \"5/s\"\n")
        .unwrap_err();
    assert_eq!(
        e.field(),
        "name",
        "a `:` would reach into the store key layout"
    );
    let script = rule("execution = \"script\"\n").unwrap();
    assert_eq!(
        script.rules()[0].policy(None).execution(),
        crate::policy::Execution::Script
    );
    assert_eq!(
        rule("algorithm = \"gcra\"\nexecution = \"script\"\n")
            .unwrap_err()
            .field(),
        "execution"
    );
    assert_eq!(
        rule("execution = \"magic\"\n").unwrap_err().field(),
        "execution"
    );
    let e = RuleSet::from_toml("tier = \"cookie\"\n").unwrap_err();
    assert_eq!((e.field(), e.rule()), ("tier", None));
}

fn rule(extra: &str) -> Result<RuleSet, RulesError> {
    RuleSet::from_toml(&format!(
        "[[rules]]\nname = \"a\"\nkey = \"ip\"\npolicy = \"5/s\"\n{extra}"
    ))
}

#[test]
fn a_block_is_at_most_a_day() {
    for at_the_bound in ["1d", "24h", "1440m", "86400s"] {
        let set = rule(&format!("block = \"{at_the_bound}\"\n")).unwrap();
        assert_eq!(set.rules()[0].block(), Some(MAX_BLOCK), "{at_the_bound}");
    }
    for past in ["86401s", "25h", "2d", "3650d"] {
        let e = rule(&format!("block = \"{past}\"\n")).unwrap_err();
        assert_eq!(
            (e.rule(), e.field()),
            (Some("\"a\" (#1)"), "block"),
            "{past}"
        );
        assert!(e.problem().contains("longer than a day"), "{e}");
    }
}

#[test]
fn a_path_holds_no_query_nor_fragment() {
    for path in ["/search?q=1", "/a?", "/page#top"] {
        let e = rule(&format!("path = \"{path}\"\n")).unwrap_err();
        assert_eq!(e.field(), "path", "{path}");
        assert!(e.problem().contains("query"), "{e}");
    }
    assert!(rule("path = \"/search\"\n").is_ok());
}

#[test]
fn an_execution_is_refused_for_another_algorithm_as_policy_refuses_it() {
    for algorithm in ["gcra", "fixed-window", "sliding-window", "concurrency"] {
        for execution in ["script", "transaction"] {
            let e = rule(&format!(
                "algorithm = \"{algorithm}\"\nexecution = \"{execution}\"\n"
            ))
            .unwrap_err();
            assert_eq!(e.field(), "execution", "{algorithm} {execution}");
            // The message is Policy's own: one validation for both.
            let policy = "5/s"
                .parse::<Policy>()
                .unwrap()
                .with_algorithm(algorithm.parse().unwrap())
                .unwrap();
            let direct = policy
                .with_execution(execution.parse().unwrap())
                .unwrap_err()
                .to_string();
            assert_eq!(e.problem(), direct);
        }
    }
}

#[test]
fn a_rule_carries_its_own_local_quota() {
    let set = rule("local_quota = \"3/250ms\"\ntiers = { pro = \"100/s\" }\n").unwrap();
    let quota = set.rules()[0].local_quota().unwrap();
    assert_eq!(
        (quota.batch(), quota.hold()),
        (3, Duration::from_millis(250))
    );
    let refused = |extra: &str, says: &str| {
        let e = rule(extra).unwrap_err();
        assert_eq!(e.field(), "local_quota", "{extra}: {e}");
        assert!(e.problem().contains(says), "{extra}: {e}");
    };
    refused("local_quota = \"lots\"\n", "100/250ms");
    refused("local_quota = \"1/s\"\n", "at least 2");
    refused(
        "local_quota = \"10/s\"\ntiers = { free = \"1/s\" }\n",
        "with tiers.free",
    );
    refused(
        "local_quota = \"10/s\"\nalgorithm = \"concurrency\"\n",
        "in flight",
    );
    refused(
        "local_quota = \"10/s\"\ncount = [\"4xx\"]\n",
        "counting by outcome",
    );
    assert!(rule("").unwrap().rules()[0].local_quota().is_none());
}

#[test]
fn debug_does_not_show_the_keys_of_allow_and_only_lists() {
    let rules = RuleSet::from_toml(
        "[[rules]]\nname = \"a\"\nkey = \"header:x-api-key\"\npolicy = \"5/s\"\n\
         allow = [\"secret-1\"]\nonly = [\"secret-1\", \"secret-2\"]\n",
    )
    .unwrap();
    let shown = format!("{rules:?}");
    assert!(!shown.contains("secret"), "{shown}");
    assert!(shown.contains("2 keys"), "{shown}");
}

#[test]
fn json_reads_the_same_schema() {
    let rules = RuleSet::from_json(
        r#"{"version": 3, "rules": [{"name": "g", "key": "global", "policy": "10/s", "algorithm": "gcra"}]}"#,
    )
    .unwrap();
    assert_eq!(rules.version(), Some(3));
    assert_eq!(rules.rules()[0].policy(None).algorithm(), Algorithm::Gcra);
    let e = RuleSet::from_json(r#"{"rules": [{"name": "g", "key": "global"}]}"#).unwrap_err();
    assert_eq!(e.field(), "policy");
}

#[test]
fn paths_match_like_axum_routes() {
    let pattern = parse_path("/users/{id}/posts/{*rest}").unwrap();
    assert!(path_matches(&pattern, "/users/7/posts/a"));
    assert!(path_matches(&pattern, "/users/7/posts/a/b"));
    assert!(!path_matches(&pattern, "/users/7/posts"));
    assert!(!path_matches(&pattern, "/users/7/posts/"));
    assert!(!path_matches(&pattern, "/users//posts/a"));
    let exact = parse_path("/login").unwrap();
    assert!(path_matches(&exact, "/login"));
    assert!(!path_matches(&exact, "/login/x"));
    assert!(!path_matches(&exact, "/logins"));
    let root = parse_path("/").unwrap();
    assert!(path_matches(&root, "/"));
    assert!(!path_matches(&root, "/a"));
}

#[test]
fn grpc_rules_match_a_method_or_a_service() {
    let rules = RuleSet::from_toml(
        "[[rules]]\nname = \"m\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"/pkg.Svc/Get\"\n\
         [[rules]]\nname = \"s\"\nkey = \"ip\"\npolicy = \"1/s\"\ngrpc = \"/pkg.Svc/*\"\n",
    )
    .unwrap();
    let names = |path| {
        rules
            .matching(&Method::POST, path)
            .map(Rule::name)
            .collect::<Vec<_>>()
    };
    assert_eq!(names("/pkg.Svc/Get"), ["m", "s"]);
    assert_eq!(names("/pkg.Svc/Put"), ["s"]);
    assert!(names("/pkg.Other/Get").is_empty());
}

#[test]
fn keys_combine_built_in_extractors() {
    assert_eq!(
        parse_key("client_ip+header:x-api-key").unwrap(),
        [
            KeyPart::ClientIp,
            KeyPart::Header(HeaderName::from_static("x-api-key"))
        ]
    );
    assert!(parse_key("ip+").is_err());
}

/// The path index finds, for every path, exactly the rules a scan of the
/// whole set matches, in the set's order: over literal prefixes sharing
/// segments, parameters and rests at every place, gRPC methods and
/// services, trailing slashes, and rules of every path.
#[test]
fn the_path_index_finds_what_a_scan_of_every_rule_matches() {
    let targets = [
        "path = \"/tenants/1/{*rest}\"",
        "path = \"/tenants/{id}/items\"",
        "path = \"/tenants/12/items\"",
        "path = \"/tenants/1\"",
        "path = \"/tenants/\"",
        "path = \"/{*rest}\"",
        "path = \"/\"",
        "path = \"/{id}\"",
        "path = \"/login\"",
        "grpc = \"/pkg.Svc/Get\"",
        "grpc = \"/pkg.Svc/*\"",
        "grpc = \"/pkg.Other/Get\"",
        "",
    ];
    let mut text = String::new();
    for (i, target) in targets.iter().enumerate() {
        text +=
            &format!("[[rules]]\nname = \"r{i}\"\nkey = \"global\"\npolicy = \"1/s\"\n{target}\n");
    }
    let set = RuleSet::from_toml(&text).unwrap();
    let index = super::index::PathIndex::new(set.rules());
    for path in [
        "/",
        "",
        "/tenants",
        "/tenants/",
        "/tenants/1",
        "/tenants/1/",
        "/tenants/1/a/b",
        "/tenants/12/items",
        "/tenants/13/items",
        "/tenants//items",
        "/login",
        "/login/",
        "/pkg.Svc/Get",
        "/pkg.Svc/Put",
        "/pkg.Other/Get",
        "/pkg.Other",
        "//",
        "/x/y/z",
        "no-slash",
    ] {
        let scanned: Vec<usize> = (0..set.rules().len())
            .filter(|&i| set.rules()[i].matches(&http::Method::GET, path))
            .collect();
        let indexed: Vec<usize> = index
            .candidates(path)
            .into_iter()
            .filter(|&i| set.rules()[i].matches(&http::Method::GET, path))
            .collect();
        assert_eq!(indexed, scanned, "{path:?}");
    }
}

#[test]
fn rules_counting_tokens_or_money_need_a_counter_and_money_needs_a_catalog() {
    let catalog = "[catalog]\ncurrency = \"USD\"\n[catalog.models.m]\ninput = 1\noutput = 1\n";
    let rule = |policy: &str, algorithm: &str| {
        RuleSet::from_toml(&format!(
            "{catalog}[[rules]]\nname = \"r\"\nkey = \"global\"\npolicy = \"{policy}\"\n{algorithm}"
        ))
    };
    // The sliding log (the default but on the calendar) keeps an entry
    // per unit.
    let error = rule("100 USD/1h", "").unwrap_err();
    assert_eq!(error.field(), "policy", "{error}");
    assert!(error.problem().contains("fixed-window"), "{error}");
    assert!(rule("5000 tokens/min", "algorithm = \"concurrency\"").is_err());
    assert!(rule("100 USD/month", "algorithm = \"fixed-window\"").is_ok());
    assert!(rule("5000 tokens/min", "algorithm = \"gcra\"").is_ok());
    // Requests keep the default.
    assert!(rule("60/min", "").is_ok());
    // Money without a catalog, or in another currency.
    let error = RuleSet::from_toml(
        "[[rules]]\nname = \"r\"\nkey = \"global\"\npolicy = \"5 USD/1d\"\nalgorithm = \"gcra\"\n",
    )
    .unwrap_err();
    assert!(error.problem().contains("no price catalog"), "{error}");
    assert!(rule("5 EUR/1d", "algorithm = \"gcra\"").is_err());
    // A tier in another unit.
    assert!(
        rule(
            "5 USD/1d",
            "algorithm = \"gcra\"\ntiers = { pro = \"100/min\" }"
        )
        .is_err()
    );
    // Notices: shares from 1 to 100, each once.
    let notify = |list: &str| {
        rule(
            "5 USD/1d",
            &format!("algorithm = \"gcra\"\nnotify = {list}"),
        )
    };
    assert_eq!(
        notify("[95, 50, 80]").unwrap().rules()[0].notify(),
        [50, 80, 95]
    );
    for bad in ["[]", "[0]", "[101]", "[50, 50]"] {
        assert_eq!(notify(bad).unwrap_err().field(), "notify", "{bad}");
    }
}

#[cfg(feature = "envoy")]
#[test]
fn a_descriptor_rule_counting_money_names_its_usage() {
    let error = RuleSet::from_toml(
        "[catalog]\ncurrency = \"USD\"\n[catalog.models.m]\ninput = 1\noutput = 1\n\
         [[rules]]\nname = \"r\"\ndomain = \"d\"\ndescriptor = [\"api_key\"]\n\
         policy = \"5 USD/day\"\nalgorithm = \"fixed-window\"\n",
    )
    .unwrap_err();
    assert_eq!(error.field(), "usage", "{error}");
}

/// A descriptor rule's `usage` (read in `validate`).
mod usage_entries {
    use super::*;

    const CATALOG: &str =
        "[catalog]\ncurrency = \"USD\"\n[catalog.default]\ninput = 1\noutput = 1\n";

    fn rule(fields: &str) -> Result<RuleSet, RulesError> {
        RuleSet::from_toml(&format!(
            "{CATALOG}[[rules]]\nname = \"r\"\ndomain = \"ai\"\n{fields}\n"
        ))
    }

    /// `usage` names entries of the rule's descriptor, on a descriptor
    /// rule counted in tokens (one entry or both) or money (both).
    #[test]
    fn a_usage_names_entries_of_the_descriptor_and_counts_tokens_or_money() {
        let usage = "usage = { model = \"model\", kind = \"token_kind\" }";
        let entries = "descriptor = [\"api_key\", \"model\", \"token_kind\"]";
        for (fields, field, says) in [
            (
                format!("{entries}\npolicy = \"100/min\"\n{usage}"),
                "usage",
                "counts requests",
            ),
            (
                format!("{entries}\npolicy = \"1 USD/day\"\nusage = {{ model = \"model\" }}"),
                "usage.kind",
                "is missing",
            ),
            (
                format!("{entries}\npolicy = \"1 USD/day\"\nusage = {{ kind = \"token_kind\" }}"),
                "usage.model",
                "is missing",
            ),
            (
                format!("{entries}\npolicy = \"100 tokens/min\"\nusage = {{}}"),
                "usage",
                "names no entry",
            ),
            (
                format!("descriptor = [\"api_key\", \"model\"]\npolicy = \"1 USD/day\"\n{usage}"),
                "usage.kind",
                "no entry of the rule's descriptor",
            ),
            (
                format!(
                    "{entries}\npolicy = \"1 USD/day\"\nusage = {{ model = \"model\", kind = \"model\" }}"
                ),
                "usage.kind",
                "two entries",
            ),
            (
                format!(
                    "{entries}\npolicy = \"1 USD/day\"\ntiers = {{ pro = \"2 USD/day\" }}\ntier_entry = \"model\"\n{usage}"
                ),
                "usage.model",
                "tier_entry",
            ),
            (
                format!(
                    "{entries}\npolicy = \"1 USD/day\"\nusage = {{ model = \"model\", price = 1 }}"
                ),
                "TOML",
                "unknown field",
            ),
            (
                format!("key = \"ip\"\n{entries}\npolicy = \"1 USD/day\"\n{usage}"),
                "usage",
                "applies to Envoy alone",
            ),
        ] {
            let error = rule(&fields).unwrap_err();
            assert_eq!(error.field(), field, "{fields}: {error}");
            assert!(error.to_string().contains(says), "{fields}: {error}");
        }
        // Not a descriptor rule.
        let error = RuleSet::from_toml(&format!(
            "{CATALOG}[[rules]]\nname = \"r\"\nkey = \"ip\"\npolicy = \"1 USD/day\"\n{usage}\n"
        ))
        .unwrap_err();
        assert_eq!(error.field(), "usage", "{error}");

        let set = rule(&format!(
            "{entries}\npolicy = \"1 USD/day\"\nsettle = {{ hits_addend = true }}\n{usage}"
        ))
        .unwrap();
        let found = set.rules()[0].envoy.usage.clone().unwrap();
        assert_eq!(found.model.as_deref(), Some("model"));
        assert!(found.names("token_kind") && !found.names("api_key"));
        // Counted in tokens, one entry is enough; an exact kind too.
        rule("descriptor = [\"api_key\", \"model\", \"token_kind=output\"]\npolicy = \"100 tokens/min\"\nalgorithm = \"gcra\"\nusage = { model = \"model\" }").unwrap();
        rule(&format!(
            "{entries}\npolicy = \"100 tokens/min\"\nalgorithm = \"gcra\"\n{usage}"
        ))
        .unwrap();
    }
}
