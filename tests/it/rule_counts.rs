//! Counts belong to the limit, not to its numbers (issue 28): a rule counts
//! under its name, so a tightened max bites at once, a raised one gives
//! exactly the difference, two versions of a rule during a rollout share
//! one count, and a caller moved to another tier keeps its usage; another
//! window (for the windowed counters) or another algorithm starts afresh.
//! On Redis (both executions of the sliding log) and in memory, for every
//! algorithm that counts requests.

use tower_redis_ratelimit::rules::{RuleSet, Rules};
use tower_redis_ratelimit::{MemoryStore, RedisStore};

use crate::support::RedisServer;

/// Every algorithm (and execution) that counts requests.
const COUNTED: [(&str, &str); 5] = [
    ("sliding-log", "transaction"),
    ("sliding-log", "script"),
    ("fixed-window", ""),
    ("sliding-window", ""),
    ("gcra", ""),
];

fn rule(algorithm: &str, execution: &str, policy: &str) -> RuleSet {
    tiered(algorithm, execution, policy, "")
}

/// Rule `api` keyed by client address, with `tiers` (TOML, empty: none).
fn tiered(algorithm: &str, execution: &str, policy: &str, tiers: &str) -> RuleSet {
    let execution = if execution.is_empty() {
        String::new()
    } else {
        format!("execution = \"{execution}\"\n")
    };
    RuleSet::from_toml(&format!(
        "[[rules]]\nname = \"api\"\nkey = \"ip\"\npolicy = \"{policy}\"\n\
         algorithm = \"{algorithm}\"\n{execution}{tiers}"
    ))
    .unwrap()
}

/// How many of `n` checks of `key` by rule `api` (tier `tier`) are admitted.
async fn admitted(rules: &Rules, tier: Option<&str>, key: &str, n: usize) -> usize {
    let limiter = rules.current().limiter("api", tier).unwrap().clone();
    let mut admitted = 0;
    for _ in 0..n {
        admitted += usize::from(limiter.check(key).await.unwrap().allowed());
    }
    admitted
}

enum Backend<'a> {
    Redis(&'a RedisServer),
    Memory(MemoryStore),
}

impl Backend<'_> {
    async fn rules(&self, set: RuleSet) -> Rules {
        let rules = match self {
            Self::Redis(server) => {
                Rules::new(RedisStore::connect(&server.url()).await.unwrap(), set)
            }
            Self::Memory(store) => Rules::new(store.clone(), set),
        };
        rules.without_deny_cache()
    }
}

async fn every_backend(test: impl AsyncFn(&Backend<'_>, &str)) {
    let server = RedisServer::start();
    test(&Backend::Redis(&server), "redis").await;
    test(&Backend::Memory(MemoryStore::new()), "memory").await;
}

#[tokio::test]
async fn a_tightened_max_bites_at_once_and_a_raised_one_gives_the_difference() {
    every_backend(async |backend, name| {
        for (i, (algorithm, execution)) in COUNTED.into_iter().enumerate() {
            let key = format!("tighten-{i}");
            let rules = backend.rules(rule(algorithm, execution, "10/h")).await;
            assert_eq!(admitted(&rules, None, &key, 8).await, 8);
            rules.replace(rule(algorithm, execution, "5/h"));
            assert_eq!(
                admitted(&rules, None, &key, 3).await,
                0,
                "{name} {algorithm} {execution}: lowered"
            );
            rules.replace(rule(algorithm, execution, "10/h"));
            assert_eq!(
                admitted(&rules, None, &key, 5).await,
                2,
                "{name} {algorithm} {execution}: raised again"
            );
        }
    })
    .await;
}

/// Two servers with the same rule at 5 and 8 an hour, one client spread
/// over both: at most 8 admitted (today's layout admitted 13).
#[tokio::test]
async fn two_versions_of_a_rule_during_a_rollout_share_one_count() {
    let server = RedisServer::start();
    for (i, (algorithm, execution)) in COUNTED.into_iter().enumerate() {
        let key = format!("rollout-{i}");
        let backend = Backend::Redis(&server);
        let old = backend.rules(rule(algorithm, execution, "5/h")).await;
        let new = backend.rules(rule(algorithm, execution, "8/h")).await;
        let mut total = 0;
        for _ in 0..10 {
            total += admitted(&old, None, &key, 1).await + admitted(&new, None, &key, 1).await;
        }
        assert_eq!(total, 8, "{algorithm} {execution}");
    }
}

#[tokio::test]
async fn a_caller_moved_to_another_tier_keeps_its_usage() {
    every_backend(async |backend, name| {
        for (i, (algorithm, execution)) in COUNTED.into_iter().enumerate() {
            let key = format!("tier-{i}");
            // A pro tier of 20 an hour.
            let tiers = "tiers = { pro = \"20/h\" }\n";
            let rules = backend
                .rules(tiered(algorithm, execution, "10/h", tiers))
                .await;
            assert_eq!(admitted(&rules, None, &key, 8).await, 8);
            // Upgraded: 20 an hour on the 8 already used.
            assert_eq!(
                admitted(&rules, Some("pro"), &key, 15).await,
                12,
                "{name} {algorithm} {execution}"
            );
        }
    })
    .await;
}

#[tokio::test]
async fn another_window_or_algorithm_starts_afresh() {
    every_backend(async |backend, name| {
        // The windowed counters find a rate's counter by its window.
        for (i, algorithm) in ["fixed-window", "sliding-window"].into_iter().enumerate() {
            let key = format!("window-{i}");
            let rules = backend.rules(rule(algorithm, "", "5/h")).await;
            assert_eq!(admitted(&rules, None, &key, 6).await, 5);
            rules.replace(rule(algorithm, "", "5/2h"));
            assert_eq!(
                admitted(&rules, None, &key, 6).await,
                5,
                "{name} {algorithm}: another window"
            );
        }
        // Another algorithm keeps another state.
        let rules = backend.rules(rule("fixed-window", "", "5/h")).await;
        assert_eq!(admitted(&rules, None, "algorithm", 6).await, 5);
        for algorithm in ["sliding-window", "gcra", "sliding-log"] {
            rules.replace(rule(algorithm, "", "5/h"));
            assert_eq!(
                admitted(&rules, None, "algorithm", 6).await,
                5,
                "{name} {algorithm}"
            );
        }
    })
    .await;
}

/// The concurrency limit keeps its leases: lowered below the requests in
/// flight, it admits none; raised again, exactly the difference.
#[tokio::test]
async fn a_concurrency_limit_keeps_its_leases() {
    every_backend(async |backend, name| {
        let rules = backend.rules(rule("concurrency", "", "10/1h")).await;
        let limiter = rules.current().limiter("api", None).unwrap().clone();
        let mut held = Vec::new();
        for _ in 0..8 {
            let verdict = limiter.check("in-flight").await.unwrap();
            assert!(verdict.allowed(), "{name}");
            held.push(verdict);
        }
        rules.replace(rule("concurrency", "", "5/1h"));
        assert_eq!(
            admitted(&rules, None, "in-flight", 3).await,
            0,
            "{name}: lowered"
        );
        rules.replace(rule("concurrency", "", "10/1h"));
        let limiter = rules.current().limiter("api", None).unwrap().clone();
        for _ in 0..3 {
            let verdict = limiter.check("in-flight").await.unwrap();
            if verdict.allowed() {
                held.push(verdict);
            }
        }
        assert_eq!(held.len(), 10, "{name}: raised again");
    })
    .await;
}
