//! Redis Sentinel (filled below).
