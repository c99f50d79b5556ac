//! The integration tests, one binary: `tests/support` (real redis-server
//! processes, the fault proxy) compiles once for all of them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

mod acl;
#[cfg(feature = "admin")]
mod admin;
mod ai_attack;
mod ai_gateway;
mod ai_gateway_sdk;
mod ai_layer;
mod algorithm_differential;
mod batch_reads_attack;
mod batching;
mod breaker;
mod calendar;
mod cancellation;
mod client_ip;
mod command_faults;
mod commands;
mod concurrency_store;
mod conformance;
mod cost_headers;
mod custom_store;
mod demotion;
mod deny_cache;
#[cfg(feature = "envoy")]
mod envoy;
mod envoy_ai;
#[cfg(feature = "envoy")]
mod envoy_program;
#[cfg(feature = "envoy")]
mod envoy_reference;
mod example_server;
mod faults;
mod fixed_window;
mod gcra;
mod grpc;
mod hostile_clients;
mod http;
mod http_strategies;
mod key_encoding;
mod limiter;
mod llm_gateway;
mod local_quota;
mod memory_usage;
mod network_faults;
#[cfg(feature = "admin")]
mod operating;
mod plain_attack;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
mod postgres_attack;
#[cfg(feature = "postgres")]
mod postgres_faults;
#[cfg(feature = "postgres")]
mod postgres_tls;
mod redis_cluster;
mod redis_floor_attack;
mod redis_store;
mod request_bodies;
mod rule_counts;
mod rules;
mod rules_faults;
mod sentinel;
mod settlement;
mod settlement_faults;
mod sliding_log;
mod sliding_log_batch_attack;
mod sliding_window;
mod store_adversarial;
mod tls;
