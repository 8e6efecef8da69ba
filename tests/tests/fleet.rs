//! Replicas as one service: real `levee` processes sharing one Redis.
//! - coalescing across replicas (one generation in the fleet), and a
//!   follower finishing the work when the generating replica is killed;
//! - the fleet-wide scale decision, the same on every replica, along a
//!   traffic trace;
//! - drain on SIGTERM during a burst.

use levee_tests::{RedisServer, Replica, exclusive, guests, metric};
use reqwest::Client;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_levee-replica");

fn shared(redis: &RedisServer) -> String {
    format!(
        "[shared-state]\nbackend = \"redis\"\nredis-url = \"{}\"\ntimeout-ms = 500\nretry-interval-ms = 200\nfollow-timeout-ms = 1500\n",
        redis.url()
    )
}

async fn metrics(http: &Client, replica: &Replica) -> String {
    http.get(replica.url("/metrics")).send().await.expect("metrics").text().await.expect("text")
}

async fn sequences(http: &Client, replica: &Replica) -> f64 {
    metric(&metrics(http, replica).await, "levee_engine_sequences_started_total").unwrap_or(0.0)
}

async fn complete(http: &Client, replica: &Replica, body: &Value) -> Result<Value, String> {
    let response =
        http.post(replica.url("/v1/completions")).json(body).send().await.map_err(|e| format!("send: {e}"))?;
    let status = response.status().as_u16();
    let body: Value = response.json().await.map_err(|e| format!("body: {e}"))?;
    if status != 200 {
        return Err(format!("status {status}: {body}"));
    }
    Ok(body)
}

#[tokio::test]
async fn identical_requests_on_different_replicas_share_one_generation() {
    let _model = exclusive().await;
    let redis = RedisServer::start();
    let toml = format!("{}[[plugins]]\nname = \"coalesce\"\npath = {:?}\n", shared(&redis), guests::COALESCE);
    let a = Replica::start(BIN, &toml).await;
    let b = Replica::start(BIN, &toml).await;
    let http = Client::new();
    let body = json!({ "prompt": "The harbour at night was quiet, and the old fisherman", "max_tokens": 24, "temperature": 0 });

    let before = sequences(&http, &a).await + sequences(&http, &b).await;
    let replies = futures::future::join_all((0..6).map(|i| {
        let (http, body) = (http.clone(), body.clone());
        let replica = if i % 2 == 0 { &a } else { &b };
        async move { complete(&http, replica, &body).await }
    }))
    .await;
    // The engine's counters are published at the end of its step: let them settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = sequences(&http, &a).await + sequences(&http, &b).await;
    let texts: Vec<String> = replies
        .into_iter()
        .map(|r| r.expect("every client gets its response")["choices"][0]["text"].to_string())
        .collect();
    assert!(texts.iter().all(|t| t == &texts[0]), "coalesced responses differ: {texts:?}");
    assert!(texts[0].len() > 10, "the shared generation is empty: {}", texts[0]);
    assert_eq!(after - before, 1.0, "6 identical requests over 2 replicas ran {} generations", after - before);
    let followed = metric(&metrics(&http, &a).await, "levee_flights_followed_total").unwrap_or(0.0)
        + metric(&metrics(&http, &b).await, "levee_flights_followed_total").unwrap_or(0.0);
    assert!(followed >= 1.0, "no replica followed the other's generation");
    println!("6 identical requests on 2 replicas: 1 generation; {} chars each", texts[0].len());
}

