//! Every Lua script against the pure functions of `src/algorithm/` (through
//! `MemoryStore` on a manual clock): the check and command scripts of every
//! algorithm, with Redis's `TIME` replaced by a time the test sets, on
//! random policies, random times (often on window edges and one
//! microsecond before them) and random sequences of checks and operator
//! commands (peek, reset, block, penalty, reward). Every answer must be the
//! same to the microsecond.
//!
//! The seed is printed with every difference; set `DIFFERENTIAL_SEED`
//! (decimal or 0x-hex) to run another one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::{RedisServer, differential};
use tower_redis_ratelimit::Algorithm;

fn seed(default: u64) -> u64 {
    match std::env::var("DIFFERENTIAL_SEED") {
        Ok(text) if !text.is_empty() => match text.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => text.parse().unwrap(),
        },
        _ => default,
    }
}

async fn same_answers(algorithm: Algorithm, limit: u128, default_seed: u64) {
    let server = RedisServer::start();
    let setup = differential::Setup {
        limit,
        ..differential::Setup::new(algorithm, seed(default_seed))
    };
    let mismatches = differential::run(&server, setup).await;
    assert_eq!(mismatches, 0, "seed {:#x}", setup.seed);
}

#[tokio::test]
async fn sliding_log_script_matches_the_pure_functions() {
    same_answers(Algorithm::SlidingLog, u128::MAX, 0x9e37_79b9_7f4a_7c15).await;
}

#[tokio::test]
async fn fixed_window_script_matches_the_pure_functions() {
    same_answers(Algorithm::FixedWindow, u128::MAX, 0x2545_f491_4f6c_dd1d).await;
}

/// Exact while `max × window ≤ 2^53` (see `scripts/sliding_window.lua`).
#[tokio::test]
async fn sliding_window_script_matches_the_pure_functions() {
    same_answers(Algorithm::SlidingWindow, 1 << 53, 0xd1b5_4a32_d192_ed03).await;
}

#[tokio::test]
async fn gcra_script_matches_the_pure_functions() {
    same_answers(Algorithm::Gcra, u128::MAX, 0x8cb9_2ba7_2f3d_8dd7).await;
}

#[tokio::test]
async fn concurrency_script_matches_the_pure_functions() {
    same_answers(Algorithm::Concurrency, u128::MAX, 0x6a09_e667_f3bc_c909).await;
}
