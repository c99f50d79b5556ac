//! One conformance suite, run for every algorithm against every store:
//! MemoryStore on a manual clock (exact values), RedisStore in both
//! executions through a pool and through a ConnectionManager against a real
//! redis-server, and on a Redis Cluster (real time, short windows, margins).
//!
//! These are the expectations every algorithm shares: up to max admitted,
//! then denied; denied requests do not count; waiting `retry_after` (or
//! `reset`) is enough; the values a response's headers are made of agree
//! with each other; keys are separate; cost counts; several rates are
//! all-or-nothing. What only one algorithm does (its edges, its exact
//! arithmetic) is in its own file: sliding_log.rs, fixed_window.rs,
//! sliding_window.rs, gcra.rs, concurrency_store.rs.
//!
//! Tests are named `<algorithm>::<store>::<case>`, e.g.
//! `gcra::cluster::cost_is_counted`, `sliding_log::redis_script::cost_is_counted`.
//! Only the sliding log has two executions in Redis (a `MULTI`/`EXEC`
//! transaction or a Lua script); the other algorithms always run one script.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::time::Duration;

use crate::support::harness::{Harness, MS, Mark, US, advance_to, align};
use tower_redis_ratelimit::policy::Execution;
use tower_redis_ratelimit::{Algorithm, Decision, Policy};

/// The policy `text` ("max/window, ...") under `algorithm` (for
/// concurrency: max in flight, leases of the window).
fn policy(h: &Harness, algorithm: Algorithm, text: &str) -> Policy {
    h.policy_of(text, algorithm)
}

/// Start a case: for the algorithms that count in wall-clock windows, at
/// the start of a window of `window` (so no window ends by surprise in the
/// middle of a burst).
async fn start(h: &Harness, algorithm: Algorithm, window: Duration) -> Mark {
    match algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingWindow => align(h, window).await,
        _ => h.mark(),
    }
}

/// One check, its decision held to [`assert_consistent`].
async fn check(h: &Harness, key: &str, policy: &Policy) -> Decision {
    let d = h.check(key, policy).await;
    assert_consistent(&d, policy);
    d
}

/// What every decision of every algorithm agrees with: the headline
/// (`limit`, `remaining`, `reset`, what the `X-RateLimit-*` and `RateLimit`
/// headers say) is one of the policy's rates, the one the docs say;
/// `retry_after` is zero exactly when the request is admitted, and
/// otherwise the longest wait of any rate and no later than the reset.
#[track_caller]
fn assert_consistent(d: &Decision, policy: &Policy) {
    assert_eq!(d.algorithm(), policy.algorithm());
    let rates: Vec<_> = d.rates().iter().map(|s| s.rate()).collect();
    assert_eq!(rates, policy.rates(), "one status per rate, in order");
    let headline = d
        .rates()
        .iter()
        .find(|s| s.rate() == d.rate() && s.remaining() == d.remaining() && s.reset() == d.reset())
        .unwrap_or_else(|| panic!("the headline is none of the rates: {d:?}"));
    assert_eq!(d.limit(), d.rate().max());
    for s in d.rates() {
        assert!(s.remaining() <= s.rate().max(), "{d:?}");
        if d.allowed() {
            assert!(
                s.remaining() <= s.rate().max() - policy.cost(),
                "an admitted request takes its cost: {d:?}"
            );
        }
    }
    if d.allowed() {
        assert_eq!(d.retry_after(), Duration::ZERO, "{d:?}");
        assert!(d.rates().iter().all(|s| s.wait().is_zero()), "{d:?}");
        let fewest = d.rates().iter().map(|s| s.remaining()).min().unwrap();
        assert_eq!(
            d.remaining(),
            fewest,
            "the rate with fewest remaining: {d:?}"
        );
        let longest_reset = d
            .rates()
            .iter()
            .filter(|s| s.remaining() == fewest)
            .map(|s| s.reset())
            .max()
            .unwrap();
        assert_eq!(
            d.reset(),
            longest_reset,
            "ties go to the longer reset: {d:?}"
        );
    } else {
        let longest_wait = d.rates().iter().map(|s| s.wait()).max().unwrap();
        assert!(d.retry_after() > Duration::ZERO, "{d:?}");
        assert_eq!(d.retry_after(), longest_wait, "{d:?}");
        assert_eq!(
            headline.wait(),
            longest_wait,
            "the rate that keeps it out: {d:?}"
        );
        assert!(d.lease().is_none(), "a denied request holds no lease");
        if policy.algorithm() != Algorithm::Concurrency {
            assert!(
                d.retry_after() <= d.reset(),
                "admitted again no later than full again: {d:?}"
            );
        }
    }
}

