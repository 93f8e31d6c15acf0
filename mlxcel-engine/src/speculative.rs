//! Speculative decoding: a drafter proposes the next few tokens of a row,
//! the target model scores all of them in one forward pass
//! (`LanguageModel::forward_batch_all`, each position exactly a decode
//! step), and the row keeps the longest prefix the target agrees with plus
//! one token of the target's own. The engine's side is
//! `BatchEngine::verify_rows`; this module holds the drafters, the
//! acceptance rules and the policy that sizes each draft.
//!
//! Acceptance preserves what a row generates:
//! - deterministic drafters (prompt lookup, and a draft model at temperature
//!   0) use sample-and-match: the target samples each position as a plain
//!   decode step would, with the same generator, and a draft token is kept
//!   while it equals the sample. The generator is consumed once per emitted
//!   token, so the tokens are exactly those of decoding without speculation,
//!   greedy or seeded;
//! - a draft model at temperature > 0 uses rejection sampling: draft token
//!   d ~ q is kept with probability min(1, p(d) / q(d)), and on the first
//!   rejection the token is drawn from norm(max(0, p − q)). The output has
//!   the target's distribution, though not the same draws as without
//!   speculation.

use rand::{Rng, RngCore};

use crate::sampler_chain::Candidates;

/// How a request speculates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Speculation {
    /// Plain decoding, one token per step.
    #[default]
    Off,
    /// Drafts are n-gram matches in the row's own prompt and output.
    PromptLookup,
    /// Drafts come from the engine's draft model (`EngineLimits::draft_model`).
    Draft,
}

impl Speculation {
    pub fn name(self) -> &'static str {
        match self {
            Speculation::Off => "off",
            Speculation::PromptLookup => "prompt-lookup",
            Speculation::Draft => "draft",
        }
    }

    pub fn from_name(name: &str) -> Option<Speculation> {
        [Speculation::Off, Speculation::PromptLookup, Speculation::Draft].into_iter().find(|s| s.name() == name)
    }
}

/// The most tokens one draft holds: a verify pass of up to 15 positions
/// runs the decode kernels for every position (quantized linears switch to
/// their GEMM from 16 rows), so verification stays token-identical.
pub const MAX_DRAFT_TOKENS: usize = 14;

/// The longest and shortest n-gram prompt lookup matches.
const LOOKUP_NGRAM_MAX: usize = 3;
const LOOKUP_NGRAM_MIN: usize = 2;

/// Whether [`prompt_lookup`] can find a match for `history` plus any next
/// token: the shortest n-gram's first n − 1 tokens must occur earlier.
/// Checked before the next token is read back, so a row whose text has no
/// repeats never waits on it.
pub fn prompt_lookup_possible(history: &[u32]) -> bool {
    let n = LOOKUP_NGRAM_MIN - 1;
    if history.len() <= n {
        return false;
    }
    let tail = &history[history.len() - n..];
    history[..history.len() - n].windows(n).any(|w| w == tail)
}

