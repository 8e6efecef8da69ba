//! Prometheus: the whole `/metrics` exposition, in one place, and its
//! primitives (a lock-free histogram with fixed buckets, headers). Each
//! part of the server keeps its own figures; this module is the only one
//! that writes them out.

use crate::api::App;
use crate::api::blocking::BlockingPool;
use crate::capabilities::Capabilities;
use crate::capabilities::metrics::{PluginMetrics, Value as PluginValue};
use crate::listener::ConnectionStats;
use crate::plugins::Policies;
use crate::plugins::bindings::Hook;
use crate::plugins::stats::FAULT_KINDS;
use crate::scaling::Scaler;
use crate::state::State;
use crate::state::flights::FlightStats;
use crate::telemetry::Telemetry;
use levee_gpu::EngineStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// The text of `GET /metrics` (Prometheus exposition format 0.0.4).
pub fn render(app: &App) -> String {
    let mut out = String::new();
    engine(&app.pipeline.telemetry, &app.pipeline.engine.stats(), &mut out);
    plugins(&app.pipeline.policies, &app.caps, &mut out);
    scaling(&app.scaling, &mut out);
    connections(&app.connections, &mut out);
    prepare(&app.blocking, &mut out);
    shared_state(&app.caps.state, app.pipeline.flights.remote().map(|r| &r.stats), &mut out);
    out
}

/// Buckets (seconds) for plugin hook latency: 5 µs to 50 ms.
pub const HOOK_BUCKETS: &[f64] = &[5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3];

/// A cumulative histogram with fixed upper bounds.
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// An empty histogram with `bounds` (ascending, seconds).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation of `seconds`.
    pub fn observe(&self, seconds: f64) {
        if let Some(i) = self.bounds.iter().position(|b| seconds <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_nanos.fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the `_bucket`, `_sum` and `_count` series of `name` with `labels` (`a="b",…` or empty).
    pub fn render(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}");
        }
        let total = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {total}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
    }
}

/// Writes a `# HELP` and `# TYPE` header.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The server's own series: requests, latencies, tokens, the engine.
fn engine(t: &Telemetry, stats: &EngineStats, out: &mut String) {
    header(out, "levee_requests_total", "counter", "HTTP requests by route and status.");
    for ((route, status), n) in t.requests.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(out, "levee_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
    }
    let histograms = [
        ("levee_time_to_first_token_seconds", "Time from arrival to the first generated token.", &t.ttft),
        ("levee_inter_token_latency_seconds", "Mean time between generated tokens, per request.", &t.itl),
        ("levee_e2e_request_latency_seconds", "Time from arrival to the last byte, successful requests.", &t.e2e),
        ("levee_queue_time_seconds", "Time a generation waited for the engine.", &t.queue),
    ];
    for (name, help, histogram) in histograms {
        header(out, name, "histogram", help);
        histogram.render(name, "", out);
    }
    let c = &t.counters;
    let counters = [
        ("levee_prompt_tokens_total", "Prompt tokens of generated requests.", &c.prompt_tokens),
        ("levee_generation_tokens_total", "Tokens generated.", &c.generation_tokens),
        ("levee_cache_hits_total", "Responses served from a cache plugin.", &c.cache_hits),
        ("levee_cache_misses_total", "Lookups that found nothing.", &c.cache_misses),
        ("levee_coalesced_requests_total", "Requests that shared another request's generation.", &c.coalesced),
        ("levee_shed_requests_total", "Requests shed by a shape plugin.", &c.shed),
        ("levee_degraded_requests_total", "Requests served degraded by a shape plugin.", &c.degraded),
        ("levee_rejected_requests_total", "Requests rejected by an admit plugin.", &c.rejected),
        ("levee_generations_total", "Generations started in the engine.", &c.generations),
    ];
    for (name, help, counter) in counters {
        header(out, name, "counter", help);
        let _ = writeln!(out, "{name} {}", counter.load(Ordering::Relaxed));
    }
    let gauges = [
        ("levee_queue_depth", "Requests waiting for the engine.", stats.queue_depth as f64),
        ("levee_queued_tokens", "Prompt tokens waiting for the engine.", stats.queued_tokens as f64),
        ("levee_running_sequences", "Sequences being generated.", stats.running as f64),
        ("levee_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", f64::from(stats.kv_usage)),
        ("levee_decode_tokens_per_second", "Generated tokens per second, recent.", stats.decode_tokens_per_s),
        ("levee_prefill_tokens_per_second", "Prompt tokens processed per second, recent.", stats.prefill_tokens_per_s),
    ];
    for (name, help, value) in gauges {
        header(out, name, "gauge", help);
        let _ = writeln!(out, "{name} {value}");
    }
    header(out, "levee_preemptions_total", "counter", "Sequences preempted when the KV cache ran out.");
    let _ = writeln!(out, "levee_preemptions_total {}", stats.preemptions);
    header(out, "levee_engine_generated_tokens_total", "counter", "Tokens the engine generated.");
    let _ = writeln!(out, "levee_engine_generated_tokens_total {}", stats.generated_tokens);
    header(out, "levee_engine_sequences_started_total", "counter", "Sequences the engine admitted.");
    let _ = writeln!(out, "levee_engine_sequences_started_total {}", stats.sequences_started);
}

