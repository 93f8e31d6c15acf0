//! Layers shared by the architectures: linear (dense or affine-quantized),
//! embeddings, RMSNorm, RoPE, the gated MLP and grouped-query attention.

use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::kernels::{self, DecoderLayerSpec, DecoderLayerWeights, KvWindow, PreparedDecoderLayer, QuantizedProjection};
use mlx_sys::{Array, Dtype};
use mlxcel_gguf::rope::Llama3Scaling;

use std::sync::Arc;

use crate::cache::{CacheLayout, KvCache};
use crate::paged::PagedKvCache;
use crate::error::{Error, Result};
use crate::quantization::QuantParams;
use crate::weights::Scope;

/// From this many rows on, quantized matmuls run as a GEMM (prefill).
const DENSE_PREFILL_MIN_ROWS: usize = 16;

/// Which kernels a forward pass picks for its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowKernels {
    /// By the pass's row count: the fused block and the matvec loops for few
    /// rows, the GEMMs for many (the fastest choice for each pass).
    #[default]
    ByCount,
    /// The prefill kernels (GEMMs, causal attention) whatever the row count:
    /// a position's keys, values and hidden states then do not depend on how
    /// its prompt was cut into chunks, which lets the engine's prefix cache
    /// hand out blocks that equal a fresh prefill bit for bit.
    Prefill,
}

impl RowKernels {
    /// The row count a kernel choice sees for `rows` rows.
    fn rows(self, rows: usize) -> usize {
        match self {
            RowKernels::ByCount => rows,
            RowKernels::Prefill => rows.max(DENSE_PREFILL_MIN_ROWS),
        }
    }
}

/// How prefill (many-row) work runs: our kernels (default), or the previous
/// path (dequantize + MLX matmul, MLX's attention), kept for side-by-side
/// comparisons: `RuntimeConfig::prefill` (`MLXCEL_PREFILL`).
fn prefill_uses_mlx() -> bool {
    crate::runtime::current().prefill == crate::runtime::PrefillBackend::Mlx
}

/// Affine-quantized weight: packed `weight`, per-group `scales` and `biases`.
#[derive(Clone)]
pub struct QuantizedWeight {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub params: QuantParams,
}

impl QuantizedWeight {
    /// The group count of `in_features`, or an error when they do not fit.
    fn groups(scope: &Scope, in_features: i32, params: QuantParams) -> Result<i32> {
        let QuantParams { bits, group_size } = params;
        if in_features % group_size != 0 || (in_features * bits) % 32 != 0 {
            return Err(Error::Unsupported {
                path: scope.module_path().into(),
                message: format!("{in_features} input features do not fit {bits}-bit groups of {group_size}"),
            });
        }
        Ok(in_features / group_size)
    }

    fn load(scope: &Scope, out_features: i32, in_features: i32, params: QuantParams) -> Result<Self> {
        let (bits, groups) = (params.bits, Self::groups(scope, in_features, params)?);
        Ok(QuantizedWeight {
            weight: scope.get("weight", &[out_features, in_features * bits / 32])?,
            scales: scope.get_stored("scales", &[out_features, groups])?,
            biases: scope.get_stored("biases", &[out_features, groups])?,
            params,
        })
    }

    /// `x @ W.T`. Many rows (prefill) run as our quantized GEMM kernel
    /// (`kernels/quantized_gemm.cc`: panels of W dequantized into cache-sized
    /// f32 buffers, an AMX, AVX-512, AVX2 or portable microkernel); few rows
    /// (decode) use our quantized matvec kernel, which reads 4-8x fewer bytes
    /// than f32. Neither calls BLAS.
    fn matmul_t(&self, x: &Array) -> Result<Array> {
        self.matmul_t_choosing_by(x, x.size() / x.dim(-1).max(1) as usize)
    }

    /// [`matmul_t`](Self::matmul_t) with the kernel chosen for `rows` rows
    /// rather than x's: a batch of sequences chooses by one sequence's rows,
    /// so each sequence gets the kernel (and the numerics) it gets alone.
    fn matmul_t_choosing_by(&self, x: &Array, rows: usize) -> Result<Array> {
        let p = self.params;
        if rows >= DENSE_PREFILL_MIN_ROWS {
            if !prefill_uses_mlx() {
                // Layouts the GEMM does not take fall back to the matvec kernel.
                return Ok(kernels::quantized_gemm(x, &self.weight, &self.scales, &self.biases, p.group_size, p.bits)?);
            }
            // Dequantize in the activations' dtype, not the scales' (f16 would
            // round every weight).
            let (scales, biases) = (self.scales.astype(x.dtype())?, self.biases.astype(x.dtype())?);
            let w = mlx_sys::dequantize(&self.weight, &scales, &biases, p.group_size, p.bits)?;
            return Ok(x.matmul(&w.transpose(&[1, 0])?)?);
        }
        Ok(kernels::quantized_matmul(x, &self.weight, &self.scales, &self.biases, p.group_size, p.bits)?)
    }
}

/// A mixture's quantized experts as the fused block takes them: gate and up
/// `[count * intermediate, ..]`, down `[count * hidden, ..]`.
pub struct StackedExperts {
    pub count: i32,
    pub gate: QuantizedWeight,
    pub up: QuantizedWeight,
    pub down: QuantizedWeight,
}

#[derive(Clone)]
enum LinearWeight {
    /// `[out_features, in_features]`, as stored.
    Dense(Array),
    Quantized(QuantizedWeight),
}

/// `x @ w.T` for a dense `w` `[N, K]`: our kernel (no BLAS), or MLX's matmul
/// under `MLXCEL_PREFILL=mlx` (for comparisons).
fn dense_matmul_t(x: &Array, w: &Array) -> Result<Array> {
    if prefill_uses_mlx() {
        return Ok(x.matmul(&w.transpose(&[1, 0])?)?);
    }
    Ok(kernels::dense_matmul(x, w)?)
}

/// `y = x @ W.T + b`, dense or quantized.
#[derive(Clone)]
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
}

impl Linear {
    /// A dense layer from its evaluated weight [out, in] and bias [out].
    pub fn from_dense(weight: Array, bias: Option<Array>) -> Self {
        Linear { weight: LinearWeight::Dense(weight), bias }
    }

    /// The output width (the weight's rows).
    pub fn out_features(&self) -> i32 {
        match &self.weight {
            LinearWeight::Dense(w) => w.dim(0),
            LinearWeight::Quantized(q) => q.weight.dim(0),
        }
    }

