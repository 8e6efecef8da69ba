//! Graceful shutdown of the real binary: on SIGTERM the listener closes,
//! a request in flight streams to its end, and the process exits 0 within
//! the grace period.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/SmolLM2-135M-Instruct.Q4_1.gguf");

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

#[tokio::test]
async fn sigterm_finishes_the_request_in_flight_then_exits_zero() {
    assert!(std::path::Path::new(MODEL).exists(), "{MODEL} is missing: run scripts/setup.sh first");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["serve", "--model", MODEL, "--listen", &format!("127.0.0.1:{port}"), "--threads", "1"])
        .args(["--shutdown-grace-secs", "20"])
        .env("LEVEE_LOG", "warn")
        .env_remove("LEVEE_CONFIG")
        .current_dir(std::env::temp_dir())
        .stdout(Stdio::null())
        .spawn()
        .expect("start levee");
    let mut server = Server(child);
    let http = reqwest::Client::new();
    let started = Instant::now();
    while http.get(format!("{base}/ready")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
        assert!(started.elapsed() < Duration::from_secs(60), "levee never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut response = http
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({ "prompt": "Write a story about a lighthouse.", "max_tokens": 40, "temperature": 0, "stream": true }))
        .send()
        .await
        .expect("streaming request");
    let first = response.chunk().await.expect("first chunk").expect("some bytes");
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));

    let pid = server.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let signalled = Instant::now();

    let mut rest = String::new();
    while let Some(chunk) = response.chunk().await.expect("the stream continues after SIGTERM") {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(rest.trim_end().ends_with("data: [DONE]"), "the request in flight did not finish: {rest}");

    // New connections are no longer accepted.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(http.get(format!("{base}/health")).send().await.is_err(), "the listener is still open after SIGTERM");

    let status = loop {
        if let Some(status) = server.0.try_wait().expect("wait") {
            break status;
        }
        assert!(signalled.elapsed() < Duration::from_secs(25), "levee did not exit within the grace period");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "levee exited with {status}");
}
