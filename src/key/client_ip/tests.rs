//! The tests of `client_ip`.

use super::*;
use std::net::SocketAddr;

fn req(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
    let mut builder = Request::get("/");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let mut request = builder.body(()).unwrap();
    request
        .extensions_mut()
        .insert(peer.parse::<SocketAddr>().unwrap());
    request
}

fn key(extractor: &ClientIp, peer: &str, headers: &[(&str, &str)]) -> String {
    extractor.extract(&req(peer, headers)).unwrap().unwrap()
}

#[test]
fn without_trusted_proxies_headers_are_ignored() {
    let untrusting = client_ip();
    let spoofed = [
        ("x-forwarded-for", "1.1.1.1"),
        ("forwarded", "for=2.2.2.2"),
        ("x-real-ip", "3.3.3.3"),
    ];
    assert_eq!(key(&untrusting, "198.51.100.7:1", &spoofed), "198.51.100.7");
}

#[test]
fn the_rightmost_untrusted_address_wins() {
    let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let xff = [("x-forwarded-for", "6.6.6.6, 203.0.113.9, 10.1.1.1")];
    assert_eq!(key(&behind, "10.0.0.2:1", &xff), "203.0.113.9");
    // A peer outside the trusted set is the client, whatever it sends.
    assert_eq!(key(&behind, "198.51.100.7:1", &xff), "198.51.100.7");
    // Several header lines count as one list, in order.
    let split = [
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-for", "203.0.113.9, 10.1.1.1"),
    ];
    assert_eq!(key(&behind, "10.0.0.2:1", &split), "203.0.113.9");
    // Every entry trusted: the leftmost one is the client.
    let internal = [("x-forwarded-for", "10.9.9.9, 10.1.1.1")];
    assert_eq!(key(&behind, "10.0.0.2:1", &internal), "10.9.9.9");
    // No header: the proxy itself.
    assert_eq!(key(&behind, "10.0.0.2:1", &[]), "10.0.0.2");
}

#[test]
fn forwarded_and_x_real_ip() {
    let fwd = client_ip()
        .trusting(["10.0.0.0/8"])
        .unwrap()
        .header(ProxyHeader::Forwarded);
    let headers = [(
        "forwarded",
        "for=6.6.6.6, for=\"[2001:db8:cafe::17]:4711\";proto=https, for=10.0.0.9;by=10.0.0.1",
    )];
    assert_eq!(key(&fwd, "10.0.0.2:1", &headers), "2001:db8:cafe::/64");
    // The X-Forwarded-For a client sends is not read by this extractor.
    let forged = [
        ("x-forwarded-for", "1.1.1.1"),
        ("forwarded", "for=203.0.113.5"),
    ];
    assert_eq!(key(&fwd, "10.0.0.2:1", &forged), "203.0.113.5");
    let real = client_ip()
        .trusting(["10.0.0.2"])
        .unwrap()
        .header(ProxyHeader::XRealIp);
    assert_eq!(
        key(&real, "10.0.0.2:1", &[("x-real-ip", "203.0.113.5")]),
        "203.0.113.5"
    );
    assert_eq!(
        key(&real, "10.0.0.3:1", &[("x-real-ip", "203.0.113.5")]),
        "10.0.0.3"
    );
    assert_eq!(
        key(&real, "10.0.0.2:1", &[("x-real-ip", "garbage")]),
        "10.0.0.2"
    );
}

