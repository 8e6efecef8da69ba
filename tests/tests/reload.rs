//! Hot reload: components replaced on disk while calls keep flowing, a
//! broken replacement that leaves the old version serving, and the admin
//! routes that list and reload the chain.

use levee::plugins::bindings::Load;
use levee_tests::{guests, plugin, request, runtime_settings, start};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("levee-reload-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces `target` atomically (write beside it, then rename), as deploy tools do.
fn replace(target: &Path, source: &str) {
    let staging = target.with_extension("staging");
    std::fs::copy(source, &staging).unwrap();
    std::fs::rename(&staging, target).unwrap();
}

async fn wait_for_version(policies: &levee::plugins::Policies, expected: i32) {
    for _ in 0..400 {
        let chain = policies.snapshot();
        if chain.admit(&request("probe", "hi"), &Load::default()).await == Ok(Some(expected)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("version {expected} never started serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_the_file_under_concurrent_calls_swaps_versions_without_failures() {
    let dir = scratch("swap");
    let path = dir.join("policy.wasm");
    replace(&path, guests::VERSION_1);
    // Failing closed turns any fault into a visible error. The budget is
    // generous: this test is about swapping, and on two cores the compiles
    // it triggers compete with the calls for the CPU.
    let mut versioned = plugin("versioned", &path, json!({}));
    versioned.on_fault = levee::config::OnFault::Closed;
    versioned.time_budget_ms = 1000.0;
    let (system, _) = start(vec![versioned], runtime_settings(true)).await.unwrap();
    let policies = system.policies.clone();

    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|worker| {
            let policies = policies.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    // One request = one snapshot: both calls must be answered by the same version.
                    let chain = policies.snapshot();
                    let req = request(&format!("tenant-{worker}"), "hello");
                    let first = chain
                        .admit(&req, &Load::default())
                        .await
                        .unwrap_or_else(|r| panic!("no call may fail: {}", r.message));
                    let second = chain
                        .admit(&req, &Load::default())
                        .await
                        .unwrap_or_else(|r| panic!("no call may fail: {}", r.message));
                    assert_eq!(first, second, "one request was answered by two versions");
                    seen.push(first.expect("every version sets a priority"));
                    tokio::task::yield_now().await;
                }
                seen
            })
        })
        .collect();

    for (source, version) in
        [(guests::VERSION_2, 2), (guests::VERSION_3, 3), (guests::VERSION_1, 1), (guests::VERSION_2, 2)]
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        replace(&path, source);
        wait_for_version(&policies, version).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for worker in workers {
        let seen = worker.await.unwrap();
        assert!(seen.iter().all(|v| (1..=3).contains(v)), "unexpected answers: {seen:?}");
        calls += seen.len();
    }
    assert!(calls > 100, "only {calls} calls were made during the swaps");
    // The newest version serves after the swap.
    let chain = policies.snapshot();
    assert_eq!(chain.admit(&request("acme", "hi"), &Load::default()).await, Ok(Some(2)));
    assert_eq!(
        chain.plugins()[0].version,
        levee::plugins::runtime::version_of(&std::fs::read(guests::VERSION_2).unwrap())
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_broken_replacement_leaves_the_old_version_serving() {
    let dir = scratch("broken");
    let path = dir.join("policy.wasm");
    replace(&path, guests::VERSION_1);
    let (system, _) = start(vec![plugin("versioned", &path, json!({}))], runtime_settings(false)).await.unwrap();
    let admit = || async { system.policies.snapshot().admit(&request("acme", "hi"), &Load::default()).await };

    std::fs::write(&path, b"\0asm garbage").unwrap();
    let err = system.reloader.reload().await.unwrap_err();
    assert!(err.contains("versioned") && err.contains("not a loadable"), "{err}");
    assert_eq!(admit().await, Ok(Some(1)));

    replace(&path, guests::INIT_FAIL);
    let err = system.reloader.reload().await.unwrap_err();
    assert!(err.contains("init failed") && err.contains("refuses every configuration"), "{err}");
    assert_eq!(admit().await, Ok(Some(1)));

    replace(&path, guests::VERSION_3);
    let report = system.reloader.reload().await.unwrap();
    assert_eq!(report.reloaded, vec!["versioned".to_string()]);
    assert_eq!(admit().await, Ok(Some(3)));
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn admin_routes_list_and_reload_behind_the_token() {
    let dir = scratch("admin");
    let path = dir.join("policy.wasm");
    replace(&path, guests::VERSION_1);
    let (system, caps) = start(vec![plugin("versioned", &path, json!({}))], runtime_settings(false)).await.unwrap();
    let base = levee_tests::serve_admin(&system, "s3cret").await;
    let http = reqwest::Client::new();

    let anonymous = http.get(format!("{base}/admin/plugins")).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let wrong = http.get(format!("{base}/admin/plugins")).bearer_auth("nope").send().await.unwrap();
    assert_eq!(wrong.status(), 403);

    let list: serde_json::Value =
        http.get(format!("{base}/admin/plugins")).bearer_auth("s3cret").send().await.unwrap().json().await.unwrap();
    let entry = &list["plugins"][0];
    assert_eq!(entry["name"], "versioned");
    assert_eq!(entry["hooks"], json!(["admit"]));
    assert_eq!(entry["mode"], "enforce");
    assert_eq!(entry["quarantined"], false);
    let old_version = entry["version"].as_str().unwrap().to_string();

    replace(&path, guests::VERSION_2);
    let reloaded = http.post(format!("{base}/admin/plugins/reload")).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(reloaded.status(), 200);
    let list: serde_json::Value =
        http.get(format!("{base}/admin/plugins")).bearer_auth("s3cret").send().await.unwrap().json().await.unwrap();
    assert_ne!(list["plugins"][0]["version"].as_str().unwrap(), old_version);

    std::fs::write(&path, b"broken").unwrap();
    let rejected = http.post(format!("{base}/admin/plugins/reload")).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(rejected.status(), 422);
    let body: serde_json::Value = rejected.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("versioned"), "{body}");

    let mut metrics = String::new();
    levee::metrics::plugins(&system.policies, &caps, &mut metrics);
    assert!(metrics.contains("levee_plugin_calls_total{plugin=\"versioned\",hook=\"admit\"}"), "{metrics}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_reload_that_fails_part_way_keeps_the_old_versions_quarantine() {
    let dir = scratch("quarantine");
    let (flaky_path, other_path) = (dir.join("flaky.wasm"), dir.join("other.wasm"));
    replace(&flaky_path, guests::SCRIPTED);
    replace(&other_path, guests::VERSION_1);
    let flaky = plugin("flaky", &flaky_path, json!({ "hooks": ["admit"], "fault_every": 1 }));
    let other = plugin("other", &other_path, json!({}));
    let (system, _) = start(vec![flaky, other], runtime_settings(false)).await.unwrap();
    let stats = system.policies.snapshot().plugins()[0].stats.clone();
    while !stats.quarantined() {
        let _ = system.policies.snapshot().admit(&request("acme", "hi"), &Load::default()).await;
    }
    // A new version of the flaky plugin, but the other plugin's file is broken:
    // the reload is refused as a whole, and the quarantine stays.
    replace(&flaky_path, guests::NOOP);
    std::fs::write(&other_path, b"not a component").unwrap();
    assert!(system.reloader.reload().await.is_err());
    assert!(stats.quarantined(), "a refused reload lifted the quarantine");
    // Once the whole chain loads, the new version starts afresh.
    replace(&other_path, guests::VERSION_1);
    let report = system.reloader.reload().await.unwrap();
    assert_eq!(report.reloaded, vec!["flaky".to_string()]);
    assert!(!stats.quarantined(), "the new version is still quarantined");
    let _ = std::fs::remove_dir_all(dir);
}
