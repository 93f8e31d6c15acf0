//! Loading a checkpoint directory into a runnable model plus its tokenizer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_sys::{Array, Dtype};
use serde_json::Value;

use crate::architectures::{self, LoadContext};
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::nn::{compute_dtype, RowKernels};
use crate::quantization::{check_quantize_params, QuantParams, QuantizationConfig};
use mlxcel_tokenizer::Tokenizer;
use crate::weights::{QuantizeAtLoad, Scope, Weights};

/// A network that maps token ids to next-token logits over borrowed caches.
///
/// Implementations hold only evaluated, immutable arrays, so one model can
/// serve several threads at once, each with its own caches.
pub trait LanguageModel: Send + Sync {
    /// `tokens`: [B, L] int32 → logits [B, L, vocab]. Appends to `caches`.
    fn forward(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array>;
    /// Like [`forward`](Self::forward), but logits for the last position
    /// only ([B, 1, vocab]): what generation needs after a prompt chunk,
    /// without the lm_head over every prompt position.
    fn forward_last(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        let logits = self.forward(tokens, caches)?;
        let length = logits.dim(1);
        Ok(logits.slice_axis(1, length - 1, length)?)
    }
    /// [`forward_last`](Self::forward_last) with the kernels chosen by `kernels`.
    fn forward_last_with(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        let _ = kernels;
        self.forward_last(tokens, caches)
    }
    /// Whether prefill with [`RowKernels::Prefill`] computes every position
    /// the same however the prompt is cut into chunks (bit for bit), so that
    /// cached prompt blocks equal a fresh prefill. False unless the model
    /// knows its kernels do (the engine's prefix cache is then off).
    fn chunking_invariant_prefill(&self) -> bool {
        false
    }
    /// B sequences at once, each over its own caches (`caches[b]`, one per
    /// layer): `tokens` [B, L] int32 → logits of each sequence's last
    /// position, [B, vocab]. A sequence's logits are exactly those it gets
    /// alone through [`forward_last`](Self::forward_last); implementations
    /// share the weight reads between sequences where their kernels allow.
    fn forward_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        let rows = (0..tokens.dim(0))
            .zip(caches.iter_mut())
            .map(|(b, c)| Ok(self.forward_last(&tokens.slice_axis(0, b, b + 1)?, c)?.squeeze(1)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(mlx_sys::concatenate(&rows, 0)?)
    }
    /// Like [`forward_batch`](Self::forward_batch), but the logits of every
    /// position, [B, L, vocab]: position l's are exactly those a decode step
    /// of `tokens[b, l]` alone gives after `tokens[b, ..l]` (what
    /// speculative verification needs to stay token-identical).
    fn forward_batch_all(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        let mut rows = Vec::with_capacity(caches.len());
        for (b, c) in (0..tokens.dim(0)).zip(caches.iter_mut()) {
            let row = tokens.slice_axis(0, b, b + 1)?;
            let steps = (0..row.dim(1))
                .map(|l| self.forward_last(&row.slice_axis(1, l, l + 1)?, c))
                .collect::<Result<Vec<_>>>()?;
            rows.push(mlx_sys::concatenate(&steps, 1)?);
        }
        Ok(mlx_sys::concatenate(&rows, 0)?)
    }
    /// `tokens` [B, L] int32 → the final norm's output [B, L, hidden],
    /// before the head: what decoder-based embedders pool. Appends to `caches`.
    fn forward_hidden(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array>;
    /// One empty cache per layer.
    fn new_caches(&self) -> Vec<Box<dyn KvCache>>;
    /// Whether this model's kernels read a paged KV pool
    /// ([`crate::paged`]) in place; rows then keep their keys and values in
    /// the pool's blocks instead of [`new_caches`](Self::new_caches).
    fn reads_paged_kv(&self) -> bool {
        false
    }
    fn shape(&self) -> &ModelShape;
    /// Each layer's sliding attention window in positions (None: it attends
    /// to every position), for descriptions such as `mlxcel inspect`.
    fn attention_windows(&self) -> Vec<Option<usize>> {
        vec![None; self.shape().num_layers]
    }
    /// What each layer is and what makes the logits, in words (`mlxcel inspect`).
    fn layout(&self) -> ModelLayout;
    /// `tokens` [B, L] int32 → the input embeddings [B, L, hidden] that
    /// [`forward_last_embedded`](Self::forward_last_embedded) takes: what a
    /// vision-language model merges image features into.
    fn embed(&self, tokens: &Array) -> Result<Array> {
        let _ = tokens;
        Err(Error::InvalidInput("this model does not take input embeddings".into()))
    }
    /// [`forward_last_with`](Self::forward_last_with) from input embeddings
    /// `h` [B, L, hidden] instead of token ids (a prefill chunk of a prompt
    /// with images). Appends to `caches`.
    fn forward_last_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        let _ = (h, caches, kernels);
        Err(Error::InvalidInput("this model does not take input embeddings".into()))
    }
    /// [`forward`](Self::forward) from input embeddings: logits of every position.
    fn forward_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        let _ = (h, caches);
        Err(Error::InvalidInput("this model does not take input embeddings".into()))
    }
    /// The vision tower and connector of a vision-language model (None for
    /// a text-only model).
    fn vision(&self) -> Option<&dyn VisionEncoder> {
        None
    }
}

/// The image side of a vision-language model: tiles of pixels in, one
/// feature per `<image>` token out, in the text model's hidden size.
pub trait VisionEncoder: Send + Sync {
    /// The id of the `<image>` token whose embeddings the features replace.
    fn image_token_id(&self) -> u32;
    /// Features per tile (`<image>` tokens per tile in the prompt).
    fn tokens_per_tile(&self) -> usize;
    /// The side of the square tiles it takes.
    fn tile_side(&self) -> usize;
    /// `pixel_values` [tiles, 3, side, side] f32 (channels first, normalized)
    /// → the vision tower's output [tiles, patches, vision_hidden].
    fn vision_tower(&self, pixel_values: &Array) -> Result<Array>;
    /// The tower's output → the connector's [tiles, tokens_per_tile, hidden].
    fn connect(&self, tower: &Array) -> Result<Array>;
    /// Both: [tiles * tokens_per_tile, hidden], one row per `<image>` token in order.
    fn encode(&self, pixel_values: &Array) -> Result<Array> {
        let features = self.connect(&self.vision_tower(pixel_values)?)?;
        let hidden = features.dim(-1);
        Ok(features.reshape(&[-1, hidden])?)
    }
}

/// `embeddings` [1, L, hidden] of `tokens` with the rows of every
/// `image_token` replaced, in order, by the rows of `features` [n, hidden]
/// (n must equal the number of image tokens), as mlx-vlm's `masked_scatter`.
pub fn merge_image_features(embeddings: &Array, tokens: &[u32], image_token: u32, features: &Array) -> Result<Array> {
    let length = tokens.len();
    let count = tokens.iter().filter(|&&t| t == image_token).count();
    if count != features.dim(0) as usize {
        return Err(Error::InvalidInput(format!(
            "the prompt has {count} image tokens for {} image features",
            features.dim(0)
        )));
    }
    let hidden = embeddings.dim(-1);
    let mut next = length as i32;
    let index: Vec<i32> = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            if t == image_token {
                next += 1;
                next - 1
            } else {
                i as i32
            }
        })
        .collect();
    let rows = mlx_sys::concatenate(&[embeddings.reshape(&[length as i32, hidden])?, features.astype(embeddings.dtype())?], 0)?;
    Ok(rows.take(&Array::from_slice(&index, &[length as i32])?, 0)?.reshape(&[1, length as i32, hidden])?)
}

