use idem::{idempotent, Idempotency, MemoryStore};

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Counter {
    idem: Idempotency,
    count: u32,
}

impl Counter {
    // The body mutates `self` while `using` reads a field of it.
    #[idempotent(key = id, using = self.idem)]
    pub async fn bump(&mut self, id: u64) -> Result<u32, Error> {
        self.count += 1;
        Ok(self.count)
    }

    // `self` by value, and a `mut` argument pattern.
    #[idempotent(key = id, using = self.idem)]
    pub async fn finish(mut self, mut id: u64) -> Result<u32, Error> {
        id += 1;
        self.count += id as u32;
        Ok(self.count)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut c = Counter { idem: Idempotency::builder(MemoryStore::new()).build(), count: 0 };
    assert_eq!(c.bump(7).await.unwrap(), 1);
    assert_eq!(c.bump(7).await.unwrap(), 1);
    assert_eq!(c.count, 1);
    assert_eq!(c.bump(8).await.unwrap(), 2);
    assert_eq!(c.finish(1).await.unwrap(), 4);
}
