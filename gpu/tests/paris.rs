//! The model runs correctly end to end: the plain completion of "The capital
//! of France is" names Paris, and a chat answer streams as text.

mod support;

use levee_gpu::{ChatMessage, Engine, EngineConfig, FinishReason, GenerationRequest};

#[test]
fn completion_of_the_capital_of_france_names_paris() {
    let engine = Engine::start(support::load_model(), support::small_config()).expect("engine starts");
    let prompt = engine.tokenizer().encode("The capital of France is");
    let (tokens, done) =
        engine.submit(GenerationRequest::new(prompt, 8)).expect("accepted").blocking_collect().expect("completes");
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    println!("completion: {text:?}");
    assert!(text.contains("Paris"), "completion was {text:?}");
    assert_eq!(done.reason, FinishReason::Length);
    assert_eq!(done.usage.completion_tokens, 8);
}

#[test]
fn chat_prompt_uses_the_model_template_and_stops_at_end_of_turn() {
    let engine = Engine::start(support::load_model(), EngineConfig { threads: 2, ..EngineConfig::default() })
        .expect("engine starts");
    let rendered = engine.render_chat(&[ChatMessage::new("user", "Write a haiku about the ocean.")]).expect("renders");
    assert!(rendered.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), "{rendered}");
    assert!(rendered.ends_with("<|im_start|>assistant\n"));
    let prompt = engine.tokenizer().encode(&rendered);
    assert_eq!(prompt[0], engine.tokenizer().token_id("<|im_start|>").expect("special token"));
    let (tokens, done) =
        engine.submit(GenerationRequest::new(prompt, 64)).expect("accepted").blocking_collect().expect("completes");
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    println!("answer: {text:?} ({:?})", done.reason);
    assert!(text.contains("ocean"), "answer was {text:?}");
    assert!(!text.contains("<|im_end|>") && !text.contains("<|im_start|>"));
}
