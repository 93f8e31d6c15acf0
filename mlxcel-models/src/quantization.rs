//! Affine quantization as mlx-lm records it in `config.json`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// Bits and group size of one quantized module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QuantParams {
    pub bits: i32,
    pub group_size: i32,
}

pub const SUPPORTED_BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];
pub const SUPPORTED_GROUP_SIZES: [i32; 3] = [32, 64, 128];

/// mlx-lm's default group size (`mlx_lm.convert -q` without `--q-group-size`).
pub const DEFAULT_GROUP_SIZE: i32 = 64;

/// Whether MLX's affine kernels take `params` for quantizing at load; the
/// error is the option's name (`q_bits`, `q_group_size`) and what is wrong.
pub fn check_quantize_params(params: QuantParams) -> Result<(), (&'static str, String)> {
    let bad = |name: &'static str, value: i32, allowed: &[i32]| (name, format!("must be one of {allowed:?}, got {value}"));
    if !SUPPORTED_BITS.contains(&params.bits) {
        return Err(bad("q_bits", params.bits, &SUPPORTED_BITS));
    }
    if !SUPPORTED_GROUP_SIZES.contains(&params.group_size) {
        return Err(bad("q_group_size", params.group_size, &SUPPORTED_GROUP_SIZES));
    }
    Ok(())
}

/// The `quantization` (or `quantization_config`) block: defaults plus
/// per-module overrides, each a params dict or `false` (left unquantized).
#[derive(Debug, Clone, Default)]
pub struct QuantizationConfig {
    pub default: Option<QuantParams>,
    overrides: HashMap<String, Option<QuantParams>>,
}

impl QuantizationConfig {
    pub fn from_config(config: &Value, path: &Path) -> Result<Self> {
        let Some(block) = config.get("quantization").or_else(|| config.get("quantization_config")) else {
            return Ok(Self::default());
        };
        let Some(block) = block.as_object() else {
            return Err(Error::InvalidConfig { path: path.into(), message: "`quantization` is not an object".into() });
        };
        let mode = block.get("mode").and_then(Value::as_str).unwrap_or("affine");
        if mode != "affine" {
            return Err(Error::Unsupported {
                path: path.into(),
                message: format!("quantization mode `{mode}` (only `affine` is supported)"),
            });
        }
        let default = parse_params(block, path, "quantization")?;
        let mut overrides = HashMap::new();
        for (key, value) in block {
            match value {
                Value::Bool(false) => {
                    overrides.insert(key.clone(), None);
                }
                Value::Object(module) => {
                    overrides.insert(key.clone(), parse_params(module, path, key)?);
                }
                _ => {}
            }
        }
        Ok(QuantizationConfig { default, overrides })
    }

    /// The params for the module at `path` (e.g. `model.layers.0.mlp.up_proj`).
    pub fn for_module(&self, module: &str) -> Option<QuantParams> {
        match self.overrides.get(module) {
            Some(params) => *params,
            None => self.default,
        }
    }
}

fn parse_params(block: &serde_json::Map<String, Value>, path: &Path, what: &str) -> Result<Option<QuantParams>> {
    let (Some(bits), Some(group_size)) = (
        block.get("bits").and_then(Value::as_i64),
        block.get("group_size").and_then(Value::as_i64),
    ) else {
        return Ok(None);
    };
    if let Some(mode) = block.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(Error::Unsupported { path: path.into(), message: format!("{what}: quantization mode `{mode}`") });
        }
    }
    let params = QuantParams { bits: bits as i32, group_size: group_size as i32 };
    if !SUPPORTED_BITS.contains(&params.bits) || !SUPPORTED_GROUP_SIZES.contains(&params.group_size) {
        return Err(Error::Unsupported {
            path: path.into(),
            message: format!(
                "{what}: {bits}-bit quantization with group size {group_size} (supported: bits {SUPPORTED_BITS:?}, group sizes {SUPPORTED_GROUP_SIZES:?})"
            ),
        });
    }
    Ok(Some(params))
}
