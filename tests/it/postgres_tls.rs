//! TLS to PostgreSQL as libpq's `sslmode` and `sslrootcert` say, against a
//! real server that refuses plain connections and presents a certificate
//! of the test's own authority.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support::postgres::PostgresServer;
use crate::support::tls::Ca;
use tower_redis_ratelimit::{Policy, PostgresStore, Store};

/// The settings of a session to `host` on `server`, with `more`.
fn url(server: &PostgresServer, host: &str, more: &str) -> String {
    format!(
        "host={host} port={} user=postgres dbname=postgres {more}",
        server.port()
    )
}

/// Connect with `url` and decide once: the error, if any.
async fn decide(url: &str) -> Result<(), String> {
    let store = PostgresStore::connect(url)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let policy: Policy = "5/min".parse().unwrap();
    let decision = store
        .check("k", &policy)
        .await
        .map_err(|e| format!("{e:?}"))?;
    assert!(decision.allowed());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sslmode_against_a_server_that_takes_tls_only() {
    let ca = Ca::new("the test's authority");
    let server = PostgresServer::start_tls(&ca.server(&["localhost", "127.0.0.1"]));
    let dir = tempfile_dir();
    let root = dir.join("root.pem");
    std::fs::write(&root, ca.pem()).unwrap();
    let other = dir.join("other.pem");
    std::fs::write(&other, Ca::new("another authority").pem()).unwrap();
    let root = root.display().to_string();
    let other = other.display().to_string();

    // Plain: refused by the server.
    let error = decide(&url(&server, "127.0.0.1", "sslmode=disable"))
        .await
        .unwrap_err();
    assert!(
        error.contains("no pg_hba.conf entry") || error.contains("SSL off"),
        "{error}"
    );
    // prefer (libpq's default) and require: encrypted, the certificate not
    // checked.
    decide(&url(&server, "127.0.0.1", "")).await.unwrap();
    decide(&url(&server, "127.0.0.1", "sslmode=require"))
        .await
        .unwrap();
    let error = decide(&url(
        &server,
        "127.0.0.1",
        &format!("sslmode=require sslrootcert={other}"),
    ))
    .await
    .expect_err("require with a root checks the chain, as verify-ca");
    assert!(error.contains("UnknownIssuer"), "{error}");
    // verify-full: the chain and the host's name.
    decide(&url(
        &server,
        "localhost",
        &format!("sslmode=verify-full sslrootcert={root}"),
    ))
    .await
    .unwrap();
    decide(&url(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert='{root}'"),
    ))
    .await
    .unwrap();
    let error = decide(&url(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={other}"),
    ))
    .await
    .unwrap_err();
    assert!(error.to_lowercase().contains("certificate"), "{error}");
    // The URL form.
    decide(&format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={root}",
        server.port()
    ))
    .await
    .unwrap();
    let error = decide(&url(&server, "127.0.0.1", "sslmode=verify-full"))
        .await
        .unwrap_err();
    assert!(error.contains("sslrootcert"), "{error}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A certificate for another host name: verify-full refuses it, verify-ca
/// (the chain only) takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_checks_the_chain_and_verify_full_the_name_too() {
    let ca = Ca::new("the test's authority");
    let server = PostgresServer::start_tls(&ca.server(&["db.example"]));
    let dir = tempfile_dir();
    let root = dir.join("root.pem");
    std::fs::write(&root, ca.pem()).unwrap();
    let root = root.display().to_string();
    let error = decide(&url(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-full sslrootcert={root}"),
    ))
    .await
    .unwrap_err();
    assert!(error.contains("NotValidForName"), "{error}");
    decide(&url(
        &server,
        "127.0.0.1",
        &format!("sslmode=verify-ca sslrootcert={root}"),
    ))
    .await
    .unwrap();
}

/// A directory of the test's own for the root certificates.
fn tempfile_dir() -> std::path::PathBuf {
    static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pg-tls-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
