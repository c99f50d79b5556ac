//! The rate-limit header fields the layer writes on every response of a
//! limited request: `X-RateLimit-*`, the IETF `RateLimit` and
//! `RateLimit-Policy`, and the numbers they are made of.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

use sfv::{Integer, KeyRef, ListSerializer, RefBareItem, StringRef, key_ref, string_ref};

use crate::decision::{Decision, RateStatus};
use crate::policy::{Algorithm, Policy, Rate};

/// `X-RateLimit-Limit`: the max of the rate reported.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: requests left in its window.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: whole seconds (rounded up) until its quota is full again.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-11): one quota
/// policy per rate, named after the rate: `"3/s";q=3;w=1, "20/min";q=20;w=60`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11): the state of every
/// rate for this request, `r` requests remaining and `t` seconds (rounded up)
/// until the rate resets or, for a rate that denied the request, until it
/// admits it again: `"3/s";r=2;t=1, "20/min";r=19;t=60`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// `RateLimit-Policy` parameters: the quota, its unit and its window.
const Q: &KeyRef = key_ref("q");
const QU: &KeyRef = key_ref("qu");
const W: &KeyRef = key_ref("w");
/// `RateLimit` parameters: remaining quota, seconds until reset.
const R: &KeyRef = key_ref("r");
const T: &KeyRef = key_ref("t");
/// The quota unit of a concurrency limit (the draft's default unit,
/// `requests`, is left implicit).
const CONCURRENT_REQUESTS: &StringRef = string_ref("concurrent-requests");

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The value of `Retry-After` for a denial: whole seconds, rounded up, at
/// least 1 — a client that waits that long and retries alone is admitted.
pub(crate) fn retry_after_secs(decision: &Decision) -> u64 {
    ceil_secs(decision.retry_after()).max(1)
}

pub(crate) fn set_headers(headers: &mut impl Sink, decision: &Decision) {
    headers.put_numbers(XRateLimit {
        limit: decision.limit(),
        remaining: decision.remaining(),
        reset: ceil_secs(decision.reset()),
    });
}

/// The numbers of the `X-RateLimit-*` fields.
#[derive(Debug, Clone, Copy)]
pub(crate) struct XRateLimit {
    limit: u64,
    remaining: u64,
    /// Whole seconds, rounded up.
    reset: u64,
}

impl XRateLimit {
    fn render(self, headers: &mut (impl Sink + ?Sized)) {
        headers.put(&X_RATELIMIT_LIMIT, number(self.limit));
        headers.put(&X_RATELIMIT_REMAINING, number(self.remaining));
        headers.put(&X_RATELIMIT_RESET, number(self.reset));
    }
}

/// Where rate-limit fields are written: a response's headers, or
/// [`Fields`] to put on a response later. A field replaces one of the same
/// name.
pub(crate) trait Sink {
    fn put(&mut self, name: &HeaderName, value: HeaderValue);

    /// The `X-RateLimit-*` fields of `numbers` (rendered at once, unless the
    /// sink writes them later).
    fn put_numbers(&mut self, numbers: XRateLimit) {
        numbers.render(self);
    }
}

impl Sink for HeaderMap {
    fn put(&mut self, name: &HeaderName, value: HeaderValue) {
        self.insert(name.clone(), value);
    }
}

/// Rate-limit fields of an admitted request, put on its response when the
/// inner service answers: the response future holds these instead of the
/// decision and the layer's settings (an `Arc` clone per request is a write
/// to a counter every worker thread shares). The `X-RateLimit-*` fields are
/// kept as their three numbers (small in the future, which moves) and
/// rendered when applied; other fields are rendered when put.
#[derive(Debug, Default)]
pub(crate) struct Fields {
    numbers: Option<XRateLimit>,
    rendered: Vec<(HeaderName, HeaderValue)>,
}

impl Sink for Fields {
    fn put(&mut self, name: &HeaderName, value: HeaderValue) {
        self.rendered.retain(|(n, _)| n != name);
        self.rendered.push((name.clone(), value));
    }