    pub fn load(scope: &Scope, in_features: i32, out_features: i32, bias: bool) -> Result<Self> {
        let weight = match scope.quant_params(in_features)? {
            Some(params) => LinearWeight::Quantized(QuantizedWeight::load(scope, out_features, in_features, params)?),
            None => {
                let w = scope.get("weight", &[out_features, in_features])?;
                w.eval()?;
                LinearWeight::Dense(w)
            }
        };
        let bias = if bias { Some(scope.get("bias", &[out_features])?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// The maps of consecutive output-row ranges of this one, `sizes` rows
    /// each: a fused projection (`qkv_proj`, `gate_up_proj`) as its parts.
    /// Every output row has its own weights (quantized: its own scales and
    /// biases), so each part computes exactly its rows of the fused map.
    pub fn split_rows(&self, sizes: &[i32]) -> Result<Vec<Linear>> {
        let mut start = 0;
        let mut parts = Vec::with_capacity(sizes.len());
        for &rows in sizes {
            let take = |a: &Array| -> Result<Array> {
                let part = a.slice_axis(0, start, start + rows)?;
                part.eval()?;
                Ok(part)
            };
            let weight = match &self.weight {
                LinearWeight::Dense(w) => LinearWeight::Dense(take(w)?),
                LinearWeight::Quantized(q) => LinearWeight::Quantized(QuantizedWeight {
                    weight: take(&q.weight)?,
                    scales: take(&q.scales)?,
                    biases: take(&q.biases)?,
                    params: q.params,
                }),
            };
            parts.push(Linear { weight, bias: self.bias.as_ref().map(take).transpose()? });
            start += rows;
        }
        Ok(parts)
    }

    /// One `Linear` per expert from stacked weights (`weight` [E, out, in],
    /// or quantized `weight`/`scales`/`biases` with a leading expert axis, as
    /// mlx-lm's `SwitchLinear` stores them). Each is a view of expert e's
    /// slice of the stacked arrays: nothing is copied.
    pub fn load_stacked(scope: &Scope, experts: i32, in_features: i32, out_features: i32) -> Result<(Vec<Self>, Option<QuantizedWeight>)> {
        let expert = |a: &Array, e: i32| -> Result<Array> {
            let mut shape = a.shape();
            shape.remove(0);
            let view = a.slice_axis(0, e, e + 1)?.reshape(&shape)?;
            view.eval()?;
            Ok(view)
        };
        match scope.quant_params(in_features)? {
            Some(params) => {
                let (bits, groups) = (params.bits, QuantizedWeight::groups(scope, in_features, params)?);
                let weight = scope.get("weight", &[experts, out_features, in_features * bits / 32])?;
                let scales = scope.get_stored("scales", &[experts, out_features, groups])?;
                let biases = scope.get_stored("biases", &[experts, out_features, groups])?;
                let each = (0..experts)
                    .map(|e| {
                        let q = QuantizedWeight { weight: expert(&weight, e)?, scales: expert(&scales, e)?, biases: expert(&biases, e)?, params };
                        Ok(Linear { weight: LinearWeight::Quantized(q), bias: None })
                    })
                    .collect::<Result<Vec<_>>>()?;
                // The experts as one [experts * out, ..] matrix each (views).
                let rows = |a: &Array| -> Result<Array> {
                    let flat = a.reshape(&[experts * out_features, a.dim(2)])?;
                    flat.eval()?;
                    Ok(flat)
                };
                let stacked = QuantizedWeight { weight: rows(&weight)?, scales: rows(&scales)?, biases: rows(&biases)?, params };
                Ok((each, Some(stacked)))
            }
            None => {
                let weight = scope.get("weight", &[experts, out_features, in_features])?;
                let each = (0..experts)
                    .map(|e| Ok(Linear { weight: LinearWeight::Dense(expert(&weight, e)?), bias: None }))
                    .collect::<Result<Vec<_>>>()?;
                Ok((each, None))
            }
        }
    }

    /// Output features, for quantized weights (None for dense ones).
    fn quantized_out_features(&self) -> Option<i32> {
        match &self.weight {
            LinearWeight::Quantized(q) => Some(q.weight.dim(0)),
            LinearWeight::Dense(_) => None,
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_with(x, RowKernels::ByCount)
    }

    /// [`forward`](Self::forward) with the kernels chosen by `kernels`.
    pub fn forward_with(&self, x: &Array, kernels: RowKernels) -> Result<Array> {
        let rows = x.size() / x.dim(-1).max(1) as usize;
        let y = match &self.weight {
            LinearWeight::Dense(w) => dense_matmul_t(x, w)?,
            LinearWeight::Quantized(q) => q.matmul_t_choosing_by(x, kernels.rows(rows))?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    /// `x` [B, L, in] as B sequences, each computed exactly as
    /// [`forward`](Self::forward) computes it alone (see [`per_sequence`]).
    pub fn forward_per_sequence(&self, x: &Array) -> Result<Array> {
        let (quantized, dense) = match &self.weight {
            LinearWeight::Quantized(q) => (Some(q), None),
            LinearWeight::Dense(w) => (None, Some(w)),
        };
        per_sequence(x, quantized, dense, self.bias.as_ref(), |rows| self.forward(rows))
    }
}

/// A linear map of `x` [B, L, in] whose every sequence b gets exactly what
/// `alone(x[b])` gives, reading the weight once for many sequences.
/// Quantized weights (`quantized`, plus `bias`) run once over all rows with
/// the kernel chosen for one sequence's L rows: its loops compute each row
/// independently. Dense weights (`dense`) go through our dense kernel, which
/// picks its loop by the row count of the call: fewer than
/// [`DENSE_PANEL_MIN_ROWS`] rows dot rows of w in place, and more run the
/// packed panels; both compute each row on its own (one accumulator per row
/// and output, summed along K in the same order), so only the loop choice
/// depends on the batch. A call therefore takes every sequence when L alone
/// reaches the panel loop, and otherwise as many whole sequences as stay
/// below it (decode: 15 rows a call). Under `MLXCEL_PREFILL=mlx` and on a
/// GPU the matmul is MLX's, whose kernel and summation order depend on the
/// row count, so there each sequence runs on its own (weights read once per
/// sequence, but a row's numerics never depend on its batch).
fn per_sequence(
    x: &Array,
    quantized: Option<&QuantizedWeight>,
    dense: Option<&Array>,
    bias: Option<&Array>,
    alone: impl Fn(&Array) -> Result<Array>,
) -> Result<Array> {
    let (b, l) = (x.dim(0), x.dim(1));
    let with_bias = |y: Array| -> Result<Array> {
        Ok(match bias {
            Some(bias) => y.add(bias)?,
            None => y,
        })
    };
    if b == 1 {
        return alone(x);
    }
    if !prefill_uses_mlx() {
        if let Some(q) = quantized {
            return with_bias(q.matmul_t_choosing_by(x, l as usize)?);
        }
        if let Some(w) = dense.filter(|_| mlx_sys::Device::default_device() == mlx_sys::Device::Cpu) {
            let per_call = dense_sequences_per_call(b as usize, l as usize) as i32;
            if per_call >= b {
                return with_bias(kernels::dense_matmul(x, w)?);
            }
            let chunks = (0..b)
                .step_by(per_call as usize)
                .map(|start| with_bias(kernels::dense_matmul(&x.slice_axis(0, start, (start + per_call).min(b))?, w)?))
                .collect::<Result<Vec<_>>>()?;
            return Ok(mlx_sys::concatenate(&chunks, 0)?);
        }
    }
    let rows = (0..b).map(|i| alone(&x.slice_axis(0, i, i + 1)?)).collect::<Result<Vec<_>>>()?;
    Ok(mlx_sys::concatenate(&rows, 0)?)
}

/// From this many rows of x on, our dense kernel runs its packed panels
/// rather than its in-place dot loop (`kDensePanelMinRows` in
/// `kernels/quantized_gemm.cc`).
const DENSE_PANEL_MIN_ROWS: usize = 16;

/// How many of `b` sequences of `l` rows one dense kernel call takes so
/// that it runs the loop one sequence runs alone.
fn dense_sequences_per_call(b: usize, l: usize) -> usize {
    if l >= DENSE_PANEL_MIN_ROWS {
        b
    } else {
        ((DENSE_PANEL_MIN_ROWS - 1) / l.max(1)).clamp(1, b.max(1))
    }
}

/// Token embeddings, dense or quantized; also serves as a tied lm_head.
#[derive(Clone)]
pub enum Embedding {
    Dense(Array),
    Quantized(QuantizedWeight),
}

impl Embedding {
    pub fn load(scope: &Scope, vocab_size: i32, hidden: i32) -> Result<Self> {
        Ok(match scope.quant_params(hidden)? {
            Some(params) => Embedding::Quantized(QuantizedWeight::load(scope, vocab_size, hidden, params)?),
            None => Embedding::Dense(scope.get("weight", &[vocab_size, hidden])?),
        })
    }

    /// Rows for `ids` (any shape) → `[..ids, hidden]` in `dtype`.
    pub fn forward(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => w.take(ids, 0)?.astype(dtype)?,
            Embedding::Quantized(q) if kernels::supports(q.params.group_size, q.params.bits) => {
                kernels::quantized_embedding(ids, &q.weight, &q.scales, &q.biases, q.params.group_size, q.params.bits, dtype)?
            }
            Embedding::Quantized(q) => {
                let p = q.params;
                let rows = |a: &Array| a.take(ids, 0);
                let as_dtype = |a: &Array| rows(&a.astype(dtype)?);
                mlx_sys::dequantize(&rows(&q.weight)?, &as_dtype(&q.scales)?, &as_dtype(&q.biases)?, p.group_size, p.bits)?
            }
        })
    }

    /// `x @ E.T`: logits through tied embeddings.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(w) => dense_matmul_t(x, w)?,
            Embedding::Quantized(q) => q.matmul_t(x)?,
        })
    }

    /// [`as_linear`](Self::as_linear) of `x` [B, L, hidden] as B sequences,
    /// each exactly as alone.
    pub fn as_linear_per_sequence(&self, x: &Array) -> Result<Array> {
        let (quantized, dense) = match self {
            Embedding::Quantized(q) => (Some(q), None),
            Embedding::Dense(w) => (None, Some(w)),
        };
        per_sequence(x, quantized, dense, None, |rows| self.as_linear(rows))
    }
}

/// `LayerNorm` with a gain and a bias (BERT, SigLIP, Whisper).
#[derive(Clone)]
pub struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    pub fn load(scope: &Scope, dims: i32, eps: f32) -> Result<Self> {
        Ok(LayerNorm { weight: scope.get("weight", &[dims])?, bias: scope.get("bias", &[dims])?, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(mlx_sys::fast::layer_norm(x, Some(&self.weight), Some(&self.bias), self.eps)?)
    }
}

#[derive(Clone)]
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(scope: &Scope, dims: i32, eps: f32) -> Result<Self> {
        Ok(RmsNorm { weight: scope.get("weight", &[dims])?, eps })
    }

    /// A norm whose gain is `offset + weight` (Gemma stores its gains as
    /// offsets from 1), added once here in the weight's dtype, as mlx-lm adds
    /// it on every call.
    pub fn load_with_offset(scope: &Scope, dims: i32, eps: f32, offset: f32) -> Result<Self> {
        let stored = scope.get("weight", &[dims])?;
        let weight = if offset == 0.0 { stored } else { stored.add_scalar(offset as f64)? };
        weight.eval()?;
        Ok(RmsNorm { weight, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(mlx_sys::kernels::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// Rotary position embedding, with `linear` and `llama3` frequency scaling.
#[derive(Clone)]
pub struct Rope {
    dims: i32,
    base: f32,
    scale: f32,
    traditional: bool,
    freqs: Option<Array>,
    /// YaRN's attention factor: the rotated features are multiplied by it
    /// before the rotation (1 otherwise).
    mscale: f32,
}

/// The `rope_scaling` block of a Hugging Face config.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: Option<f32>,
    pub low_freq_factor: Option<f32>,
    pub high_freq_factor: Option<f32>,
    pub original_max_position_embeddings: Option<f32>,
    /// YaRN's ramp and attention factor (mlx-lm's defaults: 32, 1, 1, 0).
    pub beta_fast: Option<f32>,
    pub beta_slow: Option<f32>,
    pub mscale: Option<f32>,
    pub mscale_all_dim: Option<f32>,
}

impl Rope {
    pub fn new(dims: i32, base: f32, traditional: bool, scaling: Option<&RopeScaling>) -> std::result::Result<Self, String> {
        let mut rope = Rope { dims, base, scale: 1.0, traditional, freqs: None, mscale: 1.0 };
        let Some(s) = scaling else { return Ok(rope) };
        match s.rope_type.as_str() {
            "default" => {}
            "linear" => rope.scale = 1.0 / s.factor.ok_or("linear rope_scaling needs `factor`")?,
            "llama3" => rope.freqs = Some(llama3_freqs(dims, base, s)?),
            "yarn" => {
                let (freqs, mscale) = yarn(dims, base, s)?;
                rope.freqs = Some(freqs);
                rope.mscale = mscale;
            }
            other => return Err(format!("rope_scaling type `{other}` is not supported (supported: linear, llama3, yarn)")),
        }
        Ok(rope)
    }

    /// Phi-3's `su` / `longrope` scaling as mlx-lm's `SuScaledRoPE`: periods
    /// `long_factor[i] * base^(2i / dims)` at every position (mlx-lm never
    /// switches to the short factors, whatever the sequence length), and the
    /// rotated features scaled by `sqrt(1 + ln(f) / ln(original))` where
    /// `f = max_positions / original` exceeds 1.
    pub fn su_scaled(
        dims: i32,
        base: f32,
        long_factor: &[f32],
        max_positions: f64,
        original: f64,
    ) -> std::result::Result<Self, String> {
        let half = (dims / 2).max(0) as usize;
        if long_factor.len() != half {
            return Err(format!("rope_scaling `long_factor` has {} entries; the {dims} rotated features need {half}", long_factor.len()));
        }
        let periods: Vec<f32> =
            long_factor.iter().enumerate().map(|(i, f)| f * base.powf((2 * i) as f32 / dims as f32)).collect();
        let freqs = Array::from_slice(&periods, &[half as i32]).map_err(|e| e.to_string())?;
        freqs.eval().map_err(|e| e.to_string())?;
        let factor = max_positions / original;
        let mscale = if factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / original.ln()).sqrt() };
        Ok(Rope { dims, base, scale: 1.0, traditional: false, freqs: Some(freqs), mscale: mscale as f32 })
    }

    /// Rotates `x` ([B, H, L, D]) for positions `offset..offset + L`.
    pub fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        let base = if self.freqs.is_some() { 0.0 } else { self.base };
        let scaled;
        let x = if self.mscale == 1.0 {
            x
        } else {
            let head = x.dim(-1);
            let rotated = x.slice_axis(-1, 0, self.dims)?.mul_scalar(self.mscale as f64)?;
            scaled = if self.dims == head {
                rotated
            } else {
                mlx_sys::concatenate(&[rotated, x.slice_axis(-1, self.dims, head)?], -1)?
            };
            &scaled
        };
        Ok(mlx_sys::kernels::rope(x, self.dims, self.traditional, base, self.scale, offset as i32, self.freqs.as_ref())?)
    }
}

/// YaRN's periods and attention factor, as mlx-lm's `YarnRoPE` computes them (in f64
/// where it uses Python floats, f32 where it uses MLX arrays).
fn yarn(dims: i32, base: f32, s: &RopeScaling) -> std::result::Result<(Array, f32), String> {
    let factor = s.factor.ok_or("yarn rope_scaling needs `factor`")? as f64;
    let original = s.original_max_position_embeddings.unwrap_or(4096.0) as f64;
    let (beta_fast, beta_slow) = (s.beta_fast.unwrap_or(32.0) as f64, s.beta_slow.unwrap_or(1.0) as f64);
    let (mscale, mscale_all_dim) = (s.mscale.unwrap_or(1.0) as f64, s.mscale_all_dim.unwrap_or(0.0) as f64);
    let (d, b) = (dims as f64, base as f64);
    let correction = |rotations: f64| d * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * b.ln());
    let low = correction(beta_fast).floor().max(0.0);
    let high = correction(beta_slow).ceil().min(d - 1.0);
    let get_mscale = |m: f64| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
    let attention = get_mscale(mscale) / get_mscale(mscale_all_dim);
    let (low, high) = (low as f32, if low == high { high as f32 + 0.001 } else { high as f32 });
    let half = (dims / 2).max(0) as usize;
    let periods: Vec<f32> = (0..half)
        .map(|i| {
            let extra = base.powf((2 * i) as f32 / dims as f32);
            let inter = factor as f32 * extra;
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let mask = 1.0 - ramp;
            (inter * extra) / (inter * mask + extra * (1.0 - mask))
        })
        .collect();
    let freqs = Array::from_slice(&periods, &[half as i32]).map_err(|e| e.to_string())?;
    freqs.eval().map_err(|e| e.to_string())?;
    Ok((freqs, attention as f32))
}

/// Llama 3's frequency schedule, as mlx-lm computes it (periods, not rates); shared with the
/// converter, which checks GGUF `rope_freqs` against it.
fn llama3_freqs(dims: i32, base: f32, s: &RopeScaling) -> std::result::Result<Array, String> {
    let factor = s.factor.ok_or("llama3 rope_scaling needs `factor`")?;
    let scaling = Llama3Scaling::new(factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings);
    let freqs = scaling.periods(dims.max(0) as usize, base);
    let freqs = Array::from_slice(&freqs, &[dims / 2]).map_err(|e| e.to_string())?;
    freqs.eval().map_err(|e| e.to_string())?;
    Ok(freqs)
}

/// The gate's activation in a [`GatedMlp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// `x * sigmoid(x)` (llama, qwen).
    #[default]
    Silu,
    /// GELU's tanh approximation, as MLX's `nn.gelu_approx` computes it
    /// (Hugging Face's `gelu_pytorch_tanh`; Gemma).
    GeluTanh,
}

