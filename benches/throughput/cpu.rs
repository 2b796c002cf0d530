//! CPU time of this process and of redis-server, per call.

use redis::aio::ConnectionManager;

/// CPU time of every thread of this process, in seconds (Linux:
/// `/proc/self/task/*/schedstat`, nanosecond resolution); 0 elsewhere.
pub(crate) fn client_cpu() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut ns = 0u64;
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
        }
    }
    ns as f64 / 1e9
}

/// CPU time of processes `pids` (same machine), in seconds: the
/// PostgreSQL backends serving the bench's pool. 0 for a pid not found
/// (a server on another machine).
#[cfg(feature = "postgres")]
pub(crate) fn pids_cpu(pids: &[i32]) -> f64 {
    let ns: u64 = pids
        .iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum();
    ns as f64 / 1e9
}

/// CPU time of the Redis server so far (`INFO cpu`), in seconds.
pub(crate) async fn redis_cpu(conn: &mut ConnectionManager) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| *k == "used_cpu_sys" || *k == "used_cpu_user")
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}