    fn put_numbers(&mut self, numbers: XRateLimit) {
        self.numbers = Some(numbers);
    }
}

impl Fields {
    /// Put the fields on `headers`, each replacing one of its name.
    pub(crate) fn apply(self, headers: &mut HeaderMap) {
        if let Some(numbers) = self.numbers {
            numbers.render(headers);
        }
        for (name, value) in self.rendered {
            headers.insert(name, value);
        }
    }
}

/// Numbers below this have a ready header value.
const SMALL_NUMBERS: usize = 1024;

/// The decimal digits of 0, 1, ... `SMALL_NUMBERS - 1`, one after another.
static SMALL_DIGITS: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| (0..SMALL_NUMBERS).map(|n| n.to_string()).collect());

/// Header values of the small numbers, pointing into [`SMALL_DIGITS`]: a
/// clone copies a pointer, where `HeaderValue::from(u64)` allocates twice.
static SMALL_VALUES: std::sync::LazyLock<Vec<HeaderValue>> = std::sync::LazyLock::new(|| {
    let digits: &'static str = &SMALL_DIGITS;
    let mut start = 0;
    (0..SMALL_NUMBERS)
        .map(|n| {
            let end = start + if n == 0 { 1 } else { n.ilog10() as usize + 1 };
            let value = HeaderValue::from_static(&digits[start..end]);
            start = end;
            value
        })
        .collect()
});

/// `n` as a header value: a shared one for small numbers, else one
/// allocation.
pub(crate) fn number(n: u64) -> HeaderValue {
    if let Some(value) = usize::try_from(n).ok().and_then(|i| SMALL_VALUES.get(i)) {
        return value.clone();
    }
    let mut buffer = itoa::Buffer::new();
    // Digits are always a valid header value; the fallback cannot be taken.
    HeaderValue::from_bytes(buffer.format(n).as_bytes()).unwrap_or_else(|_| HeaderValue::from(n))
}

/// A structured-field Integer; values beyond its range (15 digits, above
/// any window or count this crate reports in practice) are capped.
fn sf_integer(n: u64) -> Integer {
    Integer::try_from(n).unwrap_or(Integer::MAX)
}

/// The name of a rate in the IETF fields and in `violated-policies`: its
/// text form, `"3/s"`, `"20/min"` (unique within a policy: windows are), or
/// `"concurrency"` for a concurrency limit, whose window is only a lease time.
pub(super) fn rate_name(algorithm: Algorithm, rate: Rate) -> String {
    if algorithm == Algorithm::Concurrency {
        "concurrency".to_owned()
    } else {
        rate.to_string()
    }
}

/// The name of `rate`, a rate enforced for `named` (itself, or the
/// fallback's share of it, with the same window and a smaller max): the name
/// of `named`'s rate of that window, so a policy keeps its name whichever
/// store decides.
pub(super) fn policy_name(named: &Policy, algorithm: Algorithm, rate: Rate) -> String {
    let rate = named
        .rates()
        .iter()
        .copied()
        .find(|r| r.window() == rate.window())
        .unwrap_or(rate);
    rate_name(algorithm, rate)
}

/// Whether this rate is one that keeps the request out.
pub(super) fn denies(decision: &Decision, status: &RateStatus) -> bool {
    !decision.allowed() && !status.wait().is_zero()
}

/// `t` of one rate: for a rate that denies the request, the seconds until it
/// admits it (rounded up, so never later than `Retry-After`); otherwise the
/// seconds until its quota is full again.
fn ietf_reset_secs(decision: &Decision, status: &RateStatus) -> u64 {
    if denies(decision, status) {
        ceil_secs(status.wait())
    } else {
        ceil_secs(status.reset())
    }
}

