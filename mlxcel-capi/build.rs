//! Lets libmlxcel.so, and this crate's tests, find libmlx at run time: an
//! rpath to the folder mlx-sys linked it from, so no LD_LIBRARY_PATH is needed.
//! The folder is also handed to the tests (`MLXCEL_CAPI_MLX_LIB_DIR`), which
//! link the C and C++ examples against it.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-env=MLXCEL_CAPI_MLX_LIB_DIR={dir}");
    }
}
