//! A [`KeyState`] as bytes and back: a small, versioned encoding, for a
//! store that keeps a key's state in a row, a document or a value.
//!
//! The layout is documented on [`KeyState::to_bytes`].

use smallvec::SmallVec;

use super::{Counted, KeyState, State};
use crate::algorithm::{concurrency, fixed_window, gcra, sliding_window};
use crate::decision::Lease;
use crate::policy::{Algorithm, Calendar};

/// No time a state holds is later (µs since the epoch, 2^53: the year
/// 2255); one that is would overflow the arithmetic on it.
const MAX_TIME: u64 = 1 << 53;

/// The version of the encoding [`KeyState::to_bytes`] writes, and the only
/// one [`KeyState::from_bytes`] reads.
pub const STATE_ENCODING_VERSION: u8 = 1;

/// Why bytes could not be read back as a [`KeyState`]
/// ([`KeyState::from_bytes`]). Never a state that would count wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// Written in another version of the encoding (by another version of
    /// this crate): drop the state or read it with that version.
    #[error(
        "key state encoded in version {found}; this build reads version {STATE_ENCODING_VERSION} only"
    )]
    Version {
        /// The version the bytes say they are in (0: no bytes at all).
        found: u8,
    },
    /// The bytes end before the state does, or go on after it.
    #[error("key state bytes are {0}")]
    Length(&'static str),
    /// A field holds what no state holds.
    #[error("key state bytes hold {0}")]
    Invalid(&'static str),
}

impl KeyState {
    /// The state as bytes, in the versioned encoding
    /// [`from_bytes`](Self::from_bytes) reads: for a store that keeps it in
    /// a row, a document or a value. A few dozen bytes per algorithm the
    /// key is counted under, plus 8 per sliding-log entry and 24 per held
    /// concurrency slot.
    ///
    /// Version 1, every integer little-endian:
    ///
    /// | bytes | what |
    /// |---|---|
    /// | 1 | the version: 1 |
    /// | 8 | until when the key is blocked, µs since the Unix epoch (0: not) |
    /// | 8 | the next lease count |
    /// | 1 | n, the algorithms the key is counted under (at most 5) |
    /// | n × | each: 1 byte for the algorithm (1 sliding log, 2 fixed window, 3 sliding window, 4 GCRA, 5 concurrency), 8 bytes for when its counts stop mattering (µs), 4 bytes for m, then m records |
    ///
    /// A record is, by algorithm: a sliding log's entry time (8 bytes, oldest
    /// first); a fixed window's counter: 0 and its window in µs (1 + 8), or
    /// 1 and its calendar's name (1 + 1 + at most 255, e.g. `day:UTC`,
    /// `week:Europe/Paris:wed`, `month:+05:30:15`: a name, where the process
    /// knows a calendar's zone by a number of its own), then the window's
    /// index and count (2 × 8); a
    /// sliding window's window, index, current and previous counts (4 × 8); a
    /// GCRA rate's window, TAT in whole µs, the TAT's fraction (an IEEE 754
    /// double's bits) and max (4 × 8); a concurrency slot's lease id (16) and
    /// expiry (8).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(18 + 45 * self.counted.len());
        out.push(STATE_ENCODING_VERSION);
        put(&mut out, self.blocked_until);
        put(&mut out, self.next_lease);
        // At most one entry per algorithm: five.
        out.push(self.counted.len() as u8);
        for counted in &self.counted {
            write_counted(&mut out, counted);
        }
        out
    }

    /// The state [`to_bytes`](Self::to_bytes) wrote. Bytes of another
    /// version, cut short, with bytes left over, or holding what no state
    /// holds are an error, never a state that would count wrong.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StateError> {
        let mut input = Input(bytes);
        let version = input.byte().map_err(|_| StateError::Version { found: 0 })?;
        if version != STATE_ENCODING_VERSION {
            return Err(StateError::Version { found: version });
        }
        let blocked_until = input.word()?;
        let next_lease = input.word()?;
        let n = input.byte()?;
        let mut counted: SmallVec<[Counted; 1]> = SmallVec::new();
        for _ in 0..n {
            let read = read_counted(&mut input)?;
            if counted
                .iter()
                .any(|c| c.state.algorithm() == read.state.algorithm())
            {
                return Err(StateError::Invalid("one algorithm twice"));
            }
            counted.push(read);
        }
        if !input.0.is_empty() {
            return Err(StateError::Length("longer than the state"));
        }
        Ok(Self {
            counted,
            blocked_until,
            next_lease,
        })
    }
}

fn put(out: &mut Vec<u8>, word: u64) {
    out.extend_from_slice(&word.to_le_bytes());
}

/// The tag of `algorithm` in the encoding.
fn tag(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::SlidingLog => 1,
        Algorithm::FixedWindow => 2,
        Algorithm::SlidingWindow => 3,
        Algorithm::Gcra => 4,
        Algorithm::Concurrency => 5,
    }
}

fn write_counted(out: &mut Vec<u8>, counted: &Counted) {
    out.push(tag(counted.state.algorithm()));
    put(out, counted.expires_at);
    let records = |out: &mut Vec<u8>, m: usize| {
        // A state holds at most a policy's max of records (below 2^32).
        out.extend_from_slice(&u32::try_from(m).unwrap_or(u32::MAX).to_le_bytes());
    };
    match &counted.state {
        State::Log(entries) => {
            records(out, entries.len());
            entries.iter().for_each(|&at| put(out, at));
        }
        State::Fixed(counters) => {
            records(out, counters.len());
            for [slot, index, count] in counters.iter().map(fixed_window::Counter::words) {
                write_slot(out, slot);
                put(out, index);
                put(out, count);
            }
        }
        State::Sliding(counters) => {
            records(out, counters.len());
            for word in counters.iter().flat_map(sliding_window::Counters::words) {
                put(out, word);
            }
        }
        State::Gcra(tats) => {
            records(out, tats.len());
            tats.iter()
                .flat_map(gcra::Tat::words)
                .for_each(|w| put(out, w));
        }
        State::Leases(leases) => {
            records(out, leases.leases().len());
            for &(lease, expiry) in leases.leases() {
                out.extend_from_slice(&lease.id().to_le_bytes());
                put(out, expiry);
            }
        }
    }
}