impl Activation {
    pub fn apply(self, x: &Array) -> Result<Array> {
        match self {
            Activation::Silu => Ok(x.silu()?),
            Activation::GeluTanh => {
                // 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
                let cube = x.power(&Array::scalar(3.0, x.dtype())?)?;
                let inner = x.add(&cube.mul_scalar(0.044715)?)?.mul_scalar((2.0 / std::f64::consts::PI).sqrt())?;
                Ok(x.mul_scalar(0.5)?.multiply(&inner.tanh()?.add_scalar(1.0)?)?)
            }
        }
    }
}

/// `down(act(gate(x)) * up(x))`, `act` SiLU unless loaded otherwise.
#[derive(Clone)]
pub struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    activation: Activation,
}

impl GatedMlp {
    /// Its kind and width, for `mlxcel inspect`.
    pub fn describe(&self) -> String {
        let activation = match self.activation {
            Activation::Silu => "SwiGLU",
            Activation::GeluTanh => "GeGLU (tanh)",
        };
        format!("{activation} MLP {}", self.gate_proj.out_features())
    }

    pub fn load(scope: &Scope, hidden: i32, intermediate: i32, bias: bool) -> Result<Self> {
        Self::load_with(scope, hidden, intermediate, bias, Activation::Silu)
    }

