//! PLACEHOLDER: being ported from the memory store's reference semantics.

use redis::aio::MultiplexedConnection;

use crate::decision::{Decision, Lease};
use crate::policy::Policy;
use crate::store::StoreError;

pub(super) async fn check(
    conn: &mut MultiplexedConnection,
    key: &str,
    policy: &Policy,
    lease: Lease,
) -> Result<Decision, StoreError> {
    let _ = (conn, key, policy, lease);
    Err(StoreError::UnexpectedReply(
        "concurrency is not implemented on Redis yet".to_owned(),
    ))
}

pub(super) async fn release(
    conn: &mut MultiplexedConnection,
    key: &str,
    lease: Lease,
) -> Result<(), StoreError> {
    let _ = (conn, key, lease);
    Ok(())
}
