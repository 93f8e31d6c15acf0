//! `mlxcel serve`'s command line: llama-server's flags, short forms and
//! `LLAMA_ARG_*` environment variables, so its scripts and unit files run
//! unchanged. Flags for features mlxcel lacks fail with the reason; flags
//! that only tune llama.cpp's own machinery are accepted with a notice.

use std::path::PathBuf;

use clap::{ArgAction, Parser};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "mlxcel serve",
    about = "An OpenAI- and llama-server-compatible HTTP server over the batch engine",
    after_help = "Routes: /v1/chat/completions /v1/completions /v1/embeddings (with --embedding-model) /v1/rerank (with --rerank-model) /v1/models /completion /tokenize /detokenize /apply-template /props /slots /health /metrics, and a chat page at /.\nEach flag also reads the environment variable in brackets, as llama-server does."
)]
pub struct ServeArgs {
    /// An MLX checkpoint directory, or a GGUF file (converted once into the cache). Default: the default model.
    #[arg(short = 'm', long, env = "LLAMA_ARG_MODEL", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// The model name responses and /v1/models report (default: the directory's name).
    #[arg(short = 'a', long, env = "LLAMA_ARG_ALIAS")]
    pub alias: Option<String>,
    #[arg(long, env = "LLAMA_ARG_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on the `listening on` line).
    #[arg(long, env = "LLAMA_ARG_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (comma-separated keys allowed).
    #[arg(long, env = "LLAMA_API_KEY", value_name = "KEY")]
    pub api_key: Option<String>,
    /// A file with one API key per line.
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Never download: the default model must already be in the cache.
    #[arg(long, env = "LLAMA_OFFLINE", action = ArgAction::SetTrue)]
    pub offline: bool,
    /// Do not serve the chat page at /.
    #[arg(long = "no-webui", alias = "no-ui", env = "LLAMA_ARG_NO_WEBUI", action = ArgAction::SetTrue)]
    pub no_webui: bool,
    /// Positions of KV cache over all slots (0: the model's context length).
    #[arg(short = 'c', long = "ctx-size", env = "LLAMA_ARG_CTX_SIZE", default_value_t = 0)]
    pub ctx_size: usize,
    /// Slots: requests generated at once (the engine batches them); more wait in the queue.
    #[arg(long = "parallel", env = "LLAMA_ARG_N_PARALLEL", default_value_t = 4)]
    pub parallel: usize,
    /// Tokens to generate per request unless it says (-1: until the slot's context is full).
    #[arg(short = 'n', long = "n-predict", alias = "predict", env = "LLAMA_ARG_N_PREDICT", default_value_t = -1, allow_negative_numbers = true)]
    pub n_predict: i64,
    /// Logical batch size (accepted for compatibility; prompts are split by --ubatch-size).
    #[arg(short = 'b', long = "batch-size", env = "LLAMA_ARG_BATCH", default_value_t = 2048)]
    pub batch_size: usize,
    /// Prompt tokens per forward pass during prefill.
    #[arg(long = "ubatch-size", env = "LLAMA_ARG_UBATCH", default_value_t = 512)]
    pub ubatch_size: usize,
    /// Threads of the compute kernels (default: all cores; sets MLXCEL_NUM_THREADS).
    #[arg(short = 't', long, env = "LLAMA_ARG_THREADS", allow_negative_numbers = true)]
    pub threads: Option<i64>,
    /// Continuous batching (always on in mlxcel).
    #[arg(long = "cont-batching", env = "LLAMA_ARG_CONT_BATCHING", action = ArgAction::SetTrue)]
    pub cont_batching: bool,
    #[arg(long = "no-cont-batching", env = "LLAMA_ARG_NO_CONT_BATCHING", action = ArgAction::SetTrue)]
    pub no_cont_batching: bool,
    /// Every slot may use the whole context (-c) instead of -c / -np.
    #[arg(long = "kv-unified", env = "LLAMA_ARG_KV_UNIFIED", action = ArgAction::SetTrue)]
    pub kv_unified: bool,
    /// Reuse of cached prompt chunks (mlxcel's prefix cache always reuses whole blocks).
    #[arg(long = "cache-reuse", env = "LLAMA_ARG_CACHE_REUSE", default_value_t = 0)]
    pub cache_reuse: usize,
    /// Keep generating past a slot's context: attention keeps the first
    /// positions and a window of the latest.
    #[arg(long = "context-shift", env = "LLAMA_ARG_CONTEXT_SHIFT", action = ArgAction::SetTrue, overrides_with = "no_context_shift")]
    pub context_shift: bool,
    #[arg(long = "no-context-shift", env = "LLAMA_ARG_NO_CONTEXT_SHIFT", action = ArgAction::SetTrue)]
    pub no_context_shift: bool,
    /// KV cache type for keys: f32, f16 or bf16 (full precision) or q8_0 (8 bits).
    #[arg(long = "cache-type-k", env = "LLAMA_ARG_CACHE_TYPE_K", default_value = "f16")]
    pub cache_type_k: String,
    #[arg(long = "cache-type-v", env = "LLAMA_ARG_CACHE_TYPE_V", default_value = "f16")]
    pub cache_type_v: String,
    /// Quantize a dense (f32/f16/bf16) checkpoint as it loads to this many
    /// bits (2, 3, 4, 5, 6 or 8), exactly as `mlx_lm.convert -q` would (mlxcel's own flag).
    #[arg(long = "q-bits", value_name = "BITS")]
    pub q_bits: Option<u32>,
    /// Group size for --q-bits (32, 64 or 128; default 64).
    #[arg(long = "q-group-size", value_name = "G", requires = "q_bits")]
    pub q_group_size: Option<u32>,
    /// An embedding checkpoint (or a packaged one's name, e.g. all-MiniLM-L6-v2) that
    /// /v1/embeddings runs, beside the generative model (an mlxcel extension).
    #[arg(long = "embedding-model", env = "MLXCEL_EMBEDDING_MODEL", value_name = "PATH")]
    pub embedding_model: Option<PathBuf>,
    /// A cross-encoder checkpoint (`*ForSequenceClassification`, one label) that
    /// /v1/rerank (and llama-server's /rerank, /reranking) runs (an mlxcel extension).
    #[arg(long = "rerank-model", env = "MLXCEL_RERANK_MODEL", value_name = "PATH")]
    pub rerank_model: Option<PathBuf>,
    /// A Whisper checkpoint (mlx-whisper's layout, or a packaged one's name:
    /// whisper-tiny.en, whisper-base) that /v1/audio/transcriptions and
    /// /v1/audio/translations run (an mlxcel extension).
    #[arg(long = "whisper-model", env = "MLXCEL_WHISPER_MODEL", value_name = "PATH")]
    pub whisper_model: Option<PathBuf>,
    /// Largest audio upload to /v1/audio/* in bytes (OpenAI's 25 MiB by default).
    #[arg(long = "max-audio-bytes", default_value_t = crate::audio::DEFAULT_MAX_AUDIO_BYTES)]
    pub max_audio_bytes: usize,
    /// Largest image in a chat message (a data URL's decoded bytes; OpenAI's 20 MiB by default).
    #[arg(long = "max-image-bytes", default_value_t = mlxcel_engine::DEFAULT_MAX_IMAGE_BYTES)]
    pub max_image_bytes: usize,
    /// A smaller checkpoint with the same tokenizer, for speculative decoding.
    #[arg(long = "model-draft", env = "LLAMA_ARG_MODEL_DRAFT", value_name = "DIR")]
    pub model_draft: Option<PathBuf>,
    #[arg(long = "draft-max", alias = "draft", alias = "draft-n", env = "LLAMA_ARG_DRAFT_MAX")]
    pub draft_max: Option<i64>,
    #[arg(long = "draft-min", alias = "draft-n-min", env = "LLAMA_ARG_DRAFT_MIN")]
    pub draft_min: Option<i64>,
    /// Requests that may wait for a slot; beyond it new requests get 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,

