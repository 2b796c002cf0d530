use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

// The runtime would refuse these on every call; the macro refuses them now.
#[idempotent(key = id, ttl = "10m", lease = "1h")]
pub async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

#[idempotent(key = id, ttl = "400d", lease = "2d", wait = "500us")]
pub async fn refund(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
