//! The key extractors: what key each picks, and what it refuses.

use super::*;

#[test]
fn a_key_hashes_alike_before_and_after_namespacing() {
    let before = KeyHash::of("3/s", "203.0.113.9").to_string();
    assert_eq!(before, KeyHash::stored("3/s:203.0.113.9").to_string());
    assert_eq!(before.len(), 12);
    assert_ne!(before, KeyHash::stored("203.0.113.9").to_string());
    // A long key: the same hash from the key as extracted, as held and as
    // stored, so one client is followed across every log.
    let long = "k".repeat(500);
    let held = crate::store::bounded_key(&long).into_owned();
    let of = KeyHash::of("api", &long).to_string();
    assert_eq!(of, KeyHash::held("api", &held).to_string());
    assert_eq!(of, KeyHash::stored(&format!("api:{held}")).to_string());
}

fn req(path: &str) -> http::request::Builder {
    Request::get(path)
}

#[test]
fn peer_ip_reads_the_socket_address_only() {
    let mut r = req("/")
        .header("x-forwarded-for", "1.2.3.4")
        .body(())
        .unwrap();
    let err = peer_ip().extract(&r).unwrap_err();
    assert!(
        err.to_string()
            .contains("into_make_service_with_connect_info"),
        "{err}"
    );
    r.extensions_mut()
        .insert("198.51.100.7:5000".parse::<SocketAddr>().unwrap());
    assert_eq!(
        peer_ip().extract(&r).unwrap().as_deref(),
        Some("198.51.100.7")
    );
    r.extensions_mut()
        .insert("[::ffff:198.51.100.8]:5000".parse::<SocketAddr>().unwrap());
    assert_eq!(
        peer_ip().extract(&r).unwrap().as_deref(),
        Some("198.51.100.8")
    );
}

#[cfg(feature = "axum")]
#[test]
fn peer_ip_reads_axum_connect_info() {
    let mut r = req("/").body(()).unwrap();
    let addr: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
    r.extensions_mut().insert(axum::extract::ConnectInfo(addr));
    assert_eq!(
        peer_ip().extract(&r).unwrap().as_deref(),
        Some("2001:db8::/64")
    );
    let each = peer_ip().ipv6_prefix(128);
    assert_eq!(each.extract(&r).unwrap().as_deref(), Some("2001:db8::1"));
}

#[test]
fn header_keys_and_fallbacks() {
    let with = req("/").header("x-api-key", "abc").body(()).unwrap();
    let without = req("/").body(()).unwrap();
    assert_eq!(
        header("x-api-key").extract(&with).unwrap().as_deref(),
        Some("abc")
    );
    assert_eq!(header("x-api-key").extract(&without).unwrap(), None);
    let fallback = header("x-api-key").or(global());
    assert_eq!(fallback.extract(&with).unwrap().as_deref(), Some("abc"));
    assert_eq!(
        fallback.extract(&without).unwrap().as_deref(),
        Some("+global")
    );
    // A header equal to the fallback's key cannot take its place.
    let forged = req("/").header("x-api-key", "+global").body(()).unwrap();
    assert_eq!(
        fallback.extract(&forged).unwrap().as_deref(),
        Some("%2Bglobal")
    );
    let binary = req("/")
        .header(
            "x-api-key",
            http::HeaderValue::from_bytes(b"a\xffb").unwrap(),
        )
        .body(())
        .unwrap();
    assert_eq!(
        header("x-api-key").extract(&binary).unwrap().as_deref(),
        Some("hex:61ff62")
    );
}

