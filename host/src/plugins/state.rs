//! `PluginState`: the data of one plugin instance's store — its memory cap,
//! its deadline, an empty WASI context, and the host capabilities it imports.

use super::bindings::{embeddings, kv, metrics, ratelimit, runtime, types, vectors};
use crate::capabilities::Capabilities;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The memory cap of one instance, and its share of the plugin's total:
/// it remembers that it refused growth so that the resulting trap is
/// reported as over-memory, not as a plain trap.
pub struct MemoryCap {
    limits: StoreLimits,
    instance_max: usize,
    /// Linear memory of all the plugin's instances together, and its bound.
    total: Arc<AtomicUsize>,
    total_max: usize,
    /// What this instance adds to `total`, and its last approved growth.
    held: usize,
    last_grow: usize,
    /// Set when a growth past the cap was refused: the cap, in bytes.
    pub exceeded: Option<usize>,
}

impl MemoryCap {
    /// A cap of `bytes` of linear memory for this instance and of
    /// `total_max` for all those counted in `total`, trapping on a refused growth.
    pub fn new(bytes: usize, total: Arc<AtomicUsize>, total_max: usize) -> Self {
        let limits = StoreLimitsBuilder::new().memory_size(bytes).trap_on_grow_failure(true).build();
        Self { limits, instance_max: bytes, total, total_max, held: 0, last_grow: 0, exceeded: None }
    }
}

impl Drop for MemoryCap {
    fn drop(&mut self) {
        self.total.fetch_sub(self.held, Ordering::Relaxed);
    }
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let verdict = self.limits.memory_growing(current, desired, maximum);
        if !matches!(verdict, Ok(true)) {
            self.exceeded = Some(self.instance_max);
            return verdict;
        }
        let grow = desired.saturating_sub(current);
        let max = self.total_max;
        if self
            .total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_add(grow).filter(|n| *n <= max))
            .is_err()
        {
            self.exceeded = Some(max);
            wasmtime::bail!(
                "the plugin's instances together would hold more than memory-total-mib ({} MiB)",
                max >> 20
            );
        }
        self.held += grow;
        self.last_grow = grow;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        // Approved here but refused by the engine: give the share back.
        self.total.fetch_sub(self.last_grow, Ordering::Relaxed);
        self.held -= self.last_grow;
        self.last_grow = 0;
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }
}

/// Of a call's host-wait allowance, what is kept for the capability's own
/// work once it has waited its turn (an embedding after its queue wait).
pub const HOST_WAIT_SLACK: Duration = Duration::from_millis(250);

/// The host waits of one call: what they have moved its deadline by, and
/// when the one in progress began. The call's timeout reads it while the
/// call runs, so that a wait in progress does not cut the call.
#[derive(Default)]
pub struct HostWait {
    extended_us: AtomicU64,
    /// Microseconds since [`origin`] plus one when a wait began; 0 when none is in progress.
    since_us: AtomicU64,
    /// Calls of the plugin version waiting on the host now (shared by its instances).
    waiting: std::sync::OnceLock<Arc<AtomicUsize>>,
}

