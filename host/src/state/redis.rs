//! The Redis side of the plugins' state: key-value, token buckets (one Lua
//! script, so a take is one atomic round trip) and the vector entries that
//! every replica indexes locally, one stream per plugin (so that one
//! plugin's inserts never trim another's entries out of the stream). Keys
//! carry the plugin's name; a value is capped at the plugin's
//! `kv-max-value-bytes` before it is sent.
//!
//! Every call is bounded by a timeout. When Redis cannot be reached, the
//! failure is logged once, counted, and calls skip Redis until a background
//! probe (one ping per retry interval) finds it again; meanwhile the caller
//! applies the configured rule (fall back to the local stores, or fail).
//! Shared state resumes by itself when Redis is back. Errors that Redis
//! itself answers (a value that is not an integer, say) are the caller's,
//! never an outage.

use crate::config::{RedisErrorRule, SharedStateConfig};
use redis::aio::ConnectionManager;
use redis::streams::{StreamReadOptions, StreamReadReply};
use redis::{AsyncCommands, ErrorKind, RedisError, RedisResult, Value};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Weak;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::bucket::Take;
use super::{Failure, Pending, State, Store};

/// Takes `ARGV[3]` tokens from the bucket at `KEYS[1]` (capacity `ARGV[1]`,
/// refilled at `ARGV[2]` per second) by Redis's own clock, so that every
/// replica refills alike. A negative cost refunds, capped at the capacity.
/// Returns allowed (0/1), tokens left and seconds to wait, the last two as
/// strings (Lua numbers would be truncated to integers).
const TAKE_SCRIPT: &str = r#"
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1])
local at = tonumber(state[2])
if tokens == nil or at == nil then
  tokens = capacity
  at = now
end
tokens = math.min(capacity, tokens + math.max(0, now - at) / 1000000 * rate)
local allowed = 0
local wait = 0
if cost <= tokens then
  tokens = math.min(capacity, tokens - cost)
  allowed = 1
elseif rate > 0 then
  wait = (cost - tokens) / rate
else
  wait = -1
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at', string.format('%d', now))
local full_in_ms = 3600000
if rate > 0 then
  full_in_ms = math.ceil((capacity - tokens) / rate * 1000) + 1000
end
-- Bounded (30 days) so that extreme rates still give an integer expiry.
full_in_ms = math.min(full_in_ms, 2592000000)
redis.call('PEXPIRE', KEYS[1], full_in_ms)
return {allowed, string.format('%.17g', tokens), string.format('%.17g', wait)}
"#;

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct SharedStats {
    /// Calls that found Redis unreachable or slow.
    pub errors: AtomicU64,
    /// Vector entries indexed from other replicas.
    pub vectors_followed: AtomicU64,
}

/// One vector entry as it travels between replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct VectorEntry {
    /// Namespace (already prefixed with the plugin's name).
    pub namespace: String,
    /// The vector.
    pub vector: Vec<f32>,
    /// The payload.
    pub payload: Vec<u8>,
    /// When it expires, Unix milliseconds; 0 for never.
    pub expires_unix_ms: u64,
    /// The replica that wrote it.
    pub origin: String,
}

/// The Redis side of the shared state.
pub struct RedisState {
    client: redis::Client,
    conn: ConnectionManager,
    prefix: String,
    timeout: Duration,
    retry_interval: Duration,
    /// The rule for calls made while Redis is unreachable.
    pub rule: RedisErrorRule,
    stream_max_entries: usize,
    up: AtomicBool,
    take: redis::Script,
    /// This replica's identity in shared state.
    pub replica: String,
    /// Counters for `/metrics`.
    pub stats: SharedStats,
}

/// Unix time in milliseconds.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn replica_id() -> String {
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "levee".to_string());
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{host}-{}-{nanos:08x}", std::process::id())
}

/// Whether Redis answered (the error is the caller's) rather than failed to.
fn answered(error: &RedisError) -> bool {
    use redis::ServerErrorKind as S;
    matches!(
        error.kind(),
        ErrorKind::Server(S::ResponseError | S::ExecAbort | S::NoScript | S::CrossSlot | S::NoPerm)
            | ErrorKind::UnexpectedReturnType
            | ErrorKind::Parse
    )
}

fn stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

