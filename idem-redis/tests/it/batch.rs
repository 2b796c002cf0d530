//! `Store::claim_batch` and `Store::finish_batch` on Redis past the happy
//! path the model (`tests/it/model.rs`) drives: scripts flushed between
//! batches, a key that holds another Redis type, and a cluster, where a
//! batch spans every master and a slot moved under a batch is followed key
//! by key.

use idem_core::Error;
use idem_core::store::{ClaimReply, Complete, Finish, Store, Token, ValueKind, WriteReply};
use idem_redis::RedisStore;
use idem_testkit::{TestContext, claim, key_slot};
use std::collections::BTreeSet;

const LEASE_MS: u64 = 30_000;
const TTL_MS: u64 = 60_000;

fn complete<'a>(key: &'a str, token: &'a Token, value: &'a [u8]) -> Finish<'a> {
    Finish::Complete(Complete::of_claim(
        &claim(key, token, LEASE_MS, TTL_MS, None),
        ValueKind::Json,
        value,
    ))
}

/// Claims `keys` one batch, each by its own token of `tokens`.
async fn claim_all(
    store: &dyn Store,
    keys: &[String],
    tokens: &[Token],
) -> Vec<Result<ClaimReply, Error>> {
    let claims: Vec<_> = keys
        .iter()
        .zip(tokens)
        .map(|(k, t)| claim(k, t, LEASE_MS, TTL_MS, None))
        .collect();
    store.claim_batch(&claims).await
}

fn replays(replies: &[Result<ClaimReply, Error>]) -> Vec<Vec<u8>> {
    replies
        .iter()
        .map(|r| match r {
            Ok(ClaimReply::Completed(c)) => c.value.to_vec(),
            other => panic!("expected a replay, got {other:?}"),
        })
        .collect()
}

