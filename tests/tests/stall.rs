//! No client can stall the server, tried against a real `levee` process:
//! - clients looping 4 MB prompts and chat messages (and 1 MB texts to
//!   tokenize) beside a `/health` probe and a short generation: the probe
//!   answers within 100 ms, the generation keeps its unloaded latency;
//! - 1,000 slowloris and 1,000 idle keep-alive connections: closed within
//!   the header-read timeout, `/health` within 100 ms throughout, the
//!   server's open descriptors back to their baseline;
//! - SIGTERM with a half-sent request and idle connections open: exit 0
//!   within a second of the last in-flight response;
//! - a body that pauses or trickles (408), a chunked body over the limit
//!   (413), a client that never reads its answer (disconnected), a
//!   connection past `max-connections` (503; a liveness probe still 200);
//! - a stream still running when the shutdown grace is over ends with an
//!   error event and `[DONE]`, not mid-way.

use levee_tests::{Replica, exclusive};
use reqwest::Client;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BIN: &str = env!("CARGO_BIN_EXE_levee-replica");

/// One `/health` round trip on a fresh connection.
async fn probe(http: &Client, replica: &Replica) -> Duration {
    let started = Instant::now();
    let response = http.get(replica.url("/health")).send().await.expect("/health answers");
    assert_eq!(response.status(), 200);
    started.elapsed()
}

/// A short greedy generation, and how long it took.
async fn generation(http: &Client, replica: &Replica) -> Duration {
    let started = Instant::now();
    let body = json!({ "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": true });
    let response = http.post(replica.url("/v1/completions")).json(&body).send().await.expect("generation");
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["usage"]["completion_tokens"], 16, "{body}");
    started.elapsed()
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

/// Open descriptors of process `pid`.
fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).expect("/proc/PID/fd")
}

/// A client that never keeps a connection, so each probe is a fresh one.
fn fresh_client() -> Client {
    Client::builder().pool_max_idle_per_host(0).build().expect("client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_in_a_loop_slow_neither_probes_nor_generations() {
    let _model = exclusive().await;
    let replica = Replica::start(BIN, "").await;
    let http = fresh_client();
    for _ in 0..2 {
        generation(&http, &replica).await; // warm
    }
    let mut unloaded = Vec::new();
    for _ in 0..5 {
        unloaded.push(generation(&http, &replica).await);
    }
    let unloaded = median(unloaded);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let word = "a".repeat(4_000_000);
    let mut hogs = Vec::new();
    for i in 0..4 {
        let (http, stop) = (fresh_client(), stop.clone());
        let (route, body, param) = match i {
            0 | 1 => (replica.url("/v1/completions"), json!({ "prompt": word, "max_tokens": 4 }), "prompt"),
            2 => (
                replica.url("/v1/chat/completions"),
                json!({ "messages": [{ "role": "user", "content": word }] }),
                "messages",
            ),
            // Tokenizing has no context limit: this one is real work, on the pool.
            _ => (replica.url("/tokenize"), json!({ "prompt": word[..1_000_000] }), ""),
        };
        let body = body.to_string();
        hogs.push(tokio::spawn(async move {
            let mut sent = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let response = http
                    .post(&route)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .expect("a huge request is answered");
                let status = response.status().as_u16();
                let answer: Value = response.json().await.expect("json");
                if route.ends_with("/tokenize") {
                    assert_eq!(status, 200);
                } else {
                    assert_eq!(status, 400, "{answer}");
                    assert_eq!(answer["error"]["param"], param);
                    assert_eq!(answer["error"]["code"], "context_length_exceeded");
                }
                sent += 1;
            }
            sent
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let probes = {
        let (http, replica_url) = (fresh_client(), replica.url("/health"));
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            let mut count = 0;
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(6) {
                let t = Instant::now();
                let response = http.get(&replica_url).send().await.expect("/health");
                assert_eq!(response.status(), 200);
                worst = worst.max(t.elapsed());
                count += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (worst, count)
        })
    };
    let mut loaded = Vec::new();
    for _ in 0..5 {
        loaded.push(generation(&http, &replica).await);
    }
    let loaded = median(loaded);
    let (worst_probe, probe_count) = probes.await.expect("probes");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut huge = 0;
    for hog in hogs {
        huge += hog.await.expect("hog");
    }
    println!(
        "{huge} huge requests beside {probe_count} probes: worst /health {worst_probe:?}; \
         16-token generation {unloaded:?} unloaded, {loaded:?} loaded ({:.2}x)",
        loaded.as_secs_f64() / unloaded.as_secs_f64()
    );
    assert!(huge >= 8, "the hogs sent only {huge} requests");
    assert!(worst_probe < Duration::from_millis(100), "a /health probe took {worst_probe:?}");
    assert!(
        loaded.as_secs_f64() <= unloaded.as_secs_f64() * 1.5 + 0.05,
        "generation took {loaded:?} under load, {unloaded:?} without"
    );
}

/// Sends a request's first header line, then one more header line every
/// 500 ms, never ending the head; returns when the server closes the
/// connection, with the time it stayed open.
async fn slowloris(port: u16) -> Duration {
    let started = Instant::now();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    let _ = stream.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: levee\r\n").await;
    let mut buf = [0u8; 256];
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            },
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if stream.write_all(b"X-Slow: 1\r\n").await.is_err() {
                    return started.elapsed();
                }
            }
        }
    }
}

