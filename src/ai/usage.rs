//! The usage an OpenAI-compatible answer reports, as tokens of each kind.

use serde_json::Value;

use crate::rules::Usage;

/// The most tokens one answer may report of a kind: more is out of range
/// (a broken or hostile upstream), and the estimate is charged instead.
pub(crate) const MAX_TOKENS: u64 = 100_000_000;

/// What an answer said of its usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reported {
    /// A usage that reads.
    Usage(Usage),
    /// None.
    Missing,
    /// One that does not read, or is out of range: why.
    Bad(&'static str),
}

/// The `usage` object of an answer (chat, completions and embeddings:
/// `prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`;
/// the Responses API's `input_tokens`, `output_tokens` and
/// `input_tokens_details.cached_tokens` too), as `input` (the prompt's
/// tokens not cached), `cached_input` and `output`.
pub(crate) fn reported(usage: Option<&Value>) -> Reported {
    let usage = match usage {
        None | Some(Value::Null) => return Reported::Missing,
        Some(Value::Object(usage)) => usage,
        Some(_) => return Reported::Bad("`usage` is not an object"),
    };
    let count = |value: Option<&Value>| -> Result<Option<u64>, &'static str> {
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_u64()
                .filter(|n| *n <= MAX_TOKENS)
                .map(Some)
                .ok_or("a token count is not a whole number from 0 to 100,000,000"),
        }
    };
    let read = || -> Result<Usage, &'static str> {
        let (input, output, details) = if usage.contains_key("prompt_tokens") {
            (
                "prompt_tokens",
                "completion_tokens",
                "prompt_tokens_details",
            )
        } else {
            ("input_tokens", "output_tokens", "input_tokens_details")
        };
        let prompt = count(usage.get(input))?.ok_or("no prompt (input) token count")?;
        let output = count(usage.get(output))?.unwrap_or(0);
        let cached = count(usage.get(details).and_then(|d| d.get("cached_tokens")))?.unwrap_or(0);
        if cached > prompt {
            return Err("more cached tokens than prompt tokens");
        }
        Ok(Usage::new()
            .with("input", prompt - cached)
            .with("cached_input", cached)
            .with("output", output))
    };
    match read() {
        Ok(usage) => Reported::Usage(usage),
        Err(why) => Reported::Bad(why),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn usages_read_and_bad_ones_say_why() {
        let usage = json!({"prompt_tokens": 10, "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 4}});
        assert_eq!(
            reported(Some(&usage)),
            Reported::Usage(
                Usage::new()
                    .with("input", 6)
                    .with("cached_input", 4)
                    .with("output", 5)
            )
        );
        let embeddings = json!({"prompt_tokens": 7, "total_tokens": 7});
        assert_eq!(
            reported(Some(&embeddings)),
            Reported::Usage(
                Usage::new()
                    .with("input", 7)
                    .with("cached_input", 0)
                    .with("output", 0)
            )
        );
        let responses = json!({"input_tokens": 3, "output_tokens": 2});
        assert!(matches!(reported(Some(&responses)), Reported::Usage(u) if u.total() == 5));
        assert_eq!(reported(None), Reported::Missing);
        assert_eq!(reported(Some(&Value::Null)), Reported::Missing);
        for bad in [
            json!("lots"),
            json!({"completion_tokens": 5}),
            json!({"prompt_tokens": "10"}),
            json!({"prompt_tokens": -1}),
            json!({"prompt_tokens": 1.5}),
            json!({"prompt_tokens": 1, "completion_tokens": 1_000_000_000_000_000_000u64}),
            json!({"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}}),
        ] {
            assert!(matches!(reported(Some(&bad)), Reported::Bad(_)), "{bad}");
        }
    }
}
