//! The one place that holds a generation's defaults, ranges and error
//! messages for every front end (C ABI, Python, Node): each builds a
//! [`GenerationOptions`] from its own arguments, unchecked, and calls
//! [`GenerationOptions::request`].

use std::fmt::Display;

use crate::error::{Error, Result};
use crate::generate::{GenerationRequest, Prompt};
use crate::sampler_chain::{SamplerStage, DEFAULT_STAGES};
use crate::sampling::SamplingParams;
use crate::speculative::{Speculation, MAX_DRAFT_TOKENS};

/// Prompt tokens evaluated per forward pass during prefill, unless a request says otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// A generation's settings in wide types (signed 64-bit counts, f64 reals,
/// a 128-bit seed), so that any front end's numbers fit unchanged and the
/// range checks happen here. `Default` gives the defaults every surface
/// documents.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOptions {
    pub max_tokens: i64,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub min_p: f64,
    pub repetition_penalty: f64,
    pub repetition_context_size: i64,
    /// `None` draws a seed from the clock.
    pub seed: Option<i128>,
    pub stop: Vec<String>,
    pub prefill_chunk: i64,
    // The host chain's options (see `SamplingParams`), llama-server's names.
    pub frequency_penalty: f64,
    pub presence_penalty: f64,
    pub dry_multiplier: f64,
    pub dry_base: f64,
    pub dry_allowed_length: i64,
    /// -1: the whole history.
    pub dry_penalty_last_n: i64,
    /// None: the default breakers.
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub top_n_sigma: f64,
    pub typical_p: f64,
    pub xtc_probability: f64,
    pub xtc_threshold: f64,
    pub min_keep: i64,
    /// (token id, bias) pairs.
    pub logit_bias: Vec<(i128, f64)>,
    /// Stage names in order (`penalties`, `dry`, `top_n_sigma`, `top_k`,
    /// `typ_p`, `top_p`, `min_p`, `xtc`, `temperature`), each entry one or
    /// several separated by `;`; None: that order.
    pub samplers: Option<Vec<String>>,
    /// Report each token's logprob and this many alternatives (0..=20).
    pub logprobs: Option<i64>,
    /// From the distribution after the sampler chain (default: the model's).
    pub post_sampling_probs: bool,
    /// `off`, `prompt-lookup` or `draft`; None: off.
    pub speculation: Option<String>,
    pub draft_max: i64,
    pub draft_min: i64,
    /// Structured output (at most one): a JSON schema's text, a regular
    /// expression, a Lark grammar.
    pub json_schema: Option<String>,
    pub regex: Option<String>,
    pub grammar: Option<String>,
}

impl Default for GenerationOptions {
    fn default() -> Self {
        let d = SamplingParams::default();
        GenerationOptions {
            max_tokens: d.max_tokens as i64,
            temperature: d.temperature as f64,
            top_p: d.top_p as f64,
            top_k: d.top_k as i64,
            min_p: d.min_p as f64,
            repetition_penalty: d.repetition_penalty as f64,
            repetition_context_size: d.repetition_context_size as i64,
            seed: d.seed.map(i128::from),
            stop: d.stop,
            prefill_chunk: DEFAULT_PREFILL_CHUNK as i64,
            frequency_penalty: d.frequency_penalty as f64,
            presence_penalty: d.presence_penalty as f64,
            dry_multiplier: d.dry_multiplier as f64,
            dry_base: shortest(d.dry_base),
            dry_allowed_length: d.dry_allowed_length as i64,
            dry_penalty_last_n: d.dry_penalty_last_n.map_or(-1, |n| n as i64),
            dry_sequence_breakers: None,
            top_n_sigma: d.top_n_sigma as f64,
            typical_p: d.typical_p as f64,
            xtc_probability: d.xtc_probability as f64,
            xtc_threshold: shortest(d.xtc_threshold),
            min_keep: d.min_keep as i64,
            logit_bias: Vec::new(),
            samplers: None,
            logprobs: None,
            post_sampling_probs: false,
            speculation: None,
            draft_max: d.draft_max as i64,
            draft_min: d.draft_min as i64,
            json_schema: None,
            regex: None,
            grammar: None,
        }
    }
}