    // Sampling defaults (llama-server's).
    #[arg(long = "temp", alias = "temperature", default_value_t = 0.8)]
    pub temp: f64,
    #[arg(short = 's', long, default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    #[arg(long, default_value_t = 40)]
    pub top_k: i64,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f64,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f64,
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub repeat_last_n: i64,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f64,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f64,

    /// Render chat templates with Jinja (always; --no-jinja is accepted).
    #[arg(long, env = "LLAMA_ARG_JINJA", action = ArgAction::SetTrue)]
    pub jinja: bool,
    #[arg(long = "no-jinja", env = "LLAMA_ARG_NO_JINJA", action = ArgAction::SetTrue)]
    pub no_jinja: bool,
    /// A chat template to use instead of the checkpoint's: one of the
    /// checkpoint's named templates, `chatml`, or Jinja source.
    #[arg(long = "chat-template", env = "LLAMA_ARG_CHAT_TEMPLATE", value_name = "NAME")]
    pub chat_template: Option<String>,
    #[arg(long = "chat-template-file", env = "LLAMA_ARG_CHAT_TEMPLATE_FILE", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Serve /slots (default on).
    #[arg(long, env = "LLAMA_ARG_ENDPOINT_SLOTS", action = ArgAction::SetTrue)]
    pub slots: bool,
    #[arg(long = "no-slots", env = "LLAMA_ARG_NO_ENDPOINT_SLOTS", action = ArgAction::SetTrue)]
    pub no_slots: bool,
    /// Serve Prometheus metrics at /metrics.
    #[arg(long, env = "LLAMA_ARG_ENDPOINT_METRICS", action = ArgAction::SetTrue)]
    pub metrics: bool,

