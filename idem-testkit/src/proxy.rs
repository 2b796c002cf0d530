//! A fault-injecting TCP proxy.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// A TCP proxy on `127.0.0.1` and a free port, forwarding every connection
/// to an upstream address, with faults switched on and off at will.
///
/// It runs on its own background thread with its own Tokio runtime, so it
/// works from any test, synchronous or asynchronous, and outlives the test's
/// runtime. All the control methods take `&self` and act at once. Dropping
/// it stops the proxy and closes every connection.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_testkit::{FaultProxy, RedisServer};
///
/// let server = RedisServer::start();
/// let proxy = FaultProxy::start(server.addr());
/// let client = redis::Client::open(proxy.url()).unwrap();
/// proxy.set_latency(Duration::from_millis(50));
/// proxy.stall(true); // requests now hang...
/// proxy.stall(false); // ...and go through
/// proxy.drop_connections();
/// # let _ = client;
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// State shared by the handle and the proxy thread.
#[derive(Debug)]
struct Shared {
    /// Where new connections go; [`FaultProxy::point_to`] moves it.
    upstream: std::sync::Mutex<SocketAddr>,
    latency_nanos: AtomicU64,
    stall: watch::Sender<bool>,
    blackhole: AtomicBool,
    refuse: AtomicBool,
    /// Bumped by `drop_connections`; every connection ends when it changes.
    generation: watch::Sender<u64>,
    connections: AtomicUsize,
}

impl Shared {
    fn upstream(&self) -> SocketAddr {
        *self.upstream.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn latency(&self) -> Duration {
        Duration::from_nanos(self.latency_nanos.load(SeqCst))
    }
}

impl FaultProxy {
    /// Starts a proxy on a free port of `127.0.0.1` forwarding to `upstream`.
    /// It connects to `upstream` once per accepted connection; if that fails
    /// the accepted connection is closed.
    ///
    /// # Panics
    ///
    /// When no port can be bound or the proxy thread cannot start.
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
            .unwrap_or_else(|e| panic!("idem-testkit: FaultProxy cannot bind 127.0.0.1:0: {e}"));
        listener
            .set_nonblocking(true)
            .expect("idem-testkit: FaultProxy: set_nonblocking");
        let port = listener
            .local_addr()
            .expect("idem-testkit: local_addr")
            .port();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("idem-testkit: FaultProxy cannot build a runtime: {e}"));
        let listener = {
            let _context = runtime.enter();
            TcpListener::from_std(listener)
                .unwrap_or_else(|e| panic!("idem-testkit: FaultProxy listener: {e}"))
        };
        let shared = Arc::new(Shared {
            upstream: std::sync::Mutex::new(upstream),
            latency_nanos: AtomicU64::new(0),
            stall: watch::Sender::new(false),
            blackhole: AtomicBool::new(false),
            refuse: AtomicBool::new(false),
            generation: watch::Sender::new(0),
            connections: AtomicUsize::new(0),
        });
        let (shutdown, stopped) = oneshot::channel();
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("idem-fault-proxy-{port}"))
            .spawn(move || {
                runtime.block_on(async move {
                    tokio::select! {
                        _ = accept_loop(listener, thread_shared) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime cancels every connection task, which
                // closes its sockets.
                drop(runtime);
            })
            .unwrap_or_else(|e| panic!("idem-testkit: FaultProxy cannot start its thread: {e}"));
        FaultProxy {
            port,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// The proxy's URL, `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The proxy's address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream()
    }

    /// Sends new connections to `upstream` from now on and ends every
    /// connection open now (as a virtual IP or a sentinel moves clients to
    /// a promoted replica): clients reconnect, through the proxy, to the
    /// new address.
    pub fn point_to(&self, upstream: SocketAddr) {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = upstream;
        self.drop_connections();
    }

    /// Delays every chunk forwarded, in either direction, by `d` (zero turns
    /// the delay off). A request and its reply thus take at least `2 * d`
    /// more. The delay is counted from when the chunk was read, so it adds
    /// latency without limiting throughput.
    pub fn set_latency(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.shared.latency_nanos.store(nanos, SeqCst);
    }

    /// While on, bytes (and end-of-stream) are still read from both sides
    /// but held instead of forwarded, as with a hung server or network. When
    /// turned off, the held bytes flow again, in order.
    pub fn stall(&self, on: bool) {
        self.shared.stall.send_replace(on);
    }

    /// While on, bytes in both directions are read and discarded: requests
    /// and replies are lost, and connections stay open.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.store(on, SeqCst);
    }

    /// Closes every connection the proxy has accepted so far, on both sides
    /// (clients see the connection closed; bytes still held are lost). New
    /// connections are accepted as usual.
    pub fn drop_connections(&self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }

    /// While on, new connections are accepted and immediately closed.
    /// Existing connections are not affected.
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.store(on, SeqCst);
    }

    /// The number of connections currently open through the proxy.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            // A panic on the proxy thread is not re-raised here.
            let _ = thread.join();
        }
    }
}

/// Counts an open connection for as long as it lives.
struct Counted(Arc<Shared>);

impl Counted {
    fn new(shared: &Arc<Shared>) -> Counted {
        shared.connections.fetch_add(1, SeqCst);
        Counted(Arc::clone(shared))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, SeqCst);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. too many open files: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.refuse.load(SeqCst) {
            drop(client);
            continue;
        }
        // Counted and subscribed before the task runs, so drop_connections
        // right after a connection was accepted ends it too.
        let counted = Counted::new(&shared);
        let generation = shared.generation.subscribe();
        tokio::spawn(serve(client, counted, generation));
    }
}

async fn serve(client: TcpStream, counted: Counted, mut generation: watch::Receiver<u64>) {
    let shared = &counted.0;
    let forward = async {
        let upstream = TcpStream::connect(shared.upstream()).await?;
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (upstream_read, upstream_write) = upstream.into_split();
        tokio::try_join!(
            pipe(client_read, upstream_write, shared),
            pipe(upstream_read, client_write, shared),
        )
        .map(|_| ())
    };
    tokio::select! {
        _ = forward => {}
        _ = generation.changed() => {}
    }
    // Both sockets are dropped (closed) here.
}

/// Forwards one direction until end-of-stream (which is passed on) or error.
async fn pipe(
    mut reader: OwnedReadHalf,
    mut writer: OwnedWriteHalf,
    shared: &Shared,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = reader.read(&mut buf).await?;
            if n == 0 {
                drop(tx);
                return Ok::<(), io::Error>(());
            }
            if shared.blackhole.load(SeqCst) {
                continue;
            }
            let due = Instant::now() + shared.latency();
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return Ok(());
            }
        }
    };
    let write = async move {
        let mut stall = shared.stall.subscribe();
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            // The sender lives in `shared`, so this cannot fail.
            let _ = stall.wait_for(|stalled| !*stalled).await;
            if shared.blackhole.load(SeqCst) {
                continue;
            }
            writer.write_all(&chunk).await?;
        }
        let _ = stall.wait_for(|stalled| !*stalled).await;
        writer.shutdown().await
    };
    tokio::try_join!(read, write).map(|_| ())
}
