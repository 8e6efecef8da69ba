//! The scale ticker of one server without Redis: it decides from its own
//! load, serves the decision at `/v1/scaling` and on `/metrics`, and runs the
//! command actuator when the desired count changes (rate-limited, failures
//! counted).

use levee_tests::{TempDir, TestServer, config, exclusive, guests, metric, plugin};
use reqwest::Client;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

async fn scaling_and_metrics(http: &Client, server: &TestServer) -> (Value, String) {
    let decision = http.get(server.url("/v1/scaling")).send().await.expect("scaling");
    let decision = if decision.status() == 200 { decision.json().await.expect("json") } else { Value::Null };
    let metrics = http.get(server.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    (decision, metrics)
}

#[tokio::test]
async fn the_decision_is_served_and_the_actuator_runs_on_change() {
    let _model = exclusive().await;
    let dir = TempDir::new("actuator");
    let log = dir.0.join("actuator.log");
    let mut config = config(&format!(
        "[scaling]\ninterval-ms = 100\nwarmup-secs = 5\n[scaling.actuator]\ncommand = [\"sh\", \"-c\", \"echo {{replicas}} $LEVEE_DESIRED_REPLICAS >> {}\"]\nmin-interval-secs = 0.2\n",
        log.display()
    ));
    // min-replicas 3 > the 1 replica serving: the first decision scales to 3.
    config.plugins = vec![plugin("autoscale", guests::AUTOSCALE, json!({ "min-replicas": 3, "max-replicas": 5 }))];
    let server = TestServer::start(config).await;
    let http = Client::new();

    let started = Instant::now();
    let (decision, metrics) = loop {
        let (decision, metrics) = scaling_and_metrics(&http, &server).await;
        if decision["desiredReplicas"] == 3 && log.exists() {
            break (decision, metrics);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no decision of 3 replicas: {decision}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(decision["plugin"], "autoscale");
    assert_eq!(decision["fleet"], false, "without Redis the replica decides alone");
    assert!(decision["reason"].as_str().unwrap().starts_with("scale up 1 -> 3"), "{decision}");
    assert_eq!(decision["signals"]["replicas"], 1);
    assert_eq!(decision["signals"]["warmupSecs"], 5.0);
    assert_eq!(metric(&metrics, "levee_desired_replicas"), Some(3.0));
    assert_eq!(metric(&metrics, "levee_scaling_leader"), Some(1.0));
    // The actuator ran once for the change, with the count as argument and in the environment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = std::fs::read_to_string(&log).expect("actuator log");
    assert_eq!(lines.trim(), "3 3", "{lines}");
    let (_, metrics) = scaling_and_metrics(&http, &server).await;
    assert_eq!(metric(&metrics, "levee_scaling_actuator_runs_total"), Some(1.0));
    assert_eq!(metric(&metrics, "levee_scaling_actuator_failures_total"), Some(0.0));
}

#[tokio::test]
async fn a_failing_actuator_is_counted_and_the_server_carries_on() {
    let _model = exclusive().await;
    let mut config = config(
        "[scaling]\ninterval-ms = 100\n[scaling.actuator]\ncommand = [\"levee-no-such-program\", \"{replicas}\"]\nmin-interval-secs = 0\n",
    );
    config.plugins = vec![plugin("autoscale", guests::AUTOSCALE, json!({ "min-replicas": 2, "max-replicas": 4 }))];
    let server = TestServer::start(config).await;
    let http = Client::new();
    let started = Instant::now();
    loop {
        let (_, metrics) = scaling_and_metrics(&http, &server).await;
        if metric(&metrics, "levee_scaling_actuator_failures_total").unwrap_or(0.0) >= 1.0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the failing actuator was never counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = http
        .post(server.url("/v1/completions"))
        .json(&json!({ "prompt": "Hello", "max_tokens": 1 }))
        .send()
        .await
        .expect("request");
    assert_eq!(reply.status(), 200);
}
