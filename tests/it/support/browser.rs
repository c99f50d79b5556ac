//! A real browser for the tests: Debian's chromium, headless, driven over
//! its DevTools protocol (JSON commands on a WebSocket). Fails, saying how
//! to install it, when chromium is missing.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

const INSTALL_HINT: &str = "chromium was not found on PATH. The admin console's test drives a \
real browser: install it with `sudo apt-get install chromium` (Debian), or run `scripts/test`, \
which installs it.";

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A headless chromium with one page, killed on drop.
pub struct Browser {
    child: Child,
    profile: PathBuf,
    page: Socket,
    /// The page's session on the browser's socket.
    session: Option<String>,
    next_id: u64,
}

impl Browser {
    /// Start chromium and open a page.
    pub async fn start() -> Self {
        let profile = std::env::temp_dir().join(format!(
            "chromium-test-{}-{}",
            std::process::id(),
            super::free_port()
        ));
        let mut child = Command::new("chromium")
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--window-size=1280,1150",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("{INSTALL_HINT} ({error})"));
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        let browser_url = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("chromium says where its DevTools listen");
        // One page, attached in flat mode: its commands go over the
        // browser's socket with the page's session id.
        let (socket, _) = tokio_tungstenite::connect_async(browser_url.as_str())
            .await
            .unwrap();
        let mut browser = Self {
            child,
            profile,
            page: socket,
            session: None,
            next_id: 0,
        };
        let target = browser
            .call("Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let attached = browser
            .call(
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        browser.session = Some(attached["sessionId"].as_str().unwrap().to_owned());
        browser
    }

    /// Send a DevTools command and wait for its result (events meanwhile
    /// are skipped).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut command = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = &self.session {
            command["sessionId"] = json!(session);
        }
        self.page
            .send(Message::text(command.to_string()))
            .await
            .unwrap();
        loop {
            let message = tokio::time::timeout(Duration::from_secs(30), self.page.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method}"))
                .expect("the page's socket is open")
                .unwrap();
            let Message::Text(text) = message else {
                continue;
            };
            let answer: Value = serde_json::from_str(&text).unwrap();
            if answer["id"] == id {
                assert!(answer["error"].is_null(), "{method}: {answer}");
                return answer["result"].clone();
            }
        }
    }

    /// Evaluate `expression` in the page (awaiting a promise), its value.
    pub async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "awaitPromise": true, "returnByValue": true }),
            )
            .await;
        assert!(
            result["exceptionDetails"].is_null(),
            "{expression}: {result}"
        );
        result["result"]["value"].clone()
    }

    /// Wait until `expression` is true in the page.
    pub async fn wait_for(&mut self, expression: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while self.eval(expression).await != Value::Bool(true) {
            assert!(
                Instant::now() < deadline,
                "not within {within:?}: {expression}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The page as a PNG.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine as _;
        let shot = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
