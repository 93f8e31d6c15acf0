//! mlxcel's CPU kernels against MLX's reference op and an f64 host reference.
//!
//! Tolerance. Every implementation computes the same exact real number,
//! y = sum_k x_k (s_g q_k + b_g) over f32 (or f16/bf16-valued) inputs, and
//! differs only in rounding and summation order. With f32 accumulation the
//! rounding error of a sum of K terms is bounded by ~K·eps·Σ|terms| and is in
//! practice ~sqrt(K)·eps·Σ|terms|, so errors are measured against
//! mag = Σ_k |x_k|·|s_g q_k + b_g| (not against |y|, which can be near zero
//! through cancellation). We require |ours - exact| <= 1e-5·mag (about 80 f32
//! ulps of mag: 10-20x the ~sqrt(K)·eps we expect for K <= 1536, still 1000x
//! below any real bug such as a wrong nibble or scale, which moves the result
//! by ~1e-2·mag or more). f16/bf16 outputs add their own final rounding, half
//! an ulp of |y|: 2^-11·|y| and 2^-8·|y|.
//!
//! The integer paths (AVX-512 VNNI for bits 4 and 8, AVX2 and aarch64 NEON
//! for bits 2, 4 and 8) also quantize each group of activations to 16 bits: every x_k moves by at most max|x_g| / 65024, so
//! its bound adds Σ_g max|x_g| / 65024 · Σ_{k in g} |s_g q_k| (the bias term
//! uses exact sums of x).

mod common;

use std::sync::Mutex;

use half::{bf16, f16};
use mlx_sys::kernels::{self, KernelPath};
use mlx_sys::{quantize, quantized_matmul, random, Array, Dtype};

