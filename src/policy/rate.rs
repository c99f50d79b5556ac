//! [`Rate`]: at most `max` requests per `window` (rolling, or a window of
//! the calendar), and how a rate and a window are written as text
//! (`"20/min"`, `"250ms"`, `"1000000/month in Europe/Paris from 15"`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{Calendar, MAX_MAX, MAX_WINDOW, MIN_WINDOW, PolicyError};

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
///
/// # As text
///
/// `<max>/<window>`: a rolling window is an optional count and a unit, `ms`,
/// `s`, `m` (or `min`), `h` or `d` (`"20/min"`, `"100/15m"`, `"9/d"`: `d`
/// and `24h` are rolling 24 hours). A window of the calendar
/// ([`Calendar`]) is written
/// `<max>/<day|week|month>[ in <zone>][ from <anchor>]`:
///
/// - `"500/day"`, `"10000/week"`, `"1000000/month"`: calendar days, weeks
///   (from Monday) and months (from the 1st) in UTC;
/// - ` in <zone>`: an IANA time zone (`"500/day in America/New_York"`) or a
///   fixed offset from UTC (`"500/day in +05:30"`);
/// - ` from <anchor>`: the day a month starts on, 1 to 31 (`"1000000/month
///   from 15"`: a billing period from the 15th; a shorter month starts on
///   its last day), or the weekday a week starts on (`"10000/week from
///   wed"`). A day takes no anchor.
///
/// ```
/// use std::time::Duration;
/// use tower_redis_ratelimit::Rate;
/// use tower_redis_ratelimit::policy::Period;
///
/// let rate: Rate = "1000000/month in Europe/Paris from 15".parse()?;
/// let calendar = rate.calendar().unwrap();
/// assert_eq!(calendar.period(), Period::Month);
/// assert_eq!((calendar.zone(), calendar.anchor_day()), ("Europe/Paris", Some(15)));
/// assert_eq!(rate.to_string(), "1000000/month in Europe/Paris from 15");
/// // Rolling 24 hours, not a calendar day:
/// assert_eq!("500/d".parse::<Rate>()?.calendar(), None);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    pub(super) max: u64,
    /// The window in whole µs, as every decision reads it; for a calendar
    /// rate, the longest its window can last. (24 bytes in all: a rate is
    /// copied into every decision.)
    pub(super) micros: u64,
    /// The calendar a calendar rate's windows follow; `None` for a rolling
    /// window.
    pub(super) calendar: Option<Calendar>,
    /// The window's ns below a µs (a window given as a `Duration` of any
    /// precision is kept as given).
    pub(super) nanos: u16,
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
        Ok(Self::of(max, window, None))
    }

    /// `max` requests per window of `calendar`: a calendar day, week or
    /// month, in its time zone, from its anchor. Counted in fixed windows
    /// ([`Algorithm::FixedWindow`](super::Algorithm::FixedWindow)); its
    /// reset is the time to the next boundary.
    ///
    /// ```
    /// use tower_redis_ratelimit::Rate;
    /// use tower_redis_ratelimit::policy::Calendar;
    ///
    /// let rate = Rate::on_calendar(500, Calendar::day().in_zone("+05:30")?)?;
    /// assert_eq!(rate.to_string(), "500/day in +05:30");
    /// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A zero `max` or one above [`MAX_MAX`].
    pub fn on_calendar(max: u64, calendar: Calendar) -> Result<Self, PolicyError> {
        if max == 0 {
            return Err(PolicyError::ZeroMax {
                rate: format!("{max}/{calendar}"),
            });
        }
        if max > MAX_MAX {
            return Err(PolicyError::MaxTooLarge { max });
        }
        Ok(Self::of(max, calendar.longest(), Some(calendar)))
    }

    /// `max` requests per calendar day in UTC (`"500/day"`).
    ///
    /// # Errors
    /// A zero `max`.
    pub fn daily(max: u64) -> Result<Self, PolicyError> {
        Self::on_calendar(max, Calendar::day())
    }

    /// `max` requests per calendar week in UTC, from Monday (`"10000/week"`).
    ///
    /// # Errors
    /// A zero `max`.
    pub fn weekly(max: u64) -> Result<Self, PolicyError> {
        Self::on_calendar(max, Calendar::week())
    }

    /// `max` requests per calendar month in UTC, from the 1st
    /// (`"1000000/month"`).
    ///
    /// # Errors
    /// A zero `max`.
    pub fn monthly(max: u64) -> Result<Self, PolicyError> {
        Self::on_calendar(max, Calendar::month())
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

    /// The length of the window; for a calendar rate, the longest its
    /// window can last (see [`Calendar::longest`]).
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.micros) + Duration::from_nanos(u64::from(self.nanos))
    }

    /// The calendar whose days, weeks or months are this rate's windows;
    /// `None` for a rolling window.
    pub fn calendar(&self) -> Option<Calendar> {
        self.calendar
    }

    /// A rate of a window already checked (at most
    /// [`MAX_WINDOW`](crate::policy::MAX_WINDOW), whose µs fit a `u64`).
    pub(super) fn of(max: u64, window: Duration, calendar: Option<Calendar>) -> Self {
        Self {
            max,
            micros: duration_micros(window),
            calendar,
            // Below 1,000.
            nanos: (window.subsec_nanos() % 1_000) as u16,
        }
    }

    /// The window in whole µs (rounded down).
    #[inline]
    pub(crate) fn window_micros(&self) -> u64 {
        self.micros
    }

    /// When (µs since the epoch) the fixed window holding `now` ends: the
    /// next calendar boundary, or the next multiple of the window since
    /// the Unix epoch.
    #[cfg_attr(not(feature = "envoy"), allow(dead_code))]
    pub(crate) fn window_end(&self, now: u64) -> u64 {
        match self.calendar {
            Some(calendar) => calendar.window_at(now).1,
            None => (now / self.micros.max(1) + 1) * self.micros.max(1),
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.calendar {
            Some(calendar) => write!(f, "{}/{calendar}", self.max),
            None => write!(f, "{}/{}", self.max, Window(self.window())),
        }
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
    let per = per.trim();
    let calendar = per
        .starts_with(|c: char| c.is_ascii_alphabetic())
        .then(|| per.split_whitespace().next().unwrap_or_default())
        .filter(|word| CALENDAR_PERIODS.contains(&word.to_ascii_lowercase().as_str()));
    if calendar.is_some() {
        let calendar = Calendar::parse(per, text)?;
        if max == 0 {
            return Err(PolicyError::ZeroMax {
                rate: text.to_owned(),
            });
        }
        return Rate::on_calendar(max, calendar);
    }
    let window = parse_window(per, text)?;
    if max == 0 {
        return Err(PolicyError::ZeroMax {
            rate: text.to_owned(),
        });
    }
    Rate::new(max, window)
}

/// The words of a calendar rate's period (`"500/day"`).
const CALENDAR_PERIODS: [&str; 3] = ["day", "week", "month"];

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
    if digits > 0 && CALENDAR_PERIODS.contains(&unit.trim()) {
        return Err(invalid(
            "a calendar period takes no count: write \"N/day\", \"N/week\" or \"N/month\", \
             or a rolling window such as \"2d\"",
        ));
    }
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
