//! `RedisServer` against a real redis-server.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idem_testkit::{RedisServer, free_port, require_redis};

fn ping(url: &str) -> redis::RedisResult<String> {
    let client = redis::Client::open(url)?;
    let mut con = client.get_connection_with_timeout(Duration::from_secs(1))?;
    redis::cmd("PING").query(&mut con)
}

fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn start_kill_restart() {
    require_redis();
    let mut server = RedisServer::start();
    let port = server.port();
    assert_eq!(server.url(), format!("redis://127.0.0.1:{port}/"));
    assert_eq!(server.addr().to_string(), format!("127.0.0.1:{port}"));
    assert!(server.is_running());
    assert_eq!(ping(&server.url()).unwrap(), "PONG");
    assert_eq!(server.cli(&["SET", "k", "v"]), "OK");
    assert_eq!(server.cli(&["CONFIG", "GET", "save"]), "save");
    assert_eq!(
        server.cli(&["CONFIG", "GET", "appendonly"]),
        "appendonly\nno"
    );
    let first_pid = server.pid().unwrap();

    server.kill();
    assert!(!server.is_running());
    assert_eq!(server.pid(), None);
    assert!(ping(&server.url()).is_err(), "PING must fail after kill");
    assert!(
        !std::path::Path::new(&format!("/proc/{first_pid}")).exists(),
        "killed process must be reaped"
    );
    server.kill(); // idempotent

    server.restart();
    assert_eq!(server.port(), port);
    assert!(server.is_running());
    assert_ne!(server.pid(), Some(first_pid));
    assert_eq!(ping(&server.url()).unwrap(), "PONG");
    assert_eq!(
        server.cli(&["EXISTS", "k"]),
        "0",
        "no persistence: data is gone"
    );

    // restart() of a running server kills it first.
    server.restart();
    assert_eq!(ping(&server.url()).unwrap(), "PONG");
}

