//! `idem`: inspect, forget and scan idempotency records (see `--help`).
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::indexing_slicing,
    reason = "a command-line program prints; its indexing is not audited yet"
)]

mod args;
mod outbox;
mod render;

use args::{Cli, Command, Target};
use clap::Parser;
use idem_core::{Error, Idempotency, KeyPart, validate_key_part};
use idem_redis::{RedisStore, RedisStoreConfig};
use std::process::ExitCode;
use std::time::Duration;

/// Exit codes, as `idem --help` and docs/operating.md list them.
mod exit {
    pub(crate) const NOT_FOUND: u8 = 1;
    pub(crate) const USAGE: u8 = 2;
    pub(crate) const IN_FLIGHT: u8 = 3;
    pub(crate) const UNREADABLE: u8 = 4;
    pub(crate) const UNAVAILABLE: u8 = 5;
    pub(crate) const OTHER: u8 = 6;
}

fn code_of(e: &Error) -> u8 {
    match e {
        Error::InvalidKey(_) | Error::InvalidConfig(_) => exit::USAGE,
        Error::LeaseHeld { .. } => exit::IN_FLIGHT,
        Error::Corrupt { .. } | Error::Codec { .. } => exit::UNREADABLE,
        Error::Unavailable { .. } => exit::UNAVAILABLE,
        _ => exit::OTHER,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start: {e}");
            return ExitCode::from(exit::OTHER);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::from(code_of(&e))
        }
    }
}

/// The store `idem` talks to, and what it describes itself as (the first
/// line of `inspect`: for Redis, the server and how it completes records).
/// The Redis store the target names (standalone or cluster).
pub(crate) async fn connect_redis(target: &Target) -> Result<RedisStore, Error> {
    // An operator waits a little longer than a service would.
    let config = RedisStoreConfig::default()
        .connection_timeout(Duration::from_secs(3))
        .response_timeout(Duration::from_secs(5));
    if target.cluster.is_empty() {
        let url = target.redis.as_deref().unwrap_or("redis://127.0.0.1:6379/");
        RedisStore::connect_with(url, config).await
    } else {
        let urls: Vec<&str> = target.cluster.iter().map(String::as_str).collect();
        RedisStore::connect_cluster_with(&urls, config).await
    }
}

async fn connect(target: &Target) -> Result<(Idempotency, String), Error> {
    validate_key_part(KeyPart::Namespace, &target.namespace)?;
    if let Some(table) = &target.dynamodb {
        let aws = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        let config = idem_dynamodb::DynamoStoreConfig::new(table.as_str())
            .key_attribute(target.key_attribute.as_str())
            .key_prefix(target.key_prefix.as_str());
        let client = idem_dynamodb::aws_sdk_dynamodb::Client::new(&aws);
        let store = idem_dynamodb::DynamoStore::with_config(client, config)?;
        let idem = Idempotency::builder(store)
            .namespace(&target.namespace)
            .build();
        return Ok((idem, format!("dynamodb (table {table})")));
    }
    if let Some(url) = &target.postgres {
        let config = idem_postgres::PgStoreConfig::table(target.table.as_str());
        let store = idem_postgres::PgStore::connect_with(url, config).await?;
        let idem = Idempotency::builder(store)
            .namespace(&target.namespace)
            .build();
        return Ok((idem, "postgres".to_owned()));
    }
    let store = connect_redis(target).await?;
    let described = format!(
        "redis ({}; complete: {})",
        store.server(),
        store.complete_path()
    );
    let idem = Idempotency::builder(store)
        .namespace(&target.namespace)
        .build();
    Ok((idem, described))
}

async fn run(cli: Cli) -> Result<u8, Error> {
    let json = cli.target.json;
    let (idem, store) = match &cli.command {
        Command::Outbox(command) => return outbox::run(&cli.target, command).await,
        _ => connect(&cli.target).await?,
    };
    match cli.command {
        Command::Inspect { scope, key, value } => {
            let info = if value {
                idem.inspect_with_value(&scope, &key).await?
            } else {
                idem.inspect(&scope, &key).await?
            };
            let Some(info) = info else {
                if json {
                    println!("null");
                } else {
                    eprintln!(
                        "idem: no record for {scope:?} / {key:?} in namespace {:?}",
                        cli.target.namespace
                    );
                }
                return Ok(exit::NOT_FOUND);
            };
            if json {
                println!("{}", render::json(&scope, &key, &info));
            } else {
                print!("{}", render::human_record(&store, &scope, &key, &info));
            }
            Ok(0)
        }
        Command::Forget { scope, key, force } => {
            let forget = idem.forget(&scope, &key);
            let removed = if force {
                forget.force().await?
            } else {
                forget.await?
            };
            let Some(info) = removed else {
                if json {
                    println!("null");
                } else {
                    eprintln!("idem: nothing to forget: no record for {scope:?} / {key:?}");
                }
                return Ok(exit::NOT_FOUND);
            };
            if json {
                println!("{}", render::json(&scope, &key, &info));
            } else {
                println!("forgot {scope} / {key}: it was {}", render::summary(&info));
                if let Some(ttl) = info.ttl_left {
                    println!(
                        "services with a local replay cache may replay it for up to {} more",
                        humantime::format_duration(Duration::from_secs(ttl.as_secs() + 1))
                    );
                }
            }
            Ok(0)
        }
        Command::Scan {
            scope,
            state,
            older_than,
            ttl,
            limit,
        } => {
            let mut scan = idem.scan(&scope).page_size(500);
            let mut shown = 0usize;
            while let Some(entry) = scan.next().await {
                let entry = entry?;
                let info = match entry.record {
                    Ok(info) => info,
                    Err(e) => {
                        if state.is_none() && older_than.is_none() {
                            if json {
                                let v = serde_json::json!({"scope": scope, "key": entry.key, "state": "unreadable", "error": e.to_string()});
                                println!("{v}");
                            } else {
                                println!("{}\tunreadable\t{e}", entry.key);
                            }
                            shown += 1;
                        }
                        continue;
                    }
                };
                if state.is_some_and(|s| s != info.state) {
                    continue;
                }
                if let Some(min) = older_than
                    && info.age(ttl).is_none_or(|age| age < min)
                {
                    continue;
                }
                if shown == limit {
                    eprintln!("idem: stopped after --limit {limit} keys; more match");
                    break;
                }
                shown += 1;
                if json {
                    println!("{}", render::json(&scope, &entry.key, &info));
                } else {
                    println!("{}\t{}", entry.key, render::summary(&info));
                }
            }
            if !json {
                eprintln!("{shown} key(s)");
            }
            Ok(0)
        }
        Command::Outbox(command) => outbox::run(&cli.target, &command).await,
    }
}
