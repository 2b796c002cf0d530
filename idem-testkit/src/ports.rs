//! Ports for the servers tests spawn, reserved across every test process
//! on the machine until the process that took one exits.
//!
//! A test that kills a server and restarts it on the same port needs the port
//! to stay free while the server is down. Ports from `bind(0)` cannot
//! promise that: they come from the kernel's ephemeral range, where another
//! test process's `bind(0)` or any outgoing connection's local port may take
//! the port in between (CI saw a Valkey restart fail on "Address already in
//! use" five times over). So ports are handed out from a fixed range below
//! the ephemeral one (32768–60999 by Linux's default), and each is reserved
//! by an advisory lock on a file named after it in a shared directory: the
//! kernel drops the lock when the holding process exits, even by SIGKILL, so
//! a crashed test never leaks its ports.

use std::collections::hash_map::RandomState;
use std::fs::{File, OpenOptions};
use std::hash::BuildHasher;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Mutex;

use rustix::fs::{FlockOperation, flock};

/// The first and last port handed out. With the cluster bus port at
/// `port + 10000`, both stay in 16000–32700: below the ephemeral range, and
/// clear of the shared services' ports (PostgreSQL 5432, RabbitMQ 5672 with
/// its 15672 and 25672, NATS 4222, Redis 6379 and its bus 16379).
const FIRST: u16 = 16_400;
const LAST: u16 = 22_700;

/// Where the bus port of a Redis cluster node lies, relative to its port.
const BUS_OFFSET: u16 = 10_000;

/// The lock files of the ports this process holds: dropping one would
/// release its port to other processes, so they live as long as the process.
static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// Returns a free TCP port on `127.0.0.1`, reserved for this process until it
/// exits, such that `port + 10000` (the Redis cluster bus port) is free too.
///
/// No other caller of `free_port`, in this process or any other on the
/// machine, gets the same port while this process lives, and the port lies
/// below the kernel's ephemeral range, so no outgoing connection takes it
/// either: a server killed and restarted on it finds it free. Something
/// outside the tests may still bind it in between; callers that bind it
/// later retry with another port (as [`crate::RedisServer::start`] does).
///
/// # Panics
///
/// When every port of the range is taken, or the reservation directory
/// cannot be written; the message says which.
pub fn free_port() -> u16 {
    let dir = std::env::temp_dir().join("idem-testkit-ports");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        panic!(
            "free_port: cannot create the port reservation directory {}: {e}",
            dir.display()
        );
    }
    let span = u64::from(LAST - FIRST) + 1;
    // A different starting point per call spreads concurrent processes over
    // the range, so they rarely contend for the same lock.
    let start = RandomState::new().hash_one(std::process::id()) % span;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    for step in 0..span {
        let Ok(offset) = u16::try_from((start + step) % span) else {
            continue;
        };
        let port = FIRST + offset;
        let Some(lock) = reserve(dir.join(port.to_string())) else {
            continue;
        };
        // Kept even when the port turns out busy: this process must not
        // try it again, and another process may as well skip it.
        held.push(lock);
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + BUS_OFFSET)).is_ok()
        {
            return port;
        }
    }
    panic!(
        "free_port: every port pair (port, port + {BUS_OFFSET}) with port in {FIRST}–{LAST} is \
         taken or reserved on 127.0.0.1; too many test processes are running at once"
    );
}

/// Takes the exclusive lock on `path` without waiting: `None` when another
/// holder (another process, or this one through an earlier call) has it.
fn reserve(path: PathBuf) -> Option<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| {
            panic!(
                "free_port: cannot open the port reservation file {}: {e}",
                path.display()
            )
        });
    flock(&file, FlockOperation::NonBlockingLockExclusive)
        .ok()
        .map(|()| file)
}
