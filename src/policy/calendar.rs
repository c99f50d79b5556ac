//! [`Calendar`]: windows that follow the calendar (a day, a week, a month
//! of a time zone, from an anchor), how they are written (`"month in
//! Europe/Paris from 15"`) and where their boundaries fall.

use std::cell::Cell;
use std::fmt;
use std::time::Duration;

use jiff::Timestamp;
use jiff::civil::{Date, Time};

use super::PolicyError;
use super::zone::Zone;

/// The period of a calendar rate: the length of its windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Period {
    /// From one local midnight to the next (23 or 25 hours across a
    /// daylight-saving change).
    Day,
    /// Seven days, from local midnight of the anchor's weekday (Monday by
    /// default).
    Week,
    /// From the anchor's day of one month (the 1st by default) to the same
    /// day of the next, at local midnight; a month shorter than the anchor
    /// starts its period on its last day.
    Month,
}

impl Period {
    /// `day`, `week` or `month`, as a rate writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
        }
    }

    /// The longest a period can last: a month of 31 days, a week of 7 days
    /// and a day, each with an hour more for a daylight-saving change.
    fn longest(self) -> Duration {
        const HOUR: u64 = 3600;
        Duration::from_secs(match self {
            Self::Day => 25 * HOUR,
            Self::Week => 7 * 24 * HOUR + HOUR,
            Self::Month => 31 * 24 * HOUR + HOUR,
        })
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A day of the week: where a weekly period starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Weekday {
    /// Monday, the default.
    Monday,
    /// Tuesday.
    Tuesday,
    /// Wednesday.
    Wednesday,
    /// Thursday.
    Thursday,
    /// Friday.
    Friday,
    /// Saturday.
    Saturday,
    /// Sunday.
    Sunday,
}

impl Weekday {
    const ALL: [Weekday; 7] = [
        Self::Monday,
        Self::Tuesday,
        Self::Wednesday,
        Self::Thursday,
        Self::Friday,
        Self::Saturday,
        Self::Sunday,
    ];

    /// Days since Monday: 0 to 6.
    fn index(self) -> u8 {
        self as u8
    }

    /// `mon`, `tue`, ... as a rate writes it.
    pub fn name(self) -> &'static str {
        ["mon", "tue", "wed", "thu", "fri", "sat", "sun"][usize::from(self.index())]
    }

    /// `mon` or `monday`, any case.
    fn parse(text: &str) -> Option<Self> {
        let text = text.to_ascii_lowercase();
        Self::ALL.into_iter().find(|day| {
            let full = format!("{:?}", day).to_ascii_lowercase();
            text == day.name() || text == full
        })
    }
}

impl fmt::Display for Weekday {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the windows of a calendar rate fall: calendar days, weeks or
/// months of a time zone (UTC by default), starting on an anchor (a
/// month's day, the 1st by default; a week's day, Monday by default).
///
/// A calendar rate (`"1000000/month"`, [`Rate::on_calendar`](super::Rate::on_calendar))
/// counts in fixed windows from one boundary to the next: its reset and
/// `Retry-After` are the time to the real next boundary, whatever the month's
/// length or a daylight-saving change.
///
/// ```
/// use tower_redis_ratelimit::Rate;
/// use tower_redis_ratelimit::policy::{Calendar, Weekday};
///
/// // A billing month from the 15th, in Paris.
/// let billing = Calendar::month().in_zone("Europe/Paris")?.from_day(15)?;
/// assert_eq!(billing.to_string(), "month in Europe/Paris from 15");
/// let rate = Rate::on_calendar(1_000_000, billing)?;
/// assert_eq!(rate.to_string(), "1000000/month in Europe/Paris from 15");
/// // Weeks from Wednesday, in UTC.
/// let weeks = Calendar::week().from_weekday(Weekday::Wednesday)?;
/// assert_eq!(Rate::on_calendar(10_000, weeks)?, "10000/week from wed".parse()?);
/// # Ok::<(), tower_redis_ratelimit::PolicyError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Calendar {
    period: Period,
    /// A month's day (1..=31), a week's day (0 for Monday..=6), 0 for a
    /// day.
    anchor: u8,
    zone: Zone,
}

/// The bit that tells a calendar's [`Calendar::slot`] from a window in µs
/// (windows are at most ten years: below 2^49 µs).
const CALENDAR_SLOT: u64 = 1 << 63;

impl Calendar {
    /// Calendar days in UTC.
    pub const fn day() -> Self {
        Self::of(Period::Day, 0)
    }

