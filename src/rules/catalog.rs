//! The price catalog of a rule set: what a model's tokens cost, per
//! million of each kind, in integer micro-units of one currency, so that
//! a rule counted in money (`policy = "100 USD/month"`) charges a
//! request the price of the usage its answer reports.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

use super::RulesError;

/// Micro-units in one unit of the currency.
pub(crate) const MICROS: u64 = 1_000_000;

/// The largest price per million tokens: a million units of the currency
/// (beyond any model's, and far from overflow once multiplied by tokens).
const MAX_PRICE: u64 = 1_000_000 * MICROS;

/// The catalog as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CatalogSpec {
    currency: Option<String>,
    #[serde(default)]
    models: BTreeMap<String, BTreeMap<String, u64>>,
    default: Option<BTreeMap<String, u64>>,
}

/// The prices of each model and token kind (`[catalog]` in a rule set):
/// per million tokens, in micro-units of [`currency`](Self::currency).
///
/// ```
/// use tower_redis_ratelimit::rules::{RuleSet, Usage};
///
/// let rules = RuleSet::from_toml(r#"
///     [catalog]
///     currency = "USD"
///     [catalog.models."gpt-4o"]
///     input = 2_500_000           # $2.50 per million input tokens
///     cached_input = 1_250_000
///     output = 10_000_000
///
///     [[rules]]
///     name = "team-spend"
///     key = "header:x-team"
///     policy = "100 USD/month"    # 100,000,000 micro-USD
///     algorithm = "fixed-window"
/// "#)?;
/// let catalog = rules.catalog().unwrap();
/// let usage = Usage::new().with("input", 1000).with("cached_input", 2000).with("output", 500);
/// // 1,000 × 2.5 + 2,000 × 1.25 + 500 × 10 = 10,000 micro-USD: a cent.
/// assert_eq!(catalog.cost("gpt-4o", &usage), Ok(10_000));
/// assert!(catalog.cost("gpt-5", &usage).is_err()); // not in the catalog, and no default
/// # Ok::<(), tower_redis_ratelimit::rules::RulesError>(())
/// ```
///
/// A model is found by its name, or else by the longest entry ending in
/// `*` that its name starts with (`"gpt-4o*"` prices `gpt-4o-mini` unless
/// it has its own entry); a model the catalog does not name is priced by
/// `[catalog.default]` when there is one, and refused otherwise: never
/// free by accident. `input` and `output` are required of every model;
/// `cached_input` is the `input` price when not given; other kinds may be
/// named, and are priced when a usage reports them.
#[derive(Clone, PartialEq, Eq)]
pub struct Catalog {
    currency: String,
    models: BTreeMap<String, Prices>,
    default: Option<Prices>,
}

/// One model's prices per million tokens of each kind, in micro-units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prices {
    per_million: BTreeMap<String, u64>,
}

/// Tokens of each kind that a request used (or is estimated to use):
/// `input`, `cached_input`, `output`, or any kind the catalog names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    tokens: Vec<(String, u64)>,
}

/// Why a usage has no price.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPriced {
    /// The catalog names no such model, and has no default price.
    #[error("the model {0:?} is not in the price catalog (and it has no default price)")]
    Model(String),
    /// The model has no price for a kind of tokens the usage reports.
    #[error("the model {model:?} has no price for {kind:?} tokens")]
    Kind {
        /// The model.
        model: String,
        /// The kind of tokens.
        kind: String,
    },
}

impl Usage {
    /// No tokens.
    pub fn new() -> Self {
        Self::default()
    }

    /// These and `tokens` more of `kind`.
    #[must_use]
    pub fn with(mut self, kind: &str, tokens: u64) -> Self {
        self.add(kind, tokens);
        self
    }

    /// Count `tokens` more of `kind`.
    pub fn add(&mut self, kind: &str, tokens: u64) {
        match self.tokens.iter_mut().find(|(k, _)| k == kind) {
            Some((_, n)) => *n = n.saturating_add(tokens),
            None => self.tokens.push((kind.to_owned(), tokens)),
        }
    }

    /// The tokens of `kind` (0 when none).
    pub fn get(&self, kind: &str) -> u64 {
        self.tokens
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| *n)
    }

    /// Every kind and its tokens.
    pub fn kinds(&self) -> impl Iterator<Item = (&str, u64)> {
        self.tokens.iter().map(|(k, n)| (k.as_str(), *n))
    }

    /// All tokens, whatever their kind.
    pub fn total(&self) -> u64 {
        self.tokens
            .iter()
            .fold(0u64, |sum, (_, n)| sum.saturating_add(*n))
    }
}

