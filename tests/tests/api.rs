//! The OpenAI-compatible API end to end, over real HTTP on loopback, with
//! the real default model: completions and chat, streaming and not, `n`,
//! stop sequences, seeds, usage, every error status, and the policy
//! decisions a client can see (429 + Retry-After, cache and degradation
//! headers, coalescing).

use levee_tests::{TestServer, config, exclusive, guests};
use reqwest::Client;
use serde_json::{Value, json};

async fn post(http: &Client, url: impl reqwest::IntoUrl, body: Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let response = http.post(url).json(&body).send().await.expect("request");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, headers, body)
}

/// The `data:` payloads of an SSE body.
fn sse_data(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A server whose chain is the scripted test guest, once per `(name, config)`.
async fn with_scripted(plugins: &[(&str, Value)]) -> TestServer {
    let mut config = config("");
    config.plugins = plugins.iter().map(|(name, c)| levee_tests::plugin(name, guests::SCRIPTED, c.clone())).collect();
    TestServer::start(config).await
}

#[tokio::test]
async fn completions_chat_streaming_n_stop_seed_and_usage() {
    let _model = exclusive().await;
    let server = TestServer::start(config("")).await;
    let http = Client::new();

    // A greedy completion names Paris, and its usage matches the tokenizer.
    let (status, _, body) = post(
        &http,
        server.url("/v1/completions"),
        json!({
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0
        }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    let (_, _, tokens) = post(&http, server.url("/tokenize"), json!({ "prompt": "The capital of France is" })).await;
    assert_eq!(body["usage"]["prompt_tokens"], tokens["count"]);
    let completion_tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&completion_tokens));
    assert_eq!(body["usage"]["total_tokens"].as_u64().unwrap(), tokens["count"].as_u64().unwrap() + completion_tokens);
    let (_, _, detok) = post(&http, server.url("/detokenize"), json!({ "tokens": tokens["tokens"] })).await;
    assert_eq!(detok["prompt"], "The capital of France is");

    // A stop sequence ends the text before it, with finish_reason "stop".
    let (_, _, stopped) = post(
        &http,
        server.url("/v1/completions"),
        json!({
            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stop": ["."]
        }),
    )
    .await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop", "{stopped}");
    let stopped_text = stopped["choices"][0]["text"].as_str().unwrap();
    assert!(stopped_text.contains("Paris") && !stopped_text.contains('.'), "{stopped_text:?}");

    // Chat, whole and streamed, greedy: the same text and the same usage.
    let chat = json!({ "messages": [{ "role": "user", "content": "Name a primary colour." }], "max_tokens": 12, "temperature": 0 });
    let (status, _, whole) = post(&http, server.url("/v1/chat/completions"), chat.clone()).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let mut streamed_request = chat.clone();
    streamed_request["stream"] = json!(true);
    streamed_request["stream_options"] = json!({ "include_usage": true });
    let response = http.post(server.url("/v1/chat/completions")).json(&streamed_request).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = sse_data(&response.text().await.unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed_text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["delta"]["content"].as_str())).collect();
    assert_eq!(streamed_text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["usage"], whole["usage"]);

    // n > 1 with a seed: n choices, and the same seed gives the same output.
    let sampled = json!({ "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9, "n": 3, "seed": 7 });
    let (_, _, first) = post(&http, server.url("/v1/completions"), sampled.clone()).await;
    let (_, _, again) = post(&http, server.url("/v1/completions"), sampled).await;
    assert_eq!(first["choices"].as_array().unwrap().len(), 3, "{first}");
    for (i, choice) in first["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(choice["index"], i);
    }
    assert_eq!(first["choices"], again["choices"]);

    // The operational routes.
    assert_eq!(http.get(server.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(http.get(server.url("/ready")).send().await.unwrap().status(), 200);
    let models: Value = http.get(server.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct");
    let metrics = http.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for name in [
        "levee_requests_total{route=\"/v1/completions\",status=\"200\"}",
        "levee_time_to_first_token_seconds_bucket",
        "levee_kv_cache_usage_ratio",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test]
async fn bad_input_is_refused_with_the_field_and_the_limit() {
    let _model = exclusive().await;
    let server = TestServer::start(config("[server]\nmax-body-bytes = 4096\n[[api-keys]]\nkey = \"sk-test-123\"\ntenant = \"acme\"\n\n[admin]\ntoken = \"admin-secret\"\n")).await;
    let http = Client::new();
    let url = server.url("/v1/completions");

    let anonymous = http.post(&url).json(&json!({ "prompt": "hi" })).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let wrong = http.post(&url).bearer_auth("sk-wrong-key").json(&json!({ "prompt": "hi" })).send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let admin = http.get(server.url("/admin/plugins")).bearer_auth("not-the-token").send().await.unwrap();
    assert_eq!(admin.status(), 403);

    let cases = [
        (json!({ "prompt": "hi", "temperature": 5 }), 400, "temperature"),
        (json!({ "prompt": "hi", "n": 0 }), 400, "n"),
        (json!({ "prompt": "hi", "max_tokens": 0 }), 400, "max_tokens"),
        (json!({ "prompt": "hi", "max_tokens": 1_000_000 }), 400, "max_tokens"),
        (json!({ "prompt": "hi", "top_p": "high" }), 400, "top_p"),
        (json!({ "prompt": [1, 2, 999_999] }), 400, "prompt"),
        (json!({ "prompt": "hi", "logprobs": 50 }), 400, "logprobs"),
        (json!({ "prompt": "hi", "model": "gpt-5" }), 404, "gpt-5"),
        (json!({ "prompt": "hi", "some_future_field": true }), 400, "some_future_field"),
        (json!({ "prompt": "hi", "tools": [{ "type": "function" }] }), 400, "tools"),
        (json!({ "prompt": "hi", "response_format": { "type": "json_object" } }), 400, "response_format"),
        (json!({ "prompt": "hi", "logit_bias": { "42": 100 } }), 400, "logit_bias"),
        (json!({ "prompt": "hi", "stop": ["x".repeat(2000)] }), 400, "1024 bytes"),
        (json!({ "prompt": ["hi", ""] }), 400, "prompt 1 of 2"),
        (json!({ "prompt": "hi", "repetition_penalty": 1e-30 }), 400, "repetition_penalty"),
        (json!({ "prompt": "hi", "stop_token_ids": [999_999] }), 400, "stop_token_ids"),
        (json!({ "prompt": vec!["hi"; 32], "n": 16 }), 400, "queues at most"),
    ];
    for (body, status, field) in cases {
        let response = http.post(&url).bearer_auth("sk-test-123").json(&body).send().await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{body}");
        let error: Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{body}: {message}");
        assert!(error["error"]["type"].is_string());
    }
    let huge = json!({ "prompt": "x".repeat(8000) });
    let response = http.post(&url).bearer_auth("sk-test-123").json(&huge).send().await.unwrap();
    assert_eq!(response.status(), 413);
    // Fields Levee does not implement are accepted when they ask for nothing;
    // a temperature too small to divide by decodes greedily.
    let ok = http
        .post(&url)
        .bearer_auth("sk-test-123")
        .json(&json!({
            "prompt": "hi", "max_tokens": 2, "temperature": 1e-30, "tools": [], "logit_bias": {}, "echo": false,
            "response_format": { "type": "text" }, "user": "u-1", "stop_token_ids": [2]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn a_full_queue_is_429_and_a_long_wait_is_504() {
    let _model = exclusive().await;
    let server =
        TestServer::start(config("[engine]\nmax-running = 1\nmax-queue-requests = 1\nqueue-timeout-secs = 0.5\n"))
            .await;
    let http = Client::new();
    let body = json!({ "prompt": "Write a long story about a dragon.", "max_tokens": 48, "temperature": 0 });
    let requests = (0..6).map(|_| post(&http, server.url("/v1/completions"), body.clone()));
    let answers = futures::future::join_all(requests).await;
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.iter().all(|s| [200, 429, 504].contains(s)), "{statuses:?}");
    let full = answers.iter().find(|a| a.0 == 429).expect("a full queue answers 429");
    assert!(full.1.contains_key("retry-after"));
    assert_eq!(full.2["error"]["code"], "queue_full");
    // One request queued behind a long one (200 tokens, end-of-sequence
    // ignored) waits past the half-second timeout.
    let long = post(
        &http,
        server.url("/v1/completions"),
        json!({ "prompt": "Tell me everything.", "max_tokens": 200, "temperature": 0, "ignore_eos": true }),
    );
    let short = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        post(&http, server.url("/v1/completions"), json!({ "prompt": "Hi", "max_tokens": 4 })).await
    };
    let (_, waited) = tokio::join!(long, short);
    assert_eq!(waited.0, 504, "{}", waited.2);
    assert_eq!(waited.2["error"]["code"], "queue_timeout");
}

#[tokio::test]
async fn policy_decisions_reach_the_client() {
    let _model = exclusive().await;
    let server = with_scripted(&[
        ("limit", json!({ "hooks": ["admit"], "bucket": { "capacity": 2, "refill": 0.05 } })),
        ("cache", json!({ "hooks": ["lookup"], "lookup": { "hit": "Paris, from the cache.", "similarity": 0.97 } })),
    ])
    .await;
    let http = Client::new();
    let body = json!({ "prompt": "What is the capital of France?", "max_tokens": 8 });
    let (status, headers, cached) = post(&http, server.url("/v1/completions"), body.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-levee-cache"], "hit");
    assert_eq!(headers["x-levee-cache-similarity"], "0.9700");
    assert_eq!(cached["choices"][0]["text"], "Paris, from the cache.");
    assert_eq!(server.sequences_started(), 0, "a cache hit never reaches the engine");
    let _ = post(&http, server.url("/v1/completions"), body.clone()).await;
    let (status, headers, refused) = post(&http, server.url("/v1/completions"), body).await;
    assert_eq!(status, 429, "{refused}");
    // One token comes back every 20 s.
    let retry: u32 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "retry-after {retry}");
    assert_eq!(headers["x-levee-refused-by"], "limit");

    let server =
        with_scripted(&[("degrade", json!({ "hooks": ["shape"], "shape": { "max_tokens": 3, "label": "capped" } }))])
            .await;
    let (status, headers, degraded) = post(
        &http,
        server.url("/v1/completions"),
        json!({ "prompt": "Count to ten:", "max_tokens": 20, "temperature": 0 }),
    )
    .await;
    assert_eq!(status, 200, "{degraded}");
    assert_eq!(headers["x-levee-degraded"], "capped");
    assert!(degraded["usage"]["completion_tokens"].as_u64().unwrap() <= 3);

    let server = with_scripted(&[(
        "shed",
        json!({ "hooks": ["shape"], "shape": { "shed": { "status": 503, "retry_after": 5, "message": "shedding load" } } }),
    )])
    .await;
    let (status, headers, shed) = post(&http, server.url("/v1/completions"), json!({ "prompt": "hi" })).await;
    assert_eq!(status, 503, "{shed}");
    assert_eq!(headers["retry-after"], "5");
    assert_eq!(shed["error"]["message"], "shedding load");
}

#[tokio::test]
async fn identical_concurrent_requests_share_one_generation() {
    let _model = exclusive().await;
    let mut config = config("");
    config.plugins = vec![levee_tests::plugin("coalesce", guests::COALESCE, json!({}))];
    let server = TestServer::start(config).await;
    let http = Client::new();
    // Long enough (48 tokens, end-of-sequence ignored) that all 16 arrive while it runs.
    let body =
        json!({ "prompt": "The three primary colours are", "max_tokens": 48, "temperature": 0, "ignore_eos": true });
    let before = server.sequences_started();
    let answers =
        futures::future::join_all((0..16).map(|_| post(&http, server.url("/v1/completions"), body.clone()))).await;
    let texts: Vec<&str> = answers.iter().map(|a| a.2["choices"][0]["text"].as_str().unwrap()).collect();
    assert!(answers.iter().all(|a| a.0 == 200));
    assert!(texts.iter().all(|t| *t == texts[0] && !t.is_empty()), "{texts:?}");
    assert_eq!(server.sequences_started() - before, 1, "16 identical requests, one generation");
    assert!(answers.iter().filter(|a| a.1.contains_key("x-levee-coalesced")).count() >= 15);
}

#[tokio::test]
async fn a_client_that_goes_away_aborts_its_generation() {
    let _model = exclusive().await;
    let server = TestServer::start(config("")).await;
    let engine = server.levee.app.pipeline.engine.clone();
    let mut response = Client::new()
        .post(server.url("/v1/completions"))
        .json(&json!({ "prompt": "Write a long essay on rivers.", "max_tokens": 1000, "temperature": 0,
                       "ignore_eos": true, "stream": true }))
        .send()
        .await
        .unwrap();
    for _ in 0..3 {
        response.chunk().await.unwrap().expect("a chunk");
    }
    assert_eq!(engine.stats().running, 1);
    drop(response);
    let dropped = std::time::Instant::now();
    while engine.stats().running > 0 {
        assert!(dropped.elapsed() < std::time::Duration::from_secs(10), "the generation kept running");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let generated = engine.stats().generated_tokens;
    assert!(generated < 1000, "{generated} tokens were generated for a client that left");
}

/// POSTs raw bytes as JSON.
async fn post_raw(http: &Client, url: String, body: &'static str) -> (u16, Value) {
    let response = http.post(url).header("content-type", "application/json").body(body).send().await.expect("post");
    (response.status().as_u16(), response.json().await.expect("a JSON error body"))
}

#[tokio::test]
async fn errors_have_openai_shapes_on_every_route_and_status() {
    let _model = exclusive().await;
    let server = TestServer::start(config("")).await;
    let http = Client::new();

    // Bytes after the JSON body are refused on every JSON route.
    for (route, sent) in [
        ("/v1/completions", r#"{"prompt":"hi","max_tokens":1}{"prompt":"evil"}"#),
        ("/v1/chat/completions", r#"{"messages":[{"role":"user","content":"hi"}]} {"x":1}"#),
        ("/tokenize", r#"{"prompt":"hi"}{"prompt":"evil"}"#),
        ("/detokenize", r#"{"tokens":[1]}[2]"#),
    ] {
        let (status, body) = post_raw(&http, server.url(route), sent).await;
        assert_eq!(status, 400, "{route}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("trailing"), "{route}: {body}");
        assert_eq!(body["error"]["param"], Value::Null);
    }
    // Unknown fields are refused inside objects too, by their path; the two
    // spellings of max_tokens must agree, and the completions route has only one.
    for (route, sent, param) in [
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "Hi", "foo": 1 }] }), "messages[0]"),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": [{ "type": "text", "text": "hi", "zzz": 1 }] }] }),
            "messages[0].content",
        ),
        (
            "/v1/completions",
            json!({ "prompt": "Hi", "stream": true, "stream_options": { "include_usage": true, "x": 1 } }),
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "user", "content": "Hi" }], "max_tokens": -5, "max_completion_tokens": 5 }),
            "max_tokens",
        ),
        ("/v1/completions", json!({ "prompt": "Hi", "max_completion_tokens": 5 }), "max_completion_tokens"),
        ("/v1/completions", json!({ "prompt": "Hi", "stop": 5 }), "stop"),
    ] {
        let (status, _, body) = post(&http, server.url(route), sent.clone()).await;
        assert_eq!(status, 400, "{sent}: {body}");
        let named = body["error"]["param"].as_str().unwrap_or_default();
        assert!(named.starts_with(param), "{sent}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(!message.contains("enum") && !message.contains("struct"), "a Rust type in {message:?}");
    }
    let bad_id = http.get(server.url("/v1/models/%ff%00")).send().await.unwrap();
    assert_eq!(bad_id.status(), 400);
    assert_eq!(bad_id.headers()["content-type"], "application/json");

    // Truncated JSON names no field (not "?").
    let (status, body) = post_raw(&http, server.url("/v1/completions"), r#"{"prompt": "hi", "max_tok"#).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], Value::Null, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error");

    // 404 and 405 answer JSON.
    for (method, path, status, code) in [
        ("GET", "/v1/nothing-here", 404, "unknown_url"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("POST", "/health", 405, "method_not_allowed"),
    ] {
        let response = http.request(method.parse().unwrap(), server.url(path)).send().await.unwrap();
        assert_eq!(response.status().as_u16(), status, "{method} {path}");
        assert_eq!(response.headers()["content-type"], "application/json", "{method} {path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{method} {path}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(path), "{body}");
    }

    // A body declared larger than the limit is refused from its header,
    // without waiting for it.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = server.base.trim_start_matches("http://").to_string();
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = "POST /v1/completions HTTP/1.1\r\nHost: levee\r\ncontent-type: application/json\r\n\
                    content-length: 1000000000\r\n\r\n{";
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = vec![0u8; 512];
        let n = tokio::time::timeout(std::time::Duration::from_secs(2), stream.read(&mut answer))
            .await
            .expect("413 without waiting for the body")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("request_too_large"), "{answer}");
    }

    // GET /v1/models/{id}: the served model, or 404 model_not_found.
    let listed: Value = http.get(server.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    let id = listed["data"][0]["id"].as_str().unwrap().to_string();
    let one = http.get(server.url(&format!("/v1/models/{id}"))).send().await.unwrap();
    assert_eq!(one.status(), 200);
    let one: Value = one.json().await.unwrap();
    assert_eq!(one, listed["data"][0]);
    let missing = http.get(server.url("/v1/models/org/other-model")).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let missing: Value = missing.json().await.unwrap();
    assert_eq!(missing["error"]["code"], "model_not_found");

    // The advertised context fits: a prompt of max_model_len - 1 tokens with
    // one token to generate runs; one more token is refused by name.
    let context = listed["data"][0]["max_model_len"].as_u64().unwrap() as usize;
    let fits: Vec<u32> = vec![504; context - 1];
    let (status, _, body) =
        post(&http, server.url("/v1/completions"), json!({ "prompt": fits, "max_tokens": 1, "temperature": 0 })).await;
    assert_eq!(status, 200, "a prompt of {} tokens in a context of {context}: {body}", context - 1);
    let (status, _, body) =
        post(&http, server.url("/v1/completions"), json!({ "prompt": fits, "max_tokens": 2 })).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "max_tokens", "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded");

    // Over the context: chat names `messages`, completions `prompt`, with
    // OpenAI's code, whether refused from the length alone (huge) or after
    // tokenizing (just over); the token field named is the one sent.
    let just_over = "hello ".repeat(context + 10);
    let huge = "x".repeat(1_000_000);
    for text in [&just_over, &huge] {
        let chat = json!({ "messages": [{ "role": "user", "content": text }] });
        let (status, _, body) = post(&http, server.url("/v1/chat/completions"), chat).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"]["param"], "messages", "{body}");
        assert_eq!(body["error"]["code"], "context_length_exceeded");
        let (status, _, body) = post(&http, server.url("/v1/completions"), json!({ "prompt": text })).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"]["param"], "prompt", "{body}");
        assert_eq!(body["error"]["code"], "context_length_exceeded");
    }
    let chat = json!({ "messages": [{ "role": "user", "content": "hi" }], "max_completion_tokens": context * 2 });
    let (status, _, body) = post(&http, server.url("/v1/chat/completions"), chat).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "max_completion_tokens", "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded");
}

#[tokio::test]
async fn an_error_in_a_stream_has_the_shape_of_the_same_error_unstreamed() {
    let _model = exclusive().await;
    let server = TestServer::start(config("[engine]\nmax-running = 1\nqueue-timeout-secs = 0.3\n")).await;
    let http = Client::new();
    // A long generation holds the only running slot; a request behind it
    // times out in the queue, streamed or not.
    let hold = json!({ "prompt": "Tell me everything.", "max_tokens": 200, "temperature": 0, "ignore_eos": true });
    let long = post(&http, server.url("/v1/completions"), hold);
    let behind = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let whole = post(&http, server.url("/v1/completions"), json!({ "prompt": "Hi", "max_tokens": 4 })).await;
        let streamed = http
            .post(server.url("/v1/completions"))
            .json(&json!({ "prompt": "Hi", "max_tokens": 4, "stream": true }))
            .send()
            .await
            .unwrap();
        (whole, streamed.text().await.unwrap())
    };
    let (_, ((status, _, whole), streamed)) = tokio::join!(long, behind);
    assert_eq!(status, 504, "{whole}");
    let events = sse_data(&streamed);
    let error: Value = events
        .iter()
        .find_map(|e| serde_json::from_str::<Value>(e).ok().filter(|v| v.get("error").is_some()))
        .unwrap_or_else(|| panic!("no error event in {streamed}"));
    for key in ["type", "param", "code"] {
        assert_eq!(error["error"][key], whole["error"][key], "{key}: streamed {error}, whole {whole}");
    }
    assert_eq!(error["error"]["code"], "queue_timeout");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test]
async fn ready_judges_a_stall_from_when_work_arrived() {
    let _model = exclusive().await;
    let server = TestServer::start(config("[server]\nready-stall-secs = 1\n")).await;
    let http = Client::new();
    assert_eq!(http.get(server.url("/ready")).send().await.unwrap().status(), 200);
    // Idle for longer than the stall limit, with no /ready in between; then
    // work arrives and /ready is asked at once.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    // A long prompt, so that the first step (a prefill chunk) takes a while.
    let prompt: Vec<u32> = (0..1000).map(|i| 504 + (i % 50)).collect();
    let body = json!({ "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true });
    let generation = post(&http, server.url("/v1/completions"), body);
    let probes = async {
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(http.get(server.url("/ready")).send().await.unwrap().status().as_u16());
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        statuses
    };
    let ((status, _, _), statuses) = tokio::join!(generation, probes);
    assert_eq!(status, 200);
    assert!(statuses.iter().all(|s| *s == 200), "/ready during fresh work: {statuses:?}");
}