#[test]
fn hostile_values_never_panic_and_never_pick_the_key() {
    let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let huge = vec!["7.7.7.7"; 5_000].join(", ") + ", 10.1.1.1";
    let cases: Vec<(String, &str)> = vec![
        ("garbage, 10.1.1.1".into(), "10.1.1.1"),
        ("203.0.113.9, garbage".into(), "10.0.0.2"),
        (huge, "7.7.7.7"),
        ("[fe80::1%25eth0]:80, 10.1.1.1".into(), "fe80::/64"),
        ("fe80::1%eth0, 10.1.1.1".into(), "fe80::/64"),
        ("203.0.113.9:8080".into(), "203.0.113.9"),
        ("[2001:db8::1]:443".into(), "2001:db8::/64"),
        (",,,".into(), "10.0.0.2"),
        ("\"\"".into(), "10.0.0.2"),
        ("999.1.1.1".into(), "10.0.0.2"),
        (format!("{}, 10.1.1.1", "9".repeat(10_000)), "10.1.1.1"),
    ];
    for (value, expected) in cases {
        let headers = [("x-forwarded-for", value.as_str())];
        assert_eq!(
            key(&behind, "10.0.0.2:1", &headers),
            expected,
            "{value:.60}"
        );
    }
    // Bytes that are not text in the client's part of the line do not
    // hide the address its proxy appended.
    let mut raw = req("10.0.0.2:1", &[]);
    raw.headers_mut().insert(
        "x-forwarded-for",
        http::HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.9").unwrap(),
    );
    assert_eq!(
        behind.extract(&raw).unwrap().as_deref(),
        Some("203.0.113.9")
    );
    // 5,000 trusted hops: only MAX_HOPS are walked; the client is not believed.
    let trusted_chain = vec!["10.5.5.5"; 5_000].join(", ");
    let headers = [("x-forwarded-for", trusted_chain.as_str())];
    assert_eq!(key(&behind, "10.0.0.2:1", &headers), "10.5.5.5");
}

#[test]
fn ipv6_clients_are_grouped() {
    let direct = client_ip();
    assert_eq!(
        key(&direct, "[2001:db8:1:2:3:4:5:6]:1", &[]),
        "2001:db8:1:2::/64"
    );
    assert_eq!(
        key(
            &direct.clone().ipv6_prefix(48),
            "[2001:db8:1:2:3:4:5:6]:1",
            &[]
        ),
        "2001:db8:1::/48"
    );
    assert_eq!(
        key(&direct.ipv6_prefix(128), "[2001:db8:1:2:3:4:5:6]:1", &[]),
        "2001:db8:1:2:3:4:5:6"
    );
    assert_eq!(
        key(&client_ip(), "[::ffff:198.51.100.7]:1", &[]),
        "198.51.100.7"
    );
}

#[test]
fn ipv4_mapped_hops_peers_and_cidrs_count_as_ipv4() {
    let behind = client_ip().trusting(["10.0.0.0/8"]).unwrap();
    // A dual-stack proxy writes its IPv4 hop IPv4-mapped.
    let mapped_hop = [("x-forwarded-for", "203.0.113.9, ::ffff:10.0.0.5")];
    assert_eq!(key(&behind, "10.0.0.2:1", &mapped_hop), "203.0.113.9");
    let bracketed = [("x-forwarded-for", "203.0.113.9, [::ffff:10.0.0.5]:443")];
    assert_eq!(key(&behind, "10.0.0.2:1", &bracketed), "203.0.113.9");
    // A dual-stack listener gives the peer IPv4-mapped.
    let plain = [("x-forwarded-for", "203.0.113.9")];
    assert_eq!(key(&behind, "[::ffff:10.0.0.2]:1", &plain), "203.0.113.9");
    assert_eq!(
        key(&behind, "[::ffff:10.0.0.2]:1", &mapped_hop),
        "203.0.113.9"
    );
    // The client seen IPv4-mapped is the same client, with the same key.
    let mapped_client = [("x-forwarded-for", "::ffff:203.0.113.9, 10.0.0.5")];
    assert_eq!(key(&behind, "10.0.0.2:1", &mapped_client), "203.0.113.9");
    // Forwarded and X-Real-IP too.
    let fwd = behind.clone().header(ProxyHeader::Forwarded);
    let headers = [("forwarded", "for=203.0.113.9, for=\"[::ffff:10.0.0.5]\"")];
    assert_eq!(key(&fwd, "[::ffff:10.0.0.2]:1", &headers), "203.0.113.9");
    let real = behind.header(ProxyHeader::XRealIp);
    let headers = [("x-real-ip", "::ffff:203.0.113.9")];
    assert_eq!(key(&real, "[::ffff:10.0.0.2]:1", &headers), "203.0.113.9");
    // Trusted proxies written IPv4-mapped match both forms.
    for trusted in ["::ffff:10.0.0.0/104", "::ffff:10.0.0.2", "::ffff:a00:0/104"] {
        let mapped = client_ip().trusting([trusted]).unwrap();
        for peer in ["10.0.0.2:1", "[::ffff:10.0.0.2]:1"] {
            assert_eq!(
                key(&mapped, peer, &plain),
                "203.0.113.9",
                "{trusted} {peer}"
            );
        }
    }
    let mapped = client_ip().trusting(["::ffff:10.0.0.0/104"]).unwrap();
    assert_eq!(key(&mapped, "10.0.0.2:1", &mapped_hop), "203.0.113.9");
    // Outside the mapped block: not trusted.
    assert_eq!(key(&mapped, "11.0.0.2:1", &plain), "11.0.0.2");
    // An IPv4-mapped address with a prefix reaching outside the mapped
    // block is a mistake (it would trust ::/8): named, not guessed.
    let err = client_ip().trusting(["::ffff:10.0.0.0/8"]).unwrap_err();
    assert!(err.to_string().contains("\"::ffff:10.0.0.0/8\""), "{err}");
    assert!(err.to_string().contains("(10.0.0.0/8)"), "{err}");
    assert!(err.to_string().contains("(::ffff:10.0.0.0/104)"), "{err}");
    // An IPv6 block never covers IPv4 peers, however they are written.
    let v6_only = client_ip().trusting(["::/0"]).unwrap();
    assert_eq!(key(&v6_only, "10.0.0.2:1", &plain), "10.0.0.2");
    assert_eq!(key(&v6_only, "[::ffff:10.0.0.2]:1", &plain), "10.0.0.2");
    assert_eq!(key(&v6_only, "[2001:db8::1]:1", &plain), "203.0.113.9");
}

