//! `idem-wait: N`: how long a call is willing to wait for the answer of an
//! in-flight call with its key; capped by the layer's `max_wait` and by the
//! call's own deadline (`grpc-timeout`).

use crate::{IDEM_WAIT, IDEM_WAIT_APPLIED_MS};
use http::{HeaderMap, HeaderValue};
use idem_layer::settings::Settings;
use idem_layer::wait::{Wait, delta_seconds};
use std::time::Duration;
use tonic::metadata::MetadataMap;

/// The wait of one call: the first `idem-wait` entry's whole seconds (a
/// value that is not one is ignored, as HTTP's `Prefer: wait` is), under
/// the layer's settings, no longer than the call's deadline.
pub(crate) fn of(headers: &HeaderMap, settings: &Settings<MetadataMap>) -> Wait {
    let asked = headers
        .get(IDEM_WAIT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| delta_seconds(v.trim()));
    let wait = settings.wait_for(asked);
    match deadline(headers) {
        Some(deadline) => wait.within(deadline),
        None => wait,
    }
}

/// `idem-wait-applied-ms` on an answer to a call that asked to wait.
pub(crate) fn mark(headers: &mut HeaderMap, granted: Option<Duration>) {
    if let Some(granted) = granted {
        let ms = u64::try_from(granted.as_millis()).unwrap_or(u64::MAX);
        headers.insert(IDEM_WAIT_APPLIED_MS, HeaderValue::from(ms));
    }
}

/// The call's deadline, from `grpc-timeout` (gRPC over HTTP/2: 1 to 8
/// digits and a unit, `H`, `M`, `S`, `m`, `u` or `n`); `None` without one
/// or for one that is malformed.
fn deadline(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let digits = value.get(..value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match value.get(value.len() - 1..)? {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(entries: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in entries {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn grpc_timeout_is_read_in_its_units() {
        let d = |v: &'static str| deadline(&headers(&[("grpc-timeout", v)]));
        assert_eq!(d("2S"), Some(Duration::from_secs(2)));
        assert_eq!(d("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(d("3M"), Some(Duration::from_secs(180)));
        assert_eq!(d("250m"), Some(Duration::from_millis(250)));
        assert_eq!(d("7u"), Some(Duration::from_micros(7)));
        assert_eq!(d("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "S", "2", "2s", "123456789S", "-1S", "1.5S"] {
            assert_eq!(d(bad), None, "{bad}");
        }
        assert_eq!(deadline(&HeaderMap::new()), None);
    }

    #[test]
    fn the_wait_is_capped_by_max_wait_and_the_deadline() {
        let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
        let settings = Settings::<MetadataMap>::new(&idem);
        let w = of(&headers(&[("idem-wait", "5")]), &settings);
        assert_eq!(
            (w.wait, w.granted),
            (Duration::from_secs(5), Some(Duration::from_secs(5)))
        );
        let w = of(&headers(&[("idem-wait", "3600")]), &settings);
        assert_eq!(w.granted, Some(Duration::from_secs(10)));
        let w = of(
            &headers(&[("idem-wait", "5"), ("grpc-timeout", "1500m")]),
            &settings,
        );
        assert_eq!(w.granted, Some(Duration::from_millis(1500)));
        assert_eq!(w.wait, Duration::from_millis(1500));
        let w = of(&headers(&[("idem-wait", "soon")]), &settings);
        assert_eq!((w.wait, w.granted), (Duration::ZERO, None));
        // The layer's own wait is capped by the deadline too, and not reported.
        let waiting = settings.clone().wait(Duration::from_secs(30));
        let w = of(&headers(&[("grpc-timeout", "2S")]), &waiting);
        assert_eq!((w.wait, w.granted), (Duration::from_secs(2), None));
        // A zero cap ignores the entry.
        let off = settings.max_wait(Duration::ZERO);
        let w = of(&headers(&[("idem-wait", "5")]), &off);
        assert_eq!((w.wait, w.granted), (Duration::ZERO, None));
    }
}
