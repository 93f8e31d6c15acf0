//! Finds MLX (an install named by `MLX_DIR`, or the pinned official wheel,
//! fetched and verified into the cache), compiles the C++ side of the bridge
//! and links libmlx (with Debian's OpenBLAS ahead of the wheel's reference BLAS
//! when it is installed; models never call BLAS either way).

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
    // `../kernels` is watched as a folder: any kernel source or header added,
    // changed or removed there reruns this script.
    for path in ["cpp/shim.h", "cpp/shim.cc", "src/ffi.rs", "mlx-pin.txt", "cmake-probe/CMakeLists.txt", "../kernels"] {
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
    // Our own compute kernels (every ../kernels/*.cc) build with the shim.
    // On x86-64 they pick AVX-512, AVX2 or a portable loop at run time
    // (target attributes plus kernels/cpu_features.h), so no -march flag is
    // needed or wanted here; elsewhere only the portable loops are compiled.
    build.file("cpp/shim.cc");
    for source in kernel_sources(&manifest_dir.join("../kernels")) {
        build.file(source);
    }
    build
        .include(&install.include_dir)
        .include(manifest_dir.join("../kernels"))
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        // The portable loops pass 32-byte vectors between inline helpers on
        // CPUs without AVX; GCC notes the (internal) ABI on every build.
        .flag_if_supported("-Wno-psabi")
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

/// The platform the build targets, and whether it differs from the host's.
struct Target {
    os: String,
    arch: String,
    cross: bool,
}

impl Target {
    fn from_env() -> Target {
        let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
        let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        let host = env::var("HOST").unwrap_or_default();
        let target = env::var("TARGET").unwrap_or_default();
        let host_arch = host.split('-').next().unwrap_or_default();
        let host_os = if host.contains("-linux") { "linux" } else if host.contains("-apple-darwin") { "macos" } else { "" };
        Target { cross: host != target && (host_arch != arch || host_os != os), os, arch }
    }

    /// Whether an official wheel's file name is built for this target.
    fn accepts_wheel(&self, name: &str) -> bool {
        let Some(tag) = name.strip_suffix(".whl").and_then(|n| n.rsplit('-').next()) else { return false };
        match self.os.as_str() {
            "linux" => tag.starts_with("manylinux") && tag.ends_with(&format!("_{}", self.arch)),
            "macos" => self.arch == "aarch64" && tag.starts_with("macosx_") && tag.ends_with("_arm64"),
            _ => false,
        }
    }

    /// pip's `--platform` for a cross build (a native one lets pip choose).
    fn pip_platform(&self) -> Option<String> {
        match (self.cross, self.os.as_str()) {
            (false, _) => None,
            (true, "linux") => Some(format!("manylinux_2_35_{}", self.arch)),
            (true, _) => Some("macosx_14_0_arm64".into()),
        }
    }
}

/// The official wheel for the features and target: mlx-cuda-12 (`cuda`, Linux
/// x86_64 and aarch64), mlx-metal (`metal`, or any macOS build; Apple Silicon
/// only), else mlx-cpu (Linux x86_64 and aarch64).
fn wheel_package(target: &Target) -> &'static str {
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let metal = env::var_os("CARGO_FEATURE_METAL").is_some();
    let supported = |package: &str, platforms: &str, ok: bool| {
        assert!(
            ok,
            "{package} has no official wheel for {}-{} (only {platforms}); build MLX yourself and set MLX_DIR",
            target.os, target.arch
        );
    };
    let linux = target.os == "linux" && (target.arch == "x86_64" || target.arch == "aarch64");
    assert!(!(cuda && metal), "mlx-sys: the `cuda` and `metal` features exclude each other");
    if cuda {
        supported("mlx-cuda-12", "Linux x86_64 and aarch64", linux);
        "mlx-cuda-12"
    } else if metal || target.os == "macos" {
        supported("mlx-metal", "macOS arm64", target.os == "macos" && target.arch == "aarch64");
        "mlx-metal"
    } else {
        supported("mlx-cpu", "Linux x86_64 and aarch64", linux);
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
/// A native build unpacks into `mlx/<package>-<version>`, a cross build into
/// `mlx/<package>-<version>-<os>-<arch>`.
fn fetch_pinned_wheel(pin: &Pin) -> MlxInstall {
    let target = Target::from_env();
    let package = wheel_package(&target);
    let prefix = package.replace('-', "_") + "-" + &pin.version + "-";
    let accepted = |name: &str| name.starts_with(&prefix) && target.accepts_wheel(name);
    let mut dir_name = format!("{package}-{}", pin.version);
    if target.cross {
        dir_name += &format!("-{}-{}", target.os, target.arch);
    }
    let unpacked = cache_dir().join("mlx").join(dir_name);
    let install = MlxInstall {
        include_dir: unpacked.join("mlx/include"),
        lib_dir: unpacked.join("mlx/lib"),
    };
    // `.complete` names the wheel unpacked there.
    match fs::read_to_string(unpacked.join(".complete")) {
        Ok(name) if accepted(name.trim()) => return install,
        Ok(name) => {
            println!("cargo:warning={} holds {name}, not a {package} wheel for this target: unpacking again", unpacked.display());
            let _ = fs::remove_dir_all(&unpacked);
        }
        Err(_) => {}
    }

    let wheels_dir = cache_dir().join("wheels");
    fs::create_dir_all(&wheels_dir).expect("cannot create the wheel cache");
    let find_wheel = || pin.wheels.iter().find(|(name, _)| accepted(name) && wheels_dir.join(name).exists());
    if find_wheel().is_none() {
        let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let mut pip = Command::new(&python);
        pip.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d"]).arg(&wheels_dir);
        if let Some(platform) = target.pip_platform() {
            pip.args(["--platform", &platform]);
        }
        let status = pip
            .arg(format!("{package}=={}", pin.version))
            .status()
            .unwrap_or_else(|e| panic!("cannot run `{python} -m pip` to fetch {package}: {e}"));
        assert!(status.success(), "pip could not download {package}=={}", pin.version);
    }
    let (name, expected) = find_wheel().unwrap_or_else(|| {
        panic!(
            "pip fetched no wheel of {package}=={} that mlx-pin.txt lists for {}-{}",
            pin.version, target.os, target.arch
        )
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

/// Every `*.cc` directly in `dir`, sorted.
fn kernel_sources(dir: &Path) -> Vec<PathBuf> {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut sources: Vec<PathBuf> =
        entries.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "cc")).collect();
    sources.sort();
    sources
}

/// Debian's OpenBLAS (`libopenblas-dev`) on Linux, when present, for MLX's
/// own matmuls (models never reach them), unless `MLXCEL_BLAS=bundled` asks
/// for the wheel's reference BLAS. It looks for
/// `libopenblas.so` in the multiarch folder (`/usr/lib/<arch>-linux-gnu`)
/// where there is one, else in `/usr/lib64` and `/usr/lib`.
///
/// Cargo reruns this script when the answer can change, and not on every
/// build: it watches the library found (changed or removed), and every
/// existing folder probed before it (an entry added there). Watching the
/// missing file itself would make Cargo rerun the script, and recompile all
/// the C++, on every build. Cargo scans a watched folder recursively, which
/// is why a multiarch system does not probe all of `/usr/lib`.
fn find_openblas() -> Option<String> {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") || env::var("MLXCEL_BLAS").as_deref() == Ok("bundled") {
        return None;
    }
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = format!("/usr/lib/{arch}-linux-gnu");
    let candidates =
        if Path::new(&multiarch).is_dir() { vec![multiarch] } else { vec!["/usr/lib64".into(), "/usr/lib".into()] };
    for dir in candidates {
        let lib = Path::new(&dir).join("libopenblas.so");
        if lib.exists() {
            println!("cargo:rerun-if-changed={}", lib.display());
            return Some(dir);
        }
        if Path::new(&dir).is_dir() {
            println!("cargo:rerun-if-changed={dir}");
        }
    }
    // Not an error and no warning: no model path calls BLAS (our kernels do
    // every matmul), only a user's own MLX matmuls would use the wheel's.
    None
}
