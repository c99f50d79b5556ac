//! Reading what Redis answers: integers in any of their reply shapes, and
//! the text of a request id.

use redis::Value;

use crate::decision::Lease;
use crate::store::StoreError;

/// The text of a request id: the member it is written to Redis as.
pub(super) fn member(lease: Lease) -> String {
    format!("{:032x}", lease.id())
}

/// Read an integer from a reply that may be an integer or a numeric string.
pub(super) fn int_reply(value: &Value, what: &str) -> Result<i64, StoreError> {
    let parsed = match value {
        Value::Int(i) => Some(*i),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok().and_then(parse_num),
        Value::SimpleString(s) => parse_num(s),
        Value::Double(d) if d.is_finite() => Some(*d as i64),
        _ => None,
    };
    parsed.ok_or_else(|| {
        StoreError::UnexpectedReply(format!("{what}: expected a number, got {value:?}"))
    })
}

fn parse_num(s: &str) -> Option<i64> {
    s.parse::<i64>().ok().or_else(|| {
        s.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .map(|f| f as i64)
    })
}
