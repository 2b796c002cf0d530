use idem::{idempotent, Idempotency, MemoryStore};
use std::time::Duration;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

const LEASE: Duration = Duration::from_secs(30);
const SCOPE: &str = "jobs.run";

pub struct Jobs {
    idem: Idempotency,
    wait: Duration,
}

impl Jobs {
    #[idempotent(key = id, ttl = Duration::from_secs(3600), lease = LEASE, wait = self.wait,
                 scope = SCOPE, using = self.idem)]
    pub async fn run(&self, id: u64) -> Result<u64, Error> {
        Ok(id)
    }

    #[idempotent(key = id, ttl = ttl, using = self.idem, scope = "jobs.run_for")]
    pub async fn run_for(&self, id: u64, ttl: Duration) -> Result<u64, Error> {
        Ok(id + ttl.as_secs())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let jobs = Jobs { idem: Idempotency::builder(MemoryStore::new()).build(), wait: Duration::from_millis(100) };
    assert_eq!(jobs.run(9).await.unwrap(), 9);
    assert_eq!(jobs.run_for(1, Duration::from_secs(60)).await.unwrap(), 61);
}
