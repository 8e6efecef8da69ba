//! GPT-2 style pre-tokenization: splits text into the pieces that byte-level
//! BPE then encodes one at a time.
//!
//! It follows the GPT-2 pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//! optionally after isolating every digit (SmolLM and StarCoder vocabularies),
//! written out by hand because the lookahead is beyond the `regex` crate.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// Calls `f` with each piece of `text`, in order; the pieces concatenate back
/// to `text`.
pub fn split(text: &str, split_digits: bool, mut f: impl FnMut(&str)) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let n = chars.len();
    let at = |i: usize| if i < n { chars[i].0 } else { text.len() };
    let cls = |i: usize| class(chars[i].1);
    let run = |mut i: usize, c: Class| {
        while i < n && cls(i) == c {
            i += 1;
        }
        i
    };
    let mut i = 0;
    while i < n {
        let c = chars[i].1;
        let end = if c == '\'' && contraction(&chars[i + 1..]) > 0 {
            i + 1 + contraction(&chars[i + 1..])
        } else if c == ' ' && i + 1 < n && joins_space(cls(i + 1), split_digits) {
            let next = cls(i + 1);
            if next == Class::Number && split_digits { i + 2 } else { run(i + 1, next) }
        } else {
            match class(c) {
                Class::Number if split_digits => i + 1,
                Class::Space => {
                    let j = run(i, Class::Space);
                    // Trailing whitespace before a word is left for the word,
                    // unless a digit follows (digits were isolated first).
                    let digit_next = split_digits && j < n && cls(j) == Class::Number;
                    if j < n && j - i > 1 && !digit_next { j - 1 } else { j }
                }
                other => run(i, other),
            }
        };
        f(&text[at(i)..at(end)]);
        i = end;
    }
}

fn joins_space(next: Class, split_digits: bool) -> bool {
    match next {
        Class::Letter | Class::Other => true,
        Class::Number => !split_digits,
        Class::Space => false,
    }
}

/// Length (in chars, after the apostrophe) of a contraction starting here.
fn contraction(rest: &[(usize, char)]) -> usize {
    let c0 = rest.first().map(|c| c.1);
    let c1 = rest.get(1).map(|c| c.1);
    match (c0, c1) {
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 2,
        (Some('s' | 't' | 'm' | 'd'), _) => 1,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, digits: bool) -> Vec<String> {
        let mut out = Vec::new();
        split(text, digits, |p| out.push(p.to_string()));
        out
    }

    #[test]
    fn splits_words_spaces_and_punctuation_like_gpt2() {
        assert_eq!(pieces("Hello, world!  It's 2024", false), ["Hello", ",", " world", "!", " ", " It", "'s", " 2024"]);
        assert_eq!(pieces("a\n\n b  ", false), ["a", "\n\n", " b", "  "]);
    }

    #[test]
    fn isolates_digits_when_asked() {
        assert_eq!(pieces("in 2024:  42", true), ["in", " ", "2", "0", "2", "4", ":", "  ", "4", "2"]);
    }
}
