//! Unit tests of the degradation policy through the SDK's native harness.

use super::*;
use levee_plugin_sdk::testing::{self, Harness};

/// Five levels, each entered by a different signal.
const CONFIG: &str = r#"{
    "exit-ratio": 0.8,
    "hold-secs": 10,
    "levels": [
        { "name": "cap", "enter": { "queue-depth": 16 }, "max-tokens": 256 },
        { "name": "truncate", "enter": { "queued-tokens": 40000 }, "truncate-prompt-tokens": 1024, "max-tokens": 128 },
        { "name": "fallback", "enter": { "kv-usage": 0.9 }, "route-model": "small" },
        { "name": "loose-cache", "enter": { "latency-p95-ms": 8000 }, "cache-min-similarity": 0.8 },
        { "name": "shed", "enter": { "ttft-p95-ms": 3000 }, "shed-priority-at-least": 10, "retry-after-secs": 7 }
    ]
}"#;

fn harness() -> Harness<Degrade> {
    Harness::new(CONFIG).expect("valid configuration")
}

/// A long, generous request at `priority`.
fn request(priority: i32) -> Request {
    let mut request = testing::request("a long prompt", 3000);
    request.max_tokens = 1000;
    request.priority = priority;
    request
}

fn load(queue_depth: u32, queued_tokens: u64, kv_usage: f32, latency_p95_ms: f32, ttft_p95_ms: f32) -> Load {
    Load { queue_depth, queued_tokens, kv_usage, latency_p95_ms, ttft_p95_ms, ..Load::default() }
}

/// Whether `shaping` is the neutral answer (the SDK's records have no `PartialEq`).
fn changes_nothing(shaping: &Shaping) -> bool {
    shaping.max_tokens.is_none()
        && shaping.truncate_prompt_tokens.is_none()
        && shaping.route_model.is_none()
        && shaping.cache_min_similarity.is_none()
        && shaping.shed.is_none()
        && shaping.label.is_none()
}

fn level(plugin: &mut Harness<Degrade>, load: &Load) -> Option<String> {
    plugin.shape(&request(0), load).label
}

#[test]
fn steps_up_through_the_configured_actions_as_pressure_rises() {
    let mut plugin = harness();
    assert!(plugin.declares(Hook::Shape));
    let calm = plugin.shape(&request(0), &load(3, 1000, 0.3, 900.0, 200.0));
    assert!(changes_nothing(&calm), "{calm:?}");

    let capped = plugin.shape(&request(0), &load(20, 1000, 0.3, 900.0, 200.0));
    assert_eq!((capped.max_tokens, capped.truncate_prompt_tokens), (Some(256), None));
    assert_eq!(capped.label.as_deref(), Some("cap"));

    let truncated = plugin.shape(&request(0), &load(20, 50_000, 0.3, 900.0, 200.0));
    assert_eq!((truncated.max_tokens, truncated.truncate_prompt_tokens), (Some(128), Some(1024)));

    let routed = plugin.shape(&request(0), &load(20, 50_000, 0.95, 900.0, 200.0));
    assert_eq!(routed.route_model.as_deref(), Some("small"));
    assert_eq!(routed.max_tokens, Some(128), "earlier levels' actions stay");

    let loose = plugin.shape(&request(0), &load(20, 50_000, 0.95, 9000.0, 200.0));
    assert_eq!(loose.cache_min_similarity, Some(0.8));
    assert!(loose.shed.is_none());

    let overload = load(20, 50_000, 0.95, 9000.0, 4000.0);
    let urgent = plugin.shape(&request(0), &overload);
    assert!(urgent.shed.is_none(), "priority 0 is not the lowest priority");
    assert_eq!(urgent.label.as_deref(), Some("shed"));
    let shed = plugin.shape(&request(10), &overload).shed.expect("priority 10 is shed");
    assert_eq!((shed.status, shed.retry_after_secs), (503, Some(7)));

    assert_eq!(testing::gauge("level"), Some(5.0));
    assert_eq!(testing::counter("level_ups"), 5);
    assert_eq!(testing::counter("shed"), 1);
    assert!(testing::logs().iter().any(|l| l.contains("level 4 -> 5 (shed): p95 time to first token ms 4000 ≥ 3000")));
}

#[test]
fn a_sudden_overload_jumps_to_the_level_it_reaches() {
    let mut plugin = harness();
    assert_eq!(level(&mut plugin, &load(0, 0, 0.0, 0.0, 5000.0)).as_deref(), Some("shed"));
    assert_eq!(testing::counter("level_ups"), 1);
}