/// After `SCRIPT FLUSH` with only the release script loaded again, a batch
/// of `complete` then `release` of one key must still answer them in that
/// order (the complete is retried alone, before the release is sent), and
/// a contended claim must load the claim script again.
#[tokio::test]
async fn flushed_scripts_keep_each_keys_batch_order() {
    let ctx = TestContext::redis().await;
    let store = ctx.store();
    let (t1, t2) = (Token::random(), Token::random());
    let keys = ["batch:flush:a", "batch:flush:b", "batch:flush:c"];
    for key in keys {
        let reply = store.claim(claim(key, &t1, LEASE_MS, TTL_MS, None)).await;
        assert_eq!(reply.unwrap(), ClaimReply::Acquired { attempt: 1 });
    }
    assert_eq!(ctx.server().cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    // Loads the release script alone.
    let missing = store.release("batch:flush:none", &t1).await.unwrap();
    assert_eq!(missing, WriteReply::Missing);

    let replies = store
        .finish_batch(&[
            complete(keys[0], &t1, b"1"),
            Finish::Release {
                key: keys[0],
                token: &t1,
            },
            complete(keys[1], &t1, b"2"),
        ])
        .await;
    let replies: Vec<WriteReply> = replies.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        replies,
        [
            WriteReply::Done,
            WriteReply::AlreadyCompleted,
            WriteReply::Done
        ]
    );

    assert_eq!(ctx.server().cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    let replies = store
        .claim_batch(&[
            claim(keys[2], &t2, LEASE_MS, TTL_MS, None),
            claim(keys[0], &t2, LEASE_MS, TTL_MS, None),
        ])
        .await;
    assert!(
        matches!(replies[0], Ok(ClaimReply::InProgress { .. })),
        "{replies:?}"
    );
    assert!(
        matches!(&replies[1], Ok(ClaimReply::Completed(c)) if &c.value[..] == b"1"),
        "{replies:?}"
    );
}

/// A key holding another Redis type answers its own item with a typed
/// error; the other items of the batch are answered normally.
#[tokio::test]
async fn a_bad_item_fails_alone() {
    let ctx = TestContext::redis().await;
    let store = ctx.store();
    let token = Token::random();
    ctx.server().cli(&["LPUSH", "batch:bad:list", "x"]);
    let replies = store
        .claim_batch(&[
            claim("batch:bad:ok", &token, LEASE_MS, TTL_MS, None),
            claim("batch:bad:list", &token, LEASE_MS, TTL_MS, None),
            claim("batch:bad:ok2", &token, LEASE_MS, TTL_MS, None),
        ])
        .await;
    assert_eq!(replies.len(), 3);
    assert_eq!(
        replies[0].as_ref().unwrap(),
        &ClaimReply::Acquired { attempt: 1 }
    );
    assert!(
        matches!(replies[1], Err(Error::Corrupt { .. })),
        "{replies:?}"
    );
    assert_eq!(
        replies[2].as_ref().unwrap(),
        &ClaimReply::Acquired { attempt: 1 }
    );
    let replies = store
        .finish_batch(&[
            complete("batch:bad:list", &token, b"1"),
            complete("batch:bad:ok", &token, b"2"),
        ])
        .await;
    assert!(
        matches!(replies[0], Err(Error::Corrupt { .. })),
        "{replies:?}"
    );
    assert_eq!(replies[1].as_ref().unwrap(), &WriteReply::Done);
}

/// Keys on every master in one batch, one of them twice: each item is
/// answered as its single call would be, and the batch after a completes
/// batch replays every value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_batch_spans_every_master() {
    let ctx = TestContext::redis_cluster().await;
    let cluster = ctx.cluster();
    let store = ctx.store();
    let mut keys: Vec<String> = (0..12).map(|i| format!("batch:spread:{i}")).collect();
    let owners: BTreeSet<usize> = keys.iter().map(|k| cluster.slot_owner(k)).collect();
    assert_eq!(
        owners,
        BTreeSet::from([0, 1, 2]),
        "keys must span 3 masters"
    );
    keys.push(keys[3].clone());
    let tokens: Vec<Token> = keys.iter().map(|_| Token::random()).collect();

    let replies = claim_all(store, &keys, &tokens).await;
    for (i, reply) in replies.iter().enumerate() {
        match (i, reply) {
            (12, Ok(ClaimReply::InProgress { .. })) => {}
            (0..12, Ok(ClaimReply::Acquired { attempt: 1 })) => {}
            _ => panic!("item {i} ({}): {reply:?}", keys[i]),
        }
    }
    let values: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| i.to_string().into_bytes())
        .collect();
    let ops: Vec<Finish<'_>> = keys
        .iter()
        .zip(&tokens)
        .zip(&values)
        .map(|((k, t), v)| complete(k, t, v))
        .collect();
    let done: Vec<WriteReply> = store
        .finish_batch(&ops)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let mut expected = vec![WriteReply::Done; 12];
    expected.push(WriteReply::AlreadyCompleted);
    assert_eq!(done, expected);

    let again = claim_all(store, &keys, &tokens).await;
    let mut want: Vec<Vec<u8>> = values[..12].to_vec();
    want.push(values[3].clone());
    assert_eq!(replays(&again), want);
}

/// A slot moved to another master after the store learnt the slot map:
/// the batch's items on it are redirected (`MOVED`) and each is sent again
/// alone; every other item is answered from its pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_slot_is_followed_key_by_key() {
    let ctx = TestContext::redis_cluster().await;
    let cluster = ctx.cluster();
    let store: &RedisStore = ctx.redis_store();
    let keys: Vec<String> = (0..9).map(|i| format!("batch:moved:{i}")).collect();
    let tokens: Vec<Token> = keys.iter().map(|_| Token::random()).collect();
    // The store learns the current map.
    let warm = claim_all(store, &keys[..1], &tokens[..1]).await;
    assert_eq!(
        warm[0].as_ref().unwrap(),
        &ClaimReply::Acquired { attempt: 1 }
    );

    let moved = &keys[1];
    let slot = key_slot(moved);
    let to = (cluster.slot_owner(moved) + 1) % 3;
    tokio::task::block_in_place(|| cluster.migrate_slot(slot, to));
    assert_eq!(cluster.slot_owner(moved), to);

    let replies = claim_all(store, &keys[1..], &tokens[1..]).await;
    for (key, reply) in keys[1..].iter().zip(&replies) {
        assert_eq!(
            reply.as_ref().ok(),
            Some(&ClaimReply::Acquired { attempt: 1 }),
            "{key}: {reply:?}"
        );
    }
    assert!(ctx.record_state(moved).is_some(), "{moved} was written");
}

