//! One loaded version of one plugin: its compiled component, a pool of
//! initialised instances, and hook calls under a deadline and a memory cap.
//!
//! Instances are reused across requests (creating one means running the
//! plugin's `init`), one call at a time each. An instance that trapped, ran
//! past its deadline or hit its memory cap is dropped, never reused.

use super::bindings::{
    Admission, CacheHit, Hook, Load, LookupResult, Manifest, Plugin, PluginPre, Request, Response, ScaleDecision,
    ScaleSignals, Shaping, Usage,
};
use super::state::{HOST_WAIT_SLACK, HostWait, PluginState};
use super::stats::{Fault, PluginStats};
use crate::capabilities::Capabilities;
use crate::config::{Mode, OnFault, PluginConfig};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use wasmtime::{Store, Trap, UpdateDeadline};

/// Extra time granted past the budget before an awaiting host call (e.g. a
/// slow network store) is abandoned; CPU-bound guests are cut by the epoch.
const HOST_CALL_GRACE: Duration = Duration::from_millis(2);

/// How long plugin work that is not done at once keeps running on the
/// caller's thread before it moves to the plugin threads, counted from its
/// first pause and checked when it next pauses: a guest that computes
/// moves after about three epoch ticks (1.5 ms at the default 500 µs).
const INLINE_SLICE: Duration = Duration::from_millis(1);

/// Longest coalescing key a plugin may return.
const MAX_KEY_BYTES: usize = 4096;

/// Most replicas a scale decision may ask for.
const MAX_REPLICAS: u32 = 10_000;

/// Longest rejection message or scale reason, bytes: clients and
/// `/v1/scaling` readers see them.
const MAX_MESSAGE_BYTES: usize = 1024;

/// Longest degradation label, bytes: it is sent as `x-levee-degraded`.
const MAX_LABEL_BYTES: usize = 64;

/// Longest model name a shape decision may route to, bytes.
const MAX_MODEL_BYTES: usize = 256;

/// How a loaded plugin is called: everything fixed at load time.
#[derive(Clone)]
pub struct CallSettings {
    /// Budget of one hook call.
    pub budget: Duration,
    /// Budget of `init` on a new instance.
    pub init_budget: Duration,
    /// Memory cap, bytes.
    pub memory_bytes: usize,
    /// Idle instances to keep.
    pub max_idle: usize,
    /// Consecutive faults that quarantine the plugin.
    pub quarantine_after: u32,
    /// Most text a cache hit may carry over all its choices, bytes.
    pub max_hit_bytes: usize,
    /// Most instances of the plugin alive at once, idle or busy.
    pub max_instances: usize,
    /// Time one call may spend in the embedding model without it counting
    /// against its budget.
    pub host_wait: Duration,
    /// Linear memory of all the plugin's instances together, bytes.
    pub memory_total_bytes: usize,
}

/// One initialised instance; it holds one of the plugin's instance permits
/// for as long as it lives.
struct Slot {
    store: Store<PluginState>,
    plugin: Plugin,
    _permit: OwnedSemaphorePermit,
}

/// What making and calling instances of one plugin version needs, shared
/// (behind an `Arc`) with the calls and the background task that keeps the
/// idle pool warm.
struct Factory {
    name: Arc<str>,
    version: String,
    settings: CallSettings,
    config_json: Arc<str>,
    pre: PluginPre<PluginState>,
    engine: wasmtime::Engine,
    /// The plugin threads, where instances are made and called.
    exec: tokio::runtime::Handle,
    caps: Arc<Capabilities>,
    stats: Arc<PluginStats>,
    /// One permit per live instance (idle or busy): the plugin's own share
    /// of the pooling allocator, so that it cannot take another's.
    live: Arc<Semaphore>,
    idle: Mutex<Vec<Slot>>,
    /// Woken when an instance goes back to the idle pool.
    returned: Notify,
    warming: AtomicBool,
    /// Failed warm-up rounds in a row and when the last one ended, for backoff.
    warm_failures: Mutex<(u32, Option<Instant>)>,
    /// Set when this version leaves the chain: its warmer stops.
    retired: AtomicBool,
    /// Linear memory this version's instances hold together, bytes.
    memory: Arc<AtomicUsize>,
    /// Calls of this version waiting on a host capability right now.
    host_waits: Arc<AtomicUsize>,
}

