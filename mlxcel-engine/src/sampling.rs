//! Token sampling. Greedy and plain temperature sampling (with or without
//! a repetition penalty) run on the device, queued with the forward pass;
//! any other setting runs llama.cpp's sampler chain on the host
//! ([`crate::sampler_chain`]) over the row's logits.

use std::sync::Arc;

use mlx_sys::{concatenate, random, where_, Array, Dtype};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::sampler_chain::{self, Candidates, DryBreakers, SamplerStage, DEFAULT_STAGES};
use crate::speculative::{self, Speculation, MAX_DRAFT_TOKENS};
use mlxcel_grammar::{Constraint, TokenMatcher};

/// How to pick each next token and when to stop.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens (1 = off).
    pub repetition_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repetition_context_size: usize,
    /// Seed for reproducible sampling; `None` draws one from the clock.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    /// Generation stops before the first occurrence of any of these.
    pub stop: Vec<String>,
    /// Subtracted from a recent token's logit once per time it occurs in
    /// the last `repetition_context_size` tokens (0 = off).
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token in the last
    /// `repetition_context_size` tokens (0 = off).
    pub presence_penalty: f32,
    /// DRY: a token that would extend a repeat of n >= `dry_allowed_length`
    /// tokens of the history loses `dry_multiplier * dry_base^(n -
    /// dry_allowed_length)` (0 = off).
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: usize,
    /// Tokens of history DRY looks at; None: all of them (llama-server's -1).
    pub dry_penalty_last_n: Option<usize>,
    /// Repeats do not reach across these strings.
    pub dry_sequence_breakers: Vec<String>,
    /// Keep tokens within `top_n_sigma` standard deviations of the largest
    /// logit (<= 0 = off).
    pub top_n_sigma: f32,
    /// Locally typical sampling: keep the tokens closest to the expected
    /// surprise up to this probability mass (1 = off).
    pub typical_p: f32,
    /// XTC: with this probability per token, drop every token at least
    /// `xtc_threshold` likely but the least likely of them (0 = off).
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// The filters that can (top-p, min-p, typical-p, XTC) keep at least
    /// this many tokens.
    pub min_keep: usize,
    /// Added to these tokens' logits before every stage (`-inf` bans one).
    pub logit_bias: Vec<(u32, f32)>,
    /// The chain's stages in order; None: llama-server's
    /// ([`DEFAULT_STAGES`]). A stage left out does not run.
    pub samplers: Option<Vec<SamplerStage>>,
    /// Report each generated token's log-probability and the `n` most
    /// likely alternatives (n <= 20; 0: the chosen token's only); None: off.
    pub logprobs: Option<usize>,
    /// Report them from the distribution the token was drawn from (after
    /// the penalties, the filters and the temperature: llama-server's
    /// `post_sampling_probs`); false (the default) reports the model's own
    /// distribution, the log-softmax of its logits.
    pub post_sampling_probs: bool,
    /// Speculative decoding: off (the default), prompt lookup, or the
    /// engine's draft model. The tokens are those of plain decoding (greedy
    /// or seeded), except with a draft model at temperature > 0, where they
    /// keep the target's distribution (see [`crate::speculative`]).
    pub speculation: Speculation,
    /// The most tokens one draft proposes (1..=14, llama-server's
    /// `speculative.n_max`); the engine drafts fewer, or none, where
    /// drafts are rarely accepted.
    pub draft_max: usize,
    /// The fewest tokens a round drafts (llama-server's `speculative.n_min`):
    /// above 0 it overrides the adaptive policy, which would otherwise draft
    /// none where drafting does not pay; a prompt-lookup draft shorter than
    /// this is not verified.
    pub draft_min: usize,
    /// Structured output: the text of a JSON schema the output follows
    /// (compact JSON unless its `x-guidance` says otherwise), a regular
    /// expression it matches, or a Lark grammar (llguidance's dialect)
    /// it belongs to; at most one. A row's allowed tokens are masked before
    /// the sampler chain, and forced tokens are verified in one pass.
    pub json_schema: Option<String>,
    pub regex: Option<String>,
    pub grammar: Option<String>,
}

