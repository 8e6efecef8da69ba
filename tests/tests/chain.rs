//! A chain of real plugins (built from source) through every hook, and the
//! composition rules: first reject wins, first hit wins, first key wins,
//! shapes merge conservatively, one plugin owns scale, shadow mode decides
//! nothing.

use levee::config::Mode;
use levee::plugins::bindings::{Hook, Load, Response, Usage};
use levee_tests::{guests, plugin, request, runtime_settings, start};
use serde_json::json;

fn usage() -> Usage {
    Usage {
        prompt_tokens: 3,
        completion_tokens: 1,
        ttft_ms: 1.0,
        total_ms: 2.0,
        cached: false,
        coalesced: false,
        error_status: 0,
    }
}

#[tokio::test]
async fn every_hook_is_called_and_decisions_compose() {
    let all = ["admit", "lookup", "coalesce-key", "shape", "completed", "scale"];
    let mut shadow = plugin(
        "shadow",
        guests::SCRIPTED,
        json!({ "hooks": all, "admit": { "reject": { "status": 403, "message": "shadow says no" } },
                "lookup": { "hit": "from shadow" }, "coalesce_key": "shadow-key",
                "shape": { "max_tokens": 1, "label": "shadow" }, "scale": { "desired": 9 } }),
    );
    shadow.mode = Mode::Shadow;
    let first = plugin(
        "first",
        guests::SCRIPTED,
        json!({ "hooks": all, "admit": { "allow": 5 }, "coalesce_key": "key-first",
                "shape": { "max_tokens": 50, "floor": 0.9, "label": "capped" }, "scale": { "desired": 3, "reason": "first owns scale" },
                "count": true }),
    );
    let second = plugin(
        "second",
        guests::SCRIPTED,
        json!({ "hooks": all, "admit": { "reject": { "status": 429, "retry_after": 7, "message": "over the limit" } },
                "lookup": { "hit": "cached answer", "similarity": 0.93 }, "coalesce_key": "key-second",
                "shape": { "max_tokens": 20, "truncate": 100, "route": "small-model", "floor": 0.8, "label": "routed" },
                "scale": { "desired": 5 } }),
    );
    let third =
        plugin("third", guests::SCRIPTED, json!({ "hooks": ["admit"], "admit": { "reject": { "status": 403 } } }));
    let (system, caps) = start(vec![shadow, first, second, third], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let req = request("acme", "What is the capital of France?");
    let load = Load::default();

    let refusal = chain.admit(&req, &load).await.unwrap_err();
    assert_eq!((refusal.plugin.as_str(), refusal.status, refusal.retry_after_secs), ("second", 429, Some(7)));
    assert_eq!(refusal.message, "over the limit");

    let served = chain.lookup(&req).await.unwrap().expect("second's hit");
    assert_eq!(served.plugin, "second");
    assert_eq!(served.hit.response.choices[0].text, "cached answer");
    assert!((served.hit.similarity - 0.93).abs() < 1e-6);

    assert_eq!(chain.coalesce_key(&req).await.unwrap().as_deref(), Some("key-first"));

    let shaped = chain.shape(&req, &load).await.unwrap();
    assert_eq!(shaped.max_tokens, Some(20));
    assert_eq!(shaped.truncate_prompt_tokens, Some(100));
    assert_eq!(shaped.route_model.as_deref(), Some("small-model"));
    assert_eq!(shaped.cache_min_similarity, Some(0.8));
    assert_eq!(shaped.label.as_deref(), Some("capped,routed"));

    let signals = levee_tests::signals(load);
    let (owner, decision) = chain.scale(&signals).await.expect("a scale owner");
    assert_eq!((owner.as_str(), decision.desired_replicas), ("first", 3));
    assert_eq!(decision.reason, "first owns scale");

    let response = Response { choices: Vec::new(), completion_tokens: 1 };
    chain.completed(&req, &response, &usage()).await;

    // The shadow plugin was called for every hook, and none of its decisions applied.
    let shadow = &chain.plugins()[0];
    for hook in Hook::ALL {
        assert_eq!(shadow.stats.calls(hook), 1, "shadow {hook:?}");
    }
    // Five decisions were overridden (`completed` decides nothing).
    assert_eq!(shadow.stats.shadow_overrides(), 5);
    // `third` was never asked: `second` had already rejected.
    assert_eq!(chain.plugins()[3].stats.calls(Hook::Admit), 0);

    // Host imports: `first` counted its calls in the shared key-value store and its metrics.
    for hook in all {
        assert_eq!(caps.kv_get(&format!("first:calls:{hook}")).await.unwrap().as_deref(), Some(&b"1"[..]), "{hook}");
    }
    let mut metrics = String::new();
    levee::metrics::plugins(&system.policies, &caps, &mut metrics);
    assert!(metrics.contains("levee_plugin_calls_admit{plugin=\"first\"} 1"), "{metrics}");
}

#[tokio::test]
async fn allow_keeps_the_first_priority_and_a_shed_refuses() {
    let a = plugin("a", guests::SCRIPTED, json!({ "hooks": ["admit", "shape"], "admit": { "allow": 2 } }));
    let b = plugin(
        "b",
        guests::SCRIPTED,
        json!({ "hooks": ["admit", "shape"], "admit": { "allow": 9 },
                "shape": { "shed": { "status": 503, "retry_after": 4, "message": "shedding load" } } }),
    );
    let (system, _) = start(vec![a, b], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let req = request("acme", "hello");
    assert_eq!(chain.admit(&req, &Load::default()).await.unwrap(), Some(2));
    let shed = chain.shape(&req, &Load::default()).await.unwrap_err();
    assert_eq!((shed.plugin.as_str(), shed.status, shed.retry_after_secs), ("b", 503, Some(4)));
}

#[tokio::test]
async fn token_bucket_import_limits_each_tenant_separately() {
    let limiter =
        plugin("limiter", guests::SCRIPTED, json!({ "hooks": ["admit"], "bucket": { "capacity": 3, "refill": 0.5 } }));
    let (system, _) = start(vec![limiter], runtime_settings(false)).await.unwrap();
    let chain = system.policies.snapshot();
    let load = Load::default();
    for _ in 0..3 {
        assert_eq!(chain.admit(&request("acme", "hi"), &load).await, Ok(None));
    }
    let refusal = chain.admit(&request("acme", "hi"), &load).await.unwrap_err();
    assert_eq!(refusal.status, 429);
    assert_eq!(refusal.retry_after_secs, Some(2));
    assert_eq!(chain.admit(&request("globex", "hi"), &load).await, Ok(None));
}