/// One version of one plugin, ready to call.
pub struct LoadedPlugin {
    /// Configured name.
    pub name: Arc<str>,
    /// Its configuration entry.
    pub config: PluginConfig,
    /// First 16 hex digits of the component's SHA-256.
    pub version: String,
    /// What its `init` declared.
    pub manifest: Manifest,
    /// Counters, shared with earlier and later versions of the same name.
    pub stats: Arc<PluginStats>,
    hooks: [bool; 6],
    settings: CallSettings,
    factory: Arc<Factory>,
}

/// A call's fault that its work did not record (it never reached an instance).
struct Unrecorded(Fault);

/// One hook call, with its arguments: it travels to the plugin threads.
enum Call {
    Admit(Arc<Request>, Load),
    Lookup(Arc<Request>),
    CoalesceKey(Arc<Request>),
    Shape(Arc<Request>, Load),
    Completed(Arc<Request>, Response, Usage),
    Scale(ScaleSignals),
}

enum Answer {
    Admission(Admission),
    Lookup(LookupResult),
    Key(Option<String>),
    Shaping(Shaping),
    Done,
    Scale(ScaleDecision),
}

impl Call {
    fn hook(&self) -> Hook {
        match self {
            Call::Admit(..) => Hook::Admit,
            Call::Lookup(..) => Hook::Lookup,
            Call::CoalesceKey(..) => Hook::CoalesceKey,
            Call::Shape(..) => Hook::Shape,
            Call::Completed(..) => Hook::Completed,
            Call::Scale(..) => Hook::Scale,
        }
    }
}

async fn invoke(plugin: &Plugin, store: &mut Store<PluginState>, call: &Call) -> wasmtime::Result<Answer> {
    Ok(match call {
        Call::Admit(request, load) => Answer::Admission(plugin.call_admit(&mut *store, request, *load).await?),
        Call::Lookup(request) => Answer::Lookup(plugin.call_lookup(&mut *store, request).await?),
        Call::CoalesceKey(request) => Answer::Key(plugin.call_coalesce_key(&mut *store, request).await?),
        Call::Shape(request, load) => Answer::Shaping(plugin.call_shape(&mut *store, request, *load).await?),
        Call::Completed(request, response, usage) => {
            plugin.call_completed(&mut *store, request, response, *usage).await?;
            Answer::Done
        }
        Call::Scale(signals) => Answer::Scale(plugin.call_scale(&mut *store, *signals).await?),
    })
}

fn check_rejection(status: u16, retry_after: Option<u32>, message: &str, what: &str) -> Result<(), Fault> {
    if !(400..=599).contains(&status) {
        return Err(Fault::Malformed(format!("{what} status must be 400-599, got {status}")));
    }
    check_length(message, MAX_MESSAGE_BYTES, &format!("{what} message"))?;
    if retry_after.is_some_and(|s| s > 86_400) {
        return Err(Fault::Malformed(format!("{what} retry-after-secs must be ≤ 86400, got {retry_after:?}")));
    }
    Ok(())
}

fn check_length(text: &str, max: usize, what: &str) -> Result<(), Fault> {
    check_length_of(text.len(), max, what)
}

fn check_length_of(len: usize, max: usize, what: &str) -> Result<(), Fault> {
    if len > max {
        return Err(Fault::Malformed(format!("{what} must be at most {max} bytes, got {len}")));
    }
    Ok(())
}

/// A label is sent as a header value: a short token of letters, digits and `-_.:`.
fn check_label(label: &str) -> Result<(), Fault> {
    let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    if label.is_empty() || label.len() > MAX_LABEL_BYTES || !label.chars().all(token) {
        let shown: String = label.chars().take(MAX_LABEL_BYTES).collect();
        return Err(Fault::Malformed(format!(
            "shape label must be 1-{MAX_LABEL_BYTES} letters, digits or -_.: ({} bytes: {shown:?})",
            label.len()
        )));
    }
    Ok(())
}

