//! PLACEHOLDER: being ported from the memory store's reference semantics.

use redis::aio::MultiplexedConnection;

use crate::decision::Decision;
use crate::policy::Policy;
use crate::store::StoreError;

pub(super) async fn check(
    conn: &mut MultiplexedConnection,
    key: &str,
    policy: &Policy,
) -> Result<Decision, StoreError> {
    let _ = (conn, key, policy);
    Err(StoreError::UnexpectedReply(
        "sliding_window is not implemented on Redis yet".to_owned(),
    ))
}
