//! The sampler chain on the host: llama.cpp's samplers, stage for stage
//! (`src/llama-sampler.cpp` of the llama.cpp that llama-cpp-python 0.3.36
//! vendors), over a row's candidate tokens.
//!
//! A step starts from every token of the vocabulary with its logit,
//! applies the logit bias, then the stages in order (llama-server's default
//! order is [`DEFAULT_STAGES`]), and draws one token from the softmax of
//! what is left. Each stage keeps llama.cpp's conventions, since its
//! parameters mean what llama-server's do: the filters that need
//! probabilities compute them over the candidates still in the set, `-inf`
//! logits stay in the set (with probability 0), and `min_keep` bounds the
//! filters that take it in llama.cpp (top-p, min-p, typical-p, XTC). Ties
//! at a cut are broken by the lower token id (llama.cpp's partial sort
//! leaves them in no stated order).
//!
//! The chain has no state of its own between steps: penalties and DRY read
//! the row's history (prompt and generated tokens, as llama-server accepts
//! the prompt into its sampler), and the row's random generator drives XTC
//! and the draw.

use std::collections::HashMap;

use rand::{Rng, RngCore};
use serde::{Deserialize, Serialize};

use crate::sampling::SamplingParams;

/// One stage of the chain, by llama-server's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerStage {
    /// Repetition, frequency and presence penalties over the last
    /// `repetition_context_size` tokens.
    Penalties,
    /// DRY ("don't repeat yourself"): penalizes tokens that would extend a
    /// repeat of the history.
    Dry,
    /// Drops tokens more than `top_n_sigma` standard deviations of the
    /// logits below the largest.
    TopNSigma,
    TopK,
    /// Locally typical sampling (`typical_p`).
    #[serde(rename = "typ_p")]
    TypicalP,
    TopP,
    MinP,
    /// Exclude top choices: with probability `xtc_probability`, drops every
    /// token above `xtc_threshold` but the least likely of them.
    Xtc,
    Temperature,
}

/// llama-server's default order.
pub const DEFAULT_STAGES: [SamplerStage; 9] = [
    SamplerStage::Penalties,
    SamplerStage::Dry,
    SamplerStage::TopNSigma,
    SamplerStage::TopK,
    SamplerStage::TypicalP,
    SamplerStage::TopP,
    SamplerStage::MinP,
    SamplerStage::Xtc,
    SamplerStage::Temperature,
];

impl SamplerStage {
    /// llama-server's name (`samplers` in its API).
    pub fn name(self) -> &'static str {
        match self {
            SamplerStage::Penalties => "penalties",
            SamplerStage::Dry => "dry",
            SamplerStage::TopNSigma => "top_n_sigma",
            SamplerStage::TopK => "top_k",
            SamplerStage::TypicalP => "typ_p",
            SamplerStage::TopP => "top_p",
            SamplerStage::MinP => "min_p",
            SamplerStage::Xtc => "xtc",
            SamplerStage::Temperature => "temperature",
        }
    }

    /// The stage named `name` (llama-server's names; `typical_p` too).
    pub fn from_name(name: &str) -> Option<SamplerStage> {
        let name = name.trim();
        DEFAULT_STAGES.into_iter().find(|s| s.name() == name).or(match name {
            "typical_p" | "typical" => Some(SamplerStage::TypicalP),
            "temp" => Some(SamplerStage::Temperature),
            _ => None,
        })
    }
}

/// A candidate token and its logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub logit: f32,
}

/// The candidates of one step; `sorted` when they are in descending order
/// of logit (ties by id).
#[derive(Debug, Clone, Default)]
pub struct Candidates {
    pub items: Vec<Candidate>,
    pub sorted: bool,
}

impl Candidates {
    /// Every token of a vocabulary, by id.
    pub fn from_logits(logits: &[f32]) -> Self {
        Candidates { items: logits.iter().enumerate().map(|(id, &logit)| Candidate { id: id as u32, logit }).collect(), sorted: false }
    }