#[test]
fn a_plain_value_never_takes_an_encoded_value_s_key() {
    let extractor = header("x-api-key");
    let key_of = |value: &[u8]| {
        let r = req("/")
            .header("x-api-key", http::HeaderValue::from_bytes(value).unwrap())
            .body(())
            .unwrap();
        extractor.extract(&r).unwrap().unwrap()
    };
    let binary = key_of(b"a\xffb");
    assert_eq!(binary, "hex:61ff62");
    let forged = key_of(b"hex:61ff62");
    assert_ne!(
        forged, binary,
        "a plain header value took a binary value's key"
    );
    assert_eq!(forged, "hex:6865783a363166663632");
    // Other plain values stay readable.
    assert_eq!(key_of(b"k-123 v2"), "k-123 v2");
    assert_eq!(key_of(b"HEX:61ff62"), "HEX:61ff62");
}

/// Every built-in extractor and combination, over values chosen to hit
/// each separator and marker: two requests get one key only when they
/// are the same client.
#[test]
fn every_combination_is_injective() {
    use std::collections::HashMap;

    let values: Vec<Option<&[u8]>> = vec![
        None,
        Some(b""),
        Some(b"a"),
        Some(b"a+"),
        Some(b"+a"),
        Some(b"+"),
        Some(b"a+b"),
        Some(b"%"),
        Some(b"%2B"),
        Some(b"%25"),
        Some(b"%252B"),
        Some(b"a%2Bb"),
        Some(b"hex:"),
        Some(b"hex:61"),
        Some(b"hex:61ff62"),
        Some(b"hex:6865783a3631"),
        Some(b"a\xffb"),
        Some(b"\xff"),
        Some(b"hex:\xff"),
        Some(b"global"),
        Some(b"+global"),
        Some(b"198.51.100.7"),
        Some(b"+198.51.100.7"),
        Some(b"2001:db8::/64"),
        Some(b" a"),
        Some(b"a\t"),
        Some(b"a:b"),
    ];
    let paths = [
        "/",
        "/a",
        "/a+",
        "/+a",
        "/a%2B",
        "/a%252B",
        "/hex:61ff62",
        "/login",
        "/login/",
        "/a+/b",
    ];
    let peers = [
        "198.51.100.7:1",
        "[2001:db8::1]:1",
        "[::ffff:198.51.100.8]:1",
    ];

    struct Input<'a> {
        h1: Option<&'a [u8]>,
        h2: Option<&'a [u8]>,
        path: &'a str,
        peer: IpAddr,
    }
    let peer_id = |ip: IpAddr| format!("{:?}", canonical_ip(ip));
    type Identity = fn(&Input<'_>, &dyn Fn(IpAddr) -> String) -> Option<String>;
    let cases: Vec<(&str, Box<dyn KeyExtractor<()>>, Identity)> = vec![
        ("header", Box::new(header("h1")), |i, _| {
            i.h1.map(|v| format!("{v:?}"))
        }),
        (
            "header.and(header)",
            Box::new(header("h1").and(header("h2"))),
            |i, _| Some(format!("{:?}+{:?}", i.h1?, i.h2?)),
        ),
        (
            "header.or(header)",
            Box::new(header("h1").or(header("h2"))),
            |i, _| match i.h1 {
                Some(v) => Some(format!("first {v:?}")),
                None => i.h2.map(|v| format!("second {v:?}")),
            },
        ),
        (
            "header.or(peer_ip)",
            Box::new(header("h1").or(peer_ip())),
            |i, p| {
                Some(match i.h1 {
                    Some(v) => format!("first {v:?}"),
                    None => format!("second {}", p(i.peer)),
                })
            },
        ),
        (
            "header.or(global)",
            Box::new(header("h1").or(global())),
            |i, _| {
                Some(match i.h1 {
                    Some(v) => format!("first {v:?}"),
                    None => "second".to_owned(),
                })
            },
        ),
        (
            "header.and(path)",
            Box::new(header("h1").and(path())),
            |i, _| Some(format!("{:?}+{:?}", i.h1?, i.path)),
        ),
        (
            "peer_ip.and(path)",
            Box::new(peer_ip().and(path())),
            |i, p| Some(format!("{}+{:?}", p(i.peer), i.path)),
        ),
        (
            "header.or(peer_ip).and(path)",
            Box::new(header("h1").or(peer_ip()).and(path())),
            |i, p| {
                let first = match i.h1 {
                    Some(v) => format!("first {v:?}"),
                    None => format!("second {}", p(i.peer)),
                };
                Some(format!("{first}+{:?}", i.path))
            },
        ),
        (
            "header.and(header).or(path)",
            Box::new(header("h1").and(header("h2")).or(path())),
            |i, _| {
                Some(match (i.h1, i.h2) {
                    (Some(a), Some(b)) => format!("first {a:?}+{b:?}"),
                    _ => format!("second {:?}", i.path),
                })
            },
        ),
        (
            "and(header, header.and(path))",
            Box::new(and(header("h1"), header("h2").and(path()))),
            |i, _| Some(format!("{:?}+{:?}+{:?}", i.h1?, i.h2?, i.path)),
        ),
        (
            "or(header, or(header, peer_ip))",
            Box::new(or(header("h1"), or(header("h2"), peer_ip()))),
            |i, p| {
                Some(match (i.h1, i.h2) {
                    (Some(a), _) => format!("first {a:?}"),
                    (None, Some(b)) => format!("second {b:?}"),
                    (None, None) => format!("third {}", p(i.peer)),
                })
            },
        ),
    ];
    for (name, extractor, identity) in &cases {
        let mut seen: HashMap<String, String> = HashMap::new();
        for &a in &values {
            for &b in &values {
                for path in paths {
                    for peer in peers {
                        let mut builder = req(path);
                        if let Some(v) = a {
                            builder =
                                builder.header("h1", http::HeaderValue::from_bytes(v).unwrap());
                        }
                        if let Some(v) = b {
                            builder =
                                builder.header("h2", http::HeaderValue::from_bytes(v).unwrap());
                        }
                        let mut r = builder.body(()).unwrap();
                        let addr: SocketAddr = peer.parse().unwrap();
                        r.extensions_mut().insert(addr);
                        let input = Input {
                            h1: a,
                            h2: b,
                            path,
                            peer: addr.ip(),
                        };
                        let id = identity(&input, &peer_id);
                        let got = extractor.extract(&r).unwrap();
                        assert_eq!(got.is_some(), id.is_some(), "{name}: {got:?} for {id:?}");
                        let (Some(key), Some(id)) = (got, id) else {
                            continue;
                        };
                        if let Some(other) = seen.insert(key.clone(), id.clone()) {
                            assert_eq!(other, id, "{name}: two clients share the key {key:?}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn and_escapes_so_pairs_cannot_collide() {
    let mut r = req("/login/").body(()).unwrap();
    r.extensions_mut()
        .insert("127.0.0.1:1".parse::<SocketAddr>().unwrap());
    assert_eq!(
        peer_ip().and(path()).extract(&r).unwrap().as_deref(),
        Some("127.0.0.1+/login/")
    );
    let a = req("/b").header("k", "a+").body(()).unwrap();
    let b = req("/+b").header("k", "a").body(()).unwrap();
    let both = header("k").and(path());
    assert_ne!(both.extract(&a).unwrap(), both.extract(&b).unwrap());
    assert_eq!(both.extract(&a).unwrap().as_deref(), Some("a%2B+/b"));
    let none = req("/").body(()).unwrap();
    assert_eq!(both.extract(&none).unwrap(), None);
}

#[test]
fn closures_are_extractors() {
    let by_path = |r: &Request<()>| (r.uri().path() != "/health").then(|| r.uri().path().len());
    assert_eq!(
        by_path
            .extract(&req("/abc").body(()).unwrap())
            .unwrap()
            .as_deref(),
        Some("4")
    );
    assert_eq!(
        by_path.extract(&req("/health").body(()).unwrap()).unwrap(),
        None
    );
    let combined = and(by_path, global());
    assert_eq!(
        combined
            .extract(&req("/ab").body(()).unwrap())
            .unwrap()
            .as_deref(),
        Some("3+global")
    );
}