/// The most alternatives a token's logprobs report.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability and the most likely alternatives
/// (most likely first), as [`SamplingParams::logprobs`] asks.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_context_size: 20,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: None,
            dry_sequence_breakers: DEFAULT_DRY_SEQUENCE_BREAKERS.iter().map(|s| s.to_string()).collect(),
            top_n_sigma: -1.0,
            typical_p: 1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            min_keep: 0,
            logit_bias: Vec::new(),
            samplers: None,
            logprobs: None,
            post_sampling_probs: false,
            speculation: Speculation::Off,
            draft_max: 8,
            draft_min: 0,
            json_schema: None,
            regex: None,
            grammar: None,
        }
    }
}

/// llama-server's DRY sequence breakers.
pub const DEFAULT_DRY_SEQUENCE_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

fn invalid(name: &'static str, message: String) -> Error {
    Error::InvalidParameter { name, message }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(invalid("temperature", format!("must be a finite number >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(invalid("repetition_penalty", format!("must be > 0, got {}", self.repetition_penalty)));
        }
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1".into()));
        }
        for (name, value) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !value.is_finite() {
                return Err(invalid(name, format!("must be a finite number, got {value}")));
            }
        }
        if !self.dry_multiplier.is_finite() || self.dry_multiplier < 0.0 {
            return Err(invalid("dry_multiplier", format!("must be a finite number >= 0, got {}", self.dry_multiplier)));
        }
        if !self.dry_base.is_finite() || self.dry_base < 1.0 {
            return Err(invalid("dry_base", format!("must be a finite number >= 1, got {}", self.dry_base)));
        }
        if self.dry_allowed_length == 0 {
            return Err(invalid("dry_allowed_length", "must be at least 1".into()));
        }
        if !self.top_n_sigma.is_finite() {
            return Err(invalid("top_n_sigma", format!("must be a finite number (<= 0 = off), got {}", self.top_n_sigma)));
        }
        if !(self.typical_p > 0.0 && self.typical_p <= 1.0) {
            return Err(invalid("typical_p", format!("must be in (0, 1], got {}", self.typical_p)));
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return Err(invalid("xtc_probability", format!("must be in [0, 1], got {}", self.xtc_probability)));
        }
        if !(0.0..=1.0).contains(&self.xtc_threshold) {
            return Err(invalid("xtc_threshold", format!("must be in [0, 1] (above 0.5 turns XTC off), got {}", self.xtc_threshold)));
        }
        if let Some(&(id, bias)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || *b == f32::INFINITY) {
            return Err(invalid("logit_bias", format!("the bias of token {id} must be a number or -inf, got {bias}")));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(invalid("logprobs", format!("at most {MAX_TOP_LOGPROBS} alternatives, got {n}")));
        }
        if !(1..=MAX_DRAFT_TOKENS).contains(&self.draft_max) {
            return Err(invalid("draft_max", format!("must be in [1, {MAX_DRAFT_TOKENS}], got {}", self.draft_max)));
        }
        if self.draft_min > self.draft_max {
            return Err(invalid("draft_min", format!("must be at most draft_max ({}), got {}", self.draft_max, self.draft_min)));
        }
        let given: Vec<&str> = [("json_schema", &self.json_schema), ("regex", &self.regex), ("grammar", &self.grammar)]
            .into_iter()
            .filter_map(|(name, v)| v.is_some().then_some(name))
            .collect();
        if given.len() > 1 {
            return Err(invalid(given[1], format!("at most one of json_schema, regex and grammar (got {})", given.join(" and "))));
        }
        if let Some(stages) = &self.samplers {
            if let Some(s) = stages.iter().enumerate().find_map(|(i, s)| stages[..i].contains(s).then_some(s)) {
                return Err(invalid("samplers", format!("lists {} twice", s.name())));
            }
        }
        Ok(())
    }

    /// Whether the device's sampler serves these parameters: greedy, or
    /// temperature alone, with at most a repetition penalty. Anything else
    /// runs the host chain.
    pub fn on_device(&self) -> bool {
        if self.constraint().is_some() {
            return false;
        }
        let filters = self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0;
        let chain_only = self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.dry_multiplier > 0.0
            || self.top_n_sigma > 0.0
            || self.typical_p < 1.0
            || self.xtc_probability > 0.0
            || !self.logit_bias.is_empty()
            || self.samplers.as_deref().is_some_and(|s| s != DEFAULT_STAGES);
        // Rejection sampling needs the target's distribution on the host.
        let rejection = self.speculation == Speculation::Draft && self.temperature > 0.0;
        !chain_only && !rejection && (self.temperature == 0.0 || !filters)
    }
}

