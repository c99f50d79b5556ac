//! The time zones of calendar rates, interned: a [`Calendar`](super::Calendar)
//! stays `Copy` by naming its zone with a small id into one registry per
//! process, bounded, filled as policies are parsed (never by requests).

use std::sync::{Mutex, OnceLock, PoisonError};

use jiff::tz::{Offset, TimeZone};

use super::PolicyError;

/// The most time zones a process registers: every IANA name (about 600,
/// aliases included) fits with room for fixed offsets.
pub(super) const MAX_ZONES: usize = 1024;

/// A time zone registered in this process: its index in [`ZONES`]; 0 is
/// UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct Zone(u16);

/// A registered zone: its name as written back (`Europe/Paris`, `+05:30`)
/// and the rules jiff computes with.
struct Entry {
    name: &'static str,
    tz: TimeZone,
}

/// Every registered zone but UTC, at its id; filled in order under
/// [`REGISTERING`], read without a lock.
static ZONES: [OnceLock<Entry>; MAX_ZONES] = [const { OnceLock::new() }; MAX_ZONES];

/// How many ids are taken (UTC's included); held while a zone registers.
static REGISTERING: Mutex<usize> = Mutex::new(1);

static UTC: TimeZone = TimeZone::UTC;

impl Zone {
    /// Coordinated Universal Time, the default.
    pub(super) const UTC: Zone = Zone(0);

    /// The zone written `text`: an IANA name (`Europe/Paris`, any case),
    /// `UTC`, or a fixed offset from UTC (`+05:30`, `-08:00`, `+05`,
    /// `+05:30:15`); an offset of zero is UTC.
    pub(super) fn parse(text: &str, input: &str) -> Result<Zone, PolicyError> {
        let unknown = |reason: &str| PolicyError::UnknownZone {
            zone: text.to_owned(),
            input: input.to_owned(),
            reason: reason.to_owned(),
        };
        if text.eq_ignore_ascii_case("utc") {
            return Ok(Zone::UTC);
        }
        let (name, tz) = if text.starts_with(['+', '-']) {
            let seconds = offset_seconds(text).ok_or_else(|| {
                unknown(
                    "write a fixed offset as +HH:MM (or +HH, +HH:MM:SS), from -18:00 to +18:00 \
                     (the offsets in civil use run from -12:00 to +14:00)",
                )
            })?;
            if seconds == 0 {
                return Ok(Zone::UTC);
            }
            let offset = Offset::from_seconds(seconds)
                .map_err(|_| unknown("the offset is out of range: at most 18:00"))?;
            (offset_text(seconds), TimeZone::fixed(offset))
        } else {
            let tz = TimeZone::get(text).map_err(|_| {
                unknown(
                    "use an IANA name such as Europe/Paris, UTC, or a fixed offset such as +05:30",
                )
            })?;
            let name = tz.iana_name().unwrap_or(text).to_owned();
            (name, tz)
        };
        if name == "UTC" {
            return Ok(Zone::UTC);
        }
        Self::register(name, tz)
    }

    /// The id of `name`, registering it (with `tz`) if it is new.
    fn register(name: String, tz: TimeZone) -> Result<Zone, PolicyError> {
        let mut taken = REGISTERING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(id) = (1..*taken).find(|&i| ZONES[i].get().is_some_and(|e| e.name == name)) {
            return Ok(Zone(id as u16));
        }
        if *taken >= MAX_ZONES {
            return Err(PolicyError::TooManyZones { max: MAX_ZONES });
        }
        let id = *taken;
        // Leaked once per zone, at most MAX_ZONES times a process: the
        // name lives as long as the policies that name it may.
        let name: &'static str = Box::leak(name.into_boxed_str());
        let _ = ZONES[id].set(Entry { name, tz });
        *taken += 1;
        Ok(Zone(id as u16))
    }