/// The longest a reset may be after one window of `window` was used: the
/// sliding window counter weighs the previous window too.
fn reset_bound(algorithm: Algorithm, window: Duration) -> Duration {
    match algorithm {
        Algorithm::SlidingWindow => 2 * window,
        _ => window,
    }
}

async fn admits_max_then_denies(h: Harness, a: Algorithm) {
    let window = Duration::from_secs(1);
    let p = policy(&h, a, "3/1s");
    start(&h, a, window).await;
    for remaining in [2, 1, 0] {
        let d = check(&h, "k", &p).await;
        assert!(d.allowed(), "{a:?}: {d:?}");
        assert_eq!((d.limit(), d.remaining()), (3, remaining));
        assert!(d.reset() <= reset_bound(a, window) + h.tolerance(), "{d:?}");
        if a == Algorithm::Concurrency {
            assert!(d.lease().is_some(), "an admitted request holds a lease");
        } else {
            assert!(d.reset() > Duration::ZERO, "{d:?}");
        }
    }
    for _ in 0..3 {
        let d = check(&h, "k", &p).await;
        assert!(!d.allowed(), "{a:?}: {d:?}");
        assert_eq!((d.limit(), d.remaining()), (3, 0));
        assert!(
            d.retry_after() <= reset_bound(a, window) + h.tolerance(),
            "{d:?}"
        );
    }
}

/// Denied attempts neither count nor push the admission later: every
/// denial names the same instant, and at that instant a request is
/// admitted.
async fn denied_attempts_do_not_count(h: Harness, a: Algorithm) {
    let p = policy(&h, a, "2/1s");
    start(&h, a, Duration::from_secs(1)).await;
    assert!(check(&h, "k", &p).await.allowed());
    assert!(check(&h, "k", &p).await.allowed());
    let first = check(&h, "k", &p).await;
    let denied_at = h.mark();
    assert!(!first.allowed());
    // The soonest first wait of all algorithms is GCRA's 500 ms.
    for _ in 0..5 {
        h.advance(50 * MS).await;
        let d = check(&h, "k", &p).await;
        assert!(!d.allowed());
        assert_eq!(d.remaining(), 0);
        h.assert_near(
            d.retry_after(),
            first.retry_after().saturating_sub(h.since(denied_at)),
            "retry_after after more denials",
        );
    }
    advance_to(&h, denied_at, first.retry_after(), true).await;
    assert!(
        check(&h, "k", &p).await.allowed(),
        "the denied attempts must not count"
    );
}

/// Burst until denied, wait `retry_after`, and be admitted, several times
/// at different points of a window; on the manual clock one microsecond
/// less is not enough.
async fn retry_after_is_honest(h: Harness, a: Algorithm) {
    let p = policy(&h, a, "3/1s");
    start(&h, a, Duration::from_secs(1)).await;
    for round in 0..3 {
        let mut admitted = 0;
        let denied = loop {
            let d = check(&h, "k", &p).await;
            if !d.allowed() {
                break d;
            }
            admitted += 1;
            assert!(
                admitted <= 3,
                "round {round}: more than max admitted at once"
            );
        };
        if round == 0 {
            assert_eq!(admitted, 3);
        }
        let wait = denied.retry_after();
        if let Harness::Memory { .. } = h {
            h.advance(wait - US).await;
            let d = check(&h, "k", &p).await;
            assert!(!d.allowed(), "round {round}: admitted 1 µs early");
            assert_eq!(d.retry_after(), US);
            h.advance(US).await;
            assert!(
                check(&h, "k", &p).await.allowed(),
                "round {round}: waiting retry_after ({wait:?}) must be enough"
            );
        } else {
            h.advance(wait).await;
            assert!(
                retry(&h, a, &p).await.allowed(),
                "round {round}: waiting retry_after ({wait:?}) must be enough"
            );
        }
        // Move on so the next round starts elsewhere in a window.
        h.advance(137 * MS).await;
    }
}