/// Up to `max` tokens that followed the most recent earlier occurrence of
/// the last n tokens of `tokens` (n from 3 down to 2), or none.
pub fn prompt_lookup(tokens: &[u32], max: usize) -> Vec<u32> {
    if max == 0 {
        return Vec::new();
    }
    for n in (LOOKUP_NGRAM_MIN..=LOOKUP_NGRAM_MAX).rev() {
        if tokens.len() <= n {
            continue;
        }
        let tail = &tokens[tokens.len() - n..];
        // The latest match first: nearby text predicts best.
        let found = (0..tokens.len() - n).rev().find(|&start| &tokens[start..start + n] == tail);
        if let Some(start) = found {
            let from = start + n;
            let to = (from + max).min(tokens.len());
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

/// A verify pass of L positions costs about `1 + VERIFY_COST_PER_POSITION
/// * (L - 1)` decode steps on the CPU's decode kernels, which stream the
/// weights once for every position (SmolLM2-135M 4-bit on an Intel Xeon:
/// 5.3 ms for one position, 8.7 for 4, 14.0 for 8, 23.3 for 16).
pub const VERIFY_COST_PER_POSITION: f64 = 0.25;

/// The acceptance rate a row starts with, and returns to while it does not draft.
const PRIOR_ACCEPTANCE: f64 = 0.7;

/// Sizes each draft of one row from the acceptance it has seen, so that
/// drafting stops where it does not pay. Deterministic: it reads only the
/// row's own history of accepted tokens, so a row's draws never depend on
/// timing or on other rows.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    /// Running estimate of the chance that a draft token is accepted.
    acceptance: f64,
    /// Decode steps one draft token costs the drafter (0 for prompt lookup).
    draft_cost: f64,
    pub drafted: usize,
    pub accepted: usize,
    pub rounds: usize,
    /// Drafting attempts that found nothing in a row, and the steps left
    /// before the next attempt (1, 2, 4, … up to 16 after each miss).
    misses: u32,
    skip: usize,
}

impl DraftPolicy {
    pub fn new(draft_cost: f64) -> Self {
        DraftPolicy { acceptance: PRIOR_ACCEPTANCE, draft_cost, drafted: 0, accepted: 0, rounds: 0, misses: 0, skip: 0 }
    }

    /// The draft length in 0..=`max` with the most expected tokens per unit
    /// of cost, against one token per step without speculation; 0 when no
    /// length beats plain decoding.
    pub fn length(&self, max: usize) -> usize {
        let a = self.acceptance.clamp(0.0, 0.999);
        let mut best = (1.0, 0);
        let mut run = 1.0;
        let mut expected = 1.0;
        for k in 1..=max {
            run *= a;
            expected += run;
            let cost = 1.0 + VERIFY_COST_PER_POSITION * k as f64 + self.draft_cost * k as f64;
            let rate = expected / cost;
            // Margin: drafting has overheads the model leaves out.
            if rate > best.0 * 1.05 {
                best = (rate, k);
            }
        }
        best.1
    }

    /// Whether this step may try to draft: false while backing off after
    /// attempts that found no draft (each costs a wait for the row's token).
    pub fn due(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// An attempt that found no draft.
    pub fn missed(&mut self) {
        self.misses = (self.misses + 1).min(4);
        self.skip = 1 << self.misses;
    }

    /// After a round in which `accepted` of `drafted` tokens were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.misses = 0;
        self.drafted += drafted;
        self.accepted += accepted;
        self.rounds += 1;
        // The per-token rate that explains this round: a draft stops at its
        // first rejection, so count the rejection once.
        let trials = (accepted + usize::from(accepted < drafted)) as f64;
        let rate = accepted as f64 / trials.max(1.0);
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
    }

    /// A step without a draft: the estimate drifts back towards the prior,
    /// so a row tries again after a while.
    pub fn idle(&mut self) {
        self.acceptance += (PRIOR_ACCEPTANCE - self.acceptance) * 0.02;
    }
}

/// A distribution over the vocabulary from the candidates a sampler chain
/// left (zero elsewhere).
pub fn dense_probabilities(c: &Candidates, vocab: usize) -> Vec<f32> {
    let mut p = vec![0.0f32; vocab];
    for (item, prob) in c.items.iter().zip(c.probabilities()) {
        if let Some(slot) = p.get_mut(item.id as usize) {
            *slot = prob;
        }
    }
    p
}

/// Rejection sampling of one draft token: `Ok(())` keeps `draft` (with
/// probability min(1, p(d) / q(d))), `Err(token)` rejects it, with the
/// token drawn from norm(max(0, p − q)) in its place.
pub fn accept_or_resample(p: &[f32], q: &[f32], draft: u32, rng: &mut dyn RngCore) -> Result<(), u32> {
    let d = draft as usize;
    let (pd, qd) = (p.get(d).copied().unwrap_or(0.0) as f64, q.get(d).copied().unwrap_or(0.0) as f64);
    let u: f64 = rng.random();
    if qd > 0.0 && u < (pd / qd).min(1.0) {
        return Ok(());
    }
    let residual: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (a as f64 - b as f64).max(0.0)).collect();
    Err(draw_from(&residual, p, rng))
}

/// One draw from the unnormalized weights `w`, or from `fallback` when they
/// are all zero (p = q exactly, where a rejection cannot happen).
fn draw_from(w: &[f64], fallback: &[f32], rng: &mut dyn RngCore) -> u32 {
    let mut sum: f64 = w.iter().sum();
    let weights: Vec<f64> = if sum > 0.0 { w.to_vec() } else { fallback.iter().map(|&x| x as f64).collect() };
    if sum <= 0.0 {
        sum = weights.iter().sum();
    }
    let target = sum * rng.random::<f64>();
    let mut run = 0.0;
    for (i, &x) in weights.iter().enumerate() {
        run += x;
        if run >= target && x > 0.0 {
            return i as u32;
        }
    }
    weights.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

/// One draw from a dense distribution.
pub fn draw_dense(p: &[f32], rng: &mut dyn RngCore) -> u32 {
    let w: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    draw_from(&w, p, rng)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn prompt_lookup_continues_the_latest_match() {
        // ... 5 6 7 | 8 9 ... 5 6 7 | 1 2 ... 6 7 → the latest "6 7" is followed by 1 2.
        let tokens = [5, 6, 7, 8, 9, 4, 5, 6, 7, 1, 2, 3, 6, 7];
        assert_eq!(prompt_lookup(&tokens, 3), [1, 2, 3]);
        // The trigram 5 6 7 wins over the bigram when it matches.
        let tokens = [5, 6, 7, 8, 9, 6, 7, 0, 5, 6, 7];
        assert_eq!(prompt_lookup(&tokens, 2), [8, 9]);
        assert_eq!(prompt_lookup(&[1, 2, 3, 4], 4), Vec::<u32>::new());
        assert_eq!(prompt_lookup(&[1, 2, 1, 2], 4), [1, 2]);
        assert_eq!(prompt_lookup(&[1, 2, 1, 2], 0), Vec::<u32>::new());
    }

    #[test]
    fn lookup_is_possible_only_when_the_last_token_repeats() {
        assert!(!prompt_lookup_possible(&[1, 2, 3]));
        assert!(prompt_lookup_possible(&[3, 2, 3]));
        assert!(!prompt_lookup_possible(&[3]));
    }

    #[test]
    fn misses_back_off_exponentially_and_a_round_resets_them() {
        let mut p = DraftPolicy::new(0.0);
        let waits: Vec<usize> = (0..6)
            .map(|_| {
                p.missed();
                let mut waited = 0;
                while !p.due() {
                    waited += 1;
                }
                waited
            })
            .collect();
        assert_eq!(waits, [2, 4, 8, 16, 16, 16]);
        p.record(3, 2);
        p.missed();
        assert!(!p.due() && !p.due() && p.due());
    }

    #[test]
    fn the_policy_drafts_long_when_drafts_are_accepted_and_stops_when_not() {
        let mut good = DraftPolicy::new(0.0);
        for _ in 0..20 {
            good.record(8, 8);
        }
        assert!(good.length(14) >= 8, "{}", good.length(14));
        let mut bad = DraftPolicy::new(0.0);
        for _ in 0..20 {
            bad.record(4, 0);
        }
        assert_eq!(bad.length(14), 0);
        // It tries again after enough idle steps.
        for _ in 0..200 {
            bad.idle();
        }
        assert!(bad.length(14) > 0);
        // An expensive drafter needs a higher acceptance.
        let mut costly = DraftPolicy::new(0.6);
        for _ in 0..20 {
            costly.record(4, 2);
        }
        assert_eq!(costly.length(14), 0);
    }

    #[test]
    fn rejection_sampling_keeps_the_target_distribution() {
        let p = [0.5f32, 0.3, 0.2, 0.0];
        let q = [0.1f32, 0.1, 0.4, 0.4];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut counts = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            let d = draw_dense(&q, &mut rng);
            let token = match accept_or_resample(&p, &q, d, &mut rng) {
                Ok(()) => d,
                Err(t) => t,
            };
            counts[token as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let got = c as f64 / n as f64;
            assert!((got - p[i] as f64).abs() < 0.005, "token {i}: {got} vs {}", p[i]);
        }
    }
}
