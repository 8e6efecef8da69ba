//! Byte-level BPE tokenizer (GPT-2 family), built from GGUF metadata or from a
//! Hugging Face `tokenizer.json`, with incremental decoding for streaming.

use std::collections::HashMap;

use super::pretokenize;

/// Why a tokenizer could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The vocabulary is empty.
    #[error("the tokenizer vocabulary is empty")]
    EmptyVocab,
    /// A JSON tokenizer file is not the supported shape.
    #[error("tokenizer.json is not supported: {0}")]
    Unsupported(String),
}

/// Everything needed to build a [`Tokenizer`], whatever file it came from.
pub struct TokenizerSpec {
    /// Token strings in byte-level form (GPT-2's byte-to-unicode alphabet), by id.
    pub tokens: Vec<String>,
    /// Merge rules, highest priority first.
    pub merges: Vec<(String, String)>,
    /// Ids of tokens matched whole in text (control and added tokens).
    pub special: Vec<u32>,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Whether `encode` prepends `bos`.
    pub add_bos: bool,
    /// Whether every digit is its own piece before BPE.
    pub split_digits: bool,
}

/// A byte-level BPE tokenizer. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Tokenizer {
    vocab: HashMap<String, u32>,
    bytes: Vec<Vec<u8>>,
    ranks: HashMap<(u32, u32), (u32, u32)>,
    special: Vec<(String, u32)>,
    is_special: Vec<bool>,
    byte_char: [char; 256],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    split_digits: bool,
    /// Most text bytes one token stands for.
    widest: usize,
    /// Bytes with a token of their own: never skipped by `encode`.
    has_token: [bool; 256],
}

/// GPT-2's reversible map from bytes to printable characters.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\0')
        };
    }
    table
}

impl Tokenizer {
    /// Builds a tokenizer from its parts.
    pub fn new(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        if spec.tokens.is_empty() {
            return Err(TokenizerError::EmptyVocab);
        }
        let byte_char = byte_chars();
        let char_byte: HashMap<char, u8> = byte_char.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut is_special = vec![false; spec.tokens.len()];
        for &s in &spec.special {
            if let Some(flag) = is_special.get_mut(s as usize) {
                *flag = true;
            }
        }
        let bytes: Vec<Vec<u8>> = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                if is_special[id] {
                    return t.as_bytes().to_vec();
                }
                let mut out = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match char_byte.get(&c) {
                        Some(&b) => out.push(b),
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                out
            })
            .collect();
        let vocab: HashMap<String, u32> = spec.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut ranks = HashMap::with_capacity(spec.merges.len());
        for (rank, (a, b)) in spec.merges.iter().enumerate() {
            let merged = format!("{a}{b}");
            if let (Some(&ia), Some(&ib), Some(&im)) = (vocab.get(a), vocab.get(b), vocab.get(&merged)) {
                ranks.entry((ia, ib)).or_insert((rank as u32, im));
            }
        }
        let mut special: Vec<(String, u32)> =
            spec.special.iter().filter_map(|&id| spec.tokens.get(id as usize).map(|t| (t.clone(), id))).collect();
        special.retain(|(t, _)| !t.is_empty());
        special.sort_by_key(|s| std::cmp::Reverse(s.0.len()));
        let mut buf = [0u8; 4];
        let has_token = byte_char.map(|c| vocab.contains_key(c.encode_utf8(&mut buf) as &str));
        let widest = bytes.iter().map(Vec::len).max().unwrap_or(1).max(1);
        Ok(Tokenizer {
            vocab,
            bytes,
            ranks,
            special,
            is_special,
            byte_char,
            bos: spec.bos,
            eos: spec.eos,
            add_bos: spec.add_bos,
            split_digits: spec.split_digits,
            widest,
            has_token,
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// End-of-sequence token, if the model names one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Beginning-of-sequence token, if the model names one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Id of a token given in its vocabulary spelling (e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// Whether `id` is a control token (never shown as text).
    pub fn is_special(&self, id: u32) -> bool {
        self.is_special.get(id as usize).copied().unwrap_or(false)
    }

    /// A lower bound on `encode(text).len()`, found in one cheap pass
    /// instead of encoding: every byte that has a token of its own ends up
    /// in some token, and no token stands for more bytes than the
    /// vocabulary's longest, so a text too long for the context can be
    /// refused before the work of encoding it.
    pub fn fewest_tokens(&self, text: &str) -> usize {
        let bos = usize::from(self.add_bos && self.bos.is_some());
        let kept = text.bytes().filter(|b| self.has_token[*b as usize]).count();
        kept.div_ceil(self.widest) + bos
    }

    /// Encodes text. Special tokens written in the text (such as
    /// `<|im_start|>`) become their ids, so a rendered chat prompt encodes as
    /// the model expects; the BOS token is prepended when the model asks for it.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            out.push(bos);
        }
        // Next occurrence of each special token at or after `from`, found
        // again only once passed: linear in the text for each special token.
        let mut next: Vec<Option<usize>> = self.special.iter().map(|(s, _)| text.find(s.as_str())).collect();
        let mut from = 0;
        while from < text.len() {
            let mut best: Option<(usize, usize, u32)> = None;
            for ((s, id), cached) in self.special.iter().zip(next.iter_mut()) {
                if cached.is_some_and(|at| at < from) {
                    *cached = text[from..].find(s.as_str()).map(|at| from + at);
                }
                if let Some(at) = *cached
                    && best.is_none_or(|(b, len, _)| at < b || (at == b && s.len() > len))
                {
                    best = Some((at, s.len(), *id));
                }
            }
            let end = best.map_or(text.len(), |(at, _, _)| at);
            pretokenize::split(&text[from..end], self.split_digits, |piece| self.encode_piece(piece, &mut out));
            match best {
                Some((at, len, id)) => {
                    out.push(id);
                    from = at + len;
                }
                None => break,
            }
        }
        out
    }

