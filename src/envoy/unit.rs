//! The time units of Envoy's rate limit protocol, as the crate's
//! policies: what a reference-server limit or a descriptor's own `limit`
//! means, and how a rate is shown back in a descriptor's status.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use crate::policy::{Period, Policy, PolicyError, Rate};
use crate::rules::window_of_unit;

/// The fixed-window policy of `requests` per `unit`, as a
/// reference-server limit of that unit counts them.
pub(crate) fn policy(requests: u32, unit: Unit) -> Result<Policy, String> {
    let window = window_of_unit(unit.as_str_name())
        .ok_or_else(|| format!("unit {} is not a unit of time", unit.as_str_name()))?;
    format!("{requests}/{window}")
        .parse::<Policy>()
        .and_then(Policy::fixed_window)
        .map_err(|e: PolicyError| e.to_string())
}

/// The unit a rate's window is, when it is one (`Unknown` otherwise: a
/// status then says the max, and no unit).
pub(crate) fn of_rate(rate: &Rate) -> Unit {
    if let Some(calendar) = rate.calendar() {
        return match calendar.period() {
            Period::Day => Unit::Day,
            Period::Week => Unit::Week,
            Period::Month => Unit::Month,
        };
    }
    let window: Duration = rate.window();
    match window.as_secs() {
        _ if window.subsec_nanos() != 0 => Unit::Unknown,
        1 => Unit::Second,
        60 => Unit::Minute,
        3_600 => Unit::Hour,
        86_400 => Unit::Day,
        604_800 => Unit::Week,
        31_536_000 => Unit::Year,
        _ => Unit::Unknown,
    }
}

/// The time until the fixed window of `rate` holding now ends, by this
/// process's clock (as the reference server tells a limit's reset).
pub(crate) fn reset(rate: &Rate) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    Duration::from_micros(rate.window_end(now).saturating_sub(now))
}
