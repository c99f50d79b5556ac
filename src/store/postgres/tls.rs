//! TLS to PostgreSQL as libpq's `sslmode` and `sslrootcert` say, through
//! rustls: the settings read out of a connection string that tokio-postgres
//! does not read itself.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::store::StoreError;

/// The connector every session of a store connects with.
pub(super) type Tls = MakeRustlsConnect;

/// How much of the server's certificate is checked: libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Disable,
    /// TLS when the server offers it, its certificate not checked (libpq's
    /// default).
    Prefer,
    /// TLS always, its certificate not checked (unless `sslrootcert` is
    /// given: then as `VerifyCa`).
    Require,
    /// TLS always, the certificate signed by a root of `sslrootcert`.
    VerifyCa,
    /// As `VerifyCa`, and issued to the host connected to.
    VerifyFull,
}

/// A connection string's own settings and its TLS connector.
pub(super) fn configure(url: &str) -> Result<(tokio_postgres::Config, Tls), StoreError> {
    let (rest, mode, root) = split(url)?;
    let mut config: tokio_postgres::Config = rest.parse().map_err(super::postgres)?;
    let mode = match (mode, &root) {
        (Mode::Require, Some(_)) => Mode::VerifyCa,
        (mode, _) => mode,
    };
    config.ssl_mode(match mode {
        Mode::Disable => SslMode::Disable,
        Mode::Prefer => SslMode::Prefer,
        Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
    });
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        Mode::Disable | Mode::Prefer | Mode::Require => Arc::new(Unchecked(Arc::clone(&provider))),
        Mode::VerifyCa | Mode::VerifyFull => {
            let Some(path) = root else {
                return Err(settings(
                    "sslmode=verify-ca and verify-full need sslrootcert=<file of PEM root certificates>",
                ));
            };
            let mut roots = RootCertStore::empty();
            let certificates = CertificateDer::pem_file_iter(&path)
                .map_err(|e| settings(&format!("sslrootcert {path}: {e}")))?;
            for certificate in certificates {
                let certificate =
                    certificate.map_err(|e| settings(&format!("sslrootcert {path}: {e}")))?;
                roots
                    .add(certificate)
                    .map_err(|e| settings(&format!("sslrootcert {path}: {e}")))?;
            }
            if roots.is_empty() {
                return Err(settings(&format!(
                    "sslrootcert {path} holds no PEM certificate"
                )));
            }
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| settings(&format!("sslrootcert {path}: {e}")))?;
            Arc::new(Verified {
                webpki,
                names: mode == Mode::VerifyFull,
            })
        }
    };
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| settings(&e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok((config, MakeRustlsConnect::new(client)))
}

/// The connection string without `sslmode` and `sslrootcert`, and those two,
/// in either form: `postgres://…?sslmode=…&sslrootcert=…` or `key=value`
/// words.
fn split(url: &str) -> Result<(String, Mode, Option<String>), StoreError> {
    let mut mode = Mode::Prefer;
    let mut root = None;
    let mut take = |key: &str, value: &str| -> Result<bool, StoreError> {
        match key {
            "sslmode" => {
                mode = match value {
                    "disable" => Mode::Disable,
                    "allow" | "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-ca" => Mode::VerifyCa,
                    "verify-full" => Mode::VerifyFull,
                    other => {
                        return Err(settings(&format!(
                            "sslmode={other:?}: not disable, allow, prefer, require, verify-ca or verify-full"
                        )));
                    }
                };
                Ok(true)
            }
            "sslrootcert" => {
                root = Some(value.to_owned());
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&') {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(key, &percent_decoded(value))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        // `key = value`, spaces around the `=` (as libpq takes it): one
        // word.
        let mut settings: Vec<String> = Vec::new();
        for word in words(url) {
            match settings.last_mut() {
                Some(last) if last.ends_with('=') || word.starts_with('=') => last.push_str(word),
                _ => settings.push(word.to_owned()),
            }
        }
        let mut kept = Vec::new();
        for word in &settings {
            let (key, value) = word.split_once('=').unwrap_or((word, ""));
            let unquoted = value
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .map_or_else(|| value.to_owned(), |v| v.replace("\\'", "'"));
            if !take(key.trim(), unquoted.trim())? {
                kept.push(word.as_str());
            }
        }
        kept.join(" ")
    };
    Ok((rest, mode, root))
}

/// The `key=value` words of a connection string; a quoted value may hold
/// spaces.
fn words(text: &str) -> Vec<&str> {
    let mut words = Vec::new();
    let mut start = None;
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        if start.is_none() {
            if c.is_whitespace() {
                continue;
            }
            start = Some(i);
        }
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => {
                if let Some(s) = start.take() {
                    words.push(&text[s..i]);
                }
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        words.push(&text[s..]);
    }
    words
}

/// `%XX` escapes of a URL's query value decoded.
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn settings(what: &str) -> StoreError {
    StoreError::UnexpectedReply(format!("PostgresStore: {what}"))
}

/// `sslmode=prefer` and `require`, as libpq: the session is encrypted, the
/// server's certificate is not checked (its signature over the handshake
/// is).
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca` (the chain to a root of `sslrootcert`) and
/// `verify-full` (and the host's name).
#[derive(Debug)]
struct Verified {
    webpki: Arc<WebPkiServerVerifier>,
    names: bool,
}

impl ServerCertVerifier for Verified {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        match verified {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.names => Ok(ServerCertVerified::assertion()),
            verified => verified,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_are_read_out_of_both_forms() {
        let (rest, mode, root) = split(
            "postgres://u@h/db?sslmode=verify-full&application_name=x&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@h/db?application_name=x");
        assert_eq!(mode, Mode::VerifyFull);
        assert_eq!(root.as_deref(), Some("/tmp/ca.pem"));
        let (rest, mode, root) =
            split("host=h user=u sslmode=require  sslrootcert='/a b/ca.pem' dbname=d").unwrap();
        assert_eq!(rest, "host=h user=u dbname=d");
        assert_eq!(mode, Mode::Require);
        assert_eq!(root.as_deref(), Some("/a b/ca.pem"));
        assert_eq!(split("host=h").unwrap().1, Mode::Prefer);
        let (rest, mode, _) = split("host = h sslmode =verify-ca user= u").unwrap();
        assert_eq!((rest.as_str(), mode), ("host=h user=u", Mode::VerifyCa));
        let error = split("host=h sslmode=verify").unwrap_err().to_string();
        assert!(error.contains("sslmode"), "{error}");
    }

    #[test]
    fn verification_without_roots_is_refused_naming_the_setting() {
        let Err(error) = configure("host=h sslmode=verify-full") else {
            panic!("verify-full without roots was accepted");
        };
        let error = error.to_string();
        assert!(error.contains("sslrootcert"), "{error}");
        let (config, _) = configure("host=h sslmode=disable").unwrap();
        assert_eq!(config.get_ssl_mode(), SslMode::Disable);
    }
}