impl SamplingParams {
    /// The structured-output constraint these parameters give, if any.
    pub fn constraint(&self) -> Option<Constraint> {
        let (schema, regex, grammar) = (self.json_schema.clone(), self.regex.clone(), self.grammar.clone());
        schema.map(Constraint::JsonSchema).or(regex.map(Constraint::Regex)).or(grammar.map(Constraint::Lark))
    }
}

/// The host chain of one row: its generator, DRY breakers and
/// structured-output matcher.
struct HostChain {
    rng: ChaCha8Rng,
    dry: Arc<DryBreakers>,
    matcher: Option<TokenMatcher>,
    /// The request option the matcher's constraint came from, for its errors.
    constraint_option: &'static str,
    /// Time spent computing masks.
    mask_time: std::time::Duration,
}

impl HostChain {
    /// `values` with the tokens the matcher does not allow at -inf (a
    /// copy; unconstrained rows borrow them as they are).
    fn masked<'v>(&mut self, values: &'v [f32]) -> Result<std::borrow::Cow<'v, [f32]>> {
        let option = self.constraint_option;
        let Some(matcher) = self.matcher.as_mut() else { return Ok(values.into()) };
        let started = std::time::Instant::now();
        let mask = matcher.allowed().map_err(|e| Error::constraint(option, e))?;
        let mut masked = values.to_vec();
        for (id, v) in masked.iter_mut().enumerate() {
            if !mask.is_allowed(id as u32) {
                *v = f32::NEG_INFINITY;
            }
        }
        self.mask_time += started.elapsed();
        Ok(masked.into())
    }

    /// Moves the matcher past a sampled `token` (the end-of-sequence token
    /// a complete output may still draw leaves it as it is).
    fn advance(&mut self, token: u32) -> Result<()> {
        let option = self.constraint_option;
        match self.matcher.as_mut() {
            Some(m) if !m.is_complete() => m.consume(token).map_err(|e| Error::constraint(option, e)),
            _ => Ok(()),
        }
    }
}

/// Samples from [1, vocab] float32 logits; holds the PRNG key (device) or
/// the row's generator (host chain).
pub(crate) struct Sampler {
    params: SamplingParams,
    key: Array,
    host: Option<HostChain>,
}

