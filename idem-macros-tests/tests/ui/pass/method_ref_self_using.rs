use idem::{idempotent, Idempotency, MemoryStore};

#[derive(Debug)]
pub struct Error(#[allow(dead_code)] idem::Error);

impl From<idem::Error> for Error {
    fn from(e: idem::Error) -> Self {
        Error(e)
    }
}

pub struct Payments {
    idem: Idempotency,
    fee: u64,
}

impl Payments {
    #[idempotent(key = order_id, using = self.idem)]
    pub async fn total(&self, order_id: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount + self.fee)
    }

    // `using` may also be a reference, or an expression returning one.
    #[idempotent(key = order_id, using = &self.idem, scope = "payments.total_by_ref")]
    pub async fn total_by_ref(&self, order_id: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount + self.fee)
    }

    #[idempotent(key = order_id, using = self.handle(), scope = "payments.total_by_call")]
    pub async fn total_by_call(&self, order_id: &str, amount: u64) -> Result<u64, Error> {
        Ok(amount + self.fee)
    }

    fn handle(&self) -> &Idempotency {
        &self.idem
    }
}

// `using` with an argument, and with an `Arc`.
#[idempotent(key = id, using = idem)]
pub async fn with_arg(idem: &Idempotency, id: u32) -> Result<u32, Error> {
    Ok(id * 2)
}

#[idempotent(key = id, using = idem)]
pub async fn with_arc(idem: std::sync::Arc<Idempotency>, id: u32) -> Result<u32, Error> {
    Ok(id * 3)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let p = Payments { idem: idem.clone(), fee: 1 };
    assert_eq!(p.total("o-1", 10).await.unwrap(), 11);
    assert_eq!(p.total_by_ref("o-1", 10).await.unwrap(), 11);
    assert_eq!(p.total_by_call("o-1", 10).await.unwrap(), 11);
    assert_eq!(with_arg(&idem, 4).await.unwrap(), 8);
    assert_eq!(with_arc(std::sync::Arc::new(idem), 4).await.unwrap(), 12);
}