    pub fn load_with(scope: &Scope, hidden: i32, intermediate: i32, bias: bool, activation: Activation) -> Result<Self> {
        Ok(GatedMlp {
            gate_proj: Linear::load(&scope.pp("gate_proj"), hidden, intermediate, bias)?,
            up_proj: Linear::load(&scope.pp("up_proj"), hidden, intermediate, bias)?,
            down_proj: Linear::load(&scope.pp("down_proj"), intermediate, hidden, bias)?,
            activation,
        })
    }

    /// A checkpoint that stores the gate and up projections as one
    /// `gate_up_proj` (gate rows first, as Phi-3's), split at load.
    pub fn load_fused(scope: &Scope, hidden: i32, intermediate: i32, activation: Activation) -> Result<Self> {
        let fused = Linear::load(&scope.pp("gate_up_proj"), hidden, 2 * intermediate, false)?;
        let [gate_proj, up_proj]: [Linear; 2] =
            fused.split_rows(&[intermediate, intermediate])?.try_into().unwrap_or_else(|_| unreachable!("two sizes"));
        let down_proj = Linear::load(&scope.pp("down_proj"), intermediate, hidden, false)?;
        Ok(GatedMlp { gate_proj, up_proj, down_proj, activation })
    }

    /// A SiLU-gated MLP of given projections (a mixture-of-experts' expert).
    pub fn from_parts(gate_proj: Linear, up_proj: Linear, down_proj: Linear) -> Self {
        GatedMlp { gate_proj, up_proj, down_proj, activation: Activation::Silu }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        self.forward_with(x, RowKernels::ByCount)
    }

    pub fn forward_with(&self, x: &Array, kernels: RowKernels) -> Result<Array> {
        if let Some(hidden) = self.fused_gate_up(x, kernels.rows(x.size() / x.dim(-1).max(1) as usize))? {
            return self.down_proj.forward_with(&hidden, kernels);
        }
        let gate = self.activation.apply(&self.gate_proj.forward_with(x, kernels)?)?;
        self.down_proj.forward_with(&gate.multiply(&self.up_proj.forward_with(x, kernels)?)?, kernels)
    }

    /// `x` [B, L, hidden] as B sequences in one pass, each exactly as
    /// [`forward`](Self::forward) computes it alone: every projection runs
    /// over all rows with the kernel one sequence's L rows choose
    /// ([`Linear::forward_per_sequence`]).
    pub fn forward_per_sequence(&self, x: &Array) -> Result<Array> {
        if x.dim(0) == 1 {
            return self.forward(x);
        }
        if let Some(hidden) = self.fused_gate_up(x, x.dim(1) as usize)? {
            return self.down_proj.forward_per_sequence(&hidden);
        }
        let gate = self.activation.apply(&self.gate_proj.forward_per_sequence(x)?)?;
        self.down_proj.forward_per_sequence(&gate.multiply(&self.up_proj.forward_per_sequence(x)?)?)
    }