    /// Calendar weeks in UTC, from Monday.
    pub const fn week() -> Self {
        Self::of(Period::Week, 0)
    }

    /// Calendar months in UTC, from the 1st.
    pub const fn month() -> Self {
        Self::of(Period::Month, 1)
    }

    const fn of(period: Period, anchor: u8) -> Self {
        Self {
            period,
            anchor,
            zone: Zone::UTC,
        }
    }

    /// The same periods in the time zone `zone`: an IANA name
    /// (`Europe/Paris`, `America/New_York`; the tz database is built into
    /// the crate), `UTC`, or a fixed offset from UTC (`+05:30`, `-08:00`,
    /// `+05`, `+05:30:15`).
    ///
    /// # Errors
    /// A zone that is neither ([`PolicyError::UnknownZone`]), or more than
    /// 1024 distinct zones in one process ([`PolicyError::TooManyZones`]).
    pub fn in_zone(mut self, zone: &str) -> Result<Self, PolicyError> {
        let zone = zone.trim();
        self.zone = Zone::parse(zone, zone)?;
        Ok(self)
    }

    /// Months from day `day` (1..=31): a billing period from the 15th is
    /// `Calendar::month().from_day(15)`. A month shorter than `day` starts
    /// its period on its last day (from the 31st: Jan 31, Feb 28 or 29,
    /// Mar 31, Apr 30).
    ///
    /// # Errors
    /// A day outside 1..=31, or a calendar of other than months.
    pub fn from_day(mut self, day: u8) -> Result<Self, PolicyError> {
        if self.period != Period::Month {
            return Err(self.bad_anchor(&day.to_string()));
        }
        if !(1..=31).contains(&day) {
            return Err(self.bad_anchor(&day.to_string()));
        }
        self.anchor = day;
        Ok(self)
    }

    /// Weeks from `weekday` (Monday by default).
    ///
    /// # Errors
    /// A calendar of other than weeks.
    pub fn from_weekday(mut self, weekday: Weekday) -> Result<Self, PolicyError> {
        if self.period != Period::Week {
            return Err(self.bad_anchor(weekday.name()));
        }
        self.anchor = weekday.index();
        Ok(self)
    }

    /// Why `anchor` is not one of this calendar's.
    fn bad_anchor(&self, anchor: &str) -> PolicyError {
        PolicyError::InvalidAnchor {
            anchor: anchor.to_owned(),
            period: self.period,
            reason: match self.period {
                Period::Day => "a calendar day starts at midnight and takes no anchor",
                Period::Week => "a week starts on a weekday: mon, tue, wed, thu, fri, sat or sun",
                Period::Month => "a month starts on a day from 1 to 31",
            },
        }
    }