fn bytes(map: &HashMap<String, Value>, field: &str) -> Option<Vec<u8>> {
    match map.get(field)? {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

impl VectorEntry {
    fn fields(&self) -> Vec<(&'static str, Vec<u8>)> {
        let vector = self.vector.iter().flat_map(|x| x.to_le_bytes()).collect();
        vec![
            ("ns", self.namespace.clone().into_bytes()),
            ("vec", vector),
            ("payload", self.payload.clone()),
            ("exp", self.expires_unix_ms.to_string().into_bytes()),
            ("origin", self.origin.clone().into_bytes()),
        ]
    }

    fn parse(map: &HashMap<String, Value>) -> Option<Self> {
        let vector = bytes(map, "vec")?;
        if vector.len() % 4 != 0 {
            return None;
        }
        Some(Self {
            namespace: String::from_utf8(bytes(map, "ns")?).ok()?,
            vector: vector.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            payload: bytes(map, "payload")?,
            expires_unix_ms: String::from_utf8(bytes(map, "exp")?).ok()?.parse().ok()?,
            origin: String::from_utf8(bytes(map, "origin")?).ok()?,
        })
    }
}

impl RedisState {
    /// A client for `settings.redis-url`; connects lazily, so a Redis that is
    /// down at start is an outage like any other, not a start failure.
    pub fn new(settings: &SharedStateConfig) -> Result<Self, String> {
        let client = redis::Client::open(settings.redis_url.as_str())
            .map_err(|e| format!("shared-state.redis-url {:?}: {e}", settings.redis_url))?;
        let timeout = Duration::from_millis(settings.timeout_ms);
        let retry_interval = Duration::from_millis(settings.retry_interval_ms);
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(retry_interval)
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map_err(|e| format!("shared-state.redis-url {:?}: {e}", settings.redis_url))?;
        Ok(Self {
            client,
            conn,
            prefix: settings.key_prefix.clone(),
            timeout,
            retry_interval,
            rule: settings.on_redis_error,
            stream_max_entries: settings.vector_stream_max_entries,
            up: AtomicBool::new(true),
            take: redis::Script::new(TAKE_SCRIPT),
            replica: replica_id(),
            stats: SharedStats::default(),
        })
    }

    /// The client, for connections of their own (blocking reads).
    pub fn client(&self) -> &redis::Client {
        &self.client
    }

    /// Whether the last call reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// The full Redis key for `kind` and `key`.
    pub fn key(&self, kind: &str, key: &str) -> String {
        format!("{}{kind}:{key}", self.prefix)
    }

    fn skipping(&self) -> bool {
        !self.up.load(Ordering::Relaxed)
    }

    /// While Redis is marked unreachable, pings it every retry interval and
    /// marks it reachable once it answers, so that no request pays for the
    /// reconnection. Runs until `alive` returns false.
    pub async fn probe_while(&self, alive: impl Fn() -> bool) {
        while alive() {
            tokio::time::sleep(self.retry_interval).await;
            if self.is_up() {
                continue;
            }
            let mut conn = self.conn.clone();
            let ping = async move { redis::cmd("PING").query_async::<String>(&mut conn).await };
            if let Ok(Ok(_)) = tokio::time::timeout(self.timeout, ping).await {
                self.mark_up();
            }
        }
    }

    fn mark_down(&self, op: &str, why: &str) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if self.up.swap(false, Ordering::Relaxed) {
            tracing::warn!(op, "redis unreachable ({why}); applying shared-state.on-redis-error = {:?}", self.rule);
        }
    }

    fn mark_up(&self) {
        if !self.up.swap(true, Ordering::Relaxed) {
            tracing::info!("redis reachable again; shared state resumed");
        }
    }

    /// Runs one round trip under the timeout and the outage rules. A
    /// connection found broken (Redis restarted since the last call) is
    /// replaced and the call tried once more, within the same timeout.
    pub async fn call<T, F, Fut>(&self, op: &str, f: F) -> Result<T, Failure>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        if self.skipping() {
            return Err(Failure::Outage("redis is unreachable; retrying in the background".to_string()));
        }
        let attempt = async {
            match f(self.conn.clone()).await {
                Err(e) if e.is_connection_dropped() || e.is_unrecoverable_error() => f(self.conn.clone()).await,
                other => other,
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(value)) => {
                self.mark_up();
                Ok(value)
            }
            Ok(Err(e)) if answered(&e) => {
                self.mark_up();
                Err(Failure::Refused(format!("redis: {e}")))
            }
            Ok(Err(e)) => {
                self.mark_down(op, &e.to_string());
                Err(Failure::Outage(format!("redis: {e}")))
            }
            Err(_) => {
                let why = format!("no answer within {} ms", self.timeout.as_millis());
                self.mark_down(op, &why);
                Err(Failure::Outage(why))
            }
        }
    }

    /// `GET`.
    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, Failure> {
        let key = &self.key("kv", key);
        self.call("kv.get", |mut c| async move { c.get(key).await }).await
    }

    /// `SET`, with `PX` when `ttl_ms` > 0.
    pub async fn kv_set(&self, key: &str, value: &[u8], ttl_ms: u64) -> Result<(), Failure> {
        let key = &self.key("kv", key);
        self.call("kv.set", |mut c| async move {
            if ttl_ms > 0 { c.pset_ex(key, value, ttl_ms).await } else { c.set(key, value).await }
        })
        .await
    }

    /// `INCRBY` in one transaction with a `SET NX` that gives a new key its TTL.
    pub async fn kv_incr(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, Failure> {
        let key = &self.key("kv", key);
        let mut pipe = redis::pipe();
        pipe.atomic();
        if ttl_ms > 0 {
            pipe.cmd("SET").arg(key).arg(0).arg("NX").arg("PX").arg(ttl_ms).ignore();
        }
        pipe.cmd("INCRBY").arg(key).arg(delta);
        let pipe = &pipe;
        let (value,): (i64,) = self.call("kv.incr", |mut c| async move { pipe.query_async(&mut c).await }).await?;
        Ok(value)
    }

    /// `DEL`.
    pub async fn kv_delete(&self, key: &str) -> Result<(), Failure> {
        let key = &self.key("kv", key);
        self.call("kv.delete", |mut c| async move { c.del(key).await }).await
    }

    /// One atomic take from a shared token bucket (one script call).
    pub async fn take(&self, key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<Take, Failure> {
        let key = &self.key("bucket", key);
        let (allowed, remaining, wait): (i64, String, String) = self
            .call("token-bucket", |mut c| async move {
                self.take.key(key).arg(capacity).arg(refill_per_sec).arg(cost).invoke_async(&mut c).await
            })
            .await?;
        let number = |s: &str| s.parse::<f64>().map_err(|_| Failure::Refused(format!("redis bucket returned {s:?}")));
        let wait = number(&wait)?;
        Ok(Take {
            allowed: allowed == 1,
            remaining: number(&remaining)?,
            retry_after_secs: if wait < 0.0 { f64::INFINITY } else { wait },
        })
    }

    /// The vector stream of `plugin`.
    fn stream(&self, plugin: &str) -> String {
        format!("{}vectors:{plugin}", self.prefix)
    }

    /// Appends a vector entry to its plugin's stream, which every replica
    /// follows (trimmed, approximately, to the configured length).
    pub async fn publish_vector(&self, entry: &VectorEntry) -> Result<(), Failure> {
        let mut cmd = redis::cmd("XADD");
        let stream = self.stream(super::vectors::owner(&entry.namespace));
        cmd.arg(stream).arg("MAXLEN").arg("~").arg(self.stream_max_entries).arg("*");
        for (name, value) in entry.fields() {
            cmd.arg(name).arg(value);
        }
        let cmd = &cmd;
        let _: String = self.call("vectors.insert", |mut c| async move { cmd.query_async(&mut c).await }).await?;
        Ok(())
    }

    /// Follows every loaded plugin's vector stream from the start and
    /// indexes each live entry written by another replica into `state`'s
    /// local vectors, for as long as `state` lives. Reconnects after
    /// failures; a stream that is gone or restarted (Redis lost its data) is
    /// read again from the beginning. Plugins loaded later are picked up
    /// within a second.
    pub async fn follow_vectors(&self, state: Weak<State>) {
        let mut last: HashMap<String, String> = HashMap::new();
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(Duration::from_secs(5)));
        let mut conn = None;
        let mut checked = std::collections::HashSet::new();
        loop {
            let Some(streams) = state.upgrade().map(|s| s.local.plugins()) else { return };
            let streams: Vec<String> = streams.iter().map(|p| self.stream(p)).collect();
            if streams.is_empty() {
                tokio::time::sleep(self.retry_interval).await;
                continue;
            }
            let Some(c) = conn.as_mut() else {
                match self.client.get_multiplexed_async_connection_with_config(&config).await {
                    Ok(c) => {
                        conn = Some(c);
                        checked.clear();
                    }
                    Err(_) => tokio::time::sleep(self.retry_interval).await,
                }
                continue;
            };
            // A stream seen for the first time on this connection: start over
            // if it is behind what was read (Redis restarted without its data).
            let unchecked: Vec<&String> = streams.iter().filter(|s| !checked.contains(*s)).collect();
            for stream in unchecked {
                let newest: RedisResult<StreamRangeTail> =
                    redis::cmd("XREVRANGE").arg(stream).arg("+").arg("-").arg("COUNT").arg(1).query_async(c).await;
                if let Ok(StreamRangeTail(newest)) = newest
                    && let Some(seen) = last.get(stream)
                    && newest.as_deref().is_none_or(|id| stream_id(id) < stream_id(seen))
                {
                    last.remove(stream);
                }
                checked.insert(stream.clone());
            }
            let ids: Vec<String> =
                streams.iter().map(|s| last.get(s).cloned().unwrap_or_else(|| "0-0".into())).collect();
            let options = StreamReadOptions::default().block(1000).count(512);
            let reply: RedisResult<Option<StreamReadReply>> = c.xread_options(&streams, &ids, &options).await;
            let Ok(reply) = reply else {
                conn = None;
                tokio::time::sleep(self.retry_interval).await;
                continue;
            };
            let Some(state) = state.upgrade() else { return };
            let now = unix_ms();
            for key in reply.into_iter().flat_map(|r| r.keys) {
                for id in key.ids {
                    last.insert(key.key.clone(), id.id.clone());
                    let Some(entry) = VectorEntry::parse(&id.map) else { continue };
                    let ttl_ms = match entry.expires_unix_ms {
                        0 => 0,
                        at if at > now => at - now,
                        _ => continue,
                    };
                    // An entry counts against the plugin whose stream carries it, never another's.
                    if entry.origin == self.replica || self.stream(super::vectors::owner(&entry.namespace)) != key.key {
                        continue;
                    }
                    let inserted = state.local.vectors.insert(&entry.namespace, &entry.vector, entry.payload, ttl_ms);
                    if let Err(e) = inserted {
                        tracing::debug!("vector entry from {} not indexed: {e}", entry.origin);
                        continue;
                    }
                    self.stats.vectors_followed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Store for RedisState {
    fn kv_get<'a>(&'a self, key: &'a str) -> Pending<'a, Option<Vec<u8>>> {
        Box::pin(RedisState::kv_get(self, key))
    }

    fn kv_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl_ms: u64) -> Pending<'a, ()> {
        Box::pin(RedisState::kv_set(self, key, value, ttl_ms))
    }

    fn kv_incr<'a>(&'a self, key: &'a str, delta: i64, ttl_ms: u64) -> Pending<'a, i64> {
        Box::pin(RedisState::kv_incr(self, key, delta, ttl_ms))
    }

    fn kv_delete<'a>(&'a self, key: &'a str) -> Pending<'a, ()> {
        Box::pin(RedisState::kv_delete(self, key))
    }

    fn take<'a>(&'a self, key: &'a str, capacity: f64, refill_per_sec: f64, cost: f64) -> Pending<'a, Take> {
        Box::pin(RedisState::take(self, key, capacity, refill_per_sec, cost))
    }

    fn vector_insert<'a>(&'a self, entry: &'a VectorEntry) -> Pending<'a, ()> {
        Box::pin(self.publish_vector(entry))
    }
}

/// The id of a stream's newest entry, from `XREVRANGE … COUNT 1`.
struct StreamRangeTail(Option<String>);

impl redis::FromRedisValue for StreamRangeTail {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        let Value::Array(entries) = v else { return Ok(Self(None)) };
        let id = entries.into_iter().next().and_then(|entry| match entry {
            Value::Array(mut parts) if !parts.is_empty() => match parts.swap_remove(0) {
                Value::BulkString(b) => String::from_utf8(b).ok(),
                Value::SimpleString(s) => Some(s),
                _ => None,
            },
            _ => None,
        });
        Ok(Self(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_order_numerically() {
        assert!(stream_id("1700000000000-2") < stream_id("1700000000000-10"));
        assert!(stream_id("999-0") < stream_id("1000-0"));
        assert_eq!(stream_id("0-0"), (0, 0));
    }

    #[test]
    fn vector_entries_round_trip_through_stream_fields() {
        let entry = VectorEntry {
            namespace: "cache:m".into(),
            vector: vec![0.5, -1.25, 3.0],
            payload: b"{\"text\":\"Paris\"}".to_vec(),
            expires_unix_ms: 1_800_000_000_000,
            origin: "r1".into(),
        };
        let map: HashMap<String, Value> =
            entry.fields().into_iter().map(|(k, v)| (k.to_string(), Value::BulkString(v))).collect();
        assert_eq!(VectorEntry::parse(&map), Some(entry));
    }
}
