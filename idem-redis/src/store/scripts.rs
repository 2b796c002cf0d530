//! The Lua scripts, each joined at build time behind the shared prelude
//! (`lua/prelude.lua`: the record format and reply codes, written once).

use redis::{Cmd, Script};
use std::sync::LazyLock;

/// A script's full source: its shebang flags, the prelude, the record
/// operations between `$open` and `$close`, its body.
macro_rules! assembled {
    ($flags:literal, $open:literal, $close:literal, $file:literal) => {
        concat!(
            "#!lua",
            $flags,
            "\n",
            include_str!("../../lua/prelude.lua"),
            $open,
            include_str!("../../lua/record_ops.lua"),
            $close,
            include_str!(concat!("../../lua/", $file))
        )
    };
}

/// A script with the record operations at its top level.
macro_rules! script {
    ($flags:literal, $file:literal) => {
        assembled!($flags, "", "", $file)
    };
}

/// A script whose common path needs no record operation: they are made by
/// `record_ops()`, which returns `completing, notify`, when a key first
/// needs them. A script's top level runs on every call, and making the
/// operations' closures there cost each call about 7,000 server
/// instructions (lua/README.md).
macro_rules! lazy_ops_script {
    ($flags:literal, $file:literal) => {
        assembled!(
            $flags,
            "local function record_ops()\n",
            "return completing, notify\nend\n",
            $file
        )
    };
}

/// The prelude and the record operations, for tests that check them
/// against the Rust side.
#[cfg(test)]
pub(super) const PRELUDE: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    include_str!("../../lua/record_ops.lua")
);

/// A script and its source: `EVALSHA` by hash, and the source to load on a
/// node that no longer has it.
pub(super) struct Lua {
    pub(super) script: Script,
    pub(super) source: &'static str,
}

impl Lua {
    fn new(source: &'static str) -> Lua {
        Lua {
            script: Script::new(source),
            source,
        }
    }
}

pub(super) struct Scripts {
    pub(super) claim: Lua,
    pub(super) complete: Lua,
    /// A batch's completes in one call, on a server without `IFEQ`.
    pub(super) complete_batch: Lua,
    pub(super) release: Lua,
    pub(super) extend: Lua,
    /// Operators only (`Idempotency::forget`): not loaded at connect, so a
    /// service user needs nothing new; loaded on first use (`NOSCRIPT`).
    pub(super) forget: Lua,
    /// `Store::count_failure`: one more failed run of a key, in a counter
    /// key of its own. Not `allow-oom`: it may create that key.
    pub(super) failure: Lua,
    /// `Store::save_step`: append a finished step to our pending record.
    pub(super) step: Lua,
    /// `Store::suspend`: end our lease now, keeping the steps.
    pub(super) suspend: Lua,
    /// `RedisStore::finish_batch_then`: the carried command, run only once
    /// every complete of the batch is stored.
    pub(super) rider: Lua,
}

// `claim` may write, so Redis refuses it when out of memory; the others
// must still run then (free keys, keep leases, store a finished body's result).
pub(super) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Lua::new(script!("", "claim.lua")),
    complete: Lua::new(script!(" flags=allow-oom", "complete.lua")),
    complete_batch: Lua::new(lazy_ops_script!(" flags=allow-oom", "complete_batch.lua")),
    release: Lua::new(script!(" flags=allow-oom", "release.lua")),
    extend: Lua::new(script!(" flags=allow-oom", "extend.lua")),
    forget: Lua::new(script!(" flags=allow-oom", "forget.lua")),
    failure: Lua::new(script!("", "failure.lua")),
    step: Lua::new(script!(" flags=allow-oom", "step.lua")),
    suspend: Lua::new(script!(" flags=allow-oom", "suspend.lua")),
    rider: Lua::new(lazy_ops_script!("", "rider.lua")),
});

/// `EVALSHA <sha1> 1 <key>`, sized for `extra` more bytes in `args` more
/// arguments: the command is written once, straight into the buffer the
/// connection packs from (`ScriptInvocation` first copies every key and
/// argument into a `Vec<Vec<u8>>` of its own).
pub(super) fn invocation(hash: &str, key: &str, args: usize, extra: usize) -> Cmd {
    let mut cmd = Cmd::with_capacity(4 + args, 7 + hash.len() + 1 + key.len() + extra);
    cmd.arg("EVALSHA").arg(hash).arg("1").arg(key);
    cmd
}