    /// `silu(gate(x)) * up(x)` as one GEMM node for many rows (prefill), when
    /// both projections are quantized alike and have no bias; `rows` is the
    /// row count the kernel choice sees (one sequence's).
    fn fused_gate_up(&self, x: &Array, rows: usize) -> Result<Option<Array>> {
        if self.activation != Activation::Silu
            || rows < DENSE_PREFILL_MIN_ROWS
            || prefill_uses_mlx()
            || self.gate_proj.bias.is_some()
            || self.up_proj.bias.is_some()
        {
            return Ok(None);
        }
        let (LinearWeight::Quantized(g), LinearWeight::Quantized(u)) = (&self.gate_proj.weight, &self.up_proj.weight) else {
            return Ok(None);
        };
        let p = g.params;
        if u.params != p || !kernels::gemm_supports(p.group_size, p.bits) {
            return Ok(None);
        }
        let hidden = kernels::quantized_gemm_swiglu(
            x,
            [&g.weight, &g.scales, &g.biases],
            [&u.weight, &u.scales, &u.biases],
            p.group_size,
            p.bits,
        )?;
        Ok(Some(hidden))
    }
}

/// Shape and options of a grouped-query attention block.
#[derive(Debug, Clone)]
pub struct AttentionSpec {
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Qwen3-style RMSNorm of q and k per head, with this eps.
    pub qk_norm_eps: Option<f32>,
    /// Added to the q/k norm weights to make their gains (1 for Gemma, whose
    /// norms scale by 1 + weight; else 0).
    pub qk_norm_offset: f32,
    /// The q/k norms span the whole projection (all heads at once, as
    /// OLMo 2's) rather than each head.
    pub qk_norm_whole: bool,
    /// q, k and v are stored as one `qkv_proj` (q rows, then k, then v), as
    /// Phi-3's; split at load.
    pub qkv_fused: bool,
    /// Gemma 2's soft-capping of the attention scores: `cap * tanh(s / cap)`
    /// before the mask and softmax.
    pub softcap: Option<f32>,
    /// The softmax scale; None is head_dim^-0.5.
    pub scale: Option<f32>,
    /// A sliding window of this many positions (the token itself included):
    /// the token at position p sees p + 1 - window ..= p. None sees every
    /// position (the pool's own window, if any, still applies).
    pub window: Option<i32>,
}

impl AttentionSpec {
    /// Grouped-query attention of this shape, with no biases, norms or window.
    pub fn new(hidden: i32, heads: i32, kv_heads: i32, head_dim: i32) -> Self {
        AttentionSpec {
            hidden,
            heads,
            kv_heads,
            head_dim,
            qkv_bias: false,
            o_bias: false,
            qk_norm_eps: None,
            qk_norm_offset: 0.0,
            qk_norm_whole: false,
            qkv_fused: false,
            softcap: None,
            scale: None,
            window: None,
        }
    }

    /// The window as the kernels take it (keep 0; `KvWindow::ALL` without one).
    pub fn kv_window(&self) -> KvWindow {
        self.window.map_or(KvWindow::ALL, |window| KvWindow { window, keep: 0 })
    }
}

#[derive(Clone)]
pub struct Attention {
    spec: AttentionSpec,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    rope: Rope,
    scale: f32,
}

impl Attention {
    /// Its shape and options, for `mlxcel inspect`.
    pub fn describe(&self) -> String {
        let s = &self.spec;
        let mut parts = vec![format!("attention {} heads × {} ({} KV heads)", s.heads, s.head_dim, s.kv_heads)];
        if s.qkv_fused {
            parts.push("fused qkv_proj (split at load)".into());
        }
        if s.qkv_bias {
            parts.push("q/k/v biases".into());
        }
        if s.qk_norm_eps.is_some() {
            parts.push(if s.qk_norm_whole { "q/k norms over the projection" } else { "q/k norms per head" }.into());
        }
        if let Some(cap) = s.softcap {
            parts.push(format!("score soft-cap {cap}"));
        }
        if let Some(window) = s.window {
            parts.push(format!("sliding window {window}"));
        }
        parts.join(", ")
    }