#[test]
fn x_real_ip_is_the_last_entry_the_trusted_proxy_wrote() {
    let real = client_ip()
        .trusting(["10.0.0.2"])
        .unwrap()
        .header(ProxyHeader::XRealIp);
    // A proxy that appends its line after the client's own.
    let appended = [("x-real-ip", "6.6.6.6"), ("x-real-ip", "203.0.113.5")];
    assert_eq!(key(&real, "10.0.0.2:1", &appended), "203.0.113.5");
    // The same lines combined into one, as an intermediary may.
    let combined = [("x-real-ip", "6.6.6.6, 203.0.113.5")];
    assert_eq!(key(&real, "10.0.0.2:1", &combined), "203.0.113.5");
    // A malformed last entry never falls back to the client's.
    let broken = [("x-real-ip", "6.6.6.6"), ("x-real-ip", "garbage")];
    assert_eq!(key(&real, "10.0.0.2:1", &broken), "10.0.0.2");
    let empty_last = [("x-real-ip", "6.6.6.6, ")];
    assert_eq!(key(&real, "10.0.0.2:1", &empty_last), "10.0.0.2");
    let mut raw = req("10.0.0.2:1", &[("x-real-ip", "6.6.6.6")]);
    raw.headers_mut().append(
        "x-real-ip",
        http::HeaderValue::from_bytes(b"\xff203.0.113.5").unwrap(),
    );
    assert_eq!(real.extract(&raw).unwrap().as_deref(), Some("10.0.0.2"));
}

#[test]
fn forwarded_lines_are_one_list_in_order() {
    let fwd = client_ip()
        .trusting(["10.0.0.0/8"])
        .unwrap()
        .header(ProxyHeader::Forwarded);
    let lines = [
        ("forwarded", "for=6.6.6.6"),
        ("forwarded", "for=203.0.113.9;proto=https"),
        ("forwarded", "for=10.0.0.7, for=10.0.0.8"),
    ];
    assert_eq!(key(&fwd, "10.0.0.2:1", &lines), "203.0.113.9");
    // A malformed entry in a later line ends the walk there.
    let broken = [
        ("forwarded", "for=6.6.6.6"),
        ("forwarded", "for=_hidden, for=10.0.0.7"),
    ];
    assert_eq!(key(&fwd, "10.0.0.2:1", &broken), "10.0.0.7");
    let xff = client_ip().trusting(["10.0.0.0/8"]).unwrap();
    let lines = [
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-for", "10.0.0.7"),
    ];
    assert_eq!(key(&xff, "10.0.0.2:1", &lines), "203.0.113.9");
}

#[test]
fn bad_trusted_entries_are_named() {
    let err = client_ip()
        .trusting(["10.0.0.0/8", "ten.0.0.0/8"])
        .unwrap_err();
    assert!(err.to_string().contains("\"ten.0.0.0/8\""), "{err}");
    assert!(client_ip().trusting(["10.0.0.0/33"]).is_err());
    assert!(
        client_ip()
            .trusting(["::1", "2001:db8::/32", " 10.0.0.1 "])
            .is_ok()
    );
}
