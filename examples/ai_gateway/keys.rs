//! The keys file: each API key a client may send, and the user, team and
//! organisation it spends for. The authentication in front of the limits
//! sets them as the `x-gateway-*` headers the rules key on, after
//! removing any a client sent: a client cannot pick whose budget it
//! spends.
//!
//! The file is read again when it changes (checked every second): a key
//! added or revoked is in force within a second, in this process; a file
//! that no longer reads is logged and the keys in force stay.
//!
//! ```toml
//! [keys."sk-alice-1"]
//! name = "alice-laptop"   # how budgets and logs name the key (default: key-<hash>)
//! user = "alice"
//! team = "red"
//! org = "acme"
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::Deserialize;

/// The headers the rules key on, in the order of the hierarchy.
pub(crate) const HIERARCHY: [HeaderName; 4] = [
    HeaderName::from_static("x-gateway-key"),
    HeaderName::from_static("x-gateway-user"),
    HeaderName::from_static("x-gateway-team"),
    HeaderName::from_static("x-gateway-org"),
];

/// The most bytes a keys file may hold.
const MAX_FILE: u64 = 16 << 20;

/// Who a key spends for: its name, user, team and organisation, as header
/// values.
#[derive(Clone)]
pub(crate) struct Account {
    levels: [HeaderValue; 4],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: HashMap<String, AccountSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AccountSpec {
    name: Option<String>,
    user: String,
    team: String,
    org: String,
}

/// Every key, by the secret a client sends (its `Debug` shows how many,
/// never a secret).
pub(crate) struct Keys {
    accounts: HashMap<String, Account>,
}

impl Keys {
    /// Read the keys file at `path`; the problem, named, when it does not
    /// read.
    pub(crate) fn read(path: &Path) -> Result<Self, String> {
        let size = std::fs::metadata(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?
            .len();
        if size > MAX_FILE {
            return Err(format!("{} is over {MAX_FILE} bytes", path.display()));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        // Where it does not read, never what: a message may quote a key.
        let file: KeysFile = toml::from_str(&text).map_err(|e| {
            let at = e
                .span()
                .map_or(0, |span| text[..span.start].lines().count().max(1));
            format!(
                "{}: line {at} does not read as a table of keys, each with its name, user, team \
                 and org",
                path.display()
            )
        })?;
        let mut accounts = HashMap::with_capacity(file.keys.len());
        for (secret, spec) in file.keys {
            let name = spec.name.unwrap_or_else(|| {
                let hash = sha1_smol::Sha1::from(secret.as_bytes())
                    .digest()
                    .to_string();
                format!("key-{}", &hash[..12])
            });
            let value = |field: &str, text: String| {
                let fits = !text.is_empty()
                    && text.len() <= 128
                    && text.bytes().all(|b| b.is_ascii_graphic());
                fits.then(|| HeaderValue::from_str(&text).ok())
                    .flatten()
                    .ok_or_else(|| {
                        format!(
                            "{}: the {field} of key {name:?} must be 1 to 128 visible ASCII characters",
                            path.display()
                        )
                    })
            };
            if secret.len() < 8 {
                return Err(format!(
                    "{}: the key named {name:?} is shorter than 8 bytes",
                    path.display()
                ));
            }
            let account = Account {
                levels: [
                    value("name", name.clone())?,
                    value("user", spec.user)?,
                    value("team", spec.team)?,
                    value("org", spec.org)?,
                ],
            };
            accounts.insert(secret, account);
        }
        Ok(Self { accounts })
    }

    pub(crate) fn len(&self) -> usize {
        self.accounts.len()
    }
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} keys)", self.accounts.len())
    }
}

/// The keys in force, and the file they come from, read again when it
/// changes.
pub(crate) struct Watched {
    current: RwLock<Arc<Keys>>,
}

impl Watched {
    /// The keys of the file at `path`, followed from now on.
    pub(crate) fn follow(path: PathBuf) -> Result<Arc<Self>, String> {
        let keys = Keys::read(&path)?;
        let watched = Arc::new(Self {
            current: RwLock::new(Arc::new(keys)),
        });
        let follower = Arc::downgrade(&watched);
        tokio::spawn(async move {
            let mut seen = stamp(&path);
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let Some(watched) = follower.upgrade() else {
                    return;
                };
                let now = stamp(&path);
                if now == seen {
                    continue;
                }
                seen = now;
                match Keys::read(&path) {
                    Ok(keys) => {
                        tracing::info!(
                            keys = keys.len(),
                            "keys: the file changed; these keys in force"
                        );
                        *watched
                            .current
                            .write()
                            .unwrap_or_else(PoisonError::into_inner) = Arc::new(keys);
                    }
                    Err(problem) => {
                        tracing::warn!(%problem, "keys: the file changed and does not read; the keys in force stay");
                    }
                }
            }
        });
        Ok(watched)
    }

    fn current(&self) -> Arc<Keys> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    pub(crate) fn len(&self) -> usize {
        self.current().len()
    }
}

/// What tells a file changed: its modification time and length.
fn stamp(path: &Path) -> Option<(std::time::SystemTime, u64)> {
    let metadata = std::fs::metadata(path).ok()?;
    Some((metadata.modified().ok()?, metadata.len()))
}

/// The middleware: a request's key (`authorization: Bearer <key>` or
/// `api-key: <key>`) must be in the keys file (else `401`, in OpenAI's
/// format); its account is then set as the `x-gateway-*` headers, and
/// the key itself removed (the upstream gets the gateway's own).
pub(crate) async fn authenticate(
    State(keys): State<Arc<Watched>>,
    mut request: Request,
    next: Next,
) -> Response {
    let headers = request.headers_mut();
    for name in &HIERARCHY {
        headers.remove(name);
    }
    let key = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
        .or_else(|| headers.get("api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    let keys = keys.current();
    let Some(account) = key.and_then(|key| keys.accounts.get(key)).cloned() else {
        return unauthorized();
    };
    headers.remove(header::AUTHORIZATION);
    headers.remove("api-key");
    for (name, value) in HIERARCHY.iter().zip(account.levels) {
        headers.insert(name, value);
    }
    next.run(request).await
}

fn unauthorized() -> Response {
    let body = serde_json::json!({"error": {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "param": null,
        "code": "invalid_api_key",
    }});
    (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