/// The command sent with a batch's results
/// (`RedisStore::finish_batch_then`) goes last in the pipeline that stores
/// them, so it sees them (a `GET` of a completed key reads the completed
/// record); its reply comes back. A batch with a key twice (two waves) and
/// a cluster carry nothing, so no reply comes back and its sender sends its
/// own round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_goes_after_the_results_on_one_server_only() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store();
    let keys: Vec<String> = ["batch:ride:a", "batch:ride:b"].map(String::from).to_vec();
    let tokens = [Token::random(), Token::random()];
    claim_all(store, &keys, &tokens).await;
    let mut get = redis::cmd("GET");
    get.arg(&keys[0]);
    let ops = [
        complete(&keys[0], &tokens[0], b"\"ridden\""),
        complete(&keys[1], &tokens[1], b"2"),
    ];
    let (replies, heard) = store.finish_batch_then(&ops, &get).await;
    assert!(
        replies.iter().all(|r| matches!(r, Ok(WriteReply::Done))),
        "{replies:?}"
    );
    let value = heard.expect("carried: its reply came back").unwrap();
    let record: Vec<u8> = redis::from_redis_value(value).unwrap();
    assert!(
        record.ends_with(b"\"ridden\""),
        "the GET ran after the complete: {}",
        String::from_utf8_lossy(&record)
    );

    // A key twice: two waves, nothing carried.
    let twice = Token::random();
    claim_all(
        store,
        &["batch:ride:c".to_owned()],
        std::slice::from_ref(&twice),
    )
    .await;
    let ops = [
        complete("batch:ride:c", &twice, b"3"),
        Finish::Release {
            key: "batch:ride:c",
            token: &twice,
        },
    ];
    let (_, heard) = store.finish_batch_then(&ops, &redis::cmd("PING")).await;
    assert!(heard.is_none(), "a batch of two waves carries nothing");

    let ctx = TestContext::redis_cluster().await;
    let store = ctx.redis_store();
    let token = Token::random();
    claim_all(
        store,
        &["batch:ride:d".to_owned()],
        std::slice::from_ref(&token),
    )
    .await;
    let (replies, heard) = store
        .finish_batch_then(
            &[complete("batch:ride:d", &token, b"4")],
            &redis::cmd("PING"),
        )
        .await;
    assert!(matches!(replies[0], Ok(WriteReply::Done)), "{replies:?}");
    assert!(heard.is_none(), "a cluster carries nothing");
}

/// On Redis 7 a wave's completes go as one `complete_batch` call. After
/// `SCRIPT FLUSH` that call gets `NOSCRIPT`: each complete is stored alone
/// (the single complete loads its script), and `complete_batch` is loaded
/// again, so the next batch is one call again. Each item keeps its own
/// answer: a key another owner holds is `OtherOwner`, the rest `Done`.
#[tokio::test]
async fn a_flushed_complete_batch_completes_alone_then_is_one_call_again() {
    let ctx = TestContext::redis().await;
    let store = ctx.store();
    let server = ctx.server();
    let stats = |server: &idem_testkit::RedisServer| {
        let info = server.cli(&["INFO", "commandstats"]);
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
            .and_then(|s| s.split(',').find_map(|kv| kv.strip_prefix("calls=")))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let script_path = server
        .cli(&["INFO", "server"])
        .lines()
        .any(|l| l.starts_with("redis_version:7.") || l.starts_with("redis_version:6."))
        && !server.cli(&["INFO", "server"]).contains("valkey_version");
    for round in 0..2 {
        let keys: Vec<String> = (0..4).map(|i| format!("batch:joint:{round}:{i}")).collect();
        let tokens: Vec<Token> = keys.iter().map(|_| Token::random()).collect();
        claim_all(store, &keys, &tokens).await;
        // The last key is another owner's.
        let other = Token::random();
        if round == 0 {
            assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
        }
        assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]).trim(), "OK");
        let ops: Vec<Finish<'_>> = keys
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (k, t))| complete(k, if i == 3 { &other } else { t }, b"7"))
            .collect();
        let replies: Vec<WriteReply> = store
            .finish_batch(&ops)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            replies,
            [
                WriteReply::Done,
                WriteReply::Done,
                WriteReply::Done,
                WriteReply::OtherOwner
            ],
            "round {round}"
        );
        if script_path && round == 1 {
            assert_eq!(stats(server), 1, "one complete_batch call for the wave");
        }
    }
}