    fn encode_piece(&self, piece: &str, out: &mut Vec<u32>) {
        let mut mapped = String::with_capacity(piece.len() * 2);
        for &b in piece.as_bytes() {
            mapped.push(self.byte_char[b as usize]);
        }
        if let Some(&id) = self.vocab.get(&mapped) {
            out.push(id);
            return;
        }
        let mut symbols: Vec<u32> = Vec::with_capacity(mapped.len());
        let mut buf = [0u8; 4];
        for c in mapped.chars() {
            // Byte-level vocabularies hold every byte's character; skip any that is absent.
            if let Some(&id) = self.vocab.get(c.encode_utf8(&mut buf) as &str) {
                symbols.push(id);
            }
        }
        self.merge(&mut symbols);
        out.extend_from_slice(&symbols);
    }

    /// Applies merges, lowest rank first and leftmost among equals, in
    /// O(n log n): a heap of candidate pairs over a linked list of symbols,
    /// where a candidate whose symbols have changed since is skipped.
    fn merge(&self, symbols: &mut Vec<u32>) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let n = symbols.len();
        if n < 2 {
            return;
        }
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let candidate = |symbols: &[u32], i: usize, j: usize| {
            self.ranks.get(&(symbols[i], symbols[j])).map(|&(rank, _)| Reverse((rank, i, symbols[i], symbols[j])))
        };
        for i in 0..n - 1 {
            heap.extend(candidate(symbols, i, i + 1));
        }
        while let Some(Reverse((_, i, left, right))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j >= n || symbols[i] != left || symbols[j] != right {
                continue;
            }
            let Some(&(_, merged)) = self.ranks.get(&(left, right)) else { continue };
            symbols[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[i] < n {
                prev[next[i]] = i;
                heap.extend(candidate(symbols, i, next[i]));
            }
            if prev[i] < n {
                heap.extend(candidate(symbols, prev[i], i));
            }
        }
        let mut at = 0;
        for i in 0..n {
            if alive[i] {
                symbols[at] = symbols[i];
                at += 1;
            }
        }
        symbols.truncate(at);
    }

