//! A store written outside the crate (`examples/custom_store.rs`, over
//! the public `KeyState`) passes the crate's conformance suite: it decides
//! as `MemoryStore` does, for every algorithm, command and release.

#[path = "../../examples/custom_store.rs"]
#[allow(dead_code, unreachable_pub)]
mod example;

use tower_redis_ratelimit::store::conformance;

#[tokio::test]
async fn a_store_of_your_own_decides_as_memory_store_does() {
    conformance::check_store(example::MapStore::new).await;
}