impl Sampler {
    /// `dry` gives the DRY breakers for a list of strings (built from the
    /// model's tokenizer, cached by the caller); only called when DRY is on.
    pub fn new(params: &SamplingParams, dry: impl FnOnce(&[String]) -> Arc<DryBreakers>) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        let host = (!params.on_device()).then(|| HostChain {
            rng: ChaCha8Rng::seed_from_u64(seed),
            dry: if params.dry_multiplier > 0.0 { dry(&params.dry_sequence_breakers) } else { Arc::default() },
            matcher: None,
            constraint_option: "json_schema",
            mask_time: std::time::Duration::ZERO,
        });
        Ok(Sampler { params: params.clone(), key: random::key(seed)?, host })
    }

    /// The next token as a [1] uint32 array (lazy on the device path), and
    /// its logprobs when the parameters ask for them. `history` is the
    /// row's tokens before `input`'s last one (the token the logits follow;
    /// lazy at decode).
    pub fn sample(&mut self, logits: &Array, history: &[u32], input: &Array) -> Result<Sampled> {
        if let Some(host) = self.host.as_mut() {
            let last = input.reshape(&[-1])?;
            let n = last.dim(0);
            let last = last.slice_axis(0, n - 1, n)?.astype(Dtype::Uint32)?.item::<u32>()?;
            let mut tokens = Vec::with_capacity(history.len() + 1);
            tokens.extend_from_slice(history);
            tokens.push(last);
            let values = logits.astype(Dtype::Float32)?.reshape(&[-1])?.to_vec::<f32>()?;
            let allowed = host.masked(&values)?;
            let (token, after) = sampler_chain::sample_with_candidates(&self.params, &allowed, &tokens, &host.dry, &mut host.rng);
            host.advance(token)?;
            let logprobs = self.host_logprobs(&values, &after, token);
            return Ok(Sampled { token: Array::from_slice(&[token], &[1])?, logprobs });
        }
        let recent = recent_for(&self.params, history, input)?;
        let p = &self.params;
        let mut logits = logits.astype(Dtype::Float32)?;
        let raw = logits.clone();
        if let (Some(recent), true) = (recent.as_ref(), p.repetition_penalty != 1.0) {
            logits = apply_repetition_penalty(&logits, recent, p.repetition_penalty)?;
        }
        let token = self.sample_on_device(&logits)?;
        let logprobs = match self.params.logprobs {
            None => None,
            Some(n) => {
                let p = &self.params;
                let scores = if !p.post_sampling_probs {
                    raw
                } else if p.temperature == 0.0 {
                    // Greedy draws from a point mass.
                    let none = Array::scalar(f64::NEG_INFINITY, Dtype::Float32)?.broadcast_to(&logits.shape())?;
                    let at = token.astype(Dtype::Int32)?.reshape(&[1, 1])?;
                    none.put_along_axis(&at, &Array::scalar(0.0, Dtype::Float32)?.reshape(&[1, 1])?, -1)?
                } else {
                    logits.mul_scalar(1.0 / p.temperature as f64)?
                };
                Some(device_logprobs(&scores, &token, n)?)
            }
        };
        Ok(Sampled { token, logprobs })
    }

    /// The logprobs of `token`, when asked for: from the chain's candidates
    /// `after` (post-sampling) or the model's log-softmax of `values`.
    fn host_logprobs(&self, values: &[f32], after: &Candidates, token: u32) -> Option<PendingLogprobs> {
        self.params.logprobs.map(|n| {
            if self.params.post_sampling_probs {
                let ids: Vec<u32> = after.items.iter().map(|c| c.id).collect();
                let lp: Vec<f32> = after.probabilities().iter().map(|p| p.ln()).collect();
                PendingLogprobs::Host(host_logprobs(&ids, &lp, token, n))
            } else {
                let max = values.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let lse = max + values.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
                let lp: Vec<f32> = values.iter().map(|&x| x - lse).collect();
                let ids: Vec<u32> = (0..values.len() as u32).collect();
                PendingLogprobs::Host(host_logprobs(&ids, &lp, token, n))
            }
        })
    }

    /// Sample-and-match verification: `logits` [L, vocab] follow `inputs`
    /// (the row's next input token, then its L - 1 draft tokens) after
    /// `history`. Each position is sampled exactly as a decode step would
    /// sample it, in order, until a sample differs from the draft token at
    /// that position; returns the emitted tokens (the agreed drafts, then
    /// the target's own token) and their logprobs. The generator (host
    /// chain) or the key chain (device) advances once per emitted token, so
    /// the tokens are those of decoding without speculation.
    pub fn verify(&mut self, logits: &Array, history: &[u32], inputs: &[u32]) -> Result<Vec<(u32, Option<PendingLogprobs>)>> {
        let length = inputs.len();
        let mut known = Vec::with_capacity(history.len() + length);
        known.extend_from_slice(history);
        let mut emitted = Vec::with_capacity(length);
        if self.host.is_some() {
            let values = logits.astype(Dtype::Float32)?.reshape(&[length as i32, -1])?.to_vec::<f32>()?;
            let vocab = values.len() / length;
            for (i, &input) in inputs.iter().enumerate() {
                known.push(input);
                let row = &values[i * vocab..(i + 1) * vocab];
                let host = self.host.as_mut().expect("host chain");
                let allowed = host.masked(row)?;
                let (token, after) = sampler_chain::sample_with_candidates(&self.params, &allowed, &known, &host.dry, &mut host.rng);
                host.advance(token)?;
                let logprobs = self.host_logprobs(row, &after, token);
                emitted.push((token, logprobs));
                if inputs.get(i + 1) != Some(&token) {
                    break;
                }
            }
            return Ok(emitted);
        }
        // Device: every position sampled lazily with the next key of the
        // chain, read back once; the key then moves past the emitted ones.
        let mut keys = vec![self.key.clone()];
        let mut sampled = Vec::with_capacity(length);
        for (i, &input) in inputs.iter().enumerate() {
            let row = logits.reshape(&[length as i32, -1])?.slice_axis(0, i as i32, i as i32 + 1)?;
            let input = Array::from_slice(&[input], &[1])?;
            sampled.push(self.sample(&row, &known, &input)?);
            known.push(inputs[i]);
            keys.push(self.key.clone());
        }
        queue_sampled_eval(&sampled)?;
        for (i, s) in sampled.into_iter().enumerate() {
            let token = s.token.astype(Dtype::Uint32)?.to_vec::<u32>()?[0];
            emitted.push((token, s.logprobs));
            if inputs.get(i + 1) != Some(&token) {
                break;
            }
        }
        self.key = keys[emitted.len()].clone();
        Ok(emitted)
    }

    /// Rejection-sampling verification for a draft model at temperature >
    /// 0 (host chain): `drafts[i]` was drawn from `q[i]`, the draft model's
    /// distribution after the same chain; see [`crate::speculative`].
    pub fn verify_rejection(&mut self, logits: &Array, history: &[u32], inputs: &[u32], q: &[Vec<f32>]) -> Result<Vec<(u32, Option<PendingLogprobs>)>> {
        let length = inputs.len();
        let values = logits.astype(Dtype::Float32)?.reshape(&[length as i32, -1])?.to_vec::<f32>()?;
        let vocab = values.len() / length;
        let mut known = history.to_vec();
        let mut emitted = Vec::with_capacity(length);
        for (i, &input) in inputs.iter().enumerate() {
            known.push(input);
            let row = &values[i * vocab..(i + 1) * vocab];
            let host = self.host.as_mut().ok_or_else(|| invalid("speculation", "rejection sampling runs on the host chain".into()))?;
            let allowed = host.masked(row)?;
            let after = sampler_chain::distribution(&self.params, &allowed, &known, &host.dry, &mut host.rng);
            let p = speculative::dense_probabilities(&after, vocab);
            let (token, done) = match (inputs.get(i + 1), q.get(i)) {
                (Some(&draft), Some(q)) => match speculative::accept_or_resample(&p, q, draft, &mut host.rng) {
                    Ok(()) => (draft, false),
                    Err(token) => (token, true),
                },
                _ => (speculative::draw_dense(&p, &mut host.rng), true),
            };
            self.host.as_mut().expect("host chain").advance(token)?;
            let logprobs = self.host_logprobs(row, &after, token);
            emitted.push((token, logprobs));
            if done {
                break;
            }
        }
        Ok(emitted)
    }

    /// The draft model's distribution for one position under this row's
    /// chain (host chain rows), drawn with the drafter's own generator.
    pub fn draft_distribution(&self, values: &[f32], tokens: &[u32], rng: &mut dyn rand::RngCore) -> Result<Candidates> {
        let host = self.host.as_ref().ok_or_else(|| invalid("speculation", "draft sampling runs on the host chain".into()))?;
        Ok(sampler_chain::distribution(&self.params, values, tokens, &host.dry, rng))
    }

    /// Constrains this row's output with `matcher`, compiled from the
    /// request option `option` (host chain rows only: parameters with a
    /// constraint never run on the device).
    pub fn constrain(&mut self, matcher: TokenMatcher, option: &'static str) {
        if let Some(host) = self.host.as_mut() {
            host.matcher = Some(matcher);
            host.constraint_option = option;
        }
    }

    pub fn is_constrained(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.matcher.is_some())
    }

    /// The tokens the row's constraint forces after those sampled so far.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        match self.host.as_mut().and_then(|h| h.matcher.as_mut()) {
            Some(m) if !m.is_complete() => m.forced(),
            _ => Vec::new(),
        }
    }

    /// Time this row spent computing structured-output masks.
    pub fn mask_time(&self) -> std::time::Duration {
        self.host.as_ref().map_or(std::time::Duration::ZERO, |h| h.mask_time)
    }

    /// Greedy or temperature sampling on the device from penalized logits.
    fn sample_on_device(&mut self, logits: &Array) -> Result<Array> {
        let p = &self.params;
        if p.temperature == 0.0 {
            return Ok(logits.argmax(-1, false)?);
        }
        let parts = random::split(&self.key, 2)?;
        self.key = parts[0].clone();
        Ok(random::categorical(&logits.mul_scalar(1.0 / p.temperature as f64)?, -1, &parts[1])?)
    }
}

