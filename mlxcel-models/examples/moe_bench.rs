//! Decode speed of a mixture-of-experts checkpoint against a dense one, in
//! interleaved rounds (tests/reference/make_moe_bench_checkpoints.py writes a
//! qwen3_moe and a qwen3 with the same active parameter count).
//!
//! `cargo run --release -p mlxcel-models --example moe_bench -- MOE_DIR DENSE_DIR [STEPS] [ROUNDS]`
//!
//! Each round: a 16-token prompt, then STEPS greedy decode steps over the KV
//! cache (one token a step, evaluated), timed from the first step to the last.
//! Prints each round's tok/s and, per model, the median; then the ratio of
//! the dense model's median tok/s to the MoE's (decode time MoE / dense).

use std::path::PathBuf;
use std::time::Instant;

use mlx_sys::Array;
use mlxcel_models::model::load_network;
use mlxcel_models::LanguageModel;

fn decode_tok_s(model: &dyn LanguageModel, steps: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let prompt: Vec<i32> = (0..16).map(|i| (i * 37 + 11) % 4000).collect();
    let mut caches = model.new_caches();
    let logits = model.forward_last(&Array::from_slice(&prompt, &[1, 16])?, &mut caches)?;
    let mut token = logits.argmax(-1, false)?.astype(mlx_sys::Dtype::Int32)?.reshape(&[1, 1])?;
    token.eval()?;
    let start = Instant::now();
    for _ in 0..steps {
        let logits = model.forward_last(&token, &mut caches)?;
        token = logits.argmax(-1, false)?.astype(mlx_sys::Dtype::Int32)?.reshape(&[1, 1])?;
        token.eval()?;
    }
    Ok(steps as f64 / start.elapsed().as_secs_f64())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(moe_dir), Some(dense_dir)) = (args.get(1), args.get(2)) else {
        return Err("usage: moe_bench MOE_DIR DENSE_DIR [STEPS] [ROUNDS]".into());
    };
    let steps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(64);
    let rounds: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5);
    mlx_sys::memory::set_cache_limit(0)?;
    let (moe, _) = load_network(&PathBuf::from(moe_dir))?;
    let (dense, _) = load_network(&PathBuf::from(dense_dir))?;
    decode_tok_s(moe.as_ref(), 8)?;
    decode_tok_s(dense.as_ref(), 8)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        a.push(decode_tok_s(moe.as_ref(), steps)?);
        b.push(decode_tok_s(dense.as_ref(), steps)?);
        println!("round {round}: moe {:.1} tok/s, dense {:.1} tok/s", a[round], b[round]);
    }
    let (ma, mb) = (median(&mut a), median(&mut b));
    println!("median: moe {ma:.1} tok/s, dense {mb:.1} tok/s; decode time moe/dense {:.2}x", mb / ma);
    Ok(())
}