/// MLX evaluation is not meant to run from several threads at once.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn to_f32(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn to_f32_checked(a: &Array) -> mlx_sys::Result<Vec<f32>> {
    a.astype(Dtype::Float32)?.to_vec::<f32>()
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
    // A row-dependent spread makes scales differ a lot between rows.
    let wf = random::normal(&[n, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let row_scale = random::uniform(0.01, 2.0, &[n, 1], Dtype::Float32, &random::split(&key, 2).unwrap()[1]).unwrap();
    let wf = wf.multiply(&row_scale).unwrap().add_scalar(0.1).unwrap();
    let (w, scales, biases) = quantize(&wf, group, bits).unwrap();
    let scales = scales.astype(sdtype).unwrap();
    let biases = biases.astype(sdtype).unwrap();
    mlx_sys::eval([&w, &scales, &biases]).unwrap();
    Quantized { w, scales, biases, n: n as usize, k: k as usize }
}

fn make_x(seed: u64, shape: &[i32], dtype: Dtype) -> Array {
    let key = random::key(seed ^ 0x5eed).unwrap();
    let x = random::normal(shape, Dtype::Float32, 0.0, 1.0, &key).unwrap().astype(dtype).unwrap();
    x.eval().unwrap();
    x
}

/// Exact (f64) y and mag = Σ|x||w| for every (row of x, output), unpacking w
/// as a little-endian bit stream (element k of a row at bit k·bits).
fn reference(x: &Array, q: &Quantized, group: usize, bits: usize) -> (Vec<f64>, Vec<f64>) {
    let xs = to_f32(x);
    let words = q.w.to_vec::<u32>().unwrap();
    let s = to_f32(&q.scales);
    let b = to_f32(&q.biases);
    let (n, k) = (q.n, q.k);
    let g = k / group;
    let m = xs.len() / k;
    let row_words = k * bits / 32;
    let mask = (1u64 << bits) - 1;
    let mut deq = vec![0f64; k];
    let mut y = vec![0f64; m * n];
    let mut mag = vec![0f64; m * n];
    for o in 0..n {
        let row = &words[o * row_words..(o + 1) * row_words];
        for (j, d) in deq.iter_mut().enumerate() {
            let bit = j * bits;
            let lo = row[bit / 32] as u64;
            let hi = if bit / 32 + 1 < row_words { row[bit / 32 + 1] as u64 } else { 0 };
            let v = ((lo | (hi << 32)) >> (bit % 32)) & mask;
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

/// Whether `path` runs an integer loop (activations quantized to 16 bits)
/// for this layout on this CPU: VNNI for bits 4 and 8 with groups of 16k up
/// to 256, AVX2 and NEON (aarch64) for bits 2, 4 and 8 when a group spans a
/// power of two below 8 words or a multiple of 8.
fn uses_vnni(path: KernelPath, bits: usize, group: usize) -> bool {
    match kernels::path_name(path).as_str() {
        "avx512-vnni" => (bits == 4 || bits == 8) && group % 16 == 0 && group <= 256,
        "avx2-int8" | "neon-int8" => {
            let words_per_group = group * bits / 32;
            matches!(bits, 2 | 4 | 8)
                && ((words_per_group < 8 && words_per_group.is_power_of_two()) || words_per_group % 8 == 0)
        }
        _ => false,
    }
}

/// [`reference`] with `mag` widened by the activation-quantization bound
/// when `path` runs the VNNI loop (see the module docs), expressed in units
/// of the 1e-5 relative tolerance.
fn reference_for(path: KernelPath, x: &Array, q: &Quantized, group: usize, bits: usize) -> (Vec<f64>, Vec<f64>) {
    if uses_vnni(path, bits, group) {
        reference_quantized_x(x, q, group, bits)
    } else {
        reference(x, q, group, bits)
    }
}

/// [`reference`] with `mag` widened by the activation-quantization bound.
fn reference_quantized_x(x: &Array, q: &Quantized, group: usize, bits: usize) -> (Vec<f64>, Vec<f64>) {
    let (exact, mut mag) = reference(x, q, group, bits);
    let words = q.w.to_vec::<u32>().unwrap();
    let bound = common::quantized_x_bound(&to_f32(x), &words, &to_f32(&q.scales), q.n, q.k, group, bits);
    for (m, b) in mag.iter_mut().zip(bound) {
        *m += b * 1.01 / 1e-5;
    }
    (exact, mag)
}

fn out_rounding(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Float16 => 2f64.powi(-11),
        Dtype::Bfloat16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// Checks `got` against the exact result; returns the worst error / mag.
fn check(label: &str, got: &Array, exact: &[f64], mag: &[f64]) -> f64 {
    let vals = to_f32(got);
    assert_eq!(vals.len(), exact.len(), "{label}: length");
    let round = out_rounding(got.dtype());
    let mut worst = 0f64;
    for (i, ((&v, &e), &a)) in vals.iter().zip(exact).zip(mag).enumerate() {
        let err = (v as f64 - e).abs();
        let tol = 1e-5 * a + round * e.abs() + 1e-30;
        assert!(err <= tol, "{label}: element {i}: got {v}, exact {e}, |err| {err:.3e} > tol {tol:.3e} (mag {a:.3e})");
        worst = worst.max(err / a.max(1e-30));
    }
    worst
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    seed: u64,
    bits: i32,
    group: i32,
    k: i32,
    n: i32,
    x_shape: &[i32],
    xdtype: Dtype,
    sdtype: Dtype,
    paths: &[KernelPath],
) {
    let q = make_weights(seed, n, k, group, bits, sdtype);
    let mut shape = x_shape.to_vec();
    shape.push(k);
    let x = make_x(seed, &shape, xdtype);
    let (exact, mag) = reference(&x, &q, group as usize, bits as usize);
    let (_, vnni_mag) = reference_quantized_x(&x, &q, group as usize, bits as usize);
    let mlx = quantized_matmul(&x, &q.w, &q.scales, &q.biases, true, group, bits).unwrap();
    for &path in paths {
        let label = format!("bits={bits} group={group} K={k} N={n} x={shape:?} {xdtype}/{sdtype} path={path:?}");
        let ours = kernels::quantized_matmul_with_path(&x, &q.w, &q.scales, &q.biases, group, bits, path).unwrap();
        assert!(kernels::is_kernel_node(&ours), "{label}: fell back to MLX's op");
        assert_eq!(ours.shape(), mlx.shape(), "{label}: shape");
        assert_eq!(ours.dtype(), mlx.dtype(), "{label}: dtype");
        let mag = if uses_vnni(path, bits as usize, group as usize) { &vnni_mag } else { &mag };
        check(&label, &ours, &exact, mag);
    }
    // MLX's own op must meet the same bar in f32, or the bar is wrong.
    if xdtype == Dtype::Float32 && sdtype == Dtype::Float32 {
        check(&format!("MLX reference bits={bits} group={group} K={k} N={n}"), &mlx, &exact, &mag);
    }
}

const ALL_PATHS: [KernelPath; 7] = [
    KernelPath::Auto,
    KernelPath::Portable,
    KernelPath::Avx2,
    KernelPath::Avx2Int8,
    KernelPath::Avx512,
    KernelPath::Avx512Vnni,
    KernelPath::NeonInt8,
];

#[test]
fn reports_its_path_and_threads() {
    let auto = kernels::path_name(KernelPath::Auto);
    assert!(["avx512-vnni", "avx512", "avx2-int8", "neon-int8", "portable"].contains(&auto.as_str()), "{auto}");
    assert_eq!(kernels::path_name(KernelPath::Portable), "portable");
    // The NEON integer loop runs on aarch64 only; elsewhere it is the portable one.
    let neon = if cfg!(target_arch = "aarch64") { "neon-int8" } else { "portable" };
    assert_eq!(kernels::path_name(KernelPath::NeonInt8), neon);
    assert!(kernels::num_threads() >= 1);
    assert!(kernels::supports(32, 4) && kernels::supports(64, 8) && kernels::supports(128, 2));
    assert!(!kernels::supports(32, 7) && !kernels::supports(0, 4));
    eprintln!("auto path: {auto}, threads: {}", kernels::num_threads());
}

#[test]
fn matches_mlx_bits_4_and_8_f32_all_groups_and_shapes() {
    let _g = lock();
    let mut seed = 1;
    for bits in [4, 8] {
        for (group, ks) in [(32, [32, 96, 576]), (64, [64, 192, 576]), (128, [128, 384, 640])] {
            for k in ks {
                for n in [1, 3, 49, 200] {
                    for x_shape in [&[1][..], &[3], &[2, 3], &[1, 1], &[5]] {
                        seed += 1;
                        run_case(seed, bits, group, k, n, x_shape, Dtype::Float32, Dtype::Float32, &ALL_PATHS);
                    }
                }
            }
        }
    }
}

#[test]
fn matches_mlx_on_smollm_shapes() {
    let _g = lock();
    for bits in [4, 8] {
        for (k, n) in [(576, 1536), (1536, 576), (576, 192)] {
            run_case(100 + k as u64 + n as u64, bits, 32, k, n, &[1, 1], Dtype::Float32, Dtype::Float32, &ALL_PATHS);
        }
    }
}

#[test]
fn large_odd_row_count() {
    let _g = lock();
    // More rows than the lm_head (49152) and not a multiple of anything.
    run_case(7, 4, 32, 576, 49155, &[1, 1], Dtype::Float32, Dtype::Float32, &[KernelPath::Auto]);
    run_case(8, 8, 64, 128, 49157, &[2], Dtype::Float32, Dtype::Float32, &[KernelPath::Auto, KernelPath::Avx2, KernelPath::Avx2Int8]);
}

#[test]
fn largest_group_sums_do_not_wrap() {
    let _g = lock();
    // Every code at its largest against activations of one magnitude per row:
    // the integer paths' int32 group sums reach their maximum (8-bit groups of
    // 256: 256 * 255 * 32512 = 2.12e9, just under 2^31), positive and negative.
    let (n, k) = (19, 512);
    let x: Vec<f32> = [1.0f32, -2.5].iter().flat_map(|&v| std::iter::repeat(v).take(k)).collect();
    let x = Array::from_slice(&x, &[2, k as i32]).unwrap();
    for bits in [4, 8] {
        for group in [32, 64, 128, 256] {
            let words = vec![u32::MAX; n * k * bits / 32];
            let groups = n * k / group;
            let w = Array::from_slice(&words, &[n as i32, (k * bits / 32) as i32]).unwrap();
            let scales = Array::from_slice(&vec![f16::from_f32(0.004); groups], &[n as i32, (k / group) as i32]).unwrap();
            let biases = Array::from_slice(&vec![f16::from_f32(-0.25); groups], &[n as i32, (k / group) as i32]).unwrap();
            let q = Quantized { w, scales, biases, n, k };
            let (exact, mag) = reference(&x, &q, group, bits);
            let (_, quantized_x_mag) = reference_quantized_x(&x, &q, group, bits);
            for &path in &ALL_PATHS {
                let label = format!("bits={bits} group={group} path={path:?}");
                let ours = kernels::quantized_matmul_with_path(&x, &q.w, &q.scales, &q.biases, group as i32, bits as i32, path).unwrap();
                let mag = if uses_vnni(path, bits, group) { &quantized_x_mag } else { &mag };
                check(&label, &ours, &exact, mag);
            }
        }
    }
}

#[test]
fn more_rows_of_x() {
    let _g = lock();
    // M from 1 to 17 covers every row-tile remainder (4-row and 2-row tiles).
    for m in 1..=17 {
        run_case(200 + m as u64, 4, 64, 192, 37, &[m], Dtype::Float32, Dtype::Float32, &ALL_PATHS);
    }
    run_case(300, 8, 32, 96, 11, &[2, 3, 4], Dtype::Float32, Dtype::Float32, &ALL_PATHS);
}

#[test]
fn each_row_of_x_is_bit_identical_to_it_alone() {
    let _g = lock();
    // The engine batches rows of different sequences into one call: each row
    // must come out the same whatever M is and wherever it falls, on every
    // path. N = 37 leaves short blocks of output rows; M = 9 runs tiles of
    // 4, 4 and 1 activation rows.
    for (bits, group, k) in [(4, 64, 576), (8, 32, 256), (4, 128, 256), (8, 64, 192)] {
        let q = make_weights(500 + bits as u64 + group as u64, 37, k, group, bits, Dtype::Float16);
        let m = 9;
        let x = make_x(501, &[m, k], Dtype::Float32);
        for &path in &ALL_PATHS {
            let run = |x: &Array| {
                to_f32(&kernels::quantized_matmul_with_path(x, &q.w, &q.scales, &q.biases, group, bits, path).unwrap())
            };
            let all = run(&x);
            for i in 0..m {
                let alone = run(&x.slice_axis(0, i, i + 1).unwrap());
                let n = alone.len();
                let label = format!("bits={bits} group={group} path={path:?} row {i}");
                assert_eq!(&all[i as usize * n..(i as usize + 1) * n], &alone[..], "{label}");
            }
        }
    }
}

#[test]
fn other_bit_widths() {
    let _g = lock();
    for (bits, group) in [(2, 32), (2, 64), (2, 128), (3, 32), (3, 64), (5, 32), (6, 32), (6, 64)] {
        let k = if group == 128 { 256 } else { 192 };
        // MLX may not support every width; whatever it rejects, we must reject too.
        let key = random::key(bits as u64).unwrap();
        let wf = random::normal(&[5, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
        if quantize(&wf, group, bits).and_then(|(w, _, _)| w.eval()).is_err() {
            eprintln!("MLX does not quantize bits={bits} group={group}; skipped");
            continue;
        }
        for x_shape in [&[1][..], &[3], &[2, 3]] {
            run_case(400 + bits as u64, bits, group, k, 19, x_shape, Dtype::Float32, Dtype::Float32, &ALL_PATHS);
        }
    }
}

#[test]
fn half_precision_activations_and_scales() {
    let _g = lock();
    for (xdt, sdt) in [
        (Dtype::Float16, Dtype::Float16),
        (Dtype::Bfloat16, Dtype::Bfloat16),
        (Dtype::Float32, Dtype::Float16),
        (Dtype::Float32, Dtype::Bfloat16),
        (Dtype::Bfloat16, Dtype::Float32),
    ] {
        for bits in [4, 8] {
            for x_shape in [&[1][..], &[2, 3]] {
                run_case(500 + bits as u64, bits, 32, 576, 67, x_shape, xdt, sdt, &ALL_PATHS);
            }
        }
    }
}

#[test]
fn portable_and_simd_paths_agree() {
    let _g = lock();
    let q = make_weights(900, 300, 1536, 32, 4, Dtype::Bfloat16);
    let x = make_x(900, &[3, 1536], Dtype::Float32);
    let results: Vec<Vec<f32>> = [KernelPath::Portable, KernelPath::Avx2, KernelPath::Avx512]
        .iter()
        .map(|&p| to_f32(&kernels::quantized_matmul_with_path(&x, &q.w, &q.scales, &q.biases, 32, 4, p).unwrap()))
        .collect();
    let (_, mag) = reference(&x, &q, 32, 4);
    for other in &results[1..] {
        for (i, ((a, b), m)) in results[0].iter().zip(other).zip(&mag).enumerate() {
            assert!(((a - b).abs() as f64) <= 2e-5 * m, "element {i}: portable {a} vs simd {b} (mag {m})");
        }
    }
}

#[test]
fn strided_and_lazy_inputs() {
    let _g = lock();
    let (k, n, group, bits) = (192, 21, 64, 4);
    let q = make_weights(1000, n, k, group, bits, Dtype::Float32);
    // x as a transposed view: [3, K] with strides [1, 3].
    let xt = make_x(1000, &[k, 3], Dtype::Float32);
    let x = xt.transpose(&[1, 0]).unwrap();
    let ours = kernels::quantized_matmul(&x, &q.w, &q.scales, &q.biases, group, bits).unwrap();
    let (exact, mag) = reference_for(KernelPath::Auto, &x.contiguous().unwrap(), &q, group as usize, bits as usize);
    check("transposed x", &ours, &exact, &mag);
    // x with a broadcast (stride-0) batch axis.
    let x1 = make_x(1001, &[1, k], Dtype::Float32);
    let xb = x1.broadcast_to(&[4, k]).unwrap();
    let ours = kernels::quantized_matmul(&xb, &q.w, &q.scales, &q.biases, group, bits).unwrap();
    let (exact, mag) = reference_for(KernelPath::Auto, &xb.contiguous().unwrap(), &q, group as usize, bits as usize);
    check("broadcast x", &ours, &exact, &mag);
    // Lazy weight, scales and biases: row slices of a bigger, unevaluated set.
    let big = make_weights(1002, 2 * n, k, group, bits, Dtype::Float32);
    let lazy = |a: &Array| a.add_scalar(0.0).unwrap().slice_axis(0, n, 2 * n).unwrap();
    let w = big.w.slice_axis(0, n, 2 * n).unwrap();
    let w = w.add(&Array::from_slice(&[0u32], &[1]).unwrap()).unwrap();
    let (s, b) = (lazy(&big.scales), lazy(&big.biases));
    let x = make_x(1003, &[2, k], Dtype::Float32);
    let ours = kernels::quantized_matmul(&x, &w, &s, &b, group, bits).unwrap();
    assert!(kernels::is_kernel_node(&ours));
    let mlx = quantized_matmul(&x, &w, &s, &b, true, group, bits).unwrap();
    assert!(!kernels::is_kernel_node(&mlx));
    mlx_sys::eval([&w, &s, &b]).unwrap();
    let sliced = Quantized { w, scales: s, biases: b, n: n as usize, k: k as usize };
    let (exact, mag) = reference_for(KernelPath::Auto, &x, &sliced, group as usize, bits as usize);
    check("lazy sliced weights", &ours, &exact, &mag);
    check("lazy sliced weights (MLX)", &mlx, &exact, &mag);
}

#[test]
fn rejects_what_mlx_rejects() {
    let _g = lock();
    let q = make_weights(1100, 8, 128, 32, 4, Dtype::Float32);
    let x = make_x(1100, &[1, 96], Dtype::Float32);
    let err = kernels::quantized_matmul(&x, &q.w, &q.scales, &q.biases, 32, 4);
    assert!(err.is_err(), "K mismatch must be an error");
    let err = kernels::quantized_matmul(&make_x(1, &[1, 128], Dtype::Float32), &q.w, &q.scales, &q.biases, 64, 4);
    assert!(err.is_err(), "group mismatch must be an error");
    // Integer activations: whatever MLX does (it promotes them), we do too.
    let xi = Array::from_slice(&[1i32; 128], &[1, 128]).unwrap();
    let ours = kernels::quantized_matmul(&xi, &q.w, &q.scales, &q.biases, 32, 4).and_then(|a| to_f32_checked(&a));
    let mlx = quantized_matmul(&xi, &q.w, &q.scales, &q.biases, true, 32, 4).and_then(|a| to_f32_checked(&a));
    assert_eq!(ours.is_ok(), mlx.is_ok());
    if let (Ok(a), Ok(b)) = (ours, mlx) {
        assert_eq!(a, b);
    }
}

#[test]
fn repeated_calls_across_idle_gaps() {
    let _g = lock();
    // Exercises the pool's spin, sleep and wake paths and the reuse of its
    // per-thread buffers across calls of different shapes.
    let qa = make_weights(1200, 1536, 576, 32, 4, Dtype::Float16);
    let qb = make_weights(1201, 576, 1536, 32, 8, Dtype::Float32);
    let xa = make_x(1200, &[1, 576], Dtype::Float32);
    let xb = make_x(1201, &[1, 1536], Dtype::Float32);
    let (ea, ma) = reference_for(KernelPath::Auto, &xa, &qa, 32, 4);
    let (eb, mb) = reference_for(KernelPath::Auto, &xb, &qb, 32, 8);
    for i in 0..60 {
        let ya = kernels::quantized_matmul(&xa, &qa.w, &qa.scales, &qa.biases, 32, 4).unwrap();
        let yb = kernels::quantized_matmul(&xb, &qb.w, &qb.scales, &qb.biases, 32, 8).unwrap();
        check("a", &ya, &ea, &ma);
        check("b", &yb, &eb, &mb);
        if i % 10 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    // And a chain inside one graph: y = W2 · (W1 · x).
    let y1 = kernels::quantized_matmul(&xb, &qb.w, &qb.scales, &qb.biases, 32, 8).unwrap();
    let y2 = kernels::quantized_matmul(&y1, &qa.w, &qa.scales, &qa.biases, 32, 4).unwrap();
    let r1 = quantized_matmul(&xb, &qb.w, &qb.scales, &qb.biases, true, 32, 8).unwrap();
    let r2 = quantized_matmul(&r1, &qa.w, &qa.scales, &qa.biases, true, 32, 4).unwrap();
    let (_, mag) = reference_for(KernelPath::Auto, &y1, &qa, 32, 4);
    for ((a, b), m) in to_f32(&y2).iter().zip(to_f32(&r2)).zip(mag) {
        assert!(((a - b).abs() as f64) <= 1e-4 * m, "{a} vs {b}");
    }
    let _ = (f16::ZERO, bf16::ZERO);
}

#[test]
fn quantized_embedding_matches_mlx_gather_and_dequantize() {
    let _g = lock();
    for (bits, group) in [(2, 32), (3, 32), (4, 32), (4, 64), (5, 32), (6, 64), (8, 32), (8, 128)] {
        let (vocab, k) = (37, 256);
        let key = random::key(1300 + bits as u64).unwrap();
        let wf = random::normal(&[vocab, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
        let Ok((w, s, b)) = quantize(&wf, group, bits).and_then(|t| t.0.eval().map(|_| t)) else {
            eprintln!("MLX does not quantize bits={bits} group={group}; skipped");
            continue;
        };
        for sdtype in [Dtype::Float32, Dtype::Float16, Dtype::Bfloat16] {
            let (s, b) = (s.astype(sdtype).unwrap(), b.astype(sdtype).unwrap());
            for (ids, shape) in [(&[5i32][..], &[1, 1][..]), (&[0, 36, 7, 7, 12, 1], &[2, 3])] {
                let ids = Array::from_slice(ids, shape).unwrap();
                // The reference dequantizes in f32 (MLX would round scale * q
                // + bias to the scales' dtype; we round once, to `out`).
                let rows = |a: &Array| a.take(&ids, 0).unwrap();
                let f32_rows = |a: &Array| rows(&a.astype(Dtype::Float32).unwrap());
                let want = mlx_sys::dequantize(&rows(&w), &f32_rows(&s), &f32_rows(&b), group, bits).unwrap();
                for out in [Dtype::Float32, Dtype::Bfloat16] {
                    let got = kernels::quantized_embedding(&ids, &w, &s, &b, group, bits, out).unwrap();
                    let label = format!("bits={bits} group={group} scales={sdtype} out={out} ids={shape:?}");
                    assert!(kernels::is_kernel_node(&got), "{label}");
                    assert_eq!(got.dtype(), out, "{label}");
                    let mut want_shape = shape.to_vec();
                    want_shape.push(k);
                    assert_eq!(got.shape(), want_shape, "{label}");
                    let tol = if out == Dtype::Bfloat16 { 2f32.powi(-8) } else { 1e-6 };
                    for (i, (g, e)) in to_f32(&got).iter().zip(to_f32(&want)).enumerate() {
                        assert!((g - e).abs() <= tol * e.abs().max(1.0), "{label}: element {i}: {g} vs {e}");
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_embedding_out_of_range_ids_give_zero_rows_and_bad_input_errors() {
    let _g = lock();
    let q = make_weights(1400, 8, 64, 32, 4, Dtype::Float32);
    let ids = Array::from_slice(&[-1i32, 8, 3], &[3]).unwrap();
    let got = to_f32(&kernels::quantized_embedding(&ids, &q.w, &q.scales, &q.biases, 32, 4, Dtype::Float32).unwrap());
    assert!(got[..128].iter().all(|&v| v == 0.0), "ids -1 and 8 are outside a table of 8 rows");
    assert!(got[128..].iter().any(|&v| v != 0.0));
    let float_ids = Array::from_slice(&[1.0f32], &[1]).unwrap();
    let err = kernels::quantized_embedding(&float_ids, &q.w, &q.scales, &q.biases, 32, 4, Dtype::Float32).unwrap_err();
    assert!(err.to_string().contains("ids must be integers"), "{err}");
    let err = kernels::quantized_embedding(&ids, &q.w, &q.scales, &q.biases, 64, 4, Dtype::Float32).unwrap_err();
    assert!(err.to_string().contains("words per row"), "{err}");
    let err = kernels::quantized_embedding(&ids, &q.w, &q.scales, &q.biases, 32, 4, Dtype::Int32).unwrap_err();
    assert!(err.to_string().contains("output dtype"), "{err}");
}

#[test]
fn half_precision_scales_on_partial_chunks() {
    let _g = lock();
    // Rows whose last SIMD chunk is partial, so the loops read fewer groups
    // of scales and biases than a chunk spans (the integer AVX2 loop reads
    // f16/bf16 scales in place there).
    for sdt in [Dtype::Float16, Dtype::Bfloat16] {
        for bits in [2, 4, 8] {
            for k in [32, 96, 160] {
                run_case(600 + bits as u64 + k as u64, bits, 32, k, 13, &[3], Dtype::Float32, sdt, &ALL_PATHS);
            }
        }
    }
}

/// GELU (erf) on every loop against an f64 GELU: erf by Abramowitz & Stegun
/// 7.1.26 is within 1.5e-7, so |ours - exact| <= 0.5·|x|·1.5e-7 plus a few
/// f32 roundings of the result: the bound is 1e-7·|x| + 2^-22·|y| + 1e-30.
/// Lengths around the vector widths (1, 7, 8, 15, 16, 17) and past the
/// threading chunk (16 Ki), values over [-12, 12] with ±0 and far tails.
#[test]
fn gelu_erf_matches_an_f64_reference_on_every_path() {
    let _g = lock();
    // erf in f64 (W. J. Cody's rational approximations would do; this
    // series/continued fraction pair is exact to ~1e-15 on the range used).
    fn erf64(x: f64) -> f64 {
        let a = x.abs();
        let r = if a < 2.5 {
            // Maclaurin series: 2/sqrt(pi) Σ (-1)^n x^(2n+1) / (n! (2n+1)).
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc continued fraction (Lentz), 60 terms.
            let mut f = 0.0;
            for k in (1..60).rev() {
                f = (k as f64 / 2.0) / (a + f);
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f)
        };
        r.copysign(x)
    }
    for &n in &[1usize, 7, 8, 15, 16, 17, 33, 100, 16384 * 2 + 5] {
        let values: Vec<f32> = (0..n)
            .map(|i| match i % 11 {
                0 => 0.0,
                1 => -0.0,
                2 => 40.0 * if i % 2 == 0 { 1.0 } else { -1.0 },
                _ => ((i as f32 * 0.618_034).fract() - 0.5) * 24.0,
            })
            .collect();
        let x = Array::from_slice(&values, &[n as i32]).unwrap();
        for path in [KernelPath::Auto, KernelPath::Portable, KernelPath::Avx2, KernelPath::Avx512] {
            let got: Vec<f32> = kernels::gelu_erf_with_path(&x, path).unwrap().to_vec().unwrap();
            for (&v, &y) in values.iter().zip(&got) {
                let exact = 0.5 * v as f64 * (1.0 + erf64(v as f64 / std::f64::consts::SQRT_2));
                let bound = 1e-7 * (v as f64).abs() + 2f64.powi(-22) * exact.abs() + 1e-30;
                assert!((y as f64 - exact).abs() <= bound, "{path:?} n={n}: gelu({v}) = {y}, exact {exact}");
            }
        }
    }
    // Other dtypes run MLX's ops.
    let half = Array::from_slice(&[1.0f32, -2.0], &[2]).unwrap().astype(Dtype::Float16).unwrap();
    let got: Vec<f32> = kernels::gelu_erf(&half).unwrap().astype(Dtype::Float32).unwrap().to_vec().unwrap();
    assert!((got[0] - 0.8413).abs() < 1e-3 && (got[1] + 0.0455).abs() < 1e-3, "{got:?}");
}

/// Whether this process makes copies (`kernels::vnni_rows`) for the layout:
/// where its own loop reads them (VNNI and AVX2 integer: bits 4 and 8).
fn copies_made(bits: usize, group: usize, n: i32) -> bool {
    let auto = kernels::path_name(KernelPath::Auto);
    uses_vnni(KernelPath::Auto, bits, group)
        && (auto == "avx512-vnni" || (auto == "avx2-int8" && (bits == 4 || bits == 8)))
        && n >= 16
        && std::env::var("MLXCEL_REPACK").as_deref() != Ok("0")
}

/// A weight's copy, where this process makes one: the VNNI loop gives the
/// same result bit for bit as the weight read in place (on AMD CPUs the
/// AVX-512 int16 loop reads it instead: the AVX2 block loop's bits); the
/// AVX2 integer loop for bits 4 and 8 (forced on AVX-512 machines too,
/// reading the same copy)
/// meets the quantized-activation bound, each row the same bit for bit
/// whatever the other rows. Every row count a decode or a draft verification
/// takes, with a last block of fewer than 16 rows.
#[test]
fn vnni_rows_copy_gives_the_same_result() {
    let _g = lock();
    for (seed, n, k, group, bits, sdtype) in [
        (81, 200, 576, 32, 8, Dtype::Float16),
        (82, 72, 256, 64, 4, Dtype::Float32),
        (83, 16, 128, 32, 4, Dtype::Bfloat16),
        (84, 8, 128, 32, 8, Dtype::Float16),
        (89, 40, 96, 32, 8, Dtype::Bfloat16),
        (90, 48, 640, 128, 8, Dtype::Float32),
        (91, 33, 192, 64, 8, Dtype::Float16),
    ] {
        let q = make_weights(seed, n, k, group, bits, sdtype);
        let rows = kernels::vnni_rows(&q.w, &q.scales, &q.biases, group, bits).unwrap();
        assert_eq!(rows.is_some(), copies_made(bits as usize, group as usize, n), "seed {seed}: a copy exactly where this process's loop reads it");
        let Some(rows) = rows else { continue };
        assert_eq!(rows.size(), (n as usize / 16) * (16 * k as usize * bits as usize / 8 + 2 * 16 * (k / group) as usize * if sdtype == Dtype::Float32 { 4 } else { 2 }));
        let avx2 = kernels::path_name(KernelPath::Avx2Int8) == "avx2-int8" && (bits == 4 || bits == 8);
        for m in [1, 2, 3, 5, 9] {
            let x = make_x(seed ^ m as u64, &[m, k], Dtype::Float32);
            match kernels::copy_loop_name(KernelPath::Auto, bits).as_str() {
                "avx512-vnni" => {
                    let plain = kernels::quantized_matmul(&x, &q.w, &q.scales, &q.biases, group, bits).unwrap();
                    let copied = kernels::quantized_matmul_with_vnni_rows(&x, &q.w, &q.scales, &q.biases, group, bits, &rows).unwrap();
                    assert_eq!(to_f32(&copied), to_f32(&plain), "seed {seed}, {m} rows: the copy changed the result");
                }
                "avx512-int16" => {
                    // The AVX2 block loop's arithmetic with 16 rows per vector:
                    // the same bits (its own bound and row independence are
                    // checked below).
                    let copied = kernels::quantized_matmul_with_vnni_rows(&x, &q.w, &q.scales, &q.biases, group, bits, &rows).unwrap();
                    let label = format!("seed {seed}, {m} rows, AVX-512 int16 loop on the copy");
                    let (exact, mag) = reference_quantized_x(&x, &q, group as usize, bits as usize);
                    check(&label, &copied, &exact, &mag);
                    let avx2 = kernels::quantized_matmul_with_vnni_rows_on_path(&x, &q.w, &q.scales, &q.biases, group, bits, KernelPath::Avx2Int8, &rows).unwrap();
                    assert_eq!(to_f32(&copied), to_f32(&avx2), "{label}: differs from the AVX2 block loop");
                }
                _ => {}
            }
            if avx2 {
                let label = format!("seed {seed}, {m} rows, AVX2 integer loop on the copy");
                let got = kernels::quantized_matmul_with_vnni_rows_on_path(&x, &q.w, &q.scales, &q.biases, group, bits, KernelPath::Avx2Int8, &rows).unwrap();
                let (exact, mag) = reference_quantized_x(&x, &q, group as usize, bits as usize);
                check(&label, &got, &exact, &mag);
                let got = to_f32(&got);
                for r in 0..m as usize {
                    let row = x.slice(&[r as i32, 0], &[r as i32 + 1, k], &[1, 1]).unwrap();
                    let one = kernels::quantized_matmul_with_vnni_rows_on_path(&row, &q.w, &q.scales, &q.biases, group, bits, KernelPath::Avx2Int8, &rows).unwrap();
                    assert_eq!(&got[r * n as usize..(r + 1) * n as usize], &to_f32(&one)[..], "{label}: row {r} depends on the other rows");
                }
            }
        }
    }
    // A copy of another weight's size is refused, not misread.
    let q = make_weights(85, 32, 128, 32, 4, Dtype::Float16);
    let other = make_weights(86, 48, 128, 32, 4, Dtype::Float16);
    if let Some(rows) = kernels::vnni_rows(&other.w, &other.scales, &other.biases, 32, 4).unwrap() {
        let x = make_x(87, &[1, 128], Dtype::Float32);
        let plain = kernels::quantized_matmul(&x, &q.w, &q.scales, &q.biases, 32, 4).unwrap();
        let mismatched = kernels::quantized_matmul_with_vnni_rows(&x, &q.w, &q.scales, &q.biases, 32, 4, &rows).unwrap();
        assert_eq!(to_f32(&mismatched), to_f32(&plain), "a copy that does not fit the weight is not read");
        // One that fits is read: another weight's copy of the same shape
        // gives that weight's rows.
        let same_shape = make_weights(88, 32, 128, 32, 4, Dtype::Float16);
        let its_copy = kernels::vnni_rows(&same_shape.w, &same_shape.scales, &same_shape.biases, 32, 4).unwrap().unwrap();
        let read = kernels::quantized_matmul_with_vnni_rows(&x, &q.w, &q.scales, &q.biases, 32, 4, &its_copy).unwrap();
        let theirs = kernels::quantized_matmul(&x, &same_shape.w, &same_shape.scales, &same_shape.biases, 32, 4).unwrap();
        assert_eq!(to_f32(&read), to_f32(&theirs), "the copy passed is the one read");
    }
}
