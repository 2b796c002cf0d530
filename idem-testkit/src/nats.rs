//! One `nats-server -js` process on a free port, with its JetStream store
//! in a temporary directory, for tests that kill or restart the broker.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::spawn::{self, Slot};
use crate::{find_binary, free_port};

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const LOG_FILE: &str = "nats.log";

/// The message [`require_nats`] panics with when NATS is not installed.
const MISSING_NATS: &str = "nats-server not found on PATH: install it with \
     `apt-get install nats-server`, or run .ci/run which does";

/// Panics with installation instructions when `nats-server` is missing;
/// returns its path otherwise.
pub fn require_nats() -> PathBuf {
    find_binary("nats-server").unwrap_or_else(|| panic!("{MISSING_NATS}"))
}

/// A private `nats-server` with JetStream on `127.0.0.1` and a free port.
///
/// Its store directory survives [`kill`](NatsServer::kill) and
/// [`restart`](NatsServer::restart) (same port), so streams, consumers and
/// messages persist across a broker restart as they do in production.
/// Dropping it kills the process and deletes the directory.
///
/// ```no_run
/// let mut nats = idem_testkit::NatsServer::start();
/// let url = nats.url();
/// nats.kill();
/// nats.restart(); // same port, same JetStream store
/// # let _ = url;
/// ```
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    dir: TempDir,
    child: Slot,
}

impl NatsServer {
    /// Starts a server and waits until it accepts clients.
    ///
    /// # Panics
    ///
    /// When `nats-server` is missing or does not come up (the message quotes
    /// its log).
    pub fn start() -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("idem-nats-")
            .tempdir()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot create a temp dir: {e}"));
        let server = NatsServer {
            port: free_port(),
            dir,
            child: Slot::default(),
        };
        server.launch();
        server
    }

    /// The client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the JetStream store and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the server with `SIGKILL` and waits for it; the store stays.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts the server again on the same port and store directory.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Whether the process is alive.
    pub fn is_running(&self) -> bool {
        self.child.is_running()
    }

    fn launch(&self) {
        let bin = require_nats();
        let log = self.dir.path().join(LOG_FILE);
        let store = self.dir.path().join("jetstream");
        // "Server is ready" must come from this run, not the previous one.
        let _ = std::fs::rename(&log, self.dir.path().join("nats.log.prev"));
        let mut cmd = Command::new(bin);
        cmd.args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(&store)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn::spawn(cmd)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot run nats-server: {e}"));
        self.child.set(child);
        let what = format!("nats-server on port {}", self.port);
        self.child.wait_ready(&what, READY_TIMEOUT, &log, || {
            self.answers() && self.jetstream_ready(&log)
        });
    }

    fn answers(&self) -> bool {
        let Ok(stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("INFO")
    }

    fn jetstream_ready(&self, log: &Path) -> bool {
        File::open(log)
            .map(|f| {
                BufReader::new(f)
                    .lines()
                    .map_while(Result::ok)
                    .any(|l| l.contains("Server is ready"))
            })
            .unwrap_or(false)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
