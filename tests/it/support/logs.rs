//! What the crate logs during a test: a `tracing` subscriber set as this
//! thread's default that writes into a buffer the test reads.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// The events logged on this thread while the guard lives.
pub struct Logs {
    written: Arc<Mutex<Vec<u8>>>,
    _default: tracing::subscriber::DefaultGuard,
    _second: tracing::Dispatch,
}

#[derive(Clone)]
struct Writer(Arc<Mutex<Vec<u8>>>);

impl Write for Writer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Capture events at `level` and above on this thread (a
    /// current-thread runtime's tasks included).
    pub fn capture(level: tracing::Level) -> Self {
        let written = Arc::new(Mutex::new(Vec::new()));
        let writer = Writer(Arc::clone(&written));
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        Self {
            written,
            _default: tracing::subscriber::set_default(subscriber),
            // With one dispatcher registered, tracing computes a callsite's
            // interest from the default of the thread that registers it: a
            // test beside this one that reached the callsite first would
            // make it "never". With two, it asks every dispatcher, this
            // thread's included.
            _second: tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()),
        }
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.written.lock().unwrap()).into_owned()
    }
}