/// An f32 default as the f64 it reads as (0.1, not 0.10000000149011612).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// The integer options: name, smallest and largest value, and the range as the message states it.
const INTEGER_RANGES: [(&str, i128, i128, &str); 19] = [
    ("max_tokens", 1, i64::MAX as i128, "an integer >= 1"),
    ("top_k", 0, u32::MAX as i128, "an integer in [0, 2**32) (0 = off)"),
    ("repetition_context_size", 0, i64::MAX as i128, "an integer >= 0"),
    ("seed", 0, u64::MAX as i128, "an integer in [0, 2**64)"),
    ("prefill_chunk", 1, i64::MAX as i128, "an integer >= 1"),
    ("dry_allowed_length", 1, i64::MAX as i128, "an integer >= 1"),
    ("dry_penalty_last_n", -1, i64::MAX as i128, "an integer >= -1 (-1 = the whole history)"),
    ("min_keep", 0, i64::MAX as i128, "an integer >= 0"),
    ("logit_bias", 0, u32::MAX as i128, "a token id in [0, 2**32)"),
    ("logprobs", 0, 20, "an integer in [0, 20] (alternatives per token)"),
    ("draft_max", 1, MAX_DRAFT_TOKENS as i128, "an integer in [1, 14]"),
    ("draft_min", 0, MAX_DRAFT_TOKENS as i128, "an integer in [0, 14]"),
    // Load options (`EngineLimits`), checked with the same rules.
    ("kv_pool_bytes", 1 << 20, u64::MAX as i128, "an integer >= 1048576 (1 MiB)"),
    ("max_kv_size", 1, i32::MAX as i128, "an integer in [1, 2**31)"),
    ("kv_keep", 0, i32::MAX as i128 - 1, "an integer in [0, 2**31 - 1)"),
    ("max_rows", 1, crate::scheduler::MAX_ROWS as i128, "an integer in [1, 32]"),
    ("kv_bits", 8, 8, "8 (8-bit keys and values, group 64, as mlx-lm's kv_bits), or unset for f32"),
    ("q_bits", 2, 8, "one of [2, 3, 4, 5, 6, 8]"),
    ("q_group_size", 32, 128, "one of [32, 64, 128]"),
];

fn integer_range(name: &str) -> (i128, i128, &'static str) {
    let (_, min, max, text) = INTEGER_RANGES.iter().find(|r| r.0 == name).copied().expect("an integer option");
    (min, max, text)
}

impl GenerationOptions {
    /// The error for an integer option `name` whose value `shown` is out of
    /// its range, or cannot even be represented by the caller's conversion
    /// (e.g. a Python int beyond 128 bits).
    pub fn out_of_range(name: &'static str, shown: impl Display) -> Error {
        let (_, _, range) = integer_range(name);
        Error::InvalidParameter { name, message: format!("must be {range}, got {shown}") }
    }

    /// An integer option given as a float (JavaScript numbers): it must be a
    /// whole number; the range is checked by [`validate`](Self::validate).
    pub fn whole_number(name: &'static str, value: f64) -> Result<i128> {
        if value.is_finite() && value.fract() == 0.0 && value.abs() < 2f64.powi(127) {
            Ok(value as i128)
        } else {
            Err(Self::out_of_range(name, value))
        }
    }

    pub(crate) fn integer<T: TryFrom<i128>>(name: &'static str, value: i128) -> Result<T> {
        let (min, max, _) = integer_range(name);
        if (min..=max).contains(&value) {
            T::try_from(value).map_err(|_| Self::out_of_range(name, value))
        } else {
            Err(Self::out_of_range(name, value))
        }
    }

