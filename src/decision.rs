//! The outcome of one rate-limit check.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::{Algorithm, Rate};

/// What a store decided for one request of one key.
///
/// `limit`, `remaining` and `reset` describe one rate of the policy, the
/// one that says the most to the client: when the request is denied, the rate
/// that keeps it out longest; otherwise the rate with the fewest requests
/// remaining (ties go to the longer reset).
///
/// (Small on purpose: a decision moves from the store to the verdict to the
/// response, and each move copies it.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    allowed: bool,
    algorithm: Algorithm,
    /// Denied by a block ([`Limiter::block`](crate::Limiter::block)), not
    /// by a rate.
    blocked: bool,
    /// The index in `rates` of the rate the headline values describe.
    headline: u32,
    retry_after: Micros,
    rates: Rates,
    held: Held,
}

/// A time in whole µs, as a decision holds its waits and resets: 8 bytes
/// where a `Duration` takes 16 (a decision is copied from the store to the
/// response), and every store computes whole µs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Micros(pub(crate) u64);

impl Micros {
    pub(crate) const ZERO: Self = Self(0);

    /// `d` in µs, rounded up (a wait is never shortened), at most
    /// `u64::MAX`.
    #[cfg(test)]
    pub(crate) fn of(d: Duration) -> Self {
        let whole = crate::policy::duration_micros(d);
        Self(if d.subsec_nanos().is_multiple_of(1_000) {
            whole
        } else {
            whole.saturating_add(1)
        })
    }

    #[inline]
    pub(crate) fn duration(self) -> Duration {
        Duration::from_micros(self.0)
    }

    #[inline]
    pub(crate) fn is_zero(self) -> bool {
        self.0 == 0
    }
}

/// What an admitted check holds or wrote, to give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Nothing,
    /// A concurrency slot.
    Lease(Lease),
    /// For an admitted sliding-log check: the id of the entries it wrote.
    Entries(RefundId),
}

/// The state of every rate: inline for the usual one rate (no allocation
/// per decision), shared for several.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rates {
    One(RateStatus),
    Many(Arc<[RateStatus]>),
}

impl Rates {
    fn as_slice(&self) -> &[RateStatus] {
        match self {
            Self::One(status) => std::slice::from_ref(status),
            Self::Many(all) => all,
        }
    }

    fn map(&self, f: impl Fn(&RateStatus) -> RateStatus) -> Self {
        match self {
            Self::One(status) => Self::One(f(status)),
            Self::Many(all) => Self::Many(all.iter().map(f).collect()),
        }
    }
}

/// A concurrency slot held by an admitted request
/// ([`Algorithm::Concurrency`]); the layer gives it back through
/// [`Store::release`](crate::Store::release) when the response is done.
/// (What a refund names is a [`RefundId`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease(Id);

/// A 128-bit id as two halves: aligned to 8 bytes, where a `u128` would
/// align (and pad) every decision to 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Id([u64; 2]);

impl Id {
    fn new(id: u128) -> Self {
        Self([(id >> 64) as u64, id as u64])
    }

    fn get(self) -> u128 {
        (u128::from(self.0[0]) << 64) | u128::from(self.0[1])
    }
}

impl Lease {
    /// A lease with this id, unique among the leases of its store.
    pub(crate) fn new(id: u128) -> Self {
        Self(Id::new(id))
    }

    /// The lease's id.
    pub fn id(self) -> u128 {
        self.0.get()
    }
}

/// What an admitted check wrote, named so that it can be given back
/// exactly ([`Command::Refund`](crate::store::Command::Refund)): a sliding
/// log's entries, or a concurrency limit's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefundId(Id);

impl RefundId {
    /// A refund id of `id`, as a store gave it.
    pub(crate) fn new(id: u128) -> Self {
        Self(Id::new(id))
    }

    /// The id.
    pub fn id(self) -> u128 {
        self.0.get()
    }
}

impl From<Lease> for RefundId {
    fn from(lease: Lease) -> Self {
        Self(lease.0)
    }
}

impl From<RefundId> for Lease {
    fn from(id: RefundId) -> Self {
        Self(id.0)
    }
}

impl Decision {
    /// Whether the request is admitted.
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// The algorithm that decided.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The state of every rate of the policy, in the policy's order.
    pub fn rates(&self) -> &[RateStatus] {
        self.rates.as_slice()
    }

    /// The concurrency slot this admitted request holds
    /// ([`Algorithm::Concurrency`]); `None` otherwise.
    pub fn lease(&self) -> Option<Lease> {
        match self.held {
            Held::Lease(lease) => Some(lease),
            _ => None,
        }
    }

    /// What [`Command::Refund`](crate::store::Command::Refund) gives back
    /// of this admitted request exactly: the sliding log's entries, or the
    /// concurrency slot; `None` for the other algorithms (a refund of them
    /// is a reward) and for a denial.
    pub fn refund_id(&self) -> Option<RefundId> {
        match self.held {
            Held::Nothing => None,
            Held::Lease(lease) => Some(lease.into()),
            Held::Entries(id) => Some(id),
        }
    }

