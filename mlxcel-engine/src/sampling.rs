//! Token sampling on the device: greedy, or temperature with top-k, top-p
//! and min-p filters (in mlx-lm's order), plus a repetition penalty.

use mlx_sys::{concatenate, random, where_, Array, Dtype};

use crate::error::{Error, Result};

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
        }
    }
}

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
        Ok(())
    }
}

/// Samples from [1, vocab] float32 logits; holds the PRNG key.
pub(crate) struct Sampler {
    params: SamplingParams,
    key: Array,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(Sampler { params: params.clone(), key: random::key(seed)? })
    }

    /// The next token as a lazy [1] uint32 array. `recent` holds the recent
    /// token ids for the repetition penalty (may include lazy tokens).
    pub fn sample(&mut self, logits: &Array, recent: Option<&Array>) -> Result<Array> {
        let p = &self.params;
        let mut logits = logits.astype(Dtype::Float32)?;
        if let (Some(recent), true) = (recent, p.repetition_penalty != 1.0) {
            logits = apply_repetition_penalty(&logits, recent, p.repetition_penalty)?;
        }
        if p.temperature == 0.0 {
            return Ok(logits.argmax(-1, false)?);
        }
        let mut logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
        if p.top_p < 1.0 {
            logprobs = apply_top_p(&logprobs, p.top_p)?;
        }
        if p.min_p > 0.0 {
            logprobs = apply_min_p(&logprobs, p.min_p)?;
        }
        if p.top_k > 0 && (p.top_k as i32) < logprobs.dim(-1) {
            logprobs = apply_top_k(&logprobs, p.top_k as i32)?;
        }
        let parts = random::split(&self.key, 2)?;
        self.key = parts[0].clone();
        Ok(random::categorical(&logprobs.mul_scalar(1.0 / p.temperature as f64)?, -1, &parts[1])?)
    }
}

fn neg_inf_like(x: &Array) -> Result<Array> {
    Ok(Array::scalar(f64::NEG_INFINITY, x.dtype())?)
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

/// Keeps the most likely tokens whose cumulative probability exceeds `top_p`.
fn apply_top_p(logprobs: &Array, top_p: f32) -> Result<Array> {
    let order = logprobs.argsort(-1)?; // ascending
    let sorted = logprobs.take_along_axis(&order, -1)?;
    let cumulative = sorted.exp()?.cumsum(-1, false, true)?;
    let threshold = Array::scalar(1.0 - top_p as f64, Dtype::Float32)?;
    let kept_sorted = where_(&cumulative.greater(&threshold)?, &sorted, &neg_inf_like(&sorted)?)?;
    // Scatter back to vocabulary order.
    Ok(logprobs.put_along_axis(&order, &kept_sorted, -1)?)
}

fn apply_min_p(logprobs: &Array, min_p: f32) -> Result<Array> {
    let threshold = logprobs.max(&[-1], true)?.add_scalar((min_p as f64).ln())?;
    Ok(where_(&logprobs.less(&threshold)?, &neg_inf_like(logprobs)?, logprobs)?)
}

fn apply_top_k(logprobs: &Array, k: i32) -> Result<Array> {
    let vocab = logprobs.dim(-1);
    // Indices of everything but the k largest.
    let order = logprobs.negative()?.argpartition(k - 1, -1)?;
    let dropped = order.slice_axis(-1, k, vocab)?;
    let fill = neg_inf_like(logprobs)?.broadcast_to(&dropped.shape())?;
    Ok(logprobs.put_along_axis(&dropped, &fill, -1)?)
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
        let mut s = Sampler::new(&params).unwrap();
        (0..n).map(|_| s.sample(l, None).unwrap().to_vec::<u32>().unwrap()[0]).collect()
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
        let mut s = Sampler::new(&params).unwrap();
        let recent = Array::from_slice(&[0u32], &[1]).unwrap();
        let token = s.sample(&logits(&[3.0, 2.0, -1.0]), Some(&recent)).unwrap();
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
