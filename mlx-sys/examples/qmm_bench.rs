//! MLX's CPU `quantized_matmul` against mlxcel's kernel, in one process, on
//! SmolLM2-135M's decode shapes (one activation row, f32 activations, f16
//! scales and biases as in the mlx-community checkpoint).
//!
//! `cargo run --release -p mlx-sys --example qmm_bench [-- reps]`
//! Environment: MLXCEL_NUM_THREADS, MLXCEL_KERNELS (see mlx_sys::kernels).
//!
//! GB/s counts the bytes of quantized weights, scales and biases read per call.
//! Shapes under 4M weights run 8 independent calls per `eval` (as a decode
//! graph does) and report the time per call.

use std::time::Instant;

use mlx_sys::kernels::{self, KernelPath};
use mlx_sys::{quantize, quantized_matmul, random, Array, Dtype};

struct Case {
    name: &'static str,
    k: i32,
    n: i32,
    per_token: f64, // how many times one decode step runs it (30 layers)
}

const CASES: [Case; 6] = [
    Case { name: "tiny 32->1 (overhead)", k: 32, n: 1, per_token: 0.0 },
    Case { name: "q/o 576->576", k: 576, n: 576, per_token: 60.0 },
    Case { name: "k/v 576->192", k: 576, n: 192, per_token: 60.0 },
    Case { name: "gate/up 576->1536", k: 576, n: 1536, per_token: 60.0 },
    Case { name: "down 1536->576", k: 1536, n: 576, per_token: 30.0 },
    Case { name: "lm_head 576->49152", k: 576, n: 49152, per_token: 1.0 },
];

/// The 25th percentile: on a loaded machine the low end of the distribution
/// tracks the code's own cost, the median mostly tracks the neighbours.
fn low_quartile(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 4]
}

fn main() -> mlx_sys::Result<()> {
    let reps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(30);
    println!(
        "mlxcel kernels: path={} threads={} (MLX {}; M=1, x f32, scales/biases f16, {reps} reps, 25th-percentile time per call)",
        kernels::path_name(KernelPath::Auto),
        kernels::num_threads(),
        mlx_sys::mlx_version()
    );
    println!(
        "{:<22} {:>4} {:>9} | {:>10} {:>8} | {:>10} {:>8} | {:>7}",
        "shape", "bits", "KiB", "MLX us", "GB/s", "ours us", "GB/s", "speedup"
    );
    for bits in [4, 8] {
        let group = 32;
        let (mut mlx_token, mut ours_token) = (0.0, 0.0);
        for case in &CASES {
            let key = random::key(case.n as u64 * 7 + case.k as u64)?;
            let wf = random::normal(&[case.n, case.k], Dtype::Float32, 0.0, 0.05, &key)?;
            let (w, s, b) = quantize(&wf, group, bits)?;
            let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
            let x = random::normal(&[1, case.k], Dtype::Float32, 0.0, 1.0, &random::split(&key, 2)?[1])?;
            mlx_sys::eval([&w, &s, &b, &x])?;
            let bytes = (w.nbytes() + s.nbytes() + b.nbytes()) as f64;

            let run_mlx = || -> mlx_sys::Result<Array> { quantized_matmul(&x, &w, &s, &b, true, group, bits) };
            let run_ours = || -> mlx_sys::Result<Array> { kernels::quantized_matmul(&x, &w, &s, &b, group, bits) };
            // Warm up both, and check they agree.
            let (a, o) = (run_mlx()?, run_ours()?);
            let (a, o) = (a.to_vec::<f32>()?, o.to_vec::<f32>()?);
            let max_diff = a.iter().zip(&o).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            let max_abs = a.iter().map(|p| p.abs()).fold(0f32, f32::max);
            assert!(max_diff <= 1e-4 * max_abs.max(1.0), "{}: results differ by {max_diff}", case.name);

            // Interleave the two so that background load hits both alike.
            // Small shapes run `batch` independent calls per eval, as in a
            // decode graph, so that MLX's per-eval overhead is shared.
            let batch = if case.n * case.k >= 4 << 20 { 1 } else { 8 };
            let mlx_reps = if case.n >= 49152 { reps.clamp(3, 5) } else { reps };
            let time = |f: &dyn Fn() -> mlx_sys::Result<Array>| -> mlx_sys::Result<f64> {
                let outs = (0..batch).map(|_| f()).collect::<mlx_sys::Result<Vec<_>>>()?;
                let t = Instant::now();
                mlx_sys::eval(&outs)?;
                Ok(t.elapsed().as_secs_f64() / batch as f64)
            };
            let (mut tm, mut to) = (Vec::new(), Vec::new());
            for i in 0..reps.max(mlx_reps) {
                if i < mlx_reps {
                    tm.push(time(&run_mlx)?);
                }
                to.push(time(&run_ours)?);
            }
            let (tm, to) = (low_quartile(tm), low_quartile(to));
            mlx_token += tm * case.per_token;
            ours_token += to * case.per_token;
            println!(
                "{:<22} {:>4} {:>9.1} | {:>10.1} {:>8.2} | {:>10.1} {:>8.2} | {:>6.1}x",
                case.name,
                bits,
                bytes / 1024.0,
                tm * 1e6,
                bytes / tm / 1e9,
                to * 1e6,
                bytes / to / 1e9,
                tm / to
            );
        }
        println!(
            "{:<22} {:>4} {:>9} | {:>8.2}ms {:>8} | {:>8.2}ms {:>8} | {:>6.1}x   (all matmuls of one decode step)",
            "per token",
            bits,
            "",
            mlx_token * 1e3,
            "",
            ours_token * 1e3,
            "",
            mlx_token / ours_token
        );
    }
    Ok(())
}
