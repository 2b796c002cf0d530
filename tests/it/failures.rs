//! `Store::count_failure` / `Idempotency::count_failure`: the per-key count
//! of failed runs that `idem-consumer` dead-letters on. The same assertions
//! on a private Redis, a private three-master Redis Cluster, a PostgreSQL
//! database of its own and MemoryStore.

use idem::store::failure_key;
use idem::{Error, Idempotency, KeyState, Outcome};
use idem_testkit::TestContext;
use std::time::Duration;

const DAY: Duration = Duration::from_secs(86_400);

idem_testkit::every_store!(
    namespace = "fail", stores = [redis, cluster, postgres, postgres_partitioned, dynamodb, memory];
    counts_survive_releases,
    concurrent_counts_are_exact,
    ttl_expires_the_count,
    forget_resets_the_count,
    counters_never_meet_records_nor_scans,
);

/// A body that fails: the call releases the key, the counter stays.
async fn fail_once(idem: &Idempotency, scope: &str, key: &str) {
    let r: Result<u32, Error> = idem
        .call(scope, key)
        .run(|| async { Err(Error::codec("handler failed")) })
        .await;
    assert!(r.is_err(), "the body's error passes through");
}

async fn counts_survive_releases(ctx: TestContext) {
    let idem = ctx.idem();
    for expected in 1..=3 {
        fail_once(&idem, "charge", "order-1").await;
        assert_eq!(
            idem.inspect("charge", "order-1").await.unwrap(),
            None,
            "{}: the failed run released the record",
            ctx.name()
        );
        let n = idem.count_failure("charge", "order-1", DAY).await.unwrap();
        assert_eq!(
            n,
            expected,
            "{}: count after {expected} failures",
            ctx.name()
        );
    }
    // The key still runs (and completes) once: the counter is no record.
    let (v, o) = idem
        .call("charge", "order-1")
        .run_outcome(|| async { Ok::<_, Error>(7u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (7, Outcome::Executed));
    assert_eq!(
        idem.count_failure("charge", "order-1", DAY).await.unwrap(),
        4,
        "{}: completing the record leaves its counter alone",
        ctx.name()
    );
}

async fn concurrent_counts_are_exact(ctx: TestContext) {
    const N: u32 = 48;
    let idem = ctx.idem();
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let idem = idem.clone();
            tokio::spawn(async move { idem.count_failure("charge", "hot", DAY).await })
        })
        .collect();
    let mut counts = Vec::new();
    for t in tasks {
        counts.push(t.await.unwrap().unwrap());
    }
    counts.sort_unstable();
    assert_eq!(
        counts,
        (1..=N).collect::<Vec<_>>(),
        "{}: every count once",
        ctx.name()
    );
}

async fn ttl_expires_the_count(ctx: TestContext) {
    let idem = ctx.idem();
    assert_eq!(idem.count_failure("charge", "k", DAY).await.unwrap(), 1);
    assert_eq!(idem.count_failure("charge", "k", DAY).await.unwrap(), 2);
    // Each count sets the expiry anew, here far shorter than the day before.
    let short = Duration::from_millis(100);
    assert_eq!(idem.count_failure("charge", "k", short).await.unwrap(), 3);
    tokio::time::sleep(short * 10).await;
    assert_eq!(
        idem.count_failure("charge", "k", DAY).await.unwrap(),
        1,
        "{}: an expired counter starts again",
        ctx.name()
    );
}

