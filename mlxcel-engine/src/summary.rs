//! [`ModelSummary`]: what every front end reports about a loaded model
//! (the C ABI's `mlxcel_model_info` and its JSON, Python's `ModelInfo`,
//! Node's `info`), computed once here.

use std::path::PathBuf;

use mlxcel_models::quantization::QuantParams;
use mlxcel_models::Model;

/// Bits and group size of a quantized module group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Quantization {
    pub bits: i32,
    pub group_size: i32,
}

impl From<QuantParams> for Quantization {
    fn from(q: QuantParams) -> Self {
        Quantization { bits: q.bits, group_size: q.group_size }
    }
}

/// One group of modules (e.g. every layer's `mlp.down_proj`) and how it is stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupSummary {
    pub name: String,
    pub count: usize,
    pub dtype: String,
    pub parameters: u64,
    /// `None` for unquantized weights.
    pub quantization: Option<Quantization>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenizerSummary {
    /// E.g. "BPE (byte-level)".
    pub kind: String,
    /// Tokens the tokenizer knows, including added tokens.
    pub vocab_size: usize,
    pub bos_token: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token: Option<String>,
    /// The token ids that end a generation.
    pub eos_token_ids: Vec<u32>,
    /// The names of the chat templates (empty: none).
    pub chat_templates: Vec<String>,
}

/// A loaded model described for front ends. Serialized (`serde_json`) it
/// is the C ABI's `mlxcel_model_info_json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelSummary {
    /// `model_type` in config.json, e.g. "llama".
    pub architecture: String,
    /// The checkpoint directory.
    pub directory: PathBuf,
    /// Parameters (quantized weights count as their unpacked size).
    pub parameters: u64,
    /// Bytes of the weights as stored (quantized weights with their scales).
    pub weight_bytes: u64,
    /// Stored weight bits per parameter over the whole model.
    pub bits_per_weight: f64,
    /// The compute dtype of activations and the KV cache, e.g. "float32".
    pub dtype: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Rows of the output layer: token ids are below this.
    pub vocab_size: usize,
    /// The longest prompt in tokens, when the checkpoint says.
    pub context_length: Option<usize>,
    pub kv_bytes_per_token: usize,
    /// The quantization covering the most parameters (`None`: unquantized).
    pub main_quantization: Option<Quantization>,
    pub groups: Vec<GroupSummary>,
    pub tokenizer: TokenizerSummary,
}

impl ModelSummary {
    pub fn new(model: &Model) -> Self {
        let info = model.info();
        let shape = model.network().shape();
        let tokenizer = model.tokenizer();
        let groups: Vec<GroupSummary> = info
            .groups
            .iter()
            .map(|g| GroupSummary {
                name: g.name.clone(),
                count: g.count,
                dtype: g.dtype.name().to_string(),
                parameters: g.parameters,
                quantization: g.quantization.map(Quantization::from),
            })
            .collect();
        ModelSummary {
            architecture: info.model_type.clone(),
            directory: model.dir().to_path_buf(),
            parameters: info.parameters,
            weight_bytes: info.weight_bytes,
            bits_per_weight: if info.parameters > 0 { info.weight_bytes as f64 * 8.0 / info.parameters as f64 } else { 0.0 },
            dtype: shape.dtype.name().to_string(),
            num_layers: shape.num_layers,
            hidden_size: shape.hidden_size,
            num_kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            vocab_size: shape.vocab_size,
            context_length: shape.max_position_embeddings,
            kv_bytes_per_token: shape.kv_bytes_per_token(),
            main_quantization: main_quantization(&groups),
            groups,
            tokenizer: TokenizerSummary {
                kind: tokenizer.kind().to_string(),
                vocab_size: tokenizer.vocab_size(),
                bos_token: tokenizer.bos_token().map(str::to_string),
                bos_token_id: tokenizer.bos_token_id(),
                eos_token: tokenizer.eos_token().map(str::to_string),
                eos_token_ids: tokenizer.eos_token_ids().to_vec(),
                chat_templates: tokenizer.chat_template_names().map(str::to_string).collect(),
            },
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a model summary serializes")
    }
}

/// The quantization whose groups hold the most parameters together.
fn main_quantization(groups: &[GroupSummary]) -> Option<Quantization> {
    let mut totals: Vec<(Option<Quantization>, u64)> = Vec::new();
    for g in groups {
        match totals.iter_mut().find(|(q, _)| *q == g.quantization) {
            Some((_, n)) => *n += g.parameters,
            None => totals.push((g.quantization, g.parameters)),
        }
    }
    totals.into_iter().max_by_key(|(_, n)| *n).and_then(|(q, _)| q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(name: &str, parameters: u64, bits: Option<i32>) -> GroupSummary {
        GroupSummary {
            name: name.into(),
            count: 1,
            dtype: "float16".into(),
            parameters,
            quantization: bits.map(|bits| Quantization { bits, group_size: 64 }),
        }
    }

    #[test]
    fn main_quantization_sums_the_groups_of_each_quantization() {
        // Two 4-bit groups outweigh the one larger 8-bit group together.
        let groups = [group("embed_tokens", 50, Some(8)), group("q_proj", 30, Some(4)), group("o_proj", 30, Some(4))];
        assert_eq!(main_quantization(&groups), Some(Quantization { bits: 4, group_size: 64 }));
        assert_eq!(main_quantization(&[group("norm", 10, None), group("q_proj", 5, Some(4))]), None);
        assert_eq!(main_quantization(&[]), None);
    }
}