#[tokio::test]
async fn a_follower_finishes_the_work_when_the_generating_replica_dies() {
    let _model = exclusive().await;
    let redis = RedisServer::start();
    let toml = format!("{}[[plugins]]\nname = \"coalesce\"\npath = {:?}\n", shared(&redis), guests::COALESCE);
    let mut a = Replica::start(BIN, &toml).await;
    let b = Replica::start(BIN, &toml).await;
    let http = Client::new();
    let body = json!({ "prompt": "Once upon a time, in a small village by the sea, there lived a lighthouse keeper who", "max_tokens": 300, "temperature": 0 });

    // a starts the generation and owns the flight.
    let owner = {
        let (http, body, url) = (http.clone(), body.clone(), a.url("/v1/completions"));
        tokio::spawn(async move { http.post(url).json(&body).send().await.map(|_| ()) })
    };
    let started = Instant::now();
    while sequences(&http, &a).await < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(20), "replica a never started generating");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // b follows it, then a is killed mid-generation.
    let follower = {
        let (http, body) = (http.clone(), body.clone());
        let url = b.url("/v1/completions");
        tokio::spawn(async move {
            let response = http.post(url).json(&body).send().await.map_err(|e| e.to_string())?;
            let status = response.status().as_u16();
            let body: Value = response.json().await.map_err(|e| e.to_string())?;
            if status == 200 { Ok(body) } else { Err(format!("status {status}: {body}")) }
        })
    };
    while metric(&metrics(&http, &b).await, "levee_flights_followed_total").unwrap_or(0.0) < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(20), "replica b never followed a's generation");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = a.child().kill();
    let killed = Instant::now();
    let _ = owner.await;
    let followed = tokio::time::timeout(Duration::from_secs(60), follower)
        .await
        .expect("the follower finished in time")
        .expect("task")
        .expect("the follower's client got a full response");
    let finished_after = killed.elapsed();
    assert!(followed["usage"]["completion_tokens"].as_u64().unwrap() > 50, "{followed}");
    let text = followed["choices"][0]["text"].as_str().unwrap().to_string();
    let text_metrics = metrics(&http, &b).await;
    assert_eq!(metric(&text_metrics, "levee_flights_taken_over_total"), Some(1.0), "{text_metrics}");

    // The same request generated by b alone gives the same text.
    let alone = complete(&http, &b, &body).await.expect("reference generation");
    assert_eq!(text, alone["choices"][0]["text"].as_str().unwrap(), "the taken-over response is not the full one");
    assert_eq!(followed["usage"]["completion_tokens"], alone["usage"]["completion_tokens"]);
    println!(
        "owner killed: follower finished {:.1} s later with all {} tokens",
        finished_after.as_secs_f64(),
        alone["usage"]["completion_tokens"]
    );
}

/// What `/v1/scaling` said at one moment, on each replica.
#[derive(Debug)]
struct Poll {
    at: f64,
    phase: &'static str,
    sent_rate: f64,
    decisions: Vec<(u64, u64, String)>,
}

