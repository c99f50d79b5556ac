//! The names limits count under in this process, to warn when two
//! different limits share one: counts belong to the name, so a named
//! limiter and a rule (or two limiters with different policies) of the
//! same name spend each other's quota in a shared store.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use super::top::Denials;

/// Who counts under a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A limiter named by [`with_name`](crate::Limiter::with_name), with
    /// its policy's text.
    Limiter(String),
    /// A rule of a rule set (its tiers and reloads share the name on
    /// purpose).
    Rule,
}

impl Owner {
    fn describe(&self) -> String {
        match self {
            Self::Limiter(policy) => format!("a limiter of policy {policy:?}"),
            Self::Rule => "a rule".to_owned(),
        }
    }
}

struct Claim {
    owner: Owner,
    /// The most denied keys of the limit: one object for every limiter
    /// derived from the same one under this name (clones, a rule's tiers,
    /// its limiters after a reload), gone when they all are.
    limit: Weak<Denials>,
}

/// The claims of every name, and when to next drop the claims of limits
/// gone.
#[derive(Default)]
struct Claims {
    by_name: HashMap<String, Vec<Claim>>,
    /// How many names there may be before the whole map is pruned: twice
    /// as many as the last prune left (at least [`PRUNE_AT_LEAST`]).
    prune_at: usize,
    /// Names looked at by whole prunes so far (what a test holds linear).
    pruned: u64,
}

/// Names held before the first whole prune.
const PRUNE_AT_LEAST: usize = 64;

static CLAIMS: LazyLock<Mutex<Claims>> = LazyLock::new(Mutex::default);

/// Record that `owner` counts under `name` (the limit `limit`) in this
/// process, and describe another live limit counting under it
/// differently, if any.
pub(crate) fn claim(name: &str, owner: Owner, limit: &Arc<Denials>) -> Option<String> {
    CLAIMS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .claim(name, owner, limit)
}

impl Claims {
    /// Record that `owner` counts under `name` (the limit `limit`), and
    /// describe another live limit counting under it differently, if any.
    fn claim(&mut self, name: &str, owner: Owner, limit: &Arc<Denials>) -> Option<String> {
        // Limits gone, and names no live limit counts under: pruned
        // whenever the names have doubled since the last prune, so the map
        // stays within twice the live limits' names, and a rule set of n
        // rules costs O(n) to claim (a prune per claim made loading
        // quadratic).
        if self.by_name.len() >= self.prune_at.max(PRUNE_AT_LEAST) {
            self.pruned += self.by_name.len() as u64;
            self.by_name.retain(|_, here| {
                here.retain(|c| c.limit.strong_count() > 0);
                !here.is_empty()
            });
            self.prune_at = self.by_name.len() * 2;
        }
        let here = self.by_name.entry(name.to_owned()).or_default();
        // This name's own claims are pruned at every claim (a name is
        // claimed again at every reload of its rule).
        here.retain(|c| c.limit.strong_count() > 0);
        // Rules of one name share counts on purpose (tiers, reloads, one
        // rule set served twice), and so do limiters of one name and
        // policy (a layer's and an admin router's).
        let clash = here
            .iter()
            .find(|c| c.owner != owner)
            .map(|c| c.owner.describe());
        if !here
            .iter()
            .any(|c| c.owner == owner && std::ptr::eq(c.limit.as_ptr(), Arc::as_ptr(limit)))
        {
            here.push(Claim {
                owner: owner.clone(),
                limit: Arc::downgrade(limit),
            });
        }
        let clash = clash?;
        Some(format!(
            "{} and {clash} both count under the name {name:?}: in a shared store they spend \
             each other's quota; give one of them another name",
            owner.describe()
        ))
    }
}