fn check_similarity(value: f32, what: &str) -> Result<(), Fault> {
    if !(0.0..=1.0).contains(&value) {
        return Err(Fault::Malformed(format!("{what} must be within 0.0-1.0, got {value}")));
    }
    Ok(())
}

/// Checks a decision against the contract (values in range, texts within
/// their bounds); a violation is a fault.
fn validate(answer: &Answer, settings: &CallSettings) -> Result<(), Fault> {
    match answer {
        Answer::Admission(Admission::Reject(r)) => check_rejection(r.status, r.retry_after_secs, &r.message, "reject"),
        Answer::Lookup(LookupResult::Hit(CacheHit { response, similarity })) => {
            check_similarity(*similarity, "cache hit similarity")?;
            if response.choices.is_empty() {
                return Err(Fault::Malformed("cache hit has no choices".into()));
            }
            let text: usize = response.choices.iter().map(|c| c.text.len()).sum();
            check_length_of(text, settings.max_hit_bytes, "cache hit text")?;
            if let Some(c) = response.choices.iter().find(|c| !matches!(c.finish_reason.as_str(), "stop" | "length")) {
                let shown: String = c.finish_reason.chars().take(64).collect();
                return Err(Fault::Malformed(format!(
                    "cache hit finish-reason must be `stop` or `length`, got {:?}",
                    super::logs::one_line(&shown)
                )));
            }
            Ok(())
        }
        Answer::Key(Some(key)) if key.is_empty() || key.len() > MAX_KEY_BYTES => {
            Err(Fault::Malformed(format!("coalesce key must be 1-{MAX_KEY_BYTES} bytes, got {}", key.len())))
        }
        Answer::Shaping(s) => {
            if s.max_tokens == Some(0) {
                return Err(Fault::Malformed("shape max-tokens must be ≥ 1, got 0".into()));
            }
            if s.truncate_prompt_tokens == Some(0) {
                return Err(Fault::Malformed("shape truncate-prompt-tokens must be ≥ 1, got 0".into()));
            }
            if s.route_model.as_deref() == Some("") {
                return Err(Fault::Malformed("shape route-model must not be empty".into()));
            }
            if let Some(model) = &s.route_model {
                check_length(model, MAX_MODEL_BYTES, "shape route-model")?;
            }
            if let Some(label) = &s.label {
                check_label(label)?;
            }
            if let Some(floor) = s.cache_min_similarity {
                check_similarity(floor, "shape cache-min-similarity")?;
            }
            if let Some(shed) = &s.shed {
                check_rejection(shed.status, shed.retry_after_secs, &shed.message, "shed")?;
            }
            Ok(())
        }
        Answer::Scale(d) if d.desired_replicas > MAX_REPLICAS => Err(Fault::Malformed(format!(
            "scale desired-replicas must be ≤ {MAX_REPLICAS}, got {}",
            d.desired_replicas
        ))),
        Answer::Scale(d) => check_length(&d.reason, MAX_MESSAGE_BYTES, "scale reason"),
        _ => Ok(()),
    }
}

/// Runs `work` for `limit`, plus what the call's host waits have moved its
/// deadline by (at most `cap`; a wait in progress counts up to now); `Err`
/// when that time passes first.
async fn within<T>(limit: Duration, wait: &HostWait, cap: Duration, work: impl Future<Output = T>) -> Result<T, ()> {
    let started = tokio::time::Instant::now();
    let mut work = std::pin::pin!(work);
    loop {
        let (moved, waiting) = wait.moved();
        let mut until = started + limit + moved.min(cap);
        if waiting && moved < cap {
            until = until.max(tokio::time::Instant::now() + Duration::from_millis(1));
        }
        tokio::select! {
            // The work first: when it is done at once, no timer is ever set.
            biased;
            done = &mut work => return Ok(done),
            _ = tokio::time::sleep_until(until) => {
                let (moved, waiting) = wait.moved();
                let end = started + limit + moved.min(cap);
                if end <= tokio::time::Instant::now() && !(waiting && moved < cap) {
                    return Err(());
                }
            }
        }
    }
}

