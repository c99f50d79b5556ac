//! What a descriptor's units cost under a rule that names its usage
//! (`usage = { model = "model", kind = "token_kind" }`): tokens of the
//! model and kind its entries name, counted as they are by a rule counted
//! in tokens, priced by the rule set's catalog for a rule counted in money.

use crate::rules::{Catalog, NotPriced, Rule, Unit, Usage};

/// The units `rule` counts for a descriptor of `entries` (key, value)
/// whose cost is `tokens`: the tokens themselves, or their price in
/// micro-units of the catalog's currency (rounded up).
///
/// # Errors
/// [`NotPriced`] when the rule counts money and `catalog` has no price
/// for the descriptor's model, or for its kind of tokens, whatever their
/// number (a descriptor that asks without spending is refused as well,
/// before the request is served).
pub(super) fn units(
    rule: &Rule,
    catalog: Option<&Catalog>,
    entries: &[(&str, &str)],
    tokens: u64,
) -> Result<u64, NotPriced> {
    let Some(usage) = rule.envoy().usage.as_ref() else {
        return Ok(tokens);
    };
    if rule.unit() != Unit::Money {
        return Ok(tokens);
    }
    let value = |entry: Option<&String>| {
        entry.and_then(|name| {
            entries
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| *value)
        })
    };
    // A rule matches a descriptor of its own entries only: both are there
    // (validated), and a missing one has no price.
    let model = value(usage.model.as_ref()).unwrap_or_default();
    let kind = value(usage.kind.as_ref()).unwrap_or_default();
    let prices = catalog
        .and_then(|catalog| catalog.prices(model))
        .ok_or_else(|| NotPriced::Model(model.to_owned()))?;
    if kind.is_empty() || prices.per_million(kind).is_none() {
        return Err(NotPriced::Kind {
            model: model.to_owned(),
            kind: kind.to_owned(),
        });
    }
    match catalog {
        Some(catalog) => catalog.cost(model, &Usage::new().with(kind, tokens)),
        None => Err(NotPriced::Model(model.to_owned())),
    }
}

/// Log that `rule` found no price for the usage of a descriptor of
/// `entries`: refused on the request path, charged at the catalog's
/// dearest price at a stream's end (`settling`: a kind the request did
/// not name, or a catalog changed since).
pub(super) fn log_unpriced(
    rule: &Rule,
    entries: &[(&str, &str)],
    unpriced: &NotPriced,
    settling: bool,
) {
    let model_entry = rule.envoy().usage.as_ref().and_then(|u| u.model.as_deref());
    let model = entries
        .iter()
        .find(|(key, _)| Some(*key) == model_entry)
        .map_or("", |(_, value)| shortened(value));
    let problem = match unpriced {
        NotPriced::Model(_) => "the model has no price",
        NotPriced::Kind { .. } => "the kind of tokens has no price",
    };
    if settling {
        tracing::warn!(
            rule = rule.name(),
            model,
            "envoy: a usage sent at the stream's end has no price in the catalog ({problem}); charged at its dearest price"
        );
    } else {
        tracing::info!(
            rule = rule.name(),
            model,
            "envoy: a usage the price catalog cannot price ({problem}); refused"
        );
    }
}

/// At most `MAX` characters of `text`, for a log line: a model's name
/// comes from the request.
fn shortened(text: &str) -> &str {
    const MAX: usize = 80;
    match text.char_indices().nth(MAX) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    fn set(policy: &str, usage: &str) -> RuleSet {
        RuleSet::from_toml(&format!(
            r#"
            [catalog]
            currency = "USD"
            [catalog.models."gpt-4o"]
            input = 2_500_000
            output = 10_000_000
            [catalog.models."gpt-4o*"]
            input = 150_000
            output = 600_000

            [[rules]]
            name = "r"
            domain = "ai"
            descriptor = ["api_key", "model", "token_kind"]
            policy = "{policy}"
            algorithm = "fixed-window"
            usage = {usage}
            "#
        ))
        .unwrap()
    }

    #[test]
    fn money_prices_the_models_tokens_of_the_kind_and_tokens_count_as_they_are() {
        let money = set(
            "100 USD/month",
            r#"{ model = "model", kind = "token_kind" }"#,
        );
        let rule = &money.rules()[0];
        let priced = |model, kind, tokens| {
            let entries = [("api_key", "k"), ("model", model), ("token_kind", kind)];
            units(rule, money.catalog(), &entries, tokens)
        };
        // 1,000 output tokens at $10 per million: a cent.
        assert_eq!(priced("gpt-4o", "output", 1000), Ok(10_000));
        assert_eq!(priced("gpt-4o-mini", "input", 1000), Ok(150));
        // cached_input is priced as input when the catalog says nothing.
        assert_eq!(priced("gpt-4o", "cached_input", 1000), Ok(2_500));
        // A peek of an unpriced model or kind is refused too.
        assert!(matches!(priced("llama", "input", 0), Err(NotPriced::Model(m)) if m == "llama"));
        assert!(matches!(
            priced("gpt-4o", "audio", 0),
            Err(NotPriced::Kind { kind, .. }) if kind == "audio"
        ));
        assert!(matches!(
            priced("gpt-4o", "", 5),
            Err(NotPriced::Kind { .. })
        ));

        let tokens = set("20000 tokens/min", r#"{ model = "model" }"#);
        let entries = [("api_key", "k"), ("model", "llama"), ("token_kind", "x")];
        assert_eq!(
            units(&tokens.rules()[0], tokens.catalog(), &entries, 42),
            Ok(42)
        );
    }

    #[test]
    fn a_long_name_is_shortened_for_the_log() {
        assert_eq!(shortened("gpt-4o"), "gpt-4o");
        assert_eq!(shortened(&"é".repeat(200)).chars().count(), 80);
    }
}
