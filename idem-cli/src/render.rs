//! Records as people and programs read them.

use idem_core::store::ValueKind;
use idem_core::{KeyState, RecordInfo};
use serde_json::{Value, json};
use std::time::Duration;

/// A duration as people read it, to the second (milliseconds below one).
fn human(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format!("{}ms", d.as_millis());
    }
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| {
        json!(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    })
}

/// The stored value: its JSON when it is JSON, else its text.
fn value(info: &RecordInfo) -> Value {
    let Some(bytes) = &info.value else {
        return Value::Null;
    };
    match info.kind {
        Some(ValueKind::Json | ValueKind::Lz4Json) => serde_json::from_slice(bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned())),
        _ => Value::String(String::from_utf8_lossy(bytes).into_owned()),
    }
}

pub(crate) fn json(scope: &str, key: &str, info: &RecordInfo) -> Value {
    let mut v = json!({
        "scope": scope,
        "key": key,
        "state": info.state.as_str(),
        "attempt": info.attempt,
        "ttl_left_ms": ms(info.ttl_left),
        "lease_left_ms": ms(info.lease_left),
        "held": info.is_held(),
        "fingerprint": info.fingerprint.is_some(),
        "value_size": info.value_size,
        "result_version": info.result_version,
    });
    if info.value.is_some() {
        v["value"] = value(info);
    }
    if !info.steps.is_empty() {
        v["steps"] = json!(info.steps);
    }
    v
}

/// One line: state and what matters about it.
pub(crate) fn summary(info: &RecordInfo) -> String {
    let ttl = info.ttl_left.map_or("never expires".to_owned(), |t| {
        format!("expires in {}", human(t))
    });
    match info.state {
        KeyState::Pending => {
            let lease = match info.lease_left {
                Some(l) if !l.is_zero() => format!("lease live, {} left", human(l)),
                _ => "lease ran out: holder stopped renewing".to_owned(),
            };
            format!(
                "pending (attempt {}; {lease}; {ttl})",
                info.attempt.unwrap_or(1)
            )
        }
        state => format!(
            "{state} ({} bytes{}{}; {ttl})",
            info.value_size.unwrap_or(0),
            if info.kind == Some(ValueKind::Lz4Json) {
                ", compressed"
            } else {
                ""
            },
            // Version 0 (no version declared) goes unsaid, as before.
            info.result_version
                .filter(|&v| v != 0)
                .map_or(String::new(), |v| format!(", result version {v}"))
        ),
    }
}

/// A record as people read it, under a header naming the store.
pub(crate) fn human_record(store: &str, scope: &str, key: &str, info: &RecordInfo) -> String {
    let mut out = format!(
        "store:       {store}\nscope:       {scope}\nkey:         {key}\nstate:       {}\nfingerprint: {}\n",
        summary(info),
        if info.fingerprint.is_some() {
            "stored"
        } else {
            "none"
        }
    );
    if let Some(version) = info.result_version {
        // The version the result was stored with (`Call::result_version`).
        out.push_str(&format!("version:     {version}\n"));
    }
    if !info.steps.is_empty() {
        // A run_steps call's finished steps: the next holder replays them.
        out.push_str(&format!(
            "steps:       {} finished ({})\n",
            info.steps.len(),
            info.steps.join(", ")
        ));
    }
    if info.value.is_some() {
        out.push_str(&format!("value:       {}\n", value(info)));
    }
    out
}
