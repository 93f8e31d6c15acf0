//! Sentence-embedding checkpoints: an encoder (BERT, or a decoder body such
//! as Qwen3-Embedding's), its tokenizer and the sentence-transformers
//! pipeline after it (`modules.json`: pooling, then L2 normalisation when a
//! `Normalize` module is listed).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::architectures::bert::Bert;
use crate::architectures::LoadContext;
use crate::error::{Error, Result};
use crate::model::{construct_network, open_checkpoint, LanguageModel};
use crate::quantization::QuantizationConfig;
use crate::weights::{Scope, Weights};
use mlx_sys::{Array, Dtype};

/// `model_type`s that load as embedding models, not language models.
pub const EMBEDDING_MODEL_TYPES: &[&str] = &["bert", "xlm-roberta"];

/// Decoder `model_type`s that also load as embedders: the final norm's
/// output pooled (the last token unless `modules.json` says otherwise), as
/// mlx-embeddings runs them (causal attention; its `gemma3_text` and
/// `llama_bidirec` are bidirectional models, not these).
pub const DECODER_EMBEDDING_MODEL_TYPES: &[&str] = &["qwen3"];

/// Whether `config.json` names a sequence-classification model (a cross-encoder).
pub(crate) fn is_cross_encoder(config: &serde_json::Value) -> bool {
    config
        .get("architectures")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|n| n.ends_with("ForSequenceClassification"))))
}

/// How token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the sequence's tokens (sentence-transformers' default).
    Mean,
    /// The first token's state (`[CLS]`).
    Cls,
    /// The last token's state.
    LastToken,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::LastToken => "last_token",
        }
    }
}

/// What turns token ids into per-token states.
enum Encoder {
    /// Bidirectional; sequences run packed in one pass.
    Bert(Bert),
    /// A decoder body without its head; each sequence runs alone over fresh caches.
    Decoder(Box<dyn LanguageModel>),
}

/// A loaded embedding model. Holds only evaluated arrays and an immutable
/// tokenizer: share it between threads freely (`Send + Sync`).
pub struct EmbeddingModel {
    encoder: Encoder,
    tokenizer: tokenizers::Tokenizer,
    pooling: Pooling,
    normalize: bool,
    max_tokens: usize,
    model_type: String,
    dir: PathBuf,
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize, Default)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
}

/// Tokens an input keeps: `sentence_bert_config.json`'s `max_seq_length`,
/// at most the encoder's `positions`.
pub(crate) fn max_tokens(dir: &Path, positions: usize) -> Result<usize> {
    #[derive(Deserialize)]
    struct SentenceConfig {
        max_seq_length: Option<usize>,
    }
    let sentence: Option<SentenceConfig> = read_json(&dir.join("sentence_bert_config.json"))?;
    Ok(sentence.and_then(|s| s.max_seq_length).unwrap_or(usize::MAX).min(positions))
}

