//! Prefill-shaped quantized matmuls (M rows of f32 activations against
//! SmolLM2-135M's 4-bit weights, group 32, f16 scales) in one process:
//! MLX's dequantize + matmul (OpenBLAS), our matvec kernel, our GEMM.
//!
//! `cargo run --release -p mlx-sys --example qgemm_bench [-- M reps [cpu] [q8] [cold]]`
//!
//! With `cpu`, only our GEMM runs, and each cell is CPU seconds per call
//! (all threads, measured over enough calls for ~0.5 s of CPU) and the
//! GFLOP per CPU second: a figure that a loaded machine disturbs much less
//! than wall time. With `q8`, every weight is 8-bit. With `cold` (and
//! `cpu`), the calls cycle through copies of the weight that together
//! exceed 64 MiB, so each call reads weights that are out of L2 as a model's
//! layer-by-layer walk does.

use std::time::Instant;

use mlx_sys::kernels;
use mlx_sys::{dequantize, quantize, random, Array, Dtype};

mod common;
use common::cpu_seconds;

fn low_quartile(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 4]
}

fn main() -> mlx_sys::Result<()> {
    let m: i32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let reps: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let cpu_mode = std::env::args().skip(3).any(|s| s == "cpu");
    let all_q8 = std::env::args().skip(3).any(|s| s == "q8");
    let cold = std::env::args().skip(3).any(|s| s == "cold");
    println!("M={m}, threads={}, {reps} reps, 25th-percentile ms and GFLOP/s", kernels::num_threads());
    println!("{:<22} | {:>16} | {:>16} | {:>16}", "shape", "dequant+matmul", "matvec kernel", "gemm kernel");
    let cases: [(&str, i32, i32, i32); 6] = [
        ("q/o 576->576", 576, 576, 4),
        ("k/v 576->192", 576, 192, 4),
        ("gate/up 576->1536", 576, 1536, 4),
        ("down 1536->576", 1536, 576, 4),
        ("lm_head 576->49152 q8", 576, 49152, 8),
        ("odd 600->1000 q4", 608, 1000, 4),
    ];
    for (name, k, n, bits) in cases {
        let bits = if all_q8 { 8 } else { bits };
        let group = 32;
        let key = random::key((n * 7 + k) as u64)?;
        let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &key)?;
        let (w, s, b) = quantize(&wf, group, bits)?;
        let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
        let x = random::normal(&[1, m, k], Dtype::Float32, 0.0, 1.0, &random::split(&key, 2)?[1])?;
        mlx_sys::eval([&w, &s, &b, &x])?;
        let dense = || -> mlx_sys::Result<Array> {
            let wd = dequantize(&w, &s.astype(Dtype::Float32)?, &b.astype(Dtype::Float32)?, group, bits)?;
            x.matmul(&wd.transpose(&[1, 0])?)
        };
        let matvec = || kernels::quantized_matmul(&x, &w, &s, &b, group, bits);
        let gemm = || kernels::quantized_gemm(&x, &w, &s, &b, group, bits);
        let (r, g) = (dense()?.to_vec::<f32>()?, gemm()?.to_vec::<f32>()?);
        let diff = r.iter().zip(&g).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        let max_abs = r.iter().map(|p| p.abs()).fold(0f32, f32::max);
        assert!(diff <= 1e-4 * max_abs.max(1.0), "{name}: results differ by {diff}");
        let flop = 2.0 * m as f64 * k as f64 * n as f64;
        if cpu_mode {
            let calls = ((0.5e9 / flop * 100e9 / 1e9) as usize).clamp(3, 100000);
            // The weights each call reads: w itself, or (cold) one of copies
            // that together exceed 64 MiB, in turn.
            let copies = if cold { (64usize << 20).div_ceil(w.nbytes() + s.nbytes() + b.nbytes()) } else { 1 };
            let mut weights = vec![(w.clone(), s.clone(), b.clone())];
            for c in 1..copies {
                let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &random::key(c as u64)?)?;
                let (w, s, b) = quantize(&wf, group, bits)?;
                let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
                mlx_sys::eval([&w, &s, &b])?;
                weights.push((w, s, b));
            }
            let call = std::cell::Cell::new(0usize);
            let next = || {
                call.set(call.get() + 1);
                &weights[call.get() % copies]
            };
            let gemm = || {
                let (w, s, b) = next();
                kernels::quantized_gemm(&x, w, s, b, group, bits)
            };
            let swiglu = || {
                let (w, s, b) = next();
                kernels::quantized_gemm_swiglu(&x, [w, s, b], [w, s, b], group, bits)
            };
            let mut cells = Vec::new();
            for f in [&gemm as &dyn Fn() -> mlx_sys::Result<Array>, &swiglu] {
                f()?.eval()?;
                let (t, c) = (Instant::now(), cpu_seconds());
                for _ in 0..calls {
                    f()?.eval()?;
                }
                let (wall, cpu) = (t.elapsed().as_secs_f64() / calls as f64, (cpu_seconds() - c) / calls as f64);
                let fl = if cells.is_empty() { flop } else { 2.0 * flop };
                cells.push(format!("{:>7.2}ms cpu {:>6.1}GF/cpu-s (wall {:>6.1}GF)", cpu * 1e3, fl / cpu / 1e9, fl / wall / 1e9));
            }
            println!("{name:<22} | gemm {} | swiglu {}", cells[0], cells[1]);
            continue;
        }
        let mut cells = Vec::new();
        for (i, f) in [&dense as &dyn Fn() -> mlx_sys::Result<Array>, &matvec, &gemm].iter().enumerate() {
            if i == 1 && (m as i64) * (n as i64) > 512 * 2000 {
                cells.push(format!("{:>16}", "-"));
                continue;
            }
            let mut times = Vec::new();
            for _ in 0..reps {
                let t = Instant::now();
                f()?.eval()?;
                times.push(t.elapsed().as_secs_f64());
            }
            let t = low_quartile(times);
            cells.push(format!("{:>7.2} {:>6.1}GF", t * 1e3, flop / t / 1e9));
        }
        println!("{name:<22} | {}", cells.join(" | "));
    }
    Ok(())
}