    pub fn load(scope: &Scope, spec: AttentionSpec, rope: Rope) -> Result<Self> {
        let AttentionSpec { hidden, heads, kv_heads, head_dim, qkv_bias, o_bias, qk_norm_eps, qk_norm_offset, scale, .. } = spec;
        let (q_rows, kv_rows) = (heads * head_dim, kv_heads * head_dim);
        let norm = |name: &str, rows: i32| {
            let dims = if spec.qk_norm_whole { rows } else { head_dim };
            qk_norm_eps.map(|eps| RmsNorm::load_with_offset(&scope.pp(name), dims, eps, qk_norm_offset)).transpose()
        };
        let [q_proj, k_proj, v_proj]: [Linear; 3] = if spec.qkv_fused {
            let fused = Linear::load(&scope.pp("qkv_proj"), hidden, q_rows + 2 * kv_rows, qkv_bias)?;
            fused.split_rows(&[q_rows, kv_rows, kv_rows])?.try_into().unwrap_or_else(|_| unreachable!("three sizes"))
        } else {
            let load = |name: &str, rows: i32| Linear::load(&scope.pp(name), hidden, rows, qkv_bias);
            [load("q_proj", q_rows)?, load("k_proj", kv_rows)?, load("v_proj", kv_rows)?]
        };
        Ok(Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj: Linear::load(&scope.pp("o_proj"), q_rows, hidden, o_bias)?,
            q_norm: norm("q_norm", q_rows)?,
            k_norm: norm("k_norm", kv_rows)?,
            rope,
            scale: scale.unwrap_or((head_dim as f32).powf(-0.5)),
            spec,
        })
    }

    /// `x`: [B, L, hidden] → [B, L, hidden], appending to `cache`.
    pub fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        let project = |linear: &Linear| linear.forward_with(x, kernels);
        let (q, k, v) = self.split_heads(x, project(&self.q_proj)?, project(&self.k_proj)?, project(&self.v_proj)?)?;
        let out = self.attend(&q, &k, &v, cache)?;
        self.o_proj.forward_with(&out, kernels)
    }

    /// `x` [B, L, hidden] as B sequences, `caches[b]` sequence b's cache:
    /// the q/k/v and o projections run once over all rows (each weight read
    /// once per step, [`Linear::forward_per_sequence`]), RoPE and attention
    /// per sequence at its own cache offset. Each sequence gets exactly what
    /// [`forward`](Self::forward) gives it alone with `RowKernels::ByCount`.
    pub fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        let project = |linear: &Linear| linear.forward_per_sequence(x);
        let (q, k, v) = self.split_heads(x, project(&self.q_proj)?, project(&self.k_proj)?, project(&self.v_proj)?)?;
        let rows = caches
            .iter_mut()
            .enumerate()
            .map(|(b, cache)| {
                let row = |a: &Array| a.slice_axis(0, b as i32, b as i32 + 1);
                self.attend(&row(&q)?, &row(&k)?, &row(&v)?, cache.as_mut())
            })
            .collect::<Result<Vec<_>>>()?;
        self.o_proj.forward_per_sequence(&mlx_sys::concatenate(&rows, 0)?)
    }

    /// Projections [B, L, n * head_dim] → q, k, v as [B, n, L, head_dim]
    /// (q and k through their per-head norms).
    fn split_heads(&self, x: &Array, q: Array, k: Array, v: Array) -> Result<(Array, Array, Array)> {
        let (b, l) = (x.dim(0), x.dim(1));
        let AttentionSpec { heads, kv_heads, head_dim, .. } = self.spec;
        let whole = self.spec.qk_norm_whole;
        let split = |y: Array, n: i32, norm: &Option<RmsNorm>| -> Result<Array> {
            let y = match norm {
                Some(norm) if whole => norm.forward(&y)?.reshape(&[b, l, n, head_dim])?,
                Some(norm) => norm.forward(&y.reshape(&[b, l, n, head_dim])?)?,
                None => y.reshape(&[b, l, n, head_dim])?,
            };
            Ok(y.transpose(&[0, 2, 1, 3])?)
        };
        Ok((split(q, heads, &self.q_norm)?, split(k, kv_heads, &self.k_norm)?, split(v, kv_heads, &None)?))
    }

    /// RoPE at the cache's offset, the cache update and attention for one
    /// cache's q, k, v ([B, n, L, head_dim]) → [B, L, heads * head_dim].
    fn attend(&self, q: &Array, k: &Array, v: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        let (b, l) = (q.dim(0), q.dim(2));
        let AttentionSpec { heads, head_dim, .. } = self.spec;
        let offset = cache.offset();
        let q = self.rope.forward(q, offset)?;
        let k = self.rope.forward(k, offset)?;
        let window = self.spec.kv_window();
        let out = if let Some(cap) = self.spec.softcap {
            let (k, v) = cache.update_and_fetch(&k, v)?;
            softcapped_attention(&q, &k, &v, self.scale, cap, self.spec.window)?
        } else if let Some(out) = cache.attend(&q, &k, v, self.scale, window)? {
            out
        } else {
            let (k, v) = cache.update_and_fetch(&k, v)?;
            let seen = k.dim(2);
            match self.spec.window.filter(|&w| w < seen) {
                // Positions outside the window: the last `window + l - 1`
                // keys hold all a new token sees, and a mask leaves each its
                // own `window`.
                Some(w) => {
                    let first = (seen - l - w + 1).max(0);
                    let (k, v) = (k.slice_axis(2, first, seen)?, v.slice_axis(2, first, seen)?);
                    if l == 1 {
                        fast::scaled_dot_product_attention(&q, &k, &v, self.scale, AttentionMask::None)?
                    } else {
                        let mask = window_mask(l, seen, first, w)?;
                        fast::scaled_dot_product_attention(&q, &k, &v, self.scale, AttentionMask::Array(&mask))?
                    }
                }
                None if !prefill_uses_mlx() => {
                    // Our causal attention kernel (MLX's for what it does not
                    // handle), for decode steps too: MLX's CPU attention is a
                    // BLAS matmul. Its result transposes back to [B, L, H, D]
                    // without a copy.
                    kernels::causal_attention(&q, &k, &v, self.scale)?
                }
                None => {
                    let mask = if l > 1 { AttentionMask::Causal } else { AttentionMask::None };
                    fast::scaled_dot_product_attention(&q, &k, &v, self.scale, mask)?
                }
            }
        };
        Ok(out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, heads * head_dim])?)
    }
}

/// `cap * tanh(x / cap)`: Gemma 2's soft-capping, computed as mlx-lm does.
pub fn softcap(x: &Array, cap: f32) -> Result<Array> {
    Ok(x.divide(&Array::scalar(cap as f64, x.dtype())?)?.tanh()?.mul_scalar(cap as f64)?)
}

