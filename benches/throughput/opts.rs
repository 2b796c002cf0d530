//! Command-line options.

use crate::phases::PHASES;

pub(crate) struct Opts {
    pub(crate) redis: Option<String>,
    /// `--server redis|valkey|both`: which server binaries to run the Redis
    /// phases on (`servers.rs`); `None` = this process on redis-server.
    pub(crate) server: Option<String>,
    pub(crate) concurrency: usize,
    pub(crate) seconds: f64,
    pub(crate) rounds: usize,
    pub(crate) threads: usize,
    pub(crate) replay_keys: u64,
    pub(crate) only: Option<Vec<String>>,
    pub(crate) json: bool,
    pub(crate) profile: Option<String>,
    pub(crate) ops: u64,
    /// PostgreSQL phases (feature `postgres`): server, tasks, and whether
    /// to skip the Redis phases.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) pg_url: Option<String>,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) pg_concurrency: usize,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) pg_only: bool,
    /// `--pg`: run the PostgreSQL phases too (before the Redis ones).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) pg: bool,
}

pub(crate) fn usage() -> ! {
    eprintln!(
        "usage: cargo bench --bench throughput -- [--redis URL | --server redis|valkey|both] [--concurrency N] [--seconds S] \
         [--rounds R] [--threads T] [--replay-keys K] [--only PHASE,..] [--json] \
         [--profile PHASE --ops N] [--pg] [--pg-url URL] [--pg-concurrency N] [--pg-only]\nphases: {}",
        PHASES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
    );
    std::process::exit(2)
}

pub(crate) fn parse_opts() -> Opts {
    let mut o = Opts {
        redis: None,
        server: None,
        concurrency: 64,
        seconds: 5.0,
        rounds: 25,
        threads: 1,
        replay_keys: 1000,
        only: None,
        json: false,
        profile: None,
        ops: 20_000,
        pg_url: None,
        pg_concurrency: 16,
        pg_only: false,
        pg: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                usage()
            })
        };
        fn num<T: std::str::FromStr>(name: &str, v: String) -> T {
            v.parse().unwrap_or_else(|_| {
                eprintln!("{name}: not a number: {v}");
                usage()
            })
        }
        match a.as_str() {
            "--redis" => o.redis = Some(value("--redis")),
            "--server" => {
                let v = value("--server");
                if !["redis", "valkey", "both"].contains(&v.as_str()) {
                    eprintln!("--server: redis, valkey or both, not {v}");
                    usage()
                }
                o.server = Some(v)
            }
            "--concurrency" | "-c" => o.concurrency = num("--concurrency", value("--concurrency")),
            "--seconds" | "-s" => o.seconds = num("--seconds", value("--seconds")),
            "--rounds" => o.rounds = num("--rounds", value("--rounds")),
            "--threads" => o.threads = num("--threads", value("--threads")),
            "--replay-keys" => o.replay_keys = num("--replay-keys", value("--replay-keys")),
            "--only" => {
                o.only = Some(value("--only").split(',').map(str::to_owned).collect());
            }
            "--profile" => o.profile = Some(value("--profile")),
            "--ops" => o.ops = num("--ops", value("--ops")),
            "--json" => o.json = true,
            "--pg-url" => o.pg_url = Some(value("--pg-url")),
            "--pg-concurrency" => {
                o.pg_concurrency = num("--pg-concurrency", value("--pg-concurrency"))
            }
            "--pg-only" => o.pg_only = true,
            "--pg" => o.pg = true,
            // What `cargo bench` passes to a harness = false target.
            "--bench" => {}
            "-h" | "--help" => usage(),
            other if other.starts_with('-') => {
                eprintln!("unknown option {other}");
                usage()
            }
            _ => {} // a cargo bench name filter: this bench has one target
        }
    }
    // Fresh keys hold the task number in 4 digits.
    if !(1..=9999).contains(&o.concurrency)
        || o.rounds == 0
        || o.seconds <= 0.0
        || o.replay_keys == 0
    {
        usage()
    }
    o
}