    /// Raw bytes of one token (its literal text for special tokens).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Decodes ids to text, replacing invalid UTF-8; special tokens are kept.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Incremental detokenizer: turns a stream of ids into text pieces, holding
/// back bytes of a character split across tokens until it is complete.
#[derive(Debug, Default, Clone)]
pub struct Decoder {
    pending: Vec<u8>,
}

impl Decoder {
    /// Appends the text of `id` to `out`, skipping special tokens.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32, out: &mut String) {
        if tokenizer.is_special(id) {
            return;
        }
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return;
                }
                // An incomplete character at the end waits for the next token.
                Err(e) if e.error_len().is_none() => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    self.pending.drain(..valid);
                    return;
                }
                // An invalid sequence is replaced, and only it: what follows
                // may still be (the start of) a valid character.
                Err(e) => {
                    let end = e.valid_up_to() + e.error_len().unwrap_or(1);
                    out.push_str(&String::from_utf8_lossy(&self.pending[..end]));
                    self.pending.drain(..end);
                }
            }
        }
    }

    /// Flushes held bytes at the end of a stream, replacing invalid ones.
    pub fn finish(&mut self, out: &mut String) {
        if !self.pending.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
    }
}

impl TokenizerSpec {
    /// A vocabulary of `tokens` and nothing else (no merges, no special
    /// tokens), for unit tests.
    #[cfg(test)]
    pub(crate) fn plain(tokens: Vec<String>) -> TokenizerSpec {
        TokenizerSpec {
            tokens,
            merges: Vec::new(),
            special: Vec::new(),
            bos: None,
            eos: None,
            add_bos: false,
            split_digits: false,
        }
    }

    /// Reads a Hugging Face `tokenizer.json` (byte-level BPE only).
    pub fn from_tokenizer_json(json: &serde_json::Value) -> Result<TokenizerSpec, TokenizerError> {
        let model = &json["model"];
        if model["type"].as_str().unwrap_or("BPE") != "BPE" {
            return Err(TokenizerError::Unsupported(format!("model type {} (only BPE is)", model["type"])));
        }
        let vocab =
            model["vocab"].as_object().ok_or_else(|| TokenizerError::Unsupported("model.vocab is missing".into()))?;
        let mut pairs: Vec<(String, u32)> =
            vocab.iter().filter_map(|(k, v)| v.as_u64().map(|id| (k.clone(), id as u32))).collect();
        let mut special = Vec::new();
        for added in json["added_tokens"].as_array().into_iter().flatten() {
            if let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) {
                pairs.push((content.to_string(), id as u32));
                special.push(id as u32);
            }
        }
        let size = pairs.iter().map(|p| p.1 as usize + 1).max().unwrap_or(0);
        let mut tokens = vec![String::new(); size];
        for (t, id) in pairs {
            tokens[id as usize] = t;
        }
        let merges = model["merges"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| match m {
                serde_json::Value::String(s) => s.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())),
                serde_json::Value::Array(ab) => {
                    Some((ab.first()?.as_str()?.to_string(), ab.get(1)?.as_str()?.to_string()))
                }
                _ => None,
            })
            .collect();
        let split_digits = json["pre_tokenizer"].to_string().contains("\"individual_digits\":true");
        Ok(TokenizerSpec { tokens, merges, special, bos: None, eos: None, add_bos: false, split_digits })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_byte_spoils_only_itself_in_a_stream() {
        let spec = TokenizerSpec::plain(byte_chars().iter().map(char::to_string).collect());
        let tokenizer = Tokenizer::new(spec).expect("tokenizer");
        let (mut decoder, mut out) = (Decoder::default(), String::new());
        // A lone lead byte, a space, then 你 (E4 BD A0) split over three tokens.
        for byte in [0xe4u8, 0x20, 0xe4, 0xbd, 0xa0] {
            decoder.push(&tokenizer, u32::from(byte), &mut out);
        }
        decoder.finish(&mut out);
        assert_eq!(out, "\u{fffd} 你");
    }
}
