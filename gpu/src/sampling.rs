//! Choosing the next token from logits: greedy, temperature, top-k, top-p,
//! repetition/frequency/presence penalties, seeded randomness and top-n
//! log-probabilities. Stop conditions live with the sequence (see `batcher`).

use std::collections::HashMap;

/// How a request's tokens are chosen and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 (or less) is greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Seed of the random choice: the same seed and request give the same output.
    pub seed: Option<u64>,
    /// Divides positive (multiplies negative) logits of tokens already in the
    /// prompt or output; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit if it was generated at all.
    pub presence_penalty: f32,
    /// Texts that end generation; the stop text itself is not returned.
    pub stop: Vec<String>,
    /// Tokens that end generation (the model's end-of-sequence token always does).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence token (benchmarks).
    pub ignore_eos: bool,
    /// Return this many most likely alternatives with each token; `None` returns no log-probabilities.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, nothing else.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Why these parameters are unusable, if they are.
    pub fn validate(&self) -> Result<(), String> {
        let finite =
            [self.temperature, self.top_p, self.repetition_penalty, self.frequency_penalty, self.presence_penalty];
        if finite.iter().any(|v| !v.is_finite()) {
            return Err("sampling parameters must be finite numbers".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.01..=100.0).contains(&self.repetition_penalty) {
            return Err(format!("repetition_penalty must be between 0.01 and 100, got {}", self.repetition_penalty));
        }
        if !(0.0..=100.0).contains(&self.temperature) {
            return Err(format!("temperature must be between 0 and 100, got {}", self.temperature));
        }
        if self.logprobs.is_some_and(|n| n > 20) {
            return Err(format!("logprobs must be at most 20, got {}", self.logprobs.unwrap_or(0)));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err("stop strings must not be empty".into());
        }
        Ok(())
    }

    fn penalized(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }
}

/// Log-probabilities reported with one token.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// Log-probability of the chosen token under the model.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// Small, fast, seedable generator (SplitMix64).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Candidates kept before falling back to a full sort for top-p.
const TOP_P_FIRST_CUT: usize = 64;

/// Temperatures below this decode greedily (as in vLLM): dividing logits by
/// them would overflow.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Per-sequence sampling state: the random generator and token counts.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Times each token was generated (for frequency/presence penalties).
    generated: HashMap<u32, u32>,
    /// Distinct tokens of the prompt, sorted (for the repetition penalty).
    prompt: Vec<u32>,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for one sequence; `fallback_seed` is used when the request names none.
    pub fn new(params: SamplingParams, prompt: &[u32], fallback_seed: u64) -> Sampler {
        let seed = params.seed.unwrap_or(fallback_seed);
        let prompt = if params.repetition_penalty != 1.0 {
            let mut distinct = prompt.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            distinct
        } else {
            Vec::new()
        };
        Sampler { params, rng: Rng(seed), generated: HashMap::new(), prompt, candidates: Vec::new() }
    }

    /// The parameters this sampler follows.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether this sampler takes the largest logit and nothing else (no
    /// penalty, no log-probabilities), so that a backend may pick the token
    /// where the logits are (see `Backend::forward_greedy`).
    pub fn is_plain_greedy(&self) -> bool {
        self.greedy() && !self.params.penalized() && self.params.logprobs.is_none()
    }

    /// Records a token chosen elsewhere (by a backend's greedy pick) as
    /// [`Sampler::sample`] records its own.
    pub fn record(&mut self, token: u32) {
        *self.generated.entry(token).or_insert(0) += 1;
    }

    /// Chooses the next token from `logits` (which it may modify) and
    /// records it for the penalties.
    pub fn sample(&mut self, logits: &mut [f32]) -> (u32, Option<Logprobs>) {
        let lse = self.params.logprobs.map(|_| log_sum_exp(logits));
        let top = match (self.params.logprobs, lse) {
            (Some(n), Some(lse)) if n > 0 => top_n(logits, n).into_iter().map(|(i, l)| (i, l - lse)).collect(),
            _ => Vec::new(),
        };
        let raw = lse.map(|lse| (logits.to_vec(), lse));
        if self.params.penalized() {
            self.penalize(logits);
        }
        let token = if self.greedy() { argmax(logits) } else { self.draw(logits) };
        self.record(token);
        let logprobs = raw.map(|(raw, lse)| Logprobs { logprob: raw[token as usize] - lse, top });
        (token, logprobs)
    }

    fn greedy(&self) -> bool {
        self.params.temperature < GREEDY_BELOW || self.params.top_k == 1
    }

    fn penalize(&self, logits: &mut [f32]) {
        let rp = self.params.repetition_penalty;
        let apply_rp = |l: &mut f32| *l = if *l > 0.0 { *l / rp } else { *l * rp };
        if rp != 1.0 {
            // Each token seen once: the prompt's (sorted, distinct) then the
            // generated ones the prompt does not hold.
            let in_prompt = |t: &u32| self.prompt.binary_search(t).is_ok();
            for &t in self.prompt.iter().chain(self.generated.keys().filter(|t| !in_prompt(t))) {
                if let Some(l) = logits.get_mut(t as usize) {
                    apply_rp(l);
                }
            }
        }
        for (&t, &count) in &self.generated {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.params.frequency_penalty * count as f32 + self.params.presence_penalty;
            }
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / self.params.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp())));
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_k = if self.params.top_k == 0 { c.len() } else { self.params.top_k.min(c.len()) };
        let top_p = self.params.top_p;
        if top_k < c.len() {
            c.select_nth_unstable_by(top_k - 1, by_prob);
            c.truncate(top_k);
        }
        if top_p < 1.0 {
            let total: f32 = c.iter().map(|x| x.1).sum();
            let cut = TOP_P_FIRST_CUT.min(c.len());
            if cut < c.len() {
                c.select_nth_unstable_by(cut - 1, by_prob);
            }
            c[..cut].sort_unstable_by(by_prob);
            if c[..cut].iter().map(|x| x.1).sum::<f32>() < top_p * total {
                c.sort_unstable_by(by_prob);
            }
            let mut acc = 0.0;
            let mut keep = c.len();
            for (i, x) in c.iter().enumerate() {
                acc += x.1;
                if acc >= top_p * total {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        let total: f32 = c.iter().map(|x| x.1).sum();
        let mut r = self.rng.next_f32() * total;
        for &(i, p) in c.iter() {
            if r < p {
                return i;
            }
            r -= p;
        }
        c.last().map(|x| x.0).unwrap_or(0)
    }
}

/// Index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln()
}

