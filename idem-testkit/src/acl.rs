//! The Redis ACL a service's idem user needs, written once for the tests
//! that run as that user (docs/operating.md, "Redis ACL").

/// The rules for namespace `ns` and password `pw`, to follow
/// `ACL SETUSER <user> reset`: the commands the client sends (`EVALSHA`,
/// `SCRIPT LOAD` after a `SCRIPT FLUSH` or a restart, `SET` and `GET` for
/// plain claims, completes and replays) and those the scripts call (`MGET`
/// for a batch's completes on Redis 7), on the
/// namespace's keys only; and for waiting without polling, the sharded
/// publish and subscribe on the channels named as those keys.
///
/// ```
/// let rules = idem_testkit::store_acl("payments", "pw");
/// assert!(rules.contains(&"~payments:*".to_owned()));
/// ```
pub fn store_acl(ns: &str, pw: &str) -> Vec<String> {
    let mut rules = vec![
        "on".to_owned(),
        format!(">{pw}"),
        "resetkeys".to_owned(),
        format!("~{ns}:*"),
        "resetchannels".to_owned(),
        format!("&{ns}:*"),
    ];
    rules.extend(
        [
            "-@all",
            "+evalsha",
            "+script|load",
            "+get",
            "+mget",
            "+set",
            "+del",
            "+pttl",
            "+pexpire",
            "+spublish",
            "+ssubscribe",
            "+sunsubscribe",
            "+ping",
        ]
        .map(str::to_owned),
    );
    rules
}
