use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(key = id, ttl = "0s", lease = "0ms")]
pub async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
