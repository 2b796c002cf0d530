use idem::{idempotent, Idempotency, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Refund {
    pub amount: u64,
    pub currency: String,
}

#[derive(Debug)]
pub enum PaymentError {
    Idem(idem::Error),
}

impl From<idem::Error> for PaymentError {
    fn from(e: idem::Error) -> Self {
        PaymentError::Idem(e)
    }
}

pub struct Payments {
    idem: Idempotency,
}

impl Payments {
    #[idempotent(key = order_id, ttl = "1h", lease = "10s", scope = "payments.refund.v1",
                 fingerprint = (amount, currency), wait = "5s", using = self.idem)]
    pub async fn refund(&self, order_id: &str, amount: u64, currency: &str) -> Result<Refund, PaymentError> {
        Ok(Refund { amount, currency: currency.to_owned() })
    }

    // A fingerprint tuple borrows its parts, so the body can still use `req`.
    #[idempotent(key = req.id, fingerprint = (req.body, req.amount), ttl = "7d", lease = "500ms", wait = "1h 30m", using = self.idem)]
    pub async fn submit(&self, req: Request) -> Result<String, PaymentError> {
        Ok(req.body)
    }
}

pub struct Request {
    pub id: u64,
    pub body: String,
    pub amount: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let p = Payments { idem: Idempotency::builder(MemoryStore::new()).build() };
    let r = p.refund("o-1", 5, "EUR").await.unwrap();
    assert_eq!(r, Refund { amount: 5, currency: "EUR".into() });
    let s = p.submit(Request { id: 1, body: "b".into(), amount: 2 }).await.unwrap();
    assert_eq!(s, "b");
}
