//! OpenAI's rate-limit fields: `x-ratelimit-limit-requests`,
//! `x-ratelimit-remaining-tokens`, `x-ratelimit-reset-requests`... with
//! durations written as OpenAI writes them (`1s`, `6m0s`, `17ms`).

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::decision::{Decision, RateStatus};
use crate::rules::Unit;

const REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];

const TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// Set the fields of the requests and of the tokens, each from the rate
/// with the fewest units left among the rates (windows under a day) of
/// the rules counting them.
pub(crate) fn set<'d>(
    headers: &mut HeaderMap,
    decisions: impl Iterator<Item = (Unit, &'d Decision)>,
) {
    let mut requests: Option<&RateStatus> = None;
    let mut tokens: Option<&RateStatus> = None;
    for (unit, decision) in decisions {
        let slot = match unit {
            Unit::Requests => &mut requests,
            Unit::Tokens => &mut tokens,
            _ => continue,
        };
        // A quota (a day or more) is not a rate: OpenAI's fields describe
        // rates.
        for status in decision.rates().iter().filter(|s| !is_budget(&s.rate())) {
            if slot.is_none_or(|shown| status.remaining() < shown.remaining()) {
                *slot = Some(status);
            }
        }
    }
    for (names, status) in [(REQUESTS, requests), (TOKENS, tokens)] {
        let Some(status) = status else { continue };
        let [limit, remaining, reset] = names;
        headers.insert(limit, HeaderValue::from(status.rate().max()));
        headers.insert(remaining, HeaderValue::from(status.remaining()));
        if let Ok(value) = HeaderValue::try_from(duration(status.reset())) {
            headers.insert(reset, value);
        }
    }
}

/// Whether `rate` is a budget (on the calendar, or a day or longer)
/// rather than a rate: spent, it is `insufficient_quota`, not a wait.
pub(crate) fn is_budget(rate: &crate::policy::Rate) -> bool {
    rate.calendar().is_some() || rate.window() >= Duration::from_secs(86_400)
}

/// A duration as OpenAI writes its resets (Go's style, to the
/// millisecond, rounded up): `17ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub(crate) fn duration(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms / 60_000 % 60;
    let millis = ms % 60_000;
    let seconds = if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        let text = format!("{}.{:03}", millis / 1000, millis % 1000);
        text.trim_end_matches('0').to_owned()
    };
    if hours > 0 {
        format!("{hours}h{minutes}m{seconds}s")
    } else if minutes > 0 {
        format!("{minutes}m{seconds}s")
    } else {
        format!("{seconds}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_written_as_openai_writes_them() {
        for (d, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(16_200), "17ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(1020), "1.02s"),
            (Duration::from_secs(360), "6m0s"),
            (Duration::from_secs(3723), "1h2m3s"),
            (Duration::from_secs(86_400 * 3), "72h0m0s"),
        ] {
            assert_eq!(duration(d), text);
        }
    }
}
