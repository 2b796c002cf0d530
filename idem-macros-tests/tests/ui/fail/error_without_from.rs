use idem::idempotent;

#[derive(Debug)]
pub enum PaymentError {
    Declined,
}

#[idempotent(key = id)]
pub async fn charge(id: u64) -> Result<u64, PaymentError> {
    if id == 0 {
        return Err(PaymentError::Declined);
    }
    Ok(id)
}

fn main() {}
