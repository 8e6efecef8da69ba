//! The official OpenAI Python client (`pip install openai`, done by
//! `scripts/setup.sh`) works against Levee: chat, completions, streaming,
//! `models.retrieve`, and errors raised as the client's own exception types
//! (with OpenAI's `code` and `param` for a chat over the context).

use levee_tests::{TestServer, config, exclusive};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works() {
    let _model = exclusive().await;
    let server = TestServer::start(config("")).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/openai_client.py");
    let output = tokio::process::Command::new("python3")
        .arg(script)
        .arg(&server.base)
        .output()
        .await
        .expect("python3 runs (scripts/setup.sh installs the openai package)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "openai client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("openai client: chat, completions, streaming, models and errors ok"), "{stdout}");
}