    /// The softmax of the candidates' logits, in their order (llama.cpp's:
    /// minus the largest, `expf`, over the f32 sum).
    pub fn probabilities(&self) -> Vec<f32> {
        let max = self.items.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
        let e: Vec<f32> = self.items.iter().map(|c| (c.logit - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        e.into_iter().map(|x| x / sum).collect()
    }

    fn sort(&mut self) {
        if !self.sorted {
            self.items.sort_unstable_by(descending);
            self.sorted = true;
        }
    }

    /// Keeps the `k` largest, sorted.
    fn keep_largest(&mut self, k: usize) {
        if !self.sorted && k < self.items.len() {
            if k > 0 {
                self.items.select_nth_unstable_by(k - 1, descending);
            }
            self.items.truncate(k);
        }
        self.sort();
        self.items.truncate(k);
    }
}

fn descending(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// DRY's sequence breakers as token sequences: for each head token, the
/// tails that complete a breaker after it (empty: the token holds one).
/// Built once per tokenizer and breaker list ([`DryBreakers::new`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DryBreakers {
    by_head: HashMap<u32, Vec<Vec<u32>>>,
}

/// llama.cpp's limits on a breaker: its first 40 bytes, tails of at most 20 tokens.
const DRY_MAX_BREAKER_BYTES: usize = 40;
const DRY_MAX_TAIL_TOKENS: usize = 20;

impl DryBreakers {
    /// The breakers over a vocabulary: `piece(id)` is token id's text (its
    /// bytes, special tokens rendered), `tokenize(text)` the tokens of a
    /// text without special tokens. As llama.cpp: a token whose text holds
    /// a breaker is a whole breaker; a token whose text ends with the start
    /// of one heads the rest of it, tokenized.
    pub fn new(
        breakers: &[String],
        vocab: usize,
        piece: impl Fn(u32) -> Vec<u8>,
        tokenize: impl Fn(&[u8]) -> Vec<u32>,
    ) -> DryBreakers {
        let mut by_head: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        let breakers: Vec<&[u8]> = breakers
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| &b.as_bytes()[..b.len().min(DRY_MAX_BREAKER_BYTES)])
            .collect();
        if breakers.is_empty() {
            return DryBreakers { by_head };
        }
        for id in 0..vocab as u32 {
            let word = piece(id);
            for &breaker in &breakers {
                let mut add = |tail: Vec<u32>| {
                    let tails = by_head.entry(id).or_default();
                    if !tails.contains(&tail) {
                        tails.push(tail);
                    }
                };
                if word.windows(breaker.len()).any(|w| w == breaker) {
                    add(Vec::new());
                    continue;
                }
                for pos in (0..word.len()).filter(|&p| word[p] == breaker[0]) {
                    // The word's end from pos on starts the breaker.
                    let overlap = (word.len() - pos).min(breaker.len());
                    if word[pos..pos + overlap] == breaker[..overlap] {
                        let mut tail = tokenize(&breaker[overlap..]);
                        tail.truncate(DRY_MAX_TAIL_TOKENS);
                        add(tail);
                    }
                }
            }
        }
        DryBreakers { by_head }
    }

    /// Breakers given directly as token sequences (head, then tail).
    pub fn from_sequences(sequences: &[Vec<u32>]) -> DryBreakers {
        let mut by_head: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for s in sequences.iter().filter(|s| !s.is_empty()) {
            let mut tail = s[1..].to_vec();
            tail.truncate(DRY_MAX_TAIL_TOKENS);
            let tails = by_head.entry(s[0]).or_default();
            if !tails.contains(&tail) {
                tails.push(tail);
            }
        }
        DryBreakers { by_head }
    }

    fn is_single_token(&self, id: u32) -> bool {
        self.by_head.get(&id).is_some_and(|tails| tails.iter().any(Vec::is_empty))
    }
}

/// Applies one stage to `c`; `history` is the row's tokens so far (prompt
/// and generated), `rng` its generator (XTC draws from it).
pub fn apply_stage(
    stage: SamplerStage,
    p: &SamplingParams,
    c: &mut Candidates,
    history: &[u32],
    dry: &DryBreakers,
    rng: &mut dyn RngCore,
) {
    match stage {
        SamplerStage::Penalties => penalties(p, c, history),
        SamplerStage::Dry => dry_penalty(p, c, history, dry),
        SamplerStage::TopNSigma => top_n_sigma(p.top_n_sigma, c),
        SamplerStage::TopK => {
            if p.top_k > 0 {
                c.keep_largest((p.top_k as usize).min(c.items.len()));
            }
        }
        SamplerStage::TypicalP => typical(p.typical_p, p.min_keep, c),
        SamplerStage::TopP => top_p(p.top_p, p.min_keep, c),
        SamplerStage::MinP => min_p(p.min_p, p.min_keep, c),
        SamplerStage::Xtc => xtc(p, c, rng),
        SamplerStage::Temperature => temperature(p.temperature, c),
    }
}

/// The stages `p` runs, in order: its `samplers`, else [`DEFAULT_STAGES`].
pub fn stages(p: &SamplingParams) -> &[SamplerStage] {
    p.samplers.as_deref().unwrap_or(&DEFAULT_STAGES)
}

/// Adds each bias to its token's logit.
pub fn apply_logit_bias(bias: &[(u32, f32)], c: &mut Candidates) {
    if bias.is_empty() {
        return;
    }
    for item in c.items.iter_mut() {
        for &(id, b) in bias {
            if item.id == id {
                item.logit += b;
            }
        }
    }
    c.sorted = false;
}

/// The logit bias, every stage, then a draw: the chosen token.
pub fn sample(p: &SamplingParams, logits: &[f32], history: &[u32], dry: &DryBreakers, rng: &mut dyn RngCore) -> u32 {
    sample_with_candidates(p, logits, history, dry, rng).0
}

/// [`sample`], with the candidates the token was drawn from.
pub fn sample_with_candidates(
    p: &SamplingParams,
    logits: &[f32],
    history: &[u32],
    dry: &DryBreakers,
    rng: &mut dyn RngCore,
) -> (u32, Candidates) {
    let c = distribution(p, logits, history, dry, rng);
    (draw(&c, rng), c)
}

/// The candidates the chain leaves, before the draw.
pub fn distribution(p: &SamplingParams, logits: &[f32], history: &[u32], dry: &DryBreakers, rng: &mut dyn RngCore) -> Candidates {
    let mut c = Candidates::from_logits(logits);
    if !p.logit_bias.is_empty() {
        apply_logit_bias(&p.logit_bias, &mut c);
    }
    for &stage in stages(p) {
        apply_stage(stage, p, &mut c, history, dry, rng);
    }
    c
}

/// llama.cpp's `dist`: one uniform draw in [0, 1) against the cumulative
/// softmax (in f64), in the candidates' order.
pub fn draw(c: &Candidates, rng: &mut dyn RngCore) -> u32 {
    match c.items.len() {
        0 => return 0,
        1 => {
            let _: f64 = rng.random();
            return c.items[0].id;
        }
        _ => {}
    }
    let max = c.items.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.logit));
    let e: Vec<f32> = c.items.iter().map(|x| (x.logit - max).exp()).collect();
    let sum: f64 = e.iter().map(|&x| x as f64).sum();
    let target = sum * rng.random::<f64>();
    let mut run = 0.0f64;
    for (item, &x) in c.items.iter().zip(&e) {
        run += x as f64;
        if run >= target && x > 0.0 {
            return item.id;
        }
    }
    c.items.iter().zip(&e).rev().find(|(_, &x)| x > 0.0).map_or(c.items[0].id, |(i, _)| i.id)
}

