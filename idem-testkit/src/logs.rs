//! Capturing what idem logs, to assert on warnings and on what never
//! appears (keys in clear).

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use tracing_subscriber::fmt::format::FmtSpan;

/// An in-memory sink for `tracing` output. Clones share the buffer.
///
/// ```
/// use tracing::instrument::WithSubscriber;
/// # async fn demo() {
/// let logs = idem_testkit::LogCapture::new();
/// async { tracing::warn!("careful") }.with_subscriber(logs.subscriber()).await;
/// assert!(logs.contents().contains("careful"));
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    /// An empty capture.
    pub fn new() -> LogCapture {
        LogCapture::default()
    }

    /// A subscriber writing every event at `DEBUG` or above here, without
    /// ANSI colours (use it with `WithSubscriber` or `set_default`).
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let me = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || me.clone())
            .finish()
    }

    /// A subscriber writing everything here: events at `TRACE` and above
    /// and every span's opening and closing, with its fields (what a key
    /// leaking into the logs would show up in).
    pub fn trace_subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let me = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || me.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(FmtSpan::FULL)
            .with_ansi(false)
            .finish()
    }

    /// Everything written so far, as text.
    pub fn contents(&self) -> String {
        String::from_utf8_lossy(&self.lock()).into_owned()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
