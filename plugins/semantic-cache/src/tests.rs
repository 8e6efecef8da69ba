//! Unit tests of the semantic cache through the SDK's native harness, with a
//! small deterministic embedder that knows a few synonyms.

use super::*;
use levee_plugin_sdk::testing::{self, Harness};

const CAPITAL: &str = "What is the capital of France?";
const PARAPHRASE: &str = "What's the capital city of France?";
const UNRELATED: &str = "How do I bake sourdough bread?";

/// A stand-in for a sentence-embedding model: filler words carry nothing,
/// synonyms share an axis, "city" next to "capital" adds a little, other
/// words get an axis of their own (hashed). Unit length, like the host's.
fn concept_embedder(text: &str) -> Vec<f32> {
    const FILLER: &[&str] = &["what", "whats", "s", "is", "the", "of", "a", "how", "do", "i", "me", "tell"];
    let mut vector = vec![0.0f32; 64];
    let lower = text.to_lowercase().replace('\'', "");
    for word in lower.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty() && !FILLER.contains(w)) {
        let (axis, weight) = match word {
            "capital" => (0, 1.0),
            "city" => (0, 0.3),
            "france" | "french" => (1, 1.0),
            "germany" | "german" => (2, 1.0),
            "poem" | "verse" => (3, 1.0),
            "ocean" | "sea" => (4, 1.0),
            other => (8 + other.bytes().map(usize::from).sum::<usize>() % 56, 1.0),
        };
        vector[axis] += weight;
    }
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    vector.iter_mut().for_each(|x| *x /= norm.max(f32::MIN_POSITIVE));
    vector
}

