//! The process-wide runtime configuration: the settings that belong to the
//! process rather than to one model or one generation (MLX's buffer cache,
//! and the backend switches of the layers), gathered in one place and fixed
//! once per process.
//!
//! | field | env var | default | what it does |
//! | --- | --- | --- | --- |
//! | [`prefill`](RuntimeConfig::prefill) | `MLXCEL_PREFILL` = `kernels` \| `mlx` | `kernels` | how the matmuls outside the fused decode block (prompt rows, dense weights) and attention run: mlxcel's kernels, which never call BLAS, or dequantize + MLX's matmul and attention, which do (for comparisons) |
//! | [`fused_decode`](RuntimeConfig::fused_decode) | `MLXCEL_FUSED` = `1` \| `0` | `1` on the CPU | decode runs each quantized decoder block as one fused kernel node; `0` uses MLX's ops per layer (for comparisons). Never on a GPU |
//! | [`stacked_decode`](RuntimeConfig::stacked_decode) | `MLXCEL_STACK` = `1` \| `0` | `1` | when every block runs its fused node, a decode step runs them all as one node instead of one per layer (the same arithmetic; far less of MLX's per-node work on the thread that builds the steps); `0` keeps a node per layer (for comparisons) |
//! | [`mlx_cache_limit`](RuntimeConfig::mlx_cache_limit) | `MLXCEL_MLX_CACHE_LIMIT` = bytes \| `default` | `0` on the CPU, MLX's own on a GPU | MLX's buffer cache of freed allocations. On the CPU malloc serves the same sizes as fast, and the cache kept freed prefill activations resident for the whole run |
//!
//! The configuration is fixed the first time it is needed: by
//! [`init`] (explicitly, before loading a model), or else from the
//! environment by the first model load or engine ([`get`]). A later [`init`]
//! with a different configuration is an error rather than a silent change
//! under running generations. The kernels' thread count is read by the
//! kernels themselves (`MLXCEL_NUM_THREADS`, default: all cores), and so is
//! `MLXCEL_REPACK` (`1` or `0`, default `1`: on CPUs where decode runs the
//! AVX-512 VNNI matvec, or the AVX2 integer matvec on 8-bit weights, keep a
//! copy of the fused decoder blocks' weights in that loop's order, as much
//! memory again as those weights; checked at load
//! here), and `MLXCEL_HUGE_PAGES` (`1` or `0`, default `1`: on the CPU the
//! weights and those copies live in 2 MiB-aligned memory that Linux backs
//! with transparent huge pages, which decode streams faster; `0` leaves the
//! system's default pages; checked at load here).

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// How prompt (many-row) work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillBackend {
    /// mlxcel's kernels: quantized GEMM and blocked causal attention.
    Kernels,
    /// Dequantize + MLX's matmul and attention (the previous path, kept for
    /// side-by-side comparisons).
    Mlx,
}

impl PrefillBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillBackend::Kernels => "kernels",
            PrefillBackend::Mlx => "mlx",
        }
    }
}

/// Process-wide settings; see the [module documentation](self) for each
/// field's environment variable and default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// How prompt (many-row) matmuls and attention run (`MLXCEL_PREFILL`).
    pub prefill: PrefillBackend,
    /// Decode through one fused kernel node per quantized decoder block on
    /// the CPU (`MLXCEL_FUSED`).
    pub fused_decode: bool,
    /// Run a step's fused blocks as one node (`MLXCEL_STACK`).
    pub stacked_decode: bool,
    /// MLX's buffer-cache limit in bytes; `None` leaves MLX's default
    /// (`MLXCEL_MLX_CACHE_LIMIT`).
    pub mlx_cache_limit: Option<usize>,
}

impl Default for RuntimeConfig {
    /// The defaults for the current default device.
    fn default() -> Self {
        let cpu = mlx_sys::Device::default_device() == mlx_sys::Device::Cpu;
        RuntimeConfig { prefill: PrefillBackend::Kernels, fused_decode: true, stacked_decode: true, mlx_cache_limit: cpu.then_some(0) }
    }
}

impl RuntimeConfig {
    /// The defaults, overridden by the environment variables that are set.
    /// A value that is not one of the documented ones is an error naming the
    /// variable.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`from_env`](Self::from_env), reading variables through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut config = RuntimeConfig::default();
        let invalid = |name: &'static str, value: &str, expected: &str| Error::InvalidEnvVar {
            name,
            value: value.to_string(),
            message: format!("expected {expected}"),
        };
        if let Some(v) = lookup("MLXCEL_PREFILL") {
            config.prefill = match v.as_str() {
                "kernels" | "" => PrefillBackend::Kernels,
                "mlx" => PrefillBackend::Mlx,
                _ => return Err(invalid("MLXCEL_PREFILL", &v, "`kernels` or `mlx`")),
            };
        }
        if let Some(v) = lookup("MLXCEL_FUSED") {
            config.fused_decode = match v.as_str() {
                "1" | "" => true,
                "0" => false,
                _ => return Err(invalid("MLXCEL_FUSED", &v, "`1` or `0`")),
            };
        }
        if let Some(v) = lookup("MLXCEL_STACK") {
            config.stacked_decode = match v.as_str() {
                "1" | "" => true,
                "0" => false,
                _ => return Err(invalid("MLXCEL_STACK", &v, "`1` or `0`")),
            };
        }
        // Read by the kernels themselves; checked here so a typo fails the load.
        for name in ["MLXCEL_REPACK", "MLXCEL_HUGE_PAGES"] {
            if let Some(v) = lookup(name) {
                if !matches!(v.as_str(), "1" | "0" | "") {
                    return Err(invalid(name, &v, "`1` or `0`"));
                }
            }
        }
        if let Some(v) = lookup("MLXCEL_MLX_CACHE_LIMIT") {
            config.mlx_cache_limit = match v.as_str() {
                "default" => None,
                "" => config.mlx_cache_limit,
                n => Some(n.parse().map_err(|_| invalid("MLXCEL_MLX_CACHE_LIMIT", &v, "a number of bytes or `default`"))?),
            };
        }
        Ok(config)
    }

    /// Whether decode may use the fused decoder-block kernel here: asked for,
    /// and the default device is the CPU.
    pub fn fused_decode_active(&self) -> bool {
        self.fused_decode && mlx_sys::Device::default_device() == mlx_sys::Device::Cpu
    }

    fn apply(&self) -> Result<()> {
        if let Some(limit) = self.mlx_cache_limit {
            mlx_sys::memory::set_cache_limit(limit).map_err(|e| Error::Mlx(format!("setting the buffer cache limit to {limit}: {e}")))?;
        }
        Ok(())
    }
}

