//! Links libmlxcel.so as a versioned system library would be:
//! - SONAME `libmlxcel.so.<ABI major>` (the major from src/abi_version.rs),
//!   and a `libmlxcel.so.<major> -> libmlxcel.so` link beside the built
//!   library (`target/release` and, for `cargo test`, its `deps/`), so
//!   programs linked in the build tree (`-L target/release -lmlxcel`) find it
//!   at run time; `scripts/install-capi` installs the
//!   usual chain of links instead;
//! - an rpath to the folder mlx-sys linked libmlx from, so nothing else is
//!   needed on the building machine (the installed copy's is rewritten to
//!   `$ORIGIN`-relative). The folder is also handed to the tests
//!   (`MLXCEL_CAPI_MLX_LIB_DIR`), which link the C and C++ examples against it.

#[allow(dead_code)]
mod abi {
    include!("src/abi_version.rs");
}
use abi::MLXCEL_ABI_VERSION_MAJOR;

fn main() {
    println!("cargo:rerun-if-changed=src/abi_version.rs");
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-env=MLXCEL_CAPI_MLX_LIB_DIR={dir}");
    }
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let soname = format!("libmlxcel.so.{MLXCEL_ABI_VERSION_MAJOR}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    // OUT_DIR is <profile dir>/build/mlxcel-capi-<hash>/out; cargo puts the
    // cdylib in <profile dir>.
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let Some(profile_dir) = out_dir.ancestors().nth(3).filter(|_| {
        out_dir
            .ancestors()
            .nth(2)
            .is_some_and(|b| b.ends_with("build"))
    }) else {
        println!(
            "cargo:warning=unexpected OUT_DIR layout {}; no {soname} link made",
            out_dir.display()
        );
        return;
    };
    // `cargo build` puts the cdylib in <profile dir>, `cargo test` in
    // <profile dir>/deps (where the C tests then link it from): link both.
    for dir in [profile_dir.to_path_buf(), profile_dir.join("deps")] {
        let link = dir.join(&soname);
        if std::fs::read_link(&link).is_ok_and(|t| t == std::path::Path::new("libmlxcel.so")) {
            continue;
        }
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::remove_file(&link);
        if let Err(e) = std::os::unix::fs::symlink("libmlxcel.so", &link) {
            println!("cargo:warning=could not link {} -> libmlxcel.so: {e}", link.display());
        }
    }
}