/// The checkpoint's `tokenizer.json`, its own padding and truncation (often
/// fixed at 128) replaced: batches run packed, and inputs are cut at
/// `max_tokens` with their special tokens kept, as sentence-transformers does.
pub(crate) fn encoder_tokenizer(dir: &Path, max_tokens: usize) -> Result<tokenizers::Tokenizer> {
    let path = dir.join("tokenizer.json");
    let mut tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| Error::invalid_file(&path, format!("invalid tokenizer: {e}")))?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(Some(tokenizers::TruncationParams { max_length: max_tokens, ..Default::default() }))
        .map_err(|e| Error::invalid_file(&path, format!("truncation at {max_tokens} tokens: {e}")))?;
    Ok(tokenizer)
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|source| Error::Json { path: path.into(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Pooling and normalisation from `modules.json`; `default` pooling and L2
/// normalisation (mlx-embeddings' `text_embeds`) when the file is absent.
fn read_pipeline(dir: &Path, default: Pooling) -> Result<(Pooling, bool)> {
    let modules_path = dir.join("modules.json");
    let Some(modules) = read_json::<Vec<Module>>(&modules_path)? else {
        return Ok((default, true));
    };
    let normalize = modules.iter().any(|m| m.kind.ends_with(".Normalize"));
    let Some(pooling_module) = modules.iter().find(|m| m.kind.ends_with(".Pooling")) else {
        return Ok((default, normalize));
    };
    let path = dir.join(&pooling_module.path).join("config.json");
    let config: PoolingConfig = read_json(&path)?.unwrap_or_default();
    let modes = [
        (config.pooling_mode_mean_tokens, Some(Pooling::Mean), "mean_tokens"),
        (config.pooling_mode_cls_token, Some(Pooling::Cls), "cls_token"),
        (config.pooling_mode_lasttoken, Some(Pooling::LastToken), "lasttoken"),
        (config.pooling_mode_max_tokens, None, "max_tokens"),
        (config.pooling_mode_mean_sqrt_len_tokens, None, "mean_sqrt_len_tokens"),
        (config.pooling_mode_weightedmean_tokens, None, "weightedmean_tokens"),
    ];
    let chosen: Vec<_> = modes.iter().filter(|m| m.0).collect();
    match chosen.as_slice() {
        [] => Ok((default, normalize)),
        [(_, Some(pooling), _)] => Ok((*pooling, normalize)),
        [(_, None, name)] => Err(Error::Unsupported { path, message: format!("pooling_mode_{name} (supported: mean_tokens, cls_token, lasttoken)") }),
        _ => Err(Error::Unsupported {
            path,
            message: format!(
                "{} pooling modes at once ({}); one is supported",
                chosen.len(),
                chosen.iter().map(|m| m.2).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

impl EmbeddingModel {
    /// Loads an embedding checkpoint (`config.json` of a type in
    /// [`EMBEDDING_MODEL_TYPES`] or [`DECODER_EMBEDDING_MODEL_TYPES`],
    /// safetensors, `tokenizer.json`, and the sentence-transformers files
    /// when present).
    pub fn load(dir: &Path) -> Result<EmbeddingModel> {
        let (config, config_path, model_type) = open_checkpoint(dir)?;
        let decoder = DECODER_EMBEDDING_MODEL_TYPES.contains(&model_type.as_str());
        if !decoder && !EMBEDDING_MODEL_TYPES.contains(&model_type.as_str()) {
            let supported = [EMBEDDING_MODEL_TYPES, DECODER_EMBEDDING_MODEL_TYPES].concat().join(", ");
            return Err(Error::UnknownArchitecture { path: config_path, model_type, supported: format!("{supported} (embedding models)") });
        }
        if is_cross_encoder(&config) {
            return Err(Error::Unsupported {
                path: config_path,
                message: "a cross-encoder (a sequence-classification head): load it as a reranker (`mlxcel rerank`)".into(),
            });
        }
        let construct_decoder = if decoder { Some(crate::architectures::constructor(&model_type, &config_path)?) } else { None };
        let quantization = QuantizationConfig::from_config(&config, &config_path)?;
        let mut weights = Weights::load(dir)?;
        let (encoder, positions, default_pooling) = if let Some(construct) = construct_decoder {
            // The body alone, as mlx-embeddings' qwen3 `sanitize` makes it:
            // `model.` before unprefixed names, and no lm_head (skipped if
            // present; the config is read as tied so that none is loaded).
            weights.prefix_missing("model.", &["lm_head."]);
            weights.skip("lm_head.");
            let mut body_config = config.clone();
            body_config["tie_word_embeddings"] = serde_json::Value::Bool(true);
            let network = construct_network(construct, &body_config, &config_path, &weights, &quantization, None)?;
            let positions = network.shape().max_position_embeddings.unwrap_or(usize::MAX);
            (Encoder::Decoder(network), positions, Pooling::LastToken)
        } else {
            let scope = Scope::root(&weights, &quantization, Dtype::Float32);
            let bert = Bert::load(&LoadContext { config: &config, config_path: &config_path, scope }, false)?;
            let positions = bert.max_positions();
            (Encoder::Bert(bert), positions, Pooling::Mean)
        };
        weights.check_all_read(&model_type)?;
        let (pooling, normalize) = read_pipeline(dir, default_pooling)?;
        let max_tokens = max_tokens(dir, positions)?;
        let tokenizer = encoder_tokenizer(dir, max_tokens)?;
        Ok(EmbeddingModel { encoder, tokenizer, pooling, normalize, max_tokens, model_type, dir: dir.to_path_buf() })
    }

    /// Length of the vectors.
    pub fn dims(&self) -> usize {
        match &self.encoder {
            Encoder::Bert(bert) => bert.args().hidden_size as usize,
            Encoder::Decoder(network) => network.shape().hidden_size,
        }
    }

    /// Tokens a text keeps (longer ones are truncated, special tokens kept).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The checkpoint directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A text's token ids, special tokens added, at most [`max_tokens`](Self::max_tokens).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.tokenizer.encode(text, true).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// One vector per token sequence (BERT: in one packed pass; a decoder:
    /// each sequence alone), each the same as that sequence's alone.
    pub fn embed_tokens(&self, sequences: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        if sequences.is_empty() {
            return Ok(Vec::new());
        }
        let pooled = match &self.encoder {
            Encoder::Bert(bert) => {
                let hidden = bert.forward(sequences, None)?;
                let mut pooled = Vec::with_capacity(sequences.len());
                let mut start = 0i32;
                for sequence in sequences {
                    let len = sequence.len() as i32;
                    pooled.push(self.pool(&hidden.slice_axis(0, start, start + len)?)?);
                    start += len;
                }
                pooled
            }
            Encoder::Decoder(network) => {
                let vocab = network.shape().vocab_size;
                sequences
                    .iter()
                    .map(|sequence| {
                        if sequence.is_empty() {
                            return Err(Error::InvalidInput("an empty token sequence has no state to pool".into()));
                        }
                        if let Some(id) = sequence.iter().find(|&&id| id as usize >= vocab) {
                            return Err(Error::InvalidInput(format!("token id {id} is outside the vocabulary of {vocab}")));
                        }
                        let ids: Vec<i32> = sequence.iter().map(|&id| id as i32).collect();
                        let tokens = Array::from_slice(&ids, &[1, ids.len() as i32])?;
                        let hidden = network.forward_hidden(&tokens, &mut network.new_caches())?;
                        self.pool(&hidden.squeeze(0)?.astype(Dtype::Float32)?)
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let mut vectors = mlx_sys::stack(&pooled, 0)?;
        if self.normalize {
            let norm = vectors.square()?.sum(&[1], true)?.sqrt()?;
            vectors = vectors.divide(&norm.maximum(&Array::scalar(1e-9, Dtype::Float32)?)?)?;
        }
        let flat: Vec<f32> = vectors.to_vec()?;
        Ok(flat.chunks(self.dims()).map(<[f32]>::to_vec).collect())
    }

    /// One sequence's states [len, hidden] → its vector [hidden].
    fn pool(&self, states: &Array) -> Result<Array> {
        let len = states.dim(0);
        Ok(match self.pooling {
            Pooling::Mean => states.mean(&[0], false)?,
            Pooling::Cls => states.slice_axis(0, 0, 1)?.squeeze(0)?,
            Pooling::LastToken => states.slice_axis(0, len - 1, len)?.squeeze(0)?,
        })
    }
}
