//! Cross-encoders (`BertForSequenceClassification` or
//! `XLMRobertaForSequenceClassification` with one label): a (query,
//! document) pair runs through the encoder as one input, `[CLS] query [SEP]
//! document [SEP]` with token types 0 and 1 (XLM-RoBERTa: `<s> query </s></s>
//! document </s>`, all type 0), and the head gives its relevance score (a raw
//! logit, as sentence-transformers' `CrossEncoder` returns before its
//! activation): BERT's classifier on the pooler's output, XLM-RoBERTa's
//! `out_proj(tanh(dense(h[<s>])))`.

use std::path::{Path, PathBuf};

use mlx_sys::Dtype;

use crate::architectures::bert::Bert;
use crate::architectures::LoadContext;
use crate::embedding::{encoder_tokenizer, is_cross_encoder, max_tokens, EMBEDDING_MODEL_TYPES};
use crate::error::{Error, Result};
use crate::model::open_checkpoint;
use crate::nn::Linear;
use crate::quantization::QuantizationConfig;
use crate::weights::{Scope, Weights};

/// A loaded cross-encoder: immutable, evaluated arrays and tokenizer
/// (`Send + Sync`; share it between threads).
pub struct CrossEncoder {
    encoder: Bert,
    head: Head,
    tokenizer: tokenizers::Tokenizer,
    max_tokens: usize,
    dir: PathBuf,
}

/// What turns the encoder's states into a score.
enum Head {
    /// BERT: `classifier(pooler(h[CLS]))`.
    Pooled(Linear),
    /// XLM-RoBERTa: `out_proj(tanh(dense(h[<s>])))`, no pooler.
    Dense { dense: Linear, out_proj: Linear },
}

impl CrossEncoder {
    /// Loads a sequence-classification checkpoint of a type in
    /// [`EMBEDDING_MODEL_TYPES`] with one label.
    pub fn load(dir: &Path) -> Result<CrossEncoder> {
        let (config, config_path, model_type) = open_checkpoint(dir)?;
        if !EMBEDDING_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(Error::UnknownArchitecture {
                path: config_path,
                model_type,
                supported: format!("{} (cross-encoders)", EMBEDDING_MODEL_TYPES.join(", ")),
            });
        }
        if !is_cross_encoder(&config) {
            return Err(Error::Unsupported {
                path: config_path,
                message: "no sequence-classification head (`architectures` names no *ForSequenceClassification): an embedding model loads as an embedder (`mlxcel embed`)".into(),
            });
        }
        let labels = config
            .get("id2label")
            .and_then(serde_json::Value::as_object)
            .map_or_else(|| config.get("num_labels").and_then(serde_json::Value::as_u64).unwrap_or(1) as usize, |m| m.len());
        if labels != 1 {
            return Err(Error::Unsupported {
                path: config_path,
                message: format!("a classifier with {labels} labels; a reranker has one (its relevance score)"),
            });
        }
        let quantization = QuantizationConfig::from_config(&config, &config_path)?;
        let weights = Weights::load(dir)?;
        let scope = Scope::root(&weights, &quantization, Dtype::Float32);
        let roberta = model_type == "xlm-roberta";
        let encoder = Bert::load(&LoadContext { config: &config, config_path: &config_path, scope: scope.clone() }, !roberta)?;
        let hidden = encoder.args().hidden_size;
        let classifier = scope.pp("classifier");
        let head = if roberta {
            Head::Dense { dense: Linear::load(&classifier.pp("dense"), hidden, hidden, true)?, out_proj: Linear::load(&classifier.pp("out_proj"), hidden, 1, true)? }
        } else {
            Head::Pooled(Linear::load(&classifier, hidden, 1, true)?)
        };
        weights.check_all_read(&model_type)?;
        let max_tokens = max_tokens(dir, encoder.max_positions())?;
        let tokenizer = encoder_tokenizer(dir, max_tokens)?;
        Ok(CrossEncoder { encoder, head, tokenizer, max_tokens, dir: dir.to_path_buf() })
    }

    /// Tokens a pair keeps; longer pairs lose tokens from the longer side first.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A pair's token ids and types, special tokens added.
    pub fn tokenize_pair(&self, query: &str, document: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let encoding =
            self.tokenizer.encode((query, document), true).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_type_ids().to_vec()))
    }

    /// One score per tokenized pair, in one packed pass (each the same as alone).
    pub fn score_tokens(&self, pairs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<f32>> {
        if pairs.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&[u32]> = pairs.iter().map(|p| p.0.as_slice()).collect();
        let types: Vec<&[u32]> = pairs.iter().map(|p| p.1.as_slice()).collect();
        let hidden = self.encoder.forward(&ids, Some(&types))?;
        let scores = match &self.head {
            Head::Pooled(classifier) => classifier.forward(&self.encoder.pool_cls(&hidden, &ids)?)?,
            Head::Dense { dense, out_proj } => out_proj.forward(&dense.forward(&self.encoder.first_tokens(&hidden, &ids)?)?.tanh()?)?,
        };
        let scores: Vec<f32> = scores.to_vec()?;
        Ok(scores[..pairs.len()].to_vec())
    }
}