fn apply_repetition_penalty(logits: &Array, recent: &Array, penalty: f32) -> Result<Array> {
    let index = recent.astype(Dtype::Int32)?.reshape(&[1, -1])?;
    let selected = logits.take_along_axis(&index, -1)?;
    let zero = Array::scalar(0.0, Dtype::Float32)?;
    let penalized = where_(
        &selected.less(&zero)?,
        &selected.mul_scalar(penalty as f64)?,
        &selected.mul_scalar(1.0 / penalty as f64)?,
    )?;
    Ok(logits.put_along_axis(&index, &penalized, -1)?)
}

/// A sampled token (a [1] uint32 array) and its logprobs when asked for.
pub(crate) struct Sampled {
    pub token: Array,
    pub logprobs: Option<PendingLogprobs>,
}

/// A token's logprobs, computed (host chain) or queued on the device.
pub(crate) enum PendingLogprobs {
    Host(TokenLogprobs),
    Device { chosen: Array, ids: Array, values: Array },
}

impl PendingLogprobs {
    /// Reads them back; `token` is the token they belong to.
    pub fn resolve(self, token: u32) -> Result<TokenLogprobs> {
        match self {
            PendingLogprobs::Host(l) => Ok(l),
            PendingLogprobs::Device { chosen, ids, values } => {
                // Read as they are (`to_vec` flattens): a reshape would be a
                // new node, queued behind the step submitted since.
                let logprob = chosen.to_vec::<f32>()?[0];
                let ids = ids.astype(Dtype::Uint32)?.to_vec::<u32>()?;
                let values = values.to_vec::<f32>()?;
                let mut top: Vec<(u32, f32)> = ids.into_iter().zip(values).filter(|p| p.1 > f32::NEG_INFINITY).collect();
                top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                Ok(TokenLogprobs { token, logprob, top })
            }
        }
    }

