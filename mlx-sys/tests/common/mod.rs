//! Shared by the kernel tests.

/// The integer loops' activation-quantization bound for every (row of x,
/// output): each group of x is quantized to 16 bits, so every x_k moves by at
/// most max|x_g| / 65024, and y by at most Σ_g max|x_g| / 65024 ·
/// Σ_{k in g} |s_g q_k| (the bias term uses exact sums of x). `xs` holds the
/// rows of x ([m][k] f32), `words` and `scales` the weight's codes and scales
/// as f32 ([n][k·bits/32] and [n][k/group]).
pub fn quantized_x_bound(xs: &[f32], words: &[u32], scales: &[f32], n: usize, k: usize, group: usize, bits: usize) -> Vec<f64> {
    let (g, row_words, mask) = (k / group, k * bits / 32, (1u32 << bits) - 1);
    let rows = xs.len() / k;
    let mut out = vec![0f64; rows * n];
    for r in 0..rows {
        let xr = &xs[r * k..(r + 1) * k];
        let amax: Vec<f64> = xr.chunks(group).map(|c| c.iter().fold(0f64, |m, v| m.max(v.abs() as f64))).collect();
        for o in 0..n {
            let mut bound = 0f64;
            for j in 0..k {
                let code = (words[o * row_words + j * bits / 32] >> (j * bits % 32)) & mask;
                bound += amax[j / group] / 65024.0 * (scales[o * g + j / group] as f64 * code as f64).abs();
            }
            out[r * n + o] = bound;
        }
    }
    out
}