    /// The length of the windows.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The time zone's name: `UTC`, an IANA name (`Europe/Paris`) or a
    /// fixed offset (`+05:30`).
    pub fn zone(&self) -> &'static str {
        self.zone.name()
    }

    /// The day of the month a monthly period starts on (1..=31); `None`
    /// for days and weeks.
    pub fn anchor_day(&self) -> Option<u8> {
        (self.period == Period::Month).then_some(self.anchor)
    }

    /// The day a weekly period starts on; `None` for days and months.
    pub fn anchor_weekday(&self) -> Option<Weekday> {
        (self.period == Period::Week).then(|| Weekday::ALL[usize::from(self.anchor % 7)])
    }

    /// The longest a window can last (the [`Rate::window`](super::Rate::window)
    /// of a calendar rate): 25 hours for a day, 7 days and an hour for a
    /// week, 31 days and an hour for a month.
    pub fn longest(&self) -> Duration {
        self.period.longest()
    }

    /// The usual length of a window: 24 hours, 7 days, or 30 days for a
    /// month (what `RateLimit-Policy`'s `w` shows: a window's real length
    /// varies, its reset is exact).
    pub(crate) fn usual(&self) -> Duration {
        const DAY: u64 = 86_400;
        Duration::from_secs(match self.period {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 30 * DAY,
        })
    }

    /// `month in Europe/Paris from 15` read back, for the rate `input`
    /// (named in errors): a period, then optionally ` in <zone>` and
    /// ` from <anchor>`, in either order.
    pub(super) fn parse(text: &str, input: &str) -> Result<Self, PolicyError> {
        let invalid = |reason: &str| PolicyError::Invalid {
            input: input.to_owned(),
            reason: reason.to_owned(),
        };
        let mut words = text.split_whitespace();
        let mut calendar = match words.next().map(str::to_ascii_lowercase).as_deref() {
            Some("day") => Self::day(),
            Some("week") => Self::week(),
            Some("month") => Self::month(),
            _ => return Err(invalid("expected a calendar period: day, week or month")),
        };
        let (mut zone, mut anchor) = (None, None);
        while let Some(word) = words.next() {
            let slot = match word.to_ascii_lowercase().as_str() {
                "in" => &mut zone,
                "from" => &mut anchor,
                _ => {
                    return Err(invalid(&format!(
                        "unexpected {word:?}: write <max>/<day|week|month>[ in <zone>][ from <anchor>]"
                    )));
                }
            };
            if slot.is_some() {
                return Err(invalid(&format!("{word:?} is written twice")));
            }
            let value = words
                .next()
                .ok_or_else(|| invalid(&format!("{word:?} needs a value")))?;
            *slot = Some(value);
        }
        if let Some(zone) = zone {
            calendar.zone = Zone::parse(zone, input)?;
        }
        if let Some(anchor) = anchor {
            calendar = match calendar.period {
                Period::Day => return Err(calendar.bad_anchor(anchor)),
                Period::Week => match Weekday::parse(anchor) {
                    Some(day) => calendar.from_weekday(day)?,
                    None => return Err(calendar.bad_anchor(anchor)),
                },
                Period::Month => match anchor.parse::<u8>() {
                    Ok(day) if anchor.bytes().all(|b| b.is_ascii_digit()) => {
                        calendar.from_day(day)?
                    }
                    _ => return Err(calendar.bad_anchor(anchor)),
                },
            };
        }
        Ok(calendar)
    }

    /// The name of this calendar's counter in Redis:
    /// `day:UTC`, `week:Europe/Paris:wed`, `month:+05:30:15` (never a
    /// number, so never a rolling window's).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn field(&self) -> String {
        match self.period {
            Period::Day => format!("day:{}", self.zone.name()),
            Period::Week => format!(
                "week:{}:{}",
                self.zone.name(),
                Weekday::ALL[usize::from(self.anchor % 7)]
            ),
            Period::Month => format!("month:{}:{}", self.zone.name(), self.anchor),
        }
    }

    /// The calendar as one integer, unique per calendar in this process
    /// and never a window in µs (its top bit is set): what a window
    /// counter is found by.
    pub(crate) fn slot(&self) -> u64 {
        CALENDAR_SLOT | u64::from(self.bits())
    }

    /// The calendar whose [`field`](Self::field) is `field` (a state read
    /// back from bytes, where a slot's zone id would be this process's
    /// own); `None` for any other text.
    pub(crate) fn from_field(field: &str) -> Option<Self> {
        let (period, rest) = field.split_once(':')?;
        let (period, zone, anchor) = match period {
            "day" => (Period::Day, rest, 0),
            "week" => {
                let (zone, day) = rest.rsplit_once(':')?;
                (Period::Week, zone, Weekday::parse(day)?.index())
            }
            "month" => {
                let (zone, day) = rest.rsplit_once(':')?;
                let day = day.parse().ok().filter(|d| (1..=31).contains(d))?;
                (Period::Month, zone, day)
            }
            _ => return None,
        };
        let zone = Zone::parse(zone, field).ok()?;
        Some(Self {
            period,
            anchor,
            zone,
        })
    }

    /// The calendar of a [`slot`](Self::slot); `None` for a window in µs.
    pub(crate) fn from_slot(slot: u64) -> Option<Self> {
        if slot & CALENDAR_SLOT == 0 {
            return None;
        }
        let bits = slot as u32;
        let period = match bits >> 24 {
            0 => Period::Day,
            1 => Period::Week,
            _ => Period::Month,
        };
        Some(Self {
            period,
            anchor: (bits >> 16) as u8,
            zone: Zone::from_id(bits as u16),
        })
    }

    fn bits(&self) -> u32 {
        let period = match self.period {
            Period::Day => 0,
            Period::Week => 1,
            Period::Month => 2,
        };
        (period << 24) | (u32::from(self.anchor) << 16) | u32::from(self.zone.id())
    }

    /// The window holding `now` (µs since the epoch): its start and its end
    /// (the next boundary), µs since the epoch.
    ///
    /// Most calls read a per-thread cache of each calendar's current
    /// window; jiff computes the boundaries once per window.
    #[inline]
    pub(crate) fn window_at(&self, now: u64) -> (u64, u64) {
        let [_, start, end, _] = self.boundaries(now);
        (start, end)
    }

    /// Four consecutive boundaries around `now`: the start of the window
    /// before `now`'s, the start and end of `now`'s, and the end of the one
    /// after. (A Redis script picks, among these, the window of Redis's own
    /// clock.) From the per-thread cache when `now`'s window is in it.
    #[inline]
    pub(crate) fn boundaries(&self, now: u64) -> [u64; 4] {
        let key = self.bits();
        let slot = (key.wrapping_mul(0x9E37_79B9) >> 29) as usize;
        WINDOWS.with(|cache| {
            let cached = cache[slot].get();
            let [_, start, end, _] = cached.bounds;
            if cached.key == key && start <= now && now < end {
                return cached.bounds;
            }
            let (start, end) = self.compute(now);
            let before = self.compute(start.saturating_sub(1)).0;
            let after = self.compute(end).1;
            let bounds = [before.min(start), start, end, after.max(end)];
            cache[slot].set(Cached { key, bounds });
            bounds
        })
    }

    /// [`window_at`](Self::window_at) through jiff. Outside jiff's range
    /// (before year -9999 or after 9999: a clock gone wrong), a window of
    /// the longest length from `now`, so nothing panics.
    fn compute(&self, now: u64) -> (u64, u64) {
        let fallback = || {
            let length = u64::try_from(self.longest().as_micros()).unwrap_or(u64::MAX);
            (now, now.saturating_add(length))
        };
        let Ok(micros) = i64::try_from(now) else {
            return fallback();
        };
        let Ok(instant) = Timestamp::from_microsecond(micros) else {
            return fallback();
        };
        let tz = self.zone.tz();
        let date = tz.to_datetime(instant).date();
        let dates = match self.period {
            Period::Day => date.tomorrow().ok().map(|next| (date, next)),
            Period::Week => {
                let back =
                    (date.weekday().to_monday_zero_offset() - self.anchor as i8).rem_euclid(7);
                let start = date.checked_sub(jiff::Span::new().days(back)).ok();
                start.and_then(|s| Some((s, s.checked_add(jiff::Span::new().days(7)).ok()?)))
            }
            Period::Month => self.month_dates(date),
        };
        let midnight = |d: Date| -> Option<u64> {
            // At a gap (a zone whose clocks skip midnight), the first
            // instant of the day; at a fold, the first of the two.
            let at = tz.to_timestamp(d.to_datetime(Time::midnight())).ok()?;
            Some(u64::try_from(at.as_microsecond()).unwrap_or(0))
        };
        match dates.and_then(|(s, e)| Some((midnight(s)?, midnight(e)?))) {
            Some((start, end)) if start <= now && now < end => (start, end),
            _ => fallback(),
        }
    }

    /// The first days of the monthly period holding `date` and of the next.
    fn month_dates(&self, date: Date) -> Option<(Date, Date)> {
        let anchored = |year: i16, month: i8| -> Option<Date> {
            let first = Date::new(year, month, 1).ok()?;
            let day = (self.anchor as i8).min(first.days_in_month());
            Date::new(year, month, day).ok()
        };
        let shift = |year: i16, month: i8, by: i8| -> (i16, i8) {
            let m = i32::from(month) - 1 + i32::from(by);
            (year + m.div_euclid(12) as i16, (m.rem_euclid(12) + 1) as i8)
        };
        let (year, month) = (date.year(), date.month());
        let this = anchored(year, month)?;
        if date >= this {
            let (y, m) = shift(year, month, 1);
            Some((this, anchored(y, m)?))
        } else {
            let (y, m) = shift(year, month, -1);
            Some((anchored(y, m)?, this))
        }
    }
}

/// One calendar's window as last computed on this thread.
#[derive(Clone, Copy)]
struct Cached {
    key: u32,
    /// [`Calendar::boundaries`] of the window.
    bounds: [u64; 4],
}

thread_local! {
    /// The current window of up to 8 calendars (direct-mapped by calendar)
    /// and its neighbours' ends: a check of a calendar rate calls jiff
    /// three times per window and thread.
    static WINDOWS: [Cell<Cached>; 8] = const {
        [const { Cell::new(Cached { key: u32::MAX, bounds: [0; 4] }) }; 8]
    };
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.period.name())?;
        if self.zone != Zone::UTC {
            write!(f, " in {}", self.zone.name())?;
        }
        match self.period {
            Period::Month if self.anchor != 1 => write!(f, " from {}", self.anchor),
            Period::Week if self.anchor != 0 => {
                write!(f, " from {}", Weekday::ALL[usize::from(self.anchor % 7)])
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Debug for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Calendar({self})")
    }
}

#[cfg(test)]
mod tests;
