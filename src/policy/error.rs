//! [`PolicyError`]: why a rate or policy was refused.

use std::time::Duration;

use super::{Algorithm, Period, Rate};

/// Why a [`Rate`] or [`Policy`](crate::policy::Policy) cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy holds no rate.
    #[error("a policy needs at least one rate, such as \"10/s\"")]
    Empty,
    /// A rate admits nothing.
    #[error("rate {rate}: max must be at least 1")]
    ZeroMax {
        /// The rate as written.
        rate: String,
    },
    /// A rate's window is empty.
    #[error("rate {rate}: the window must be longer than zero")]
    ZeroWindow {
        /// The rate as written.
        rate: String,
    },
    /// A window outside [`MIN_WINDOW`](crate::policy::MIN_WINDOW)..=[`MAX_WINDOW`](crate::policy::MAX_WINDOW).
    #[error("window {window:?} is out of range: it must be between 1ms and 10 years")]
    WindowOutOfRange {
        /// The window given.
        window: Duration,
    },
    /// Two rates share a window.
    #[error("rates {first} and {second} have the same window; keep one rate per window")]
    DuplicateWindow {
        /// One rate.
        first: Rate,
        /// The other rate with the same window.
        second: Rate,
    },
    /// A unit the parser does not know.
    #[error("unknown time unit {unit:?} in {input:?}: use ms, s, m (or min), h or d")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The rate it was in.
        input: String,
    },
    /// Text that is not a rate.
    #[error("cannot read {input:?} as a rate: {reason}")]
    Invalid {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An algorithm name the parser does not know.
    #[error(
        "unknown algorithm {input:?}: use sliding-log, fixed-window, sliding-window, gcra or concurrency"
    )]
    UnknownAlgorithm {
        /// The text given.
        input: String,
    },
    /// A setting the policy's algorithm cannot enforce.
    #[error("the {algorithm} algorithm does not support {what}")]
    Unsupported {
        /// The policy's algorithm.
        algorithm: Algorithm,
        /// What it does not support.
        what: &'static str,
    },
    /// An execution other than `transaction` or `script`.
    #[error("unknown execution {input:?}: use `transaction` or `script`")]
    UnknownExecution {
        /// The text given.
        input: String,
    },
    /// A `max` above [`MAX_MAX`](crate::policy::MAX_MAX).
    #[error("max {max} is too large: at most 2^53 (9007199254740992)")]
    MaxTooLarge {
        /// The max given.
        max: u64,
    },
    /// A minimum spacing outside 1µs..=[`MAX_WINDOW`](crate::policy::MAX_WINDOW).
    #[error(
        "minimum spacing {spacing:?} is out of range: it must be zero (none) or between 1µs and 10 years"
    )]
    SpacingOutOfRange {
        /// The spacing given.
        spacing: Duration,
    },
    /// A sliding log's cost above [`MAX_COST`](crate::policy::MAX_COST).
    #[error(
        "cost {cost} is too large for the sliding log: at most 10000 (it keeps one entry per unit; the other algorithms count any cost up to the max)"
    )]
    CostTooLarge {
        /// The cost given.
        cost: u64,
    },
    /// A zero cost.
    #[error("cost must be at least 1")]
    ZeroCost,
    /// A request would cost more than a rate ever admits.
    #[error("cost {cost} is above the max of rate {rate}: no request could ever be admitted")]
    CostAboveMax {
        /// The cost given.
        cost: u64,
        /// The rate it exceeds.
        rate: Rate,
    },
    /// A time zone that is neither an IANA name nor a fixed offset.
    #[error("unknown time zone {zone:?} in {input:?}: {reason}")]
    UnknownZone {
        /// The zone as written.
        zone: String,
        /// The rate it was in.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// More distinct time zones than a process registers.
    #[error("too many time zones: a process registers at most {max}")]
    TooManyZones {
        /// The bound.
        max: usize,
    },
    /// An anchor the calendar period cannot start on.
    #[error("anchor {anchor:?} for a calendar {period}: {reason}")]
    InvalidAnchor {
        /// The anchor as written.
        anchor: String,
        /// The calendar's period.
        period: Period,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A settlement reads the cost from a header that never reaches it
    /// as a cost: a connection's or the body's framing.
    #[error("the cost header {header:?} can never settle a cost: {reason}")]
    UnusableCostHeader {
        /// The header's name.
        header: String,
        /// Why it cannot carry a cost.
        reason: &'static str,
    },
}