/// Attention with soft-capped scores, explicitly as mlx-lm's gemma2 computes
/// it (no fused kernel caps its scores): q ([B, H, L, D]) scaled, q·k per
/// group of query heads sharing a kv head, the cap, the causal mask (and
/// `window`, if any) as the float minimum, a precise softmax, then the
/// values. `k`, `v`: [B, kv_heads, seen, D], the last L positions new.
fn softcapped_attention(q: &Array, k: &Array, v: &Array, scale: f32, cap: f32, window: Option<i32>) -> Result<Array> {
    let (b, heads, l, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let (kv_heads, seen) = (k.dim(1), k.dim(2));
    let repeats = heads / kv_heads;
    let mut q = q.mul_scalar(scale as f64)?;
    let (mut k, mut v) = (k.clone(), v.clone());
    if repeats > 1 {
        q = q.reshape(&[b, kv_heads, repeats, l, d])?;
        k = k.expand_dims(2)?;
        v = v.expand_dims(2)?;
    }
    let mut scores = softcap(&q.matmul(&k.swapaxes(-1, -2)?)?, cap)?;
    let window = window.filter(|&w| w < seen);
    if l > 1 || window.is_some() {
        let mask = window_mask(l, seen, 0, window.unwrap_or(seen))?;
        let lowest = Array::scalar(f32::MIN as f64, scores.dtype())?;
        scores = mlx_sys::where_(&mask, &scores, &lowest)?;
    }
    let out = scores.softmax(&[-1], true)?.matmul(&v)?;
    Ok(if repeats > 1 { out.reshape(&[b, heads, l, d])? } else { out })
}

/// The boolean mask [l, seen - first] of `l` new tokens (the last of `seen`
/// positions) over the keys from position `first` on, each token seeing the
/// latest `window` positions up to itself.
fn window_mask(l: i32, seen: i32, first: i32, window: i32) -> Result<Array> {
    let queries = Array::arange((seen - l) as f64, seen as f64, 1.0, Dtype::Int32)?.reshape(&[l, 1])?;
    let keys = Array::arange(first as f64, seen as f64, 1.0, Dtype::Int32)?.reshape(&[1, seen - first])?;
    let visible = keys.less_equal(&queries)?;
    Ok(visible.logical_and(&keys.greater(&queries.add_scalar(-(window as f64))?)?)?)
}

/// Pre-norm decoder block: attention and gated MLP with residuals.
#[derive(Clone)]
pub struct DecoderBlock {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    fused: Option<FusedBlock>,
}

/// Most new tokens per forward pass that run through the fused block (decode,
/// and prompts of up to 32 tokens: the block's matvec loops take 4 rows at a
/// time, and one node per layer saves the ~25 MLX ops whose dispatch
/// dominates a short prefill: 16 tokens 1.25x, 32 tokens 1.17x faster on AMD
/// EPYC Zen 5, even with 64). Longer prompts run as MLX ops around our
/// GEMMs, which amortize their dispatch.
pub(crate) const FUSED_MAX_ROWS: i32 = 32;

/// Whether `x` is what the fused block takes: [B, L, hidden] float32 with
/// at most [`FUSED_MAX_ROWS`] new tokens per sequence.
pub(crate) fn fused_takes(x: &Array) -> bool {
    x.ndim() == 3 && x.dim(1) <= FUSED_MAX_ROWS && x.dtype() == Dtype::Float32
}

impl DecoderBlock {
    /// Its layout, for `mlxcel inspect`.
    pub fn describe(&self) -> String {
        let fused = if self.is_fused() { " [one fused kernel node at decode]" } else { "" };
        format!("pre-norm: {} → {}{fused}", self.self_attn.describe(), self.mlp.describe())
    }

    pub fn new(input_layernorm: RmsNorm, self_attn: Attention, post_attention_layernorm: RmsNorm, mlp: GatedMlp) -> Self {
        let mut block = DecoderBlock { input_layernorm, self_attn, post_attention_layernorm, mlp, fused: None };
        block.fused = FusedBlock::new(FusedParts {
            input_norm: &block.input_layernorm,
            attn: &block.self_attn,
            mlp_norm: &block.post_attention_layernorm,
            mlp: &block.mlp,
            output_norms: None,
        });
        block
    }

    pub fn forward(&self, x: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        self.forward_with(x, cache, RowKernels::ByCount)
    }

    /// [`forward`](Self::forward) with the kernels chosen by `kernels`
    /// (`Prefill` never takes the fused block).
    pub fn forward_with(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        if let (Some(fused), RowKernels::ByCount) = (&self.fused, kernels) {
            if fused_takes(x) && x.dim(0) == 1 {
                if let Some(out) = fused.forward(x, cache)? {
                    return Ok(out);
                }
            }
        }
        let h = x.add(&self.self_attn.forward(&self.input_layernorm.forward(x)?, cache, kernels)?)?;
        h.add(&self.mlp.forward_with(&self.post_attention_layernorm.forward(&h)?, kernels)?)
            .map_err(Into::into)
    }

    /// `x` [B, L, hidden] as B sequences, `caches[b]` sequence b's cache.
    /// Each sequence's output is exactly what [`forward`](Self::forward)
    /// gives it alone, and each weight is read once per step for all of
    /// them: the fused block serves all rows in one node; MLX's op-by-op
    /// path (dense checkpoints, `MLXCEL_FUSED=0`, long prompts) runs the
    /// norms, projections and MLP once over the [B, L, hidden] batch and
    /// RoPE and attention per sequence over its own cache
    /// ([`Attention::forward_batch`], [`GatedMlp::forward_per_sequence`]).
    /// When the fused block declines a batch whose rows it would take alone
    /// (a cache it cannot write in place), each sequence runs on its own.
    pub fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        if caches.len() != x.dim(0) as usize {
            return Err(Error::Mlx(format!("{} caches given for a batch of {}", caches.len(), x.dim(0))));
        }
        if let [cache] = caches {
            return self.forward(x, cache.as_mut());
        }
        if let Some(fused) = self.fused_for(x) {
            if let Some(out) = fused.forward_batch(x, caches)? {
                return Ok(out);
            }
        } else {
            let h = x.add(&self.self_attn.forward_batch(&self.input_layernorm.forward(x)?, caches)?)?;
            return Ok(h.add(&self.mlp.forward_per_sequence(&self.post_attention_layernorm.forward(&h)?)?)?);
        }
        let rows = caches
            .iter_mut()
            .enumerate()
            .map(|(b, cache)| self.forward(&x.slice_axis(0, b as i32, b as i32 + 1)?, cache.as_mut()))
            .collect::<Result<Vec<_>>>()?;
        Ok(mlx_sys::concatenate(&rows, 0)?)
    }

    /// Whether decode steps of this block run as one fused kernel node.
    pub fn is_fused(&self) -> bool {
        self.fused.is_some()
    }

    /// The fused block where [`forward_batch`](Self::forward_batch) runs it
    /// for `x` over paged caches (few f32 rows).
    pub(crate) fn fused_for(&self, x: &Array) -> Option<&FusedBlock> {
        self.fused.as_ref().filter(|_| fused_takes(x))
    }
}

/// A decoder block as one CPU kernel node (`kernels::decoder_layer`): used
/// for decode when every projection is affine-quantized in a layout the
/// kernels support. `RuntimeConfig::fused_decode` (`MLXCEL_FUSED=0`) turns
/// it off (for comparisons). Opaque outside this crate.
#[derive(Clone)]
pub struct FusedBlock {
    spec: DecoderLayerSpec,
    weights: PreparedDecoderLayer,
}

/// What a fused block is made of: llama's pre-norm block, or Gemma's, whose
/// attention and MLP outputs are normed before their residual adds
/// (`output_norms`: after attention, after the MLP).
pub(crate) struct FusedParts<'a> {
    pub input_norm: &'a RmsNorm,
    pub attn: &'a Attention,
    /// The MLP's input norm.
    pub mlp_norm: &'a RmsNorm,
    pub mlp: &'a GatedMlp,
    pub output_norms: Option<(&'a RmsNorm, &'a RmsNorm)>,
}

impl FusedBlock {
    /// The block as one kernel node, or None when the kernel cannot run it
    /// (a dense projection, norms with different eps, partial RoPE).
    pub(crate) fn new(parts: FusedParts) -> Option<Self> {
        let (weights, spec) = Self::layer(parts)?;
        Self::prepare(weights, spec)
    }

    /// A block whose MLP is a mixture of `experts` (quantized, stacked as
    /// the kernel takes them; `parts.mlp` is one of the experts, for the
    /// shapes) routed by `router` to `top_k` experts a token (`routing` as
    /// `DecoderLayerSpec::routing`).
    pub(crate) fn new_moe(parts: FusedParts, router: &Linear, experts: &StackedExperts, top_k: i32, routing: i32) -> Option<Self> {
        let (mut weights, mut spec) = Self::layer(parts)?;
        let quantized = |q: &QuantizedWeight| {
            kernels::supports(q.params.group_size, q.params.bits).then(|| QuantizedProjection {
                weight: q.weight.clone(),
                scales: q.scales.clone(),
                biases: q.biases.clone(),
                bias: None,
            })
        };
        let LinearWeight::Quantized(r) = &router.weight else { return None };
        weights.router = Some(quantized(r)?);
        weights.gate_proj = quantized(&experts.gate)?;
        weights.up_proj = quantized(&experts.up)?;
        weights.down_proj = quantized(&experts.down)?;
        spec.experts = experts.count;
        spec.top_k = top_k;
        spec.routing = routing;
        Self::prepare(weights, spec)
    }

    // Prepared once: each step's node then has x and the caches as its only
    // graph inputs. A layout the kernel rejects stays on MLX's ops.
    fn prepare(weights: DecoderLayerWeights, spec: DecoderLayerSpec) -> Option<Self> {
        let weights = PreparedDecoderLayer::new(&weights, &spec).ok()?;
        Some(FusedBlock { spec, weights })
    }