/// A model's layers and output described in words, one line per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelLayout {
    pub layers: Vec<String>,
    /// How the logits are made: the lm_head or the tied embeddings, any scale or soft-cap.
    pub head: String,
}

impl ModelLayout {
    /// Layers with the same description grouped: (`"0-4, 6-10"`, description),
    /// in order of first appearance.
    pub fn grouped(&self) -> Vec<(String, &str)> {
        let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, line) in self.layers.iter().enumerate() {
            match groups.iter_mut().find(|(l, _)| *l == line.as_str()) {
                Some((_, indices)) => indices.push(i),
                None => groups.push((line, vec![i])),
            }
        }
        groups
            .into_iter()
            .map(|(line, indices)| {
                let mut ranges: Vec<String> = Vec::new();
                let mut start = indices[0];
                for (k, &i) in indices.iter().enumerate() {
                    let last = indices.get(k + 1).is_none_or(|&next| next != i + 1);
                    if last {
                        ranges.push(if start == i { i.to_string() } else { format!("{start}-{i}") });
                        if let Some(&next) = indices.get(k + 1) {
                            start = next;
                        }
                    }
                }
                (ranges.join(", "), line)
            })
            .collect()
    }
}

/// Sizes that callers need without knowing the architecture.
#[derive(Debug, Clone)]
pub struct ModelShape {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// The dtype activations and the KV cache use.
    pub dtype: Dtype,
    pub max_position_embeddings: Option<usize>,
}

