//! Request coalescing: requests with the same key while one generation is
//! in flight share it. The first request starts a *flight* (a task that
//! drives the engine's token stream); every subscriber, early or late,
//! replays the flight's events from the start, so each gets the whole
//! response. The generation is aborted once no subscriber is left.
//!
//! With Redis, flights span replicas: the replica that first claims a key
//! (`SET NX` with a lease) generates and appends every event to a Redis
//! stream; the others follow that stream into a local flight of their own.
//! A follower that sees no progress within the follow timeout (the owner
//! died or gave up) generates by itself; since only deterministic requests
//! are coalesced, it skips the tokens it already relayed and carries on.

use crate::state::flights::{Claim, FlightStats, FlightStreams};
use levee_gpu::{Completion, EngineError, FinishReason, GeneratedToken, Logprobs, TokenEvent, TokenStream};
use levee_gpu::{Timing, Usage};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};

type Event = Result<TokenEvent, EngineError>;

#[derive(Default)]
struct Log {
    events: Vec<Event>,
    done: bool,
}

/// One shared generation.
struct Flight {
    log: Mutex<Log>,
    changed: Notify,
    subscribers: AtomicUsize,
}

impl Flight {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A subscriber's view of a flight: every event, from the first.
pub struct Subscription {
    flight: Arc<Flight>,
    cursor: usize,
}

impl Subscription {
    fn new(flight: Arc<Flight>) -> Self {
        flight.subscribers.fetch_add(1, Ordering::SeqCst);
        Self { flight, cursor: 0 }
    }

    /// The next event; `None` once the flight is over and replayed.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            // Registered before the check, so a notification in between is not lost.
            let mut changed = std::pin::pin!(self.flight.changed.notified());
            changed.as_mut().enable();
            {
                let log = self.flight.lock();
                if let Some(event) = log.events.get(self.cursor) {
                    self.cursor += 1;
                    return Some(event.clone());
                }
                if log.done {
                    return None;
                }
            }
            changed.await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.flight.subscribers.fetch_sub(1, Ordering::SeqCst);
        // Wake the driver so it notices when nobody is left.
        self.flight.changed.notify_waiters();
    }
}

/// Flights of other replicas, through Redis.
pub struct Remote {
    /// Where flights travel.
    pub streams: FlightStreams,
    /// Longest wait for the owner's next event before generating here.
    pub follow_timeout: Duration,
    /// Counters for `/metrics`.
    pub stats: FlightStats,
}

/// How this request got its flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It started the generation, here.
    Leader,
    /// It joined a flight of this replica.
    Joined,
    /// It follows a generation of another replica.
    Follower,
}

/// The flights in progress, by key.
#[derive(Default)]
pub struct Flights {
    flights: Mutex<HashMap<String, Arc<Flight>>>,
    remote: Option<Remote>,
}

/// Starts the engine's generation for a flight.
pub type Start = Box<dyn FnOnce() -> Result<TokenStream, EngineError> + Send>;

impl Flights {
    /// Flights that span the replicas sharing `remote`'s Redis.
    pub fn across_replicas(remote: Remote) -> Self {
        Self { flights: Mutex::default(), remote: Some(remote) }
    }

