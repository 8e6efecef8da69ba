//! Misbehaving guests: the host keeps serving, each fault is counted against
//! its plugin, `on-fault = open` lets the request through, `on-fault =
//! closed` refuses it with 503, an endless loop is cut at its deadline,
//! memory growth stops at the cap, and repeated faults quarantine a plugin.

use levee::config::OnFault;
use levee::plugins::bindings::{Hook, Load};
use levee::plugins::{FAULT_KINDS, PluginError};
use levee_tests::{guests, plugin, request, runtime_settings, start};
use serde_json::json;
use std::time::{Duration, Instant};

fn kind(name: &str) -> usize {
    FAULT_KINDS.iter().position(|k| *k == name).unwrap()
}

/// Runs `guest` first in a chain before a well-behaved plugin, once failing
/// open and once failing closed, and checks the outcome and the count.
async fn misbehaves(guest: &str, fault: &str) {
    let mut bad = plugin("bad", guest, json!({}));
    // A tight budget where the deadline is under test; elsewhere a loose one,
    // so that a loaded machine never turns another fault into a deadline.
    bad.time_budget_ms = if fault == "deadline" { 20.0 } else { 2000.0 };
    bad.memory_mib = 16;
    let good = plugin("good", guests::VERSION_1, json!({}));
    let (system, _) = start(vec![bad.clone(), good.clone()], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let load = Load::default();

    // Open: the request goes on to the next plugin, which still answers.
    let started = Instant::now();
    assert_eq!(chain.admit(&request("acme", "hi"), &load).await, Ok(Some(1)), "{guest}");
    let elapsed = started.elapsed();
    let stats = &chain.plugins()[0].stats;
    assert_eq!(stats.faults_by_kind()[kind(fault)], 1, "{guest}: {:?}", stats.faults_by_kind());
    assert_eq!(stats.total_faults(), 1);
    if fault == "deadline" {
        assert!(elapsed < Duration::from_millis(20 * 10), "an endless loop was cut after {elapsed:?}");
    }

    // Closed: the request is refused with 503, naming the plugin.
    bad.on_fault = OnFault::Closed;
    let (system, _) = start(vec![bad, good], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let refusal = chain.admit(&request("acme", "hi"), &load).await.unwrap_err();
    assert_eq!(refusal.status, 503);
    assert_eq!(refusal.plugin, "bad");
    assert!(refusal.message.contains("`bad`"), "{}", refusal.message);
    // The host keeps serving: the next call faults again, and is answered again.
    assert!(chain.admit(&request("acme", "hi"), &load).await.is_err());
    assert_eq!(chain.plugins()[0].stats.total_faults(), 2);
}

#[tokio::test]
async fn a_trap_is_a_fault() {
    misbehaves(guests::TRAP, "trap").await;
}

#[tokio::test]
async fn an_endless_loop_is_cut_at_its_deadline() {
    misbehaves(guests::SPIN, "deadline").await;
}

#[tokio::test]
async fn memory_growth_stops_at_the_cap() {
    misbehaves(guests::HOG, "over-memory").await;
}

#[tokio::test]
async fn a_malformed_decision_is_a_fault() {
    misbehaves(guests::MALFORMED, "malformed").await;
}

#[tokio::test]
async fn a_failing_init_refuses_the_plugin_with_its_message() {
    let err = start(vec![plugin("picky", guests::INIT_FAIL, json!({}))], runtime_settings(false)).await.err().unwrap();
    assert!(matches!(err, PluginError::Init { ref name, .. } if name == "picky"), "{err}");
    assert!(err.to_string().contains("refuses every configuration"), "{err}");
}

#[tokio::test]
async fn repeated_faults_quarantine_the_plugin() {
    let mut bad = plugin("bad", guests::TRAP, json!({}));
    bad.on_fault = OnFault::Closed;
    let (system, _) = start(vec![bad], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let stats = &chain.plugins()[0].stats;
    for _ in 0..3 {
        assert_eq!(chain.admit(&request("acme", "hi"), &Load::default()).await.unwrap_err().status, 503);
    }
    assert!(stats.quarantined());
    // Quarantined: not called any more, and still answered by its on-fault rule.
    let refusal = chain.admit(&request("acme", "hi"), &Load::default()).await.unwrap_err();
    assert!(refusal.message.contains("quarantined"), "{}", refusal.message);
    assert_eq!(stats.calls(Hook::Admit), 3);
}

#[tokio::test]
async fn a_file_that_is_not_a_component_is_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("levee-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("garbage.wasm");
    std::fs::write(&path, b"not wasm at all").unwrap();
    let err = start(vec![plugin("garbage", &path, json!({}))], runtime_settings(false)).await.err().unwrap();
    assert!(matches!(err, PluginError::Compile { .. }), "{err}");
    assert!(err.to_string().contains("garbage"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The scripted guest as the only plugin, failing open.
async fn scripted(config: serde_json::Value) -> levee::plugins::PluginSystem {
    let mut settings = runtime_settings(false);
    settings.quarantine_after = 1000;
    start(vec![plugin("bad", guests::SCRIPTED, config)], settings).await.unwrap().0
}

#[tokio::test]
async fn decisions_past_their_bounds_are_malformed_faults_not_stalls() {
    let load = Load::default();
    let malformed = |system: &levee::plugins::PluginSystem| {
        system.policies.snapshot().plugins()[0].stats.faults_by_kind()[kind("malformed")]
    };

    // A cache hit of 1 MiB (the bound is 256 KiB): a fault, answered as a miss.
    let system = scripted(json!({ "hooks": ["lookup"], "lookup": { "hit_bytes": 1 << 20 } })).await;
    assert!(system.policies.snapshot().lookup(&request("acme", "hi")).await.unwrap().is_none());
    assert_eq!(malformed(&system), 1);
    let system = scripted(json!({ "hooks": ["lookup"], "lookup": { "hit_bytes": 100 << 10 } })).await;
    assert!(system.policies.snapshot().lookup(&request("acme", "hi")).await.unwrap().is_some());

    // Labels go into a header: short tokens only.
    for label in ["x".repeat(1 << 20), "two\r\nx-forged: 1".to_string(), String::new()] {
        let system = scripted(json!({ "hooks": ["shape"], "shape": { "label": label } })).await;
        let shaping = system.policies.snapshot().shape(&request("acme", "hi"), &load).await.unwrap();
        assert_eq!(shaping.label, None);
        assert_eq!(malformed(&system), 1, "label of {} bytes", label.len());
    }
    let system = scripted(json!({ "hooks": ["shape"], "shape": { "label": "tier-2:capped" } })).await;
    let shaping = system.policies.snapshot().shape(&request("acme", "hi"), &load).await.unwrap();
    assert_eq!(shaping.label.as_deref(), Some("tier-2:capped"));

    // Rejection messages, shed messages and scale reasons reach clients: 1 KiB at most.
    let long = "m".repeat(10_000);
    let system =
        scripted(json!({ "hooks": ["admit"], "admit": { "reject": { "status": 429, "message": long } } })).await;
    assert_eq!(system.policies.snapshot().admit(&request("acme", "hi"), &load).await, Ok(None));
    assert_eq!(malformed(&system), 1);
    let system = scripted(json!({ "hooks": ["shape"], "shape": { "shed": { "status": 503, "message": long } } })).await;
    assert!(system.policies.snapshot().shape(&request("acme", "hi"), &load).await.unwrap().shed.is_none());
    assert_eq!(malformed(&system), 1);
    let system = scripted(json!({ "hooks": ["scale"], "scale": { "desired": 2, "reason": long } })).await;
    assert!(system.policies.snapshot().scale(&levee_tests::signals(load)).await.is_none());
    assert_eq!(malformed(&system), 1);
}

#[tokio::test]
async fn a_log_flood_is_cut_to_the_plugins_rate_and_counted() {
    let config = json!({ "hooks": ["admit"], "log": { "lines": 500, "text": "one\nINFO levee: forged line" } });
    let system = scripted(config).await;
    let chain = system.policies.snapshot();
    let stats = &chain.plugins()[0].stats;
    let before = stats.logs.dropped();
    assert_eq!(chain.admit(&request("acme", "hi"), &Load::default()).await, Ok(None));
    // The default rate is 20 lines a second: of 500 lines in one call, at most
    // 20 (plus what refilled meanwhile) were written, the rest counted.
    let dropped = stats.logs.dropped() - before;
    assert!((470..=480).contains(&dropped), "{dropped} lines dropped");
    assert_eq!(stats.total_faults(), 0);
}