    /// The arrays to evaluate with the token.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            PendingLogprobs::Host(_) => Vec::new(),
            PendingLogprobs::Device { chosen, ids, values } => vec![chosen, ids, values],
        }
    }
}

/// Evaluates sampled tokens and their logprobs.
fn queue_sampled_eval(sampled: &[Sampled]) -> Result<()> {
    let arrays: Vec<&Array> = sampled.iter().flat_map(|s| std::iter::once(&s.token).chain(s.logprobs.iter().flat_map(|l| l.arrays()))).collect();
    Ok(mlx_sys::eval(arrays)?)
}

/// The log-softmax of `scores` ([1, vocab]) at `token` and its `n` largest, queued.
fn device_logprobs(scores: &Array, token: &Array, n: usize) -> Result<PendingLogprobs> {
    let lp = scores.subtract(&scores.logsumexp(&[-1], true)?)?;
    let chosen = lp.take_along_axis(&token.astype(Dtype::Int32)?.reshape(&[1, 1])?, -1)?;
    let vocab = lp.dim(-1);
    let n = (n as i32).min(vocab);
    let (ids, values) = if n == 0 {
        (Array::from_slice::<u32>(&[], &[0])?, Array::from_slice::<f32>(&[], &[0])?)
    } else {
        let ids = lp.negative()?.argpartition(n - 1, -1)?.slice_axis(-1, 0, n)?;
        let values = lp.take_along_axis(&ids, -1)?;
        (ids, values)
    };
    Ok(PendingLogprobs::Device { chosen, ids, values })
}