#[tokio::test]
async fn the_fleet_scales_on_one_decision_along_a_traffic_trace() {
    let _model = exclusive().await;
    let redis = RedisServer::start();
    let toml = format!(
        "{}[scaling]\ninterval-ms = 250\nwindow-secs = 1.0\nwarmup-secs = 1.0\n\n[[plugins]]\nname = \"autoscale\"\npath = {:?}\n[plugins.config]\nmin-replicas = 1\nmax-replicas = 8\nreplica-throughput = 4.0\ntarget-utilization = 0.8\ntarget-latency-p95-ms = 60000\ntarget-ttft-p95-ms = 60000\nscale-up-stabilization-secs = 2.5\nscale-down-stabilization-secs = 3.0\nscale-down-cooldown-secs = 3.0\n",
        shared(&redis),
        guests::AUTOSCALE
    );
    let replicas =
        vec![Replica::start(BIN, &toml).await, Replica::start(BIN, &toml).await, Replica::start(BIN, &toml).await];
    let http = Client::new();
    let urls: Vec<String> = replicas.iter().map(|r| r.url("/v1/completions")).collect();

    // The trace: (phase, seconds, requests per second at start, at end).
    let trace: [(&'static str, f64, f64, f64); 4] =
        [("settle", 9.0, 1.0, 1.0), ("spike", 0.4, 24.0, 24.0), ("ramp", 9.0, 1.0, 14.0), ("decline", 12.0, 2.0, 1.0)];
    let origin = Instant::now();
    let sender = {
        let (http, urls) = (http.clone(), urls.clone());
        tokio::spawn(async move {
            let mut sent = 0usize;
            let mut in_flight = Vec::new();
            for (_, secs, from, to) in trace {
                let phase_start = Instant::now();
                let mut debt = 0.0;
                while phase_start.elapsed().as_secs_f64() < secs {
                    let f = phase_start.elapsed().as_secs_f64() / secs;
                    debt += (from + (to - from) * f) * 0.05;
                    while debt >= 1.0 {
                        debt -= 1.0;
                        let (http, url) = (http.clone(), urls[sent % urls.len()].clone());
                        sent += 1;
                        in_flight.push(tokio::spawn(async move {
                            let body = json!({ "prompt": format!("Say hello to visitor {sent}."), "max_tokens": 1, "temperature": 0 });
                            http.post(url).json(&body).send().await.map(|r| r.status().as_u16()).unwrap_or(0)
                        }));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let statuses = futures::future::join_all(in_flight).await;
            statuses.into_iter().filter(|s| matches!(s, Ok(200))).count()
        })
    };

    let phase_at = |t: f64| -> (&'static str, f64) {
        let mut start = 0.0;
        for (phase, secs, from, to) in trace {
            if t < start + secs {
                return (phase, from + (to - from) * (t - start) / secs);
            }
            start += secs;
        }
        ("after", 0.0)
    };
    let total: f64 = trace.iter().map(|p| p.1).sum();
    let mut polls = Vec::new();
    while origin.elapsed().as_secs_f64() < total + 1.0 {
        let at = origin.elapsed().as_secs_f64();
        let mut decisions = Vec::new();
        for replica in &replicas {
            let d: Value =
                http.get(replica.url("/v1/scaling")).send().await.expect("scaling").json().await.expect("json");
            decisions.push((
                d["tick"].as_u64().unwrap_or(0),
                d["desiredReplicas"].as_u64().unwrap_or(0),
                d["reason"].as_str().unwrap_or_default().to_string(),
            ));
            assert_eq!(d["fleet"], true, "{d}");
        }
        let (phase, sent_rate) = phase_at(at);
        polls.push(Poll { at, phase, sent_rate, decisions });
        tokio::time::sleep(Duration::from_millis(125)).await;
    }
    let answered = sender.await.expect("sender");
    assert!(answered > 50, "only {answered} requests answered");

    // Every replica serves the leader's decision, at most one tick behind.
    for poll in &polls {
        let ticks: Vec<u64> = poll.decisions.iter().map(|d| d.0).collect();
        let (lo, hi) = (ticks.iter().min().unwrap(), ticks.iter().max().unwrap());
        assert!(hi - lo <= 1, "at {:.2} s the replicas are more than one tick apart: {ticks:?}", poll.at);
        if lo == hi {
            assert!(
                poll.decisions.iter().all(|d| d.1 == poll.decisions[0].1),
                "same tick, different decisions: {poll:?}"
            );
        }
    }
    // The decision sequence, as the first replica saw it. A decision reflects the
    // arrivals of the last window, taken at the last tick and read at the last poll,
    // so a change is put in the phase of the traffic it answered: the one running
    // `LAG` before it was seen (window 1 s + tick 0.25 s + poll 0.125 s, and slack
    // for a loaded machine). A scale-up read just after the ramp ended answers the ramp.
    const LAG: f64 = 2.0;
    let mut changes = Vec::new();
    let mut desired = polls[0].decisions[0].1;
    for poll in &polls {
        let now = poll.decisions[0].1;
        if now != desired {
            let (answers, _) = phase_at((poll.at - LAG).max(0.0));
            println!(
                "{:>6.2} s  {:<8} sent {:>5.1} req/s  answers {:<8} {} -> {}: {}",
                poll.at, poll.phase, poll.sent_rate, answers, desired, now, poll.decisions[0].2
            );
            changes.push((poll.at, answers, desired, now, poll.decisions[0].2.clone()));
            desired = now;
        }
    }
    // Settling from 3 serving replicas at 1 req/s: down one at a time, a window apart.
    let settle: Vec<_> = changes.iter().filter(|c| c.1 == "settle").collect();
    assert!(settle.iter().all(|c| c.3 + 1 == c.2), "settle: {settle:?}");
    let settled = polls.iter().rfind(|p| p.phase == "settle").expect("settle polls");
    assert_eq!(settled.decisions[0].1, 1, "1 req/s needs one replica: {:?}", settled.decisions[0]);
    for pair in settle.windows(2) {
        assert!(pair[1].0 - pair[0].0 >= 2.5, "scale-downs closer than the stabilization window: {pair:?}");
    }
    // The spike is absorbed: nothing added during it or just after.
    let spike_end = trace[0].1 + trace[1].1;
    assert!(!changes.iter().any(|c| c.3 > c.2 && c.0 < spike_end + 2.0), "the short spike was scaled for: {changes:?}");
    // The ramp is met ahead of time: a scale-up during the ramp, planned on the predicted rate.
    let ups: Vec<_> = changes.iter().filter(|c| c.3 > c.2).collect();
    assert!(ups.iter().any(|c| c.1 == "ramp"), "no scale-up during the ramp: {changes:?}");
    assert!(ups.iter().all(|c| c.4.contains("predict")), "{ups:?}");
    // The decline scales down, one replica at a time, never up.
    let decline: Vec<_> = changes.iter().filter(|c| c.1 == "decline" || c.1 == "after").collect();
    assert!(decline.iter().all(|c| c.3 + 1 == c.2), "decline must only step down by one: {decline:?}");
}

#[tokio::test]
async fn sigterm_during_a_burst_loses_no_admitted_request() {
    let _model = exclusive().await;
    let mut replica = Replica::start_with(BIN, "", &["--shutdown-grace-secs", "30"]).await;
    let http = Client::new();
    let url = replica.url("/v1/completions");
    let burst: Vec<_> = (0..24)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(25 * i)).await;
                // Streamed, so that admission is visible: the response head is
                // sent once the request is admitted, the tokens follow.
                let body = json!({
                    "prompt": format!("Describe the colour number {i}."), "max_tokens": 16, "temperature": 0, "stream": true
                });
                match http.post(url).json(&body).send().await {
                    // No response head: refused before admission (listener closed, or the
                    // connection was still in the accept queue when it closed).
                    Err(_) => Ok(None),
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let text = response.text().await.map_err(|e| format!("request {i}: stream cut short: {e}"))?;
                        match status {
                            200 if text.trim_end().ends_with("data: [DONE]") => {
                                Ok(Some(text.matches("data: {").count() as u64))
                            }
                            200 => Err(format!("request {i} was admitted but its stream did not finish: {text}")),
                            503 => Ok(None),
                            other => Err(format!("request {i}: status {other}: {text}")),
                        }
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = replica.pid().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let signalled = Instant::now();
    let mut completed = 0;
    let mut refused = 0;
    for outcome in futures::future::join_all(burst).await {
        match outcome.expect("task") {
            Ok(Some(tokens)) => {
                assert!(tokens > 0);
                completed += 1;
            }
            Ok(None) => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let status = loop {
        if let Some(status) = replica.child().try_wait().expect("wait") {
            break status;
        }
        assert!(signalled.elapsed() < Duration::from_secs(30), "levee did not exit within the grace period");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "levee exited with {status}");
    println!(
        "SIGTERM during a burst of 24: {completed} completed, {refused} refused before admission, exit after {:.1} s",
        signalled.elapsed().as_secs_f64()
    );
    assert!(completed > 0);
}