    /// The checked sampling parameters and prefill chunk.
    pub fn validate(&self) -> Result<(SamplingParams, usize)> {
        let params = SamplingParams {
            max_tokens: Self::integer("max_tokens", self.max_tokens.into())?,
            temperature: self.temperature as f32,
            top_p: self.top_p as f32,
            top_k: Self::integer("top_k", self.top_k.into())?,
            min_p: self.min_p as f32,
            repetition_penalty: self.repetition_penalty as f32,
            repetition_context_size: Self::integer("repetition_context_size", self.repetition_context_size.into())?,
            seed: self.seed.map(|seed| Self::integer("seed", seed)).transpose()?,
            stop: self.stop.clone(),
            frequency_penalty: self.frequency_penalty as f32,
            presence_penalty: self.presence_penalty as f32,
            dry_multiplier: self.dry_multiplier as f32,
            dry_base: self.dry_base as f32,
            dry_allowed_length: Self::integer("dry_allowed_length", self.dry_allowed_length.into())?,
            dry_penalty_last_n: usize::try_from(Self::integer::<i64>("dry_penalty_last_n", self.dry_penalty_last_n.into())?).ok(),
            dry_sequence_breakers: self.dry_sequence_breakers.clone().unwrap_or_else(|| SamplingParams::default().dry_sequence_breakers),
            top_n_sigma: self.top_n_sigma as f32,
            typical_p: self.typical_p as f32,
            xtc_probability: self.xtc_probability as f32,
            xtc_threshold: self.xtc_threshold as f32,
            min_keep: Self::integer("min_keep", self.min_keep.into())?,
            logit_bias: self
                .logit_bias
                .iter()
                .map(|&(id, bias)| Ok((Self::integer::<u32>("logit_bias", id)?, bias as f32)))
                .collect::<Result<Vec<_>>>()?,
            samplers: self.samplers.as_ref().map(|names| Self::stages(names)).transpose()?,
            logprobs: self.logprobs.map(|n| Self::integer("logprobs", n.into())).transpose()?,
            post_sampling_probs: self.post_sampling_probs,
            speculation: self.speculation.as_deref().map(Self::speculation).transpose()?.unwrap_or_default(),
            draft_max: Self::integer("draft_max", self.draft_max.into())?,
            draft_min: Self::integer("draft_min", self.draft_min.into())?,
            json_schema: self.json_schema.clone(),
            regex: self.regex.clone(),
            grammar: self.grammar.clone(),
        };
        params.validate()?;
        Ok((params, Self::integer("prefill_chunk", self.prefill_chunk.into())?))
    }

    /// The speculation method named `name`.
    pub fn speculation(name: &str) -> Result<Speculation> {
        Speculation::from_name(name).ok_or_else(|| Error::InvalidParameter {
            name: "speculation",
            message: format!("unknown method {name:?} (known: off, prompt-lookup, draft)"),
        })
    }

    /// The stages named in `names` (llama-server's names); an entry may
    /// hold several, separated by `;` or `,` ("top_k;temperature").
    pub fn stages(names: &[String]) -> Result<Vec<SamplerStage>> {
        names
            .iter()
            .flat_map(|entry| entry.split([';', ',']))
            .filter(|name| !name.trim().is_empty())
            .map(|name| {
                SamplerStage::from_name(name).ok_or_else(|| Error::InvalidParameter {
                    name: "samplers",
                    message: format!(
                        "unknown stage {name:?} (known: {})",
                        DEFAULT_STAGES.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
                    ),
                })
            })
            .collect()
    }