/// `token`'s logprob and the `n` largest of `lp` (over `ids`).
fn host_logprobs(ids: &[u32], lp: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let logprob = ids.iter().position(|&i| i == token).map_or(f32::NEG_INFINITY, |i| lp[i]);
    let mut order: Vec<usize> = (0..ids.len()).filter(|&i| lp[i] > f32::NEG_INFINITY).collect();
    let k = n.min(order.len());
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]).then(ids[a].cmp(&ids[b])));
    }
    order.truncate(k);
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(ids[a].cmp(&ids[b])));
    TokenLogprobs { token, logprob, top: order.into_iter().map(|i| (ids[i], lp[i])).collect() }
}

/// The repetition penalty's window: `history` followed by the last token of
/// `input` (lazy), or None when the penalty is off.
fn recent_for(params: &SamplingParams, history: &[u32], input: &Array) -> Result<Option<Array>> {
    if params.repetition_penalty == 1.0 {
        return Ok(None);
    }
    let prev = input.reshape(&[-1])?;
    let n = prev.dim(0);
    Ok(Some(recent_tokens(history, &prev.slice_axis(0, n - 1, n)?, params.repetition_context_size)?))
}

/// The last `n` tokens of the host history followed by the lazy `latest`.
pub(crate) fn recent_tokens(history: &[u32], latest: &Array, n: usize) -> Result<Array> {
    let tail = &history[history.len().saturating_sub(n.saturating_sub(1))..];
    let latest = latest.reshape(&[1])?.astype(Dtype::Uint32)?;
    if tail.is_empty() {
        return Ok(latest);
    }
    Ok(concatenate(&[Array::from_slice(tail, &[tail.len() as i32])?, latest], 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(v: &[f32]) -> Array {
        Array::from_slice(v, &[1, v.len() as i32]).unwrap()
    }

    fn sample_many(params: SamplingParams, l: &Array, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(&params, |_| Arc::default()).unwrap();
        let input = Array::from_slice(&[0u32], &[1]).unwrap();
        (0..n).map(|_| s.sample(l, &[], &input).unwrap().token.to_vec::<u32>().unwrap()[0]).collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let params = SamplingParams::default();
        assert_eq!(sample_many(params, &logits(&[0.1, 3.0, 2.0]), 3), [1, 1, 1]);
    }

    #[test]
    fn seeded_sampling_is_reproducible() {
        let l = logits(&[1.0, 1.1, 0.9, 1.05]);
        let params = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        let a = sample_many(params.clone(), &l, 32);
        assert_eq!(a, sample_many(params, &l, 32));
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "{a:?}");
    }

    #[test]
    fn filters_remove_unlikely_tokens() {
        let l = logits(&[5.0, 4.0, 0.0, -1.0]);
        let base = SamplingParams { temperature: 5.0, seed: Some(1), ..Default::default() };
        let top_k = sample_many(SamplingParams { top_k: 2, ..base.clone() }, &l, 64);
        assert!(top_k.iter().all(|&t| t < 2), "{top_k:?}");
        // p(0) ≈ 0.72, p(1) ≈ 0.27: top_p 0.5 keeps only token 0.
        let top_p = sample_many(SamplingParams { top_p: 0.5, temperature: 1.0, ..base.clone() }, &l, 64);
        assert!(top_p.iter().all(|&t| t == 0), "{top_p:?}");
        // min_p 0.2 keeps tokens with p >= 0.2 p(0): tokens 0 and 1.
        let min_p = sample_many(SamplingParams { min_p: 0.2, ..base }, &l, 64);
        assert!(min_p.iter().all(|&t| t < 2), "{min_p:?}");
        assert!(min_p.contains(&1));
    }

    #[test]
    fn repetition_penalty_demotes_recent_tokens() {
        let params = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::new(&params, |_| Arc::default()).unwrap();
        let input = Array::from_slice(&[0u32], &[1]).unwrap();
        let token = s.sample(&logits(&[3.0, 2.0, -1.0]), &[], &input).unwrap().token;
        assert_eq!(token.to_vec::<u32>().unwrap(), [1]);
    }

    #[test]
    fn invalid_parameters_are_named() {
        let bad = [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { max_tokens: 0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
        ];
        let names: Vec<_> = bad
            .iter()
            .map(|p| match p.validate() {
                Err(Error::InvalidParameter { name, .. }) => name,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(names, ["temperature", "top_p", "min_p", "repetition_penalty", "max_tokens", "temperature"]);
    }
}
