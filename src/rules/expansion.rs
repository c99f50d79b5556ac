//! The bound on what a rule set's text may expand to. YAML's aliases
//! repeat what an anchor names wherever they appear, so a file of a few
//! kilobytes can stand for billions of values (an anchor of 3,000
//! descriptors aliased 3,000 times): read whole, it would take every byte
//! of memory. A text is counted first, value by value as it expands, and
//! refused at the bound, before anything is built from it. JSON and TOML
//! have no aliases (each value takes at least a byte of the text); JSON is
//! counted all the same, so that every format that can be published or
//! watched says the same bound.

use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, Visitor};

/// The most values a rule set's text may expand to (each mapping, list,
/// key and scalar counts, and whatever an alias names counts each time it
/// is used): a text over it is refused as any text that does not
/// validate. Ten thousand descriptor rules take about a tenth of it.
pub const MAX_VALUES: usize = 100_000;

/// `T` read from the YAML `text`, unless `text` expands to more than
/// [`MAX_VALUES`] values.
#[cfg(feature = "envoy")]
pub(crate) fn yaml<T: DeserializeOwned>(text: &str) -> Result<T, serde_yaml_ng::Error> {
    within_bound(serde_yaml_ng::Deserializer::from_str(text))?;
    serde_yaml_ng::from_str(text)
}

/// `T` read from the JSON `text`, unless `text` holds more than
/// [`MAX_VALUES`] values.
pub(crate) fn json<T: DeserializeOwned>(text: &str) -> Result<T, serde_json::Error> {
    within_bound(&mut serde_json::Deserializer::from_str(text))?;
    serde_json::from_str(text)
}

/// An error if what `deserializer` reads expands to more than
/// [`MAX_VALUES`] values; any other error is left to the reading proper,
/// which says it in its own words.
fn within_bound<'de, D: Deserializer<'de>>(deserializer: D) -> Result<(), D::Error> {
    let mut left = MAX_VALUES;
    let mut over = false;
    let counted = Count {
        left: &mut left,
        over: &mut over,
    }
    .deserialize(deserializer);
    match counted {
        Err(error) if over => Err(error),
        _ => Ok(()),
    }
}

/// Counts the values of one value and those below it, and gives up (an
/// error, `over` set) at the bound.
struct Count<'a> {
    left: &'a mut usize,
    over: &'a mut bool,
}

impl Count<'_> {
    /// One more value.
    fn one<E: de::Error>(&mut self) -> Result<(), E> {
        match self.left.checked_sub(1) {
            Some(left) => {
                *self.left = left;
                Ok(())
            }
            None => {
                *self.over = true;
                Err(E::custom(format!(
                    "the text expands to more than {MAX_VALUES} values (each use of an \
                     alias counts what it names); a rule set may hold at most {MAX_VALUES}"
                )))
            }
        }
    }

    /// The counter of a value below this one.
    fn below(&mut self) -> Count<'_> {
        Count {
            left: self.left,
            over: self.over,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// A scalar counts one.
macro_rules! scalars {
    ($($visit:ident($type:ty)),* $(,)?) => {
        $(fn $visit<E: de::Error>(mut self, _: $type) -> Result<(), E> {
            self.one()
        })*
    };
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("any value")
    }

    scalars!(
        visit_bool(bool),
        visit_i64(i64),
        visit_i128(i128),
        visit_u64(u64),
        visit_u128(u128),
        visit_f64(f64),
        visit_str(&str),
        visit_bytes(&[u8]),
    );

    fn visit_none<E: de::Error>(mut self) -> Result<(), E> {
        self.one()
    }

    fn visit_unit<E: de::Error>(mut self) -> Result<(), E> {
        self.one()
    }

    fn visit_some<D: Deserializer<'de>>(mut self, deserializer: D) -> Result<(), D::Error> {
        self.one()?;
        self.below().deserialize(deserializer)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(
        mut self,
        deserializer: D,
    ) -> Result<(), D::Error> {
        self.one()?;
        self.below().deserialize(deserializer)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.one()?;
        while seq.next_element_seed(self.below())?.is_some() {}
        Ok(())
    }

    fn visit_map<A: de::MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        self.one()?;
        while map.next_key_seed(self.below())?.is_some() {
            map.next_value_seed(self.below())?;
        }
        Ok(())
    }

    // A tagged YAML value (`!tag value`).
    fn visit_enum<A: de::EnumAccess<'de>>(mut self, data: A) -> Result<(), A::Error> {
        use de::VariantAccess as _;
        self.one()?;
        let ((), contents) = data.variant_seed(self.below())?;
        contents.newtype_variant_seed(self.below())
    }
}

#[cfg(test)]
mod tests {
    use super::MAX_VALUES;

    #[test]
    fn json_is_counted_value_by_value() {
        // A list and its elements.
        let at = format!("[{}]", vec!["0"; MAX_VALUES - 1].join(","));
        assert!(super::json::<serde_json::Value>(&at).is_ok());
        let over = format!("[{}]", vec!["0"; MAX_VALUES].join(","));
        let error = super::json::<serde_json::Value>(&over).unwrap_err();
        assert!(error.to_string().contains("100000 values"), "{error}");
    }

    #[test]
    fn other_errors_are_the_readings_own() {
        let error = super::json::<serde_json::Value>("[1,").unwrap_err();
        assert!(error.is_eof(), "{error}");
    }

    #[cfg(feature = "envoy")]
    #[test]
    fn each_use_of_an_alias_counts_what_it_names() {
        let anchor = format!("a: &x [{}]\n", vec!["0"; 998].join(","));
        // The root mapping (1), the anchor's key and list (1 + 999) and 98
        // aliases of it, each a key and what it names (1,000 each): 99,001
        // values. One more alias makes 100,001.
        let aliases = |n: usize| (0..n).map(|i| format!("b{i}: *x\n")).collect::<String>();
        let at = format!("{anchor}{}", aliases(98));
        assert!(super::yaml::<serde_yaml_ng::Value>(&at).is_ok());
        let over = format!("{anchor}{}", aliases(99));
        let error = super::yaml::<serde_yaml_ng::Value>(&over).unwrap_err();
        assert!(error.to_string().contains("100000 values"), "{error}");
    }
}
