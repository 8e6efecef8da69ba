//! The tokenizer built from GGUF metadata encodes exactly as Hugging Face
//! `tokenizers` does with the same vocabulary, merges and pre-tokenizer
//! (expected ids produced by that library), and decodes back to the text.

mod support;

#[test]
fn encodes_like_the_reference_tokenizer_and_round_trips() {
    let model = support::shared_model();
    let cases: [(&str, &[u32]); 6] = [
        (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            &[
                1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
            ][..],
        ),
        ("The capital of France is", &[504, 3575, 282, 4649, 314][..]),
        (
            "Hello, world!  It's 2024\n\n  x  y\t\tz",
            &[19556, 28, 905, 17, 216, 657, 506, 216, 34, 32, 34, 36, 8866, 1792, 216, 329, 197, 197, 106][..],
        ),
        (
            "héllo wörld 你好 🎉 don't I'll WE'RE",
            &[
                88, 2756, 31394, 267, 29989, 400, 216, 18645, 250, 48392, 138, 15107, 232, 227, 1326, 982, 339, 3060,
                26587, 23, 3256,
            ][..],
        ),
        ("a\n\n b  ", &[81, 1116, 278, 256][..]),
        (
            "    def f(x):\n        return x**2 + 31",
            &[333, 753, 275, 24, 104, 727, 448, 1003, 1792, 828, 34, 1232, 216, 35, 33][..],
        ),
    ];
    for (text, expected) in cases {
        let ids = model.tokenizer.encode(text);
        assert_eq!(ids, expected, "encoding of {text:?}");
        assert_eq!(model.tokenizer.decode(&ids), text, "decoding of {text:?}");
        assert!(model.tokenizer.fewest_tokens(text) <= ids.len(), "the lower bound for {text:?}");
    }
}

/// Inputs that make naive byte-pair encoding quadratic (one huge piece with
/// nothing to split it, thousands of special tokens) encode in one pass and
/// round-trip. A quadratic encoder takes minutes here.
#[test]
fn adversarial_inputs_encode_and_round_trip() {
    let model = support::shared_model();
    let tokenizer = &model.tokenizer;
    let long_word = "a".repeat(400_000);
    let specials = "<|im_start|>".repeat(50_000);
    let mixed = "ab<|im_end|>".repeat(20_000) + &"z".repeat(100_000);
    for text in [&long_word, &specials, &mixed] {
        let ids = tokenizer.encode(text);
        assert!(!ids.is_empty());
        let bound = tokenizer.fewest_tokens(text);
        assert!(bound > 0 && bound <= ids.len(), "{bound} > {} tokens", ids.len());
        assert_eq!(tokenizer.decode(&ids), *text);
    }
    let im_start = tokenizer.token_id("<|im_start|>").expect("special token");
    assert_eq!(tokenizer.encode(&specials), vec![im_start; 50_000]);
}
