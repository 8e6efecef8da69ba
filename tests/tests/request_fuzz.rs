//! Property tests of the request parser and validator over the real
//! tokenizer and chat template: arbitrary bytes and arbitrary JSON bodies
//! built from the fields clients send (values of every type and range)
//! never panic; every refusal is a 4xx that names a field the request has
//! or a limit it broke; every accepted request fits the context.
//!
//! The test command runs a short pass (`PROPTEST_CASES`, 256 by default);
//! `PROPTEST_CASES=100000 cargo test -p levee-tests --test request_fuzz`
//! runs a long one (BENCHMARKS.md records it).

use levee::api::error::ApiError;
use levee::api::validate;
use levee::api::wire::{self, ChatBody, CompletionBody};
use levee::config::ServerConfig;
use levee::tenancy::Tenant;
use levee_gpu::{Engine, EngineConfig, EngineHandle, KvBudget, Model};
use proptest::prelude::*;
use serde_json::{Map, Value, json};
use std::sync::OnceLock;

fn engine() -> &'static EngineHandle {
    static ENGINE: OnceLock<EngineHandle> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let model = Model::load(levee_tests::model_path()).expect("the default model loads");
        let config = EngineConfig { threads: 1, kv_budget: KvBudget::Bytes(16 << 20), ..EngineConfig::default() };
        Engine::start(model, config).expect("engine")
    })
}

/// Any JSON value, a few levels deep, with the edge cases of each type.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        prop_oneof![Just(0i64), Just(1), Just(-1), Just(2), Just(16), Just(4096), Just(i64::from(u32::MAX) + 1)]
            .prop_map(|n| json!(n)),
        any::<f64>().prop_filter("JSON numbers are finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        prop_oneof![Just(0.0f64), Just(1e-30), Just(0.5), Just(2.0), Just(-2.5)].prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
        Just(json!("<|im_start|>user\n")),
        (0usize..40_000).prop_map(|n| Value::String("ab ".repeat(n))),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((field_name(), inner), 0..4)
                .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

fn message() -> impl Strategy<Value = Value> {
    let role =
        prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("tool"), Just("developer"), Just("robot")];
    (role, any_value(), any::<bool>()).prop_map(|(role, content, text)| {
        let content = if text { content.as_str().map_or(json!("hello"), |s| json!(s)) } else { content };
        json!({ "role": role, "content": content })
    })
}

/// Field names clients send, and some they should not.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model"),
        Just("max_tokens"),
        Just("max_completion_tokens"),
        Just("temperature"),
        Just("top_p"),
        Just("top_k"),
        Just("n"),
        Just("stop"),
        Just("stop_token_ids"),
        Just("seed"),
        Just("presence_penalty"),
        Just("frequency_penalty"),
        Just("repetition_penalty"),
        Just("user"),
        Just("ignore_eos"),
        Just("priority"),
        Just("stream"),
        Just("stream_options"),
        Just("logprobs"),
        Just("top_logprobs"),
        Just("tools"),
        Just("logit_bias"),
        Just("response_format"),
        Just("echo"),
        Just("best_of"),
        Just("prompt"),
        Just("messages"),
        Just("include_usage"),
        Just("unknown_field"),
    ]
    .prop_map(str::to_string)
}

/// A body: the route's main field (often well formed) plus any fields.
fn body(chat: bool) -> impl Strategy<Value = Value> {
    let main = if chat {
        prop_oneof![prop::collection::vec(message(), 0..4).prop_map(Value::Array), any_value()].boxed()
    } else {
        prop_oneof![
            ".{0,200}".prop_map(Value::String),
            prop::collection::vec(0u32..60_000, 0..64).prop_map(|t| json!(t)),
            prop::collection::vec(".{0,20}", 0..40).prop_map(|t| json!(t)),
            any_value(),
        ]
        .boxed()
    };
    (main, prop::collection::vec((field_name(), any_value()), 0..6), any::<bool>()).prop_map(
        move |(main, extra, keep)| {
            let mut fields: Map<String, Value> = extra.into_iter().collect();
            if keep {
                fields.insert(if chat { "messages" } else { "prompt" }.to_string(), main);
            }
            Value::Object(fields)
        },
    )
}

/// Runs a body through parsing and validation as the server does.
fn validate_body(bytes: &[u8], chat: bool) -> Result<validate::ValidRequest, ApiError> {
    let (engine, limits) = (engine(), ServerConfig::default());
    let tenant = Tenant { name: "fuzz".into(), tier: None };
    let model = "SmolLM2-135M-Instruct";
    if chat {
        let (fields, route) = wire::parse_generation::<ChatBody>(bytes, wire::CHAT_FIELDS)?;
        validate::chat(fields, route, engine, model, &limits, tenant, Vec::new())
    } else {
        let (fields, route) = wire::parse_generation::<CompletionBody>(bytes, wire::COMPLETION_FIELDS)?;
        validate::completion(fields, route, engine, model, &limits, tenant, Vec::new())
    }
}

/// Checks one outcome: a refusal is a 4xx naming a field the body has (or
/// `n`, whose default can break the queue's limit); an acceptance fits the
/// context.
fn check(body: &Value, outcome: Result<validate::ValidRequest, ApiError>) -> Result<(), TestCaseError> {
    match outcome {
        Ok(request) => {
            let context = engine().max_context();
            for prompt in &request.prompts {
                prop_assert!(!prompt.tokens.is_empty());
                prop_assert!(prompt.tokens.len() + request.max_tokens as usize <= context);
            }
            prop_assert!(request.n >= 1);
        }
        Err(error) => {
            let status = error.status().as_u16();
            prop_assert!((400..500).contains(&status), "status {status} for {body}: {error}");
            let shape = error.body();
            prop_assert!(shape["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
            if let Some(param) = shape["error"]["param"].as_str() {
                let root = param.split(['.', '[']).next().unwrap_or(param);
                let sent = body.as_object().is_some_and(|o| o.contains_key(root));
                // `n` is named when prompts x n overflow the queue, sent or not.
                let defaulted = root == "n";
                prop_assert!(sent || defaulted, "param {param:?} names nothing in {body}: {error}");
            }
        }
    }
    Ok(())
}

proptest! {
    // Cases: proptest's default of 256, or PROPTEST_CASES.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), chat in any::<bool>()) {
        if let Err(error) = validate_body(&bytes, chat) {
            prop_assert!((400..500).contains(&error.status().as_u16()));
        }
    }

    #[test]
    fn completion_bodies_are_accepted_within_limits_or_refused_by_name(body in body(false)) {
        let bytes = serde_json::to_vec(&body).expect("serialize");
        check(&body, validate_body(&bytes, false))?;
    }

    #[test]
    fn chat_bodies_are_accepted_within_limits_or_refused_by_name(body in body(true)) {
        let bytes = serde_json::to_vec(&body).expect("serialize");
        check(&body, validate_body(&bytes, true))?;
    }
}
