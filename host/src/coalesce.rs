//! Request coalescing: requests with the same key while one generation is
//! in flight share it. The first request starts a *flight* (a task that
//! drives the engine's token stream); every subscriber, early or late,
//! replays the flight's events from the start, so each gets the whole
//! response. The generation is aborted once no subscriber is left.

use levee_gpu::{EngineError, TokenEvent, TokenStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

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

/// The flights in progress, by key.
#[derive(Default)]
pub struct Flights {
    flights: Mutex<HashMap<String, Arc<Flight>>>,
}

impl Flights {
    /// Joins the flight of `key`, or starts one with `start` (which submits
    /// to the engine). Returns the subscription and whether it joined an
    /// existing flight.
    pub fn join(
        self: &Arc<Self>,
        key: &str,
        start: impl FnOnce() -> Result<TokenStream, EngineError>,
    ) -> Result<(Subscription, bool), EngineError> {
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(flight) = flights.get(key)
            && !flight.lock().done
        {
            return Ok((Subscription::new(flight.clone()), true));
        }
        let stream = start()?;
        let flight =
            Arc::new(Flight { log: Mutex::default(), changed: Notify::new(), subscribers: AtomicUsize::new(0) });
        let subscription = Subscription::new(flight.clone());
        flights.insert(key.to_string(), flight.clone());
        tokio::spawn(drive(self.clone(), key.to_string(), flight, stream));
        Ok((subscription, false))
    }

    /// Flights in progress.
    pub fn len(&self) -> usize {
        self.flights.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// Whether no flight is in progress.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

async fn drive(flights: Arc<Flights>, key: String, flight: Arc<Flight>, mut stream: TokenStream) {
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
    let mut flights = flights.flights.lock().unwrap_or_else(|p| p.into_inner());
    if flights.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
        flights.remove(&key);
    }
}
