//! Times one prefill forward pass (default 512 tokens) of a checkpoint the
//! way the engine runs its last prompt chunk: `forward_last` (every block over
//! the whole chunk, the lm_head for the last position only), evaluated.
//!
//! `cargo run --release -p mlxcel-models --example prefill_bench [-- TOKENS REPS [DIR]]`
//!
//! The prompt is `benches/prompt.txt` tokenized with the model's tokenizer,
//! repeated and cut to TOKENS. Prints every run and the minimum and median
//! (the machine is shared; the low end tracks the code's own cost), and the
//! CPU seconds each run used (all threads; the kernels' pool spins briefly
//! between jobs, which counts too).
//! Environment: MLXCEL_PREFILL=mlx selects the previous prefill path
//! (dequantize + MLX matmul, MLX's attention, MLX's silu) for side-by-side
//! comparisons.

use std::path::PathBuf;
use std::time::Instant;

use mlx_sys::Array;
use mlxcel_models::Model;

const PROMPT_TEXT: &str = include_str!("../../benches/prompt.txt");

/// CPU seconds (user + system) used by this process so far, from
/// /proc/self/stat (clock ticks of 1/100 s); 0 where it is not available.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesized command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let tokens: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let dir = match args.get(3) {
        Some(d) => PathBuf::from(d),
        None => mlxcel_hub::default_model_dir()?,
    };
    // As mlxcel_engine::Engine does on the CPU: MLX's buffer cache off
    // (PREFILL_BENCH_CACHE=1 keeps it).
    if std::env::var("PREFILL_BENCH_CACHE").map_or(true, |v| v != "1") {
        mlx_sys::memory::set_cache_limit(0)?;
    }
    let model = Model::load(&dir)?;
    let text_ids = model.tokenizer().encode(PROMPT_TEXT, false)?;
    let ids: Vec<i32> = text_ids.iter().cycle().take(tokens).map(|&t| t as i32).collect();
    let input = Array::from_slice(&ids, &[1, tokens as i32])?;
    let network = model.network();
    let run = || -> Result<(f64, f64), Box<dyn std::error::Error>> {
        let mut caches = network.new_caches();
        let (start, cpu) = (Instant::now(), cpu_seconds());
        network.forward_last(&input, &mut caches)?.eval()?;
        Ok((start.elapsed().as_secs_f64(), cpu_seconds() - cpu))
    };
    run()?; // warm-up
    let mut times = Vec::new();
    for i in 0..reps {
        let (t, cpu) = run()?;
        println!("run {i}: {:.1} ms, {:.1} tok/s, {:.2} CPU s", t * 1e3, tokens as f64 / t, cpu);
        times.push(t);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let (min, med) = (times[0], times[times.len() / 2]);
    println!(
        "prefill {tokens} tokens (MLXCEL_PREFILL={}): best {:.1} tok/s, median {:.1} tok/s",
        std::env::var("MLXCEL_PREFILL").unwrap_or_default(),
        tokens as f64 / min,
        tokens as f64 / med
    );
    Ok(())
}