#[test]
fn steps_back_down_one_level_at_a_time_with_hysteresis() {
    let mut plugin = harness();
    // Queue depth and KV usage raise it to level 3.
    assert_eq!(level(&mut plugin, &load(20, 0, 0.95, 0.0, 0.0)).as_deref(), Some("fallback"));

    // Just under the thresholds (above 80 % of them): the level holds, however long.
    testing::advance_clock(60_000);
    assert_eq!(level(&mut plugin, &load(15, 0, 0.85, 0.0, 0.0)).as_deref(), Some("fallback"));

    // Under 80 % of level 3's threshold (KV 0.72): one step down, to level 2.
    assert_eq!(level(&mut plugin, &load(15, 0, 0.5, 0.0, 0.0)).as_deref(), Some("truncate"));
    // Level 2 was just entered: held for 10 s before the next step.
    testing::advance_clock(5_000);
    assert_eq!(level(&mut plugin, &load(0, 0, 0.0, 0.0, 0.0)).as_deref(), Some("truncate"));
    testing::advance_clock(5_000);
    assert_eq!(level(&mut plugin, &load(15, 0, 0.0, 0.0, 0.0)).as_deref(), Some("cap"));
    // Level 1 (queue depth 16) leaves only under 12.8 waiting requests.
    testing::advance_clock(10_000);
    assert_eq!(level(&mut plugin, &load(13, 0, 0.0, 0.0, 0.0)).as_deref(), Some("cap"));
    assert_eq!(level(&mut plugin, &load(12, 0, 0.0, 0.0, 0.0)), None);
    assert_eq!(testing::gauge("level"), Some(0.0));
    assert_eq!(testing::counter("level_downs"), 3);
}

#[test]
fn the_level_is_shared_by_instances_and_survives_a_reload() {
    let mut first = harness();
    level(&mut first, &load(20, 50_000, 0.0, 0.0, 0.0));
    let mut second = harness();
    let calm = load(14, 0, 0.0, 0.0, 0.0);
    assert_eq!(level(&mut second, &calm).as_deref(), Some("truncate"), "the level is in the host");
}

#[test]
fn actions_that_change_nothing_are_left_out() {
    let mut plugin = harness();
    let mut modest = testing::request("short", 10);
    modest.max_tokens = 50;
    modest.model = "small".into();
    let shaping = plugin.shape(&modest, &load(20, 50_000, 0.95, 0.0, 0.0));
    assert!(changes_nothing(&shaping), "short, modest, already on the small model: {shaping:?}");
}

#[test]
fn a_failing_store_falls_back_to_the_instance_level() {
    let mut plugin = harness();
    level(&mut plugin, &load(20, 0, 0.0, 0.0, 0.0));
    testing::fail_host_calls(Some("redis is down"));
    assert_eq!(level(&mut plugin, &load(14, 0, 0.0, 0.0, 0.0)).as_deref(), Some("cap"));
    assert!(testing::counter("store_errors") >= 1);
    testing::fail_host_calls(None);
}

#[test]
fn invalid_configuration_names_the_field_and_the_limit() {
    let refused = |config: &str| Harness::<Degrade>::new(config).err().expect("refused");
    assert!(refused(r#"{"levels": []}"#).contains("`levels` must be a list of at least one level"));
    let error = refused(r#"{"levels": [{"name": "a", "enter": {}, "max-tokens": 5}]}"#);
    assert!(error.contains("`levels[0].enter`"), "{error}");
    let error = refused(r#"{"levels": [{"name": "a", "enter": {"kv-usage": 1.5}, "max-tokens": 5}]}"#);
    assert!(error.contains("`levels[0].enter.kv-usage` must be in (0, 1], got 1.5"), "{error}");
    let error =
        refused(r#"{"exit-ratio": 1, "levels": [{"name": "a", "enter": {"queue-depth": 1}, "max-tokens": 5}]}"#);
    assert!(error.contains("`exit-ratio` must be in (0, 1), got 1"), "{error}");
    let error = refused(r#"{"levels": [{"name": "a", "enter": {"queue-depth": 1}}]}"#);
    assert!(error.contains("at least one action"), "{error}");
    let error = refused(r#"{"levels": [{"name": "a", "enter": {"queue-depth": 1}, "max-token": 5}]}"#);
    assert!(error.contains("max-token"), "{error}");
    assert!(refused("{}").contains("levels"), "levels are required");
    // The name becomes the x-levee-degraded header value.
    let error = refused(r#"{"levels": [{"name": "heavy load", "enter": {"queue-depth": 1}, "max-tokens": 5}]}"#);
    assert!(error.contains("`levels[0].name`") && error.contains("1-64 letters"), "{error}");
}
