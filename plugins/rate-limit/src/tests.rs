//! Unit tests of the rate limiter through the SDK's native harness.

use super::*;
use levee_plugin_sdk::testing::{self, Harness};

fn harness(config: &str) -> Harness<RateLimit> {
    Harness::new(config).expect("valid configuration")
}

/// A request of `tenant` (in `tier`) with a unique id.
fn request(id: usize, tenant: &str, tier: Option<&str>, prompt_tokens: u32, max_tokens: u32) -> Request {
    let mut request = testing::request("hello", prompt_tokens);
    request.id = format!("req-{id}");
    request.tenant = tenant.to_string();
    request.tier = tier.map(str::to_string);
    request.max_tokens = max_tokens;
    request
}

fn usage(prompt_tokens: u32, completion_tokens: u32) -> Usage {
    Usage {
        prompt_tokens,
        completion_tokens,
        ttft_ms: 10.0,
        total_ms: 100.0,
        cached: false,
        coalesced: false,
        error_status: 0,
    }
}

fn rejection(admission: Admission) -> Rejection {
    match admission {
        Admission::Reject(rejection) => rejection,
        Admission::Allow(priority) => panic!("expected a rejection, got allow({priority:?})"),
    }
}

fn allowed(admission: &Admission) -> bool {
    matches!(admission, Admission::Allow(_))
}