    /// Whether the key was denied by a block (an operator's
    /// [`Limiter::block`](crate::Limiter::block), or a rule's block after a
    /// breach) rather than by its rates.
    pub fn blocked(&self) -> bool {
        self.blocked
    }

    /// This decision, marked as a block's.
    pub(crate) fn into_blocked(mut self) -> Self {
        self.blocked = true;
        self
    }

    /// The same decision `by` later: every wait and reset shortened by it.
    pub(crate) fn aged(&self, by: Duration) -> Self {
        // Whole µs gone by: a wait is never shortened by more than passed.
        let by = crate::policy::duration_micros(by);
        let age = |d: Micros| Micros(d.0.saturating_sub(by));
        let mut aged = self.clone();
        aged.retry_after = age(self.retry_after);
        aged.rates = self.rates.map(|s| RateStatus {
            reset: age(s.reset),
            wait: age(s.wait),
            ..*s
        });
        aged
    }

    /// The same decision holding `lease`.
    #[inline]
    pub(crate) fn with_lease(mut self, lease: Lease) -> Self {
        self.held = Held::Lease(lease);
        self
    }

    /// This admitted sliding-log decision, with the id of its entries.
    pub(crate) fn with_entries(mut self, entries: RefundId) -> Self {
        self.held = Held::Entries(entries);
        self
    }

    /// For an admitted check of a window counter, how long the window that
    /// counted it lasts from when it was decided: units given back after
    /// that would come off a later window, which never counted them.
    /// `None` where giving back is exact whenever it comes (GCRA, the
    /// sliding log, the concurrency limit).
    pub(crate) fn counting_window_left(&self) -> Option<Duration> {
        // A fixed window's reset is its end; an admitted sliding window
        // counter's reset is the end of the window after.
        let fixed = match self.algorithm {
            Algorithm::FixedWindow => true,
            Algorithm::SlidingWindow => false,
            _ => return None,
        };
        self.rates()
            .iter()
            .map(|r| {
                if fixed {
                    r.reset()
                } else {
                    r.reset().saturating_sub(r.rate().window())
                }
            })
            .min()
    }

    /// Whether the units of this admitted decision, decided at `at`, can
    /// still be given back without lending them to a later window (see
    /// [`counting_window_left`](Self::counting_window_left)), by this
    /// process's clock.
    pub(crate) fn refundable_since(&self, at: std::time::Instant) -> bool {
        self.counting_window_left()
            .is_none_or(|left| at.elapsed() < left)
    }

    /// The status of the rate the headline values describe.
    fn headline(&self) -> &RateStatus {
        let rates = self.rates.as_slice();
        // Built with a rate at `headline`; the first is a safe answer.
        rates
            .get(self.headline as usize)
            .unwrap_or_else(|| &rates[0])
    }

    /// The rate the other values describe.
    pub fn rate(&self) -> Rate {
        self.headline().rate
    }

    /// The `max` of [`rate`](Self::rate).
    pub fn limit(&self) -> u64 {
        self.headline().rate.max()
    }

    /// Requests left in the current window of [`rate`](Self::rate), after
    /// this one.
    pub fn remaining(&self) -> u64 {
        self.headline().remaining
    }

    /// Time until the quota of [`rate`](Self::rate) is full again, if no
    /// further request arrives.
    pub fn reset(&self) -> Duration {
        self.headline().reset.duration()
    }

    /// For a denied request: the time after which the same request, sent
    /// alone, is admitted. Exact for the state the store saw. Zero for an
    /// admitted request.
    pub fn retry_after(&self) -> Duration {
        self.retry_after.duration()
    }
}

/// The state of one rate for one request, as a store computed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateStatus {
    pub(crate) rate: Rate,
    /// Requests left after this one (if admitted).
    pub(crate) remaining: u64,
    /// Time until this rate's quota is full again.
    pub(crate) reset: Micros,
    /// Time until this rate admits the request; zero when it admits it now.
    pub(crate) wait: Micros,
}

impl RateStatus {
    /// The rate.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// Requests this rate still admits now (after this one, if admitted).
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until this rate's quota is full again.
    pub fn reset(&self) -> Duration {
        self.reset.duration()
    }

    /// Time until this rate admits the request (zero if it does now).
    pub fn wait(&self) -> Duration {
        self.wait.duration()
    }

    /// The units of this rate spent: as a check's decision says it
    /// (`command`: `None`), or a command's (a peek, a settlement), which
    /// answers as a request of its policy's cost would after it:
    /// `Some((allowed, cost))`, `allowed` when that cost fits (the
    /// remaining units are then net of it). A key in debt shows its whole
    /// max spent.
    pub(crate) fn spent(&self, command: Option<(bool, u64)>) -> u64 {
        let answered_for = command.map_or(0, |(allowed, cost)| if allowed { cost } else { 0 });
        let left = self.remaining.saturating_add(answered_for);
        self.rate.max().saturating_sub(left)
    }
}