impl Prices {
    /// The price per million tokens of `kind` (`cached_input` falls back
    /// to `input`).
    pub fn per_million(&self, kind: &str) -> Option<u64> {
        self.per_million.get(kind).copied().or_else(|| {
            (kind == "cached_input")
                .then(|| self.per_million.get("input").copied())
                .flatten()
        })
    }
}

impl Catalog {
    /// The currency the prices and money policies count in (`"USD"`).
    pub fn currency(&self) -> &str {
        &self.currency
    }

    /// `micros` micro-units as an amount of the currency: `12.5 USD`.
    pub fn amount(&self, micros: u64) -> String {
        let (whole, fraction) = (micros / MICROS, micros % MICROS);
        if fraction == 0 {
            return format!("{whole} {}", self.currency);
        }
        let fraction = format!("{fraction:06}");
        format!(
            "{whole}.{} {}",
            fraction.trim_end_matches('0'),
            self.currency
        )
    }

    /// What `tokens` cost at the catalog's dearest price of any kind (of
    /// any model, or the default), rounded up: the charge of a usage that
    /// must be charged and has no price of its own.
    pub fn at_dearest(&self, tokens: u64) -> u64 {
        let dearest = self
            .models
            .values()
            .chain(self.default.as_ref())
            .flat_map(|prices| prices.per_million.values())
            .copied()
            .max()
            .unwrap_or(0);
        let cost = (u128::from(tokens) * u128::from(dearest)).div_ceil(u128::from(MICROS));
        u64::try_from(cost).unwrap_or(u64::MAX)
    }

    /// The prices of `model`: its own entry, else the longest `prefix*`
    /// entry it starts with, else the default.
    pub fn prices(&self, model: &str) -> Option<&Prices> {
        if let Some(prices) = self.models.get(model) {
            return Some(prices);
        }
        self.models
            .iter()
            .filter_map(|(name, prices)| {
                let prefix = name.strip_suffix('*')?;
                model.starts_with(prefix).then_some((prefix.len(), prices))
            })
            .max_by_key(|(len, _)| *len)
            .map(|(_, prices)| prices)
            .or(self.default.as_ref())
    }

    /// What `usage` of `model` costs, in micro-units, rounded up (a
    /// fraction of a micro-unit is charged as one, never dropped).
    ///
    /// # Errors
    /// [`NotPriced`] when the catalog cannot price the model or one of the
    /// kinds of tokens the usage reports.
    pub fn cost(&self, model: &str, usage: &Usage) -> Result<u64, NotPriced> {
        let prices = self
            .prices(model)
            .ok_or_else(|| NotPriced::Model(model.to_owned()))?;
        let mut total: u128 = 0;
        for (kind, tokens) in usage.kinds() {
            if tokens == 0 {
                continue;
            }
            let price = prices.per_million(kind).ok_or_else(|| NotPriced::Kind {
                model: model.to_owned(),
                kind: kind.to_owned(),
            })?;
            total += u128::from(tokens) * u128::from(price);
        }
        Ok(u64::try_from(total.div_ceil(u128::from(MICROS))).unwrap_or(u64::MAX))
    }

    pub(super) fn validate(spec: CatalogSpec) -> Result<Self, RulesError> {
        let fault = |field: String, problem: String| RulesError {
            rule: None,
            field,
            problem,
        };
        let currency = match spec.currency {
            Some(c) if valid_currency(&c) => c,
            Some(c) => {
                return Err(fault(
                    "catalog.currency".to_owned(),
                    format!(
                        "{c:?}: name the currency in 1 to 8 capital letters (\"USD\", \"EUR\", \"CREDITS\")"
                    ),
                ));
            }
            None => {
                return Err(fault(
                    "catalog.currency".to_owned(),
                    "is missing (e.g. \"USD\"): prices and money policies count in it".to_owned(),
                ));
            }
        };
        let prices = |field: String, kinds: BTreeMap<String, u64>| -> Result<Prices, RulesError> {
            for required in ["input", "output"] {
                if !kinds.contains_key(required) {
                    return Err(fault(
                        field.clone(),
                        format!(
                            "has no {required:?} price (micro-units of the currency per million tokens)"
                        ),
                    ));
                }
            }
            for (kind, price) in &kinds {
                if kind.is_empty()
                    || !kind
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                {
                    return Err(fault(
                        format!("{field}.{kind}"),
                        "name a kind of tokens in lower-case letters, digits and `_`".to_owned(),
                    ));
                }
                if *price > MAX_PRICE {
                    return Err(fault(
                        format!("{field}.{kind}"),
                        format!(
                            "{price} micro-units per million tokens is over a million units of the currency (prices are in micro-units: $2.50 is 2500000)"
                        ),
                    ));
                }
            }
            Ok(Prices { per_million: kinds })
        };
        let mut models = BTreeMap::new();
        for (model, kinds) in spec.models {
            if model.is_empty() || model == "*" {
                return Err(fault(
                    "catalog.models".to_owned(),
                    format!(
                        "{model:?} names no model: give the default price as [catalog.default]"
                    ),
                ));
            }
            let field = format!("catalog.models.{model:?}");
            models.insert(model, prices(field, kinds)?);
        }
        let default = spec
            .default
            .map(|kinds| prices("catalog.default".to_owned(), kinds))
            .transpose()?;
        Ok(Self {
            currency,
            models,
            default,
        })
    }
}