fn penalties(p: &SamplingParams, c: &mut Candidates, history: &[u32]) {
    let off = p.repetition_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0;
    if off || p.repetition_context_size == 0 {
        return;
    }
    let window = &history[history.len().saturating_sub(p.repetition_context_size)..];
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &t in window {
        *counts.entry(t).or_default() += 1;
    }
    for item in c.items.iter_mut() {
        let Some(&count) = counts.get(&item.id) else { continue };
        if item.logit <= 0.0 {
            item.logit *= p.repetition_penalty;
        } else {
            item.logit /= p.repetition_penalty;
        }
        item.logit -= count as f32 * p.frequency_penalty + p.presence_penalty;
    }
    c.sorted = false;
}

fn top_n_sigma(n: f32, c: &mut Candidates) {
    if n <= 0.0 || c.items.len() <= 1 {
        return;
    }
    let mut max = c.items[0].logit;
    let (mut sum, mut count) = (0.0f32, 0usize);
    for x in c.items.iter().filter(|x| x.logit != f32::NEG_INFINITY) {
        max = max.max(x.logit);
        sum += x.logit;
        count += 1;
    }
    let mean = if count > 0 { sum / count as f32 } else { 0.0 };
    let mut acc = 0.0f32;
    for x in c.items.iter().filter(|x| x.logit != f32::NEG_INFINITY) {
        acc += (x.logit - mean) * (x.logit - mean);
    }
    let std = if count > 0 { (acc / count as f32).sqrt() } else { 0.0 };
    for x in c.items.iter_mut() {
        if x.logit < max - n * std {
            x.logit = f32::NEG_INFINITY;
        }
    }
}

