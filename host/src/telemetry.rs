//! What the server measures: Prometheus counters and histograms for
//! requests, latencies and tokens, and the recent-window load snapshot that
//! policies (`admit`, `shape`) and the scale tick read.

use crate::metrics::Histogram;
use crate::plugins::bindings::Load;
use levee_gpu::{EngineStats, Timing};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Latency buckets, seconds: 5 ms to 2 minutes.
const LATENCY_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0];
/// Inter-token latency buckets, seconds.
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];
/// How far back the load window looks.
const WINDOW: Duration = Duration::from_secs(60);
/// Most samples kept in the window.
const WINDOW_SAMPLES: usize = 4096;
/// How long a computed load snapshot is reused.
const SNAPSHOT_TTL: Duration = Duration::from_millis(200);

/// Named counters of the request path.
#[derive(Default)]
pub struct Counters {
    /// Prompt tokens of generated requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Responses served from a cache.
    pub cache_hits: AtomicU64,
    /// Lookups that found nothing.
    pub cache_misses: AtomicU64,
    /// Requests that shared another request's generation.
    pub coalesced: AtomicU64,
    /// Requests refused by `shape` (shed).
    pub shed: AtomicU64,
    /// Requests served degraded.
    pub degraded: AtomicU64,
    /// Requests refused by `admit`.
    pub rejected: AtomicU64,
    /// Generations started in the engine.
    pub generations: AtomicU64,
    /// Requests that arrived on the generation routes.
    pub arrivals: AtomicU64,
    /// Requests on the generation routes answered successfully.
    pub completions: AtomicU64,
}

#[derive(Default)]
struct Window {
    arrivals: VecDeque<Instant>,
    latency: VecDeque<(Instant, f32)>,
    ttft: VecDeque<(Instant, f32)>,
}

fn trim<T>(samples: &mut VecDeque<T>, at: impl Fn(&T) -> Instant, now: Instant) {
    while samples.len() > WINDOW_SAMPLES || samples.front().is_some_and(|s| now.duration_since(at(s)) > WINDOW) {
        samples.pop_front();
    }
}

fn percentile(sorted: &[f32], p: f32) -> f32 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f32 * p).round() as usize]
}

fn sorted(samples: &VecDeque<(Instant, f32)>) -> Vec<f32> {
    let mut v: Vec<f32> = samples.iter().map(|s| s.1).collect();
    v.sort_by(f32::total_cmp);
    v
}

/// Server metrics and the load window.
pub struct Telemetry {
    /// Counters.
    pub counters: Counters,
    pub(crate) requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) queue: Histogram,
    window: Mutex<Window>,
    snapshot: Mutex<Option<(Instant, Load)>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Self {
            counters: Counters::default(),
            requests: Mutex::new(BTreeMap::new()),
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            queue: Histogram::new(LATENCY_BUCKETS),
            window: Mutex::new(Window::default()),
            snapshot: Mutex::new(None),
        }
    }
}

impl Telemetry {
    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request arrived.
    pub fn arrival(&self) {
        self.counters.arrivals.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut w = self.window();
        w.arrivals.push_back(now);
        trim(&mut w.arrivals, |t| *t, now);
    }

    /// A request on `route` was answered with `status`.
    pub fn answered(&self, route: &'static str, status: u16, elapsed: Duration) {
        *self.requests.lock().unwrap_or_else(|p| p.into_inner()).entry((route, status)).or_default() += 1;
        if status < 400 {
            if route.ends_with("completions") {
                self.counters.completions.fetch_add(1, Ordering::Relaxed);
            }
            self.e2e.observe(elapsed.as_secs_f64());
            let now = Instant::now();
            let mut w = self.window();
            w.latency.push_back((now, elapsed.as_secs_f32() * 1000.0));
            trim(&mut w.latency, |s| s.0, now);
        }
    }

    /// A generation finished with `timing`.
    pub fn generation(&self, timing: &Timing, completion_tokens: usize) {
        self.ttft.observe(timing.time_to_first_token.as_secs_f64());
        self.queue.observe(timing.queued.as_secs_f64());
        if completion_tokens > 1 {
            self.itl.observe(timing.time_per_output_token.as_secs_f64());
        }
        let now = Instant::now();
        let mut w = self.window();
        w.ttft.push_back((now, timing.time_to_first_token.as_secs_f32() * 1000.0));
        trim(&mut w.ttft, |s| s.0, now);
    }

    /// Requests per second over the window.
    pub fn arrival_rate(&self) -> f32 {
        let now = Instant::now();
        let mut w = self.window();
        trim(&mut w.arrivals, |t| *t, now);
        w.arrivals.len() as f32 / WINDOW.as_secs_f32()
    }

    /// The load as policies see it: engine figures and window percentiles
    /// (recomputed at most every 200 ms).
    pub fn load(&self, stats: &EngineStats) -> Load {
        let now = Instant::now();
        let mut cached = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let percentiles = match *cached {
            Some((at, load)) if now.duration_since(at) < SNAPSHOT_TTL => load,
            _ => {
                let mut w = self.window();
                trim(&mut w.latency, |s| s.0, now);
                trim(&mut w.ttft, |s| s.0, now);
                let latency = sorted(&w.latency);
                let ttft = sorted(&w.ttft);
                let load = Load {
                    latency_p50_ms: percentile(&latency, 0.50),
                    latency_p95_ms: percentile(&latency, 0.95),
                    latency_p99_ms: percentile(&latency, 0.99),
                    ttft_p50_ms: percentile(&ttft, 0.50),
                    ttft_p95_ms: percentile(&ttft, 0.95),
                    ..Load::default()
                };
                *cached = Some((now, load));
                load
            }
        };
        Load {
            queue_depth: stats.queue_depth as u32,
            queued_tokens: stats.queued_tokens as u64,
            running: stats.running as u32,
            kv_usage: stats.kv_usage,
            tokens_per_second: stats.decode_tokens_per_s as f32,
            replicas: 1,
            ..percentiles
        }
    }
}
