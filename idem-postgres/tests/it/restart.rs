//! A private PostgreSQL restarted (stopped like a crash) under load: calls
//! wait it out or fail closed with `Unavailable`, no key runs twice,
//! completed results survive the restart, and calls work again after it.

use idem_core::{Error, Idempotency, Outcome};
use idem_postgres::PgStore;
use idem_testkit::{Ledger, PgServer};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_load() {
    let pg = PgServer::start();
    let store = PgStore::connect(&pg.url("postgres")).await.unwrap();
    store.migrate().await.unwrap();
    let idem = Idempotency::builder(store).build();
    let (v, _) = idem
        .call("s", "before")
        .run_outcome(|| async { Ok::<_, Error>(41u32) })
        .await
        .unwrap();
    assert_eq!(v, 41);

    let ledger = Ledger::new();
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, unavailable) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (idem, ledger, stop) = (idem.clone(), ledger.clone(), stop.clone());
            let (ok, unavailable) = (ok.clone(), unavailable.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let key = format!("{t}-{n}");
                    let l = ledger.clone();
                    let k = key.clone();
                    let r = idem
                        .call("load", &key)
                        .run_outcome(|| async move {
                            l.record(&k);
                            Ok::<_, Error>(n)
                        })
                        .await;
                    match r {
                        Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(Error::Unavailable { .. }) => {
                            unavailable.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(e) => panic!("{key}: unexpected {e}"),
                    };
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = ok.load(Ordering::Relaxed);
    pg.stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    pg.start_again();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after_restart = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    assert!(before > 0, "no call succeeded before the restart");
    // Calls caught by the outage either waited it out (the pool reconnects,
    // idem re-sends the claim) or failed closed with `Unavailable`; either
    // way no body ran twice.
    eprintln!(
        "ok {}, unavailable {}",
        ok.load(Ordering::Relaxed),
        unavailable.load(Ordering::Relaxed)
    );
    assert!(
        ok.load(Ordering::Relaxed) > after_restart,
        "calls did not recover after the restart"
    );
    assert!(
        ledger.duplicates().is_empty(),
        "a key ran twice: {:?}",
        ledger.duplicates()
    );
    // the result completed before the crash-like stop is still there
    let (v, o) = idem
        .call("s", "before")
        .run_outcome(|| async { Ok::<_, Error>(0u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (41, Outcome::Replayed));
}
