//! napi's link setup, plus an rpath to the folder mlx-sys linked libmlx from
//! (`DEP_MLX_LIB_DIR`), so the `.node` file loads without LD_LIBRARY_PATH.
fn main() {
    napi_build::setup();
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    println!("cargo:rerun-if-changed=build.rs");
}