/// Builds a [`Decision`] from the state of every rate, so every store picks
/// the headline rate the same way.
#[derive(Debug)]
pub(crate) struct DecisionBuilder {
    allowed: bool,
    algorithm: Algorithm,
    retry_after: Micros,
    /// The headline so far (its index among the rates and its state), and
    /// whether it was chosen for denying.
    headline: Option<(u32, RateStatus, bool)>,
    /// The first rate's state, then the others' (a policy of one rate
    /// allocates nothing).
    first: Option<RateStatus>,
    rest: Vec<RateStatus>,
}

impl DecisionBuilder {
    #[inline]
    pub(crate) fn new(allowed: bool) -> Self {
        Self {
            allowed,
            algorithm: Algorithm::SlidingLog,
            retry_after: Micros::ZERO,
            headline: None,
            first: None,
            rest: Vec::new(),
        }
    }

    /// The algorithm deciding (default: the sliding log).
    #[inline]
    pub(crate) fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Add a wait that is not tied to one rate (minimum spacing).
    #[inline]
    pub(crate) fn wait(&mut self, wait: Micros) {
        if !self.allowed {
            self.retry_after = self.retry_after.max(wait);
        }
    }

    #[inline]
    pub(crate) fn rate(&mut self, state: RateStatus) {
        let index = if self.first.is_none() {
            self.first = Some(state);
            0
        } else {
            self.rest.push(state);
            u32::try_from(self.rest.len()).unwrap_or(u32::MAX)
        };
        let denies = !self.allowed && !state.wait.is_zero();
        if denies {
            self.retry_after = self.retry_after.max(state.wait);
        }
        let better = match &self.headline {
            None => true,
            Some((_, best, best_denies)) => match (denies, *best_denies) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => state.wait > best.wait,
                (false, false) => {
                    (state.remaining, std::cmp::Reverse(state.reset))
                        < (best.remaining, std::cmp::Reverse(best.reset))
                }
            },
        };
        if better {
            self.headline = Some((index, state, denies));
        }
    }

    /// The decision of a policy of one rate, whose `status` is given and
    /// that has no other wait: what a builder given only that rate builds,
    /// without the builder's moves (an algorithm's fast path).
    #[inline]
    pub(crate) fn one(allowed: bool, algorithm: Algorithm, status: RateStatus) -> Decision {
        Decision {
            allowed,
            algorithm,
            retry_after: if allowed { Micros::ZERO } else { status.wait },
            rates: Rates::One(status),
            held: Held::Nothing,
            blocked: false,
            headline: 0,
        }
    }

    /// `None` if no rate was added.
    #[inline]
    pub(crate) fn build(self) -> Option<Decision> {
        let (headline, _, _) = self.headline?;
        let first = self.first?;
        let rates = if self.rest.is_empty() {
            Rates::One(first)
        } else {
            Rates::Many(std::iter::once(first).chain(self.rest).collect())
        };
        Some(Decision {
            allowed: self.allowed,
            algorithm: self.algorithm,
            rates,
            held: Held::Nothing,
            blocked: false,
            headline,
            retry_after: if self.allowed {
                Micros::ZERO
            } else {
                self.retry_after
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(max: u64, secs: u64, remaining: u64, reset_ms: u64, wait_ms: u64) -> RateStatus {
        RateStatus {
            rate: Rate::new(max, Duration::from_secs(secs)).unwrap(),
            remaining,
            reset: Micros(reset_ms * 1_000),
            wait: Micros(wait_ms * 1_000),
        }
    }

    #[test]
    fn allowed_reports_the_rate_with_least_remaining() {
        let mut b = DecisionBuilder::new(true);
        b.rate(state(3, 1, 2, 1000, 0));
        b.rate(state(20, 60, 1, 60_000, 0));
        let d = b.build().unwrap();
        assert!(d.allowed());
        assert_eq!((d.limit(), d.remaining()), (20, 1));
        assert_eq!(d.retry_after(), Duration::ZERO);
    }

    #[test]
    fn denied_reports_the_rate_that_keeps_the_client_out_longest() {
        let mut b = DecisionBuilder::new(false);
        b.rate(state(3, 1, 0, 900, 400));
        b.rate(state(20, 60, 0, 59_000, 30_000));
        b.rate(state(100, 3600, 50, 3_000_000, 0));
        b.wait(Micros(100_000));
        let d = b.build().unwrap();
        assert!(!d.allowed());
        assert_eq!(d.limit(), 20);
        assert_eq!(d.retry_after(), Duration::from_millis(30_000));
    }

    #[test]
    fn spacing_alone_can_deny() {
        let mut b = DecisionBuilder::new(false);
        b.rate(state(3, 1, 2, 500, 0));
        b.wait(Micros(70_000));
        let d = b.build().unwrap();
        assert_eq!(d.retry_after(), Duration::from_millis(70));
        assert_eq!(d.remaining(), 2);
    }
}
