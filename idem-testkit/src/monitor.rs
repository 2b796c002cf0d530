//! The commands a Redis server runs, in the order it runs them (`MONITOR`),
//! for tests that check the order of writes made on several connections.

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A `MONITOR` connection to one server, read on a thread of its own: each
/// command the server runs from now on, as one line
/// (`<time> [<db> <client address>|lua] "<command>" "<arg>" …`; commands a
/// script makes carry `lua` as their client). Dropping it closes the
/// connection.
///
/// ```no_run
/// use idem_testkit::{Monitor, RedisServer};
///
/// let server = RedisServer::start();
/// let monitor = Monitor::start(server.addr());
/// server.cli(&["SET", "k", "v"]);
/// let seen = monitor.until_now();
/// assert!(seen.iter().any(|l| l.contains(r#""SET" "k" "v""#)));
/// ```
pub struct Monitor {
    addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
    stream: TcpStream,
}

impl Monitor {
    /// Starts monitoring the server at `addr`.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached or refuses `MONITOR`.
    pub fn start(addr: SocketAddr) -> Monitor {
        let mut stream = TcpStream::connect(addr)
            .unwrap_or_else(|e| panic!("cannot connect to {addr} to MONITOR it: {e}"));
        stream
            .write_all(b"MONITOR\r\n")
            .unwrap_or_else(|e| panic!("cannot send MONITOR to {addr}: {e}"));
        let mut reader = BufReader::new(
            stream
                .try_clone()
                .unwrap_or_else(|e| panic!("cannot clone the MONITOR socket: {e}")),
        );
        let mut ok = String::new();
        reader
            .read_line(&mut ok)
            .unwrap_or_else(|e| panic!("no reply to MONITOR from {addr}: {e}"));
        assert_eq!(ok.trim_end(), "+OK", "{addr} refused MONITOR");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { return };
                let line = line.strip_prefix('+').unwrap_or(&line).to_owned();
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        Monitor {
            addr,
            lines,
            stream,
        }
    }

    /// Every command the server ran since [`start`](Monitor::start), up
    /// to now: a marker (`ECHO`) is sent on a connection of its own and
    /// the lines before it are returned once it is seen.
    ///
    /// # Panics
    ///
    /// When the marker is not seen within 10 s.
    pub fn until_now(&self) -> Vec<String> {
        static MARKS: AtomicU64 = AtomicU64::new(0);
        let marker = format!(
            "idem-monitor-marker-{}-{}",
            std::process::id(),
            MARKS.fetch_add(1, Ordering::Relaxed)
        );
        let client = redis::Client::open(format!("redis://{}/", self.addr))
            .unwrap_or_else(|e| panic!("bad address {}: {e}", self.addr));
        let mut conn = client
            .get_connection()
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.addr));
        let _: String = redis::cmd("ECHO")
            .arg(&marker)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("ECHO to {} failed: {e}", self.addr));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            {
                let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(at) = lines.iter().position(|l| l.contains(&marker)) {
                    return lines[..at].to_vec();
                }
            }
            assert!(
                Instant::now() < deadline,
                "MONITOR on {} did not show the marker within 10 s",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