/// Client connections.
fn connections(c: &ConnectionStats, out: &mut String) {
    header(out, "levee_connections_open", "gauge", "Client connections open now.");
    let _ = writeln!(out, "levee_connections_open {}", c.open());
    header(out, "levee_connections_accepted_total", "counter", "Client connections accepted.");
    let _ = writeln!(out, "levee_connections_accepted_total {}", c.accepted.load(Ordering::Relaxed));
    header(
        out,
        "levee_connections_refused_total",
        "counter",
        "Connections answered 503 and closed because max-connections were open.",
    );
    let _ = writeln!(out, "levee_connections_refused_total {}", c.refused.load(Ordering::Relaxed));
    header(
        out,
        "levee_connections_timed_out_total",
        "counter",
        "Connections closed because a request's headers did not arrive in time (slow or idle clients).",
    );
    let _ = writeln!(out, "levee_connections_timed_out_total {}", c.timed_out.load(Ordering::Relaxed));
    header(out, "levee_requests_in_flight", "gauge", "Requests being answered now.");
    let _ = writeln!(out, "levee_requests_in_flight {}", c.in_flight());
}

/// The preparation pool.
fn prepare(pool: &BlockingPool, out: &mut String) {
    header(
        out,
        "levee_prepare_pending",
        "gauge",
        "Requests being parsed, rendered or tokenized off the async workers, or waiting for a thread to do it.",
    );
    let _ = writeln!(out, "levee_prepare_pending {}", pool.pending());
    header(
        out,
        "levee_prepare_refused_total",
        "counter",
        "Requests refused with 503 because the preparation queue was full.",
    );
    let _ = writeln!(out, "levee_prepare_refused_total {}", pool.refused());
}

/// The scale decision and its signals.
fn scaling(scaler: &Scaler, out: &mut String) {
    let Some(d) = scaler.decision() else { return };
    header(out, "levee_desired_replicas", "gauge", "Replicas the fleet should have.");
    let _ = writeln!(out, "levee_desired_replicas {}", d.desired_replicas);
    header(out, "levee_scaling_leader", "gauge", "1 when this replica made the latest decision.");
    let _ = writeln!(out, "levee_scaling_leader {}", u8::from(scaler.is_leader()));
    let (s, l) = (&d.signals, &d.signals.load);
    let gauges: [(&str, &str, f64); 10] = [
        ("levee_scale_queue_depth", "Requests waiting (fleet-wide with Redis).", f64::from(l.queue_depth)),
        ("levee_scale_queue_trend", "Change of the queue depth per second.", f64::from(s.queue_trend)),
        ("levee_scale_arrival_rate", "Requests arriving per second.", f64::from(s.arrival_rate)),
        ("levee_scale_arrival_trend", "Change of the arrival rate per second.", f64::from(s.arrival_trend)),
        (
            "levee_scale_throughput_per_replica",
            "Measured capacity of one replica, req/s.",
            f64::from(s.throughput_per_replica),
        ),
        ("levee_scale_replicas", "Replicas serving.", f64::from(s.replicas)),
        ("levee_scale_kv_usage", "Highest KV usage of any replica.", f64::from(l.kv_usage)),
        (
            "levee_scale_latency_p95_seconds",
            "Highest p95 latency of any replica.",
            f64::from(l.latency_p95_ms) / 1000.0,
        ),
        (
            "levee_scale_ttft_p95_seconds",
            "Highest p95 time to first token of any replica.",
            f64::from(l.ttft_p95_ms) / 1000.0,
        ),
        ("levee_scale_running", "Sequences running.", f64::from(l.running)),
    ];
    for (name, help, value) in gauges {
        header(out, name, "gauge", help);
        let _ = writeln!(out, "{name} {value}");
    }
    header(out, "levee_scaling_actuator_runs_total", "counter", "Actuator commands run.");
    let _ = writeln!(out, "levee_scaling_actuator_runs_total {}", scaler.actuator_runs.load(Ordering::Relaxed));
    header(out, "levee_scaling_actuator_failures_total", "counter", "Actuator commands that failed.");
    let _ = writeln!(out, "levee_scaling_actuator_failures_total {}", scaler.actuator_failures.load(Ordering::Relaxed));
}

/// The plugins' own counters and gauges, `levee_plugin_<name>{plugin="…"}`.
fn plugin_series(metrics: &PluginMetrics, out: &mut String) {
    let values = metrics.values.lock().unwrap_or_else(|p| p.into_inner());
    let mut last = String::new();
    for ((name, plugin), value) in values.iter() {
        let full = format!("levee_plugin_{name}");
        let (kind, number) = match value {
            PluginValue::Counter(n) => ("counter", *n as f64),
            PluginValue::Gauge(g) => ("gauge", *g),
        };
        if full != last {
            let _ = writeln!(out, "# TYPE {full} {kind}");
            last = full.clone();
        }
        let _ = writeln!(out, "{full}{{plugin=\"{plugin}\"}} {number}");
    }
}

