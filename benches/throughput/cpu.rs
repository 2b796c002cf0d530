//! CPU time of this process and of redis-server, per call.

use redis::aio::ConnectionManager;

/// CPU time of every thread of this process, in seconds (0 without
/// `/proc`).
pub(crate) fn client_cpu() -> f64 {
    idem_testkit::process_cpu("self")
}

/// CPU time of processes `pids` (same machine), in seconds: the
/// PostgreSQL backends serving the bench's pool. 0 for a pid not found
/// (a server on another machine).
#[cfg(feature = "postgres")]
pub(crate) fn pids_cpu(pids: &[i32]) -> f64 {
    pids.iter()
        .map(|p| idem_testkit::process_cpu(&p.to_string()))
        .sum()
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
