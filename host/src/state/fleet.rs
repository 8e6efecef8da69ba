//! The fleet's shared board in Redis: each replica's latest report (one
//! hash), the scaling lease (one key, taken and renewed by a Lua script)
//! and the leader's latest decision. What reports and decisions contain is
//! the scaler's business (`crate::scaling`); this is where they are kept.

use super::RedisState;
use std::collections::HashMap;
use std::sync::Arc;

/// Takes or renews the scaling lease (`KEYS[1]`) for `ARGV[1]` for `ARGV[2]`
/// ms; returns 1 when the caller holds it.
const LEASE_SCRIPT: &str = r#"
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"#;

/// Gives the lease up if the caller holds it.
const RELEASE_SCRIPT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

/// What one exchange read back.
pub struct Exchanged {
    /// Every replica's report, by replica (as JSON).
    pub reports: HashMap<String, String>,
    /// Whether this replica holds the lease.
    pub leader: bool,
    /// The last published decision (as JSON).
    pub decision: Option<String>,
}

/// This replica's place on the fleet's board.
pub struct FleetBoard {
    redis: Arc<RedisState>,
}

impl FleetBoard {
    /// The board in `redis`.
    pub fn new(redis: Arc<RedisState>) -> Self {
        Self { redis }
    }

    /// This replica's identity on the board.
    pub fn replica(&self) -> &str {
        &self.redis.replica
    }

    fn keys(&self) -> (String, String, String) {
        (self.redis.key("fleet", "replicas"), self.redis.key("scale", "leader"), self.redis.key("scale", "decision"))
    }

    /// Publishes `report`, reads every replica's, takes or renews the lease
    /// for `lease_ms` (gives it up when `draining`) and reads the last
    /// decision, in one round trip. `None` when Redis is unreachable.
    pub async fn exchange(&self, report: &str, lease_ms: u64, draining: bool) -> Option<Exchanged> {
        let (fleet_key, lease_key, decision_key) = self.keys();
        let me = &self.redis.replica;
        let mut pipe = redis::pipe();
        pipe.cmd("HSET").arg(&fleet_key).arg(me).arg(report).ignore();
        pipe.cmd("HGETALL").arg(&fleet_key);
        if draining {
            pipe.cmd("EVAL").arg(RELEASE_SCRIPT).arg(1).arg(&lease_key).arg(me).ignore();
            pipe.cmd("EVAL").arg("return 0").arg(0);
        } else {
            pipe.cmd("EVAL").arg(LEASE_SCRIPT).arg(1).arg(&lease_key).arg(me).arg(lease_ms);
        }
        pipe.cmd("GET").arg(&decision_key);
        let pipe = &pipe;
        let (reports, leader, decision): (HashMap<String, String>, i64, Option<String>) =
            self.redis.call("scale.exchange", |mut c| async move { pipe.query_async(&mut c).await }).await.ok()?;
        Some(Exchanged { reports, leader: leader == 1, decision })
    }

    /// Removes the reports of `replicas` (gone quiet) from the board.
    pub async fn prune(&self, replicas: &[String]) {
        let (key, _, _) = self.keys();
        let key = &key;
        let _ = self
            .redis
            .call("fleet.prune", |mut c| async move {
                redis::cmd("HDEL").arg(key).arg(replicas).query_async::<i64>(&mut c).await
            })
            .await;
    }

    /// Publishes the leader's `decision` for `ttl_ms`.
    pub async fn publish_decision(&self, decision: &str, ttl_ms: u64) {
        let (_, _, key) = self.keys();
        let key = &key;
        let _ = self
            .redis
            .call("scale.publish", |mut c| async move {
                redis::cmd("SET").arg(key).arg(decision).arg("PX").arg(ttl_ms).query_async::<()>(&mut c).await
            })
            .await;
    }

    /// Removes this replica from the board and gives up the lease (on shutdown).
    pub async fn leave(&self) {
        let (fleet_key, lease_key, _) = self.keys();
        let me = &self.redis.replica;
        let mut pipe = redis::pipe();
        pipe.cmd("HDEL").arg(&fleet_key).arg(me).ignore();
        pipe.cmd("EVAL").arg(RELEASE_SCRIPT).arg(1).arg(&lease_key).arg(me).ignore();
        let pipe = &pipe;
        let _ = self.redis.call("fleet.leave", |mut c| async move { pipe.query_async::<()>(&mut c).await }).await;
    }
}
