//! The SigLIP vision transformer of Idefics3 / SmolVLM, as mlx-vlm's
//! `idefics3/vision.py` (`vision_model.` weights): a patch embedding (a
//! convolution with stride = kernel = `patch_size`, computed here as one
//! matrix product over flattened patches), learned position embeddings,
//! pre-norm encoder layers with bidirectional attention and a GELU (erf) MLP,
//! and a final LayerNorm.

use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::Array;
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::nn::{LayerNorm, Linear};
use crate::weights::Scope;

/// `vision_config`, with mlx-vlm's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct SiglipArgs {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: i32,
    pub num_attention_heads: i32,
    pub patch_size: i32,
    #[serde(default = "default_layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "default_intermediate")]
    pub intermediate_size: i32,
    #[serde(default = "default_image_size")]
    pub image_size: i32,
    #[serde(default = "default_channels")]
    pub num_channels: i32,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
}

fn default_model_type() -> String {
    "siglip_vision_model".into()
}
fn default_layers() -> i32 {
    12
}
fn default_intermediate() -> i32 {
    3072
}
fn default_image_size() -> i32 {
    224
}
fn default_channels() -> i32 {
    3
}
fn default_eps() -> f32 {
    1e-6
}

impl SiglipArgs {
    pub fn validate(&self) -> std::result::Result<(), String> {
        const TYPES: &[&str] = &["siglip_vision_model", "idefics3", "idefics3_vision", "smolvlm_vision"];
        if !TYPES.contains(&self.model_type.as_str()) {
            return Err(format!("vision_config.model_type `{}` is not supported ({})", self.model_type, TYPES.join(", ")));
        }
        super::decoder::check_sizes(&[
            ("vision_config.hidden_size", self.hidden_size),
            ("vision_config.num_attention_heads", self.num_attention_heads),
            ("vision_config.patch_size", self.patch_size),
            ("vision_config.num_hidden_layers", self.num_hidden_layers),
            ("vision_config.intermediate_size", self.intermediate_size),
            ("vision_config.image_size", self.image_size),
        ])?;
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err("vision_config.hidden_size is not a multiple of num_attention_heads".into());
        }
        if self.image_size % self.patch_size != 0 {
            return Err("vision_config.image_size is not a multiple of patch_size".into());
        }
        if self.num_channels != 3 {
            return Err(format!("vision_config.num_channels {} (only RGB, 3, is supported)", self.num_channels));
        }
        Ok(())
    }

    pub fn patches_per_side(&self) -> i32 {
        self.image_size / self.patch_size
    }
}

struct EncoderLayer {
    layer_norm1: LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl EncoderLayer {
    fn load(scope: &Scope, args: &SiglipArgs) -> Result<Self> {
        let (d, eps) = (args.hidden_size, args.layer_norm_eps);
        let attn = scope.pp("self_attn");
        let mlp = scope.pp("mlp");
        Ok(EncoderLayer {
            layer_norm1: LayerNorm::load(&scope.pp("layer_norm1"), d, eps)?,
            q_proj: Linear::load(&attn.pp("q_proj"), d, d, true)?,
            k_proj: Linear::load(&attn.pp("k_proj"), d, d, true)?,
            v_proj: Linear::load(&attn.pp("v_proj"), d, d, true)?,
            out_proj: Linear::load(&attn.pp("out_proj"), d, d, true)?,
            layer_norm2: LayerNorm::load(&scope.pp("layer_norm2"), d, eps)?,
            fc1: Linear::load(&mlp.pp("fc1"), d, args.intermediate_size, true)?,
            fc2: Linear::load(&mlp.pp("fc2"), args.intermediate_size, d, true)?,
        })
    }

    fn forward(&self, x: &Array, heads: i32) -> Result<Array> {
        let (n, l, d) = (x.dim(0), x.dim(1), x.dim(2));
        let h = self.layer_norm1.forward(x)?;
        let split = |a: Array| -> Result<Array> { Ok(a.reshape(&[n, l, heads, d / heads])?.transpose(&[0, 2, 1, 3])?) };
        let q = split(self.q_proj.forward(&h)?)?;
        let k = split(self.k_proj.forward(&h)?)?;
        let v = split(self.v_proj.forward(&h)?)?;
        let scale = ((d / heads) as f32).powf(-0.5);
        let attended = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None)?;
        let attended = attended.transpose(&[0, 2, 1, 3])?.reshape(&[n, l, d])?;
        let x = x.add(&self.out_proj.forward(&attended)?)?;
        let h = self.fc1.forward(&self.layer_norm2.forward(&x)?)?;
        let h = mlx_sys::kernels::gelu_erf(&h)?;
        Ok(x.add(&self.fc2.forward(&h)?)?)
    }
}

/// The vision tower: tiles in, one hidden state per patch out.
pub struct SiglipVision {
    args: SiglipArgs,
    /// The patch convolution as a matrix: [hidden, patch·patch·channels]
    /// over patches flattened (row, column, channel), MLX's kernel layout.
    patch_weight: Linear,
    /// Every patch's position embedding, [patches, hidden] (all patches
    /// real: the position ids mlx-vlm computes for a full tile).
    positions: Array,
    layers: Vec<EncoderLayer>,
    post_layernorm: LayerNorm,
}

