use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(req.order_id)]
pub async fn charge(req: u64) -> Result<u64, Error> {
    Ok(req)
}

#[idempotent(key = id, scope = 42, ttl)]
pub async fn refund(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