#[test]
fn an_empty_bucket_answers_429_with_retry_after_and_spares_other_tenants() {
    // 6 per minute: a bucket of 6 that refills one request every 10 seconds.
    let mut plugin = harness(r#"{"requests-per-minute": 6}"#);
    let load = Load::default();
    for i in 0..6 {
        assert!(allowed(&plugin.admit(&request(i, "acme", None, 5, 10), &load)), "request {i}");
    }
    let refused = rejection(plugin.admit(&request(6, "acme", None, 5, 10), &load));
    assert_eq!(refused.status, 429);
    assert_eq!(refused.retry_after_secs, Some(10));
    assert!(refused.message.contains("tenant acme"), "{}", refused.message);

    assert!(allowed(&plugin.admit(&request(7, "globex", None, 5, 10), &load)), "another tenant is unaffected");

    testing::advance_clock(4_000);
    assert_eq!(rejection(plugin.admit(&request(8, "acme", None, 5, 10), &load)).retry_after_secs, Some(6));
    testing::advance_clock(6_000);
    assert!(allowed(&plugin.admit(&request(9, "acme", None, 5, 10), &load)), "one request refilled after 10 s");
    assert_eq!(testing::counter("rejected_requests"), 2);
    assert_eq!(testing::counter("admitted"), 8);
}

#[test]
fn a_token_budget_holds_under_32_concurrent_requests_and_refunds_reopen_it() {
    let mut plugin = harness(r#"{"tokens-per-minute": 1000}"#);
    assert!(plugin.declares(Hook::Completed));
    let load = Load::default();
    // 32 requests arrive before any finishes; each reserves 10 + 90 tokens.
    let requests: Vec<Request> = (0..32).map(|i| request(i, "acme", None, 10, 90)).collect();
    let admitted: Vec<&Request> = requests.iter().filter(|r| allowed(&plugin.admit(r, &load))).collect();
    assert_eq!(admitted.len(), 10, "1000 tokens hold ten reservations of 100");
    let refused = rejection(plugin.admit(&request(99, "acme", None, 10, 90), &load));
    assert_eq!(refused.status, 429);
    // 100 tokens at 1000/60 per second: 6 seconds.
    assert_eq!(refused.retry_after_secs, Some(6));

    // Each used 30 of its 100: 70 come back, enough for seven more.
    for r in &admitted {
        plugin.completed(r, &testing::response("ok", 20), &usage(10, 20));
    }
    assert_eq!(testing::counter("refunded_tokens"), 700);
    let more = (100..132).map(|i| request(i, "acme", None, 10, 90)).filter(|r| allowed(&plugin.admit(r, &load)));
    assert_eq!(more.count(), 7);
}

#[test]
fn refunds_need_a_reservation_and_happen_once() {
    let mut plugin = harness(r#"{"tokens-per-minute": 200}"#);
    let load = Load::default();
    let never_admitted = request(1, "acme", None, 10, 90);
    plugin.completed(&never_admitted, &testing::response("ok", 1), &usage(10, 1));
    assert_eq!(testing::counter("refunded_tokens"), 0);

    let admitted = request(2, "acme", None, 10, 90);
    assert!(allowed(&plugin.admit(&admitted, &load)));
    plugin.completed(&admitted, &testing::response("ok", 40), &usage(10, 40));
    plugin.completed(&admitted, &testing::response("ok", 40), &usage(10, 40));
    assert_eq!(testing::counter("refunded_tokens"), 50);

    // A cache hit generated nothing: the whole reservation returns.
    let cached = request(3, "acme", None, 10, 90);
    assert!(allowed(&plugin.admit(&cached, &load)));
    plugin.completed(&cached, &testing::response("ok", 40), &Usage { cached: true, ..usage(10, 40) });
    assert_eq!(testing::counter("refunded_tokens"), 150);
}

#[test]
fn a_request_larger_than_the_budget_is_refused_as_invalid() {
    let mut plugin = harness(r#"{"tokens-per-minute": 100}"#);
    let refused = rejection(plugin.admit(&request(1, "acme", None, 50, 60), &Load::default()));
    assert_eq!(refused.status, 400);
    assert!(refused.message.contains("110 tokens"), "{}", refused.message);
    assert_eq!(refused.retry_after_secs, None);
}

#[test]
fn a_refused_token_take_gives_the_request_slot_back() {
    let mut plugin = harness(r#"{"requests-per-minute": 2, "tokens-per-minute": 100}"#);
    let load = Load::default();
    assert!(allowed(&plugin.admit(&request(1, "acme", None, 10, 50), &load)));
    assert_eq!(rejection(plugin.admit(&request(2, "acme", None, 10, 50), &load)).status, 429);
    // Had request 2 kept its request slot, the bucket of 2 would be empty now.
    assert!(allowed(&plugin.admit(&request(3, "acme", None, 5, 5), &load)));
}

#[test]
fn tiers_set_priority_and_limits_and_tenants_override_them() {
    let config = r#"{
        "requests-per-minute": 100,
        "default-priority": 5,
        "tiers": {
            "paid": { "priority": 0, "requests-per-minute": 3 },
            "free": { "priority": 10, "requests-per-minute": 1, "tier-requests-per-minute": 3 }
        },
        "tenants": { "vip": { "priority": -1, "requests-per-minute": 50 } }
    }"#;
    let mut plugin = harness(config);
    assert!(!plugin.declares(Hook::Completed), "no token limits, nothing to refund");
    let load = Load::default();
    assert!(matches!(plugin.admit(&request(1, "a", Some("paid"), 1, 1), &load), Admission::Allow(Some(0))));
    assert!(matches!(plugin.admit(&request(2, "b", Some("free"), 1, 1), &load), Admission::Allow(Some(10))));
    assert!(matches!(plugin.admit(&request(3, "c", None, 1, 1), &load), Admission::Allow(Some(5))));
    assert!(matches!(plugin.admit(&request(4, "vip", Some("free"), 1, 1), &load), Admission::Allow(Some(-1))));

    // A client cannot jump ahead of its tier, but may ask to run later within it.
    let mut eager = request(5, "d", Some("free"), 1, 1);
    eager.priority = -100;
    assert!(matches!(plugin.admit(&eager, &load), Admission::Allow(Some(10))));
    let mut patient = request(6, "e", Some("paid"), 1, 1);
    patient.priority = 20;
    assert!(matches!(plugin.admit(&patient, &load), Admission::Allow(Some(20))));

    // b, vip and d used up the free tier's shared 3 per minute.
    let refused = rejection(plugin.admit(&request(11, "f", Some("free"), 1, 1), &load));
    assert!(refused.message.contains("tier free"), "{}", refused.message);

    // The free tier's per-tenant limit is 1; the paid tier's is 3.
    assert_eq!(rejection(plugin.admit(&request(7, "b", Some("free"), 1, 1), &load)).status, 429);
    assert!(allowed(&plugin.admit(&request(8, "a", Some("paid"), 1, 1), &load)));
    assert!(allowed(&plugin.admit(&request(9, "a", Some("paid"), 1, 1), &load)));
    assert_eq!(rejection(plugin.admit(&request(10, "a", Some("paid"), 1, 1), &load)).status, 429);
}

#[test]
fn store_failures_follow_the_configured_rule() {
    testing::fail_host_calls(Some("redis is down"));
    let load = Load::default();
    let mut open = harness(r#"{"requests-per-minute": 1}"#);
    assert!(matches!(open.admit(&request(1, "acme", None, 1, 1), &load), Admission::Allow(None)));
    let mut closed = harness(r#"{"requests-per-minute": 1, "on-store-error": "reject"}"#);
    let refused = rejection(closed.admit(&request(2, "acme", None, 1, 1), &load));
    assert_eq!((refused.status, refused.retry_after_secs), (503, Some(1)));
    assert_eq!(testing::counter("store_errors"), 2);
    assert_eq!(testing::logs().len(), 2, "one line per instance");
    testing::fail_host_calls(None);
}

#[test]
fn invalid_configuration_names_the_field_and_the_limit() {
    let error = Harness::<RateLimit>::new(r#"{"requests-per-minute": 0}"#).err().expect("refused");
    assert!(error.contains("`requests-per-minute`") && error.contains("≥ 1"), "{error}");
    let error = Harness::<RateLimit>::new(r#"{"tiers": {"free": {"tokens-per-minute": -5}}}"#).err().expect("refused");
    assert!(error.contains("tiers.free.tokens-per-minute"), "{error}");
    let error = Harness::<RateLimit>::new(r#"{"request-per-minute": 5}"#).err().expect("refused");
    assert!(error.contains("request-per-minute"), "{error}");
    let error = Harness::<RateLimit>::new(r#"{"on-store-error": "maybe"}"#).err().expect("refused");
    assert!(error.contains("maybe"), "{error}");
    assert!(Harness::<RateLimit>::new("").is_ok(), "no settings: no limits");
}