async fn forget_resets_the_count(ctx: TestContext) {
    let idem = ctx.idem();
    // A key with no record.
    for expected in 1..=2 {
        assert_eq!(
            idem.count_failure("charge", "bare", DAY).await.unwrap(),
            expected
        );
    }
    assert!(idem.forget("charge", "bare").await.unwrap().is_none());
    assert_eq!(
        idem.count_failure("charge", "bare", DAY).await.unwrap(),
        1,
        "{}: forget resets a key without a record",
        ctx.name()
    );

    // A key with a completed record.
    let _: u32 = idem
        .call("charge", "done")
        .run(|| async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    for expected in 1..=3 {
        assert_eq!(
            idem.count_failure("charge", "done", DAY).await.unwrap(),
            expected
        );
    }
    let removed = idem.forget("charge", "done").await.unwrap().unwrap();
    assert_eq!(removed.state, KeyState::Completed);
    assert_eq!(
        idem.count_failure("charge", "done", DAY).await.unwrap(),
        1,
        "{}: forget resets a completed key's count",
        ctx.name()
    );
}

async fn counters_never_meet_records_nor_scans(ctx: TestContext) {
    let idem = ctx.idem();
    // Scopes and keys that escape into each other's shapes stay apart.
    let pairs = [("a:b", "c"), ("a", "b:c"), ("failures", "a:c"), ("a", "c")];
    for (i, (scope, key)) in pairs.iter().enumerate() {
        for _ in 0..=i {
            idem.count_failure(scope, key, DAY).await.unwrap();
        }
    }
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let n = idem.count_failure(scope, key, DAY).await.unwrap();
        assert_eq!(n as usize, i + 2, "{}: ({scope:?}, {key:?})", ctx.name());
        // No record was made by counting.
        assert_eq!(idem.inspect(scope, key).await.unwrap(), None);
    }
    // Counting in one namespace never reaches another's counter.
    let other = ctx.idem_with(|b| b.namespace("fail2"));
    assert_eq!(other.count_failure("a", "c", DAY).await.unwrap(), 1);

    // A record under a key with a counter runs and replays as usual; scans
    // list records only, in every scope, the counters' own shape included.
    for (scope, key) in &pairs {
        let (_, o) = idem
            .call(scope, key)
            .run_outcome(|| async { Ok::<_, Error>(1u8) })
            .await
            .unwrap();
        assert_eq!(o, Outcome::Executed, "{}: ({scope:?}, {key:?})", ctx.name());
    }
    for scope in ["a", "a:b", "failures", ""].into_iter().chain(["fail"]) {
        let mut scan = idem.scan(scope);
        let mut keys = Vec::new();
        while let Some(entry) = scan.next().await {
            match entry {
                Ok(entry) => keys.push(entry.key),
                Err(Error::InvalidKey(_)) if scope.is_empty() => break,
                Err(e) => panic!("{}: scan {scope:?}: {e}", ctx.name()),
            }
        }
        keys.sort();
        let mut expected: Vec<String> = pairs
            .iter()
            .filter(|(s, _)| *s == scope)
            .map(|(_, k)| (*k).to_owned())
            .collect();
        expected.sort();
        assert_eq!(keys, expected, "{}: scan of scope {scope:?}", ctx.name());
    }
    // Invalid scopes and keys are refused before the store.
    assert!(idem.count_failure("", "k", DAY).await.is_err());
    assert!(idem.count_failure("s", "", DAY).await.is_err());
    assert_eq!(failure_key("fail:a:c"), "fail::failures:a:c");
}

/// Redis: a counter key holding something else (another program's key) is
/// reported as corrupt and left as it is.
#[tokio::test]
async fn redis_counter_of_another_program_is_corrupt_and_kept() {
    let ctx = TestContext::redis().await.with_namespace("fail");
    let idem = ctx.idem();
    let server = ctx.server();
    let counter = failure_key("fail:charge:text");
    assert_eq!(server.cli(&["SET", &counter, "not a count"]), "OK");
    let e = idem.count_failure("charge", "text", DAY).await.unwrap_err();
    assert!(
        matches!(&e, Error::Corrupt { reason: m, .. } if m.contains("not a count")),
        "{e}"
    );
    assert_eq!(server.cli(&["GET", &counter]), "not a count");

    let counter = failure_key("fail:charge:list");
    server.cli(&["RPUSH", &counter, "x"]);
    let e = idem.count_failure("charge", "list", DAY).await.unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert_eq!(server.cli(&["TYPE", &counter]), "list");

    // A real counter: its key and its expiry, as documented.
    idem.count_failure("charge", "k", Duration::from_secs(60))
        .await
        .unwrap();
    let counter = failure_key("fail:charge:k");
    assert_eq!(server.cli(&["GET", &counter]), "1");
    let pttl: i64 = server.cli(&["PTTL", &counter]).parse().unwrap();
    assert!(pttl > 0 && pttl <= 60_000, "{pttl}");
}
