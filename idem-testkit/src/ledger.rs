//! Exact counts of side effects per key: the ground truth every "exactly
//! once" assertion is checked against.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Every run of a body, per key, with the time it started; shared by clones,
/// so tasks and threads of one process write to the same ledger.
///
/// ```
/// let ledger = idem_testkit::Ledger::new();
/// let l = ledger.clone();
/// std::thread::spawn(move || l.record("order-1")).join().unwrap();
/// assert_eq!(ledger.count("order-1"), 1);
/// assert!(ledger.duplicates().is_empty());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    runs: Arc<Mutex<BTreeMap<String, Vec<Instant>>>>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Records one run of the body for `key`; returns how many runs `key`
    /// has had, this one included.
    pub fn record(&self, key: &str) -> usize {
        let mut runs = self.lock();
        let v = runs.entry(key.to_owned()).or_default();
        v.push(Instant::now());
        v.len()
    }

    /// Number of runs of `key` so far.
    pub fn count(&self, key: &str) -> usize {
        self.lock().get(key).map_or(0, Vec::len)
    }

    /// Start times of every run of `key`, oldest first.
    pub fn runs(&self, key: &str) -> Vec<Instant> {
        self.lock().get(key).cloned().unwrap_or_default()
    }

    /// Total runs over all keys.
    pub fn total(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Keys that ran more than once, with their counts.
    pub fn duplicates(&self) -> BTreeMap<String, usize> {
        self.lock()
            .iter()
            .filter(|(_, v)| v.len() > 1)
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
    }

    // A body that panicked while recording must not hide the other runs.
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Vec<Instant>>> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One line of a [`FileLedger`]: which key ran, in which process, when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRun {
    /// The key whose body ran.
    pub key: String,
    /// The process that ran it.
    pub pid: u32,
    /// When the run started, in milliseconds since the Unix epoch (the one
    /// clock processes share).
    pub unix_ms: u128,
}

/// A [`Ledger`] for many OS processes: every run appends `key pid ms` to one
/// file, each line with its own `open(O_APPEND)` and a single `write`, so
/// lines of concurrent processes never interleave. The parent reads it back
/// with [`FileLedger::runs`].
///
/// ```
/// let dir = tempfile::tempdir().unwrap();
/// let ledger = idem_testkit::FileLedger::at(dir.path().join("ledger"));
/// ledger.record("key-1");
/// assert_eq!(ledger.runs()[0].pid, std::process::id());
/// ```
#[derive(Debug, Clone)]
pub struct FileLedger {
    path: PathBuf,
}

impl FileLedger {
    /// A ledger kept in the file at `path` (created on the first record).
    pub fn at(path: impl Into<PathBuf>) -> FileLedger {
        FileLedger { path: path.into() }
    }

    /// The file this ledger appends to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one run of `key` by this process, now.
    ///
    /// # Panics
    ///
    /// When the file cannot be opened or the line is not written whole.
    pub fn record(&self, key: &str) {
        let line = format!("{key} {} {}\n", std::process::id(), unix_ms());
        let mut f = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot open {:?}: {e}", self.path));
        let n = f
            .write(line.as_bytes())
            .unwrap_or_else(|e| panic!("idem-testkit: cannot append to {:?}: {e}", self.path));
        assert_eq!(n, line.len(), "short append to the ledger");
    }

    /// Every run recorded so far, in file order (empty before the first).
    ///
    /// # Panics
    ///
    /// On a line that is not `key pid ms` (a torn write).
    pub fn runs(&self) -> Vec<FileRun> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f.len(), 3, "torn ledger line {l:?}");
                let parse_err = |what: &str| format!("bad {what} in ledger line {l:?}");
                FileRun {
                    key: f[0].to_owned(),
                    pid: f[1]
                        .parse()
                        .unwrap_or_else(|_| panic!("{}", parse_err("pid"))),
                    unix_ms: f[2]
                        .parse()
                        .unwrap_or_else(|_| panic!("{}", parse_err("time"))),
                }
            })
            .collect()
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