/// A burst right after the first admission: the denial's `retry_after`,
/// and every rate's wait and reset, are at most the window (`Retry-After:
/// 10` for `5/10s`, not 11), and waiting `retry_after` admits. Two
/// exceptions, both documented: the sliding window counter's weighting of
/// the previous window keeps a key out up to `window · cost / max` longer;
/// and the sliding log's `Transaction` execution, whose entries may be
/// dated up to twice its clock tolerance (about 10 ms) late, may answer a
/// retry at the very end of the window with one more denial of those
/// milliseconds.
async fn a_burst_right_after_the_first_admission(h: Harness, a: Algorithm) {
    let window = Duration::from_secs(1);
    let p = policy(&h, a, "3/1s");
    start(&h, a, window).await;
    for _ in 0..3 {
        assert!(check(&h, "k", &p).await.allowed());
    }
    let denied = check(&h, "k", &p).await;
    assert!(!denied.allowed(), "{a:?}: {denied:?}");
    let longest = match a {
        Algorithm::SlidingWindow => window + window / 3 + US,
        _ => window,
    };
    assert!(
        denied.retry_after() <= longest,
        "{a:?}: waits beyond the window: {denied:?}"
    );
    for s in denied.rates() {
        assert!(s.wait() <= longest, "{a:?}: {denied:?}");
        assert!(s.reset() <= reset_bound(a, window), "{a:?}: {denied:?}");
    }
    h.advance(denied.retry_after()).await;
    let retried = retry(&h, a, &p).await;
    assert!(
        retried.allowed(),
        "{a:?}: waiting retry_after ({:?}) must be enough: {retried:?}",
        denied.retry_after()
    );
}

/// A check after waiting a denial's `retry_after`. On the sliding log's
/// `Transaction` execution, whose waits are at most the window although its
/// entries may be dated up to twice its clock tolerance late, a retry
/// within those milliseconds of the window's end may meet one more denial,
/// of those milliseconds only: then it waits that too.
async fn retry(h: &Harness, a: Algorithm, p: &Policy) -> Decision {
    let d = check(h, "k", p).await;
    let transaction = matches!(
        h,
        Harness::Redis {
            execution: Execution::Transaction,
            ..
        }
    );
    if !(transaction && a == Algorithm::SlidingLog && !d.allowed()) {
        return d;
    }
    assert!(
        d.retry_after() <= 30 * MS,
        "one more denial, of the clock tolerance only: {d:?}"
    );
    h.advance(d.retry_after()).await;
    check(h, "k", p).await
}

/// Waiting `reset` (of every rate) with no request in between gives the
/// full quota back.
async fn reset_is_honest(h: Harness, a: Algorithm) {
    let p = policy(&h, a, "3/500ms, 5/1s");
    start(&h, a, Duration::from_secs(1)).await;
    assert!(check(&h, "k", &p).await.allowed());
    h.advance(100 * MS).await;
    assert!(check(&h, "k", &p).await.allowed());
    let d = check(&h, "k", &p).await;
    assert!(d.allowed());
    let last = h.mark();
    let full_again = d.rates().iter().map(|s| s.reset()).max().unwrap();
    assert!(full_again >= d.reset());
    advance_to(&h, last, full_again, true).await;
    let d = check(&h, "k", &p).await;
    assert!(d.allowed());
    let remaining: Vec<u64> = d.rates().iter().map(|s| s.remaining()).collect();
    assert_eq!(remaining, [2, 4], "every rate is full again: {d:?}");
}

