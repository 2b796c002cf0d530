//! `FaultProxy` in front of a real redis-server.

use std::time::{Duration, Instant};

use idem_testkit::{FaultProxy, RedisServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";

/// Reads until `expected.len()` bytes arrived or `within` passed.
async fn read_reply(stream: &mut TcpStream, expected: &[u8], within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while got.len() < expected.len() {
        let mut buf = [0u8; 256];
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    Some(got)
}

/// True when the peer closed (EOF or reset) within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        timeout(within, stream.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn ping_once(proxy: &FaultProxy) -> TcpStream {
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    stream.write_all(PING).await.unwrap();
    assert_eq!(
        read_reply(&mut stream, b"+PONG\r\n", Duration::from_secs(5))
            .await
            .as_deref(),
        Some(&b"+PONG\r\n"[..])
    );
    stream
}

#[tokio::test]
async fn forwards_commands() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    assert_eq!(proxy.url(), format!("redis://127.0.0.1:{}/", proxy.port()));
    assert_eq!(proxy.upstream(), server.addr());
    let client = redis::Client::open(proxy.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SET")
        .arg("k")
        .arg("through the proxy")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(server.cli(&["GET", "k"]), "through the proxy");
    // A large value, in several chunks each way.
    let big = "v".repeat(1 << 20);
    let () = redis::cmd("SET")
        .arg("big")
        .arg(&big)
        .query_async(&mut con)
        .await
        .unwrap();
    let back: String = redis::cmd("GET")
        .arg("big")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(back, big);
    assert_eq!(proxy.connections(), 1);
}

/// Sync use, and the proxy outlives the runtimes of its users.
#[test]
fn works_without_and_across_runtimes() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let client = redis::Client::open(proxy.url()).unwrap();
    let mut con = client.get_connection().unwrap();
    let pong: String = redis::cmd("PING").query(&mut con).unwrap();
    assert_eq!(pong, "PONG");
    for _ in 0..2 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            ping_once(&proxy).await;
        });
    }
}

#[tokio::test]
async fn latency_delays_both_directions() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut stream = ping_once(&proxy).await;
    proxy.set_latency(Duration::from_millis(150));
    let started = Instant::now();
    stream.write_all(PING).await.unwrap();
    let reply = read_reply(&mut stream, b"+PONG\r\n", Duration::from_secs(5)).await;
    assert_eq!(reply.as_deref(), Some(&b"+PONG\r\n"[..]));
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");

    // Latency does not add up over pipelined requests.
    let started = Instant::now();
    for _ in 0..5 {
        stream.write_all(PING).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let five = b"+PONG\r\n".repeat(5);
    let reply = read_reply(&mut stream, &five, Duration::from_secs(5)).await;
    assert_eq!(reply.as_deref(), Some(&five[..]));
    assert!(started.elapsed() >= Duration::from_millis(300));

    proxy.set_latency(Duration::ZERO);
    let started = Instant::now();
    stream.write_all(PING).await.unwrap();
    read_reply(&mut stream, b"+PONG\r\n", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
}

#[tokio::test]
async fn stall_holds_then_releases() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut stream = ping_once(&proxy).await;
    proxy.stall(true);
    stream
        .write_all(b"*2\r\n$4\r\nINCR\r\n$1\r\nn\r\n")
        .await
        .unwrap();
    assert_eq!(
        read_reply(&mut stream, b":1\r\n", Duration::from_millis(300)).await,
        None,
        "no reply while stalled"
    );
    assert_eq!(server.cli(&["GET", "n"]), "", "request held, not delivered");
    proxy.stall(false);
    let reply = read_reply(&mut stream, b":1\r\n", Duration::from_secs(5)).await;
    assert_eq!(reply.as_deref(), Some(&b":1\r\n"[..]));
    assert_eq!(server.cli(&["GET", "n"]), "1");
}

#[tokio::test]
async fn blackhole_loses_requests_and_replies() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut stream = ping_once(&proxy).await;
    proxy.blackhole(true);
    stream
        .write_all(b"*3\r\n$3\r\nSET\r\n$2\r\nbh\r\n$1\r\n1\r\n")
        .await
        .unwrap();
    assert_eq!(
        read_reply(&mut stream, b"+OK\r\n", Duration::from_millis(300)).await,
        None
    );
    proxy.blackhole(false);
    assert_eq!(server.cli(&["EXISTS", "bh"]), "0", "the request was lost");
    // The connection still works, and the lost request gets no late reply.
    stream.write_all(PING).await.unwrap();
    let reply = read_reply(&mut stream, b"+PONG\r\n", Duration::from_secs(5)).await;
    assert_eq!(reply.as_deref(), Some(&b"+PONG\r\n"[..]));
    assert_eq!(proxy.connections(), 1);
}

#[tokio::test]
async fn drop_connections_closes_them_all() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut a = ping_once(&proxy).await;
    let mut b = ping_once(&proxy).await;
    let client = redis::Client::open(proxy.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let _: String = redis::cmd("PING").query_async(&mut con).await.unwrap();
    assert_eq!(proxy.connections(), 3);

    proxy.drop_connections();
    assert!(closed_within(&mut a, Duration::from_secs(2)).await);
    assert!(closed_within(&mut b, Duration::from_secs(2)).await);
    wait_until("no connection is left", || proxy.connections() == 0).await;
    let failed = redis::cmd("PING").query_async::<String>(&mut con).await;
    assert!(failed.is_err(), "{failed:?}");

    // New connections work. The stream is held: dropping it would race the count.
    let _fresh = ping_once(&proxy).await;
    assert_eq!(proxy.connections(), 1);
}

#[tokio::test]
async fn refuse_closes_new_connections() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let mut existing = ping_once(&proxy).await;
    proxy.refuse(true);
    let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
    let _ = refused.write_all(PING).await;
    assert!(closed_within(&mut refused, Duration::from_secs(2)).await);
    let client = redis::Client::open(proxy.url()).unwrap();
    assert!(client.get_multiplexed_async_connection().await.is_err());
    assert_eq!(proxy.connections(), 1, "existing connection unaffected");
    existing.write_all(PING).await.unwrap();
    assert!(
        read_reply(&mut existing, b"+PONG\r\n", Duration::from_secs(5))
            .await
            .is_some()
    );

    proxy.refuse(false);
    ping_once(&proxy).await;
}

#[tokio::test]
async fn drop_stops_the_proxy() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let addr = proxy.addr();
    let mut stream = ping_once(&proxy).await;
    proxy.stall(true); // held bytes do not keep it alive
    stream.write_all(PING).await.unwrap();
    tokio::task::spawn_blocking(move || drop(proxy))
        .await
        .unwrap();
    assert!(closed_within(&mut stream, Duration::from_secs(2)).await);
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn unreachable_upstream_closes_the_client() {
    let server = RedisServer::start();
    let upstream = server.addr();
    drop(server);
    let proxy = FaultProxy::start(upstream);
    let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
    assert!(closed_within(&mut stream, Duration::from_secs(2)).await);
    wait_until("the connection is gone", || proxy.connections() == 0).await;
}
