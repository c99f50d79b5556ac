//! The tests of `builder`: what `Debug` shows, and Sentinel URLs.
#![allow(clippy::expect_used)]

use super::*;

/// What `Debug` shows of a builder: whether secrets are set, never them.
#[test]
fn debug_shows_no_key_or_password() {
    let builder = RedisStore::builder().pool_size(3);
    #[cfg(feature = "tls")]
    let builder = builder
        .root_certificate(b"ROOT-PEM".to_vec())
        .client_certificate(b"CLIENT-PEM".to_vec(), b"CLIENT-KEY-SECRET".to_vec());
    #[cfg(feature = "sentinel")]
    let builder = builder.sentinel_credentials(Some("sentinel-user"), "SENTINEL-SECRET");
    let shown = format!("{builder:?}");
    assert!(shown.contains("pool_size: 3"), "{shown}");
    for secret in [
        "ROOT-PEM",
        "CLIENT-PEM",
        "CLIENT-KEY-SECRET",
        "sentinel-user",
        "SENTINEL-SECRET",
    ] {
        assert!(!shown.contains(secret), "{secret} in {shown}");
    }
}

/// A manager's `Debug` shows no part of the URL it connects to.
#[test]
fn a_managers_debug_shows_no_credentials() {
    let manager =
        TrackedManager::new("redis://app:REDIS-SECRET@127.0.0.1:6379/0").expect("a valid URL");
    let shown = format!("{manager:?}");
    assert!(!shown.contains("REDIS-SECRET"), "{shown}");
    assert!(!shown.contains("app"), "{shown}");
}

#[cfg(feature = "sentinel")]
mod sentinel_urls {
    use super::*;

    fn parse(url: &str) -> Result<ParsedSentinel, RedisError> {
        parse_sentinel_url(sentinel_url(url).expect("a sentinel URL"))
    }

    #[test]
    fn sentinel_urls_are_read_with_their_credentials_and_database() {
        let parsed = parse("redis+sentinel://app:p%40ss@10.0.0.1:26379,[::1]:26380/mymaster/3")
            .expect("a valid URL");
        assert_eq!(parsed.service, "mymaster");
        assert_eq!(parsed.db, 3);
        assert_eq!(parsed.username.as_deref(), Some("app"));
        assert_eq!(parsed.password.as_deref(), Some("p@ss"));
        assert_eq!(
            parsed.sentinels,
            vec![
                redis::ConnectionAddr::Tcp("10.0.0.1".into(), 26379),
                redis::ConnectionAddr::Tcp("::1".into(), 26380),
            ]
        );
        let plain = parse("redis+sentinel://127.0.0.1:26379/cache").expect("a valid URL");
        assert_eq!((plain.db, plain.username, plain.password), (0, None, None));
        // A Sentinel's port defaults to 26379, not Redis's 6379.
        let bare = parse("redis+sentinel://s1,[::1],s3:26400/cache").expect("a valid URL");
        assert_eq!(
            bare.sentinels,
            vec![
                redis::ConnectionAddr::Tcp("s1".into(), 26379),
                redis::ConnectionAddr::Tcp("::1".into(), 26379),
                redis::ConnectionAddr::Tcp("s3".into(), 26400),
            ]
        );
    }

    #[test]
    fn sentinel_addresses_take_a_default_port_and_nothing_else() {
        let addrs = sentinel_addrs(["10.0.0.1", "10.0.0.2:26380"], false).expect("valid");
        assert_eq!(
            addrs,
            vec![
                redis::ConnectionAddr::Tcp("10.0.0.1".into(), 26379),
                redis::ConnectionAddr::Tcp("10.0.0.2".into(), 26380),
            ]
        );
        for (hosts, reason) in [
            (&[][..], "at least one"),
            (&[""][..], "is empty"),
            (&["h:1/x"][..], "nothing more"),
            (&["user:pw@h:1"][..], "nothing more"),
        ] {
            let error = sentinel_addrs(hosts.iter().copied(), false)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(reason), "{hosts:?}: {error}");
        }
    }

    #[test]
    fn bad_sentinel_urls_are_refused_with_the_reason() {
        for (url, reason) in [
            ("redis+sentinel://127.0.0.1:26379", "names its service"),
            ("redis+sentinel://127.0.0.1:26379/", "names its service"),
            ("redis+sentinel:///mymaster", "at least one host"),
            ("redis+sentinel://h:1/a/0/extra", "/service or /service/db"),
            ("redis+sentinel://h:1,,h:2/svc", "is empty"),
            ("redis+sentinel://h:1/svc?protocol=resp3", "no query"),
            ("redis+sentinel://h:1/svc#insecure", "no query"),
        ] {
            let error = parse(url).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(error.contains(reason), "{url}: {error}");
        }
        assert!(parse("redis+sentinel://h:1/svc/notanumber").is_err());
        assert!(parse("redis+sentinel://h:notaport/svc").is_err());
    }
}
