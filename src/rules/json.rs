//! Strict JSON for rule sets: a key given twice in one object is refused,
//! naming the rule and the field, where serde_json would keep the last one
//! (`"tiers": {"pro": "1/s", "pro": "900/s"}` would start at 900/s). TOML
//! refuses duplicate keys on its own.

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::RulesError;

/// An error if some object of `text` holds a key twice. Text that is not
/// JSON passes: the typed read that follows reports it.
pub(super) fn refuse_duplicate_keys(text: &str) -> Result<(), RulesError> {
    let mut path = Vec::new();
    let mut found = None;
    let walk = Walk {
        path: &mut path,
        found: &mut found,
    };
    // Its error is either the duplicate (in `found`) or bad JSON.
    let _ = walk.deserialize(&mut serde_json::Deserializer::from_str(text));
    match found {
        None => Ok(()),
        Some(path) => Err(located(text, &path)),
    }
}

/// One step of a path into the JSON: an object's key or an array's index.
#[derive(Debug, Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// The error for a duplicate at `path`: in a rule (`rules[i]...`), that
/// rule and the field below it; elsewhere, the top-level field.
fn located(text: &str, path: &[Step]) -> RulesError {
    let key = match path.last() {
        Some(Step::Key(key)) => key.as_str(),
        _ => "",
    };
    let problem =
        format!("the key {key:?} is given twice in one object (JSON would keep the last silently)");
    let dotted = |steps: &[Step]| {
        steps
            .iter()
            .map(|step| match step {
                Step::Key(key) => key.clone(),
                Step::Index(i) => i.to_string(),
            })
            .collect::<Vec<_>>()
            .join(".")
    };
    if let [Step::Key(rules), Step::Index(i), rest @ ..] = path
        && rules == "rules"
        && !rest.is_empty()
    {
        // The rule's name, as the last `name` in the text gives it.
        let name = serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|set| set["rules"][*i]["name"].as_str().map(str::to_owned));
        return RulesError {
            rule: Some(super::fields::label(name.as_deref(), *i)),
            field: dotted(rest),
            problem,
        };
    }
    RulesError {
        rule: None,
        field: dotted(path),
        problem,
    }
}

/// Walks any JSON value, recording the path to the first key found twice
/// in one object (and stopping there, with an error).
struct Walk<'a> {
    path: &'a mut Vec<Step>,
    found: &'a mut Option<Vec<Step>>,
}

impl Walk<'_> {
    fn below(&mut self) -> Walk<'_> {
        Walk {
            path: self.path,
            found: self.found,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        for i in 0.. {
            self.path.push(Step::Index(i));
            let more = seq.next_element_seed(self.below())?;
            self.path.pop();
            if more.is_none() {
                break;
            }
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            self.path.push(Step::Key(key.clone()));
            if !seen.insert(key) {
                *self.found = Some(self.path.clone());
                return Err(de::Error::custom("duplicate key"));
            }
            map.next_value_seed(self.below())?;
            self.path.pop();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::RuleSet;

    #[test]
    fn a_duplicate_key_is_refused_naming_the_rule_and_the_field() {
        let e = RuleSet::from_json(
            r#"{"rules": [
                {"name": "g", "key": "global", "policy": "10/s"},
                {"name": "api", "key": "ip", "policy": "5/s",
                 "tiers": {"pro": "1/s", "pro": "900/s"}}
            ]}"#,
        )
        .unwrap_err();
        assert_eq!(e.rule(), Some("\"api\" (#2)"));
        assert_eq!(e.field(), "tiers.pro");
        assert!(e.problem().contains("given twice"), "{e}");

        // A field of the rule itself, before or after its name.
        let e = RuleSet::from_json(
            r#"{"rules": [{"policy": "1/s", "key": "ip", "policy": "900/s", "name": "a"}]}"#,
        )
        .unwrap_err();
        assert_eq!((e.rule(), e.field()), (Some("\"a\" (#1)"), "policy"));
        let e = RuleSet::from_json(r#"{"rules": [{"key": "ip", "key": "global"}]}"#).unwrap_err();
        assert_eq!((e.rule(), e.field()), (Some("#1"), "key"));

        // At the top level, and deep in a list.
        let e = RuleSet::from_json(r#"{"version": 1, "version": 2, "rules": []}"#).unwrap_err();
        assert_eq!((e.rule(), e.field()), (None, "version"));
        let e = RuleSet::from_json(r#"{"rules": [], "x": [{"a": 1, "a": 2}]}"#).unwrap_err();
        assert_eq!((e.rule(), e.field()), (None, "x.0.a"));

        // The same keys in different objects are fine.
        let set = RuleSet::from_json(
            r#"{"rules": [
                {"name": "a", "key": "ip", "policy": "1/s", "tiers": {"pro": "2/s"}},
                {"name": "b", "key": "ip", "policy": "1/s", "tiers": {"pro": "3/s"}}
            ]}"#,
        )
        .unwrap();
        assert_eq!(set.rules()[1].policy(Some("pro")).to_string(), "3/s");
    }

    #[test]
    fn bad_json_is_still_reported_by_the_typed_read() {
        let e = RuleSet::from_json(r#"{"rules": [{"name": "a""#).unwrap_err();
        assert_eq!(e.field(), "JSON");
    }
}