impl SiglipVision {
    /// `scope`: the `vision_model.` weights.
    pub fn load(scope: &Scope, args: SiglipArgs, config_path: &std::path::Path) -> Result<Self> {
        args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
        let (d, p, c) = (args.hidden_size, args.patch_size, args.num_channels);
        let embeddings = scope.pp("embeddings");
        let conv = embeddings.pp("patch_embedding");
        // mlx-vlm's sanitize turns PyTorch's [out, in, kh, kw] into MLX's
        // [out, kh, kw, in]; an MLX checkpoint stores the latter.
        let weight = conv.get("weight", &[d, p, p, c])?.reshape(&[d, p * p * c])?;
        weight.eval()?;
        let bias = conv.get("bias", &[d])?;
        let patch_weight = Linear::from_dense(weight, Some(bias));
        let side = args.patches_per_side();
        let table = embeddings.pp("position_embedding").get("weight", &[side * side, d])?;
        let ids = position_ids(side);
        let positions = table.take(&Array::from_slice(&ids, &[ids.len() as i32])?, 0)?;
        positions.eval()?;
        let layers = (0..args.num_hidden_layers)
            .map(|i| EncoderLayer::load(&scope.pp("encoder").pp("layers").pp(i), &args))
            .collect::<Result<Vec<_>>>()?;
        // mlx-vlm's `post_layernorm` is `nn.LayerNorm(hidden)`: MLX's default eps, 1e-5.
        let post_layernorm = LayerNorm::load(&scope.pp("post_layernorm"), d, 1e-5)?;
        scope.weights.skip(&scope.path("embeddings.position_ids"));
        Ok(SiglipVision { args, patch_weight, positions, layers, post_layernorm })
    }

    pub fn args(&self) -> &SiglipArgs {
        &self.args
    }

    /// `pixel_values` [N, 3, S, S] → [N, patches, hidden].
    pub fn forward(&self, pixel_values: &Array) -> Result<Array> {
        let (p, s) = (self.args.patch_size, self.args.image_size);
        let shape = pixel_values.shape();
        if shape.len() != 4 || shape[1] != 3 || shape[2] != s || shape[3] != s {
            return Err(Error::InvalidInput(format!("pixel values of shape {shape:?}, expected [tiles, 3, {s}, {s}]")));
        }
        let (n, g) = (shape[0], s / p);
        // [N, 3, S, S] → [N, g, g, p, p, 3] → [N, g², p²·3]: each patch in the conv kernel's order.
        let x = pixel_values
            .reshape(&[n, 3, g, p, g, p])?
            .transpose(&[0, 2, 4, 3, 5, 1])?
            .reshape(&[n, g * g, p * p * 3])?
            .astype(self.positions.dtype())?;
        let mut x = self.patch_weight.forward(&x)?.add(&self.positions)?;
        for layer in &self.layers {
            x = layer.forward(&x, self.args.num_attention_heads)?;
        }
        self.post_layernorm.forward(&x)
    }
}

/// The position ids mlx-vlm gives the patches of a full tile, computed as it
/// computes them in float32: buckets of `i / side` against the boundaries
/// `arange(1/side, 1, 1/side)` (accumulated as MLX's arange does).
fn position_ids(side: i32) -> Vec<i32> {
    let step = 1.0f32 / side as f32;
    let mut boundaries = Vec::new();
    let (mut value, next) = (step, step + step);
    let delta = next - step;
    // MLX's arange: ceil((stop - start) / step) values in double, accumulated in float32.
    let count = ((1.0f64 - 1.0 / side as f64) / (1.0 / side as f64)).ceil().max(0.0) as usize;
    for _ in 0..count {
        boundaries.push(value);
        value += delta;
    }
    let bucket = |i: i32| {
        let fraction = (i as f32 / side as f32).clamp(0.0, 1.0 - 1e-6);
        boundaries.iter().filter(|&&b| fraction >= b).count() as i32
    };
    (0..side).flat_map(|h| (0..side).map(move |w| (h, w))).map(|(h, w)| bucket(h) * side + bucket(w)).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn full_tiles_number_their_patches_as_mlx_vlm() {
        for side in [4, 16, 32, 64] {
            assert_eq!(super::position_ids(side), (0..side * side).collect::<Vec<_>>(), "side {side}");
        }
        // What mlx-vlm 0.7.10 computes for sides whose 1/side is inexact in
        // float32 (SmolVLM-2.2B's 384 / 14 = 27): some buckets repeat.
        let rows = |side: i32| super::position_ids(side).iter().step_by(side as usize).map(|id| id / side).collect::<Vec<_>>();
        assert_eq!(rows(14), [0, 1, 2, 2, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12]);
        assert_eq!(
            rows(27),
            [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
        );
    }
}