impl Factory {
    /// Makes and initialises an instance; see [`Factory::make_here`] and [`Factory::run`].
    async fn make(self: &Arc<Self>, budget: Duration, permit: OwnedSemaphorePermit) -> Result<(Slot, Manifest), Fault> {
        let factory = self.clone();
        self.run(async move { factory.make_here(budget, permit).await })
            .await
            .unwrap_or_else(|e| Err(Fault::HostBusy(format!("the plugin threads stopped: {e}"))))
    }

    /// Runs plugin work where it costs least: on the caller's thread while
    /// it is short (most hook calls are a few microseconds, and a hop to
    /// another thread costs more than the call), and on the plugin threads
    /// once it has run for [`INLINE_SLICE`] and is not done: a call that
    /// computes for its whole budget then takes the plugin threads' time,
    /// not the server's async workers'. The work is a boxed future, so it
    /// moves between threads mid-call.
    async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        use std::task::Poll;
        let mut work = Box::pin(work);
        // Timed from the first time it is not done: a call that finishes at
        // once (the common case) never reads the clock here.
        let mut pending_since = None;
        let inline = std::future::poll_fn(|cx| match work.as_mut().poll(cx) {
            Poll::Ready(done) => Poll::Ready(Some(done)),
            Poll::Pending => match pending_since {
                None => {
                    pending_since = Some(Instant::now());
                    Poll::Pending
                }
                Some(since) if since.elapsed() >= INLINE_SLICE => Poll::Ready(None),
                Some(_) => Poll::Pending,
            },
        });
        match inline.await {
            Some(done) => Ok(done),
            None => self.exec.spawn(work).await,
        }
    }

    /// Makes and initialises an instance whose `init` must finish within
    /// `budget`, holding `permit`.
    async fn make_here(&self, budget: Duration, permit: OwnedSemaphorePermit) -> Result<(Slot, Manifest), Fault> {
        let memory = (self.settings.memory_bytes, self.memory.clone(), self.settings.memory_total_bytes);
        let state = PluginState::new(self.name.clone(), memory, self.caps.clone(), self.stats.clone());
        state.wait.count_in(self.host_waits.clone());
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.cap);
        store.epoch_deadline_callback(|ctx| {
            if Instant::now() >= ctx.data().deadline {
                Err(Trap::Interrupt.into())
            } else {
                Ok(UpdateDeadline::Yield(1))
            }
        });
        store.data_mut().deadline = Instant::now() + budget;
        store.data_mut().host_wait_left = self.settings.host_wait + HOST_WAIT_SLACK;
        store.set_epoch_deadline(1);
        let wait = store.data().wait.clone();
        wait.reset();
        let started = async {
            let plugin = self.pre.instantiate_async(&mut store).await?;
            let manifest = plugin.call_init(&mut store, &self.config_json).await?;
            wasmtime::Result::Ok((plugin, manifest))
        };
        let cap = self.settings.host_wait + HOST_WAIT_SLACK;
        let outcome = within(budget + HOST_CALL_GRACE, &wait, cap, started).await;
        let (plugin, manifest) = match outcome {
            Err(_) => return Err(Fault::Instantiate(format!("init ran past its budget of {budget:?}"))),
            Ok(Err(error)) => {
                return Err(match self.classify(&error, &store) {
                    Fault::Deadline(_) => Fault::Instantiate(format!("init ran past its budget of {budget:?}")),
                    Fault::HostBusy(why) => Fault::HostBusy(why),
                    other => Fault::Instantiate(other.to_string()),
                });
            }
            Ok(Ok((_, Err(message)))) => {
                return Err(Fault::Instantiate(format!("init refused: {}", super::logs::one_line(&message))));
            }
            Ok(Ok((plugin, Ok(manifest)))) => (plugin, manifest),
        };
        Ok((Slot { store, plugin, _permit: permit }, manifest))
    }

    fn classify(&self, error: &wasmtime::Error, store: &Store<PluginState>) -> Fault {
        if let Some(full) = error.downcast_ref::<wasmtime::PoolConcurrencyLimitError>() {
            Fault::HostBusy(full.to_string())
        } else if let Some(cap) = store.data().cap.exceeded {
            Fault::OverMemory(cap as u64 >> 20)
        } else if matches!(error.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
            Fault::Deadline(self.settings.budget)
        } else {
            // The whole reason, on one bounded line.
            Fault::Trap(super::logs::one_line(&format!("{error:#}")))
        }
    }

    /// Records one call of `hook` that started at `started`, logs its fault
    /// (within the plugin's fault-log rate) and says when it tipped the
    /// plugin into quarantine. A retired version's faults are counted but
    /// never quarantine the name: its successor starts afresh.
    fn finish(&self, hook: Hook, started: Instant, outcome: Result<(), &Fault>) {
        let retired = self.retired.load(Ordering::Acquire);
        let fault = outcome.err();
        let tipped = self.stats.record(hook, started.elapsed(), fault, self.settings.quarantine_after, !retired);
        if let Some(fault) = fault
            && self.stats.fault_logs.admit() == super::logs::Verdict::Write
        {
            tracing::warn!(plugin = &*self.name, version = %self.version, hook = hook.name(), "plugin fault: {fault}");
        }
        if tipped {
            tracing::error!(
                plugin = &*self.name,
                version = %self.version,
                "plugin quarantined after repeated faults ({} in a row, or half of its last {} calls); load a fixed \
                 version, or lift it with POST /admin/plugins/{}/lift-quarantine",
                self.settings.quarantine_after,
                super::stats::RATE_WINDOW,
                self.name
            );
        }
    }

    fn idle_count(&self) -> usize {
        self.idle.lock().map(|v| v.len()).unwrap_or(0)
    }

    fn take_idle(&self) -> Option<Slot> {
        self.idle.lock().ok()?.pop()
    }

    /// Keeps `slot` for reuse if the pool has room (dropping it otherwise,
    /// which frees its permit), and wakes a call waiting for an instance.
    fn put_back(&self, slot: Slot) {
        if self.retired.load(Ordering::Acquire) {
            return;
        }
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.settings.max_idle
        {
            idle.push(slot);
        }
        self.returned.notify_one();
    }

    /// Fills the idle pool up to `max_idle` in the background, with `init`
    /// under its own budget: a slow `init` runs here, not on a request's
    /// path. One warmer per plugin version at a time; a failure counts as a
    /// fault and ends the round.
    fn warm(self: &Arc<Self>) {
        if self.settings.max_idle == 0 || self.retired.load(Ordering::Acquire) {
            return;
        }
        // After failed rounds, wait 1, 2, 4, ... up to 60 seconds before the next.
        if let Ok(failures) = self.warm_failures.lock()
            && let (n @ 1.., Some(at)) = *failures
            && at.elapsed() < Duration::from_secs(1u64 << n.min(6)).min(Duration::from_secs(60))
        {
            return;
        }
        if self.warming.swap(true, Ordering::AcqRel) {
            return;
        }
        let factory = self.clone();
        self.exec.spawn(async move {
            while factory.idle_count() < factory.settings.max_idle && !factory.retired.load(Ordering::Acquire) {
                let Ok(permit) = factory.live.clone().try_acquire_owned() else { break };
                let started = Instant::now();
                match factory.make_here(factory.settings.init_budget, permit).await {
                    Ok((slot, _)) => {
                        factory.put_back(slot);
                        if let Ok(mut failures) = factory.warm_failures.lock() {
                            *failures = (0, None);
                        }
                    }
                    Err(fault) => {
                        factory.stats.record_instance_fault(&fault, started.elapsed());
                        if factory.stats.fault_logs.admit() == super::logs::Verdict::Write {
                            tracing::warn!(plugin = &*factory.name, "warming an instance failed: {fault}");
                        }
                        if let Ok(mut failures) = factory.warm_failures.lock() {
                            *failures = (failures.0.saturating_add(1), Some(Instant::now()));
                        }
                        break;
                    }
                }
            }
            factory.warming.store(false, Ordering::Release);
        });
    }
}