fn top_p(top_p: f32, min_keep: usize, c: &mut Candidates) {
    if top_p >= 1.0 || c.items.is_empty() {
        return;
    }
    c.sort();
    let probs = c.probabilities();
    let mut cumulative = 0.0f32;
    let mut last = c.items.len();
    for (i, &pr) in probs.iter().enumerate() {
        cumulative += pr;
        if cumulative >= top_p && i + 1 >= min_keep {
            last = i + 1;
            break;
        }
    }
    c.items.truncate(last);
}

fn min_p(min_p: f32, min_keep: usize, c: &mut Candidates) {
    if min_p <= 0.0 || c.items.is_empty() {
        return;
    }
    let max = c.items.iter().fold(f32::MIN, |m, x| m.max(x.logit));
    let min_logit = max + min_p.ln();
    let kept = c.items.iter().filter(|x| x.logit >= min_logit).count();
    if !c.sorted && kept > 0 && kept >= min_keep {
        c.items.retain(|x| x.logit >= min_logit);
        return;
    }
    c.sort();
    let min_logit = c.items[0].logit + min_p.ln();
    let mut i = 1;
    while i < c.items.len() && !(c.items[i].logit < min_logit && i >= min_keep) {
        i += 1;
    }
    c.items.truncate(i);
}

fn typical(typical_p: f32, min_keep: usize, c: &mut Candidates) {
    if typical_p >= 1.0 || c.items.is_empty() {
        return;
    }
    c.sort();
    let probs = c.probabilities();
    // A token of probability 0 (a -inf logit) adds nothing to the entropy
    // and is the least typical (llama.cpp's entropy turns NaN there).
    let entropy: f32 = probs.iter().filter(|&&p| p > 0.0).map(|&p| -p * p.ln()).sum();
    let shifted: Vec<f32> = probs.iter().map(|&p| if p > 0.0 { (-p.ln() - entropy).abs() } else { f32::INFINITY }).collect();
    let mut order: Vec<usize> = (0..c.items.len()).collect();
    order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]).then(a.cmp(&b)));
    let mut cumulative = 0.0f32;
    let mut last = order.len();
    for (i, &idx) in order.iter().enumerate() {
        cumulative += probs[idx];
        if cumulative > typical_p && (min_keep == 0 || i + 1 >= min_keep) {
            last = i + 1;
            break;
        }
    }
    c.items = order[..last].iter().map(|&i| c.items[i]).collect();
    c.sorted = false;
}

fn xtc(p: &SamplingParams, c: &mut Candidates, rng: &mut dyn RngCore) {
    if p.xtc_probability <= 0.0 || p.xtc_threshold > 0.5 || c.items.len() < 2 {
        return;
    }
    let chance: f32 = rng.random();
    if chance > p.xtc_probability {
        return;
    }
    c.sort();
    let probs = c.probabilities();
    let mut last_above = 0;
    for (i, &pr) in probs.iter().enumerate() {
        if pr >= p.xtc_threshold {
            last_above = i;
        } else {
            break;
        }
    }
    if c.items.len() - last_above >= p.min_keep && last_above > 0 {
        c.items.drain(..last_above);
    }
}

fn temperature(t: f32, c: &mut Candidates) {
    if c.items.is_empty() {
        return;
    }
    if t <= 0.0 {
        // Only the largest logit (the first of equals) stays finite.
        let mut best = 0;
        for i in 1..c.items.len() {
            if c.items[i].logit > c.items[best].logit {
                best = i;
            }
        }
        for (i, x) in c.items.iter_mut().enumerate() {
            if i != best {
                x.logit = f32::NEG_INFINITY;
            }
        }
        return;
    }
    for x in c.items.iter_mut() {
        x.logit /= t;
    }
}

