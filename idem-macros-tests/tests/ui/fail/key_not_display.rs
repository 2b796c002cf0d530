use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct OrderId(pub u64);

#[idempotent(key = order)]
pub async fn charge(order: OrderId) -> Result<u64, Error> {
    Ok(order.0)
}

fn main() {}