/// The command sent with a batch's results
/// (`RedisStore::finish_batch_then`) runs only once every complete of its
/// batch is stored, so a consumer that acks with it never acks an entry
/// whose result is not stored yet: its sender sends it itself after. After
/// `SCRIPT FLUSH` the batch's completes get `NOSCRIPT` in the round trip
/// that carries it and are stored alone after it: the command is withheld
/// (its write is not made; the reply is an error). So it is when a
/// complete is refused (another owner's pending record); it runs again
/// once every result is stored.
#[tokio::test]
async fn a_command_is_withheld_while_a_result_of_its_batch_is_not_stored() {
    fn marking() -> redis::Cmd {
        let mut mark = redis::cmd("SET");
        mark.arg("batch:gate:carried").arg("1");
        mark
    }
    fn heard_value(heard: Option<Result<redis::Value, Error>>) -> redis::Value {
        heard.expect("its reply came back").unwrap()
    }
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store();
    let server = ctx.server();
    let carried = || server.cli(&["EXISTS", "batch:gate:carried"]).trim() == "1";

    // The scripts gone: stored alone, after the round trip.
    let keys: Vec<String> = ["batch:gate:a", "batch:gate:b"].map(String::from).to_vec();
    let tokens = [Token::random(), Token::random()];
    claim_all(store, &keys, &tokens).await;
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    let ops = [
        complete(&keys[0], &tokens[0], b"1"),
        complete(&keys[1], &tokens[1], b"2"),
    ];
    let (replies, heard) = store.finish_batch_then(&ops, &marking()).await;
    assert!(
        replies.iter().all(|r| matches!(r, Ok(WriteReply::Done))),
        "stored alone: {replies:?}"
    );
    let value = heard_value(heard);
    assert!(
        matches!(&value, redis::Value::ServerError(e) if ["UNSTORED", "NOSCRIPT"].contains(&e.code())),
        "withheld: {value:?}"
    );
    assert!(!carried(), "the carried command did not run");
    for key in &keys {
        assert!(
            ctx.record_state(key).is_some_and(|s| s.is_completed()),
            "{key}"
        );
    }

    // One complete refused: its key stays another owner's pending record.
    let keys: Vec<String> = ["batch:gate:c", "batch:gate:d"].map(String::from).to_vec();
    let tokens = [Token::random(), Token::random()];
    claim_all(store, &keys, &tokens).await;
    let other = Token::random();
    let ops = [
        complete(&keys[0], &tokens[0], b"3"),
        complete(&keys[1], &other, b"4"),
    ];
    let (replies, heard) = store.finish_batch_then(&ops, &marking()).await;
    assert!(matches!(replies[0], Ok(WriteReply::Done)), "{replies:?}");
    assert!(
        matches!(replies[1], Ok(WriteReply::OtherOwner)),
        "{replies:?}"
    );
    let value = heard_value(heard);
    assert!(
        matches!(&value, redis::Value::ServerError(e) if e.code() == "UNSTORED"),
        "withheld: {value:?}"
    );
    assert!(!carried(), "the carried command did not run");

    // Every result stored in the round trip: the command runs in it.
    let keys: Vec<String> = ["batch:gate:e"].map(String::from).to_vec();
    let tokens = [Token::random()];
    claim_all(store, &keys, &tokens).await;
    let (replies, heard) = store
        .finish_batch_then(&[complete(&keys[0], &tokens[0], b"5")], &marking())
        .await;
    assert!(matches!(replies[0], Ok(WriteReply::Done)), "{replies:?}");
    assert_eq!(heard_value(heard), redis::Value::Okay);
    assert!(carried());
}