    fn layer(parts: FusedParts) -> Option<(DecoderLayerWeights, DecoderLayerSpec)> {
        if !crate::runtime::current().fused_decode_active() {
            return None;
        }
        let FusedParts { input_norm, attn, mlp_norm, mlp, output_norms } = parts;
        let eps = input_norm.eps;
        let output_norm_list = output_norms.iter().flat_map(|(a, b)| [*a, *b]);
        let norms_agree = mlp_norm.eps == eps
            && attn.q_norm.iter().chain(attn.k_norm.iter()).chain(output_norm_list).all(|n| n.eps == eps);
        if !norms_agree
            || attn.rope.dims != attn.spec.head_dim
            || attn.q_norm.is_some() != attn.k_norm.is_some()
            || attn.spec.qk_norm_whole
            || attn.spec.softcap.is_some()
        {
            return None;
        }
        let projection = |linear: &Linear| -> Option<QuantizedProjection> {
            let LinearWeight::Quantized(q) = &linear.weight else { return None };
            kernels::supports(q.params.group_size, q.params.bits).then(|| QuantizedProjection {
                weight: q.weight.clone(),
                scales: q.scales.clone(),
                biases: q.biases.clone(),
                bias: linear.bias.clone(),
            })
        };
        let weights = DecoderLayerWeights {
            input_norm: input_norm.weight.clone(),
            q_proj: projection(&attn.q_proj)?,
            k_proj: projection(&attn.k_proj)?,
            v_proj: projection(&attn.v_proj)?,
            o_proj: projection(&attn.o_proj)?,
            post_attention_norm: mlp_norm.weight.clone(),
            gate_proj: projection(&mlp.gate_proj)?,
            up_proj: projection(&mlp.up_proj)?,
            down_proj: projection(&mlp.down_proj)?,
            q_norm: attn.q_norm.as_ref().map(|n| n.weight.clone()),
            k_norm: attn.k_norm.as_ref().map(|n| n.weight.clone()),
            rope_freqs: attn.rope.freqs.clone(),
            attn_out_norm: output_norms.map(|(a, _)| a.weight.clone()),
            mlp_out_norm: output_norms.map(|(_, m)| m.weight.clone()),
            router: None,
        };
        let window = attn.spec.kv_window();
        let spec = DecoderLayerSpec {
            hidden: attn.spec.hidden,
            heads: attn.spec.heads,
            kv_heads: attn.spec.kv_heads,
            head_dim: attn.spec.head_dim,
            intermediate: mlp.gate_proj.quantized_out_features()?,
            offset: 0,
            norm_eps: eps,
            rope_dims: attn.rope.dims,
            rope_base: attn.rope.base,
            rope_scale: attn.rope.scale,
            rope_traditional: attn.rope.traditional,
            rope_mscale: attn.rope.mscale,
            attn_scale: attn.scale,
            // KvCache::append_with hands over buffers it owns exclusively.
            cache_in_place: true,
            kv_window: window.window,
            kv_keep: window.keep,
            kv_layer: 0,
            activation: match mlp.activation {
                Activation::Silu => 0,
                Activation::GeluTanh => 1,
            },
            experts: 0,
            top_k: 0,
            routing: 0,
        };
        Some((weights, spec))
    }

    /// The block for `x` ([1, L, hidden]), or None when the cache cannot be
    /// written in place.
    pub(crate) fn forward(&self, x: &Array, cache: &mut dyn KvCache) -> Result<Option<Array>> {
        if let Some(paged) = cache.as_paged() {
            return self.forward_paged(x, &mut [paged]).map(Some);
        }
        let layout = CacheLayout { kv_heads: self.spec.kv_heads, head_dim: self.spec.head_dim, dtype: Dtype::Float32 };
        let mut out = None;
        let appended = cache.append_with(x.dim(1) as usize, layout, &mut |keys, values, offset| {
            let spec = DecoderLayerSpec { offset: offset as i32, ..self.spec };
            let (h, keys, values) = self.weights.forward(x, keys, values, &spec)?;
            out = Some(h);
            Ok((keys, values))
        })?;
        Ok(if appended { out } else { None })
    }

    /// The block for `x` ([B, L, hidden]) over B caches in one node, or None
    /// (every cache unchanged) when one of them cannot be written in place.
    pub(crate) fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Option<Array>> {
        let rows = caches.len();
        let mut paged: Vec<&mut PagedKvCache> = caches.iter_mut().filter_map(|c| c.as_paged()).collect();
        if paged.len() == rows && paged.iter().all(|p| Arc::ptr_eq(p.pool(), paged[0].pool())) {
            return self.forward_paged(x, &mut paged).map(Some);
        }
        drop(paged);
        let layout = CacheLayout { kv_heads: self.spec.kv_heads, head_dim: self.spec.head_dim, dtype: Dtype::Float32 };
        let length = x.dim(1) as usize;
        let mut buffers = Vec::with_capacity(caches.len());
        for cache in caches.iter_mut() {
            match cache.append_buffers(length, layout)? {
                Some(b) => buffers.push(b),
                None => return Ok(None),
            }
        }
        let sequences: Vec<kernels::SequenceCache<'_>> = buffers
            .iter()
            .map(|(keys, values, offset)| kernels::SequenceCache { keys, values, offset: *offset as i32 })
            .collect();
        let (out, written) = self.weights.forward_batch(x, &sequences, &self.spec)?;
        drop(sequences);
        drop(buffers);
        for (cache, (keys, values)) in caches.iter_mut().zip(written) {
            cache.commit_append(keys, values, length);
        }
        Ok(Some(out))
    }
}

impl FusedBlock {
    /// The block for `x` ([B, L, hidden]) over B paged caches of one pool,
    /// in one node that writes the pool in place.
    fn forward_paged(&self, x: &Array, caches: &mut [&mut PagedKvCache]) -> Result<Array> {
        let length = x.dim(1) as usize;
        let tables = caches.iter().map(|c| c.table_for(length)).collect::<Result<Vec<_>>>()?;
        let sequences: Vec<kernels::PagedSequence<'_>> = tables
            .iter()
            .zip(caches.iter())
            .map(|(table, c)| kernels::PagedSequence { table, offset: c.offset() as i32 })
            .collect();
        let (pool_keys, pool_values) = caches[0].layer_pools()?;
        let spec = self.paged_spec(caches[0]);
        let (out, keys, values) = self.weights.forward_paged(x, &pool_keys, &pool_values, &sequences, &spec)?;
        caches[0].set_layer_pools(keys, values);
        for cache in caches.iter_mut() {
            cache.advance(length);
        }
        Ok(out)
    }
}

impl FusedBlock {
    /// The prepared weights.
    pub(crate) fn prepared(&self) -> &PreparedDecoderLayer {
        &self.weights
    }

    /// The spec of a node over `cache`'s layer of a paged pool: the
    /// layer's window within the pool's, and its place in an 8-bit pool.
    pub(crate) fn paged_spec(&self, cache: &PagedKvCache) -> DecoderLayerSpec {
        let layer = KvWindow { window: self.spec.kv_window, keep: self.spec.kv_keep };
        let window = crate::paged::layer_window(cache.pool().window(), layer);
        DecoderLayerSpec { kv_window: window.window, kv_keep: window.keep, kv_layer: cache.layer() as i32, ..self.spec }
    }
}

/// The compute dtype: float32 on the CPU (MLX's CPU kernels are fastest and
/// exact there); the checkpoint's own floating dtype on a GPU.
pub fn compute_dtype(checkpoint_dtype: Option<Dtype>) -> Dtype {
    match mlx_sys::Device::default_device() {
        mlx_sys::Device::Gpu => checkpoint_dtype.filter(|d| d.is_floating()).unwrap_or(Dtype::Float16),
        mlx_sys::Device::Cpu => Dtype::Float32,
    }
}
