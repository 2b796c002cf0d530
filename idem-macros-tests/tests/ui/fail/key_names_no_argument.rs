use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct ChargeRequest {
    pub order_id: String,
}

#[idempotent(key = request.order_id)]
pub async fn charge(req: ChargeRequest, amount: u64) -> Result<u64, Error> {
    let _ = req;
    Ok(amount)
}

#[idempotent(key = id)]
pub async fn ping() -> Result<u64, Error> {
    Ok(1)
}

fn main() {}
