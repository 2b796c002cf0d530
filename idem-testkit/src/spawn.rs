//! Spawning child processes that die with the test process.
//!
//! On Linux every child is started from one long-lived thread with
//! `PR_SET_PDEATHSIG = SIGKILL`. The kernel sends that signal when the thread
//! that forked the child exits, so the forking thread must live as long as
//! the process: a test thread would not do (a server shared through a
//! `static` outlives the test that started it). Thanks to this, servers are
//! killed even when the test process is itself killed or aborts and no
//! destructor runs, and never linger holding ports (or CI's pipes).

use std::io;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type Request = (Command, Sender<io::Result<Child>>);

/// Spawns `command`, tied to the lifetime of this process where possible.
pub(crate) fn spawn(command: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<Sender<Request>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<Request>();
        std::thread::Builder::new()
            .name("idem-testkit-spawner".into())
            .spawn(move || {
                while let Ok((mut command, reply)) = rx.recv() {
                    tie_to_parent(&mut command);
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("idem-testkit: could not start the process spawner thread");
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply_tx))
        .map_err(|_| io::Error::other("idem-testkit spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("idem-testkit spawner thread is gone"))?
}

#[cfg(target_os = "linux")]
// The workspace's one unsafe block (the workspace denies unsafe_code, and
// .ci/run fails on an `allow(unsafe_code)` anywhere else): `CommandExt::pre_exec` is an unsafe fn, and no
// safe API sets a child's parent-death signal between fork and exec. The
// calls inside are rustix's safe wrappers of raw syscalls.
#[allow(unsafe_code)]
fn tie_to_parent(command: &mut Command) {
    use rustix::process::{Signal, getpid, getppid, set_parent_process_death_signal};
    use std::os::unix::process::CommandExt;
    let parent = getpid();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // two syscalls (prctl, getppid), async-signal-safe; it allocates nothing
    // (an `io::Error` from an `Errno` is a raw OS code).
    unsafe {
        command.pre_exec(move || {
            set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died between fork and prctl.
            if getppid() != Some(parent) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn tie_to_parent(_command: &mut Command) {}

/// The one process of a spawned server, or none between a kill and a
/// restart (the servers keep their port and directory across both).
#[derive(Debug, Default)]
pub(crate) struct Slot(Mutex<Option<Child>>);

impl Slot {
    pub(crate) fn set(&self, child: Child) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
    }

    /// `SIGKILL`s the process and reaps it.
    pub(crate) fn kill(&self) {
        let mut child = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut c) = child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn is_running(&self) -> bool {
        let mut child = self.0.lock().unwrap_or_else(|e| e.into_inner());
        child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Polls `ready` until it holds; panics, quoting the end of the server's
    /// log, when the process dies first or `timeout` passes.
    pub(crate) fn wait_ready(
        &self,
        what: &str,
        timeout: Duration,
        log: &Path,
        mut ready: impl FnMut() -> bool,
    ) {
        let end = Instant::now() + timeout;
        loop {
            if ready() {
                return;
            }
            if !self.is_running() || Instant::now() > end {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
                panic!(
                    "idem-testkit: {what} did not come up within {timeout:?}; its log:\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Lines of a server's log quoted when it fails to start.
const LOG_TAIL_LINES: usize = 40;
