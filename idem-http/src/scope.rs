//! The scope a key is stored under: the layer's scope plus the tenant.

use sha2::{Digest, Sha256};
use std::fmt::Write;

/// Longest scope idem-core accepts.
const MAX_SCOPE_LEN: usize = 255;

/// `escape(scope)`, or `escape(scope) "|" escape(tenant)` with a tenant.
///
/// `escape` percent-encodes `%`, `|`, `#` and control characters, so `|`
/// only ever separates the two parts and the mapping is injective: two
/// different (scope, tenant) pairs never give the same string. (idem-core
/// then percent-escapes `:` and `%` of the whole scope, which is injective
/// too.) A tenant too long to fit in the 255-byte scope is replaced by `#`
/// and its SHA-256 in hex; `#` cannot start an escaped tenant.
pub(crate) fn compose(scope: &str, tenant: Option<&str>) -> String {
    let mut out = String::with_capacity(scope.len() + tenant.map_or(0, str::len) + 1);
    escape_into(&mut out, scope);
    if let Some(tenant) = tenant {
        out.push('|');
        let mark = out.len();
        escape_into(&mut out, tenant);
        if out.len() > MAX_SCOPE_LEN {
            out.truncate(mark);
            out.push('#');
            for b in Sha256::digest(tenant.as_bytes()) {
                // Writing to a String cannot fail.
                let _ = write!(out, "{b:02x}");
            }
        }
    }
    out
}

fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        if matches!(c, '%' | '|' | '#') || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_never_collide() {
        assert_eq!(compose("http", None), "http");
        assert_eq!(compose("http", Some("acme")), "http|acme");
        assert_ne!(compose("http", Some("")), compose("http", None));
        assert_ne!(compose("a|b", None), compose("a", Some("b")));
        assert_ne!(compose("a", Some("b|c")), compose("a|b", Some("c")));
        assert_ne!(compose("h", Some("a:b")), compose("h:a", Some("b")));
        assert_eq!(compose("h", Some("a%|#\n")), "h|a%25%7C%23%0A");
    }

    #[test]
    fn long_tenants_are_hashed() {
        let long = "t".repeat(400);
        let s = compose("http", Some(&long));
        assert!(s.len() <= MAX_SCOPE_LEN);
        assert!(s.starts_with("http|#"));
        assert_ne!(s, compose("http", Some(&"t".repeat(401))));
        // An escaped tenant never starts with '#', so it cannot look hashed.
        assert!(compose("http", Some("#abc")).starts_with("http|%23"));
    }
}
