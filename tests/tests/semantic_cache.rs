//! The semantic-cache reference plugin through the real server, with the
//! host's real embedding model: a paraphrase is served from the cache, an
//! unrelated prompt is generated.

use levee_tests::{TestServer, config, exclusive, guests, plugin};
use reqwest::Client;
use serde_json::{Value, json};
use std::time::Duration;

async fn chat(http: &Client, server: &TestServer, question: &str) -> (reqwest::header::HeaderMap, Value) {
    let response = http
        .post(server.url("/v1/chat/completions"))
        .json(&json!({ "messages": [{ "role": "user", "content": question }], "max_tokens": 12, "temperature": 0 }))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    (headers, response.json().await.expect("json"))
}

#[tokio::test]
async fn a_paraphrase_hits_and_an_unrelated_prompt_misses() {
    let _model = exclusive().await;
    let mut config = config("");
    config.plugins = vec![plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.85 }))];
    let server = TestServer::start(config).await;
    let http = Client::new();

    let (headers, first) = chat(&http, &server, "What is the capital of France?").await;
    assert!(!headers.contains_key("x-levee-cache"));
    // `completed` stores the response off the response path: wait for it.
    let mut hit = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (headers, body) = chat(&http, &server, "What's the capital city of France?").await;
        if headers.contains_key("x-levee-cache") {
            hit = Some((headers, body));
            break;
        }
    }
    let (headers, body) = hit.expect("the paraphrase was never served from the cache");
    let similarity: f32 = headers["x-levee-cache-similarity"].to_str().unwrap().parse().unwrap();
    assert!(similarity >= 0.85, "similarity {similarity}");
    assert_eq!(body["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
    println!("paraphrase similarity: {similarity}");

    let (headers, _) = chat(&http, &server, "How do I bake sourdough bread?").await;
    assert!(!headers.contains_key("x-levee-cache"), "an unrelated prompt was served from the cache");
}
