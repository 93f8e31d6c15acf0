//! include/mlxcel.h must be exactly what cbindgen generates from this crate.
//! Regenerate it with:
//!     MLXCEL_UPDATE_HEADER=1 cargo test --release -p mlxcel-capi --test header

use std::path::{Path, PathBuf};

// The one place the ABI version is set (as build.rs reads it).
#[allow(dead_code)]
mod abi {
    include!("../src/abi_version.rs");
}

const UPDATE_COMMAND: &str =
    "MLXCEL_UPDATE_HEADER=1 cargo test --release -p mlxcel-capi --test header";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn header_path() -> PathBuf {
    crate_dir()
        .parent()
        .unwrap()
        .join("include")
        .join("mlxcel.h")
}

fn generate() -> String {
    let dir = crate_dir();
    let config =
        cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src").join("lib.rs"))
        .generate()
        .expect("cbindgen failed on mlxcel-capi/src");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("cbindgen wrote UTF-8")
}

#[test]
fn committed_header_matches_the_code() {
    let generated = generate();
    let path = header_path();
    if std::env::var_os("MLXCEL_UPDATE_HEADER").is_some_and(|v| v != "0") {
        std::fs::write(&path, &generated).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b);
        let line = first.unwrap_or(committed.lines().count().min(generated.lines().count()));
        panic!(
            "{} is out of date with mlxcel-capi/src (first difference at line {}:\n  committed: {:?}\n  generated: {:?}).\nRegenerate it with:\n    {UPDATE_COMMAND}",
            path.display(),
            line + 1,
            committed.lines().nth(line).unwrap_or("<end>"),
            generated.lines().nth(line).unwrap_or("<end>"),
        );
    }
}

#[test]
fn header_declares_every_exported_function() {
    let header = generate();
    let src = std::fs::read_to_string(crate_dir().join("src/lib.rs")).unwrap();
    let exported: Vec<&str> = src
        .split("extern \"C\" fn ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .filter(|name| name.starts_with("mlxcel_"))
        .collect();
    assert!(exported.len() >= 20, "{exported:?}");
    for name in exported {
        assert!(
            header.contains(&format!("{name}(")),
            "{name} is not declared in {}",
            Path::new("include/mlxcel.h").display()
        );
    }
    let major = format!("#define MLXCEL_ABI_VERSION_MAJOR {}", abi::MLXCEL_ABI_VERSION_MAJOR);
    for constant in [
        major.as_str(),
        "MLXCEL_OK = 0,",
        "MLXCEL_CANCELLED = 1,",
        "MLXCEL_ERR_INVALID_HANDLE = -4,",
    ] {
        assert!(header.contains(constant), "{constant}");
    }
}
