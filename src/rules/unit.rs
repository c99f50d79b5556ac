//! What a rule counts, as its policy names it: requests (`"60/min"`,
//! `"60 requests/min"`), tokens (`"20000 tokens/min"`) or money in the
//! catalog's currency (`"100 USD/month"`, counted in micro-units).

use std::borrow::Cow;
use std::fmt;

use super::catalog::MICROS;

/// What a rule's policy counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Unit {
    /// Requests: each costs its `cost` (default 1).
    #[default]
    Requests,
    /// Tokens of a language model: a request costs the tokens its answer
    /// reports (`"20000 tokens/min"`).
    Tokens,
    /// Money, in micro-units of the price catalog's currency: a request
    /// costs the catalog's price of its usage (`"100 USD/month"` counts
    /// 100,000,000).
    Money,
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unit::Requests => "requests",
            Unit::Tokens => "tokens",
            Unit::Money => "money",
        })
    }
}

/// `text` with each rate's unit word removed and money amounts in
/// micro-units (`"1.50 USD/day, 10 USD/month"` is
/// `"1500000/day, 10000000/month"`), and the unit they share. `currency`
/// is the catalog's, if the rule set has one.
pub(super) fn read<'t>(
    text: &'t str,
    currency: Option<&str>,
) -> Result<(Cow<'t, str>, Unit), String> {
    let plain = |rate: &str| {
        rate.split_once('/')
            .is_none_or(|(amount, _)| !amount.trim().contains(char::is_whitespace))
    };
    if text.split(',').all(plain) {
        return Ok((Cow::Borrowed(text), Unit::Requests));
    }
    let mut unit = None;
    let mut rates = Vec::new();
    for rate in text.split(',') {
        let (amount, window) = rate
            .split_once('/')
            .ok_or_else(|| format!("{:?} is not a rate such as \"100 USD/month\"", rate.trim()))?;
        let amount = amount.trim();
        let (number, this) = match amount.split_once(char::is_whitespace) {
            None => (amount.to_owned(), Unit::Requests),
            Some((number, word)) => match word.trim() {
                "requests" | "request" => (number.to_owned(), Unit::Requests),
                "tokens" | "token" => (number.to_owned(), Unit::Tokens),
                word if Some(word) == currency => (micros(number, word)?, Unit::Money),
                word if word.len() <= 8 && word.bytes().all(|b| b.is_ascii_uppercase()) => {
                    return Err(match currency {
                        None => format!(
                            "{word:?} reads as money, and the rule set has no price catalog \
                             ([catalog] with currency = {word:?})"
                        ),
                        Some(currency) => {
                            format!("{word:?} is not the price catalog's currency ({currency:?})")
                        }
                    });
                }
                word => {
                    return Err(format!(
                        "{word:?} is not a unit: use requests, tokens or the catalog's currency"
                    ));
                }
            },
        };
        if unit.is_some_and(|u| u != this) {
            return Err("every rate of a policy counts in one unit".to_owned());
        }
        unit = Some(this);
        rates.push(format!("{number}/{}", window.trim()));
    }
    Ok((Cow::Owned(rates.join(", ")), unit.unwrap_or_default()))
}

/// A decimal amount of money (at most 6 decimals) in micro-units.
fn micros(number: &str, currency: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "{number:?} {currency} is not an amount such as \"100\" or \"0.25\" (at most 6 decimals)"
        )
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty()
        || fraction.len() > 6
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let fraction: u64 = format!("{fraction:0<6}").parse().map_err(|_| bad())?;
    whole
        .checked_mul(MICROS)
        .and_then(|w| w.checked_add(fraction))
        .map(|m| m.to_string())
        .ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_read_and_money_is_in_micro_units() {
        let read = |t| read(t, Some("USD")).map(|(t, u)| (t.into_owned(), u));
        assert_eq!(read("60/min"), Ok(("60/min".to_owned(), Unit::Requests)));
        assert_eq!(
            read("60 requests/min"),
            Ok(("60/min".to_owned(), Unit::Requests))
        );
        assert_eq!(
            read("20000 tokens/min, 1000000 tokens/month"),
            Ok(("20000/min, 1000000/month".to_owned(), Unit::Tokens))
        );
        assert_eq!(
            read("100 USD/month"),
            Ok(("100000000/month".to_owned(), Unit::Money))
        );
        assert_eq!(
            read("0.25 USD/day"),
            Ok(("250000/day".to_owned(), Unit::Money))
        );
        assert!(
            read("1 USD/day, 5 tokens/min")
                .unwrap_err()
                .contains("one unit")
        );
        assert!(
            read("1 EUR/day")
                .unwrap_err()
                .contains("not the price catalog's currency")
        );
        assert!(
            read("0.1234567 USD/day")
                .unwrap_err()
                .contains("6 decimals")
        );
        assert!(read("5 apples/min").unwrap_err().contains("not a unit"));
        assert!(
            super::read("1 USD/day", None)
                .unwrap_err()
                .contains("no price catalog")
        );
    }
}
