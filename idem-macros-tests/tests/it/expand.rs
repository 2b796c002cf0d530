//! Runs `#[idempotent]` functions against the in-memory store: the body runs
//! once per key and later calls replay its value.

use idem::{Idempotency, MemoryStore, idempotent};
use serde::{Deserialize, Serialize};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug)]
pub(crate) enum PaymentError {
    #[allow(dead_code)] // shown by Debug in failed assertions
    Idem(idem::Error),
    Declined,
}

impl From<idem::Error> for PaymentError {
    fn from(e: idem::Error) -> Self {
        PaymentError::Idem(e)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub order_id: String,
    pub amount: u64,
    pub run: usize,
}

pub(crate) struct ChargeRequest {
    pub order_id: String,
    pub amount: u64,
}

/// Installs one global runtime for the tests of this binary that use it.
fn install_global() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        Idempotency::builder(MemoryStore::new())
            .build()
            .install()
            .expect("first install");
    });
}

static CHARGES: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = req.order_id, ttl = "24h")]
async fn charge(req: ChargeRequest) -> Result<Receipt, PaymentError> {
    let run = CHARGES.fetch_add(1, Ordering::SeqCst) + 1;
    Ok(Receipt {
        order_id: req.order_id,
        amount: req.amount,
        run,
    })
}

#[tokio::test]
async fn global_runtime_runs_the_body_once_and_replays() {
    install_global();
    let req = || ChargeRequest {
        order_id: "order-1".into(),
        amount: 1250,
    };
    let first = charge(req()).await.unwrap();
    let second = charge(req()).await.unwrap();
    let third = charge(req()).await.unwrap();
    assert_eq!(
        CHARGES.load(Ordering::SeqCst),
        1,
        "the body ran exactly once"
    );
    assert_eq!(
        first,
        Receipt {
            order_id: "order-1".into(),
            amount: 1250,
            run: 1
        }
    );
    assert_eq!(second, first, "replayed");
    assert_eq!(third, first, "replayed");
}

static GREETINGS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = name, ttl = "1h")]
async fn greet(name: &str) -> Result<String, PaymentError> {
    GREETINGS.fetch_add(1, Ordering::SeqCst);
    Ok(format!("hello {name}"))
}

#[tokio::test]
async fn each_key_runs_once() {
    install_global();
    for _ in 0..3 {
        assert_eq!(greet("ann").await.unwrap(), "hello ann");
        assert_eq!(greet("bob").await.unwrap(), "hello bob");
    }
    assert_eq!(GREETINGS.load(Ordering::SeqCst), 2);
}

pub(crate) struct Payments {
    idem: Idempotency,
    refunds: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Refund {
    pub order_id: String,
    pub amount: u64,
    pub currency: String,
    pub run: usize,
}

impl Payments {
    #[idempotent(key = order_id, ttl = "1h", lease = "10s", scope = "payments.refund.v1",
                 fingerprint = (amount, currency), wait = "5s", using = self.idem)]
    async fn refund(
        &mut self,
        order_id: &str,
        amount: u64,
        currency: &str,
    ) -> Result<Refund, PaymentError> {
        if amount == 0 {
            return Err(PaymentError::Declined);
        }
        self.refunds += 1;
        Ok(Refund {
            order_id: order_id.to_owned(),
            amount,
            currency: currency.to_owned(),
            run: self.refunds,
        })
    }
}

#[tokio::test]
async fn using_a_field_of_mut_self() {
    let mut payments = Payments {
        idem: Idempotency::builder(MemoryStore::new()).build(),
        refunds: 0,
    };
    let first = payments.refund("order-7", 300, "EUR").await.unwrap();
    let second = payments.refund("order-7", 300, "EUR").await.unwrap();
    let third = payments.refund("order-7", 300, "EUR").await.unwrap();
    assert_eq!(payments.refunds, 1, "the body ran exactly once");
    assert_eq!(first.run, 1);
    assert_eq!(second, first);
    assert_eq!(third, first);

    // The user's own errors come back as they are.
    assert!(matches!(
        payments.refund("order-8", 0, "EUR").await,
        Err(PaymentError::Declined)
    ));
}

#[tokio::test]
async fn using_does_not_touch_the_global() {
    // A separate runtime: the same key runs again there.
    let mut other = Payments {
        idem: Idempotency::builder(MemoryStore::new()).build(),
        refunds: 0,
    };
    assert_eq!(other.refund("order-7", 300, "EUR").await.unwrap().run, 1);
    assert_eq!(other.refunds, 1);
}

static STEPS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(key = id, scope = "steps", using = idem)]
async fn step(idem: &Idempotency, id: u32, input: &str) -> Result<u32, PaymentError> {
    STEPS.fetch_add(1, Ordering::SeqCst);
    if input.is_empty() {
        return Ok(0);
    }
    let n: u32 = input.parse().map_err(|_| PaymentError::Declined)?;
    Ok(n + id)
}

#[tokio::test]
async fn early_return_and_question_mark() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    assert_eq!(step(&idem, 1, "").await.unwrap(), 0);
    assert_eq!(step(&idem, 2, "40").await.unwrap(), 42);
    assert_eq!(step(&idem, 2, "40").await.unwrap(), 42);
    assert!(matches!(
        step(&idem, 3, "x").await,
        Err(PaymentError::Declined)
    ));
    assert_eq!(STEPS.load(Ordering::SeqCst), 3);
}