impl ModelShape {
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }
}

/// How one group of modules (e.g. every layer's `mlp.down_proj`) is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleGroup {
    /// The module path without `model.layers.N.`, e.g. `self_attn.q_proj`.
    pub name: String,
    pub count: usize,
    /// `None` for unquantized weights.
    pub quantization: Option<QuantParams>,
    pub dtype: Dtype,
    pub parameters: u64,
}

/// What `mlxcel inspect` prints.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_type: String,
    pub parameters: u64,
    pub weight_bytes: u64,
    pub groups: Vec<ModuleGroup>,
    pub shape: ModelShape,
    pub tokenizer_kind: String,
    pub tokenizer_vocab_size: usize,
    /// Set when a dense checkpoint was quantized while loading.
    pub quantized_at_load: Option<QuantParams>,
}

impl ModelInfo {
    /// The bit width of the largest quantized module group (0 when the
    /// linear layers are not quantized): what the kernel report describes.
    pub fn main_weight_bits(&self) -> i32 {
        self.groups
            .iter()
            .filter(|g| g.name != "embed_tokens")
            .max_by_key(|g| g.parameters)
            .and_then(|g| g.quantization)
            .map_or(0, |q| q.bits)
    }
}

/// A loaded checkpoint: the network, its tokenizer and a summary.
///
/// `Model` is `Send + Sync`: share it behind an `Arc` and run one generation
/// per thread, each with its own caches.
pub struct Model {
    network: Box<dyn LanguageModel>,
    tokenizer: Tokenizer,
    info: ModelInfo,
    dir: PathBuf,
    /// A vision-language model's image processor (None for text-only models).
    image_processor: Option<mlxcel_vision::Idefics3Processor>,
}

/// Reads `config.json`.
pub fn read_config(dir: &Path) -> Result<(Value, PathBuf)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let value = serde_json::from_str(&text).map_err(|source| Error::Json { path: path.clone(), source })?;
    Ok((value, path))
}

impl Model {
    /// Loads a checkpoint in the MLX / Hugging Face layout.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_quantizing(dir, None)
    }

    /// [`load`](Self::load), quantizing a dense checkpoint with `quantize`
    /// as it loads (see [`load_network_quantizing`]).
    pub fn load_quantizing(dir: &Path, quantize: Option<QuantParams>) -> Result<Model> {
        let tokenizer = Tokenizer::from_dir(dir)?;
        let (network, mut info) = load_network_quantizing(dir, quantize)?;
        info.tokenizer_kind = tokenizer.kind().to_string();
        info.tokenizer_vocab_size = tokenizer.vocab_size();
        let image_processor = match network.vision() {
            None => None,
            Some(vision) => {
                let processor = mlxcel_vision::Idefics3Processor::from_dir(dir, vision.tokens_per_tile()).map_err(|e| match e {
                    mlxcel_vision::Error::Config { path, message } => Error::InvalidConfig { path, message },
                    mlxcel_vision::Error::Io { path, source } => Error::Io { path, source },
                    other => Error::invalid_file(dir, other.to_string()),
                })?;
                if processor.tile_side() != vision.tile_side() {
                    return Err(Error::InvalidConfig {
                        path: dir.join("preprocessor_config.json"),
                        message: format!(
                            "max_image_size.longest_edge {} is not the vision tower's image_size {}",
                            processor.tile_side(),
                            vision.tile_side()
                        ),
                    });
                }
                Some(processor)
            }
        };
        Ok(Model { network, tokenizer, info, dir: dir.to_path_buf(), image_processor })
    }

    /// The image processor of a vision-language model (None: text only).
    pub fn image_processor(&self) -> Option<&mlxcel_vision::Idefics3Processor> {
        self.image_processor.as_ref()
    }

    pub fn network(&self) -> &dyn LanguageModel {
        self.network.as_ref()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The checkpoint directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The first steps of loading any checkpoint directory: the process's
/// runtime configuration (the layers read it: fixed from the environment
/// unless `runtime::init` did, invalid values reported here), then
/// `config.json` and its `model_type`.
pub(crate) fn open_checkpoint(dir: &Path) -> Result<(Value, PathBuf, String)> {
    crate::runtime::get()?;
    if !dir.is_dir() {
        return Err(Error::invalid_file(dir, "not a checkpoint directory"));
    }
    let (config, config_path) = read_config(dir)?;
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::InvalidConfig { path: config_path.clone(), message: "no `model_type`".into() })?
        .to_string();
    Ok((config, config_path, model_type))
}

