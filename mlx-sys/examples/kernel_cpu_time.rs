//! CPU time per call of mlxcel's quantized matvec on SmolLM2-135M's decode
//! shapes, one thread. Unlike wall-clock timings this stays meaningful on a
//! loaded machine: it counts the cycles the kernel itself burns (descheduled
//! time is not counted), so kernel variants can be compared while other work
//! runs. Run with MLXCEL_NUM_THREADS=1.
//!
//! `MLXCEL_NUM_THREADS=1 cargo run --release -p mlx-sys --example kernel_cpu_time [-- calls]`

use mlx_sys::kernels::{self, KernelPath};
use mlx_sys::{quantize, random, Dtype};

mod common;
use common::cpu_seconds;

fn main() -> mlx_sys::Result<()> {
    let calls: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    println!("path={} threads={} (CPU time per call, M=1, f32 x, f16 scales)", kernels::path_name(KernelPath::Auto), kernels::num_threads());
    let shapes = [("q/o 576->576", 576, 576, 60.0), ("k/v 576->192", 576, 192, 60.0), ("gate/up 576->1536", 576, 1536, 60.0), ("down 1536->576", 1536, 576, 30.0), ("lm_head 576->49152", 576, 49152, 1.0)];
    for bits in [4, 8] {
        let mut token = 0.0;
        for &(name, k, n, per_token) in &shapes {
            let key = random::key((n * 7 + k) as u64)?;
            let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &key)?;
            let (w, s, b) = quantize(&wf, 32, bits)?;
            let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
            let x = random::normal(&[1, k], Dtype::Float32, 0.0, 1.0, &key)?;
            mlx_sys::eval([&w, &s, &b, &x])?;
            let reps = (calls as f64 * 884736.0 / (n * k) as f64).max(8.0) as usize;
            let batch = 16;
            kernels::quantized_matmul(&x, &w, &s, &b, 32, bits)?.eval()?;
            let t0 = cpu_seconds();
            for _ in 0..reps.div_ceil(batch) {
                let outs = (0..batch).map(|_| kernels::quantized_matmul(&x, &w, &s, &b, 32, bits)).collect::<mlx_sys::Result<Vec<_>>>()?;
                mlx_sys::eval(&outs)?;
            }
            let per_call = (cpu_seconds() - t0) / (reps.div_ceil(batch) * batch) as f64;
            let bytes = (w.nbytes() + s.nbytes() + b.nbytes()) as f64;
            token += per_call * per_token;
            println!("{name:<20} {bits} bit  {:>9.1} us  {:>6.2} GB/s per core  {:>5.3} ns/weight", per_call * 1e6, bytes / per_call / 1e9, per_call * 1e9 / (n * k) as f64);
        }
        println!("per token ({bits} bit, 30 layers + lm_head): {:.2} ms of CPU", token * 1e3);
    }
    Ok(())
}
