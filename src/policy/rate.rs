//! [`Rate`]: at most `max` requests per `window`, and how a rate and a
//! window are written as text (`"20/min"`, `"250ms"`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{MAX_MAX, MAX_WINDOW, MIN_WINDOW, PolicyError};

/// At most `max` requests per `window`.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Rate;
///
/// let rate = Rate::new(20, Duration::from_secs(60))?;
/// assert_eq!(rate.to_string(), "20/min");
/// assert_eq!("20/min".parse::<Rate>()?, rate);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    pub(super) max: u64,
    pub(super) window: Duration,
}

impl Rate {
    /// `max` requests per `window`.
    ///
    /// # Errors
    /// A zero `max` or one above [`MAX_MAX`], or a window shorter than
    /// [`MIN_WINDOW`] or longer than [`MAX_WINDOW`].
    pub fn new(max: u64, window: Duration) -> Result<Self, PolicyError> {
        if max == 0 {
            return Err(PolicyError::ZeroMax {
                rate: format!("{max}/{}", Window(window)),
            });
        }
        if max > MAX_MAX {
            return Err(PolicyError::MaxTooLarge { max });
        }
        if window.is_zero() {
            return Err(PolicyError::ZeroWindow {
                rate: format!("{max}/0s"),
            });
        }
        if window < MIN_WINDOW || window > MAX_WINDOW {
            return Err(PolicyError::WindowOutOfRange { window });
        }
        Ok(Self { max, window })
    }

    /// `max` requests per second.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_second(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(1))
    }

    /// `max` requests per minute.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_minute(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(60))
    }

    /// `max` requests per hour.
    ///
    /// # Errors
    /// A zero `max`.
    pub fn per_hour(max: u64) -> Result<Self, PolicyError> {
        Self::new(max, Duration::from_secs(3600))
    }

    /// The most requests admitted in any window.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The length of the window.
    pub fn window(&self) -> Duration {
        self.window
    }

    pub(crate) fn window_micros(&self) -> u64 {
        duration_micros(self.window)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.max, Window(self.window))
    }
}

impl FromStr for Rate {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_rate(s)
    }
}

pub(super) fn parse_rate(input: &str) -> Result<Rate, PolicyError> {
    let text = input.trim();
    let invalid = |reason: &str| PolicyError::Invalid {
        input: text.to_owned(),
        reason: reason.to_owned(),
    };
    if text.is_empty() {
        return Err(invalid(
            "empty rate (a stray comma?); write rates as \"10/s\"",
        ));
    }
    let (max, per) = text
        .split_once('/')
        .ok_or_else(|| invalid("expected <max>/<window>, such as \"10/s\" or \"100/15m\""))?;
    let max = max.trim();
    if max.is_empty() || !max.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("the max must be a whole number, such as \"10/s\""));
    }
    let max: u64 = max.parse().map_err(|_| invalid("the max is too large"))?;
    let window = parse_window(per.trim(), text)?;
    if max == 0 {
        return Err(PolicyError::ZeroMax {
            rate: text.to_owned(),
        });
    }
    Rate::new(max, window)
}

/// A window as a rate writes it (`s`, `15m`, `250ms`, `1d`: an optional
/// count, 1 by default, and a unit), for the rate or duration `input`
/// (named in errors).
fn parse_window(per: &str, input: &str) -> Result<Duration, PolicyError> {
    let invalid = |reason: &str| PolicyError::Invalid {
        input: input.to_owned(),
        reason: reason.to_owned(),
    };
    let digits = per.bytes().take_while(u8::is_ascii_digit).count();
    let (count, unit) = per.split_at(digits);
    let count: u64 = if count.is_empty() {
        1
    } else {
        count
            .parse()
            .map_err(|_| invalid("the window count is too large"))?
    };
    let unit_micros: u64 = match unit.trim() {
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" | "min" => 60_000_000,
        "h" => 3_600_000_000,
        "d" => 86_400_000_000,
        "" => {
            return Err(invalid(
                "the window needs a unit: ms, s, m (or min), h or d",
            ));
        }
        other => {
            return Err(PolicyError::UnknownUnit {
                unit: other.to_owned(),
                input: input.to_owned(),
            });
        }
    };
    if count == 0 {
        return Err(PolicyError::ZeroWindow {
            rate: input.to_owned(),
        });
    }
    let micros = count
        .checked_mul(unit_micros)
        .ok_or_else(|| invalid("the window is too long"))?;
    Ok(Duration::from_micros(micros))
}

/// A duration written as a rate's window (`"30s"`, `"15m"`, `"1d"`).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, PolicyError> {
    let text = text.trim();
    parse_window(text, text)
}

/// `1s` → `"s"`, `15 min` → `"15m"`, `1500ms` → `"1500ms"`; written
/// straight to the formatter (a 429's text names the rate on every denial).
struct Window(Duration);

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u128, &str); 5] = [
            (86_400_000_000, "d"),
            (3_600_000_000, "h"),
            (60_000_000, "min"),
            (1_000_000, "s"),
            (1_000, "ms"),
        ];
        let micros = self.0.as_micros();
        for (size, name) in UNITS {
            if micros >= size && micros.is_multiple_of(size) {
                let n = micros / size;
                return match (n, name) {
                    (1, _) => f.write_str(name),
                    (_, "min") => write!(f, "{n}m"),
                    _ => write!(f, "{n}{name}"),
                };
            }
        }
        write!(f, "{micros}us")
    }
}

/// A duration as a rate's window is written, with its count even when it
/// is 1 (`1s`, `10s`, `250ms`, `15m`, `1500us`): exact to the microsecond,
/// as stores count.
pub(crate) fn duration_text(d: Duration) -> String {
    let text = Window(d).to_string();
    if text.starts_with(|c: char| c.is_ascii_digit()) {
        text
    } else {
        format!("1{text}")
    }
}

pub(crate) fn duration_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
