//! The phases, their totals, and one interleaved slice of a phase.

use crate::keys::FreshKey;
use crate::ops::Ctx;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Op {
    FloorFresh,
    FloorSets,
    IdemFresh,
    HandFresh,
    Steps1,
    Steps3,
    FloorReplay,
    IdemReplay,
    CachedReplay,
    BigFresh,
    BigFreshLz4,
    BigReplay,
    BigReplayLz4,
}

pub(crate) struct PhaseDef {
    pub(crate) name: &'static str,
    pub(crate) op: Op,
    /// `None`: the `--concurrency` option; `Some(1)`: one call at a time,
    /// latencies recorded.
    pub(crate) concurrency: Option<usize>,
    pub(crate) what: &'static str,
}

pub(crate) const PHASES: &[PhaseDef] = &[
    PhaseDef {
        name: "floor_fresh",
        op: Op::FloorFresh,
        concurrency: None,
        what: "minimal Lua claim + complete, fresh key",
    },
    PhaseDef {
        name: "floor_sets",
        op: Op::FloorSets,
        concurrency: None,
        what: "two plain SETs (NX PX GET, then XX KEEPTTL GET), fresh key",
    },
    PhaseDef {
        name: "idem_fresh",
        op: Op::IdemFresh,
        concurrency: None,
        what: "#[idempotent] no-op body, fresh key",
    },
    PhaseDef {
        name: "hand_fresh",
        op: Op::HandFresh,
        concurrency: None,
        what: "idem.call(..).run(..) no-op body, fresh key",
    },
    PhaseDef {
        name: "steps1_fresh",
        op: Op::Steps1,
        concurrency: None,
        what: "run_steps: 1 no-op step + complete, fresh key",
    },
    PhaseDef {
        name: "steps3_fresh",
        op: Op::Steps3,
        concurrency: None,
        what: "run_steps: 3 no-op steps + complete, fresh key",
    },
    PhaseDef {
        name: "floor_replay",
        op: Op::FloorReplay,
        concurrency: None,
        what: "one GET of an existing key",
    },
    PhaseDef {
        name: "idem_replay",
        op: Op::IdemReplay,
        concurrency: None,
        what: "call on a completed key",
    },
    PhaseDef {
        name: "cached_replay",
        op: Op::CachedReplay,
        concurrency: None,
        what: "call on a completed key, local_cache(100_000)",
    },
    PhaseDef {
        name: "floor_fresh_c1",
        op: Op::FloorFresh,
        concurrency: Some(1),
        what: "floor_fresh, one at a time",
    },
    PhaseDef {
        name: "idem_fresh_c1",
        op: Op::IdemFresh,
        concurrency: Some(1),
        what: "idem_fresh, one at a time",
    },
    PhaseDef {
        name: "big_fresh",
        op: Op::BigFresh,
        concurrency: Some(1),
        what: "16 KiB JSON result, fresh key, uncompressed",
    },
    PhaseDef {
        name: "big_fresh_lz4",
        op: Op::BigFreshLz4,
        concurrency: Some(1),
        what: "16 KiB JSON result, fresh key, compress_above(1024)",
    },
    PhaseDef {
        name: "big_replay",
        op: Op::BigReplay,
        concurrency: Some(1),
        what: "16 KiB JSON replay, uncompressed",
    },
    PhaseDef {
        name: "big_replay_lz4",
        op: Op::BigReplayLz4,
        concurrency: Some(1),
        what: "16 KiB JSON replay, compressed",
    },
];

#[derive(Default)]
pub(crate) struct Totals {
    pub(crate) ops: u64,
    pub(crate) secs: f64,
    /// ops/s of each round, for the spread of the ratios.
    pub(crate) per_round: Vec<f64>,
    pub(crate) latencies_ns: Vec<u64>,
    /// CPU seconds this process and redis-server spent in the phase.
    pub(crate) client_cpu: f64,
    pub(crate) redis_cpu: f64,
}

impl Totals {
    pub(crate) fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    pub(crate) fn client_us_per_call(&self) -> f64 {
        self.client_cpu * 1e6 / self.ops as f64
    }

    pub(crate) fn redis_us_per_call(&self) -> f64 {
        self.redis_cpu * 1e6 / self.ops as f64
    }

    pub(crate) fn percentile_us(&mut self, p: f64) -> Option<f64> {
        if self.latencies_ns.is_empty() {
            return None;
        }
        self.latencies_ns.sort_unstable();
        let idx = ((self.latencies_ns.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(self.latencies_ns.len() - 1);
        Some(self.latencies_ns[idx] as f64 / 1000.0)
    }
}

/// One call of a phase's operation. `seq` numbers the task's calls; fresh
/// keys are unique per (phase, task, seq).
pub(crate) async fn one_call(c: &Ctx, phase: usize, task: u16, seq: u64) {
    let fresh = FreshKey {
        run: c.run,
        phase: phase as u8,
        task,
        seq,
    };
    match PHASES[phase].op {
        Op::FloorFresh => c.floor_fresh(fresh).await,
        Op::FloorSets => c.floor_sets(fresh).await,
        Op::IdemFresh => c.idem_fresh(fresh).await,
        Op::HandFresh => c.hand_fresh(fresh).await,
        Op::Steps1 => c.steps_fresh(fresh, 1).await,
        Op::Steps3 => c.steps_fresh(fresh, 3).await,
        Op::FloorReplay => c.floor_replay(c.replay_key(0, task, seq)).await,
        Op::IdemReplay => {
            c.idem_replay(&c.replayer, c.replay_key(0, task, seq), "idem replay")
                .await
        }
        Op::CachedReplay => {
            c.idem_replay(&c.cached, c.replay_key(0, task, seq), "cached replay")
                .await
        }
        Op::BigFresh => c.big_fresh(&c.big_plain, fresh).await,
        Op::BigFreshLz4 => c.big_fresh(&c.big_lz4, fresh).await,
        Op::BigReplay => {
            c.big_replay(&c.big_plain_r, c.replay_key(1, task, seq))
                .await
        }
        Op::BigReplayLz4 => c.big_replay(&c.big_lz4_r, c.replay_key(2, task, seq)).await,
    }
}

/// Runs one slice of a phase: `tasks` tasks calling until `dur` is over.
/// Returns the calls made, the time until the last one finished and, when
/// asked, each call's latency. `seq0` keeps fresh keys unique across slices.
pub(crate) async fn slice(
    ctx: &Arc<Ctx>,
    phase: usize,
    tasks: usize,
    dur: Duration,
    seq0: u64,
    latencies: bool,
) -> (u64, f64, Vec<u64>) {
    let start = Instant::now();
    let deadline = start + dur;
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let c = Arc::clone(ctx);
            tokio::spawn(async move {
                let task = t as u16;
                let mut n = 0u64;
                let mut lat = Vec::new();
                // The deadline is checked per call, not by a timer task: a
                // cached replay never yields, so a timer could starve.
                loop {
                    let t0 = Instant::now();
                    if t0 >= deadline {
                        break;
                    }
                    one_call(&c, phase, task, seq0 + n).await;
                    if latencies {
                        lat.push(t0.elapsed().as_nanos() as u64);
                    }
                    n += 1;
                }
                (n, lat)
            })
        })
        .collect();
    let mut ops = 0;
    let mut all = Vec::new();
    for h in handles {
        let (n, lat) = h.await.expect("bench task panicked");
        ops += n;
        all.extend(lat);
    }
    (ops, start.elapsed().as_secs_f64(), all)
}
