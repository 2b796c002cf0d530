//! What recording metrics costs (feature `metrics`; the aim: within
//! 3 %): `idem_fresh` and `idem_replay` at the bench's concurrency
//! with a Prometheus recorder recording, against the same phases with the
//! recorder switched off (it hands out no-op handles, as the facade does
//! with no recorder installed), interleaved in short alternating slices
//! of one run on one server.
//!
//! `cargo bench --bench throughput --features metrics -- --only metrics`

use crate::ops::Ctx;
use crate::phases::{PHASES, slice};
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A recorder that records (Prometheus) only while switched on. idem keeps
/// the handles it registers, so the switch is in each handle: switched off,
/// a handle skips recording after one atomic load (a no-op handle, as the
/// facade hands out with no recorder installed, skips after a branch).
struct Switch {
    on: Arc<AtomicBool>,
    inner: PrometheusRecorder,
}

struct Switched<T> {
    on: Arc<AtomicBool>,
    inner: T,
}

impl<T> Switched<T> {
    fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }
}

impl CounterFn for Switched<Counter> {
    fn increment(&self, value: u64) {
        if self.on() {
            self.inner.increment(value)
        }
    }
    fn absolute(&self, value: u64) {
        if self.on() {
            self.inner.absolute(value)
        }
    }
}

impl GaugeFn for Switched<Gauge> {
    fn increment(&self, value: f64) {
        if self.on() {
            self.inner.increment(value)
        }
    }
    fn decrement(&self, value: f64) {
        if self.on() {
            self.inner.decrement(value)
        }
    }
    fn set(&self, value: f64) {
        if self.on() {
            self.inner.set(value)
        }
    }
}

impl HistogramFn for Switched<Histogram> {
    fn record(&self, value: f64) {
        if self.on() {
            self.inner.record(value)
        }
    }
}

impl Switch {
    fn wrap<T>(&self, inner: T) -> Arc<Switched<T>> {
        Arc::new(Switched {
            on: Arc::clone(&self.on),
            inner,
        })
    }
}

impl Recorder for Switch {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, d: SharedString) {
        self.inner.describe_counter(key, unit, d)
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, d: SharedString) {
        self.inner.describe_gauge(key, unit, d)
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, d: SharedString) {
        self.inner.describe_histogram(key, unit, d)
    }
    fn register_counter(&self, key: &Key, m: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.wrap(self.inner.register_counter(key, m)))
    }
    fn register_gauge(&self, key: &Key, m: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.wrap(self.inner.register_gauge(key, m)))
    }
    fn register_histogram(&self, key: &Key, m: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.wrap(self.inner.register_histogram(key, m)))
    }
}

const ROUNDS: usize = 10;
const SLICE: Duration = Duration::from_millis(250);

/// Runs the comparison and prints its table.
pub(crate) async fn measure(ctx: &Arc<Ctx>, concurrency: usize) {
    let switch: &'static Switch = Box::leak(Box::new(Switch {
        on: Arc::new(AtomicBool::new(false)),
        inner: PrometheusBuilder::new().build_recorder(),
    }));
    if metrics::set_global_recorder(switch).is_err() {
        eprintln!("metrics: a recorder was installed already; skipped");
        return;
    }
    println!(
        "\nmetrics: calls/s recording vs not ({ROUNDS} rounds of {} ms slices, c={concurrency})",
        SLICE.as_millis()
    );
    println!("| phase | metrics off | metrics on | on/off |");
    println!("|---|---:|---:|---:|");
    for name in ["idem_fresh", "idem_replay"] {
        let Some(i) = PHASES.iter().position(|p| p.name == name) else {
            continue;
        };
        let mut seq = 1_u64 << 45;
        let (mut ops, mut secs) = ([0_u64; 2], [0_f64; 2]);
        for round in 0..ROUNDS {
            for k in 0..2 {
                // Alternate which goes first.
                let on = (round + k) % 2;
                switch.on.store(on == 1, Ordering::Relaxed);
                let (n, s, _) = slice(ctx, i, concurrency, SLICE, seq, false).await;
                seq += n + 1;
                ops[on] += n;
                secs[on] += s;
            }
        }
        switch.on.store(false, Ordering::Relaxed);
        let rate = |m: usize| ops[m] as f64 / secs[m];
        println!(
            "| {name} | {:.0} | {:.0} | {:.3} |",
            rate(0),
            rate(1),
            rate(1) / rate(0)
        );
    }
}
