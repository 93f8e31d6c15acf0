//! Prefill attention (`kernels::causal_attention`) at SmolLM2-135M's shapes
//! (9 query heads, 3 KV heads, head size 64) for a prompt of L tokens: CPU
//! seconds per call and useful GFLOP per CPU second (the causal half of
//! q·kᵀ and p·v, 4·H·D·L(L+1)/2 flops), the 25th percentile of `reps`
//! batches. CPU time, so a loaded machine disturbs it less than wall time.
//!
//! `cargo run --release -p mlx-sys --example attention_bench [-- L reps]`

use mlx_sys::kernels;
use mlx_sys::{random, Dtype};

mod common;
use common::cpu_seconds;

fn main() -> mlx_sys::Result<()> {
    let l: i32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let reps: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(9).max(1);
    let (heads, kv_heads, d) = (9, 3, 64);
    let key = random::key(7)?;
    let q = random::normal(&[1, heads, l, d], Dtype::Float32, 0.0, 1.0, &key)?;
    let k = random::normal(&[1, kv_heads, l, d], Dtype::Float32, 0.0, 1.0, &random::key(8)?)?;
    let v = random::normal(&[1, kv_heads, l, d], Dtype::Float32, 0.0, 1.0, &random::key(9)?)?;
    mlx_sys::eval([&q, &k, &v])?;
    let flops = 4.0 * (heads * d) as f64 * (l as f64 * (l as f64 + 1.0) / 2.0);
    // Enough calls per batch for about 0.15 s of CPU.
    let calls = ((0.15e9 * 60.0 / flops) as usize).max(3);
    let mut per_call = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = cpu_seconds();
        for _ in 0..calls {
            mlx_sys::eval([&kernels::causal_attention(&q, &k, &v, 0.125)?])?;
        }
        per_call.push((cpu_seconds() - t0) / calls as f64);
    }
    per_call.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let s = per_call[reps / 4];
    println!(
        "L={l} threads={} calls/batch={calls}: {:.3} ms CPU per call, {:.1} GFLOP per CPU second",
        kernels::num_threads(),
        s * 1e3,
        flops / s / 1e9
    );
    Ok(())
}
