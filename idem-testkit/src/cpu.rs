//! CPU time of processes on this machine, for benches that report what a
//! call or a message costs beside how fast it went.

/// CPU time so far of every thread of process `pid` (`"self"` for this
/// one), in seconds: Linux `/proc/<pid>/task/*/schedstat`, nanosecond
/// resolution. 0 where there is no such process (or no `/proc`).
///
/// ```
/// let before = idem_testkit::process_cpu("self");
/// let spin: u64 = (0..100_000u64).map(std::hint::black_box).sum();
/// assert!(spin > 0 && idem_testkit::process_cpu("self") >= before);
/// ```
pub fn process_cpu(pid: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}
