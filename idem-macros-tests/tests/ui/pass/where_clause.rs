use idem::{idempotent, Idempotency, MemoryStore};
use std::fmt::Display;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Service<S> {
    idem: Idempotency,
    name: S,
}

impl<S> Service<S>
where
    S: Display + Send + Sync,
{
    #[idempotent(key = id, using = self.idem)]
    pub async fn describe<I>(&self, id: I) -> Result<String, Error>
    where
        I: Display + Send,
    {
        Ok(format!("{} #{id}", self.name))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let s = Service { idem: Idempotency::builder(MemoryStore::new()).build(), name: "svc" };
    assert_eq!(s.describe(3).await.unwrap(), "svc #3");
}
