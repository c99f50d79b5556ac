//! Test support: real `redis-server` processes on free loopback ports.
//!
//! Never a mock: if `redis-server` is missing the tests fail and say how to
//! install it. The binary is `$REDIS_SERVER` when that is set (a path or a
//! name on `PATH`; `scripts/test` runs part of the tests again with Valkey's
//! `valkey-server` this way), `redis-server` otherwise. (Shared with the
//! `global` test crate, which uses part of it: hence the allowances.)
#![allow(
    dead_code,
    unused_imports,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used
)]

pub mod browser;
pub mod cluster;
pub mod contention;
pub mod differential;
#[cfg(feature = "envoy")]
pub mod envoy;
pub mod eventually;
pub mod faults;
pub mod harness;
pub mod http;
pub mod logs;
pub mod openai_upstream;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod proxy;
pub mod raw;
pub mod rng;
pub mod sentinel;
pub mod server;
pub mod suites;
pub mod tls;
pub mod units;
pub mod window_counters;

pub use cluster::{CLUSTER_NODE_ARGS, RedisCluster, create_cluster};
pub use raw::{
    client_ids, raw_command, raw_command_as, try_raw_command_as, wait_until_retired, zcard,
};
pub(crate) use server::answers_as;
pub use server::{RedisServer, SERVER_VARIABLE, free_port, install_hint, server_binary};
pub use suites::{every_algorithm, start_of_a_second};
pub(crate) use suites::{every_store, every_store_and_execution, suite};
