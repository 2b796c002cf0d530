//! `Prefer: wait=N` (RFC 7240): how long a request is willing to wait for
//! the response of an in-flight request with its key.

use http::HeaderMap;
use http::header::HeaderValue;
use idem_layer::wait::{delta_seconds, whole_seconds};
use std::time::Duration;

/// The `wait` preference of a request, from its `Prefer` headers (RFC 7240
/// §2 and §4.3): the first `wait` among every preference of every `Prefer`
/// field, in order, its name in any case; its value RFC 7240's
/// `delta-seconds`, bare or quoted (`word`), its parameters ignored. A
/// first `wait` whose value is not one (none, `-1`, `1.5`, `soon`) is
/// ignored, and the ones after it too: RFC 7240 considers only the first
/// instance of a preference, and has servers ignore what they cannot
/// honour rather than fail. A field that is not visible ASCII is skipped.
pub(crate) fn wait(headers: &HeaderMap) -> Option<Duration> {
    for field in headers.get_all(crate::PREFER) {
        let Ok(field) = field.to_str() else {
            continue;
        };
        for preference in elements(field) {
            let mut name_value = preference
                .split(';')
                .next()
                .unwrap_or_default()
                .splitn(2, '=');
            let name = name_value.next().unwrap_or_default().trim();
            if !name.eq_ignore_ascii_case("wait") {
                continue;
            }
            let value = name_value.next().map(str::trim).map(unquote);
            return value.and_then(|v| delta_seconds(&v));
        }
    }
    None
}

/// `Preference-Applied: wait=N`: the wait the layer granted, in whole
/// seconds rounded up.
pub(crate) fn applied(wait: Duration) -> HeaderValue {
    HeaderValue::from_str(&format!("wait={}", whole_seconds(wait)))
        .unwrap_or_else(|_| HeaderValue::from_static("wait"))
}

/// The comma-separated elements of a field value (RFC 9110 §5.6.1), commas
/// inside quoted strings kept; empty elements dropped.
fn elements(field: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in field.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(field.get(start..i).unwrap_or_default());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(field.get(start..).unwrap_or_default());
    out.retain(|e| !e.trim().is_empty());
    out
}

/// A `word`'s value: a quoted string unquoted (its `\` escapes undone), a
/// token as it is.
fn unquote(word: &str) -> String {
    let Some(inner) = word
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    else {
        return word.to_owned();
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(fields: &[&str]) -> Option<u64> {
        let mut headers = HeaderMap::new();
        for f in fields {
            headers.append("prefer", HeaderValue::from_str(f).unwrap());
        }
        wait(&headers).map(|d| d.as_secs())
    }

    #[test]
    fn the_wait_preference_is_read_as_rfc_7240_has_it() {
        assert_eq!(of(&[]), None);
        assert_eq!(of(&["wait=5"]), Some(5));
        assert_eq!(of(&["WAIT=5"]), Some(5));
        assert_eq!(of(&["Wait = 7"]), Some(7));
        assert_eq!(of(&["respond-async, wait=10"]), Some(10));
        assert_eq!(of(&["respond-async,wait=10,handling=lenient"]), Some(10));
        assert_eq!(of(&["return=minimal", "wait=3"]), Some(3));
        assert_eq!(of(&["wait=\"4\""]), Some(4));
        assert_eq!(of(&["wait=4; foo=bar"]), Some(4));
        assert_eq!(of(&["foo=\"a,wait=9\", wait=2"]), Some(2));
        assert_eq!(of(&[",, wait=6 ,"]), Some(6));
        assert_eq!(of(&["wait=3600"]), Some(3600));
        assert_eq!(of(&["wait=99999999999999999999999"]), Some(u64::MAX));
        assert_eq!(of(&["waiting=5"]), None);
        assert_eq!(of(&["respond-async"]), None);
    }

    /// RFC 7240: a value that cannot be honoured is ignored, never an
    /// error; only the first instance of a preference counts.
    #[test]
    fn a_bad_or_repeated_wait_is_ignored() {
        for bad in [
            "wait",
            "wait=",
            "wait=-1",
            "wait=1.5",
            "wait=soon",
            "wait=1 0",
        ] {
            assert_eq!(of(&[bad]), None, "{bad}");
        }
        assert_eq!(of(&["wait=soon, wait=5"]), None);
        assert_eq!(of(&["wait=2", "wait=5"]), Some(2));
        let mut headers = HeaderMap::new();
        headers.append("prefer", HeaderValue::from_bytes(b"wait=\xff").unwrap());
        headers.append("prefer", HeaderValue::from_static("wait=8"));
        assert_eq!(wait(&headers), Some(Duration::from_secs(8)));
    }

    #[test]
    fn the_applied_wait_is_whole_seconds() {
        assert_eq!(applied(Duration::from_secs(10)), "wait=10");
        assert_eq!(applied(Duration::from_millis(200)), "wait=1");
        assert_eq!(applied(Duration::ZERO), "wait=0");
    }
}
