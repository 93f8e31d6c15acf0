//! Thread scaling of the quantized matvec: `count` independent [n, k]
//! products of `rows` activation rows (default 1; random weights, group 32,
//! f16 scales), evaluated together, best of 30; prints µs per product, GB/s
//! of weights and, for several rows, GMAC/s.
//! Run it with MLXCEL_NUM_THREADS=1 and =2 (and MLXCEL_KERNELS) to compare,
//! and with MLXCEL_PROBE_COPIES=1 to give each weight its VNNI copy.
//!
//! `cargo run --release -p mlx-sys --example scaling_probe -- N K BITS COUNT [ROWS]`
//! (SmolLM2-135M decode: 576 576 4 120, 1536 576 4 60; its lm_head: 49152 576 8 1).

use std::time::Instant;
use mlx_sys::kernels;
use mlx_sys::{quantize, random, Dtype};
fn main() -> mlx_sys::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: scaling_probe N K BITS COUNT [ROWS] (e.g. 576 576 4 120)";
    let [n, k, bits, batch, m]: [usize; 5] = args
        .iter()
        .map(|a| a.parse::<usize>().ok().filter(|&v| v > 0))
        .collect::<Option<Vec<_>>>()
        .map(|mut v| {
            if v.len() == 4 {
                v.push(1);
            }
            v
        })
        .and_then(|v| v.try_into().ok())
        .unwrap_or_else(|| {
            eprintln!("{usage}");
            std::process::exit(2)
        });
    let (n, k, bits) = (n as i32, k as i32, bits as i32);
    let key = random::key(1)?;
    let mut ws = Vec::new();
    for i in 0..batch {
        let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &random::key(i as u64)?)?;
        let (w, s, b) = quantize(&wf, 32, bits)?;
        let (s, b) = (s.astype(Dtype::Float16)?, b.astype(Dtype::Float16)?);
        mlx_sys::eval([&w, &s, &b])?;
        ws.push((w, s, b));
    }
    // MLXCEL_PROBE_COPIES=1: each weight with its VNNI copy (kernels::vnni_rows).
    let copies = std::env::var("MLXCEL_PROBE_COPIES").as_deref() == Ok("1");
    let rows = ws
        .iter()
        .map(|(w, s, b)| if copies { kernels::vnni_rows(w, s, b, 32, bits) } else { Ok(None) })
        .collect::<mlx_sys::Result<Vec<_>>>()?;
    let x = random::normal(&[m as i32, k], Dtype::Float32, 0.0, 1.0, &key)?;
    x.eval()?;
    let mut best = f64::MAX;
    for _ in 0..30 {
        let outs = ws
            .iter()
            .zip(&rows)
            .map(|((w, s, b), copy)| match copy {
                Some(copy) => kernels::quantized_matmul_with_vnni_rows(&x, w, s, b, 32, bits, copy),
                None => kernels::quantized_matmul(&x, w, s, b, 32, bits),
            })
            .collect::<mlx_sys::Result<Vec<_>>>()?;
        let t = Instant::now();
        mlx_sys::eval(outs.iter())?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes: usize = ws.iter().map(|(w, s, b)| w.nbytes() + s.nbytes() + b.nbytes()).sum();
    let with = if rows.iter().any(Option::is_some) { ", VNNI copies" } else { "" };
    let macs = if m > 1 { format!(", {:.1} GMAC/s", (m * batch) as f64 * (n as f64) * (k as f64) / best / 1e9) } else { String::new() };
    println!("threads {}{with} n {n} k {k} bits {bits} rows {m} x{batch}: {:.1} us per call, {:.1} GB/s{macs}", kernels::num_threads(), best * 1e6 / batch as f64, bytes as f64 / best / 1e9);
    Ok(())
}
