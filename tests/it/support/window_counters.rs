//! The window counters (the fixed window and the sliding window counter)
//! by name, for the tests that attack both.

use tower_redis_ratelimit::Policy;

/// The fixed window.
pub const FIXED: &str = "fixed-window";
/// The sliding window counter.
pub const SLIDING: &str = "sliding-window";
/// Both.
pub const WINDOW_COUNTERS: [&str; 2] = [FIXED, SLIDING];

/// The policy `text` run by `algorithm` (one of the window counters).
pub fn policy(algorithm: &str, text: &str) -> Policy {
    let policy: Policy = text.parse().unwrap();
    match algorithm {
        FIXED => policy.fixed_window().unwrap(),
        SLIDING => policy.sliding_window().unwrap(),
        other => panic!("{other}"),
    }
}

/// The algorithm's tag in its Redis keys.
pub fn tag(algorithm: &str) -> &'static str {
    match algorithm {
        FIXED => "fixed",
        SLIDING => "swc",
        other => panic!("{other}"),
    }
}