/// Makes one request on a kept-alive connection, then idles; returns when
/// the server closes it, with the time it stayed idle.
async fn idle_keep_alive(port: u16) -> Duration {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    stream.write_all(b"GET /health HTTP/1.1\r\nHost: levee\r\n\r\n").await.expect("request");
    let mut response = Vec::new();
    let mut buf = [0u8; 1024];
    while !response.ends_with(b"ok") {
        let n = stream.read(&mut buf).await.expect("response");
        assert!(n > 0, "closed before the response");
        response.extend_from_slice(&buf[..n]);
    }
    let idle = Instant::now();
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return idle.elapsed(),
            Ok(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_and_idle_connections_are_closed_and_never_block_probes() {
    let _model = exclusive().await;
    const TIMEOUT_SECS: f64 = 2.0;
    let replica =
        Replica::start(BIN, &format!("[server]\nheader-read-timeout-secs = {TIMEOUT_SECS}\nmax-connections = 4096\n"))
            .await;
    let port: u16 = replica.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let http = fresh_client();
    probe(&http, &replica).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = open_files(replica.pid());

    // /health is probed, and the server's descriptors counted, from before
    // the first connection until after the last has timed out.
    let prober = {
        let (http, health, pid) = (http.clone(), replica.url("/health"), replica.pid());
        tokio::spawn(async move {
            let (mut worst, mut worst_at, mut peak) = (Duration::ZERO, Duration::ZERO, 0);
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs_f64(TIMEOUT_SECS + 3.5) {
                let at = started.elapsed();
                let sent = Instant::now();
                let response = http.get(&health).send().await.expect("/health answers");
                assert_eq!(response.status(), 200);
                if sent.elapsed() > worst {
                    (worst, worst_at) = (sent.elapsed(), at);
                }
                peak = peak.max(open_files(pid));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (worst, worst_at, peak)
        })
    };
    // The connections open over half a second (an attacker's pace, not one
    // instant SYN burst that would queue the probe behind 2,000 connects).
    let mut slow = Vec::new();
    let mut idle = Vec::new();
    for i in 0..1000 {
        slow.push(tokio::spawn(slowloris(port)));
        idle.push(tokio::spawn(idle_keep_alive(port)));
        if i % 20 == 19 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let (worst, worst_at, peak) = prober.await.expect("prober");
    let mut slow_open = Vec::new();
    for task in slow {
        slow_open.push(tokio::time::timeout(Duration::from_secs(10), task).await.expect("closed").expect("task"));
    }
    let mut idle_open = Vec::new();
    for task in idle {
        idle_open.push(tokio::time::timeout(Duration::from_secs(10), task).await.expect("closed").expect("task"));
    }
    let (slowest, longest_idle) = (slow_open.iter().max().copied(), idle_open.iter().max().copied());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = open_files(replica.pid());
    let metrics = http.get(replica.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    let timed_out = levee_tests::metric(&metrics, "levee_connections_timed_out_total").unwrap_or(0.0);
    println!(
        "1000 slowloris + 1000 idle: descriptors {baseline} -> peak {peak} -> {after}; slowloris open at most \
         {slowest:?}, idle at most {longest_idle:?}; worst /health {worst:?} (at {worst_at:?}); {timed_out} timed out"
    );
    assert!(peak >= baseline + 1500, "the connections never reached the server ({peak} descriptors)");
    let bound = Duration::from_secs_f64(TIMEOUT_SECS + 1.5);
    assert!(slowest.is_some_and(|d| d <= bound), "a slowloris connection stayed open {slowest:?}");
    assert!(longest_idle.is_some_and(|d| d <= bound), "an idle connection stayed open {longest_idle:?}");
    assert!(worst < Duration::from_millis(100), "a /health probe took {worst:?}");
    assert!(after <= baseline + 2, "descriptors did not return to their baseline: {baseline} -> {after}");
    assert!(timed_out >= 2000.0, "{timed_out} connections counted as timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_half_sent_and_idle_connections_exits_right_after_the_last_response() {
    let _model = exclusive().await;
    let mut replica = Replica::start_with(BIN, "", &["--shutdown-grace-secs", "30"]).await;
    let port: u16 = replica.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let http = fresh_client();

    // An idle keep-alive connection, a request with half its headers, and
    // one with its headers and half its body.
    let idle = tokio::spawn(idle_keep_alive(port));
    let mut half_head = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    half_head.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: levee\r\n").await.expect("write");
    let mut half_body = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    half_body
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: levee\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":")
        .await
        .expect("write");
    // A stream in flight.
    let body =
        json!({ "prompt": "Count to twenty:", "max_tokens": 48, "temperature": 0, "ignore_eos": true, "stream": true });
    let mut response = http.post(replica.url("/v1/completions")).json(&body).send().await.expect("stream");
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.expect("first chunk");
    assert!(first.is_some());

    let pid = replica.pid().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let mut text = String::from_utf8_lossy(&first.unwrap_or_default()).into_owned();
    while let Some(chunk) = response.chunk().await.expect("the stream finishes") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let last_response = Instant::now();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let status = loop {
        if let Some(status) = replica.child().try_wait().expect("wait") {
            break status;
        }
        assert!(last_response.elapsed() < Duration::from_secs(10), "levee did not exit");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let exit_after = last_response.elapsed();
    // The half-sent body was answered 503 on the signal, or its connection closed.
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(1), half_body.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    println!("exit {status} {exit_after:?} after the last response; half-sent body got {:?}", answer.lines().next());
    assert!(status.success(), "levee exited with {status}");
    assert!(exit_after < Duration::from_secs(1), "exit came {exit_after:?} after the last response");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(tokio::time::timeout(Duration::from_secs(1), idle).await.is_ok(), "the idle connection stayed open");
    drop(half_head);
}

/// Reads what the server sends until it closes, or `limit` passes.
async fn answer(stream: &mut TcpStream, limit: Duration) -> String {
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(limit, stream.read_to_end(&mut bytes)).await;
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_non_reading_clients_and_excess_connections_are_answered_and_closed() {
    let _model = exclusive().await;
    let replica = Replica::start(
        BIN,
        "[server]\nmax-connections = 8\nbody-read-timeout-secs = 1\nmin-body-bytes-per-sec = 1000\n\
         write-timeout-secs = 1\nmax-body-bytes = 4194304\n",
    )
    .await;
    let port: u16 = replica.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
    let head = |length: &str| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: levee\r\ncontent-type: application/json\r\n{length}\r\n\r\n")
    };

    // A body that stops: 408 after the pause.
    let mut paused = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    paused.write_all(format!("{}{{\"prompt\"", head("content-length: 100")).as_bytes()).await.expect("write");
    let started = Instant::now();
    let reply = answer(&mut paused, Duration::from_secs(5)).await;
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("request_timeout"), "{reply}");
    assert!(started.elapsed() < Duration::from_secs(3), "408 after {:?}", started.elapsed());

    // A body that trickles (200 bytes/s against a minimum of 1000): 408 soon after the first second.
    let mut trickle = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    trickle.write_all(head("content-length: 60000").as_bytes()).await.expect("write");
    let started = Instant::now();
    let reply = loop {
        if trickle.write_all(&[b' '; 100]).await.is_err() {
            break answer(&mut trickle, Duration::from_secs(1)).await;
        }
        let mut buf = [0u8; 512];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), trickle.read(&mut buf)).await {
            let mut reply = String::from_utf8_lossy(&buf[..n]).into_owned();
            reply.push_str(&answer(&mut trickle, Duration::from_secs(1)).await);
            break reply;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the trickling body was never refused");
    };
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(started.elapsed() < Duration::from_secs(4), "408 after {:?}", started.elapsed());

    // A chunked body past the limit: 413.
    let mut chunked = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    chunked.write_all(head("transfer-encoding: chunked").as_bytes()).await.expect("write");
    let piece = format!("10000\r\n{}\r\n", " ".repeat(0x10000));
    for _ in 0..80 {
        if chunked.write_all(piece.as_bytes()).await.is_err() {
            break;
        }
    }
    let reply = answer(&mut chunked, Duration::from_secs(5)).await;
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");

    // A client that asks for a large answer and never reads it: closed
    // after the write timeout (only the metrics connection stays open).
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("small receive buffer");
    let mut stalled = socket.connect(([127, 0, 0, 1], port).into()).await.expect("connect");
    let text = "a b c d e f g h ".repeat(200_000);
    let body = json!({ "prompt": text }).to_string();
    let request = format!(
        "POST /tokenize HTTP/1.1\r\nHost: levee\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stalled.write_all(request.as_bytes()).await.expect("send the request");
    let http = fresh_client();
    let started = Instant::now();
    let open = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let metrics = http.get(replica.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
        let open = levee_tests::metric(&metrics, "levee_connections_open").unwrap_or(-1.0);
        if open <= 1.0 || started.elapsed() > Duration::from_secs(15) {
            break open;
        }
    };
    println!("a non-reading client was disconnected after {:?}", started.elapsed());
    assert_eq!(open, 1.0, "the non-reading client's connection stayed open");
    drop(stalled);

    // Past max-connections: 503 with Retry-After, and the connection closed.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(TcpStream::connect(("127.0.0.1", port)).await.expect("connect"));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    extra.write_all(b"GET /v1/models HTTP/1.1\r\nHost: levee\r\n\r\n").await.expect("write");
    let reply = answer(&mut extra, Duration::from_secs(3)).await;
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    assert!(reply.to_ascii_lowercase().contains("retry-after: 1"), "{reply}");
    assert!(reply.contains("too many open connections"), "{reply}");
    // A liveness probe past the bound is still told the process is alive.
    let mut liveness = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
    liveness.write_all(b"GET /health HTTP/1.1\r\nHost: levee\r\n\r\n").await.expect("write");
    let reply = answer(&mut liveness, Duration::from_secs(3)).await;
    assert!(reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"), "{reply}");
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    probe(&http, &replica).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_still_running_when_the_grace_is_over_ends_with_an_error_event() {
    let _model = exclusive().await;
    let mut replica = Replica::start_with(BIN, "", &["--shutdown-grace-secs", "1"]).await;
    let http = fresh_client();
    let body = json!({ "prompt": "Tell me a story.", "max_tokens": 1000, "temperature": 0, "ignore_eos": true, "stream": true });
    let mut response = http.post(replica.url("/v1/completions")).json(&body).send().await.expect("stream");
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    if let Some(chunk) = response.chunk().await.expect("first chunk") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let pid = replica.pid().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let signalled = Instant::now();
    while let Ok(Some(chunk)) = response.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let ended = signalled.elapsed();
    let status = loop {
        if let Some(status) = replica.child().try_wait().expect("wait") {
            break status;
        }
        assert!(signalled.elapsed() < Duration::from_secs(10), "levee did not exit");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    println!("cut after {ended:?}, {} events, exit {status} after {:?}", events.len(), signalled.elapsed());
    assert!(status.success(), "levee exited with {status}");
    assert_eq!(events.last().copied(), Some("[DONE]"), "{text}");
    let error: Value = serde_json::from_str(events[events.len() - 2]).expect("an error event before [DONE]");
    assert_eq!(error["error"]["type"], "service_unavailable", "{error}");
    assert!(
        ended >= Duration::from_secs(1) && ended < Duration::from_secs(3),
        "the stream ended {ended:?} after SIGTERM"
    );
}
