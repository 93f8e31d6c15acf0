//! Crates that do not need MLX must not depend on it, so that their tests build in seconds
//! and never compile MLX or our C++ kernels: `cargo tree` of each, with its dev-dependencies,
//! must not reach `mlx-sys`.

use std::path::Path;
use std::process::Command;

/// The crates that must build and test without MLX.
const MLX_FREE: &[&str] = &["mlxcel-tokenizer", "mlxcel-vision", "mlxcel-gguf", "mlxcel-ctranslate2", "mlxcel-grammar", "mlxcel-hub", "mlxcel-audio"];

#[test]
fn mlx_free_crates_do_not_depend_on_mlx_sys() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for krate in MLX_FREE {
        let out = Command::new(&cargo)
            .current_dir(workspace)
            .args(["tree", "--quiet", "-e", "normal,dev", "--prefix", "none", "-p", krate])
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{cargo} tree`: {e}"));
        let tree = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "`cargo tree -p {krate}` failed: {}", String::from_utf8_lossy(&out.stderr));
        assert!(tree.lines().next().is_some_and(|root| root.starts_with(krate)), "`cargo tree -p {krate}` printed:\n{tree}");
        let mlx: Vec<&str> = tree.lines().filter(|l| l.starts_with("mlx-sys ") || l.starts_with("mlxcel-models ")).collect();
        assert!(mlx.is_empty(), "{krate} depends on MLX through: {mlx:?}");
    }
}