#[test]
fn start_with_applies_extra_args() {
    let server =
        RedisServer::start_with(&["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]);
    assert_eq!(
        server.cli(&["CONFIG", "GET", "maxmemory"]),
        "maxmemory\n1048576"
    );
    let mut con = server.connection();
    let big = vec![b'x'; 64 * 1024];
    let mut oom = None;
    for i in 0..100 {
        if let Err(e) = redis::cmd("SET").arg(i).arg(&big).query::<()>(&mut con) {
            oom = Some(e);
            break;
        }
    }
    let oom = oom.expect("writes past maxmemory must fail");
    assert!(oom.to_string().contains("OOM"), "{oom}");
    // The arguments survive a restart.
    let mut server = server;
    server.restart();
    assert_eq!(
        server.cli(&["CONFIG", "GET", "maxmemory-policy"]),
        "maxmemory-policy\nnoeviction"
    );
}

#[test]
fn cli_returns_error_replies_as_text_and_panics_when_down() {
    let mut server = RedisServer::start();
    assert!(
        server
            .cli(&["NO-SUCH-COMMAND"])
            .starts_with("ERR unknown command")
    );
    assert_eq!(server.cli(&["GET", "missing"]), "");
    server.kill();
    let err = std::panic::catch_unwind(|| server.cli(&["PING"])).unwrap_err();
    let message = panic_message(err);
    assert!(message.contains("Connection refused"), "{message}");
}

#[test]
fn flushall_empties_the_server() {
    let server = RedisServer::start();
    server.cli(&["SET", "a", "1"]);
    server.cli(&["-n", "3", "SET", "b", "1"]);
    server.flushall();
    assert_eq!(server.cli(&["DBSIZE"]), "0");
    assert_eq!(server.cli(&["-n", "3", "DBSIZE"]), "0");
}

#[test]
fn drop_kills_the_process_and_deletes_its_dir() {
    let server = RedisServer::start();
    let (pid, dir, url) = (
        server.pid().unwrap(),
        server.dir().to_path_buf(),
        server.url(),
    );
    assert!(server.log_path().starts_with(&dir));
    assert!(server.log_tail(50).contains("Ready to accept connections"));
    drop(server);
    assert!(!dir.exists(), "temp dir must be deleted");
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert!(ping(&url).is_err());
}

#[test]
fn exit_on_its_own_is_noticed() {
    let server = RedisServer::start();
    let mut con = server.connection();
    let _ = redis::cmd("SHUTDOWN").arg("NOSAVE").query::<()>(&mut con);
    wait_until("the server exited", Duration::from_secs(5), || {
        !server.is_running()
    });
}

#[test]
fn startup_failure_panics_with_the_log() {
    let err = std::panic::catch_unwind(|| RedisServer::start_with(&["--no-such-directive", "x"]))
        .unwrap_err();
    let message = panic_message(err);
    assert!(message.contains("failed to start"), "{message}");
    assert!(message.contains("Bad directive"), "{message}");
}

#[test]
fn parallel_starts_get_distinct_ports() {
    let servers: Vec<RedisServer> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(RedisServer::start)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ports: HashSet<u16> = servers.iter().map(RedisServer::port).collect();
    assert_eq!(ports.len(), 4);
    for server in &servers {
        assert_eq!(ping(&server.url()).unwrap(), "PONG");
    }
}

#[test]
fn free_port_leaves_the_bus_port_free_below_the_ephemeral_range() {
    // Linux's default ephemeral range starts at 32768; where the machine
    // says otherwise, its own figure.
    let ephemeral_from: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let ports: HashSet<u16> = (0..20).map(|_| free_port()).collect();
    assert_eq!(ports.len(), 20, "never the same port twice");
    for port in ports {
        assert!(u32::from(port) + 10_000 < ephemeral_from, "{port}");
        std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).unwrap();
    }
}

const PORTS_CHILD: &str = "IDEM_TESTKIT_PORTS_CHILD";

/// A port stays this process's until it exits, so a server killed and
/// restarted on it never finds another test's server there.
#[test]
fn free_port_never_hands_a_held_port_to_another_process() {
    if std::env::var_os(PORTS_CHILD).is_some() {
        let ports: Vec<String> = (0..50).map(|_| free_port().to_string()).collect();
        println!("ports: {}", ports.join(","));
        return;
    }
    let mine: HashSet<u16> = (0..50).map(|_| free_port()).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "server::free_port_never_hands_a_held_port_to_another_process",
            "--nocapture",
        ])
        .env(PORTS_CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: HashSet<u16> = stdout
        .lines()
        .find_map(|line| line.strip_prefix("ports: "))
        .unwrap_or_else(|| panic!("the child printed no ports: {stdout}"))
        .split(',')
        .map(|port| port.parse().unwrap())
        .collect();
    assert_eq!(theirs.len(), 50);
    assert!(mine.is_disjoint(&theirs), "{mine:?} and {theirs:?} meet");
}

#[tokio::test]
async fn async_client_works() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("SET")
        .arg("key")
        .arg("value")
        .query_async(&mut con)
        .await
        .unwrap();
    let value: String = redis::cmd("GET")
        .arg("key")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(value, "value");
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// A server outlives no test process, even one killed with SIGKILL (so no
/// destructor ran). The test re-runs itself as a child process that starts a
/// server and hangs; the parent kills that child.
#[test]
fn servers_die_with_a_killed_test_process() {
    use std::io::BufRead;
    const CHILD: &str = "IDEM_TESTKIT_ORPHAN_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let server = RedisServer::start();
        // The harness may have printed "test NAME ... " on the same line.
        println!("\nSERVER_PID={}", server.pid().unwrap());
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "server::servers_die_with_a_killed_test_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let pid: u32 = stdout
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            line.strip_prefix("SERVER_PID=")
                .map(|p| p.trim().parse().unwrap())
        })
        .expect("the child test prints the server pid");
    assert!(!process_gone(pid));
    child.kill().unwrap();
    child.wait().unwrap();
    wait_until("the orphaned server died", Duration::from_secs(5), || {
        process_gone(pid)
    });
}
