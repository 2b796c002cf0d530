//! One private RabbitMQ node on free ports, with its data in a temporary
//! directory, for tests that kill or restart the broker (the shared one on
//! 5672 is never restarted by a test).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use crate::spawn::{self, Slot};
use crate::{find_binary, free_port};

/// An Erlang node boots in a few seconds on a quiet machine; CI's two
/// cores may be busy building.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
const LOG_FILE: &str = "rabbitmq.log";
/// The server script itself: Debian's `/usr/sbin/rabbitmq-server` is a
/// wrapper that switches to the `rabbitmq` user, who cannot write the
/// test's directory.
const SERVER_SCRIPT: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// The message [`require_rabbitmq`] panics with when RabbitMQ is not installed.
const MISSING_RABBITMQ: &str = "rabbitmq-server not found (looked for \
     /usr/lib/rabbitmq/bin/rabbitmq-server, then on PATH): install it with \
     `apt-get install rabbitmq-server`, or run .ci/run which does";

/// Panics with installation instructions when RabbitMQ is missing; returns
/// the server script's path otherwise.
pub fn require_rabbitmq() -> PathBuf {
    let script = PathBuf::from(SERVER_SCRIPT);
    if script.is_file() {
        return script;
    }
    find_binary("rabbitmq-server").unwrap_or_else(|| panic!("{MISSING_RABBITMQ}"))
}

/// A private RabbitMQ node (`guest`/`guest`, no plugins, no config file)
/// on `127.0.0.1` and a free port.
///
/// Its data directory survives [`kill`](RabbitServer::kill) and
/// [`restart`](RabbitServer::restart) (same ports), so durable queues and
/// their messages persist across a broker restart as they do in
/// production. Dropping it kills the node and deletes the directory.
///
/// ```no_run
/// let mut rabbit = idem_testkit::RabbitServer::start();
/// let url = rabbit.url(); // amqp://guest:guest@127.0.0.1:PORT/%2f
/// rabbit.restart(); // SIGKILL, then the same ports and data
/// # let _ = url;
/// ```
#[derive(Debug)]
pub struct RabbitServer {
    port: u16,
    dist_port: u16,
    node: String,
    dir: TempDir,
    child: Slot,
}

impl RabbitServer {
    /// Starts a node and waits until it accepts AMQP clients.
    ///
    /// # Panics
    ///
    /// When RabbitMQ is missing or does not come up (the message quotes its
    /// output).
    pub fn start() -> RabbitServer {
        let dir = tempfile::Builder::new()
            .prefix("idem-rabbitmq-")
            .tempdir()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot create a temp dir: {e}"));
        let port = free_port();
        let server = RabbitServer {
            port,
            dist_port: free_port(),
            node: format!("idemtest-{}-{port}@localhost", std::process::id()),
            dir,
            child: Slot::default(),
        };
        server.launch();
        server
    }

    /// The client URL, `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The AMQP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the node's data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the node with `SIGKILL` and waits for it; the data stays.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts the node again on the same ports and data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// How many times the node has booted (from its log).
    pub fn boots(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join(LOG_FILE))
            .map_or(0, |log| log.matches("Starting broker").count())
    }

    /// Whether the node's process is alive.
    pub fn is_running(&self) -> bool {
        self.child.is_running()
    }

    fn launch(&self) {
        let script = require_rabbitmq();
        let dir = self.dir.path();
        let log = dir.join(LOG_FILE);
        // Appended to: the log tells every boot of the node.
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot open {}: {e}", log.display()));
        let err = out
            .try_clone()
            .unwrap_or_else(|e| panic!("idem-testkit: cannot share {}: {e}", log.display()));
        let mut cmd = Command::new(script);
        // HOME holds the node's Erlang cookie; the files named but absent
        // keep the machine's own RabbitMQ config and plugins out. Under
        // "systemd" the script execs the node instead of waiting on it in
        // the background, so the process killed (and tied to this one's
        // life) is the node itself.
        cmd.current_dir(dir) // where a failed boot writes erl_crash.dump
            .env("HOME", dir)
            .env("RUNNING_UNDER_SYSTEMD", "1")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("none"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("none.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("plugins"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = spawn::spawn(cmd)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot run rabbitmq-server: {e}"));
        self.child.set(child);
        let what = format!("rabbitmq-server on port {}", self.port);
        self.child
            .wait_ready(&what, READY_TIMEOUT, &log, || self.answers());
    }

    /// The listener opens last in the node's boot, and answers a protocol
    /// header it does not speak with its own.
    fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut reply = [0u8; 8];
        stream.write_all(b"AMQP\x00\x00\x00\x00").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && reply.starts_with(b"AMQP")
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill();
    }
}
