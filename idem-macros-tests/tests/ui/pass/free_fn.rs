use idem::{idempotent, Idempotency, MemoryStore};
use serde::{Deserialize, Serialize};

pub struct ChargeRequest {
    pub order_id: String,
    pub amount: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct Receipt {
    pub charged: u64,
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

/// Charges the order once per `order_id`.
#[idempotent(key = req.order_id, ttl = "24h")]
pub async fn charge(req: ChargeRequest) -> Result<Receipt, PaymentError> {
    Ok(Receipt { charged: req.amount })
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    Idempotency::builder(MemoryStore::new()).build().install().unwrap();
    let req = || ChargeRequest { order_id: "o-1".into(), amount: 42 };
    assert_eq!(charge(req()).await.unwrap(), Receipt { charged: 42 });
    assert_eq!(charge(req()).await.unwrap(), Receipt { charged: 42 });
}