    // Accepted for compatibility; they tune llama.cpp's own machinery.
    #[arg(long = "n-gpu-layers", alias = "gpu-layers", env = "LLAMA_ARG_N_GPU_LAYERS", hide = true, allow_negative_numbers = true)]
    pub n_gpu_layers: Option<String>,
    #[arg(long = "flash-attn", env = "LLAMA_ARG_FLASH_ATTN", hide = true, num_args = 0..=1, default_missing_value = "on")]
    pub flash_attn: Option<String>,
    #[arg(long = "threads-batch", hide = true)]
    pub threads_batch: Option<i64>,
    #[arg(long = "threads-http", env = "LLAMA_ARG_THREADS_HTTP", hide = true)]
    pub threads_http: Option<i64>,
    #[arg(long = "timeout", hide = true)]
    pub timeout: Option<u64>,
    #[arg(long, hide = true, action = ArgAction::SetTrue)]
    pub mlock: bool,
    #[arg(long = "no-mmap", hide = true, action = ArgAction::SetTrue)]
    pub no_mmap: bool,
    #[arg(long = "verbose", short = 'v', hide = true, action = ArgAction::SetTrue)]
    pub verbose: bool,
}

/// llama-server's multi-letter short flags → long flags (clap's short flags are one letter).
const SHORT_FORMS: &[(&str, &str)] = &[
    ("-np", "--parallel"),
    ("-ub", "--ubatch-size"),
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("-kvu", "--kv-unified"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-md", "--model-draft"),
    ("-ngl", "--n-gpu-layers"),
    ("-fa", "--flash-attn"),
    ("-tb", "--threads-batch"),
    ("-to", "--timeout"),
    ("-dev", "--device"),
    ("-hf", "--hf-repo"),
    ("-hfr", "--hf-repo"),
    ("-hff", "--hf-file"),
    ("-mu", "--model-url"),
    ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"),
    ("-mg", "--main-gpu"),
    ("-ngld", "--n-gpu-layers-draft"),
];

/// llama-server features mlxcel serve does not have, with what to do instead.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("--lora", "LoRA adapters are not supported; merge the adapter into the checkpoint"),
    ("--lora-scaled", "LoRA adapters are not supported; merge the adapter into the checkpoint"),
    ("--lora-init-without-apply", "LoRA adapters are not supported"),
    ("--control-vector", "control vectors are not supported"),
    ("--control-vector-scaled", "control vectors are not supported"),
    ("--mmproj", "multimodal projectors are not supported: mlxcel serve runs text models"),
    ("--mmproj-url", "multimodal projectors are not supported: mlxcel serve runs text models"),
    ("--hf-repo", "downloading from model hubs is not supported: pass -m DIR or -m FILE.gguf"),
    ("--hf-file", "downloading from model hubs is not supported: pass -m DIR or -m FILE.gguf"),
    ("--model-url", "downloading models by URL is not supported: pass -m DIR or -m FILE.gguf"),
    ("--embedding", "llama-server's embeddings from the generative model are not supported: pass --embedding-model PATH|NAME (e.g. all-MiniLM-L6-v2) to serve /v1/embeddings"),
    ("--embeddings", "llama-server's embeddings from the generative model are not supported: pass --embedding-model PATH|NAME (e.g. all-MiniLM-L6-v2) to serve /v1/embeddings"),
    ("--reranking", "llama-server's reranking with the generative model is not supported: pass --rerank-model PATH (a cross-encoder) to serve /v1/rerank"),
    ("--rerank", "llama-server's reranking with the generative model is not supported: pass --rerank-model PATH (a cross-encoder) to serve /v1/rerank"),
    ("--rope-scaling", "RoPE scaling overrides are not supported; the checkpoint's config.json decides"),
    ("--rope-scale", "RoPE scaling overrides are not supported; the checkpoint's config.json decides"),
    ("--rope-freq-base", "RoPE overrides are not supported; the checkpoint's config.json decides"),
    ("--ssl-key-file", "TLS is not supported; put a reverse proxy in front"),
    ("--ssl-cert-file", "TLS is not supported; put a reverse proxy in front"),
    ("--path", "serving a directory of static files is not supported (the chat page is built in)"),
    ("--grammar-file", "a server-wide grammar is not supported; send `grammar` with each request"),
    ("--device", "device selection is MLX's: set MLX's default device instead"),
    ("--split-mode", "multi-GPU splitting is not supported"),
    ("--tensor-split", "multi-GPU splitting is not supported"),
    ("--main-gpu", "multi-GPU selection is not supported"),
    ("--n-gpu-layers-draft", "layer offload does not apply to MLX"),
    ("--slot-save-path", "saving slots to disk is not supported"),
];