/// The value of `RateLimit-Policy`: the quotas of `enforced`, under the
/// names of `named`; `None` only for a policy without rates or a name that is
/// not a structured-field String (neither can happen).
fn ratelimit_policy_value(
    named: &Policy,
    enforced: &Policy,
    algorithm: Algorithm,
) -> Option<String> {
    let mut list = ListSerializer::new();
    for &rate in enforced.rates() {
        let name = policy_name(named, algorithm, rate);
        let extent: (&KeyRef, RefBareItem<'_>) = if algorithm == Algorithm::Concurrency {
            // A concurrency limit has no window: the rate's window is only
            // the lease after which a crashed process's slot frees itself.
            (QU, CONCURRENT_REQUESTS.into())
        } else {
            // A calendar rate's window varies (a month of 28 to 31 days,
            // a day of 23 to 25 hours): its usual length.
            let window = rate.calendar().map_or(rate.window(), |c| c.usual());
            (W, sf_integer(ceil_secs(window).max(1)).into())
        };
        // The serializer writes into `list`; what it returns only chains.
        let _ = list
            .bare_item(StringRef::from_str(&name).ok()?)
            .parameter(Q, sf_integer(rate.max()))
            .parameters([extent]);
    }
    list.finish()
}

/// The value of `RateLimit`, under the names of `named`; `None` as for
/// [`ratelimit_policy_value`].
fn ratelimit_value(named: &Policy, decision: &Decision) -> Option<String> {
    let mut list = ListSerializer::new();
    for status in decision.rates() {
        let name = policy_name(named, decision.algorithm(), status.rate());
        // No `t` for a concurrency limit: a slot frees when a request ends,
        // not at a time the limiter knows.
        let t = (decision.algorithm() != Algorithm::Concurrency)
            .then(|| (T, sf_integer(ietf_reset_secs(decision, status))));
        let _ = list
            .bare_item(StringRef::from_str(&name).ok()?)
            .parameter(R, sf_integer(status.remaining()))
            .parameters(t);
    }
    list.finish()
}

/// Set `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11)
/// for `decision`, taken under `enforced` (the layer's policy `named`, or
/// the fallback's share of it): one list member per rate, in the policy's
/// order, named after `named`'s rates, with the quotas of `enforced`,
/// serialised as RFC 9651 structured fields.
pub(crate) fn set_ietf_headers(
    headers: &mut impl Sink,
    named: &Policy,
    enforced: &Policy,
    decision: &Decision,
) {
    let fields = [
        (
            &RATELIMIT_POLICY,
            ratelimit_policy_value(named, enforced, decision.algorithm()),
        ),
        (&RATELIMIT, ratelimit_value(named, decision)),
    ];
    for (name, value) in fields {
        if let Some(value) = value.and_then(|v| HeaderValue::try_from(v).ok()) {
            headers.put(name, value);
        }
    }
}