impl Drop for LoadedPlugin {
    fn drop(&mut self) {
        // This version has left every chain: its warmer stops, its idle instances go.
        self.factory.retired.store(true, Ordering::Release);
        if let Ok(mut idle) = self.factory.idle.lock() {
            idle.clear();
        }
    }
}

impl LoadedPlugin {
    /// Instantiates a first instance of `pre`, runs `init`, and keeps it;
    /// the rest of the idle pool is warmed in the background. Fails with the
    /// plugin's own message when `init` refuses.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start(
        config: PluginConfig,
        version: String,
        pre: PluginPre<PluginState>,
        (engine, exec): (wasmtime::Engine, tokio::runtime::Handle),
        caps: Arc<Capabilities>,
        settings: CallSettings,
        stats: Arc<PluginStats>,
    ) -> Result<Self, String> {
        let config_json =
            serde_json::to_string(&config.config).map_err(|e| format!("config is not valid JSON: {e}"))?;
        stats.logs.set_rate(config.log_lines_per_sec);
        let name: Arc<str> = Arc::from(config.name.as_str());
        let factory = Arc::new(Factory {
            name: name.clone(),
            version: version.clone(),
            settings: settings.clone(),
            config_json: Arc::from(config_json),
            pre,
            engine,
            exec,
            caps,
            stats: stats.clone(),
            live: Arc::new(Semaphore::new(settings.max_instances.max(1))),
            idle: Mutex::default(),
            returned: Notify::new(),
            warming: AtomicBool::new(false),
            warm_failures: Mutex::default(),
            retired: AtomicBool::new(false),
            memory: Arc::default(),
            host_waits: Arc::default(),
        });
        let permit = factory.live.clone().try_acquire_owned().map_err(|e| e.to_string())?;
        let (slot, manifest) = factory.make(settings.init_budget, permit).await.map_err(|fault| match fault {
            Fault::Instantiate(message) => message,
            other => other.to_string(),
        })?;
        let mut hooks = [false; 6];
        for hook in &manifest.hooks {
            hooks[hook.index()] = true;
        }
        factory.put_back(slot);
        factory.warm();
        Ok(Self { name, config, version, manifest, stats, hooks, settings, factory })
    }

    /// Whether the plugin declared `hook`.
    pub fn declares(&self, hook: Hook) -> bool {
        self.hooks[hook.index()]
    }

    /// Fault rule.
    pub fn on_fault(&self) -> OnFault {
        self.config.on_fault
    }

    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.config.mode
    }

    /// Linear memory this version's instances hold together, bytes.
    pub fn memory_bytes(&self) -> usize {
        self.factory.memory.load(Ordering::Relaxed)
    }

    /// Idle instances right now.
    pub fn idle_instances(&self) -> usize {
        self.factory.idle_count()
    }

    async fn call(&self, call: Call) -> Result<Answer, Fault> {
        let hook = call.hook();
        let started = Instant::now();
        // The work records its own outcome (see `call_inner`); only a call
        // that never reached an instance is recorded here.
        match self.call_inner(call, started).await {
            Err(Unrecorded(fault)) => {
                self.factory.finish(hook, started, Err(&fault));
                Err(fault)
            }
            Ok(outcome) => outcome,
        }
    }

    /// An instance for one call, by `deadline`: an idle one, one that comes
    /// back to the pool meanwhile, or a new one whose `init` must finish by
    /// the deadline too (a slow `init` is the plugin's fault, not the
    /// request's wait). The warmer refills the idle pool in the background.
    async fn instance(&self, deadline: Instant) -> Result<Slot, Fault> {
        let factory = &self.factory;
        if let Some(slot) = factory.take_idle() {
            if factory.idle_count() == 0 {
                factory.warm();
            }
            return Ok(slot);
        }
        factory.warm();
        loop {
            let returned = factory.returned.notified();
            let mut returned = std::pin::pin!(returned);
            returned.as_mut().enable();
            if let Some(slot) = factory.take_idle() {
                return Ok(slot);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::select! {
                permit = factory.live.clone().acquire_owned() => {
                    let permit = permit.map_err(|e| Fault::Instantiate(e.to_string()))?;
                    if let Some(slot) = factory.take_idle() {
                        return Ok(slot);
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    return Ok(factory.make(left, permit).await?.0);
                }
                _ = returned => continue,
                _ = tokio::time::sleep(left) => {
                    // Instances held by calls that wait on the host's
                    // embedding model are the host's doing, not the plugin's.
                    if factory.host_waits.load(Ordering::Relaxed) > 0 {
                        return Err(Fault::HostBusy(format!(
                            "no instance was free within the call's budget of {:?}: the plugin's calls are waiting \
                             on the host",
                            self.settings.budget
                        )));
                    }
                    return Err(Fault::Instantiate(format!(
                        "no instance was free within the call's budget of {:?} (all {} of the plugin's were busy)",
                        self.settings.budget, self.settings.max_instances
                    )));
                }
            }
        }
    }

    async fn call_inner(&self, call: Call, started: Instant) -> Result<Result<Answer, Fault>, Unrecorded> {
        // One budget for the whole call: waiting for an instance, a new
        // instance's `init`, and the hook itself.
        let budget = self.settings.budget;
        let deadline = started + budget;
        let mut slot = self.instance(deadline).await.map_err(Unrecorded)?;
        let factory = self.factory.clone();
        // The work puts its instance back and records its outcome itself:
        // once on the plugin threads, it ends the same way if the request
        // goes away.
        let hook = call.hook();
        let work = self.factory.run(async move {
            slot.store.data_mut().deadline = deadline;
            let cap = factory.settings.host_wait + HOST_WAIT_SLACK;
            slot.store.data_mut().host_wait_left = cap;
            slot.store.set_epoch_deadline(1);
            let wait = slot.store.data().wait.clone();
            wait.reset();
            let left = deadline.saturating_duration_since(Instant::now());
            let invoked = invoke(&slot.plugin, &mut slot.store, &call);
            let outcome = match within(left + HOST_CALL_GRACE, &wait, cap, invoked).await {
                Err(_) => Err(Fault::Deadline(budget)),
                Ok(Err(error)) => Err(factory.classify(&error, &slot.store)),
                Ok(Ok(answer)) => {
                    // The instance is sound even when its decision is not.
                    factory.put_back(slot);
                    validate(&answer, &factory.settings).map(|()| answer)
                }
            };
            factory.finish(hook, started, outcome.as_ref().map(|_| ()));
            outcome
        });
        match work.await {
            Ok(outcome) => Ok(outcome),
            // The plugin threads are shutting down with the server.
            Err(e) => Err(Unrecorded(Fault::HostBusy(format!("the plugin threads stopped: {e}")))),
        }
    }

    /// Calls `admit`.
    pub async fn admit(&self, request: &Arc<Request>, load: &Load) -> Result<Admission, Fault> {
        match self.call(Call::Admit(request.clone(), *load)).await? {
            Answer::Admission(a) => Ok(a),
            _ => unreachable!("admit answers with an admission"),
        }
    }

    /// Calls `lookup`.
    pub async fn lookup(&self, request: &Arc<Request>) -> Result<LookupResult, Fault> {
        match self.call(Call::Lookup(request.clone())).await? {
            Answer::Lookup(l) => Ok(l),
            _ => unreachable!("lookup answers with a lookup result"),
        }
    }

    /// Calls `coalesce-key`.
    pub async fn coalesce_key(&self, request: &Arc<Request>) -> Result<Option<String>, Fault> {
        match self.call(Call::CoalesceKey(request.clone())).await? {
            Answer::Key(k) => Ok(k),
            _ => unreachable!("coalesce-key answers with a key"),
        }
    }

    /// Calls `shape`.
    pub async fn shape(&self, request: &Arc<Request>, load: &Load) -> Result<Shaping, Fault> {
        match self.call(Call::Shape(request.clone(), *load)).await? {
            Answer::Shaping(s) => Ok(s),
            _ => unreachable!("shape answers with a shaping"),
        }
    }

    /// Calls `completed`.
    pub async fn completed(&self, request: &Arc<Request>, response: &Response, usage: &Usage) -> Result<(), Fault> {
        match self.call(Call::Completed(request.clone(), response.clone(), *usage)).await? {
            Answer::Done => Ok(()),
            _ => unreachable!("completed answers with nothing"),
        }
    }

    /// Calls `scale`.
    pub async fn scale(&self, signals: &ScaleSignals) -> Result<ScaleDecision, Fault> {
        match self.call(Call::Scale(*signals)).await? {
            Answer::Scale(d) => Ok(d),
            _ => unreachable!("scale answers with a decision"),
        }
    }
}
