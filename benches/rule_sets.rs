//! Large rule sets (a rule per tenant): how long a rule set of 1,000,
//! 10,000 and 100,000 rules takes to read and validate, to put in force
//! (its limiters built and swapped in), and how long the first request
//! after it and the next ones take to be checked. Every line
//! `RESULT <name> <value>`; times in milliseconds (a check in
//! microseconds).
//!
//! ```sh
//! cargo bench --bench rule_sets                       # 1k, 10k, 100k rules
//! BENCH_RULES=30000 cargo bench --bench rule_sets     # one size
//! ```
//!
//! The store is a `MemoryStore`: what is measured is the engine's own
//! work on the rule set, not a round trip.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use http::Method;
use tower_redis_ratelimit::MemoryStore;
use tower_redis_ratelimit::rules::{Call, RuleSet, Rules};

/// A rule per tenant, as a tenant-per-rule deployment writes them: its
/// own path, key, policy and one tier.
fn rule_set_text(rules: usize) -> String {
    let mut text = String::with_capacity(rules * 160);
    for i in 0..rules {
        let _ = write!(
            text,
            "[[rules]]\nname = \"tenant-{i}\"\npath = \"/tenants/{i}/{{*rest}}\"\n\
             key = \"header:x-api-key\"\npolicy = \"{max}/min, 10000/day\"\n\
             tiers = {{ pro = \"{pro}/min\" }}\n\n",
            max = 100 + i % 50,
            pro = 1000 + i % 50,
        );
    }
    text
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn main() {
    let sizes: Vec<usize> = match std::env::var("BENCH_RULES") {
        Ok(n) if !n.is_empty() => vec![n.parse().expect("BENCH_RULES: a number of rules")],
        _ => vec![1_000, 10_000, 100_000],
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for n in sizes {
        let text = rule_set_text(n);
        let started = Instant::now();
        let set = RuleSet::from_toml(&text).unwrap();
        let parsed = started.elapsed();
        assert_eq!(set.rules().len(), n);

        // Put in force over a set already in force (a reload), as a
        // watched file or a published rule set does.
        let rules = Rules::new(MemoryStore::new(), RuleSet::from_toml("").unwrap());
        let started = Instant::now();
        rules.replace(set.clone());
        let first_swap = started.elapsed();
        let started = Instant::now();
        rules.replace(set);
        let reload = started.elapsed();

        // The last tenant's request: every rule before it is looked at.
        let path = format!("/tenants/{}/v1/items", n - 1);
        let check = |rules: &Rules| {
            let active = rules.current();
            let check = active
                .check(&Method::GET, &path, None, |_| {
                    Ok::<_, std::convert::Infallible>(Some(Call::new("key-1")))
                })
                .unwrap();
            runtime.block_on(check).unwrap()
        };
        let started = Instant::now();
        assert!(check(&rules).allowed());
        let first_check = started.elapsed();
        let rounds = 50;
        let started = Instant::now();
        for _ in 0..rounds {
            check(&rules);
        }
        let per_check = started.elapsed() / rounds;

        println!("RESULT rules/{n}/text_bytes {}", text.len());
        println!("RESULT rules/{n}/read_and_validate_ms {}", ms(parsed));
        println!("RESULT rules/{n}/first_in_force_ms {}", ms(first_swap));
        println!("RESULT rules/{n}/reload_in_force_ms {}", ms(reload));
        println!(
            "RESULT rules/{n}/first_check_us {:.1}",
            first_check.as_secs_f64() * 1e6
        );
        println!(
            "RESULT rules/{n}/check_last_rule_us {:.1}",
            per_check.as_secs_f64() * 1e6
        );
        println!(
            "RESULT rules/{n}/total_ms {}",
            ms(parsed + first_swap + first_check)
        );
    }
}
