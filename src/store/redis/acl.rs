//! The Redis commands a store sends (for a least-privileged ACL user).

/// Every command a store sends, directly or from its scripts (see
/// [`RedisStore::acl_rules`]).
pub(super) const ACL_COMMANDS: &[&str] = &[
    "+ping",
    "+evalsha",
    "+script|load",
    "+multi",
    "+exec",
    "+time",
    "+get",
    "+mget",
    "+set",
    "+del",
    // The window counters' counts.
    "+incrby",
    "+decrby",
    "+hset",
    "+hget",
    "+hmget",
    "+hdel",
    "+pexpire",
    "+pexpireat",
    "+pttl",
    "+zadd",
    "+zrem",
    "+zscore",
    "+zcard",
    "+zcount",
    "+zrange",
    "+zrevrange",
    "+zremrangebyscore",
    "+zremrangebyrank",
    // The most denied keys, shared (`{prefix}:denied:*`).
    "+zincrby",
    // Sentinel: redis-rs asks the primary it was given for its ROLE.
    "+role",
    // Cluster: the client's topology (and `ping()`'s list of masters), and
    // an `ASK` redirect's first command.
    "+cluster|slots",
    "+asking",
];