/// The `n` largest logits, best first.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, &l) in logits.iter().enumerate() {
        if best.len() < n || l > best[best.len() - 1].1 {
            let at = best.partition_point(|x| x.1 >= l);
            best.insert(at, (i as u32, l));
            best.truncate(n);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect()
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[], 1);
        let l = logits();
        assert_eq!(s.sample(&mut l.clone()).0, argmax(&l));
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_limits_the_choice() {
        let params = SamplingParams { temperature: 1.0, top_k: 5, seed: Some(7), ..SamplingParams::default() };
        let run = || {
            let mut s = Sampler::new(params.clone(), &[], 0);
            (0..50).map(|_| s.sample(&mut logits()).0).collect::<Vec<_>>()
        };
        let (a, b) = (run(), run());
        assert_eq!(a, b);
        let top5: Vec<u32> = top_n(&logits(), 5).into_iter().map(|x| x.0).collect();
        assert!(a.iter().all(|t| top5.contains(t)));
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 over 5 candidates should vary");
    }

    #[test]
    fn tiny_top_p_is_greedy_and_logprobs_are_normalised() {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            logprobs: Some(3),
            seed: Some(1),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, &[], 0);
        let (t, lp) = s.sample(&mut logits());
        assert_eq!(t, argmax(&logits()));
        let lp = lp.expect("logprobs asked for");
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, t);
        assert!(lp.logprob < 0.0 && (lp.logprob - lp.top[0].1).abs() < 1e-6);
    }

    #[test]
    fn only_unpenalized_greedy_without_logprobs_is_plain() {
        let plain = |p: SamplingParams| Sampler::new(p, &[], 0).is_plain_greedy();
        assert!(plain(SamplingParams::greedy()));
        assert!(plain(SamplingParams { temperature: 0.7, top_k: 1, ..SamplingParams::default() }));
        assert!(!plain(SamplingParams { logprobs: Some(0), ..SamplingParams::default() }));
        assert!(!plain(SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() }));
        assert!(!plain(SamplingParams { temperature: 0.7, ..SamplingParams::default() }));
    }

    #[test]
    fn frequency_penalty_discourages_repeats() {
        let params = SamplingParams { frequency_penalty: 100.0, ..SamplingParams::default() };
        let mut s = Sampler::new(params, &[], 0);
        let first = s.sample(&mut logits()).0;
        let second = s.sample(&mut logits()).0;
        assert_ne!(first, second);
    }
}
