//! The prefill kernels (`quantized_gemm`, `causal_attention`) against MLX's
//! reference ops and an f64 host reference, on awkward shapes.
//!
//! Every loop this CPU runs is checked (AMX, AVX-512, AVX2, portable: see
//! `kernels::gemm_loop_name`); attention and the fused SwiGLU follow
//! `MLXCEL_KERNELS`, so the last test re-runs their tests in child processes
//! with `MLXCEL_KERNELS=portable` and `avx2`.
//!
//! Tolerances. The GEMM's exact f32 loops (all but AMX) compute the
//! same exact sum as MLX's `x @ dequantize(w).T`, in another order; as in
//! tests/kernels.rs, errors are measured against mag = Σ_k |x_k · w_k| and
//! must stay below 1e-5·mag (plus half an ulp of an f16/bf16 output). The AMX
//! loop (the default where the CPU has it) splits x and w into two bf16
//! halves each: every product term may be off by up to 3·2^-16 of |x_k w_k|
//! (two representation errors and the dropped lo·lo product), so it gets
//! 5e-5·mag; on average it lands far below that. The integer loops
//! (`avx512-int16` for 4- and 8-bit weights, `avx2-int16` for 8-bit ones)
//! quantize each group of x to 16
//! bits as the matvec's integer paths do (tests/kernels.rs): every x_k moves
//! by at most max|x_g| / 65024, which adds Σ_g max|x_g| / 65024 ·
//! Σ_{k in g} |s_g q_k| to their bound. Attention outputs are convex
//! combinations of value rows; errors must stay below 1e-5 of the largest
//! |v| (scores carry ~D·eps of relative error into the probabilities), and
//! MLX's own op must meet the same bar.

mod common;

use std::sync::Mutex;

use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::kernels::{self, KernelPath};
use mlx_sys::{quantize, quantized_matmul, random, Array, Dtype};