/// Admitted and denied requests of several rates, costs and gaps: every
/// decision is held to [`assert_consistent`]; and on the manual clock, now
/// and then, `remaining` is taken at its word: that many more (in units of
/// the cost) are admitted at once, and not one more.
async fn headers_stay_consistent(h: Harness, a: Algorithm) {
    let one = policy(&h, a, "4/300ms, 6/1s");
    let two = one.clone().with_cost(2).unwrap();
    start(&h, a, Duration::from_secs(1)).await;
    let gaps = [
        0, 0, 40, 0, 90, 10, 0, 160, 0, 0, 70, 230, 0, 20, 0, 310, 0, 0, 45,
    ];
    let (mut admitted, mut drained) = (0, 0);
    for (i, gap) in gaps.into_iter().enumerate() {
        h.advance(gap * MS).await;
        let p = if i % 3 == 2 { &two } else { &one };
        let d = check(&h, "k", p).await;
        admitted += usize::from(d.allowed());
        if i % 5 == 4 && d.allowed() && matches!(h, Harness::Memory { .. }) {
            for _ in 0..d.remaining() / p.cost() {
                assert!(check(&h, "k", p).await.allowed(), "step {i}: {d:?}");
            }
            assert!(!check(&h, "k", p).await.allowed(), "step {i}: {d:?}");
            drained += 1;
        }
    }
    assert!(admitted > 3, "admitted {admitted}");
    if let Harness::Memory { .. } = h {
        assert!(drained > 0, "remaining was never taken at its word");
    }
}

async fn keys_are_independent(h: Harness, a: Algorithm) {
    let p = policy(&h, a, "1/1s");
    start(&h, a, Duration::from_secs(1)).await;
    assert!(check(&h, "a", &p).await.allowed());
    assert!(!check(&h, "a", &p).await.allowed());
    assert!(check(&h, "b", &p).await.allowed());
    assert!(check(&h, "a b {c}", &p).await.allowed());
    assert!(!check(&h, "a b {c}", &p).await.allowed());
    assert!(!check(&h, "a", &p).await.allowed());
}

/// A request of cost `c` takes `c`; `retry_after` of a denied one is
/// enough for its cost; a denied costly request leaves room for a cheaper
/// one.
async fn cost_is_counted(h: Harness, a: Algorithm) {
    let p = policy(&h, a, "5/1s").with_cost(2).unwrap();
    let cheap = policy(&h, a, "5/1s");
    start(&h, a, Duration::from_secs(1)).await;
    for key in ["k", "cheap"] {
        let d = check(&h, key, &p).await;
        assert!(d.allowed());
        assert_eq!(d.remaining(), 3);
        assert_eq!(check(&h, key, &p).await.remaining(), 1);
    }
    let d = check(&h, "k", &p).await;
    let denied_at = h.mark();
    assert!(!d.allowed());
    assert_eq!(d.remaining(), 1, "the denied request took nothing");
    // One unit is still free for a cheaper request.
    let c = check(&h, "cheap", &p).await;
    assert!(!c.allowed());
    let c = check(&h, "cheap", &cheap).await;
    assert!(c.allowed());
    assert_eq!(c.remaining(), 0);
    assert!(!check(&h, "cheap", &cheap).await.allowed());
    // Waiting retry_after frees the whole cost.
    advance_to(&h, denied_at, d.retry_after(), true).await;
    assert!(check(&h, "k", &p).await.allowed());
}

