//! Read bandwidth of this machine, on 1..=T threads: each thread sums its
//! share of a buffer (u64 lanes, vectorized by the compiler), best of 10
//! passes. The decode of a model whose weights exceed the last-level cache
//! reads them from DRAM once per token, so the ratio between thread counts
//! here bounds how decode can scale with threads.
//!
//! `cargo run --release -p mlx-sys --example memory_bandwidth -- [MiB] [max threads]`
//! (defaults: 512 MiB, 2 threads).

use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let mib = args.first().copied().unwrap_or(512).max(1);
    let max_threads = args.get(1).copied().unwrap_or(2).max(1);
    let words = mib * (1 << 20) / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    for threads in 1..=max_threads {
        let chunk = words.div_ceil(threads);
        let mut best = f64::MAX;
        let mut check = 0u64;
        for _ in 0..10 {
            let start = Instant::now();
            check = std::thread::scope(|s| {
                let handles: Vec<_> = buffer
                    .chunks(chunk)
                    .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &w| a.wrapping_add(w))))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).fold(0u64, u64::wrapping_add)
            });
            best = best.min(start.elapsed().as_secs_f64());
        }
        let expected = (words as u64).wrapping_mul(words as u64 - 1) / 2;
        assert_eq!(check, expected, "the sum must cover every word");
        println!("{mib} MiB, {threads} thread(s): {:.1} GB/s", (words * 8) as f64 / best / 1e9);
    }
}
