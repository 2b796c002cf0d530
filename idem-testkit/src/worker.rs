//! The child side of multi-process tests: a test binary re-executed as a
//! worker process (see `idem-redis/tests/it/processes.rs`), which must
//! never outlive the test that started it.

use std::future::Future;
use std::time::Duration;

/// Exits this process (status 3) as soon as its parent is gone, checked
/// every 100 ms on a thread of its own: a worker whose test process died
/// (killed, or aborted) must not go on hammering a store.
pub fn exit_with_parent() {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        loop {
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
}

/// Runs `body` to completion as a worker process: [`exit_with_parent`],
/// then a multi-threaded Tokio runtime with two workers.
///
/// # Panics
///
/// When the runtime cannot be built.
pub fn run_worker<F: Future>(body: F) -> F::Output {
    exit_with_parent();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("idem-testkit: cannot build the worker runtime: {e}"))
        .block_on(body)
}

/// A variable the test set for its worker process.
///
/// # Panics
///
/// When it is not set: the worker was started without it.
pub fn worker_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("worker: {name} is not set"))
}

/// The payment provider of the multi-process tests, as a Redis script:
/// charges once per idempotency key (`KEYS[1]`) atomically, counts the
/// charges per order (`ARGV[1]`) in the `charges` hash, and answers every
/// request of a key with the first charge's id (`ARGV[2]`).
pub const CHARGE_ONCE_SCRIPT: &str = r"
if redis.call('SET', KEYS[1], ARGV[2], 'NX') then
  redis.call('HINCRBY', 'charges', ARGV[1], 1)
end
return redis.call('GET', KEYS[1])";
