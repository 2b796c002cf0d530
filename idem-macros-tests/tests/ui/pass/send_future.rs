// The generated future is `Send` whenever the arguments are, so annotated fns
// can be spawned on a multi-threaded runtime.
use idem::{idempotent, Idempotency, MemoryStore};

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(key = id, ttl = "1m")]
pub async fn job(id: String) -> Result<usize, Error> {
    tokio::task::yield_now().await;
    Ok(id.len())
}

fn assert_send<T: Send>(t: T) -> T {
    t
}

#[tokio::main]
async fn main() {
    Idempotency::builder(MemoryStore::new()).build().install().unwrap();
    let handle = tokio::spawn(assert_send(job("abc".into())));
    assert_eq!(handle.await.unwrap().unwrap(), 3);
}