    /// A checked request for `prompt`.
    pub fn request(&self, prompt: Prompt) -> Result<GenerationRequest> {
        let (params, prefill_chunk) = self.validate()?;
        Ok(GenerationRequest { params, prefill_chunk, ..GenerationRequest::new(prompt) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(options: GenerationOptions) -> (Option<&'static str>, String) {
        let e = options.validate().unwrap_err();
        (e.parameter(), e.to_string())
    }

    #[test]
    fn defaults_are_valid_and_match_the_request_defaults() {
        let (params, chunk) = GenerationOptions::default().validate().unwrap();
        let request = GenerationRequest::new(Prompt::Text(String::new()));
        assert_eq!(params, request.params);
        assert_eq!(chunk, request.prefill_chunk);
        assert_eq!(chunk, DEFAULT_PREFILL_CHUNK);
    }

    #[test]
    fn integers_out_of_range_name_the_option_and_the_value() {
        let cases = [
            (GenerationOptions { max_tokens: 0, ..Default::default() }, "max_tokens", "got 0"),
            (GenerationOptions { top_k: -1, ..Default::default() }, "top_k", "got -1"),
            (GenerationOptions { top_k: 1 << 32, ..Default::default() }, "top_k", "got 4294967296"),
            (GenerationOptions { repetition_context_size: -2, ..Default::default() }, "repetition_context_size", "got -2"),
            (GenerationOptions { seed: Some(-1), ..Default::default() }, "seed", "got -1"),
            (GenerationOptions { seed: Some(1 << 64), ..Default::default() }, "seed", "got 18446744073709551616"),
            (GenerationOptions { prefill_chunk: 0, ..Default::default() }, "prefill_chunk", "got 0"),
        ];
        for (options, name, got) in cases {
            let (parameter, message) = error_of(options);
            assert_eq!(parameter, Some(name));
            assert!(message.starts_with(&format!("invalid parameter `{name}`: must be an integer")), "{message}");
            assert!(message.ends_with(got), "{message}");
        }
        assert_eq!(GenerationOptions { seed: Some(u64::MAX as i128), ..Default::default() }.validate().unwrap().0.seed, Some(u64::MAX));
    }

    #[test]
    fn reals_are_checked_by_the_sampling_parameters() {
        let (parameter, message) = error_of(GenerationOptions { temperature: -1.0, ..Default::default() });
        assert_eq!(parameter, Some("temperature"));
        assert_eq!(message, "invalid parameter `temperature`: must be a finite number >= 0, got -1");
        assert_eq!(error_of(GenerationOptions { top_p: 0.0, ..Default::default() }).0, Some("top_p"));
        assert_eq!(error_of(GenerationOptions { temperature: 1e40, ..Default::default() }).0, Some("temperature"));
    }

    #[test]
    fn chain_options_are_checked_and_named() {
        let cases = [
            (GenerationOptions { dry_allowed_length: 0, ..Default::default() }, "dry_allowed_length"),
            (GenerationOptions { dry_penalty_last_n: -2, ..Default::default() }, "dry_penalty_last_n"),
            (GenerationOptions { min_keep: -1, ..Default::default() }, "min_keep"),
            (GenerationOptions { logit_bias: vec![(-1, 1.0)], ..Default::default() }, "logit_bias"),
            (GenerationOptions { logit_bias: vec![(5, f64::NAN)], ..Default::default() }, "logit_bias"),
            (GenerationOptions { samplers: Some(vec!["top_k".into(), "mirostat".into()]), ..Default::default() }, "samplers"),
            (GenerationOptions { samplers: Some(vec!["top_k".into(), "top_k".into()]), ..Default::default() }, "samplers"),
            (GenerationOptions { typical_p: 0.0, ..Default::default() }, "typical_p"),
            (GenerationOptions { xtc_probability: 2.0, ..Default::default() }, "xtc_probability"),
            (GenerationOptions { dry_base: 0.5, ..Default::default() }, "dry_base"),
            (GenerationOptions { frequency_penalty: f64::INFINITY, ..Default::default() }, "frequency_penalty"),
        ];
        for (options, name) in cases {
            assert_eq!(error_of(options.clone()).0, Some(name), "{options:?}");
        }
        let (params, _) = GenerationOptions {
            samplers: Some(vec!["top_k".into(), "temperature".into()]),
            logit_bias: vec![(7, f64::NEG_INFINITY)],
            dry_penalty_last_n: 64,
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert_eq!(params.samplers, Some(vec![SamplerStage::TopK, SamplerStage::Temperature]));
        let joined = GenerationOptions::stages(&["top_k; temperature".into()]).unwrap();
        assert_eq!(joined, [SamplerStage::TopK, SamplerStage::Temperature]);
        assert_eq!(params.logit_bias, [(7, f32::NEG_INFINITY)]);
        assert_eq!(params.dry_penalty_last_n, Some(64));
        assert!(!params.on_device());
    }

    #[test]
    fn whole_numbers_from_floats() {
        assert_eq!(GenerationOptions::whole_number("max_tokens", 8.0).unwrap(), 8);
        for bad in [2.5, f64::NAN, f64::INFINITY] {
            let e = GenerationOptions::whole_number("max_tokens", bad).unwrap_err();
            assert_eq!(e.parameter(), Some("max_tokens"));
        }
        let message = GenerationOptions::whole_number("seed", 0.5).unwrap_err().to_string();
        assert_eq!(message, "invalid parameter `seed`: must be an integer in [0, 2**64), got 0.5");
    }
}
