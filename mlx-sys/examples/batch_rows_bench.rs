//! mlxcel's quantized matvec with 1, 2, 4 and 8 activation rows (batched
//! decode) on SmolLM2-135M's shapes: 4-bit, group 64, f16 scales and biases.
//! Each row count is timed as 8 independent calls per `eval`, as a decode
//! graph runs them; the 25th percentile of 60 rounds is reported per call.
//!
//! `cargo run --release -p mlx-sys --example batch_rows_bench`
//! Environment: MLXCEL_NUM_THREADS, MLXCEL_KERNELS (see mlx_sys::kernels).

use std::time::Instant;

use mlx_sys::kernels::{self, KernelPath};
use mlx_sys::{quantize, random, Array, Dtype};

const SHAPES: [(&str, i32, i32); 4] =
    [("q/o 576->576", 576, 576), ("gate/up 576->1536", 576, 1536), ("down 1536->576", 1536, 576), ("lm_head 576->49152", 576, 49152)];

fn main() -> mlx_sys::Result<()> {
    println!("mlxcel kernels: path={} threads={}", kernels::path_name(KernelPath::Auto), kernels::num_threads());
    for (name, k, n) in SHAPES {
        let key = random::key(7)?;
        let (w, s, b) = quantize(&random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &key)?, 64, 4)?;
        let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
        let mut one_row = 0.0;
        for m in [1, 2, 4, 8] {
            let x = random::normal(&[m, k], Dtype::Float32, 0.0, 1.0, &key)?;
            mlx_sys::eval([&w, &s, &b, &x])?;
            let mut times = Vec::new();
            for _ in 0..60 {
                let calls: Vec<Array> = (0..8).map(|_| kernels::quantized_matmul(&x, &w, &s, &b, 64, 4)).collect::<Result<_, _>>()?;
                let start = Instant::now();
                mlx_sys::eval(&calls)?;
                times.push(start.elapsed().as_secs_f64() / 8.0);
            }
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 4];
            if m == 1 {
                one_row = t;
            }
            let gmacs = (m * k * n) as f64 / t / 1e9;
            println!("{name:<20} M={m} {:9.1} us  {:5.2}x of M=1  {gmacs:6.1} GMAC/s", t * 1e6, t / one_row);
        }
    }
    Ok(())
}