/// Loads only the network of a checkpoint (no tokenizer needed); the
/// tokenizer fields of the returned info are left empty.
pub fn load_network(dir: &Path) -> Result<(Box<dyn LanguageModel>, ModelInfo)> {
    load_network_quantizing(dir, None)
}

/// [`load_network`], quantizing a dense checkpoint with `quantize` as
/// `mlx_lm.convert -q --q-bits B --q-group-size G` would (see
/// [`QuantizeAtLoad`]: the same arrays, so the same kernels and tokens), each
/// dense weight replaced by its packed form as it loads. A checkpoint that is
/// already quantized is refused.
pub fn load_network_quantizing(dir: &Path, quantize: Option<QuantParams>) -> Result<(Box<dyn LanguageModel>, ModelInfo)> {
    let (network, info, weights) = load_parts(dir, quantize)?;
    drop(weights);
    if quantize.is_some() {
        // The dense weights are free now, but held by MLX's cache and the heap.
        mlx_sys::memory::release_free_memory()?;
    }
    Ok((network, info))
}

/// Every tensor of the checkpoint in `dir` after loading it quantized with
/// `quantize`, each as `mlx_lm.convert -q` would save it (floating tensors
/// in config.json's `torch_dtype`): what the model runs, for comparisons
/// with a converted copy.
pub fn load_tensors_quantizing(dir: &Path, quantize: QuantParams) -> Result<BTreeMap<String, Array>> {
    let (_, _, weights) = load_parts(dir, Some(quantize))?;
    let (config, _) = read_config(dir)?;
    let convert_dtype = convert_dtype(&config);
    weights
        .all()
        .into_iter()
        .map(|(name, array)| {
            let array = match convert_dtype {
                Some(dtype) if array.dtype().is_floating() => array.astype(dtype)?,
                _ => array,
            };
            array.eval()?;
            Ok((name, array))
        })
        .collect()
}

/// The dtype `mlx_lm.convert` casts floating tensors to: config.json's `torch_dtype`.
fn convert_dtype(config: &Value) -> Option<Dtype> {
    let dtype = config.get("torch_dtype").and_then(Value::as_str).and_then(Dtype::from_name)?;
    matches!(dtype, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32).then_some(dtype)
}

/// The network `construct` builds from `weights` under `config`, in the
/// compute dtype for the checkpoint's `torch_dtype`.
pub(crate) fn construct_network(
    construct: architectures::Constructor,
    config: &Value,
    config_path: &Path,
    weights: &Weights,
    quantization: &QuantizationConfig,
    at_load: Option<QuantizeAtLoad>,
) -> Result<Box<dyn LanguageModel>> {
    let checkpoint_dtype = config.get("torch_dtype").and_then(Value::as_str).and_then(Dtype::from_name);
    let scope = Scope::root(weights, quantization, compute_dtype(checkpoint_dtype)).quantizing(at_load);
    construct(&LoadContext { config, config_path, scope })
}