/// A named change to a request.
type Change = (&'static str, fn(&mut Request));

fn harness(config: &str) -> Harness<SemanticCache> {
    testing::set_embedder(concept_embedder);
    Harness::new(config).expect("valid configuration")
}

fn request(id: &str, prompt: &str) -> Request {
    let mut request = testing::request(prompt, 8);
    request.id = id.to_string();
    request
}

fn usage() -> Usage {
    Usage {
        prompt_tokens: 8,
        completion_tokens: 2,
        ttft_ms: 50.0,
        total_ms: 80.0,
        cached: false,
        coalesced: false,
        error_status: 0,
    }
}

/// Looks `request` up and, on a miss, completes it with `answer`.
fn serve(plugin: &mut Harness<SemanticCache>, request: &Request, answer: &str) -> LookupResult {
    let result = plugin.lookup(request);
    if matches!(result, LookupResult::Miss) {
        plugin.completed(request, &testing::response(answer, 2), &usage());
    }
    result
}

fn hit_text(result: &LookupResult) -> Option<&str> {
    match result {
        LookupResult::Hit(hit) => hit.response.choices.first().map(|c| c.text.as_str()),
        LookupResult::Miss => None,
    }
}

#[test]
fn a_paraphrase_hits_and_an_unrelated_prompt_misses() {
    let mut plugin = harness("{}");
    assert!(plugin.declares(Hook::Lookup) && plugin.declares(Hook::Completed));
    assert!(matches!(serve(&mut plugin, &request("1", CAPITAL), "Paris."), LookupResult::Miss));
    assert_eq!(testing::counter("stores"), 1);

    let LookupResult::Hit(hit) = plugin.lookup(&request("2", PARAPHRASE)) else { panic!("the paraphrase misses") };
    assert_eq!(hit.response.choices[0].text, "Paris.");
    assert_eq!(hit.response.completion_tokens, 2);
    assert!(hit.similarity > 0.95 && hit.similarity <= 1.0, "{}", hit.similarity);
    assert!(matches!(plugin.lookup(&request("3", UNRELATED)), LookupResult::Miss));

    assert_eq!((testing::counter("hits"), testing::counter("misses")), (1, 2));
    assert_eq!(testing::gauge("similarity"), Some(f64::from(hit.similarity)));
}

#[test]
fn no_cache_skips_the_lookup_but_stores_and_no_store_does_neither() {
    let mut plugin = harness("{}");
    let mut fresh = request("1", CAPITAL);
    fresh.headers = vec![("cache-control".into(), "max-age=0, No-Cache".into())];
    assert!(matches!(serve(&mut plugin, &fresh, "Paris."), LookupResult::Miss));
    assert_eq!(hit_text(&plugin.lookup(&fresh)), None, "no-cache never reads");
    assert_eq!(hit_text(&plugin.lookup(&request("2", CAPITAL))), Some("Paris."), "but it stored");

    let mut private = request("3", "Tell me the capital of Germany");
    private.headers = vec![("cache-control".into(), "no-store".into())];
    serve(&mut plugin, &private, "Berlin.");
    assert_eq!(hit_text(&plugin.lookup(&request("4", "Tell me the capital of Germany"))), None);
    assert_eq!(testing::counter("bypassed"), 3);
    assert_eq!(testing::counter("stores"), 1);
}

#[test]
fn the_ttl_header_sets_the_lifetime_within_the_maximum() {
    let mut plugin = harness(r#"{"ttl-secs": 60, "max-ttl-secs": 120}"#);
    let mut short = request("1", CAPITAL);
    short.headers = vec![("x-levee-cache-ttl".into(), "5".into())];
    serve(&mut plugin, &short, "Paris.");
    testing::advance_clock(4_000);
    assert_eq!(hit_text(&plugin.lookup(&request("2", CAPITAL))), Some("Paris."));
    testing::advance_clock(2_000);
    assert_eq!(hit_text(&plugin.lookup(&request("3", CAPITAL))), None, "expired after 5 s");

    let mut long = request("4", "The capital of Germany");
    long.headers = vec![("x-levee-cache-ttl".into(), "100000".into())];
    serve(&mut plugin, &long, "Berlin.");
    testing::advance_clock(119_000);
    assert_eq!(hit_text(&plugin.lookup(&request("5", "The capital of Germany"))), Some("Berlin."));
    testing::advance_clock(2_000);
    assert_eq!(hit_text(&plugin.lookup(&request("6", "The capital of Germany"))), None, "capped at 120 s");

    let mut never = request("7", "The ocean");
    never.headers = vec![("x-levee-cache-ttl".into(), "0".into())];
    serve(&mut plugin, &never, "Blue.");
    let mut garbled = request("8", "The sea");
    garbled.headers = vec![("x-levee-cache-ttl".into(), "soon".into())];
    assert_eq!(hit_text(&plugin.lookup(&garbled)), None, "ttl 0 stored nothing");
    plugin.completed(&garbled, &testing::response("Wet.", 2), &usage());
    testing::advance_clock(59_000);
    assert_eq!(hit_text(&plugin.lookup(&request("9", "The sea"))), Some("Wet."), "an unreadable ttl is ignored");
    testing::advance_clock(2_000);
    assert_eq!(hit_text(&plugin.lookup(&request("10", "The sea"))), None, "the default 60 s applies");
}

#[test]
fn sampled_requests_are_skipped_unless_configured() {
    let mut plugin = harness("{}");
    let mut sampled = request("1", CAPITAL);
    sampled.temperature = 0.7;
    serve(&mut plugin, &sampled, "Paris, of course.");
    assert_eq!(hit_text(&plugin.lookup(&sampled)), None);
    assert_eq!((testing::counter("skipped"), testing::counter("stores")), (2, 0));

    let mut plugin = harness(r#"{"cache-sampled": true}"#);
    serve(&mut plugin, &sampled, "Paris, of course.");
    assert_eq!(hit_text(&plugin.lookup(&sampled)), Some("Paris, of course."));
    let mut greedy = sampled.clone();
    greedy.temperature = 0.0;
    assert_eq!(hit_text(&plugin.lookup(&greedy)), None, "another temperature is another namespace");
}

#[test]
fn entries_are_namespaced_by_model_and_sampling_settings() {
    let mut plugin = harness("{}");
    serve(&mut plugin, &request("1", CAPITAL), "Paris.");
    let changes: [Change; 5] = [
        ("model", |r| r.model = "other-model".into()),
        ("top-p", |r| r.top_p = 0.5),
        ("seed", |r| r.seed = Some(1)),
        ("n", |r| r.n = 2),
        ("stop", |r| r.stop = vec!["\n".into()]),
    ];
    for (what, change) in changes {
        let mut other = request("2", CAPITAL);
        change(&mut other);
        assert_eq!(hit_text(&plugin.lookup(&other)), None, "a different {what} misses");
    }
    // A response that stopped on its own serves any limit that fits it.
    let mut roomier = request("3", CAPITAL);
    roomier.max_tokens = 500;
    assert_eq!(hit_text(&plugin.lookup(&roomier)), Some("Paris."));
    let mut tighter = request("4", CAPITAL);
    tighter.max_tokens = 1;
    assert_eq!(hit_text(&plugin.lookup(&tighter)), None, "two tokens do not fit in one");

    // One cut by its length limit serves only the same limit.
    let cut = request("5", UNRELATED);
    plugin.lookup(&cut);
    let truncated = Response {
        choices: vec![Choice { text: "Mix flour".into(), finish_reason: "length".into() }],
        completion_tokens: 16,
    };
    plugin.completed(&cut, &truncated, &usage());
    assert_eq!(hit_text(&plugin.lookup(&request("6", UNRELATED))), Some("Mix flour"));
    let mut longer = request("7", UNRELATED);
    longer.max_tokens = 64;
    assert_eq!(hit_text(&plugin.lookup(&longer)), None);
}

#[test]
fn per_tenant_keeps_tenants_entries_apart() {
    let mut plugin = harness(r#"{"per-tenant": true}"#);
    serve(&mut plugin, &request("1", CAPITAL), "Paris.");
    let mut other = request("2", CAPITAL);
    other.tenant = "someone-else".into();
    assert_eq!(hit_text(&plugin.lookup(&other)), None);
    assert_eq!(hit_text(&plugin.lookup(&request("3", PARAPHRASE))), Some("Paris."));
}

#[test]
fn a_degraded_request_accepts_a_lower_similarity() {
    let mut plugin = harness("{}");
    serve(&mut plugin, &request("1", "capital France Paris"), "Yes.");
    // Shares two of three concepts: similarity 2/3, under the 0.92 threshold.
    let near = request("2", "capital France Lyon");
    assert_eq!(hit_text(&plugin.lookup(&near)), None);
    let mut degraded = near.clone();
    degraded.min_similarity = Some(0.6);
    let LookupResult::Hit(hit) = plugin.lookup(&degraded) else { panic!("the degraded lookup misses") };
    assert!((hit.similarity - 2.0 / 3.0).abs() < 1e-4, "{}", hit.similarity);
    assert_eq!(testing::counter("hits_below_threshold"), 1);
    // A floor above the configured threshold does not make the cache stricter.
    let mut strict = request("3", PARAPHRASE);
    strict.min_similarity = Some(0.999);
    serve(&mut plugin, &request("4", CAPITAL), "Paris.");
    assert_eq!(hit_text(&plugin.lookup(&strict)), Some("Paris."));
}

#[test]
fn rules_set_thresholds_and_ttls_by_prompt_route_or_model() {
    let config = r#"{
        "threshold": 0.9,
        "rules": [
            { "prompt-contains": ["POEM", "story"], "threshold": 0.999 },
            { "route": "chat", "model": "private-model", "cache": false },
            { "model": "news-model", "ttl-secs": 10 }
        ]
    }"#;
    let mut plugin = harness(config);
    serve(&mut plugin, &request("1", "Write a poem about the capital of France"), "Roses...");
    let paraphrase = request("2", "Write a poem about the capital city of France");
    assert_eq!(hit_text(&plugin.lookup(&paraphrase)), None, "creative prompts need a near-exact match");
    serve(&mut plugin, &request("3", CAPITAL), "Paris.");
    assert_eq!(hit_text(&plugin.lookup(&request("4", PARAPHRASE))), Some("Paris."), "factual ones do not");

    let mut private = request("5", CAPITAL);
    private.route = levee_plugin_sdk::Route::Chat;
    private.model = "private-model".into();
    serve(&mut plugin, &private, "Paris.");
    assert_eq!(hit_text(&plugin.lookup(&private)), None);

    let mut news = request("6", UNRELATED);
    news.model = "news-model".into();
    serve(&mut plugin, &news, "Knead.");
    testing::advance_clock(11_000);
    assert_eq!(hit_text(&plugin.lookup(&news)), None, "the rule's 10 s ttl");
}

#[test]
fn only_fresh_successful_generations_are_stored() {
    let mut plugin = harness("{}");
    let req = request("1", CAPITAL);
    let response = testing::response("Paris.", 2);
    plugin.completed(&req, &response, &Usage { cached: true, ..usage() });
    plugin.completed(&req, &response, &Usage { coalesced: true, ..usage() });
    plugin.completed(&req, &response, &Usage { error_status: 500, ..usage() });
    let mut long = request("2", CAPITAL);
    long.prompt_tokens = 300;
    plugin.completed(&long, &response, &usage());
    assert_eq!(testing::counter("stores"), 0);
}

#[test]
fn host_failures_are_misses() {
    let mut plugin = harness("{}");
    serve(&mut plugin, &request("1", CAPITAL), "Paris.");
    testing::fail_host_calls(Some("vector store unavailable"));
    assert!(matches!(plugin.lookup(&request("2", CAPITAL)), LookupResult::Miss));
    plugin.completed(&request("2", CAPITAL), &testing::response("Paris.", 2), &usage());
    testing::fail_host_calls(None);
    assert_eq!(testing::counter("errors"), 2);
    assert_eq!(testing::logs().len(), 1, "logged once");
}

#[test]
fn invalid_configuration_names_the_field_and_the_limit() {
    let refused = |config: &str| Harness::<SemanticCache>::new(config).err().expect("refused");
    let error = refused(r#"{"threshold": 1.2}"#);
    assert!(error.contains("`threshold` must be in (0, 1], got 1.2"), "{error}");
    let error = refused(r#"{"rules": [{"threshold": 0.5}]}"#);
    assert!(error.contains("`rules[0].prompt-contains` must be set, or route or model"), "{error}");
    let error = refused(r#"{"rules": [{"route": "embeddings"}]}"#);
    assert!(error.contains("embeddings"), "{error}");
    let error = refused(r#"{"ttl-secs": 100, "max-ttl-secs": 10}"#);
    assert!(error.contains("`max-ttl-secs` must be at least ttl-secs (100), got 10"), "{error}");
    let error = refused(r#"{"treshold": 0.9}"#);
    assert!(error.contains("treshold"), "{error}");
}
