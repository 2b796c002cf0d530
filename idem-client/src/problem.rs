//! RFC 9457 problem details (`application/problem+json`).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// An RFC 9457 problem details object, as sent by the server with
/// `Content-Type: application/problem+json`.
///
/// The standard members `type`, `title`, `status` and `detail` get their own
/// fields; every other member (including `instance`) is kept in
/// [`extensions`](Self::extensions).
///
/// ```
/// use idem_client::Problem;
///
/// let p = Problem::parse(br#"{
///     "type": "https://example.com/probs/key-reused",
///     "title": "Idempotency key reused",
///     "status": 422,
///     "detail": "the key was first used with another body",
///     "key": "abc"
/// }"#).unwrap();
/// assert_eq!(p.status, Some(422));
/// assert_eq!(p.title.as_deref(), Some("Idempotency key reused"));
/// assert_eq!(p.extensions["key"], "abc");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// URI reference identifying the problem type (`type`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r#type: Option<String>,
    /// Short human-readable summary of the problem type (`title`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The HTTP status code the server generated (`status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Human-readable explanation of this occurrence (`detail`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// All other members of the object.
    #[serde(flatten)]
    pub extensions: Map<String, Value>,
}

impl Problem {
    /// Parses a problem details document leniently.
    ///
    /// Returns `None` unless `body` is a JSON object. As RFC 9457 asks,
    /// standard members with the wrong JSON type are ignored rather than
    /// failing the whole document.
    ///
    /// ```
    /// use idem_client::Problem;
    ///
    /// assert!(Problem::parse(b"not json").is_none());
    /// assert!(Problem::parse(b"[1, 2]").is_none());
    /// let p = Problem::parse(br#"{"title": 7, "detail": "d"}"#).unwrap();
    /// assert_eq!(p.title, None);
    /// assert_eq!(p.detail.as_deref(), Some("d"));
    /// ```
    pub fn parse(body: &[u8]) -> Option<Problem> {
        let Value::Object(mut members) = serde_json::from_slice::<Value>(body).ok()? else {
            return None;
        };
        let mut string = |name: &str| match members.remove(name) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        let r#type = string("type");
        let title = string("title");
        let detail = string("detail");
        let status = match members.remove("status") {
            Some(Value::Number(n)) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
            _ => None,
        };
        Some(Problem {
            r#type,
            title,
            status,
            detail,
            extensions: members,
        })
    }

    /// `title: detail`, `title`, or `detail`, whichever the server provided.
    pub(crate) fn summary(&self) -> Option<String> {
        match (self.title.as_deref(), self.detail.as_deref()) {
            (Some(t), Some(d)) => Some(format!("{t}: {d}")),
            (Some(t), None) => Some(t.to_owned()),
            (None, Some(d)) => Some(d.to_owned()),
            (None, None) => None,
        }
    }
}

/// The problem type slug of an idem server's "processed, response not kept"
/// answer; the type URI ends with it (its base is the server's choice).
pub(crate) const RESPONSE_NOT_KEPT: &str = "response-not-kept";

impl Problem {
    /// Whether this is an idem server's "processed, response not kept"
    /// problem (its `type` ends with `response-not-kept`), and if so the
    /// status the operation answered when it was applied.
    pub(crate) fn response_not_kept(&self) -> Option<Option<http::StatusCode>> {
        let t = self.r#type.as_deref()?;
        let slug = t.rsplit(['/', '#']).next()?;
        (slug == RESPONSE_NOT_KEPT).then(|| {
            self.extensions
                .get("processed_status")
                .and_then(serde_json::Value::as_u64)
                .and_then(|s| u16::try_from(s).ok())
                .and_then(|s| http::StatusCode::from_u16(s).ok())
        })
    }
}

/// Whether a `Content-Type` value names `application/problem+json`.
pub(crate) fn is_problem_json(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/problem+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_type_detection() {
        assert!(is_problem_json("application/problem+json"));
        assert!(is_problem_json("Application/Problem+JSON; charset=utf-8"));
        assert!(!is_problem_json("application/json"));
        assert!(!is_problem_json(""));
    }

    #[test]
    fn wrong_types_are_ignored_and_extensions_kept() {
        let p = Problem::parse(
            br#"{"type":"about:blank","status":"422","instance":"/x","detail":"d"}"#,
        )
        .unwrap_or_default();
        assert_eq!(p.r#type.as_deref(), Some("about:blank"));
        assert_eq!(p.status, None);
        assert_eq!(p.extensions.get("instance"), Some(&Value::from("/x")));
        assert!(!p.extensions.contains_key("status"));
        assert_eq!(p.summary().as_deref(), Some("d"));
    }

    #[test]
    fn recognizes_response_not_kept_under_any_base() {
        let p = |t: &str| Problem {
            r#type: Some(t.into()),
            ..Problem::default()
        };
        assert_eq!(
            p("https://docs.rs/idem-http/latest/idem_http/#response-not-kept").response_not_kept(),
            Some(None)
        );
        let mut q = p("https://errors.example.com/idempotency/response-not-kept");
        q.extensions
            .insert("processed_status".into(), Value::from(201));
        assert_eq!(q.response_not_kept(), Some(Some(http::StatusCode::CREATED)));
        assert_eq!(
            p("https://x/not-response-not-kept").response_not_kept(),
            None
        );
        assert_eq!(Problem::default().response_not_kept(), None);
    }

    #[test]
    fn serializes_with_type_member() {
        let p = Problem {
            r#type: Some("t".into()),
            ..Problem::default()
        };
        assert_eq!(
            serde_json::to_string(&p).unwrap_or_default(),
            r#"{"type":"t"}"#
        );
    }
}
