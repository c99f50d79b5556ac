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

static CLAIMS: LazyLock<Mutex<HashMap<String, Vec<Claim>>>> = LazyLock::new(Mutex::default);

/// Record that `owner` counts under `name` (the limit `limit`), and
/// describe another live limit of this process counting under it
/// differently, if any.
pub(crate) fn claim(name: &str, owner: Owner, limit: &Arc<Denials>) -> Option<String> {
    let mut claims = CLAIMS.lock().unwrap_or_else(PoisonError::into_inner);
    // Limits gone, and names no live limit counts under: claims are made
    // when limiters are built, so this stays as small as the live limits.
    claims.retain(|_, here| {
        here.retain(|c| c.limit.strong_count() > 0);
        !here.is_empty()
    });
    let here = claims.entry(name.to_owned()).or_default();
    // Rules of one name share counts on purpose (tiers, reloads, one rule
    // set served twice), and so do limiters of one name and policy (a
    // layer's and an admin router's).
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

    fn limit(name: &str) -> (Registry, Arc<Denials>) {
        let registry = Registry::default();
        let denials = registry.of(&Arc::from(name));
        (registry, denials)
    }

    #[test]
    fn a_rule_and_a_limiter_of_one_name_clash() {
        let (_r1, rule) = limit("names-test-api");
        let (_r2, limiter) = limit("names-test-api");
        assert_eq!(claim("names-test-api", Owner::Rule, &rule), None);
        // The rule's tiers and reloads: one limit.
        assert_eq!(claim("names-test-api", Owner::Rule, &rule), None);
        let clash = claim(
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
        let (r1, a) = limit("names-test-x");
        let (r2, b) = limit("names-test-x");
        let (_r3, c) = limit("names-test-x");
        let ten = Owner::Limiter("10/s".to_owned());
        let five = Owner::Limiter("5/s".to_owned());
        assert_eq!(claim("names-test-x", ten.clone(), &a), None);
        // The same policy (a layer's limiter and an admin's copy): meant.
        assert_eq!(claim("names-test-x", ten, &b), None);
        assert!(claim("names-test-x", five.clone(), &c).is_some());
        // Once the others are gone, the name is this one's alone.
        drop((a, b, r1, r2));
        assert_eq!(claim("names-test-x", five, &c), None);
    }

    #[test]
    fn a_rule_and_a_limiter_of_one_limit_family_clash_too() {
        // The example server's case: its limiter named `api` is the
        // template of its rules, one of which is named `api`.
        let (_r, shared) = limit("names-test-family");
        assert_eq!(
            claim(
                "names-test-family",
                Owner::Limiter("1/s".to_owned()),
                &shared
            ),
            None
        );
        assert!(claim("names-test-family", Owner::Rule, &shared).is_some());
    }
}
