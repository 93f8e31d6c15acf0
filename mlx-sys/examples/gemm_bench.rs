//! Float32 GEMM throughput through MLX, to show which BLAS MLX's CPU matmul
//! resolves to. `benches/blas.sh` runs it against OpenBLAS and the wheel's
//! bundled reference BLAS side by side.

use std::time::Instant;

use mlx_sys::{random, Dtype};

fn main() -> mlx_sys::Result<()> {
    let (m, k, n) = (128, 2048, 8192);
    let key = random::key(0)?;
    let a = random::normal(&[m, k], Dtype::Float32, 0.0, 1.0, &key)?;
    let b = random::normal(&[k, n], Dtype::Float32, 0.0, 1.0, &random::split(&key, 2)?[1])?;
    mlx_sys::eval([&a, &b])?;
    a.matmul(&b)?.eval()?; // warm-up
    let repeats = 3;
    let start = Instant::now();
    for _ in 0..repeats {
        a.matmul(&b)?.eval()?;
    }
    let seconds = start.elapsed().as_secs_f64() / repeats as f64;
    let gflops = 2.0 * m as f64 * k as f64 * n as f64 / seconds / 1e9;
    println!("blas={} m={m} k={k} n={n} seconds={seconds:.4} gflops={gflops:.1}", mlx_sys::BLAS_BACKEND);
    Ok(())
}
