//! Helpers shared by the reliability tests (`tests/cluster.rs`,
//! `tests/faults.rs`, `tests/processes.rs`): exact execution ledgers, log
//! capture, polling with generous deadlines.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counts every run of a body, per key, with the time it started: the
/// ground truth the "exactly once" assertions are checked against.
#[derive(Clone, Default)]
pub struct Ledger {
    runs: Arc<Mutex<BTreeMap<String, Vec<Instant>>>>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Records one execution of the body for `key`; returns how many runs
    /// `key` has had, this one included.
    pub fn record(&self, key: &str) -> usize {
        let mut runs = self.runs.lock().unwrap();
        let v = runs.entry(key.to_owned()).or_default();
        v.push(Instant::now());
        v.len()
    }

    /// Number of runs of `key` so far.
    pub fn count(&self, key: &str) -> usize {
        self.runs.lock().unwrap().get(key).map_or(0, Vec::len)
    }

    /// Start times of every run of `key`.
    pub fn runs(&self, key: &str) -> Vec<Instant> {
        self.runs
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// Total runs over all keys.
    pub fn total(&self) -> usize {
        self.runs.lock().unwrap().values().map(Vec::len).sum()
    }

    /// Keys that ran more than once, with their counts.
    pub fn duplicates(&self) -> BTreeMap<String, usize> {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, v)| v.len() > 1)
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
    }
}

/// A `tracing` subscriber writing into memory, to assert on warnings.
#[derive(Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    pub fn new() -> LogBuffer {
        LogBuffer::default()
    }

    /// A subscriber that writes every event at `DEBUG` or above to this
    /// buffer, without ANSI colours (use it with `WithSubscriber`).
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let me = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || me.clone())
            .finish()
    }

    pub fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Polls `check` every 50 ms until it returns `Some`, or panics with
/// `what` after `deadline` (generous by design: never a timing assertion).
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A small deterministic PRNG (xorshift64*), so tests need no `rand`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// True for `idem::Error::Unavailable`.
pub fn is_unavailable(e: &idem::Error) -> bool {
    matches!(e, idem::Error::Unavailable { .. })
}

/// True for the errors a caller may legitimately get while the store is
/// faulty: the store is unreachable, or another (live) holder has the key.
pub fn is_typed_store_error(e: &idem::Error) -> bool {
    matches!(
        e,
        idem::Error::Unavailable { .. } | idem::Error::InProgress { .. }
    )
}

/// The error type of the test bodies: idem's errors, or the body's own.
#[derive(Debug)]
pub enum BodyError {
    Idem(idem::Error),
    Boom(String),
}

impl From<idem::Error> for BodyError {
    fn from(e: idem::Error) -> Self {
        BodyError::Idem(e)
    }
}

impl BodyError {
    /// The idem error inside, if this is one.
    pub fn idem(&self) -> Option<&idem::Error> {
        match self {
            BodyError::Idem(e) => Some(e),
            BodyError::Boom(_) => None,
        }
    }
}