/// `args` (without the program name) parsed, after rewriting short forms;
/// an unsupported flag is an error naming why.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<ServeArgs, String> {
    let mut rewritten = vec!["mlxcel serve".to_string()];
    for arg in args {
        let (flag, value) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with('-') => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let long = SHORT_FORMS.iter().find(|(short, _)| *short == flag).map_or(flag.as_str(), |(_, long)| long);
        if let Some((name, why)) = UNSUPPORTED.iter().find(|(name, _)| *name == long) {
            return Err(format!("{name} ({flag}): {why}"));
        }
        rewritten.push(match value {
            Some(v) => format!("{long}={v}"),
            None => long.to_string(),
        });
    }
    ServeArgs::try_parse_from(rewritten).map_err(|e| match e.kind() {
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => e.exit(),
        _ => e.render().to_string(),
    })
}

impl ServeArgs {
    /// Notices for accepted flags that change nothing here.
    pub fn notices(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.no_cont_batching {
            notes.push("--no-cont-batching: mlxcel always batches continuously; ignored".to_string());
        }
        if self.no_jinja {
            notes.push("--no-jinja: chat templates always render with Jinja; ignored".to_string());
        }
        if self.cache_reuse > 0 {
            notes.push("--cache-reuse: the prefix cache reuses whole 16-token blocks of any earlier prompt; the chunk size is ignored".to_string());
        }
        if self.n_gpu_layers.is_some() {
            notes.push("--n-gpu-layers: MLX runs every layer on its default device; ignored".to_string());
        }
        if self.flash_attn.is_some() {
            notes.push("--flash-attn: attention is always fused; ignored".to_string());
        }
        if self.mlock || self.no_mmap {
            notes.push("--mlock/--no-mmap: weights are loaded by MLX; ignored".to_string());
        }
        notes
    }