static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn to_f32(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn normal(seed: u64, shape: &[i32]) -> Array {
    let x = random::normal(shape, Dtype::Float32, 0.0, 1.0, &random::key(seed).unwrap()).unwrap();
    x.eval().unwrap();
    x
}

struct Quantized {
    w: Array,
    scales: Array,
    biases: Array,
    n: usize,
    k: usize,
}

fn make_weights(seed: u64, n: i32, k: i32, group: i32, bits: i32, sdtype: Dtype) -> Quantized {
    let key = random::key(seed).unwrap();
    let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let row_scale = random::uniform(0.01, 2.0, &[n, 1], Dtype::Float32, &random::split(&key, 2).unwrap()[1]).unwrap();
    let wf = wf.multiply(&row_scale).unwrap().add_scalar(0.1).unwrap();
    let (w, scales, biases) = quantize(&wf, group, bits).unwrap();
    let (scales, biases) = (scales.astype(sdtype).unwrap(), biases.astype(sdtype).unwrap());
    mlx_sys::eval([&w, &scales, &biases]).unwrap();
    Quantized { w, scales, biases, n: n as usize, k: k as usize }
}

/// Exact (f64) y and mag for every (row of x, output).
fn gemm_reference(x: &Array, q: &Quantized, group: usize, bits: usize) -> (Vec<f64>, Vec<f64>) {
    let xs = to_f32(&x.contiguous().unwrap());
    let words = q.w.to_vec::<u32>().unwrap();
    let (s, b) = (to_f32(&q.scales), to_f32(&q.biases));
    let (n, k) = (q.n, q.k);
    let (g, m, row_words) = (k / group, xs.len() / k, k * bits / 32);
    let mask = (1u64 << bits) - 1;
    let mut deq = vec![0f64; k];
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for o in 0..n {
        let row = &words[o * row_words..(o + 1) * row_words];
        for (j, d) in deq.iter_mut().enumerate() {
            let bit = j * bits;
            // MLX's little-endian bit stream: 3, 5 and 6 bits straddle words.
            let pair = row[bit / 32] as u64 | (row.get(bit / 32 + 1).copied().unwrap_or(0) as u64) << 32;
            let v = (pair >> (bit % 32)) & mask;
            let gi = o * g + j / group;
            *d = s[gi] as f64 * v as f64 + b[gi] as f64;
        }
        for r in 0..m {
            let xr = &xs[r * k..(r + 1) * k];
            let (mut acc, mut a) = (0f64, 0f64);
            for j in 0..k {
                acc += xr[j] as f64 * deq[j];
                a += (xr[j] as f64 * deq[j]).abs();
            }
            y[r * n + o] = acc;
            mag[r * n + o] = a;
        }
    }
    (y, mag)
}

/// The bound for `path`: 1e-5 of mag on the exact and integer loops, 5e-5 on AMX.
fn gemm_tol(path: KernelPath) -> f64 {
    if kernels::gemm_uses_amx(path) { 5e-5 } else { 1e-5 }
}

/// Whether `path`'s GEMM loop for `bits` quantizes x to 16 bits per group.
fn quantizes_x(path: KernelPath, bits: i32) -> bool {
    kernels::gemm_loop_name(path, bits).ends_with("-int16")
}

/// [`gemm_reference`]'s mag for `path`: widened by the activation-quantization
/// bound (in units of `gemm_tol(path)`) where its loop quantizes x.
fn mag_for(path: KernelPath, x: &Array, q: &Quantized, group: usize, bits: usize, mag: &[f64]) -> Vec<f64> {
    let mut mag = mag.to_vec();
    if !quantizes_x(path, bits as i32) {
        return mag;
    }
    let words = q.w.to_vec::<u32>().unwrap();
    let xs = to_f32(&x.contiguous().unwrap());
    let bound = common::quantized_x_bound(&xs, &words, &to_f32(&q.scales), q.n, q.k, group, bits);
    let rel = gemm_tol(path);
    for (m, b) in mag.iter_mut().zip(bound) {
        *m += b * 1.01 / rel;
    }
    mag
}

fn check_gemm(label: &str, got: &Array, exact: &[f64], mag: &[f64]) {
    check_gemm_tol(label, got, exact, mag, gemm_tol(KernelPath::Auto));
}

fn check_gemm_tol(label: &str, got: &Array, exact: &[f64], mag: &[f64], rel: f64) {
    let vals = to_f32(got);
    assert_eq!(vals.len(), exact.len(), "{label}: length");
    let round = match got.dtype() {
        Dtype::Float16 => 2f64.powi(-11),
        Dtype::Bfloat16 => 2f64.powi(-8),
        _ => 0.0,
    };
    for (i, ((&v, &e), &a)) in vals.iter().zip(exact).zip(mag).enumerate() {
        let err = (v as f64 - e).abs();
        let tol = rel * a + round * e.abs() + 1e-30;
        assert!(err <= tol, "{label}: element {i}: got {v}, exact {e}, |err| {err:.3e} > tol {tol:.3e}");
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_case(seed: u64, bits: i32, group: i32, k: i32, n: i32, x: &Array, sdtype: Dtype, expect_kernel: bool) {
    let q = make_weights(seed, n, k, group, bits, sdtype);
    let label = format!("bits={bits} group={group} K={k} N={n} x={:?} {}/{sdtype}", x.shape(), x.dtype());
    let (exact, mag) = gemm_reference(x, &q, group as usize, bits as usize);
    let mlx = quantized_matmul(x, &q.w, &q.scales, &q.biases, true, group, bits).unwrap();
    // The default (AMX where available) and every exact loop this CPU runs.
    for path in distinct_loops(bits) {
        let ours = kernels::quantized_gemm_with_path(x, &q.w, &q.scales, &q.biases, group, bits, path).unwrap();
        let label = format!("{label} {}", kernels::gemm_loop_name(path, bits));
        if expect_kernel && x.dtype() == Dtype::Float32 && ours.dtype() == Dtype::Float32 {
            assert!(kernels::is_kernel_node(&ours), "{label}: fell back to another op");
        }
        assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
        assert_eq!(ours.dtype(), mlx.dtype(), "{label}: dtype");
        let mag = mag_for(path, x, &q, group as usize, bits as usize, &mag);
        check_gemm_tol(&label, &ours, &exact, &mag, gemm_tol(path));
    }
}

/// One path per distinct loop the GEMM runs here for `bits` (0: dense).
fn distinct_loops(bits: i32) -> Vec<KernelPath> {
    let mut seen = Vec::new();
    let mut paths = Vec::new();
    for path in [
        KernelPath::Auto,
        KernelPath::Avx512Vnni,
        KernelPath::Avx512,
        KernelPath::Avx2Int8,
        KernelPath::Avx2,
        KernelPath::Portable,
    ] {
        let name = kernels::gemm_loop_name(path, bits);
        if !seen.contains(&name) {
            seen.push(name);
            paths.push(path);
        }
    }
    paths
}

fn x_of(seed: u64, shape: &[i32], dtype: Dtype) -> Array {
    let x = normal(seed ^ 0x5eed, shape).astype(dtype).unwrap();
    x.eval().unwrap();
    x
}

#[test]
fn gemm_reports_support() {
    eprintln!("AMX loop by default: {}", kernels::gemm_uses_amx(KernelPath::Auto));
    assert!(!kernels::gemm_uses_amx(KernelPath::Avx512), "Avx512 is the exact loop");
    assert_eq!(kernels::gemm_loop_name(KernelPath::Portable, 4), "portable");
    assert_eq!(kernels::gemm_loop_name(KernelPath::Portable, 0), "portable");
    assert!(["amx", "avx512-int16", "avx512", "avx2", "portable"].contains(&kernels::gemm_loop_name(KernelPath::Auto, 4).as_str()));
    // No AVX-512 loop for dense weights or for widths that straddle words.
    assert!(["avx2", "portable"].contains(&kernels::gemm_loop_name(KernelPath::Avx512, 3).as_str()));
    assert!(["avx2", "portable"].contains(&kernels::gemm_loop_name(KernelPath::Auto, 0).as_str()));
    // The integer loops: 4- and 8-bit weights on AVX-512 VNNI without AMX,
    // 8-bit ones on the AVX2 integer path, and nowhere else.
    if kernels::path_name(KernelPath::Avx2Int8) == "avx2-int8" {
        assert_eq!(kernels::gemm_loop_name(KernelPath::Avx2Int8, 8), "avx2-int16");
        assert_eq!(kernels::gemm_loop_name(KernelPath::Avx2Int8, 4), "avx2");
    }
    if kernels::path_name(KernelPath::Avx512Vnni) == "avx512-vnni" {
        let expected = if kernels::gemm_uses_amx(KernelPath::Avx512Vnni) { "amx" } else { "avx512-int16" };
        assert_eq!(kernels::gemm_loop_name(KernelPath::Avx512Vnni, 8), expected);
        assert_eq!(kernels::gemm_loop_name(KernelPath::Avx512Vnni, 4), expected);
        let two_bit = if kernels::gemm_uses_amx(KernelPath::Avx512Vnni) { "amx" } else { "avx512" };
        assert_eq!(kernels::gemm_loop_name(KernelPath::Avx512Vnni, 2), two_bit);
    }
    for path in [KernelPath::Avx512, KernelPath::Avx2, KernelPath::Portable] {
        assert!(!quantizes_x(path, 8) && !quantizes_x(path, 4), "{path:?} is an exact loop");
    }
    for (group, bits) in [(32, 2), (32, 4), (32, 8), (64, 4), (128, 8), (32, 3), (64, 5), (128, 6), (16, 8)] {
        assert!(kernels::gemm_supports(group, bits), "group {group} bits {bits}");
    }
    for (group, bits) in [(0, 4), (4, 4), (16, 3), (32, 7), (32, 1), (-32, 4)] {
        assert!(!kernels::gemm_supports(group, bits), "group {group} bits {bits}");
    }
}

#[test]
fn gemm_matches_on_awkward_shapes() {
    let _g = lock();
    let supported = kernels::gemm_supports(32, 4);
    let mut seed = 10;
    for bits in [2, 3, 4, 5, 6, 8] {
        for (group, k) in [(32, 32), (32, 96), (32, 608), (64, 192), (128, 384)] {
            for n in [1, 5, 31, 33, 64, 100, 200] {
                for m in [16, 17, 33, 129] {
                    seed += 1;
                    let x = x_of(seed, &[m, k], Dtype::Float32);
                    gemm_case(seed, bits, group, k, n, &x, Dtype::Float32, supported);
                }
            }
        }
    }
}

/// Random codes, scales and biases in MLX's layout (for a group size that
/// `quantize` does not make).
fn random_quantized(seed: u64, n: i32, k: i32, group: i32, bits: i32) -> Quantized {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let words: Vec<u32> = (0..n * k * bits / 32).map(|_| next() as u32).collect();
    let groups = (n * k / group) as usize;
    let unit = |v: u64| (v >> 40) as f32 / (1u64 << 24) as f32;
    let scales: Vec<f32> = (0..groups).map(|_| 0.001 + 0.02 * unit(next())).collect();
    let biases: Vec<f32> = (0..groups).map(|_| unit(next()) - 0.5).collect();
    Quantized {
        w: Array::from_slice(&words, &[n, k * bits / 32]).unwrap(),
        scales: Array::from_slice(&scales, &[n, k / group]).unwrap(),
        biases: Array::from_slice(&biases, &[n, k / group]).unwrap(),
        n: n as usize,
        k: k as usize,
    }
}

/// 8-bit rows of 12 and 20 words (groups of 16): the integer loops' panels
/// take a row's words 8 at a time, so these end on a short chunk.
#[test]
fn gemm_matches_with_rows_of_a_few_words() {
    let _g = lock();
    for (k, n, m) in [(48, 37, 19), (80, 16, 33), (48, 100, 5)] {
        let q = random_quantized(k as u64 * 131 + n as u64, n, k, 16, 8);
        let x = x_of(9000 + k as u64, &[m, k], Dtype::Float32);
        let (exact, mag) = gemm_reference(&x, &q, 16, 8);
        for path in distinct_loops(8) {
            let ours = kernels::quantized_gemm_with_path(&x, &q.w, &q.scales, &q.biases, 16, 8, path).unwrap();
            let label = format!("group 16 K={k} N={n} M={m} {}", kernels::gemm_loop_name(path, 8));
            let mag = mag_for(path, &x, &q, 16, 8, &mag);
            check_gemm_tol(&label, &ours, &exact, &mag, gemm_tol(path));
        }
    }
}

#[test]
fn gemm_matches_on_model_shapes_and_batches() {
    let _g = lock();
    let supported = kernels::gemm_supports(32, 4);
    for (k, n, bits) in [(576, 576, 4), (576, 192, 4), (576, 1536, 4), (1536, 576, 4), (576, 3001, 8)] {
        let x = x_of(k as u64 + n as u64, &[2, 67, k], Dtype::Float32);
        gemm_case(1000 + n as u64, bits, 32, k, n, &x, Dtype::Float16, supported);
    }
    // More rows than one task takes (several row blocks per panel).
    let x = x_of(1500, &[600, 96], Dtype::Float32);
    gemm_case(1500, 4, 32, 96, 100, &x, Dtype::Float32, supported);
    swiglu_case(1501, 4, 32, 96, 70, &x, Dtype::Float32);
    // A single row and a few rows also work (any M).
    for m in [1, 2, 7, 8, 9] {
        let x = x_of(2000 + m as u64, &[m, 96], Dtype::Float32);
        gemm_case(2000 + m as u64, 4, 32, 96, 70, &x, Dtype::Float32, supported);
    }
}

/// A row's result does not depend on how many rows share the call: a few
/// rows run the panel a chunk of K at a time from one row block, many rows
/// pack whole panels for several row blocks, and both sum the same products
/// in the same order (bit for bit, on every loop this CPU runs).
#[test]
fn gemm_rows_do_not_depend_on_the_row_count() {
    let _g = lock();
    for (bits, group, k) in [(2, 32, 608), (4, 32, 608), (4, 64, 192), (8, 32, 608), (8, 128, 384), (3, 32, 96)] {
        let q = make_weights(7000 + bits as u64, 100, k, group, bits, Dtype::Float16);
        let x = x_of(7100 + bits as u64, &[300, k], Dtype::Float32);
        for path in distinct_loops(bits) {
            let gemm = |x: &Array| {
                let y = kernels::quantized_gemm_with_path(x, &q.w, &q.scales, &q.biases, group, bits, path).unwrap();
                to_f32(&y)
            };
            let all = gemm(&x);
            for m in [1, 5, 16, 17, 31, 64] {
                let some = gemm(&x.slice_axis(0, 0, m).unwrap());
                let label = format!("bits={bits} group={group} K={k} {}", kernels::gemm_loop_name(path, bits));
                assert_eq!(some, all[..(m * 100) as usize], "{label}: the first {m} rows alone differ from 300 rows");
            }
        }
    }
}

#[test]
fn gemm_half_precision_inputs_and_strided_x() {
    let _g = lock();
    let supported = kernels::gemm_supports(32, 4);
    for (xdt, sdt) in [
        (Dtype::Float16, Dtype::Float16),
        (Dtype::Bfloat16, Dtype::Bfloat16),
        (Dtype::Float32, Dtype::Bfloat16),
        (Dtype::Bfloat16, Dtype::Float32),
    ] {
        let x = x_of(3000, &[3, 19, 160], xdt);
        gemm_case(3000, 4, 32, 160, 45, &x, sdt, supported);
    }
    // A transposed view of x: [40, 96] with strides [1, 40].
    let xt = x_of(3100, &[96, 40], Dtype::Float32);
    gemm_case(3100, 4, 32, 96, 50, &xt.transpose(&[1, 0]).unwrap(), Dtype::Float32, supported);
    // A broadcast (stride-0) row axis.
    let x1 = x_of(3200, &[1, 96], Dtype::Float32);
    gemm_case(3200, 8, 32, 96, 50, &x1.broadcast_to(&[20, 96]).unwrap(), Dtype::Float32, supported);
    // Lazy, sliced weights.
    let big = make_weights(3300, 80, 128, 64, 4, Dtype::Float32);
    let w = big.w.slice_axis(0, 40, 80).unwrap();
    let s = big.scales.add_scalar(0.0).unwrap().slice_axis(0, 40, 80).unwrap();
    let b = big.biases.add_scalar(0.0).unwrap().slice_axis(0, 40, 80).unwrap();
    let x = x_of(3300, &[33, 128], Dtype::Float32);
    let ours = kernels::quantized_gemm(&x, &w, &s, &b, 64, 4).unwrap();
    mlx_sys::eval([&w, &s, &b]).unwrap();
    let sliced = Quantized { w, scales: s, biases: b, n: 40, k: 128 };
    let (exact, mag) = gemm_reference(&x, &sliced, 64, 4);
    let mag = mag_for(KernelPath::Auto, &x, &sliced, 64, 4, &mag);
    check_gemm("lazy sliced weights", &ours, &exact, &mag);
}

#[test]
fn gemm_paths_and_errors() {
    let _g = lock();
    let q = make_weights(4000, 37, 192, 64, 4, Dtype::Float32);
    let x = x_of(4000, &[21, 192], Dtype::Float32);
    let (exact, mag) = gemm_reference(&x, &q, 64, 4);
    for path in [KernelPath::Auto, KernelPath::Portable, KernelPath::Avx2, KernelPath::Avx512, KernelPath::Avx512Vnni] {
        let y = kernels::quantized_gemm_with_path(&x, &q.w, &q.scales, &q.biases, 64, 4, path).unwrap();
        let mag = mag_for(path, &x, &q, 64, 4, &mag);
        check_gemm_tol(&format!("path {path:?}"), &y, &exact, &mag, gemm_tol(path));
    }
    let bad_x = x_of(4001, &[17, 96], Dtype::Float32);
    assert!(kernels::quantized_gemm(&bad_x, &q.w, &q.scales, &q.biases, 64, 4).is_err(), "K mismatch");
    assert!(kernels::quantized_gemm(&x, &q.w, &q.scales, &q.biases, 32, 4).is_err(), "group mismatch");
    // Widths that straddle words read MLX's bit stream: the same answer as MLX's op.
    let key = random::key(4002).unwrap();
    let wf = random::normal(&[19, 192], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    for bits in [3, 5, 6] {
        let (w, s, b) = quantize(&wf, 64, bits).unwrap();
        let y = kernels::quantized_gemm(&x, &w, &s, &b, 64, bits).unwrap();
        assert!(kernels::is_kernel_node(&y), "{bits}-bit: our GEMM");
        let r = quantized_matmul(&x, &w, &s, &b, true, 64, bits).unwrap();
        for (a, b) in to_f32(&y).iter().zip(to_f32(&r)) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{bits}-bit: {a} vs MLX {b}");
        }
    }
}

// ---------------------------------------------------------------------------
// Dense GEMM.

/// Exact (f64) `x @ w.T` and mag for contiguous f32 copies.
fn dense_reference(x: &Array, w: &Array) -> (Vec<f64>, Vec<f64>) {
    let xs = to_f32(&x.contiguous().unwrap());
    let ws = to_f32(&w.contiguous().unwrap());
    let (n, k) = (w.dim(0) as usize, w.dim(1) as usize);
    let m = if k == 0 { 0 } else { xs.len() / k };
    let (mut y, mut mag) = (vec![0f64; m * n], vec![0f64; m * n]);
    for r in 0..m {
        for o in 0..n {
            let (mut acc, mut a) = (0f64, 0f64);
            for j in 0..k {
                let p = xs[r * k + j] as f64 * ws[o * k + j] as f64;
                acc += p;
                a += p.abs();
            }
            y[r * n + o] = acc;
            mag[r * n + o] = a;
        }
    }
    (y, mag)
}

fn dense_case(seed: u64, x: &Array, w: &Array) {
    let label = format!("dense x={:?} {} w={:?} {}", x.shape(), x.dtype(), w.shape(), w.dtype());
    let (exact, mag) = dense_reference(x, w);
    let mlx = x.matmul(&w.transpose(&[1, 0]).unwrap()).unwrap();
    for path in distinct_loops(0) {
        let ours = kernels::dense_matmul_with_path(x, w, path).unwrap();
        let label = format!("{label} {} (seed {seed})", kernels::gemm_loop_name(path, 0));
        assert!(kernels::is_kernel_node(&ours) || ours.dtype() != Dtype::Float32, "{label}: fell back");
        assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
        assert_eq!(ours.dtype(), mlx.dtype(), "{label}: dtype");
        check_gemm_tol(&label, &ours, &exact, &mag, 1e-5);
    }
}

#[test]
fn dense_matches_on_awkward_shapes() {
    let _g = lock();
    let mut seed = 11000;
    for k in [1, 7, 8, 9, 64, 577] {
        for n in [1, 2, 3, 4, 7, 100] {
            for m in [1, 2, 3, 5, 17, 130] {
                seed += 1;
                dense_case(seed, &x_of(seed, &[m, k], Dtype::Float32), &normal(seed + 7, &[n, k]));
            }
        }
    }
    // Model shapes with a batch axis, half-precision weights and inputs.
    dense_case(11900, &x_of(11900, &[2, 37, 576], Dtype::Float32), &normal(11901, &[1536, 576]));
    for (xdt, wdt) in [(Dtype::Float32, Dtype::Float16), (Dtype::Bfloat16, Dtype::Bfloat16), (Dtype::Float16, Dtype::Float32)] {
        let w = normal(11910, &[45, 160]).astype(wdt).unwrap();
        dense_case(11910, &x_of(11910, &[3, 19, 160], xdt), &w);
    }
    // Few rows read a float16 w in place: on the AVX2 loop (explicit FMAs) exactly
    // the products of its float32 widening; the portable loop leaves contraction
    // to the compiler, so it is held to the tolerance of `dense_case` only.
    for (m, k, n) in [(1, 384, 51), (3, 9, 7), (15, 577, 100), (2, 64, 1)] {
        seed += 1;
        let x = x_of(seed, &[m, k], Dtype::Float32);
        let w = normal(seed + 7, &[n, k]).astype(Dtype::Float16).unwrap();
        dense_case(seed, &x, &w);
        let wide = w.astype(Dtype::Float32).unwrap();
        for path in distinct_loops(0).into_iter().filter(|&p| kernels::gemm_loop_name(p, 0) != "portable") {
            let half = kernels::dense_matmul_with_path(&x, &w, path).unwrap();
            let full = kernels::dense_matmul_with_path(&x, &wide, path).unwrap();
            assert_eq!(to_f32(&half), to_f32(&full), "f16 w, m={m} k={k} n={n}, {}", kernels::gemm_loop_name(path, 0));
        }
    }
    // A transposed view of x, a broadcast row axis, a transposed (non-contiguous) w.
    let xt = x_of(11920, &[96, 40], Dtype::Float32).transpose(&[1, 0]).unwrap();
    dense_case(11920, &xt, &normal(11921, &[50, 96]));
    let x1 = x_of(11930, &[1, 96], Dtype::Float32).broadcast_to(&[20, 96]).unwrap();
    dense_case(11930, &x1, &normal(11931, &[33, 96]));
    let wt = normal(11940, &[96, 70]).transpose(&[1, 0]).unwrap();
    dense_case(11940, &x_of(11940, &[21, 96], Dtype::Float32), &wt);
}

#[test]
fn dense_errors_name_the_shapes() {
    let _g = lock();
    let x = x_of(12000, &[4, 96], Dtype::Float32);
    let w = normal(12001, &[10, 95]);
    let err = kernels::dense_matmul(&x, &w).and_then(|y| y.eval().map(|_| y)).err().expect("K mismatch");
    let msg = err.to_string();
    assert!(msg.contains("96") && msg.contains("95"), "{msg}");
    let w3 = normal(12002, &[2, 10, 96]);
    assert!(kernels::dense_matmul(&x, &w3).and_then(|y| y.eval().map(|_| y)).is_err(), "3-D weight");
    // Zero rows give an empty result of the right shape.
    let empty = x_of(12003, &[0, 96], Dtype::Float32);
    let y = kernels::dense_matmul(&empty, &normal(12004, &[10, 96])).unwrap();
    y.eval().unwrap();
    assert_eq!(y.shape(), vec![0, 10]);
}

#[test]
fn gemm_chained_in_one_graph() {
    let _g = lock();
    // y2 = W2 · (W1 · x) as one graph, both nodes ours, and a large N.
    let q1 = make_weights(5000, 160, 96, 32, 4, Dtype::Float32);
    let q2 = make_weights(5001, 4099, 160, 32, 8, Dtype::Float32);
    let x = x_of(5000, &[1, 40, 96], Dtype::Float32);
    let y1 = kernels::quantized_gemm(&x, &q1.w, &q1.scales, &q1.biases, 32, 4).unwrap();
    let y2 = kernels::quantized_gemm(&y1, &q2.w, &q2.scales, &q2.biases, 32, 8).unwrap();
    let r1 = quantized_matmul(&x, &q1.w, &q1.scales, &q1.biases, true, 32, 4).unwrap();
    y2.eval().unwrap();
    let (exact, mag) = gemm_reference(&y1, &q2, 32, 8);
    let mag = mag_for(KernelPath::Auto, &y1, &q2, 32, 8, &mag);
    check_gemm("second of a chain", &y2, &exact, &mag);
    let (e1, m1) = gemm_reference(&x, &q1, 32, 4);
    check_gemm("MLX first of a chain", &r1, &e1, &m1);
    let m1 = mag_for(KernelPath::Auto, &x, &q1, 32, 4, &m1);
    check_gemm("first of a chain", &y1, &e1, &m1);
}

fn swiglu_case(seed: u64, bits: i32, group: i32, k: i32, n: i32, x: &Array, sdtype: Dtype) {
    let g = make_weights(seed, n, k, group, bits, sdtype);
    let u = make_weights(seed + 1, n, k, group, bits, sdtype);
    let label = format!("swiglu bits={bits} group={group} K={k} N={n} x={:?} {}/{sdtype}", x.shape(), x.dtype());
    let ours = kernels::quantized_gemm_swiglu(x, [&g.w, &g.scales, &g.biases], [&u.w, &u.scales, &u.biases], group, bits).unwrap();
    // MLX's composition, as the model wrote it before.
    let mg = quantized_matmul(x, &g.w, &g.scales, &g.biases, true, group, bits).unwrap();
    let mu = quantized_matmul(x, &u.w, &u.scales, &u.biases, true, group, bits).unwrap();
    let mlx = mg.silu().unwrap().multiply(&mu).unwrap();
    assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
    assert_eq!(ours.dtype(), mlx.dtype(), "{label}: dtype");
    if kernels::gemm_supports(group, bits) && x.dtype() == Dtype::Float32 && ours.dtype() == Dtype::Float32 {
        assert!(kernels::is_kernel_node(&ours), "{label}: fell back");
    }
    let (eg, mgag) = gemm_reference(x, &g, group as usize, bits as usize);
    let (eu, muag) = gemm_reference(x, &u, group as usize, bits as usize);
    let mgag = mag_for(KernelPath::Auto, x, &g, group as usize, bits as usize, &mgag);
    let muag = mag_for(KernelPath::Auto, x, &u, group as usize, bits as usize, &muag);
    let round = match ours.dtype() {
        Dtype::Float16 => 2f64.powi(-9),
        Dtype::Bfloat16 => 2f64.powi(-6),
        _ => 0.0,
    };
    for (i, v) in to_f32(&ours).iter().enumerate() {
        let (gv, uv) = (eg[i], eu[i]);
        let sig = 1.0 / (1.0 + (-gv).exp());
        let exact = gv * sig * uv;
        // d/dg silu is within [-0.1, 1.1]; the sigmoid itself is within a few ulp.
        let rel = gemm_tol(KernelPath::Auto);
        let tol = rel * (1.1 * uv.abs() * mgag[i] + (gv * sig).abs() * muag[i]) + (1e-6 + round) * exact.abs() + 1e-30;
        assert!(((*v as f64) - exact).abs() <= tol, "{label}: element {i}: got {v}, exact {exact}, tol {tol:.3e}");
    }
}

#[test]
fn swiglu_matches() {
    let _g = lock();
    let mut seed = 6000;
    for (bits, group, k) in [(4, 32, 576), (4, 64, 192), (8, 32, 96), (2, 32, 64)] {
        for n in [1, 17, 64, 100] {
            for m in [16, 37] {
                seed += 2;
                swiglu_case(seed, bits, group, k, n, &x_of(seed, &[1, m, k], Dtype::Float32), Dtype::Float32);
            }
        }
    }
    // Large activations: e^-g overflows for g << 0 and silu must go to 0, not NaN.
    let big = normal(6500, &[20, 64]).mul_scalar(400.0).unwrap();
    swiglu_case(6500, 4, 32, 64, 40, &big, Dtype::Float32);
    // Half precision falls back to MLX's ops in the output dtype.
    swiglu_case(6600, 4, 32, 96, 33, &x_of(6600, &[18, 96], Dtype::Float16), Dtype::Float16);
    swiglu_case(6700, 4, 32, 96, 33, &x_of(6700, &[18, 96], Dtype::Float32), Dtype::Bfloat16);
}

#[test]
fn swiglu_rejects_mismatched_projections() {
    let _g = lock();
    let g = make_weights(6800, 40, 96, 32, 4, Dtype::Float32);
    let u = make_weights(6801, 41, 96, 32, 4, Dtype::Float32);
    let x = x_of(6800, &[17, 96], Dtype::Float32);
    let r = kernels::quantized_gemm_swiglu(&x, [&g.w, &g.scales, &g.biases], [&u.w, &u.scales, &u.biases], 32, 4)
        .and_then(|y| y.eval());
    assert!(r.is_err(), "gate [40] and up [41] cannot be multiplied");
}

// ---------------------------------------------------------------------------
// Attention.

/// f64 attention, causal or unmasked: q [B, H, L, D], k/v [B, Hkv, S, D] (contiguous copies).
fn attention_reference(q: &Array, k: &Array, v: &Array, scale: f32, causal: bool) -> Vec<f64> {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (b, h, l, d) = (qs[0] as usize, qs[1] as usize, qs[2] as usize, qs[3] as usize);
    let (hkv, s) = (ks[1] as usize, ks[2] as usize);
    assert_eq!(vs, ks);
    let (qv, kv, vv) = (to_f32(&q.contiguous().unwrap()), to_f32(&k.contiguous().unwrap()), to_f32(&v.contiguous().unwrap()));
    let mut out = vec![0f64; b * h * l * d];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hkv);
            for i in 0..l {
                let lim = if causal { s - l + i } else { s - 1 };
                let qrow = &qv[((bi * h + hi) * l + i) * d..][..d];
                let mut scores = vec![f64::NEG_INFINITY; s];
                for (j, sc) in scores.iter_mut().enumerate().take(lim + 1) {
                    let krow = &kv[((bi * hkv + kh) * s + j) * d..][..d];
                    *sc = qrow.iter().zip(krow).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() * scale as f64;
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let o = &mut out[((bi * h + hi) * l + i) * d..][..d];
                for (j, p) in e.iter().enumerate() {
                    let vrow = &vv[((bi * hkv + kh) * s + j) * d..][..d];
                    for (oo, vx) in o.iter_mut().zip(vrow) {
                        *oo += p / z * *vx as f64;
                    }
                }
            }
        }
    }
    out
}

fn check_attention(label: &str, got: &Array, exact: &[f64], vmax: f64) {
    let vals = to_f32(&got.contiguous().unwrap());
    assert_eq!(vals.len(), exact.len(), "{label}: length");
    let round = match got.dtype() {
        Dtype::Float16 => 2f64.powi(-9),
        Dtype::Bfloat16 => 2f64.powi(-6),
        _ => 0.0,
    };
    let tol = 1e-5 * vmax + round * vmax;
    for (i, (&v, &e)) in vals.iter().zip(exact).enumerate() {
        let err = (v as f64 - e).abs();
        assert!(err <= tol, "{label}: element {i}: got {v}, exact {e}, |err| {err:.3e} > tol {tol:.3e}");
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_case(seed: u64, b: i32, h: i32, hkv: i32, l: i32, s: i32, d: i32, dtype: Dtype) {
    let scale = (d as f32).powf(-0.5);
    // q as the transposed view a model produces: [B, L, H, D] -> [B, H, L, D].
    let q = normal(seed, &[b, l, h, d]).mul_scalar(2.0).unwrap().astype(dtype).unwrap().transpose(&[0, 2, 1, 3]).unwrap();
    // k and v as slices of a larger cache buffer.
    let cap = s + 7;
    let kbuf = normal(seed + 1, &[b, hkv, cap, d]).astype(dtype).unwrap();
    let vbuf = normal(seed + 2, &[b, hkv, cap, d]).astype(dtype).unwrap();
    let k = kbuf.slice_axis(2, 0, s).unwrap();
    let v = vbuf.slice_axis(2, 0, s).unwrap();
    mlx_sys::eval([&q, &k, &v]).unwrap();
    let label = format!("B={b} H={h} Hkv={hkv} L={l} S={s} D={d} {dtype}");
    let ours = kernels::causal_attention(&q, &k, &v, scale).unwrap();
    let mlx = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Causal).unwrap();
    assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
    assert_eq!(ours.dtype(), mlx.dtype(), "{label}: dtype");
    let supported = kernels::causal_attention_supports(&q, &k, &v);
    assert_eq!(supported, dtype == Dtype::Float32 && d % 16 == 0, "{label}: support");
    let exact = attention_reference(&q, &k, &v, scale, true);
    let vmax = to_f32(&v.contiguous().unwrap()).iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    check_attention(&label, &ours, &exact, vmax);
    check_attention(&format!("MLX {label}"), &mlx, &exact, vmax);
    // The layout promise: transposing back to [B, L, H, D] and merging the heads is free.
    if supported {
        let merged = ours.transpose(&[0, 2, 1, 3]).unwrap();
        assert_eq!(merged.strides(), vec![(l * h * d) as i64, (h * d) as i64, d as i64, 1], "{label}: layout");
    }
}

#[test]
fn attention_matches_mlx_causal() {
    let _g = lock();
    let mut seed = 7000;
    for (h, hkv) in [(9, 3), (4, 4), (8, 1)] {
        for d in [16, 64, 80] {
            for (l, offset) in [(1, 0), (2, 0), (5, 3), (17, 0), (33, 100), (64, 1)] {
                seed += 3;
                attention_case(seed, 1, h, hkv, l, l + offset, d, Dtype::Float32);
            }
        }
    }
}

/// Without the mask (an encoder, cross-attention): every query sees every
/// key, and S may be shorter or longer than L.
#[test]
fn attention_matches_mlx_unmasked() {
    let _g = lock();
    let mut seed = 9500;
    for (h, hkv, d) in [(6, 6, 64), (8, 2, 32), (4, 4, 80)] {
        for (l, s) in [(1, 1), (1, 150), (3, 150), (40, 40), (150, 9), (67, 200)] {
            seed += 3;
            let scale = (d as f32).powf(-0.5);
            let q = normal(seed, &[1, l, h, d]).mul_scalar(2.0).unwrap().transpose(&[0, 2, 1, 3]).unwrap();
            let k = normal(seed + 1, &[1, hkv, s, d]);
            let v = normal(seed + 2, &[1, s, hkv, d]).transpose(&[0, 2, 1, 3]).unwrap();
            mlx_sys::eval([&q, &k, &v]).unwrap();
            let label = format!("unmasked H={h} Hkv={hkv} L={l} S={s} D={d}");
            assert_eq!(kernels::attention_supports(&q, &k, &v, false), d % 16 == 0, "{label}: support");
            let ours = kernels::attention(&q, &k, &v, scale, false).unwrap();
            let mlx = fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None).unwrap();
            assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
            let exact = attention_reference(&q, &k, &v, scale, false);
            let vmax = to_f32(&v.contiguous().unwrap()).iter().fold(0f64, |m, x| m.max(x.abs() as f64));
            check_attention(&label, &ours, &exact, vmax);
            check_attention(&format!("MLX {label}"), &mlx, &exact, vmax);
        }
    }
    // `causal: true` is causal_attention.
    let (q, k) = (normal(9990, &[1, 2, 5, 32]), normal(9991, &[1, 2, 9, 32]));
    let v = normal(9992, &[1, 2, 9, 32]);
    let a = kernels::attention(&q, &k, &v, 0.3, true).unwrap();
    let b = kernels::causal_attention(&q, &k, &v, 0.3).unwrap();
    assert_eq!(to_f32(&a.contiguous().unwrap()), to_f32(&b.contiguous().unwrap()));
}

#[test]
fn attention_batches_long_context_and_fallbacks() {
    let _g = lock();
    attention_case(8000, 2, 6, 2, 40, 45, 128, Dtype::Float32);
    attention_case(8003, 1, 9, 3, 300, 700, 64, Dtype::Float32);
    // Handed to MLX: half precision, a head size that is not a multiple of 16.
    attention_case(8006, 1, 4, 2, 9, 12, 64, Dtype::Float16);
    attention_case(8009, 1, 4, 2, 9, 12, 64, Dtype::Bfloat16);
    attention_case(8012, 1, 4, 2, 9, 12, 24, Dtype::Float32);
}

/// Keys and values whose head axis is not contiguous (a transposed view):
/// gathered into a row buffer before the keys' 8 x 8 transposes.
#[test]
fn attention_reads_keys_and_values_of_any_stride() {
    let _g = lock();
    for (l, s) in [(13, 13), (9, 30)] {
        let (h, hkv, d) = (4, 2, 32);
        let q = normal(9400 + l as u64, &[1, h, l, d]);
        let k = normal(9401 + l as u64, &[1, hkv, d, s]).transpose(&[0, 1, 3, 2]).unwrap();
        let v = normal(9402 + l as u64, &[1, d, hkv, s]).transpose(&[0, 2, 3, 1]).unwrap();
        mlx_sys::eval([&q, &k, &v]).unwrap();
        assert_ne!(k.strides()[3], 1);
        assert_ne!(v.strides()[3], 1);
        let label = format!("strided k and v, L={l} S={s}");
        assert!(kernels::causal_attention_supports(&q, &k, &v), "{label}: support");
        let ours = kernels::causal_attention(&q, &k, &v, 0.2).unwrap();
        let exact = attention_reference(&q, &k, &v, 0.2, true);
        let vmax = to_f32(&v.contiguous().unwrap()).iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        check_attention(&label, &ours, &exact, vmax);
    }
}

#[test]
fn attention_large_scores_stay_finite() {
    let _g = lock();
    // Scores of several hundred: the softmax must subtract the row maximum.
    let (b, h, l, d) = (1, 2, 20, 32);
    let q = normal(9000, &[b, h, l, d]).mul_scalar(30.0).unwrap();
    let k = normal(9001, &[b, h, l, d]).mul_scalar(30.0).unwrap();
    let v = normal(9002, &[b, h, l, d]);
    mlx_sys::eval([&q, &k, &v]).unwrap();
    let ours = kernels::causal_attention(&q, &k, &v, 0.2).unwrap();
    let exact = attention_reference(&q, &k, &v, 0.2, true);
    let vmax = to_f32(&v).iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    // Scores ~1e3 carry ~1e3·eps absolute error into the exponent.
    let vals = to_f32(&ours.contiguous().unwrap());
    for (i, (&g, &e)) in vals.iter().zip(&exact).enumerate() {
        assert!(g.is_finite(), "element {i} is not finite");
        assert!((g as f64 - e).abs() <= 1e-3 * vmax, "element {i}: {g} vs {e}");
    }
}

/// Attention and the fused SwiGLU GEMM follow `MLXCEL_KERNELS` (read once per
/// process): run their tests again in children capped at the portable and
/// AVX2 loops.
#[test]
fn attention_and_swiglu_on_every_loop() {
    if std::env::var_os("MLXCEL_KERNELS").is_some() {
        return; // already a child
    }
    for path in ["portable", "avx2"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "--test-threads=1",
                "attention_matches_mlx_causal",
                "attention_matches_mlx_unmasked",
                "attention_batches_long_context_and_fallbacks",
                "attention_large_scores_stay_finite",
                "attention_reads_keys_and_values_of_any_stride",
                "swiglu_matches",
            ])
            .env("MLXCEL_KERNELS", path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "MLXCEL_KERNELS={path}:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("6 passed"), "MLXCEL_KERNELS={path}: expected 6 tests to run:\n{text}");
    }
}
