//! Without `using` and with no runtime installed, an `#[idempotent]` fn
//! returns `idem::Error::NotInstalled` through the user's error type, without
//! running the body. Its own test binary: installing is process-wide.

use idem::idempotent;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug)]
enum PaymentError {
    Idem(idem::Error),
}

impl From<idem::Error> for PaymentError {
    fn from(e: idem::Error) -> Self {
        PaymentError::Idem(e)
    }
}

static RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = order_id, ttl = "1h")]
async fn charge(order_id: &str) -> Result<u64, PaymentError> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(order_id.len() as u64)
}

#[idempotent(key = order_id)]
async fn charge_plain(order_id: &str) -> Result<u64, idem::Error> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(order_id.len() as u64)
}

#[tokio::test]
async fn returns_not_installed_without_running_the_body() {
    assert!(idem::Idempotency::global().is_none());
    match charge("order-1").await {
        Err(PaymentError::Idem(idem::Error::NotInstalled)) => {}
        other => panic!("expected NotInstalled, got {other:?}"),
    }
    assert!(matches!(
        charge_plain("order-1").await,
        Err(idem::Error::NotInstalled)
    ));
    assert_eq!(RUNS.load(Ordering::SeqCst), 0);
}