    /// The zone's name as a policy writes it (`UTC`, `Europe/Paris`, `+05:30`).
    pub(super) fn name(self) -> &'static str {
        ZONES[usize::from(self.0)].get().map_or("UTC", |e| e.name)
    }

    /// The zone's rules.
    pub(super) fn tz(self) -> &'static TimeZone {
        ZONES[usize::from(self.0)].get().map_or(&UTC, |e| &e.tz)
    }

    /// The id, for packing a calendar into an integer.
    pub(super) fn id(self) -> u16 {
        self.0
    }

    /// The zone of an id [`id`](Self::id) gave.
    pub(super) fn from_id(id: u16) -> Zone {
        Zone(id)
    }
}

/// `+HH[:MM[:SS]]` or `-...` in seconds east of UTC, at most 18 hours
/// either way (as java.time's `ZoneOffset`: every offset in civil use,
/// -12:00 to +14:00, with room; a day's boundary never needs more), minutes
/// and seconds at most 59.
fn offset_seconds(text: &str) -> Option<i32> {
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let mut parts = rest.split(':');
    let mut field = |max: i32, required: bool| -> Option<Option<i32>> {
        match parts.next() {
            None if !required => Some(None),
            None => None,
            Some(p) if p.len() == 2 && p.bytes().all(|b| b.is_ascii_digit()) => {
                let n: i32 = p.parse().ok()?;
                (n <= max).then_some(Some(n))
            }
            Some(_) => None,
        }
    };
    let hours = field(MAX_OFFSET_HOURS, true)??;
    let minutes = field(59, false)?;
    let seconds = match minutes {
        Some(_) => field(59, false)?,
        None => None,
    };
    if parts.next().is_some() {
        return None;
    }
    let seconds = hours * 3600 + minutes.unwrap_or(0) * 60 + seconds.unwrap_or(0);
    (seconds <= MAX_OFFSET_HOURS * 3600).then_some(sign * seconds)
}

/// The largest fixed offset, in hours either way.
const MAX_OFFSET_HOURS: i32 = 18;

/// An offset as a policy writes it: `+05:30`, `-08:00`, `+05:30:15`.
fn offset_text(seconds: i32) -> String {
    let sign = if seconds < 0 { '-' } else { '+' };
    let s = seconds.unsigned_abs();
    let (h, m, sec) = (s / 3600, s / 60 % 60, s % 60);
    if sec == 0 {
        format!("{sign}{h:02}:{m:02}")
    } else {
        format!("{sign}{h:02}:{m:02}:{sec:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_read_and_written() {
        assert_eq!(offset_seconds("+05:30"), Some(19_800));
        assert_eq!(offset_seconds("-08:00"), Some(-28_800));
        assert_eq!(offset_seconds("+05"), Some(18_000));
        assert_eq!(offset_seconds("+05:30:15"), Some(19_815));
        assert_eq!(offset_seconds("+18:00"), Some(64_800));
        assert_eq!(offset_seconds("-18:00"), Some(-64_800));
        for bad in [
            "+5",
            "+05:3",
            "+05:60",
            "+26:00",
            "+25:00",
            "-19:00",
            "+18:00:01",
            "-18:30",
            "+05:30:15:00",
            "+",
            "05:00",
            "+0a:00",
        ] {
            assert_eq!(offset_seconds(bad), None, "{bad}");
        }
        assert_eq!(offset_text(19_800), "+05:30");
        assert_eq!(offset_text(-28_800), "-08:00");
        assert_eq!(offset_text(19_815), "+05:30:15");
    }

    #[test]
    fn zones_are_interned_by_their_canonical_name() {
        let a = Zone::parse("Europe/Paris", "x").unwrap();
        let b = Zone::parse("europe/paris", "x").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.name(), "Europe/Paris");
        assert_eq!(Zone::parse("utc", "x").unwrap(), Zone::UTC);
        assert_eq!(Zone::parse("+00:00", "x").unwrap(), Zone::UTC);
        let plus = Zone::parse("+05:30", "x").unwrap();
        assert_eq!(plus.name(), "+05:30");
        assert_eq!(Zone::from_id(plus.id()), plus);
        let err = Zone::parse("Mars/Olympus_Mons", "1/day in Mars/Olympus_Mons").unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown time zone \"Mars/Olympus_Mons\""),
            "{err}"
        );
    }
}