fn load_parts(dir: &Path, quantize: Option<QuantParams>) -> Result<(Box<dyn LanguageModel>, ModelInfo, Weights)> {
    let (config, config_path, model_type) = open_checkpoint(dir)?;
    if crate::embedding::EMBEDDING_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(Error::Unsupported {
            path: config_path,
            message: format!("`{model_type}` is an embedding model, not a language model: load it as an embedder (`mlxcel embed`)"),
        });
    }
    // An unknown architecture is refused before any weight is read.
    let construct = architectures::constructor(&model_type, &config_path)?;
    let mut quantization = QuantizationConfig::from_config(&config, &config_path)?;
    if let Some(params) = quantize {
        check_quantize_params(params).map_err(|(name, message)| Error::InvalidInput(format!("{name} {message}")))?;
    }
    let weights = if quantize.is_some() { Weights::load_for_quantizing(dir)? } else { Weights::load(dir)? };
    let at_load = match quantize {
        None => None,
        Some(params) => {
            if quantization.default.is_some() || weights.any_name_ends_with(".scales") {
                return Err(Error::Unsupported {
                    path: config_path,
                    message: "the checkpoint is already quantized; q_bits quantizes dense (f32/f16/bf16) checkpoints at load".into(),
                });
            }
            quantization.default = Some(params);
            Some(QuantizeAtLoad { params, convert_dtype: convert_dtype(&config) })
        }
    };
    let network = construct_network(construct, &config, &config_path, &weights, &quantization, at_load)?;
    weights.check_all_read(&model_type)?;
    let mut info = summarize(&model_type, &weights, &quantization, network.shape().clone());
    info.quantized_at_load = quantize;
    Ok((network, info, weights))
}

fn summarize(
    model_type: &str,
    weights: &Weights,
    quantization: &QuantizationConfig,
    shape: ModelShape,
) -> ModelInfo {
    let mut groups: BTreeMap<(String, Option<QuantParams>, Dtype), (usize, u64)> = BTreeMap::new();
    let (mut parameters, mut weight_bytes) = (0u64, 0u64);
    for (name, array) in weights.all() {
        let name = name.as_str();
        weight_bytes += array.nbytes() as u64;
        let Some(module) = name.strip_suffix(".weight").or_else(|| name.strip_suffix(".bias")) else {
            continue; // scales and biases of quantized modules
        };
        let quant = weights.contains(&format!("{module}.scales")).then(|| quantization.for_module(module)).flatten();
        let shape = array.shape();
        let count: u64 = match (quant, name.ends_with(".weight")) {
            (Some(q), true) => shape.iter().map(|&d| d as u64).product::<u64>() * 32 / q.bits as u64,
            _ => shape.iter().map(|&d| d as u64).product(),
        };
        parameters += count;
        if name.ends_with(".weight") {
            let group = group_name(module);
            let entry = groups.entry((group, quant, array.dtype())).or_default();
            entry.0 += 1;
            entry.1 += count;
        }
    }
    ModelInfo {
        model_type: model_type.into(),
        parameters,
        weight_bytes,
        groups: groups
            .into_iter()
            .map(|((name, quantization, dtype), (count, parameters))| ModuleGroup {
                name,
                count,
                quantization,
                dtype,
                parameters,
            })
            .collect(),
        shape,
        tokenizer_kind: String::new(),
        tokenizer_vocab_size: 0,
        quantized_at_load: None,
    }
}

/// `model.layers.12.self_attn.q_proj` → `self_attn.q_proj`; `model.norm` → `norm`.
fn group_name(module: &str) -> String {
    let rest = module.strip_prefix("model.").unwrap_or(module);
    match rest.strip_prefix("layers.") {
        Some(layer) => layer.split_once('.').map_or(layer, |(_, tail)| tail).to_string(),
        None => rest.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_strip_layer_indices() {
        assert_eq!(super::group_name("model.layers.12.self_attn.q_proj"), "self_attn.q_proj");
        assert_eq!(super::group_name("model.norm"), "norm");
        assert_eq!(super::group_name("lm_head"), "lm_head");
    }
}
