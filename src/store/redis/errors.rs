//! What a Redis error means for the call that met it: whether the
//! command may have run, whether the connection is unusable or leads to a
//! demoted primary, whether Redis lost the script.

use redis::RedisError;

use crate::store::StoreError;

/// Whether Redis does not know the script it was asked to run.
pub(super) fn no_script(error: &StoreError) -> bool {
    error
        .backend_error::<redis::RedisError>()
        .is_some_and(|error| {
            error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        })
}

/// Whether Redis (or the cluster client) refused `error`'s command before
/// running any of it, so that sending it again cannot count it twice.
pub(super) fn not_run(error: &StoreError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    let Some(error) = error.backend_error::<redis::RedisError>() else {
        return false;
    };
    matches!(
        error.kind(),
        ErrorKind::ClusterConnectionNotFound
            | ErrorKind::Server(
                ServerErrorKind::Moved
                    | ServerErrorKind::Ask
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ExecAbort
            )
    )
}

/// Whether `error` says the connection leads to a replica: a primary
/// demoted by a Sentinel failover refuses writes with `READONLY` (before
/// running them). Such a connection is retired like a broken one, so that
/// the next goes to the new primary.
pub(super) fn is_demoted(error: &StoreError) -> bool {
    error
        .backend_error::<RedisError>()
        .is_some_and(redis_demoted)
}

/// Whether a redis-rs error carries `READONLY`: as the error itself (a
/// script or a single command) or inside an aborted transaction, where a
/// replica refuses each queued write with `READONLY` and `EXEC` answers
/// `EXECABORT`.
fn redis_demoted(error: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly) => true,
        ErrorKind::Server(ServerErrorKind::ExecAbort) => {
            error.clone().into_server_errors().is_some_and(|errors| {
                errors
                    .iter()
                    .any(|(_, e)| e.kind() == Some(ServerErrorKind::ReadOnly))
            })
        }
        _ => false,
    }
}

/// Whether `error` means the connection itself is unusable. A timeout does
/// not: a slow Redis answers later on the same connection.
pub(super) fn is_connection_error(error: &StoreError) -> bool {
    match error.backend_error::<RedisError>() {
        Some(e) => {
            !e.is_timeout()
                && (e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_unrecoverable_error())
        }
        _ => false,
    }
}
