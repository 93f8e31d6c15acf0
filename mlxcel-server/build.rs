//! Lets this crate's binaries and tests find libmlx at run time (rpath to the
//! folder mlx-sys linked it from), so no LD_LIBRARY_PATH is needed.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