fn origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl HostWait {
    /// Forgets the last call's waits.
    pub fn reset(&self) {
        self.extended_us.store(0, Ordering::Relaxed);
        self.since_us.store(0, Ordering::Relaxed);
    }

    /// Counts this instance's waits in `waiting` (its plugin version's count).
    pub fn count_in(&self, waiting: Arc<AtomicUsize>) {
        let _ = self.waiting.set(waiting);
    }

    fn begin(&self) {
        self.since_us.store(origin().elapsed().as_micros() as u64 + 1, Ordering::Relaxed);
        if let Some(waiting) = self.waiting.get() {
            waiting.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn end(&self, excused: Duration) {
        self.since_us.store(0, Ordering::Relaxed);
        self.extended_us.fetch_add(excused.as_micros() as u64, Ordering::Relaxed);
        if let Some(waiting) = self.waiting.get() {
            waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// How far the call's deadline has moved, counting a wait in progress
    /// up to now; and whether one is in progress.
    pub fn moved(&self) -> (Duration, bool) {
        let extended = Duration::from_micros(self.extended_us.load(Ordering::Relaxed));
        match self.since_us.load(Ordering::Relaxed) {
            0 => (extended, false),
            since => {
                let now = origin().elapsed().as_micros() as u64 + 1;
                (extended + Duration::from_micros(now.saturating_sub(since)), true)
            }
        }
    }
}

/// Longest key or vector namespace a plugin may use, bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The store data of one plugin instance.
pub struct PluginState {
    /// The plugin's name: its namespace in the shared stores and its tag in logs.
    pub plugin: Arc<str>,
    /// Memory cap.
    pub cap: MemoryCap,
    /// When the current call must be done.
    pub deadline: Instant,
    /// Time the current call may still spend in the embedding model
    /// without it counting against its budget.
    pub host_wait_left: Duration,
    /// The current call's host waits, read by the caller's timeout while it runs.
    pub wait: Arc<HostWait>,
    caps: Arc<Capabilities>,
    stats: Arc<super::stats::PluginStats>,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl PluginState {
    /// State for an instance of `plugin` capped at `memory_bytes`, counted
    /// in `memory_total` with the other instances of its version, which
    /// together hold at most `memory_total_bytes`; `stats` are the plugin's
    /// (its log rate among them).
    pub fn new(
        plugin: Arc<str>,
        (memory_bytes, memory_total, memory_total_bytes): (usize, Arc<AtomicUsize>, usize),
        caps: Arc<Capabilities>,
        stats: Arc<super::stats::PluginStats>,
    ) -> Self {
        Self {
            plugin,
            cap: MemoryCap::new(memory_bytes, memory_total, memory_total_bytes),
            deadline: Instant::now(),
            host_wait_left: Duration::ZERO,
            wait: Arc::default(),
            caps,
            stats,
            // Nothing is granted: no files, no network, no environment, no stdio.
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        }
    }

    /// `key` in the plugin's namespace; keys (and namespace names) are at
    /// most [`MAX_KEY_BYTES`], so that a plugin cannot fill the host's
    /// memory with the keys themselves.
    fn key(&self, key: &str) -> Result<String, String> {
        if key.len() > MAX_KEY_BYTES {
            return Err(format!("keys and namespaces must be at most {MAX_KEY_BYTES} bytes, got {}", key.len()));
        }
        Ok(format!("{}:{key}", self.plugin))
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl types::Host for PluginState {}

impl runtime::Host for PluginState {
    async fn log(&mut self, level: runtime::Level, message: String) {
        use super::logs::{Verdict, one_line};
        let plugin = &*self.plugin;
        match self.stats.logs.admit() {
            Verdict::Write => {}
            Verdict::Drop => return,
            Verdict::DropAndWarn(n) => {
                tracing::warn!(plugin, "plugin log over its rate: {n} lines dropped");
                return;
            }
        }
        let message = one_line(&message);
        match level {
            runtime::Level::Trace => tracing::trace!(plugin, "{message}"),
            runtime::Level::Debug => tracing::debug!(plugin, "{message}"),
            runtime::Level::Info => tracing::info!(plugin, "{message}"),
            runtime::Level::Warn => tracing::warn!(plugin, "{message}"),
            runtime::Level::Error => tracing::error!(plugin, "{message}"),
        }
    }

    async fn now_ms(&mut self) -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

impl kv::Host for PluginState {
    async fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, String> {
        self.caps.kv_get(&self.key(&key)?).await
    }

    async fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        self.caps.kv_set(&self.key(&key)?, value, ttl_ms).await
    }

    async fn incr(&mut self, key: String, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        self.caps.kv_incr(&self.key(&key)?, delta, ttl_ms).await
    }

    async fn delete(&mut self, key: String) -> Result<(), String> {
        self.caps.kv_delete(&self.key(&key)?).await
    }
}

impl ratelimit::Host for PluginState {
    async fn token_bucket(
        &mut self,
        key: String,
        capacity: f64,
        refill_per_sec: f64,
        cost: f64,
    ) -> Result<ratelimit::BucketState, String> {
        let take = self.caps.take(&self.key(&key)?, capacity, refill_per_sec, cost).await?;
        Ok(ratelimit::BucketState {
            allowed: take.allowed,
            remaining: take.remaining,
            retry_after_secs: take.retry_after_secs,
        })
    }
}

impl embeddings::Host for PluginState {
    async fn embed(&mut self, text: String) -> Result<Vec<f32>, String> {
        let Some(embedder) = self.caps.embedder.clone() else {
            return Err("no embedding model is configured on this host".to_string());
        };
        // The model is the host's: time spent in it (waiting for its turn
        // behind other plugins' texts, and embedding) moves this call's
        // deadline rather than counting against its budget, up to the
        // call's host-wait allowance, and is reported on its own. A
        // plugin's budget pays for its own work.
        let (owner, started) = (self.plugin.clone(), Instant::now());
        // The queue wait ends early enough to leave time for the embedding itself.
        let queue_wait = self.host_wait_left.saturating_sub(HOST_WAIT_SLACK);
        self.wait.begin();
        let result = tokio::task::spawn_blocking(move || embedder.embed(&owner, &text, queue_wait))
            .await
            .map_err(|e| format!("embedding failed: {e}"))
            .and_then(|r| r);
        self.excuse(started.elapsed());
        result
    }
}

impl vectors::Host for PluginState {
    async fn insert(
        &mut self,
        namespace: String,
        vector: Vec<f32>,
        payload: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<(), String> {
        self.caps.vector_insert(&self.key(&namespace)?, &vector, payload, ttl_ms).await
    }

    async fn search(
        &mut self,
        namespace: String,
        vector: Vec<f32>,
        k: u32,
        min_score: f32,
    ) -> Result<Vec<vectors::Match>, String> {
        let hits = self.caps.vectors().search(&self.key(&namespace)?, &vector, k, min_score)?;
        Ok(hits.into_iter().map(|h| vectors::Match { score: h.score, payload: h.payload }).collect())
    }
}

impl PluginState {
    /// Moves the deadline by `waited` (at most what is left of the call's
    /// host-wait allowance) and counts it as host wait.
    fn excuse(&mut self, waited: Duration) {
        let waited = waited.min(self.host_wait_left);
        self.host_wait_left -= waited;
        self.deadline += waited;
        self.wait.end(waited);
        self.stats.record_host_wait(waited);
    }

    /// Logs a host warning about this plugin under its log rate, so that a
    /// plugin cannot make the host write without bound either.
    fn warn_limited(&self, message: &str) {
        use super::logs::{Verdict, one_line};
        match self.stats.logs.admit() {
            Verdict::Write => tracing::warn!(plugin = &*self.plugin, "{}", one_line(message)),
            Verdict::Drop => {}
            Verdict::DropAndWarn(n) => {
                tracing::warn!(plugin = &*self.plugin, "plugin log over its rate: {n} lines dropped")
            }
        }
    }
}

impl metrics::Host for PluginState {
    async fn counter_add(&mut self, name: String, delta: u64) {
        if let Err(message) = self.caps.metrics.counter_add(&self.plugin, &name, delta) {
            self.warn_limited(&format!("metric refused: {message}"));
        }
    }

    async fn gauge_set(&mut self, name: String, value: f64) {
        if let Err(message) = self.caps.metrics.gauge_set(&self.plugin, &name, value) {
            self.warn_limited(&format!("metric refused: {message}"));
        }
    }
}