    /// The cross-replica side, when configured.
    pub fn remote(&self) -> Option<&Remote> {
        self.remote.as_ref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Flight>>> {
        self.flights.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the flight of `key`, or starts one with `start` (which submits
    /// to the engine), or, across replicas, follows another replica's.
    pub async fn join(self: &Arc<Self>, key: &str, start: Start) -> Result<(Subscription, Role), EngineError> {
        let (flight, remote) = {
            let mut flights = self.lock();
            if let Some(flight) = flights.get(key)
                && !flight.lock().done
            {
                return Ok((Subscription::new(flight.clone()), Role::Joined));
            }
            let flight = Flight::new();
            let Some(remote) = &self.remote else {
                let stream = start()?;
                let subscription = Subscription::new(flight.clone());
                flights.insert(key.to_string(), flight.clone());
                tokio::spawn(drive(self.clone(), key.to_string(), flight, stream, 0, None));
                return Ok((subscription, Role::Leader));
            };
            flights.insert(key.to_string(), flight.clone());
            (flight, remote)
        };
        let subscription = Subscription::new(flight.clone());
        let wire = remote.streams.wire_key(key);
        match remote.streams.claim(&wire).await {
            Claim::Follow => {
                remote.stats.followed.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(follow(self.clone(), key.to_string(), flight, wire, start));
                Ok((subscription, Role::Follower))
            }
            claim => {
                let publish = (claim == Claim::Owner).then_some(wire.clone());
                match start() {
                    Ok(stream) => {
                        tokio::spawn(drive(self.clone(), key.to_string(), flight, stream, 0, publish));
                        Ok((subscription, Role::Leader))
                    }
                    Err(e) => {
                        if publish.is_some() {
                            remote.streams.abandon(&wire, r#"{"abandoned":true}"#).await;
                        }
                        self.finish(key, &flight, Some(Err(e.clone())));
                        Err(e)
                    }
                }
            }
        }
    }

    /// Records the last event of `flight` and forgets it.
    fn finish(&self, key: &str, flight: &Arc<Flight>, last: Option<Event>) {
        {
            let mut log = flight.lock();
            if let Some(event) = last {
                log.events.push(event);
            }
            log.done = true;
        }
        flight.changed.notify_waiters();
        let mut flights = self.lock();
        if flights.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            flights.remove(key);
        }
    }

    /// Flights in progress.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no flight is in progress.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Flight {
    fn new() -> Arc<Flight> {
        Arc::new(Flight { log: Mutex::default(), changed: Notify::new(), subscribers: AtomicUsize::new(0) })
    }
}

impl Remote {
    /// Flights through `redis`; a follower waits `follow_timeout` for the owner's next event.
    pub fn new(redis: Arc<crate::state::RedisState>, follow_timeout: Duration) -> Self {
        Self { streams: FlightStreams::new(redis, follow_timeout), follow_timeout, stats: FlightStats::default() }
    }
}

/// An event as it crosses replicas.
fn encode(event: &Event) -> Value {
    match event {
        Ok(TokenEvent::Token(t)) => json!({ "token": {
            "id": t.id,
            "text": t.text,
            "logprob": t.logprobs.as_ref().map(|l| l.logprob),
            "top": t.logprobs.as_ref().map(|l| l.top.clone()),
        }}),
        Ok(TokenEvent::Finished(c)) => json!({ "finished": {
            "reason": c.reason.as_str(),
            "prompt_tokens": c.usage.prompt_tokens,
            "completion_tokens": c.usage.completion_tokens,
            "queued_us": c.timing.queued.as_micros() as u64,
            "ttft_us": c.timing.time_to_first_token.as_micros() as u64,
            "tpot_us": c.timing.time_per_output_token.as_micros() as u64,
            "total_us": c.timing.total.as_micros() as u64,
            "preemptions": c.timing.preemptions,
        }}),
        Err(_) => json!({ "abandoned": true }),
    }
}

/// A remote event: `Some(Ok)` to relay, `Some(Err(()))` when the owner gave up, `None` if unreadable.
fn decode(value: &Value) -> Option<Result<TokenEvent, ()>> {
    if value.get("abandoned").is_some() {
        return Some(Err(()));
    }
    if let Some(t) = value.get("token") {
        let logprobs = match (t.get("logprob").and_then(Value::as_f64), t.get("top")) {
            (Some(logprob), Some(top)) => Some(Logprobs {
                logprob: logprob as f32,
                top: serde_json::from_value::<Vec<(u32, f32)>>(top.clone()).ok()?,
            }),
            _ => None,
        };
        return Some(Ok(TokenEvent::Token(GeneratedToken {
            id: t.get("id")?.as_u64()? as u32,
            text: t.get("text")?.as_str()?.to_string(),
            logprobs,
        })));
    }
    let f = value.get("finished")?;
    let us = |name: &str| Some(Duration::from_micros(f.get(name)?.as_u64()?));
    Some(Ok(TokenEvent::Finished(Completion {
        reason: if f.get("reason")?.as_str()? == "length" { FinishReason::Length } else { FinishReason::Stop },
        usage: Usage {
            prompt_tokens: f.get("prompt_tokens")?.as_u64()? as usize,
            completion_tokens: f.get("completion_tokens")?.as_u64()? as usize,
        },
        timing: Timing {
            queued: us("queued_us")?,
            time_to_first_token: us("ttft_us")?,
            time_per_output_token: us("tpot_us")?,
            total: us("total_us")?,
            preemptions: f.get("preemptions")?.as_u64()? as u32,
        },
    })))
}

/// Follows another replica's flight into `flight`; generates here when the
/// owner stalls past the follow timeout or gives up.
async fn follow(flights: Arc<Flights>, key: String, flight: Arc<Flight>, wire: String, start: Start) {
    let Some(remote) = flights.remote() else { return };
    let mut reader = remote.streams.reader().await;
    let mut last = "0-0".to_string();
    let mut relayed = 0usize;
    let mut progress = Instant::now();
    let mut abandoned = false;
    let block = remote.follow_timeout.min(Duration::from_millis(500)).max(Duration::from_millis(10));
    loop {
        if flight.subscribers.load(Ordering::SeqCst) == 0 {
            flights.finish(&key, &flight, None);
            return;
        }
        if abandoned || progress.elapsed() >= remote.follow_timeout {
            break;
        }
        let Some(r) = reader.as_mut() else { break };
        let Ok(events) = r.read(&wire, &mut last, block).await else { break };
        if !events.is_empty() {
            progress = Instant::now();
        }
        for text in events {
            // An event this replica cannot read would leave a gap in the
            // relayed tokens: stop following and generate here instead.
            let Some(event) = text.and_then(|t| serde_json::from_str(&t).ok()).as_ref().and_then(decode) else {
                abandoned = true;
                break;
            };
            match event {
                Ok(TokenEvent::Token(token)) => {
                    relayed += 1;
                    flight.lock().events.push(Ok(TokenEvent::Token(token)));
                    flight.changed.notify_waiters();
                }
                Ok(finished) => {
                    flights.finish(&key, &flight, Some(Ok(finished)));
                    return;
                }
                Err(()) => {
                    abandoned = true;
                    break;
                }
            }
        }
    }
    // The owner is gone or stalled: generate here, skipping what was relayed.
    remote.stats.taken_over.fetch_add(1, Ordering::Relaxed);
    tracing::info!(relayed, "coalesced flight taken over from another replica");
    match start() {
        Ok(stream) => drive(flights, key, flight, stream, relayed, None).await,
        Err(e) => flights.finish(&key, &flight, Some(Err(e))),
    }
}

/// Drives `stream` into `flight`, dropping its first `skip` tokens (already
/// relayed from another replica) and, as the owner of a cross-replica
/// flight, publishing every event to `publish`.
async fn drive(
    flights: Arc<Flights>,
    key: String,
    flight: Arc<Flight>,
    mut stream: TokenStream,
    mut skip: usize,
    publish: Option<String>,
) {
    let publisher = match (&publish, flights.remote()) {
        (Some(wire), Some(_)) => {
            let (tx, rx) = mpsc::unbounded_channel::<Value>();
            tokio::spawn(publish_events(flights.clone(), wire.clone(), rx));
            Some(tx)
        }
        _ => None,
    };
    loop {
        let next = tokio::select! {
            event = stream.next() => event,
            _ = async {
                loop {
                    let mut changed = std::pin::pin!(flight.changed.notified());
                    changed.as_mut().enable();
                    if flight.subscribers.load(Ordering::SeqCst) == 0 {
                        return;
                    }
                    changed.await;
                }
            } => None, // nobody is listening: dropping the stream aborts the generation
        };
        let finished = !matches!(next, Some(Ok(TokenEvent::Token(_))));
        if let Some(tx) = &publisher {
            // A generation that ends without `Finished` is abandoned: followers take over.
            let _ = tx.send(match &next {
                Some(event) => encode(event),
                None => json!({ "abandoned": true }),
            });
        }
        if matches!(next, Some(Ok(TokenEvent::Token(_)))) && skip > 0 {
            skip -= 1;
            continue;
        }
        {
            let mut log = flight.lock();
            if let Some(event) = next {
                log.events.push(event);
            }
            if finished {
                log.done = true;
            }
        }
        flight.changed.notify_waiters();
        if finished {
            break;
        }
    }
    let mut map = flights.lock();
    if map.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
        map.remove(&key);
    }
}

/// Sends an owner's events to Redis in batches, in order.
async fn publish_events(flights: Arc<Flights>, wire: String, mut rx: mpsc::UnboundedReceiver<Value>) {
    let Some(remote) = flights.remote() else { return };
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 256).await > 0 {
        let last = batch.iter().any(|e| e.get("finished").is_some() || e.get("abandoned").is_some());
        let texts: Vec<String> = batch.iter().map(Value::to_string).collect();
        remote.streams.publish(&wire, &texts, last).await;
        batch.clear();
        if last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_cross_replicas_unchanged() {
        let token = Ok(TokenEvent::Token(GeneratedToken {
            id: 42,
            text: " Paris".into(),
            logprobs: Some(Logprobs { logprob: -0.25, top: vec![(42, -0.25), (7, -2.5)] }),
        }));
        let finished = Ok(TokenEvent::Finished(Completion {
            reason: FinishReason::Length,
            usage: Usage { prompt_tokens: 5, completion_tokens: 8 },
            timing: Timing {
                queued: Duration::from_micros(10),
                time_to_first_token: Duration::from_micros(2000),
                time_per_output_token: Duration::from_micros(300),
                total: Duration::from_micros(5000),
                preemptions: 1,
            },
        }));
        for event in [token, finished] {
            let wire = encode(&event);
            let back = decode(&serde_json::from_str(&wire.to_string()).unwrap()).unwrap().unwrap();
            assert_eq!(Some(back), event.ok());
        }
        assert_eq!(decode(&json!({ "abandoned": true })), Some(Err(())));
        assert_eq!(decode(&json!({ "something": 1 })), None);
    }
}
