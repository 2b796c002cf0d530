//! The table and the JSON line.

use crate::memory::Memory;
use crate::opts::Opts;
use crate::phases::{PHASES, Totals};
use serde_json::json;

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// Lowest, median and highest per-round ratio of two phases.
fn spread(a: &Totals, b: &Totals) -> Option<(f64, f64, f64)> {
    let mut r: Vec<f64> = a
        .per_round
        .iter()
        .zip(&b.per_round)
        .map(|(x, y)| x / y)
        .collect();
    if r.is_empty() {
        return None;
    }
    r.sort_by(f64::total_cmp);
    let mid = if r.len() % 2 == 1 {
        r[r.len() / 2]
    } else {
        (r[r.len() / 2 - 1] + r[r.len() / 2]) / 2.0
    };
    Some((r[0], mid, r[r.len() - 1]))
}

/// `[min, median, max]` of the per-round ratios, or null.
fn spread_json(a: &Totals, b: &Totals) -> serde_json::Value {
    spread(a, b).map_or(serde_json::Value::Null, |(lo, mid, hi)| {
        json!([round3(lo), round3(mid), round3(hi)])
    })
}

fn round3(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!((x * 1000.0).round() / 1000.0)
    } else {
        serde_json::Value::Null
    }
}

fn round1(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!((x * 10.0).round() / 10.0)
    } else {
        serde_json::Value::Null
    }
}