fn valid_currency(c: &str) -> bool {
    (1..=8).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_uppercase())
}

impl fmt::Debug for Catalog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Catalog")
            .field("currency", &self.currency)
            .field("models", &self.models.len())
            .field("default", &self.default.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(text: &str) -> Result<Catalog, RulesError> {
        let spec: CatalogSpec = toml::from_str(text).map_err(|e| RulesError {
            rule: None,
            field: "TOML".to_owned(),
            problem: e.to_string(),
        })?;
        Catalog::validate(spec)
    }

    #[test]
    fn costs_are_rounded_up_and_exact() {
        let c = catalog(
            "currency = \"USD\"\n[models.m]\ninput = 3\noutput = 1000001\n[models.\"m-*\"]\ninput = 1\noutput = 1\n",
        )
        .unwrap();
        // 1 token at 3 micro-units per million: 0.000003 micro-units, charged 1.
        assert_eq!(c.cost("m", &Usage::new().with("input", 1)), Ok(1));
        assert_eq!(
            c.cost("m", &Usage::new().with("output", 1_000_000)),
            Ok(1_000_001)
        );
        // cached_input falls back to input.
        assert_eq!(
            c.cost("m", &Usage::new().with("cached_input", 1_000_000)),
            Ok(3)
        );
        assert_eq!(c.cost("m", &Usage::new()), Ok(0));
        // The longest prefix entry.
        assert_eq!(
            c.cost("m-mini", &Usage::new().with("input", 1_000_000)),
            Ok(1)
        );
        assert_eq!(
            c.cost("other", &Usage::new()),
            Err(NotPriced::Model("other".to_owned()))
        );
        assert!(matches!(
            c.cost("m", &Usage::new().with("audio", 5)),
            Err(NotPriced::Kind { .. })
        ));
        // The dearest price: 1000001 micro-units per million.
        assert_eq!(c.at_dearest(2_000_000), 2_000_002);
        // A huge usage saturates rather than wraps.
        assert_eq!(
            c.cost("m", &Usage::new().with("output", u64::MAX)),
            Ok(u64::MAX)
        );
    }

    #[test]
    fn a_default_prices_unknown_models() {
        let c =
            catalog("currency = \"EUR\"\n[default]\ninput = 1000000\noutput = 2000000\n").unwrap();
        assert_eq!(c.cost("anything", &Usage::new().with("output", 3)), Ok(6));
        assert_eq!(c.currency(), "EUR");
        assert_eq!(c.amount(12_500_000), "12.5 EUR");
        assert_eq!(c.amount(7), "0.000007 EUR");
        assert_eq!(c.amount(3_000_000), "3 EUR");
    }

    #[test]
    fn bad_catalogs_name_the_problem() {
        for (text, field) in [
            ("[models.m]\ninput = 1\noutput = 1\n", "catalog.currency"),
            ("currency = \"usd\"\n", "catalog.currency"),
            (
                "currency = \"USD\"\n[models.m]\ninput = 1\n",
                "catalog.models.\"m\"",
            ),
            (
                "currency = \"USD\"\n[models.m]\ninput = 1\noutput = 1\n\"Bad Kind\" = 1\n",
                "catalog.models.\"m\".Bad Kind",
            ),
            (
                "currency = \"USD\"\n[models.m]\ninput = 1000000000000000\noutput = 1\n",
                "catalog.models.\"m\".input",
            ),
            (
                "currency = \"USD\"\n[models.\"*\"]\ninput = 1\noutput = 1\n",
                "catalog.models",
            ),
        ] {
            let error = catalog(text).unwrap_err();
            assert_eq!(error.field(), field, "{text}: {error}");
        }
    }
}