fn dry_penalty(p: &SamplingParams, c: &mut Candidates, history: &[u32], breakers: &DryBreakers) {
    let last_n = p.dry_penalty_last_n.unwrap_or(history.len());
    if p.dry_multiplier == 0.0 || p.dry_base < 1.0 || last_n == 0 {
        return;
    }
    let n = history.len().min(last_n);
    if n <= p.dry_allowed_length {
        return;
    }
    // at(i): the token i places from the end (0 = the latest).
    let tail = &history[history.len() - n..];
    let at = |i: usize| tail[n - 1 - i];

    // A breaker limits how far back a repeat may reach: the nearest one from the end.
    let mut limit = n;
    for i in 0..n {
        let Some(tails) = breakers.by_head.get(&at(i)) else { continue };
        let longest = tails
            .iter()
            .filter(|t| t.len() <= i && (0..t.len()).all(|o| t[o] == at(i - o - 1)))
            .map(Vec::len)
            .max();
        if let Some(len) = longest {
            limit = i - len;
            break;
        }
    }
    if limit < p.dry_allowed_length {
        return;
    }

    // repeat[n - 1 - k]: how many tokens ending k places before the end
    // match the last ones (the reversed Z-algorithm), at most `limit`.
    let mut repeat = vec![0usize; n];
    let (mut lt, mut rt) = (0usize, 0usize);
    for k in 1..n {
        if k > rt {
            let mut m = 0;
            while m + k < n && at(m) == at(m + k) {
                m += 1;
            }
            repeat[n - 1 - k] = m.min(limit);
            if m > 0 {
                lt = k;
                rt = k + m - 1;
            }
        } else {
            let pair = k - lt;
            let right = rt - k + 1;
            if repeat[n - 1 - pair] < right {
                repeat[n - 1 - k] = repeat[n - 1 - pair].min(limit);
            } else {
                let mut i = rt + 1;
                while i < n && at(i) == at(i - k) {
                    i += 1;
                }
                repeat[n - 1 - k] = (i - k).min(limit);
                lt = k;
                rt = i - 1;
            }
        }
    }

    // The longest repeat each next token would extend.
    let mut extends: HashMap<u32, usize> = HashMap::new();
    for (i, &len) in repeat.iter().enumerate().take(n - 1) {
        if len >= p.dry_allowed_length {
            let token = at(n - 2 - i);
            let e = extends.entry(token).or_insert(len);
            *e = (*e).max(len);
        }
    }
    let max_exponent = if p.dry_base > 1.000001 { (88.722_84f32 / p.dry_base.ln()) as usize } else { 0 };
    for x in c.items.iter_mut() {
        let Some(&len) = extends.get(&x.id) else { continue };
        if breakers.is_single_token(x.id) {
            continue;
        }
        let mut exponent = len - p.dry_allowed_length;
        if max_exponent > 0 && exponent > max_exponent {
            exponent = max_exponent;
        }
        x.logit -= p.dry_multiplier * p.dry_base.powi(exponent as i32);
    }
    c.sorted = false;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params() -> SamplingParams {
        SamplingParams { temperature: 1.0, repetition_context_size: 64, ..Default::default() }
    }

    fn ids(c: &Candidates) -> Vec<u32> {
        let mut v: Vec<u32> = c.items.iter().filter(|x| x.logit > f32::NEG_INFINITY).map(|x| x.id).collect();
        v.sort();
        v
    }

    #[test]
    fn stage_names_round_trip() {
        for s in DEFAULT_STAGES {
            assert_eq!(SamplerStage::from_name(s.name()), Some(s));
        }
        assert_eq!(SamplerStage::from_name("typical_p"), Some(SamplerStage::TypicalP));
        assert_eq!(SamplerStage::from_name("mirostat"), None);
    }

    #[test]
    fn filters_keep_what_llama_cpp_keeps() {
        let logits = [3.0, 1.0, 2.0, 0.0, 2.0];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let run = |p: SamplingParams, stage: SamplerStage, rng: &mut dyn RngCore| {
            let mut c = Candidates::from_logits(&logits);
            apply_stage(stage, &p, &mut c, &[], &DryBreakers::default(), rng);
            ids(&c)
        };
        // Ties at the cut go to the lower id.
        assert_eq!(run(SamplingParams { top_k: 2, ..params() }, SamplerStage::TopK, &mut rng), [0, 2]);
        // p = 0.47, 0.17, 0.17, 0.06, 0.02 (by id 0, 2, 4, 1, 3): 0.47 + 0.17 + 0.17 >= 0.8.
        assert_eq!(run(SamplingParams { top_p: 0.8, ..params() }, SamplerStage::TopP, &mut rng), [0, 2, 4]);
        assert_eq!(run(SamplingParams { top_p: 0.1, min_keep: 2, ..params() }, SamplerStage::TopP, &mut rng), [0, 2]);
        // min_p 0.3: logits >= 3 + ln 0.3 = 1.80.
        assert_eq!(run(SamplingParams { min_p: 0.3, ..params() }, SamplerStage::MinP, &mut rng), [0, 2, 4]);
        assert_eq!(run(SamplingParams { temperature: 0.0, ..params() }, SamplerStage::Temperature, &mut rng), [0]);
        // Mean 1.6, std 1.02: at least 3 - 1.02 = 1.98, or 3 - 0.51.
        assert_eq!(run(SamplingParams { top_n_sigma: 1.0, ..params() }, SamplerStage::TopNSigma, &mut rng), [0, 2, 4]);
        assert_eq!(run(SamplingParams { top_n_sigma: 0.5, ..params() }, SamplerStage::TopNSigma, &mut rng), [0]);
    }

    #[test]
    fn penalties_follow_llama_cpp() {
        let p = SamplingParams { repetition_penalty: 2.0, frequency_penalty: 0.5, presence_penalty: 0.25, ..params() };
        let mut c = Candidates::from_logits(&[4.0, -1.0, 1.0]);
        apply_stage(SamplerStage::Penalties, &p, &mut c, &[0, 0, 1], &DryBreakers::default(), &mut rand_chacha::ChaCha8Rng::seed_from_u64(0));
        let got: Vec<f32> = c.items.iter().map(|x| x.logit).collect();
        assert_eq!(got, [4.0 / 2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn dry_penalizes_the_token_that_extends_a_repeat() {
        // a b c x a b -> c would extend "a b" (length 2) to 3.
        let p = SamplingParams { dry_multiplier: 1.0, dry_base: 2.0, dry_allowed_length: 2, ..params() };
        let history = [1, 2, 3, 9, 1, 2];
        let mut c = Candidates::from_logits(&[0.0; 10]);
        apply_stage(SamplerStage::Dry, &p, &mut c, &history, &DryBreakers::default(), &mut rand_chacha::ChaCha8Rng::seed_from_u64(0));
        let penalized: Vec<(u32, f32)> = c.items.iter().filter(|x| x.logit != 0.0).map(|x| (x.id, x.logit)).collect();
        assert_eq!(penalized, [(3, -1.0)]);
        // A breaker between them stops the repeat.
        let breakers = DryBreakers::from_sequences(&[vec![9]]);
        let history = [1, 2, 9, 3, 1, 2, 9, 3];
        let mut c = Candidates::from_logits(&[0.0; 10]);
        apply_stage(SamplerStage::Dry, &p, &mut c, &history, &breakers, &mut rand_chacha::ChaCha8Rng::seed_from_u64(0));
        assert!(c.items.iter().all(|x| x.logit == 0.0), "{:?}", c.items);
    }

    #[test]
    fn seeded_draws_are_reproducible_and_follow_the_distribution() {
        let p = params();
        let logits = [0.0, (3.0f32).ln(), f32::NEG_INFINITY];
        let draws = |seed| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            (0..4000).map(|_| sample(&p, &logits, &[], &DryBreakers::default(), &mut rng)).collect::<Vec<_>>()
        };
        let a = draws(7);
        assert_eq!(a, draws(7));
        assert!(a.iter().all(|&t| t < 2));
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }
}