fn read_counted(input: &mut Input<'_>) -> Result<Counted, StateError> {
    let algorithm = match input.byte()? {
        1 => Algorithm::SlidingLog,
        2 => Algorithm::FixedWindow,
        3 => Algorithm::SlidingWindow,
        4 => Algorithm::Gcra,
        5 => Algorithm::Concurrency,
        _ => return Err(StateError::Invalid("an unknown algorithm")),
    };
    let expires_at = input.word()?;
    let m = input.records(match algorithm {
        Algorithm::SlidingLog => 8,
        // At least: a calendar's name of one byte, the index and count.
        Algorithm::FixedWindow => 18,
        Algorithm::SlidingWindow | Algorithm::Gcra => 32,
        Algorithm::Concurrency => 24,
    })?;
    let state = read_records(input, algorithm, m)?;
    Ok(Counted { state, expires_at })
}

/// The `m` records of a state under `algorithm`.
fn read_records(
    input: &mut Input<'_>,
    algorithm: Algorithm,
    m: usize,
) -> Result<State, StateError> {
    let invalid = StateError::Invalid;
    Ok(match algorithm {
        Algorithm::SlidingLog => {
            let entries = (0..m).map(|_| input.word()).collect::<Result<_, _>>()?;
            let entries: std::collections::VecDeque<u64> = entries;
            let ordered = entries
                .iter()
                .zip(entries.iter().skip(1))
                .all(|(a, b)| a <= b);
            if !ordered || entries.back().is_some_and(|&t| t > MAX_TIME) {
                return Err(invalid(
                    "a sliding log out of order or past the clock's range",
                ));
            }
            State::Log(entries)
        }
        Algorithm::FixedWindow => State::Fixed(
            (0..m)
                .map(|_| {
                    let slot = read_slot(input)?;
                    fixed_window::Counter::from_words([slot, input.word()?, input.word()?])
                        .ok_or(invalid("a window counter out of range"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Algorithm::SlidingWindow => State::Sliding(
            (0..m)
                .map(|_| {
                    sliding_window::Counters::from_words(input.words()?)
                        .ok_or(invalid("sliding window counters out of range"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Algorithm::Gcra => State::Gcra(
            (0..m)
                .map(|_| gcra::Tat::from_words(input.words()?).ok_or(invalid("a TAT out of range")))
                .collect::<Result<_, _>>()?,
        ),
        Algorithm::Concurrency => State::Leases(concurrency::State::of_leases(
            (0..m)
                .map(|_| Ok((Lease::new(input.id()?), input.word()?)))
                .collect::<Result<_, StateError>>()?,
        )),
    })
}

/// A fixed window counter's slot: its window in µs, or its calendar by
/// name.
fn write_slot(out: &mut Vec<u8>, slot: u64) {
    match Calendar::from_slot(slot) {
        None => {
            out.push(0);
            put(out, slot);
        }
        Some(calendar) => {
            let field = calendar.field();
            out.push(1);
            // A zone's name is short (the longest IANA name has 32 bytes).
            let field = &field.as_bytes()[..field.len().min(255)];
            out.push(field.len() as u8);
            out.extend_from_slice(field);
        }
    }
}

/// The slot [`write_slot`] wrote, a calendar's as this process numbers it.
fn read_slot(input: &mut Input<'_>) -> Result<u64, StateError> {
    match input.byte()? {
        0 => {
            let window = input.word()?;
            match Calendar::from_slot(window) {
                None => Ok(window),
                Some(_) => Err(StateError::Invalid("a window past ten years")),
            }
        }
        1 => {
            let len = usize::from(input.byte()?);
            let name = input.bytes(len)?;
            std::str::from_utf8(name)
                .ok()
                .and_then(Calendar::from_field)
                .map(|calendar| calendar.slot())
                .ok_or(StateError::Invalid("an unknown calendar"))
        }
        _ => Err(StateError::Invalid("an unknown kind of window")),
    }
}

/// The bytes not read yet.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], StateError> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(StateError::Length("shorter than the state"))?;
        self.0 = rest;
        Ok(*head)
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8], StateError> {
        if n > self.0.len() {
            return Err(StateError::Length("shorter than the state"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, StateError> {
        self.take::<1>().map(|[b]| b)
    }

    fn word(&mut self) -> Result<u64, StateError> {
        self.take().map(u64::from_le_bytes)
    }

    fn id(&mut self) -> Result<u128, StateError> {
        self.take().map(u128::from_le_bytes)
    }

    fn words<const N: usize>(&mut self) -> Result<[u64; N], StateError> {
        let mut words = [0; N];
        for word in &mut words {
            *word = self.word()?;
        }
        Ok(words)
    }

    /// A count of records of `size` bytes each, which the bytes left must
    /// hold (so that nothing is allocated for records that are not there).
    fn records(&mut self, size: usize) -> Result<usize, StateError> {
        let m = self.take().map(u32::from_le_bytes)? as usize;
        if m.saturating_mul(size) > self.0.len() {
            return Err(StateError::Length("shorter than the state"));
        }
        Ok(m)
    }
}