/// Rates `2c/200ms, 3c/1s` with cost `c`: a request counts against every
/// rate or none, and waiting `retry_after` is enough under several rates.
async fn several_rates(h: Harness, a: Algorithm, cost: u64) {
    let p = policy(&h, a, &format!("{}/200ms, {}/1s", 2 * cost, 3 * cost))
        .with_cost(cost)
        .unwrap();
    let memory = matches!(h, Harness::Memory { .. });
    start(&h, a, Duration::from_secs(1)).await;
    let d = check(&h, "k", &p).await;
    assert!(d.allowed());
    assert_eq!(
        (d.limit(), d.remaining()),
        (2 * cost, cost),
        "the rate with fewest remaining"
    );
    assert_eq!(d.rates()[1].remaining(), 2 * cost);
    let d = check(&h, "k", &p).await;
    assert!(d.allowed());
    assert_eq!((d.limit(), d.remaining()), (2 * cost, 0));
    assert_eq!(d.rates()[1].remaining(), cost);
    let mut denied = d;
    for _ in 0..3 {
        denied = check(&h, "k", &p).await;
        assert!(!denied.allowed());
        assert_eq!(denied.limit(), 2 * cost, "denied by the short rate");
        let [short, long] = denied.rates() else {
            panic!("two rates")
        };
        assert_eq!(short.remaining(), 0);
        assert_eq!(long.remaining(), cost, "the denied request did not count");
        assert_eq!(long.wait(), Duration::ZERO, "the long rate admits it");
    }
    let denied_at = h.mark();
    advance_to(&h, denied_at, denied.retry_after(), true).await;
    let d = check(&h, "k", &p).await;
    assert!(
        d.allowed(),
        "the denied requests took nothing from the long rate"
    );
    assert_eq!(d.rates()[1].remaining(), 0);
    let mut before = d.rates()[0].remaining();
    for _ in 0..3 {
        denied = check(&h, "k", &p).await;
        assert!(!denied.allowed());
        assert_eq!(denied.limit(), 3 * cost, "denied by the long rate");
        let short = denied.rates()[0].remaining();
        if memory {
            assert_eq!(short, before, "the denied request did not count");
        } else {
            assert!(short >= before, "the denied request did not count");
        }
        before = short;
    }
    let denied_at = h.mark();
    advance_to(&h, denied_at, denied.retry_after(), true).await;
    assert!(
        check(&h, "k", &p).await.allowed(),
        "waiting retry_after must be enough"
    );
}

async fn multi_rate_is_all_or_nothing(h: Harness, a: Algorithm) {
    several_rates(h, a, 1).await;
}

async fn cost_with_several_rates(h: Harness, a: Algorithm) {
    several_rates(h, a, 2).await;
}

/// One module per algorithm, running `cases` (each an
/// `async fn(Harness, Algorithm)` above) on the stores that `$stores`
/// ([`support::every_store_and_execution!`] or [`support::every_store!`])
/// names.
macro_rules! every_algorithm {
    (algorithms: [$($module:ident: $algorithm:expr, $stores:ident);+ $(;)?], cases: $cases:tt $(,)?) => {
        $(
            every_algorithm!(@one $module, $algorithm, $stores, $cases);
        )+
    };
    (@one $module:ident, $algorithm:expr, $stores:ident, [$($case:ident),* $(,)?]) => {
        mod $module {
            use super::*;

            $(
                async fn $case(h: Harness) {
                    super::$case(h, $algorithm).await;
                }
            )*

            support::$stores!([$($case),*]);
        }
    };
}

every_algorithm! {
    algorithms: [
        sliding_log: Algorithm::SlidingLog, every_store_and_execution;
        fixed_window: Algorithm::FixedWindow, every_store;
        sliding_window: Algorithm::SlidingWindow, every_store;
        gcra: Algorithm::Gcra, every_store;
    ],
    cases: [
        admits_max_then_denies,
        denied_attempts_do_not_count,
        retry_after_is_honest,
        a_burst_right_after_the_first_admission,
        reset_is_honest,
        headers_stay_consistent,
        keys_are_independent,
        cost_is_counted,
        multi_rate_is_all_or_nothing,
        cost_with_several_rates,
    ],
}

// One rate of cost 1 (leases of the window): no cost, no several rates, and
// no reset (a slot frees when a request ends, which no clock says).
every_algorithm! {
    algorithms: [concurrency: Algorithm::Concurrency, every_store],
    cases: [
        admits_max_then_denies,
        denied_attempts_do_not_count,
        retry_after_is_honest,
        keys_are_independent,
    ],
}
