//! Coalesced generations across replicas, through Redis. The replica that
//! first claims a flight's key (`SET NX` with a lease) generates and appends
//! every event to the flight's stream, renewing its lease; the others read
//! that stream. What the events mean is the coalescing layer's business
//! (`crate::coalesce`); this is where they travel.

use super::RedisState;
use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct FlightStats {
    /// Flights followed from another replica.
    pub followed: AtomicU64,
    /// Followed flights that had to be generated here after all.
    pub taken_over: AtomicU64,
}

/// The outcome of claiming a flight across replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This replica generates and publishes.
    Owner,
    /// Another replica generates; follow it.
    Follow,
    /// Redis is unreachable: generate here without publishing.
    Alone,
}

/// Flight streams in Redis.
pub struct FlightStreams {
    redis: Arc<RedisState>,
    lease_ms: u64,
}

/// Reads one flight's stream on a connection of its own (reads block).
pub struct FlightReader {
    conn: redis::aio::MultiplexedConnection,
}

impl FlightStreams {
    /// Streams whose owners hold a lease of `follow_timeout` (at least a second).
    pub fn new(redis: Arc<RedisState>, follow_timeout: Duration) -> Self {
        Self { redis, lease_ms: (follow_timeout.as_millis() as u64).max(1000) }
    }

    /// The stream name of the flight keyed `key` (hashed: keys may be long).
    pub fn wire_key(&self, key: &str) -> String {
        let digest = Sha256::digest(key.as_bytes());
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        self.redis.key("flight", &hex)
    }

    /// Claims `wire` for this replica.
    pub async fn claim(&self, wire: &str) -> Claim {
        let claim = format!("{wire}:owner");
        let (claim, me, lease) = (&claim, &self.redis.replica, self.lease_ms);
        let taken: Result<Option<String>, _> = self
            .redis
            .call("flight.claim", |mut c| async move {
                redis::cmd("SET").arg(claim).arg(me).arg("NX").arg("PX").arg(lease).query_async(&mut c).await
            })
            .await;
        match taken {
            Ok(Some(_)) => Claim::Owner,
            Ok(None) => Claim::Follow,
            Err(_) => Claim::Alone,
        }
    }

    /// Appends `event` and drops the claim: followers stop waiting for this replica.
    pub async fn abandon(&self, wire: &str, event: &str) {
        self.publish(wire, &[event.to_string()], true).await;
    }

    /// Appends `events` to the flight's stream and renews the owner's lease;
    /// after the last event, lets the stream expire and drops the claim.
    pub async fn publish(&self, wire: &str, events: &[String], last: bool) {
        let mut pipe = redis::pipe();
        for event in events {
            pipe.cmd("XADD").arg(wire).arg("*").arg("e").arg(event).ignore();
        }
        pipe.cmd("PEXPIRE").arg(wire).arg(self.lease_ms * 4).ignore();
        let owner = format!("{wire}:owner");
        if last {
            pipe.cmd("DEL").arg(&owner).ignore();
        } else {
            pipe.cmd("PEXPIRE").arg(&owner).arg(self.lease_ms).ignore();
        }
        let pipe = &pipe;
        let _ = self.redis.call("flight.publish", |mut c| async move { pipe.query_async::<()>(&mut c).await }).await;
    }

    /// A reader, or `None` when Redis cannot be reached.
    pub async fn reader(&self) -> Option<FlightReader> {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5)));
        let conn = self.redis.client().get_multiplexed_async_connection_with_config(&config).await.ok()?;
        Some(FlightReader { conn })
    }
}

impl FlightReader {
    /// The events of `wire` after `last` (which moves past them), waiting
    /// up to `block` for the first; each is its text, or `None` when it is
    /// not text. `Err` when the connection failed.
    pub async fn read(&mut self, wire: &str, last: &mut String, block: Duration) -> Result<Vec<Option<String>>, ()> {
        let options = StreamReadOptions::default().block(block.as_millis() as usize).count(256);
        let reply: redis::RedisResult<Option<StreamReadReply>> =
            self.conn.xread_options(&[wire], &[last.as_str()], &options).await;
        let reply = reply.map_err(|_| ())?;
        let mut events = Vec::new();
        for id in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids) {
            *last = id.id.clone();
            events.push(match id.map.get("e") {
                Some(redis::Value::BulkString(b)) => String::from_utf8(b.clone()).ok(),
                _ => None,
            });
        }
        Ok(events)
    }
}