/// The shared state's series (with Redis only), and `flights`' when
/// coalescing spans replicas.
fn shared_state(state: &State, flights: Option<&FlightStats>, out: &mut String) {
    let Some(redis) = &state.redis else { return };
    let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
    header(out, "levee_redis_up", "gauge", "1 while the last call reached Redis.");
    let _ = writeln!(out, "levee_redis_up {}", u8::from(redis.is_up()));
    header(out, "levee_redis_errors_total", "counter", "Calls that found Redis unreachable or slow.");
    let _ = writeln!(out, "levee_redis_errors_total {}", load(&redis.stats.errors));
    header(out, "levee_redis_fallbacks_total", "counter", "Calls served locally while Redis was unreachable.");
    let _ = writeln!(out, "levee_redis_fallbacks_total {}", load(&state.rule_stats.fallbacks));
    header(out, "levee_redis_refusals_total", "counter", "Calls failed while Redis was unreachable (rule closed).");
    let _ = writeln!(out, "levee_redis_refusals_total {}", load(&state.rule_stats.refusals));
    header(out, "levee_vectors_followed_total", "counter", "Vector entries indexed from other replicas.");
    let _ = writeln!(out, "levee_vectors_followed_total {}", load(&redis.stats.vectors_followed));
    if let Some(flights) = flights {
        header(
            out,
            "levee_flights_followed_total",
            "counter",
            "Coalesced requests that followed another replica's generation.",
        );
        let _ = writeln!(out, "levee_flights_followed_total {}", load(&flights.followed));
        header(
            out,
            "levee_flights_taken_over_total",
            "counter",
            "Followed generations finished here after the owner stalled or left.",
        );
        let _ = writeln!(out, "levee_flights_taken_over_total {}", load(&flights.taken_over));
    }
}

/// The plugins: calls, faults, quarantine, logs, memory, host wait, latency.
pub fn plugins(policies: &Policies, caps: &Capabilities, out: &mut String) {
    let chain = policies.snapshot();
    header(out, "levee_plugin_calls_total", "counter", "Hook calls per plugin and hook.");
    for p in chain.plugins() {
        for hook in Hook::ALL.iter().filter(|h| p.declares(**h)) {
            let _ = writeln!(
                out,
                "levee_plugin_calls_total{{plugin=\"{}\",hook=\"{}\"}} {}",
                p.name,
                hook.name(),
                p.stats.calls(*hook)
            );
        }
    }
    header(
        out,
        "levee_plugin_faults_total",
        "counter",
        "Plugin faults by kind (trap, deadline, over-memory, malformed, instantiate).",
    );
    for p in chain.plugins() {
        for (kind, n) in FAULT_KINDS.iter().zip(p.stats.faults_by_kind()) {
            let _ = writeln!(out, "levee_plugin_faults_total{{plugin=\"{}\",kind=\"{kind}\"}} {n}", p.name);
        }
    }
    header(out, "levee_plugin_quarantined", "gauge", "1 when the plugin is quarantined after repeated faults.");
    for p in chain.plugins() {
        let _ = writeln!(out, "levee_plugin_quarantined{{plugin=\"{}\"}} {}", p.name, u8::from(p.stats.quarantined()));
    }
    header(
        out,
        "levee_plugin_log_dropped_total",
        "counter",
        "Plugin log lines dropped because the plugin logged past its log-lines-per-sec.",
    );
    for p in chain.plugins() {
        let _ = writeln!(out, "levee_plugin_log_dropped_total{{plugin=\"{}\"}} {}", p.name, p.stats.logs.dropped());
    }
    header(out, "levee_plugin_memory_bytes", "gauge", "Linear memory all of the plugin's instances hold together.");
    for p in chain.plugins() {
        let _ = writeln!(out, "levee_plugin_memory_bytes{{plugin=\"{}\"}} {}", p.name, p.memory_bytes());
    }
    header(
        out,
        "levee_plugin_host_wait_seconds_total",
        "counter",
        "Time plugin calls spent in the embedding model (waiting for it and embedding); not charged to their budgets.",
    );
    for p in chain.plugins() {
        let _ = writeln!(
            out,
            "levee_plugin_host_wait_seconds_total{{plugin=\"{}\"}} {}",
            p.name,
            p.stats.host_wait().as_secs_f64()
        );
    }
    header(out, "levee_plugin_shadow_overrides_total", "counter", "Shadow-mode decisions that were not applied.");
    for p in chain.plugins() {
        let _ = writeln!(
            out,
            "levee_plugin_shadow_overrides_total{{plugin=\"{}\"}} {}",
            p.name,
            p.stats.shadow_overrides()
        );
    }
    header(
        out,
        "levee_plugin_hook_duration_seconds",
        "histogram",
        "Time of one hook call, including instance start-up.",
    );
    for p in chain.plugins() {
        for hook in Hook::ALL.iter().filter(|h| p.declares(**h)) {
            p.stats.latency(*hook).render(
                "levee_plugin_hook_duration_seconds",
                &format!("plugin=\"{}\",hook=\"{}\"", p.name, hook.name()),
                out,
            );
        }
    }
    plugin_series(&caps.metrics, out);
}