    /// Validates what clap's types do not.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=mlxcel_engine::scheduler::MAX_ROWS).contains(&self.parallel) {
            return Err(format!("--parallel (-np) {}: must be from 1 to {}", self.parallel, mlxcel_engine::scheduler::MAX_ROWS));
        }
        if self.ubatch_size == 0 {
            return Err("--ubatch-size (-ub): must be at least 1".into());
        }
        if self.n_predict < -1 || self.n_predict == 0 {
            return Err(format!("--n-predict (-n) {}: must be -1 (until the context is full) or at least 1", self.n_predict));
        }
        if let Some(t) = self.threads {
            if t == 0 || t < -1 {
                return Err(format!("--threads (-t) {t}: must be at least 1, or -1 for all cores"));
            }
        }
        if self.chat_template.is_some() && self.chat_template_file.is_some() {
            return Err("give --chat-template or --chat-template-file, not both".into());
        }
        self.kv_bits()?;
        Ok(())
    }

    /// The KV format -ctk/-ctv ask for: None (full precision) or Some(8).
    pub fn kv_bits(&self) -> Result<Option<i128>, String> {
        let bits = |flag: &str, name: &str| match name {
            "f32" | "f16" | "bf16" => Ok(None),
            "q8_0" => Ok(Some(8)),
            other => Err(format!("{flag} {other:?}: mlxcel keeps KV in full precision (f32/f16/bf16) or q8_0")),
        };
        let k = bits("--cache-type-k", &self.cache_type_k)?;
        let v = bits("--cache-type-v", &self.cache_type_v)?;
        if k != v {
            return Err("--cache-type-k and --cache-type-v must match (both q8_0 or both full precision)".into());
        }
        Ok(k)
    }

    /// Keys from --api-key (comma-separated) and --api-key-file.
    pub fn api_keys(&self) -> Result<Vec<String>, String> {
        let mut keys: Vec<String> = self.api_key.iter().flat_map(|k| k.split(',')).map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
        if let Some(file) = &self.api_key_file {
            let text = std::fs::read_to_string(file).map_err(|e| format!("--api-key-file {}: {e}", file.display()))?;
            keys.extend(text.lines().map(str::trim).filter(|k| !k.is_empty()).map(str::to_string));
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<ServeArgs, String> {
        parse(list.iter().map(|s| s.to_string()))
    }

    #[test]
    fn q_bits_and_q_group_size_quantize_at_load() {
        let a = args(&["-m", "dir", "--q-bits", "4", "--q-group-size", "32"]).unwrap();
        assert_eq!((a.q_bits, a.q_group_size), (Some(4), Some(32)));
        let a = args(&["-m", "dir"]).unwrap();
        assert_eq!((a.q_bits, a.q_group_size), (None, None));
        assert!(args(&["-m", "dir", "--q-group-size", "64"]).is_err(), "a group size needs --q-bits");
    }

    #[test]
    fn short_forms_reach_their_long_flags() {
        let a = args(&["-m", "dir", "-np", "8", "-c", "4096", "-ub", "256", "-t", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-kvu", "-cb", "-ngl=99"]).unwrap();
        assert_eq!(a.model.as_deref(), Some(std::path::Path::new("dir")));
        assert_eq!((a.parallel, a.ctx_size, a.ubatch_size, a.threads), (8, 4096, 256, Some(2)));
        assert!(a.kv_unified && a.cont_batching);
        assert_eq!(a.kv_bits().unwrap(), Some(8));
        assert_eq!(a.n_gpu_layers.as_deref(), Some("99"));
    }

    #[test]
    fn unsupported_and_unknown_flags_fail_clearly() {
        let e = args(&["--lora", "x.gguf"]).unwrap_err();
        assert!(e.contains("--lora") && e.contains("LoRA"), "{e}");
        let e = args(&["-hf", "org/repo"]).unwrap_err();
        assert!(e.contains("-hf") && e.contains("hub"), "{e}");
        let e = args(&["--frobnicate"]).unwrap_err();
        assert!(e.contains("--frobnicate"), "{e}");
    }

    #[test]
    fn defaults_are_llama_servers() {
        let a = args(&[]).unwrap();
        assert_eq!((a.temp, a.top_k, a.top_p, a.min_p, a.seed, a.n_predict, a.port), (0.8, 40, 0.95, 0.05, -1, -1, 8080));
        assert!(a.validate().is_ok());
        assert!(args(&["-np", "0"]).unwrap().validate().unwrap_err().contains("--parallel"));
        assert!(args(&["-ctk", "q4_0"]).unwrap().validate().unwrap_err().contains("q4_0"));
    }
}