pub(crate) fn report(
    opts: &Opts,
    totals: &mut [Totals],
    mem: &Memory,
    wall: f64,
    errors: u64,
    url: &str,
) {
    let idx = |name: &str| PHASES.iter().position(|p| p.name == name).unwrap();
    let rate = |t: &[Totals], name: &str| t[idx(name)].rate();
    let mut pct = |name: &str, p: f64| totals[idx(name)].percentile_us(p);
    let lat: Vec<(usize, Option<f64>, Option<f64>)> = (0..PHASES.len())
        .map(|i| (i, pct(PHASES[i].name, 0.50), pct(PHASES[i].name, 0.99)))
        .collect();
    let p = |name: &str, which: usize| -> f64 {
        let l = &lat[idx(name)];
        (if which == 50 { l.1 } else { l.2 }).unwrap_or(f64::NAN)
    };

    let shown = if opts.redis.is_some() {
        url
    } else {
        "private redis-server"
    };
    let threads = if opts.threads == 0 {
        "current-thread".to_owned()
    } else {
        format!("{} worker(s)", opts.threads)
    };
    println!(
        "\nidem throughput: {} per phase in {} rounds, concurrency {}, Tokio {threads}, {shown}; {:.1} s in all",
        format_secs(opts.seconds),
        opts.rounds,
        opts.concurrency,
        wall
    );
    println!(
        "{:<16} {:>4} {:>10} {:>12} {:>9} {:>9} {:>11} {:>11}  what",
        "phase", "c", "calls", "calls/s", "p50 µs", "p99 µs", "client µs", "redis µs"
    );
    for (i, def) in PHASES.iter().enumerate() {
        let t = &totals[i];
        if t.ops == 0 && t.secs == 0.0 {
            continue;
        }
        let fmt_us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "{:<16} {:>4} {:>10} {:>12.0} {:>9} {:>9} {:>11.2} {:>11.2}  {}",
            def.name,
            def.concurrency.unwrap_or(opts.concurrency),
            t.ops,
            t.rate(),
            fmt_us(lat[i].1),
            fmt_us(lat[i].2),
            t.client_us_per_call(),
            t.redis_us_per_call(),
            def.what
        );
    }

    println!("(client µs, redis µs: CPU time per call of this process and of redis-server)");

    let t = &*totals;
    let fresh_ratio = ratio(rate(t, "idem_fresh"), rate(t, "floor_fresh"));
    let sets_ratio = ratio(rate(t, "idem_fresh"), rate(t, "floor_sets"));
    let fresh_ratio_c1 = ratio(rate(t, "idem_fresh_c1"), rate(t, "floor_fresh_c1"));
    let replay_ratio = ratio(rate(t, "idem_replay"), rate(t, "floor_replay"));
    let cache_ratio = ratio(rate(t, "cached_replay"), rate(t, "floor_replay"));
    let macro_ratio = ratio(rate(t, "idem_fresh"), rate(t, "hand_fresh"));
    let p50_gap = p("idem_fresh_c1", 50) - p("floor_fresh_c1", 50);
    let bytes_overhead = mem.idem_bytes - mem.plain_bytes;

    println!(
        "\n{:<30} {:>9} {:>25}  target",
        "ratio (totals)", "value", "per round: min / med / max"
    );
    let line = |name: &str, v: f64, a: &str, b: &str, target: &str, ok: bool| {
        if !v.is_finite() {
            return;
        }
        let range = spread(&t[idx(a)], &t[idx(b)]).map_or("-".to_owned(), |(lo, mid, hi)| {
            format!("{lo:.3} / {mid:.3} / {hi:.3}")
        });
        println!(
            "{name:<30} {v:>9.3} {range:>25}  {target} {}",
            if ok { "ok" } else { "MISSED" }
        );
    };
    line(
        "fresh_ratio (c=N)",
        fresh_ratio,
        "idem_fresh",
        "floor_fresh",
        ">= 1.0",
        fresh_ratio >= 1.0,
    );
    line(
        "fresh vs two plain SETs",
        sets_ratio,
        "idem_fresh",
        "floor_sets",
        "(reported)",
        true,
    );
    line(
        "fresh_ratio_c1",
        fresh_ratio_c1,
        "idem_fresh_c1",
        "floor_fresh_c1",
        ">= 1.0",
        fresh_ratio_c1 >= 1.0,
    );
    line(
        "replay_ratio",
        replay_ratio,
        "idem_replay",
        "floor_replay",
        ">= 0.95",
        replay_ratio >= 0.95,
    );
    line(
        "cache_ratio",
        cache_ratio,
        "cached_replay",
        "floor_replay",
        ">= 10",
        cache_ratio >= 10.0,
    );
    line(
        "macro_ratio (macro / by hand)",
        macro_ratio,
        "idem_fresh",
        "hand_fresh",
        "0.98..1.02",
        (0.98..=1.02).contains(&macro_ratio),
    );
    if p50_gap.is_finite() {
        println!(
            "{:<30} {:>9.1} {:>17}  <= 10 µs {}",
            "p50 gap idem - floor (c=1) µs",
            p50_gap,
            "",
            if p50_gap <= 10.0 { "ok" } else { "MISSED" }
        );
    }
    println!(
        "\nbytes per record ({}-byte key, 64-byte value): idem {} (STRLEN {}), plain string {} (STRLEN {}), \
         plain with PX {}; overhead {} bytes (target <= 24) {}; with a fingerprint: {} bytes",
        mem.key_len,
        mem.idem_bytes,
        mem.idem_strlen,
        mem.plain_bytes,
        mem.plain_strlen,
        mem.plain_px_bytes,
        bytes_overhead,
        if bytes_overhead <= 24 { "ok" } else { "MISSED" },
        mem.idem_fp_bytes
    );
    println!(
        "compression, {}-byte repetitive JSON: record {} bytes (STRLEN {}) plain, {} bytes (STRLEN {}) with compress_above(1024); \
         fresh call p50 {:.1} vs {:.1} µs, replay p50 {:.1} vs {:.1} µs",
        mem.big_json_len,
        mem.big_plain_bytes,
        mem.big_plain_strlen,
        mem.big_lz4_bytes,
        mem.big_lz4_strlen,
        p("big_fresh", 50),
        p("big_fresh_lz4", 50),
        p("big_replay", 50),
        p("big_replay_lz4", 50),
    );
    if errors > 0 {
        println!("{errors} calls failed (first ones printed on stderr)");
    }

    if opts.json {
        let mut phases = serde_json::Map::new();
        for (i, def) in PHASES.iter().enumerate() {
            let t = &t[i];
            if t.ops == 0 && t.secs == 0.0 {
                continue;
            }
            let mut m = serde_json::Map::new();
            m.insert("ops_per_s".into(), round1(t.rate()));
            m.insert("calls".into(), json!(t.ops));
            m.insert(
                "per_round_ops_per_s".into(),
                json!(t.per_round.iter().map(|r| r.round()).collect::<Vec<_>>()),
            );
            m.insert(
                "concurrency".into(),
                json!(def.concurrency.unwrap_or(opts.concurrency)),
            );
            m.insert(
                "client_cpu_us_per_call".into(),
                round3(t.client_us_per_call()),
            );
            m.insert(
                "redis_cpu_us_per_call".into(),
                round3(t.redis_us_per_call()),
            );
            if let (Some(p50), Some(p99)) = (lat[i].1, lat[i].2) {
                m.insert("p50_us".into(), round1(p50));
                m.insert("p99_us".into(), round1(p99));
            }
            phases.insert(def.name.into(), serde_json::Value::Object(m));
        }
        let out = json!({
            "concurrency": opts.concurrency,
            "seconds_per_phase": opts.seconds,
            "rounds": opts.rounds,
            "tokio_workers": opts.threads,
            "floor_fresh_ops": round1(rate(t, "floor_fresh")),
            "floor_sets_ops": round1(rate(t, "floor_sets")),
            "idem_fresh_ops": round1(rate(t, "idem_fresh")),
            "hand_fresh_ops": round1(rate(t, "hand_fresh")),
            "floor_replay_ops": round1(rate(t, "floor_replay")),
            "idem_replay_ops": round1(rate(t, "idem_replay")),
            "cached_replay_ops": round1(rate(t, "cached_replay")),
            "floor_fresh_c1_ops": round1(rate(t, "floor_fresh_c1")),
            "idem_fresh_c1_ops": round1(rate(t, "idem_fresh_c1")),
            "floor_fresh_c1_p50_us": round1(p("floor_fresh_c1", 50)),
            "floor_fresh_c1_p99_us": round1(p("floor_fresh_c1", 99)),
            "idem_fresh_c1_p50_us": round1(p("idem_fresh_c1", 50)),
            "idem_fresh_c1_p99_us": round1(p("idem_fresh_c1", 99)),
            "p50_gap_us": round1(p50_gap),
            "idem_bytes": mem.idem_bytes,
            "plain_bytes": mem.plain_bytes,
            "plain_px_bytes": mem.plain_px_bytes,
            "idem_fingerprint_bytes": mem.idem_fp_bytes,
            "bytes_overhead": bytes_overhead,
            "fresh_ratio": round3(fresh_ratio),
            "fresh_ratio_c1": round3(fresh_ratio_c1),
            "replay_ratio": round3(replay_ratio),
            "cache_ratio": round3(cache_ratio),
            "macro_ratio": round3(macro_ratio),
            "compression": {
                "json_bytes": mem.big_json_len,
                "plain_record_bytes": mem.big_plain_bytes,
                "lz4_record_bytes": mem.big_lz4_bytes,
                "plain_strlen": mem.big_plain_strlen,
                "lz4_strlen": mem.big_lz4_strlen,
                "fresh_p50_us": round1(p("big_fresh", 50)),
                "fresh_lz4_p50_us": round1(p("big_fresh_lz4", 50)),
                "replay_p50_us": round1(p("big_replay", 50)),
                "replay_lz4_p50_us": round1(p("big_replay_lz4", 50)),
                "fresh_ops": round1(rate(t, "big_fresh")),
                "fresh_lz4_ops": round1(rate(t, "big_fresh_lz4")),
                "replay_ops": round1(rate(t, "big_replay")),
                "replay_lz4_ops": round1(rate(t, "big_replay_lz4")),
            },
            "per_round": {
                "fresh_ratio": spread_json(&t[idx("idem_fresh")], &t[idx("floor_fresh")]),
                "fresh_ratio_c1": spread_json(&t[idx("idem_fresh_c1")], &t[idx("floor_fresh_c1")]),
                "replay_ratio": spread_json(&t[idx("idem_replay")], &t[idx("floor_replay")]),
                "cache_ratio": spread_json(&t[idx("cached_replay")], &t[idx("floor_replay")]),
                "macro_ratio": spread_json(&t[idx("idem_fresh")], &t[idx("hand_fresh")]),
            },
            "errors": errors,
            "phases": phases,
        });
        println!("{out}");
    }
}

fn format_secs(s: f64) -> String {
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s} s")
    }
}
