use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(key = id, ttl = "24 hours please")]
pub async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

#[idempotent(key = id, lease = 24h)]
pub async fn refund(id: u64) -> Result<u64, Error> {
    Ok(id)
}

#[idempotent(key = id, wait = 5)]
pub async fn capture(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