static CONFIG: OnceLock<RuntimeConfig> = OnceLock::new();

/// Fixes the process's configuration to `config` and applies it; call it
/// before the first model load. Calling it again with the same
/// configuration is a no-op; with a different one (or after the first load
/// fixed it from the environment) it fails and changes nothing.
pub fn init(config: RuntimeConfig) -> Result<&'static RuntimeConfig> {
    let mut applied = Ok(());
    let current = CONFIG.get_or_init(|| {
        applied = config.apply();
        config.clone()
    });
    applied?;
    if *current != config {
        return Err(Error::RuntimeConfig(format!(
            "the process's runtime configuration is already fixed to {current:?}; cannot change it to {config:?}"
        )));
    }
    Ok(current)
}

/// The process's configuration, fixed from the environment
/// ([`RuntimeConfig::from_env`]) when nothing fixed it yet. Fails (and fixes
/// nothing) when an environment variable has an invalid value.
pub fn get() -> Result<&'static RuntimeConfig> {
    if let Some(config) = CONFIG.get() {
        return Ok(config);
    }
    let config = RuntimeConfig::from_env()?;
    let mut applied = Ok(());
    let current = CONFIG.get_or_init(|| {
        applied = config.apply();
        config
    });
    applied.map(|_| current)
}

/// For readers that cannot fail (layer code): [`get`], or the defaults
/// without fixing them when the environment is invalid. Model loading calls
/// [`get`] first, so an invalid variable is reported there.
pub fn current() -> RuntimeConfig {
    get().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn environment_overrides_the_defaults() {
        let defaults = RuntimeConfig::from_lookup(lookup(&[])).unwrap();
        assert_eq!(defaults, RuntimeConfig::default());
        assert_eq!(defaults.prefill, PrefillBackend::Kernels);
        assert!(defaults.fused_decode);
        let c = RuntimeConfig::from_lookup(lookup(&[
            ("MLXCEL_PREFILL", "mlx"),
            ("MLXCEL_FUSED", "0"),
            ("MLXCEL_STACK", "0"),
            ("MLXCEL_MLX_CACHE_LIMIT", "1048576"),
        ]))
        .unwrap();
        assert_eq!(
            c,
            RuntimeConfig { prefill: PrefillBackend::Mlx, fused_decode: false, stacked_decode: false, mlx_cache_limit: Some(1 << 20) }
        );
        let c = RuntimeConfig::from_lookup(lookup(&[("MLXCEL_MLX_CACHE_LIMIT", "default")])).unwrap();
        assert_eq!(c.mlx_cache_limit, None);
        for (name, value) in [("MLXCEL_REPACK", "0"), ("MLXCEL_REPACK", "1"), ("MLXCEL_HUGE_PAGES", "0"), ("MLXCEL_HUGE_PAGES", "1")] {
            assert_eq!(RuntimeConfig::from_lookup(lookup(&[(name, value)])).unwrap(), RuntimeConfig::default());
        }
    }

    #[test]
    fn invalid_values_name_the_variable() {
        for (name, value) in [("MLXCEL_PREFILL", "fast"), ("MLXCEL_FUSED", "yes"), ("MLXCEL_STACK", "on"), ("MLXCEL_MLX_CACHE_LIMIT", "1G"), ("MLXCEL_REPACK", "off"), ("MLXCEL_HUGE_PAGES", "yes")] {
            let e = RuntimeConfig::from_lookup(lookup(&[(name, value)])).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(value), "{e}");
        }
    }

    #[test]
    fn init_fixes_the_configuration_once() {
        // What the first model load of this test process fixes, too.
        let config = RuntimeConfig::from_env().unwrap();
        assert_eq!(init(config.clone()).unwrap(), &config);
        assert_eq!(init(config.clone()).unwrap(), &config);
        assert_eq!(get().unwrap(), &config);
        let other = RuntimeConfig { prefill: PrefillBackend::Mlx, ..config.clone() };
        let e = init(other).unwrap_err().to_string();
        assert!(e.contains("already fixed"), "{e}");
        assert_eq!(get().unwrap(), &config);
    }
}
