//! Where the extension finds libmlx at run time.
//!
//! An installed wheel sits at `site-packages/mlxcel/_mlxcel.abi3.so` and the
//! `mlx-cpu` / `mlx-metal` wheel it depends on puts libmlx in
//! `site-packages/mlx/lib`, so the first rpath is `$ORIGIN/../mlx/lib`
//! (`@loader_path/../mlx/lib` on macOS). The folder mlx-sys linked against
//! (the unpacked wheel in the cache) follows as a fallback for builds used
//! in place, e.g. `cargo build` in the workspace.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let macos = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos");
    let origin = if macos { "@loader_path" } else { "$ORIGIN" };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{origin}/../mlx/lib");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