/// [`claim`], logging a clash at warn level.
pub(crate) fn claim_or_warn(name: &str, owner: Owner, limit: &Arc<Denials>) {
    if let Some(clash) = claim(name, owner, limit) {
        tracing::warn!("rate limit: {clash}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::top::Registry;

    /// Each test's claims of its own: the process's are shared by every
    /// test running at once.
    fn claims() -> Claims {
        Claims::default()
    }

    fn limit(name: &str) -> (Registry, Arc<Denials>) {
        let registry = Registry::default();
        let denials = registry.of(&Arc::from(name));
        (registry, denials)
    }

    #[test]
    fn a_rule_and_a_limiter_of_one_name_clash() {
        let mut claims = claims();
        let (_r1, rule) = limit("names-test-api");
        let (_r2, limiter) = limit("names-test-api");
        assert_eq!(claims.claim("names-test-api", Owner::Rule, &rule), None);
        // The rule's tiers and reloads: one limit.
        assert_eq!(claims.claim("names-test-api", Owner::Rule, &rule), None);
        let clash = claims
            .claim(
                "names-test-api",
                Owner::Limiter("10/s".to_owned()),
                &limiter,
            )
            .unwrap();
        assert!(
            clash.contains("a rule") && clash.contains("names-test-api"),
            "{clash}"
        );
    }

    #[test]
    fn limiters_of_one_name_clash_only_with_other_policies_and_while_alive() {
        let mut claims = claims();
        let (r1, a) = limit("names-test-x");
        let (r2, b) = limit("names-test-x");
        let (_r3, c) = limit("names-test-x");
        let ten = Owner::Limiter("10/s".to_owned());
        let five = Owner::Limiter("5/s".to_owned());
        assert_eq!(claims.claim("names-test-x", ten.clone(), &a), None);
        // The same policy (a layer's limiter and an admin's copy): meant.
        assert_eq!(claims.claim("names-test-x", ten, &b), None);
        assert!(claims.claim("names-test-x", five.clone(), &c).is_some());
        // Once the others are gone, the name is this one's alone.
        drop((a, b, r1, r2));
        assert_eq!(claims.claim("names-test-x", five, &c), None);
    }

    #[test]
    fn a_rule_and_a_limiter_of_one_limit_family_clash_too() {
        let mut claims = claims();
        // The example server's case: its limiter named `api` is the
        // template of its rules, one of which is named `api`.
        let (_r, shared) = limit("names-test-family");
        assert_eq!(
            claims.claim(
                "names-test-family",
                Owner::Limiter("1/s".to_owned()),
                &shared
            ),
            None
        );
        assert!(
            claims
                .claim("names-test-family", Owner::Rule, &shared)
                .is_some()
        );
    }

    #[test]
    fn claims_of_limits_gone_are_dropped_as_names_grow() {
        let mut claims = claims();
        // A claim per name whose limit is gone at once: the map is pruned
        // as it doubles, so it never holds them all (without pruning it
        // would hold 5,000; pruning at every claim made loading a large
        // rule set quadratic).
        for i in 0..5_000 {
            let (_r, limit) = limit(&format!("names-test-gone-{i}"));
            assert_eq!(
                claims.claim(&format!("names-test-gone-{i}"), Owner::Rule, &limit),
                None
            );
        }
        let gone = claims
            .by_name
            .keys()
            .filter(|name| name.starts_with("names-test-gone-"))
            .count();
        assert!(gone < 1_000, "{gone} names of limits gone still held");
    }

    #[test]
    fn claiming_many_live_names_looks_at_each_a_few_times() {
        let mut claims = claims();
        // 5,000 rules in force: each name is looked at by whole prunes a
        // few times in all (a prune at every claim looked at 12.5 million).
        let live: Vec<_> = (0..5_000)
            .map(|i| limit(&format!("names-test-live-{i}")))
            .collect();
        let before = claims.pruned;
        for (i, (_, limit)) in live.iter().enumerate() {
            claims.claim(&format!("names-test-live-{i}"), Owner::Rule, limit);
        }
        let pruned = claims.pruned - before;
        assert!(pruned < 4 * 5_000 + 10_000, "{pruned} names looked at");
    }
}