/// `args` as bytes in one allocation of their exact size: written to the
/// stack first (`format!` then `Bytes::from` takes two allocations, as a
/// `String`'s spare capacity makes `Bytes` box a header).
pub(super) fn format_bytes(args: std::fmt::Arguments<'_>) -> Bytes {
    struct Stack {
        buf: [u8; 192],
        len: usize,
    }
    impl std::fmt::Write for Stack {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let end = self.len + s.len();
            let dst = self.buf.get_mut(self.len..end).ok_or(std::fmt::Error)?;
            dst.copy_from_slice(s.as_bytes());
            self.len = end;
            Ok(())
        }
    }
    let mut stack = Stack {
        buf: [0; 192],
        len: 0,
    };
    match std::fmt::write(&mut stack, args) {
        Ok(()) => Bytes::copy_from_slice(&stack.buf[..stack.len]),
        // Longer than the buffer.
        Err(_) => Bytes::from(std::fmt::format(args)),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::decision::{DecisionBuilder, Micros};
    pub(crate) fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn numbers_are_their_decimal_digits() {
        for n in (0..2100).chain([9_999, 10_000, 1_000_000, u64::MAX]) {
            assert_eq!(number(n).to_str().unwrap(), n.to_string(), "{n}");
        }
    }

    /// The state of `rate` ("3/s") for one request.
    pub(crate) fn status(
        rate: &str,
        remaining: u64,
        reset: Duration,
        wait: Duration,
    ) -> RateStatus {
        RateStatus {
            rate: rate.parse().unwrap(),
            remaining,
            reset: Micros::of(reset),
            wait: Micros::of(wait),
        }
    }

    pub(crate) fn decision(allowed: bool, algorithm: Algorithm, rates: &[RateStatus]) -> Decision {
        let mut b = DecisionBuilder::new(allowed).algorithm(algorithm);
        for &s in rates {
            b.rate(s);
        }
        b.build().unwrap()
    }

    pub(crate) fn header<'a>(headers: &'a HeaderMap, name: &HeaderName) -> &'a str {
        headers.get(name).unwrap().to_str().unwrap()
    }

    pub(crate) fn ietf(policy: &Policy, decision: &Decision) -> (String, String) {
        let mut headers = HeaderMap::new();
        set_ietf_headers(&mut headers, policy, policy, decision);
        (
            header(&headers, &RATELIMIT_POLICY).to_owned(),
            header(&headers, &RATELIMIT).to_owned(),
        )
    }

    #[test]
    fn ietf_fields_of_the_design_example() {
        let policy: Policy = "3/s, 20/min".parse().unwrap();
        let d = decision(
            true,
            Algorithm::SlidingLog,
            &[
                status("3/s", 2, ms(1000), Duration::ZERO),
                status("20/min", 19, ms(59_200), Duration::ZERO),
            ],
        );
        let (policy_field, ratelimit) = ietf(&policy, &d);
        assert_eq!(policy_field, r#""3/s";q=3;w=1, "20/min";q=20;w=60"#);
        assert_eq!(ratelimit, r#""3/s";r=2;t=1, "20/min";r=19;t=60"#);
    }

    /// A calendar rate's `w` is its period's usual length; `t` is the
    /// real time to its boundary.
    #[test]
    fn calendar_windows_show_their_usual_length() {
        let policy: Policy = "100/min, 500/day in Europe/Paris".parse().unwrap();
        let d = decision(
            true,
            Algorithm::FixedWindow,
            &[
                status("100/min", 99, ms(30_000), Duration::ZERO),
                status(
                    "500/day in Europe/Paris",
                    499,
                    ms(3_600_000),
                    Duration::ZERO,
                ),
            ],
        );
        let (policy_field, ratelimit) = ietf(&policy, &d);
        assert_eq!(
            policy_field,
            r#""100/min";q=100;w=60, "500/day in Europe/Paris";q=500;w=86400"#
        );
        assert_eq!(
            ratelimit,
            r#""100/min";r=99;t=30, "500/day in Europe/Paris";r=499;t=3600"#
        );
        let (policy_field, _) = ietf(
            &"7/week, 9/month".parse().unwrap(),
            &decision(
                true,
                Algorithm::FixedWindow,
                &[
                    status("7/week", 6, ms(1_000), Duration::ZERO),
                    status("9/month", 8, ms(1_000), Duration::ZERO),
                ],
            ),
        );
        assert_eq!(
            policy_field,
            r#""7/week";q=7;w=604800, "9/month";q=9;w=2592000"#
        );
    }

    #[test]
    fn windows_round_up_to_whole_seconds_and_at_least_one() {
        let policy: Policy = "1/250ms, 2/1500ms, 100/15m, 5/d".parse().unwrap();
        let d = decision(
            true,
            Algorithm::Gcra,
            &[
                status("1/250ms", 0, ms(250), Duration::ZERO),
                status("2/1500ms", 1, ms(750), Duration::ZERO),
                status("100/15m", 99, ms(9_000), Duration::ZERO),
                status("5/d", 4, Duration::ZERO, Duration::ZERO),
            ],
        );
        let (policy_field, ratelimit) = ietf(&policy, &d);
        assert_eq!(
            policy_field,
            r#""1/250ms";q=1;w=1, "2/1500ms";q=2;w=2, "100/15m";q=100;w=900, "5/d";q=5;w=86400"#
        );
        assert_eq!(
            ratelimit,
            r#""1/250ms";r=0;t=1, "2/1500ms";r=1;t=1, "100/15m";r=99;t=9, "5/d";r=4;t=0"#
        );
    }

    /// "3/s, 20/min, 100/h" denied by its first two rates.
    pub(crate) fn two_rates_deny() -> (Policy, Decision) {
        let policy: Policy = "3/s, 20/min, 100/h".parse().unwrap();
        let d = decision(
            false,
            Algorithm::SlidingLog,
            &[
                // Full, but admits again in 0.4 s although it resets in 0.9 s.
                status("3/s", 0, ms(900), ms(400)),
                // Full: admits again in 30.2 s, resets in 59.5 s.
                status("20/min", 0, ms(59_500), ms(30_200)),
                // Admits this request: its reset is reported.
                status("100/h", 50, ms(3_000_500), Duration::ZERO),
            ],
        );
        (policy, d)
    }

    #[test]
    fn an_admitted_request_reports_resets_even_if_a_wait_was_recorded() {
        // Waits only count for denied requests, as in DecisionBuilder.
        let policy: Policy = "3/s".parse().unwrap();
        let d = decision(
            true,
            Algorithm::FixedWindow,
            &[status("3/s", 0, ms(800), ms(300))],
        );
        assert_eq!(ietf(&policy, &d).1, r#""3/s";r=0;t=1"#);
    }

    #[test]
    fn concurrency_has_a_unit_and_no_window_or_reset() {
        let policy = Policy::concurrency(10).unwrap();
        let admitted = decision(
            true,
            Algorithm::Concurrency,
            &[status("10/min", 9, Duration::ZERO, Duration::ZERO)],
        );
        let (policy_field, ratelimit) = ietf(&policy, &admitted);
        assert_eq!(
            policy_field,
            r#""concurrency";q=10;qu="concurrent-requests""#
        );
        assert_eq!(ratelimit, r#""concurrency";r=9"#);

        let denied = decision(
            false,
            Algorithm::Concurrency,
            &[status("10/min", 0, Duration::ZERO, ms(250))],
        );
        assert_eq!(ietf(&policy, &denied).1, r#""concurrency";r=0"#);
    }

    #[test]
    fn integers_beyond_the_structured_field_range_are_capped() {
        let max = crate::policy::MAX_MAX;
        let policy = Policy::new([Rate::new(max, Duration::from_secs(1)).unwrap()]).unwrap();
        let d = decision(
            true,
            Algorithm::Gcra,
            &[RateStatus {
                rate: policy.rates()[0],
                remaining: max - 1,
                reset: Micros(1_000),
                wait: Micros::ZERO,
            }],
        );
        let (policy_field, ratelimit) = ietf(&policy, &d);
        let name = format!("{max}/s");
        assert_eq!(policy_field, format!(r#""{name}";q=999999999999999;w=1"#));
        assert_eq!(ratelimit, format!(r#""{name}";r=999999999999999;t=1"#));
    }

    #[test]
    fn ietf_headers_replace_earlier_values() {
        let policy: Policy = "3/s".parse().unwrap();
        let d = decision(
            true,
            Algorithm::SlidingLog,
            &[status("3/s", 2, ms(1000), Duration::ZERO)],
        );
        let mut headers = HeaderMap::new();
        headers.insert(RATELIMIT.clone(), HeaderValue::from_static("stale"));
        set_ietf_headers(&mut headers, &policy, &policy, &d);
        assert_eq!(headers.get_all(&RATELIMIT).iter().count(), 1);
        assert_eq!(header(&headers, &RATELIMIT), r#""3/s";r=2;t=1"#);
    }

    #[test]
    fn bodies_are_formatted_whole_at_any_length() {
        assert_eq!(
            &format_bytes(format_args!("retry in {} s", 7))[..],
            b"retry in 7 s"
        );
        let long = "x".repeat(500);
        assert_eq!(
            &format_bytes(format_args!("{long}/{}", 3))[..],
            format!("{long}/3").as_bytes(),
            "past the stack buffer"
        );
    }
}
