//! `kernels::decoder_layer` (one fused pre-norm decoder block as a single
//! MLX node) against the same block composed of MLX's own ops:
//! `quantized_matmul` (transpose = true) for every projection,
//! `fast::rms_norm`, `fast::rope` at the cache offset,
//! `fast::scaled_dot_product_attention` over cache positions
//! `0..offset + L` (causal when L > 1), silu and the residual adds.
//!
//! Every case is checked against two references that differ only in the
//! projections: (1) MLX's own `quantized_matmul`, exact f32 dequantization;
//! (2) our `kernels::quantized_matmul`, the loops the fused block runs.
//!
//! Tolerances, max|got - ref| <= tol · max|ref| over each whole tensor
//! (`tol()`):
//! - exact kernel paths (portable, AVX2, AVX-512; and bit widths other than
//!   4 and 8 on any path): 1e-5. Both sides compute the same f32 formulas
//!   and differ only in summation order and MLX's vectorized exp/sin/cos; we
//!   measure <= 1.3e-6 vs MLX's matmul.
//! - AVX-512 VNNI (the default on CPUs that have it, bits 4 and 8): 5e-4.
//!   That path quantizes each group of activations to 16 bits; per
//!   projection we measure up to ~9e-5 of max|y| (3.6e-5 of Σ|x||w|, the
//!   per-group sums of x being taken from the unquantized x), and seven
//!   projections, attention and the residuals compound it: up to ~1.5e-4
//!   of max|ref| per block.
//! - the AVX2 integer path (bits 2, 4, 8): 5e-4 below 16 new tokens, as
//!   VNNI; from 16 on the block's projections run on the GEMM's panels:
//!   exact f32 for bits 2 and 4 (against MLX's matmul: 1e-5; against our
//!   matvec loops, which the kernel reference still runs: 5e-4), the
//!   integer loop with x quantized as the matvec quantizes it for bits 8
//!   (5e-4).
//! - plus end · max(rope_scale, 1) · 2^-23 for the RoPE angles of far
//!   positions (1.8e-4 at position 1503, where we measure 1.5e-5).
//! A real bug (wrong head, row, position, rotation, mask) moves the result
//! by ~1e-1 of max|ref|. Cache rows below `offset` are compared bit for bit.
//!
//! `exact_kernel_paths_in_subprocesses` reruns this file with
//! `MLXCEL_KERNELS=avx512|avx2|portable` (the variable is read once per
//! process), so both the VNNI default and the exact loops are covered on a
//! VNNI machine.

use std::sync::Mutex;

use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::kernels::{self, DecoderLayerSpec, DecoderLayerWeights, KernelPath, QuantizedProjection};
use mlx_sys::{quantize, quantized_matmul, random, Array, Dtype};

/// MLX evaluation is not meant to run from several threads at once (and the
/// memory counters of the donation test are process-wide).
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the kernels' default path quantizes activations for `bits` in a
/// block of `rows` new tokens (the integer loops: AVX-512 VNNI for bits 4
/// and 8, AVX2 and NEON for 2, 4 and 8). From 16 rows on, the AVX2 integer
/// path runs its projections on the GEMM's panels instead: exact f32 for
/// bits 2 and 4, its integer loop for bits 8.
fn activations_quantized(bits: i32, rows: i32) -> bool {
    match kernels::path_name(KernelPath::Auto).as_str() {
        "avx512-vnni" => bits == 4 || bits == 8,
        "neon-int8" => matches!(bits, 2 | 4 | 8),
        "avx2-int8" => matches!(bits, 2 | 4 | 8) && (rows < 16 || bits == 8),
        _ => false,
    }
}

/// Relative tolerance (of max|ref|) for a step of `layer` ending at position
/// `end` (see the module docs). The same for both references: on the VNNI
/// path the activation quantization is discontinuous, so a last-ulp
/// difference upstream (MLX's attention vs ours) can flip a rounding of the
/// o_proj or MLP inputs even against our own matmul.
fn tol(layer: &Layer, end: i32, rows: i32) -> f64 {
    let base = if activations_quantized(layer.bits, rows) { 5e-4 } else { 1e-5 };
    // RoPE angles are position · scale · inv_freq, rounded to f32, so sin and
    // cos of far positions differ by up to ~angle · eps between any two f32
    // implementations.
    base + end as f64 * layer.spec.rope_scale.max(1.0) as f64 * f32::EPSILON as f64
}

/// Which quantized matmul a reference runs.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Matmul {
    Mlx,
    Kernel,
}

fn to_f32(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn randn(seed: u64, shape: &[i32], std: f32) -> Array {
    let key = random::key(seed).unwrap();
    let a = random::normal(shape, Dtype::Float32, 0.0, std, &key).unwrap();
    a.eval().unwrap();
    a
}

/// An evaluated copy of `a` in a buffer of its own (so that handing the
/// original to the kernel leaves it the only holder of its buffer).
fn detached_copy(a: &Array) -> Array {
    let c = Array::from_slice(&to_f32(a), &a.shape()).unwrap();
    c.eval().unwrap();
    c
}

// ---------------------------------------------------------------------------
// A random layer.

#[derive(Clone)]
struct Proj {
    w: Array,
    scales: Array,
    biases: Array,
    group: i32,
    bits: i32,
    /// Added to the output.
    bias: Option<Array>,
}

impl Proj {
    fn new(seed: u64, n: i32, k: i32, group: i32, bits: i32, sdtype: Dtype) -> Proj {
        let wf = randn(seed, &[n, k], 1.0 / (k as f32).sqrt());
        let (w, scales, biases) = quantize(&wf, group, bits).unwrap();
        let scales = scales.astype(sdtype).unwrap();
        let biases = biases.astype(sdtype).unwrap();
        mlx_sys::eval([&w, &scales, &biases]).unwrap();
        Proj { w, scales, biases, group, bits, bias: None }
    }

    fn apply(&self, x: &Array, mm: Matmul) -> Array {
        let y = match mm {
            Matmul::Mlx => quantized_matmul(x, &self.w, &self.scales, &self.biases, true, self.group, self.bits),
            Matmul::Kernel => kernels::quantized_matmul(x, &self.w, &self.scales, &self.biases, self.group, self.bits),
        };
        let y = y.unwrap().astype(Dtype::Float32).unwrap();
        match &self.bias {
            Some(b) => y.add(b).unwrap(),
            None => y,
        }
    }

    fn projection(&self) -> QuantizedProjection {
        QuantizedProjection {
            weight: self.w.clone(),
            scales: self.scales.clone(),
            biases: self.biases.clone(),
            bias: self.bias.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Config {
    hidden: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    intermediate: i32,
    group: i32,
    bits: i32,
    sdtype: Dtype,
    /// 0: head_dim.
    rope_dims: i32,
    rope_base: f32,
    rope_scale: f32,
    rope_traditional: bool,
    rope_freqs: bool,
    qkv_bias: bool,
    o_bias: bool,
    mlp_bias: bool,
    qk_norm: bool,
}

/// hidden 64, heads 4, kv_heads 2, head_dim 16, intermediate 96, 4-bit group 32.
const LLAMA: Config = Config {
    hidden: 64,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    intermediate: 96,
    group: 32,
    bits: 4,
    sdtype: Dtype::Float32,
    rope_dims: 0,
    rope_base: 10000.0,
    rope_scale: 1.0,
    rope_traditional: false,
    rope_freqs: false,
    qkv_bias: false,
    o_bias: false,
    mlp_bias: false,
    qk_norm: false,
};

#[derive(Clone)]
struct Layer {
    spec: DecoderLayerSpec,
    bits: i32,
    /// `spec.cache_in_place` of every step (false unless a test sets it).
    in_place: bool,
    input_norm: Array,
    post_norm: Array,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    gate: Proj,
    up: Proj,
    down: Proj,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
    freqs: Option<Array>,
}

impl Layer {
    fn new(seed: u64, c: Config) -> Layer {
        let (h, d, i) = (c.hidden, c.head_dim, c.intermediate);
        let (qn, kvn) = (c.heads * d, c.kv_heads * d);
        let rope_dims = if c.rope_dims == 0 { d } else { c.rope_dims };
        let bias = |n: u64, size: i32| randn(seed * 100 + n, &[size], 0.3);
        // Projection n (bias seed n + 10 when `biased`).
        let proj = |n: u64, rows: i32, cols: i32, biased: bool| Proj {
            bias: biased.then(|| bias(n + 10, rows)),
            ..Proj::new(seed * 100 + n, rows, cols, c.group, c.bits, c.sdtype)
        };
        let norm = |n: u64, size: i32| randn(seed * 100 + n, &[size], 0.2).add_scalar(1.0).unwrap();
        let freqs = c.rope_freqs.then(|| {
            // Periods as llama3 scaling produces them: base^(2i/dims), the
            // low-frequency half stretched by 8.
            let half = rope_dims / 2;
            let f: Vec<f32> = (0..half)
                .map(|j| {
                    let p = c.rope_base.powf(2.0 * j as f32 / rope_dims as f32);
                    if j >= half / 2 {
                        p * 8.0
                    } else {
                        p
                    }
                })
                .collect();
            let a = Array::from_slice(&f, &[half]).unwrap();
            a.eval().unwrap();
            a
        });
        let layer = Layer {
            bits: c.bits,
            in_place: false,
            spec: DecoderLayerSpec {
                hidden: h,
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: d,
                intermediate: i,
                offset: 0,
                norm_eps: 1e-5,
                rope_dims,
                rope_base: c.rope_base,
                rope_scale: c.rope_scale,
                rope_traditional: c.rope_traditional,
                rope_mscale: 1.0,
                attn_scale: (d as f32).powf(-0.5),
                cache_in_place: false,
                kv_window: 0,
                kv_keep: 0,
                kv_layer: 0,
                activation: 0,
                experts: 0,
                top_k: 0,
                routing: 0,
            },
            input_norm: norm(1, h),
            post_norm: norm(2, h),
            q: proj(3, qn, h, c.qkv_bias),
            k: proj(4, kvn, h, c.qkv_bias),
            v: proj(5, kvn, h, c.qkv_bias),
            o: proj(6, h, qn, c.o_bias),
            gate: proj(7, i, h, c.mlp_bias),
            up: proj(8, i, h, c.mlp_bias),
            down: proj(9, h, i, c.mlp_bias),
            q_norm: c.qk_norm.then(|| norm(27, d)),
            k_norm: c.qk_norm.then(|| norm(28, d)),
            freqs,
        };
        let all: Vec<&Array> = [&layer.input_norm, &layer.post_norm]
            .into_iter()
            .chain(layer.projs().into_iter().filter_map(|p| p.bias.as_ref()))
            .chain(layer.q_norm.iter())
            .chain(layer.k_norm.iter())
            .collect();
        mlx_sys::eval(all).unwrap();
        layer
    }

    fn spec(&self, offset: i32) -> DecoderLayerSpec {
        DecoderLayerSpec { offset, cache_in_place: self.in_place, ..self.spec }
    }

    fn projs(&self) -> [&Proj; 7] {
        [&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down]
    }

    /// The kernel's weights.
    fn weights(&self) -> DecoderLayerWeights {
        DecoderLayerWeights {
            input_norm: self.input_norm.clone(),
            q_proj: self.q.projection(),
            k_proj: self.k.projection(),
            v_proj: self.v.projection(),
            o_proj: self.o.projection(),
            post_attention_norm: self.post_norm.clone(),
            gate_proj: self.gate.projection(),
            up_proj: self.up.projection(),
            down_proj: self.down.projection(),
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            rope_freqs: self.freqs.clone(),
            attn_out_norm: None,
            mlp_out_norm: None,
            router: None,
        }
    }

    /// One kernel step; takes the caches by value so that the caller can
    /// give up its references (the node then holds the only ones).
    fn run(&self, x: &Array, keys: Array, values: Array, offset: i32) -> mlx_sys::Result<(Array, Array, Array)> {
        kernels::decoder_layer(x, &self.weights(), &keys, &values, &self.spec(offset))
    }

    /// The block from MLX ops: (out, keys, values), the caches with
    /// positions offset..offset+L replaced.
    fn reference(&self, x: &Array, keys: &Array, values: &Array, offset: i32, mm: Matmul) -> (Array, Array, Array) {
        let s = &self.spec;
        let (l, d) = (x.dim(1), s.head_dim);
        let eps = s.norm_eps;
        let n1 = fast::rms_norm(x, Some(&self.input_norm), eps).unwrap();
        let (q, k, v) = (self.q.apply(&n1, mm), self.k.apply(&n1, mm), self.v.apply(&n1, mm));
        let heads = |y: Array, n: i32, norm: Option<&Array>| -> Array {
            let y = y.reshape(&[1, l, n, d]).unwrap();
            let y = match norm {
                Some(w) => fast::rms_norm(&y, Some(w), eps).unwrap(),
                None => y,
            };
            y.transpose(&[0, 2, 1, 3]).unwrap()
        };
        let q = heads(q, s.heads, self.q_norm.as_ref());
        let k = heads(k, s.kv_heads, self.k_norm.as_ref());
        let v = heads(v, s.kv_heads, None);
        let base = if self.freqs.is_some() { 0.0 } else { s.rope_base };
        let rope = |t: &Array| {
            fast::rope(t, s.rope_dims, s.rope_traditional, base, s.rope_scale, offset, self.freqs.as_ref()).unwrap()
        };
        let (q, k) = (rope(&q), rope(&k));
        let end = offset + l;
        let write = |cache: &Array, new: &Array| {
            cache.slice_update(new, &[0, 0, offset, 0], &[1, s.kv_heads, end, d], &[1, 1, 1, 1]).unwrap()
        };
        let (keys, values) = (write(keys, &k), write(values, &v));
        // A sliding window as an additive mask: query i (position offset + i)
        // sees 0..keep and offset + i + 1 - window..=offset + i.
        let window_mask = (s.kv_window > 0).then(|| {
            let seen = kernels::KvWindow { window: s.kv_window, keep: s.kv_keep };
            let mask: Vec<f32> = (0..l)
                .flat_map(|i| {
                    let p = (offset + i) as usize;
                    (0..end as usize).map(move |t| {
                        let visible = t <= p && (t < seen.keep as usize || t >= seen.first_recent(p));
                        if visible { 0.0 } else { f32::NEG_INFINITY }
                    })
                })
                .collect();
            Array::from_slice(&mask, &[l, end]).unwrap()
        });
        let mask = match &window_mask {
            Some(m) => AttentionMask::Array(m),
            None if l > 1 => AttentionMask::Causal,
            None => AttentionMask::None,
        };
        let att = fast::scaled_dot_product_attention(
            &q,
            &keys.slice_axis(2, 0, end).unwrap(),
            &values.slice_axis(2, 0, end).unwrap(),
            s.attn_scale,
            mask,
        )
        .unwrap();
        let att = att.transpose(&[0, 2, 1, 3]).unwrap().reshape(&[1, l, s.heads * d]).unwrap();
        let h = x.add(&self.o.apply(&att, mm)).unwrap();
        let n2 = fast::rms_norm(&h, Some(&self.post_norm), eps).unwrap();
        let (g, u) = (self.gate.apply(&n2, mm), self.up.apply(&n2, mm));
        let down = self.down.apply(&g.silu().unwrap().multiply(&u).unwrap(), mm);
        let out = h.add(&down).unwrap();
        mlx_sys::eval([&out, &keys, &values]).unwrap();
        (out, keys, values)
    }
}

// ---------------------------------------------------------------------------
// Comparisons.

/// max|got - want| / max|want|, asserting shapes, finiteness and `tol`.
fn compare(label: &str, got: &Array, want: &Array, tol: f64) -> f64 {
    assert_eq!(got.shape(), want.shape(), "{label}: shape");
    assert_eq!(got.dtype(), Dtype::Float32, "{label}: dtype");
    let (g, w) = (to_f32(got), to_f32(want));
    let scale = w.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    let mut worst = (0f64, 0usize);
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        assert!(a.is_finite(), "{label}: element {i} is {a}");
        let e = (a as f64 - b as f64).abs();
        if e > worst.0 {
            worst = (e, i);
        }
    }
    let (err, at) = worst;
    assert!(
        err <= tol * scale,
        "{label}: max|Δ| {err:.3e} at element {at} (got {}, want {}) > {tol:e} · max|ref| {scale:.3e}",
        g[at],
        w[at]
    );
    err / scale.max(1e-30)
}

/// Positions `0..upto` of a [1, H, capacity, D] cache.
fn rows(cache: &Array, upto: i32) -> Array {
    cache.slice_axis(2, 0, upto).unwrap()
}

/// The kernel's caches must hold `old` bit for bit below `offset` and the
/// reference's new rows at offset..end. Returns the relative error of the
/// new rows.
fn compare_cache(label: &str, got: &Array, want: &Array, old: &Array, offset: i32, end: i32, tol: f64) -> f64 {
    assert_eq!(got.shape(), old.shape(), "{label}: cache shape");
    if offset > 0 {
        assert_eq!(to_f32(&rows(got, offset)), to_f32(&rows(old, offset)), "{label}: cached prefix changed");
    }
    compare(label, &got.slice_axis(2, offset, end).unwrap(), &want.slice_axis(2, offset, end).unwrap(), tol)
}

#[derive(Default)]
struct Errors {
    out: f64,
    keys: f64,
    values: f64,
}

impl Errors {
    fn max(&self) -> f64 {
        self.out.max(self.keys).max(self.values)
    }
}

impl std::fmt::Display for Errors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "out {:.2e}, keys {:.2e}, values {:.2e}", self.out, self.keys, self.values)
    }
}

/// Checks the kernel's (out, keys, values) for a step from caches
/// `old_keys`/`old_values` against both references; returns the errors vs
/// MLX's matmul and vs our matmul.
#[allow(clippy::too_many_arguments)]
fn check_outputs(
    label: &str,
    layer: &Layer,
    x: &Array,
    old_keys: &Array,
    old_values: &Array,
    offset: i32,
    got: [&Array; 3],
) -> (Errors, Errors) {
    let end = offset + x.dim(1);
    let mut errors = [Errors::default(), Errors::default()];
    for (e, mm) in errors.iter_mut().zip([Matmul::Mlx, Matmul::Kernel]) {
        // The kernel reference runs the matvec loops whatever the row count.
        let tol = tol(layer, end, if mm == Matmul::Kernel { 1 } else { x.dim(1) });
        let (want, want_k, want_v) = layer.reference(x, old_keys, old_values, offset, mm);
        let l = format!("{label} (vs {mm:?} matmul)");
        e.out = compare(&format!("{l}: out"), got[0], &want, tol);
        e.keys = compare_cache(&format!("{l}: keys"), got[1], &want_k, old_keys, offset, end, tol);
        e.values = compare_cache(&format!("{l}: values"), got[2], &want_v, old_values, offset, end, tol);
    }
    let [mlx, same] = errors;
    eprintln!("{label}: max|Δ|/max|ref| vs MLX matmul: {mlx}; vs kernel matmul: {same}");
    (mlx, same)
}

/// Runs the kernel for one step on (shared handles to) the caches and
/// checks it; returns the errors vs MLX's matmul and the kernel's outputs.
fn check_step(
    label: &str,
    layer: &Layer,
    x: &Array,
    keys: &Array,
    values: &Array,
    offset: i32,
) -> (Errors, [Array; 3]) {
    let (out, k, v) = layer.run(x, keys.clone(), values.clone(), offset).unwrap();
    assert!(kernels::is_kernel_node(&out), "{label}: not a kernel node");
    mlx_sys::eval([&out, &k, &v]).unwrap();
    let (errors, _) = check_outputs(label, layer, x, keys, values, offset, [&out, &k, &v]);
    (errors, [out, k, v])
}

/// A [1, kv_heads, capacity, head_dim] cache of random values.
fn random_cache(seed: u64, layer: &Layer, capacity: i32) -> Array {
    randn(seed, &[1, layer.spec.kv_heads, capacity, layer.spec.head_dim], 1.0)
}

/// One step at `offset` with `l` new tokens over random caches of `capacity`.
fn case(label: &str, seed: u64, c: Config, offset: i32, l: i32, capacity: i32) -> f64 {
    let layer = Layer::new(seed, c);
    let x = randn(seed ^ 0x5eed, &[1, l, c.hidden], 1.0);
    let keys = random_cache(seed ^ 0xe1, &layer, capacity);
    let values = random_cache(seed ^ 0xe2, &layer, capacity);
    check_step(label, &layer, &x, &keys, &values, offset).0.max()
}

// ---------------------------------------------------------------------------
// Numerics.

/// Each optional array is read from its own field: with everything enabled,
/// dropping any one (a single projection's bias, the q/k norms, the rope
/// freqs) must match the reference without it, and must change the output.
#[test]
fn each_option_is_read_from_its_field() {
    let _g = lock();
    let all = Config { qkv_bias: true, o_bias: true, mlp_bias: true, qk_norm: true, rope_freqs: true, ..LLAMA };
    let full = Layer::new(120, all);
    let x = randn(121, &[1, 2, 64], 1.0);
    let keys = random_cache(122, &full, 8);
    let values = random_cache(123, &full, 8);
    let (_, [full_out, _, _]) = check_step("every option", &full, &x, &keys, &values, 5);
    let without: [(&str, fn(&mut Layer)); 9] = [
        ("q_proj bias", |l| l.q.bias = None),
        ("k_proj bias", |l| l.k.bias = None),
        ("v_proj bias", |l| l.v.bias = None),
        ("o_proj bias", |l| l.o.bias = None),
        ("gate_proj bias", |l| l.gate.bias = None),
        ("up_proj bias", |l| l.up.bias = None),
        ("down_proj bias", |l| l.down.bias = None),
        ("q/k norms", |l| (l.q_norm, l.k_norm) = (None, None)),
        ("rope freqs", |l| l.freqs = None),
    ];
    for (name, drop_it) in without {
        let mut layer = full.clone();
        drop_it(&mut layer);
        let (_, [out, _, _]) = check_step(&format!("without {name}"), &layer, &x, &keys, &values, 5);
        let moved = compare_any(&out, &full_out);
        eprintln!("without {name}: output moved by {moved:.2e} of max|out|");
        assert!(moved > 1e-3, "without {name}: the output did not change ({moved:.2e}): the option is not read");
    }
}

/// max|a - b| / max|b|.
fn compare_any(a: &Array, b: &Array) -> f64 {
    let (a, b) = (to_f32(a), to_f32(b));
    let scale = b.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    a.iter().zip(&b).fold(0f64, |m, (&p, &q)| m.max((p as f64 - q as f64).abs())) / scale
}

/// The prepared-weights node computes the same block (bit for bit, but for
/// the AVX2 integer loop on 8-bit copies: within its bound), with x
/// and the caches as its only graph inputs, and rejects a spec whose
/// dimensions differ from the prepared ones.
#[test]
fn prepared_weights_give_the_same_block() {
    let _g = lock();
    for (seed, c, offset, l) in [
        (31, LLAMA, 5, 1),
        (32, Config { qkv_bias: true, qk_norm: true, rope_freqs: true, ..LLAMA }, 3, 3),
        (33, Config { bits: 8, group: 32, sdtype: Dtype::Float16, ..LLAMA }, 0, 2),
        // k and v of 24 rows: one full block of 16 in the VNNI copy, 8 rows
        // read in place.
        (34, Config { kv_heads: 1, head_dim: 24, ..LLAMA }, 2, 1),
        (35, Config { bits: 8, group: 32, kv_heads: 1, head_dim: 24, sdtype: Dtype::Bfloat16, ..LLAMA }, 1, 5),
        // Prompts of 16 and 20 rows: on the AVX2 integer path the prepared
        // block's weights stay on the block loop over their copies, the
        // unprepared block's go to the GEMM's panels (int16 for 8 bits,
        // exact f32 for 4).
        (36, Config { bits: 8, group: 32, sdtype: Dtype::Float16, ..LLAMA }, 2, 16),
        (37, LLAMA, 1, 20),
    ] {
        let layer = Layer::new(seed, c);
        let x = randn(seed ^ 0x5eed, &[1, l, c.hidden], 1.0);
        let keys = random_cache(seed ^ 0xe1, &layer, offset + 2 * l + 1);
        let values = random_cache(seed ^ 0xe2, &layer, offset + 2 * l + 1);
        let spec = layer.spec(offset);
        let copies_before = kernels::vnni_rows_bytes();
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        // The prepared block streams its own copies where the loop reads them
        // (VNNI; AVX2 integer for bits 4 and 8), compared with the unprepared
        // block below, which has none: bit for bit on VNNI; the int16 loops
        // (AVX2, and AVX-512 on AMD) sum a copy's groups in one lane, which
        // rounds differently (the same bound).
        let copy_loop = kernels::copy_loop_name(kernels::KernelPath::Auto, c.bits);
        let int16_copies = copy_loop.ends_with("-int16");
        if !copy_loop.is_empty() && std::env::var("MLXCEL_REPACK").as_deref() != Ok("0") {
            assert!(kernels::vnni_rows_bytes() > copies_before, "seed {seed}: no copies were made");
        }
        let same = |name: &str, a: &Array, b: &Array| {
            if int16_copies {
                // 1e-4 where both quantize x, else the quantized bound.
                let bound = if activations_quantized(c.bits, l) { 1e-4 } else { 5e-4 };
                let moved = compare_any(a, b);
                assert!(moved <= bound, "seed {seed}: {name} moved by {moved:.2e} of its max from the unprepared block");
            } else {
                assert_eq!(to_f32(a), to_f32(b), "seed {seed}: {name} differs from the unprepared block");
            }
        };
        let direct = kernels::decoder_layer(&x, &layer.weights(), &detached_copy(&keys), &detached_copy(&values), &spec).unwrap();
        let (out, k, v) = prepared.forward(&x, &detached_copy(&keys), &detached_copy(&values), &spec).unwrap();
        assert_eq!(kernels::array_inputs(&out), 3, "seed {seed}: x, keys and values are the only inputs");
        // Cache positions from offset + l on are unspecified (see DecoderLayerSpec).
        let end = offset + l;
        for (name, a, b) in [
            ("out", out.clone(), direct.0.clone()),
            ("keys", rows(&k, end), rows(&direct.1, end)),
            ("values", rows(&v, end), rows(&direct.2, end)),
        ] {
            same(name, &a, &b);
        }
        // The same prepared weights serve a later step (another offset).
        let later = layer.spec(offset + l);
        let again = prepared.forward(&x, &k, &v, &later).unwrap();
        let reference = kernels::decoder_layer(&x, &layer.weights(), &k, &v, &later).unwrap();
        same("the next step", &again.0, &reference.0);
        let wrong = DecoderLayerSpec { intermediate: spec.intermediate + 1, ..spec };
        let err = prepared.forward(&x, &keys, &values, &wrong).err().expect("a dimension mismatch is an error");
        assert!(err.to_string().contains("dimensions differ"), "{err}");
    }
}

#[test]
fn llama_decode_at_offset_0() {
    let _g = lock();
    case("llama L=1 offset=0", 1, LLAMA, 0, 1, 8);
    case("llama L=1 offset=0 f16 scales", 2, Config { sdtype: Dtype::Float16, ..LLAMA }, 0, 1, 1);
}

#[test]
fn llama_decode_at_offset_5() {
    let _g = lock();
    case("llama L=1 offset=5", 3, LLAMA, 5, 1, 8);
    case("llama L=1 offset=5 f16 scales", 4, Config { sdtype: Dtype::Float16, ..LLAMA }, 5, 1, 6);
    case("llama L=1 offset=5 bf16 scales", 5, Config { sdtype: Dtype::Bfloat16, ..LLAMA }, 5, 1, 16);
}

#[test]
fn llama_three_new_tokens_at_offset_5_causal() {
    let _g = lock();
    case("llama L=3 offset=5", 6, LLAMA, 5, 3, 8);
    case("llama L=3 offset=5 f16 scales", 7, Config { sdtype: Dtype::Float16, ..LLAMA }, 5, 3, 12);
    case("llama L=3 offset=0", 8, LLAMA, 0, 3, 3);
    case("llama L=8 offset=2", 9, LLAMA, 2, 8, 16);
}

#[test]
fn eight_bit_group_64_hidden_128() {
    let _g = lock();
    let c = Config { hidden: 128, heads: 8, kv_heads: 2, head_dim: 16, intermediate: 192, group: 64, bits: 8, ..LLAMA };
    case("8-bit g64 H=128 L=1 offset=0", 20, c, 0, 1, 4);
    case("8-bit g64 H=128 L=1 offset=7", 21, Config { sdtype: Dtype::Float16, ..c }, 7, 1, 8);
    case("8-bit g64 H=128 L=2 offset=7", 22, c, 7, 2, 9);
}

/// Prompts of 16 rows and more: the block's projections run on the GEMM's
/// panels on every path but VNNI and NEON (exact f32 there, held to 1e-5,
/// but for 8-bit weights on the AVX2 integer path: its integer GEMM loop).
#[test]
fn prompt_rows_on_the_gemm_panels() {
    let _g = lock();
    case("4-bit g32 L=16 offset=0", 60, LLAMA, 0, 16, 16);
    case("4-bit g32 L=20 offset=5", 61, LLAMA, 5, 20, 27);
    let c8 = Config { bits: 8, group: 32, sdtype: Dtype::Float16, qkv_bias: true, ..LLAMA };
    case("8-bit g32 f16 scales qkv bias L=32 offset=3", 62, c8, 3, 32, 40);
    case("8-bit g32 L=15 offset=0 (matvec loops)", 63, c8, 0, 15, 15);
    let c2 = Config { bits: 2, group: 32, sdtype: Dtype::Bfloat16, ..LLAMA };
    case("2-bit g32 bf16 scales L=17 offset=1", 64, c2, 1, 17, 18);
    case("3-bit g32 L=16 offset=0 (not a word layout)", 65, Config { bits: 3, ..LLAMA }, 0, 16, 16);
}

#[test]
fn hidden_96_group_32() {
    let _g = lock();
    // 96 = 3 groups of 32, not a multiple of 64; 6 query heads per 2 kv heads
    // (groups of 3), intermediate 160.
    let c = Config { hidden: 96, heads: 6, kv_heads: 2, head_dim: 16, intermediate: 160, ..LLAMA };
    case("4-bit g32 H=96 L=1 offset=3", 30, c, 3, 1, 4);
    case("8-bit g32 H=96 L=2 offset=3", 31, Config { bits: 8, sdtype: Dtype::Float16, ..c }, 3, 2, 5);
    // head_dim 32 and one kv head for all query heads (multi-query).
    let mq = Config { hidden: 96, heads: 3, kv_heads: 1, head_dim: 32, intermediate: 64, ..LLAMA };
    case("4-bit g32 H=96 MQA L=1 offset=4", 32, mq, 4, 1, 5);
    // head_dim 24: not a multiple of the 16 AVX-512 lanes.
    let d24 = Config { hidden: 96, heads: 4, kv_heads: 2, head_dim: 24, intermediate: 160, ..LLAMA };
    case("4-bit g32 H=96 head_dim 24 L=3 offset=4", 33, d24, 4, 3, 8);
    case("8-bit g32 H=96 head_dim 24 long cache L=1 offset=900", 34, Config { bits: 8, ..d24 }, 900, 1, 901);
}

#[test]
fn other_bit_widths() {
    let _g = lock();
    for (bits, group) in [(2, 32), (3, 32), (5, 32), (6, 64)] {
        if !kernels::supports(group, bits) {
            eprintln!("kernel does not support bits={bits} group={group}; skipped");
            continue;
        }
        let wf = randn(1, &[4, 64], 1.0);
        if quantize(&wf, group, bits).and_then(|(w, _, _)| w.eval()).is_err() {
            eprintln!("MLX does not quantize bits={bits} group={group}; skipped");
            continue;
        }
        let c = Config { bits, group, intermediate: 128, ..LLAMA };
        case(&format!("{bits}-bit g{group} L=2 offset=3"), 40 + bits as u64, c, 3, 2, 6);
    }
}

#[test]
fn qwen2_qkv_bias() {
    let _g = lock();
    let c = Config { qkv_bias: true, rope_base: 1_000_000.0, ..LLAMA };
    case("qkv bias L=1 offset=5", 50, c, 5, 1, 8);
    case("qkv bias L=3 offset=5", 51, Config { sdtype: Dtype::Float16, ..c }, 5, 3, 8);
}

#[test]
fn o_and_mlp_biases() {
    let _g = lock();
    let c = Config { o_bias: true, mlp_bias: true, ..LLAMA };
    case("o+mlp bias L=1 offset=5", 55, c, 5, 1, 8);
    case("all biases L=2 offset=1", 56, Config { qkv_bias: true, ..c }, 1, 2, 3);
}

#[test]
fn qwen3_qk_norm() {
    let _g = lock();
    let c = Config { qk_norm: true, rope_base: 1_000_000.0, ..LLAMA };
    case("qk_norm L=1 offset=5", 60, c, 5, 1, 8);
    case("qk_norm L=3 offset=5", 61, Config { sdtype: Dtype::Float16, ..c }, 5, 3, 8);
}

#[test]
fn rope_traditional() {
    let _g = lock();
    let c = Config { rope_traditional: true, ..LLAMA };
    case("traditional rope L=1 offset=5", 70, c, 5, 1, 8);
    case("traditional rope L=3 offset=5", 71, c, 5, 3, 8);
}

#[test]
fn rope_custom_freqs() {
    let _g = lock();
    let c = Config { rope_freqs: true, rope_base: 500_000.0, ..LLAMA };
    case("rope freqs L=1 offset=5", 80, c, 5, 1, 8);
    case("rope freqs L=3 offset=5", 81, c, 5, 3, 8);
    case("rope freqs traditional L=2 offset=9", 82, Config { rope_traditional: true, ..c }, 9, 2, 11);
}

#[test]
fn rope_scale() {
    let _g = lock();
    let c = Config { rope_scale: 0.25, ..LLAMA };
    case("rope scale 0.25 L=1 offset=5", 90, c, 5, 1, 8);
    case("rope scale 0.25 L=3 offset=5", 91, c, 5, 3, 8);
    case("rope scale 2.0 L=1 offset=5", 92, Config { rope_scale: 2.0, ..LLAMA }, 5, 1, 8);
}

#[test]
fn partial_rope_dims() {
    let _g = lock();
    // Only the first 8 of 16 features of each head rotate.
    let c = Config { rope_dims: 8, ..LLAMA };
    case("rope dims 8/16 L=1 offset=5", 95, c, 5, 1, 8);
    case("rope dims 8/16 traditional L=3 offset=5", 96, Config { rope_traditional: true, ..c }, 5, 3, 8);
}

#[test]
fn every_option_at_once() {
    let _g = lock();
    let c = Config {
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        qk_norm: true,
        rope_freqs: true,
        rope_traditional: true,
        rope_scale: 0.5,
        sdtype: Dtype::Float16,
        ..LLAMA
    };
    case("every option L=1 offset=5", 97, c, 5, 1, 8);
    case("every option L=3 offset=5", 98, c, 5, 3, 8);
}

#[test]
fn long_cache_parallel_attention() {
    let _g = lock();
    // heads · L · (offset + L) · head_dim >= 64Ki sends attention to the pool.
    case("long cache L=1 offset=1500", 100, LLAMA, 1500, 1, 1600);
    case("long cache L=3 offset=1500", 101, LLAMA, 1500, 3, 1503);
    let wide = Config { hidden: 128, heads: 8, kv_heads: 2, head_dim: 32, intermediate: 128, ..LLAMA };
    case("long cache H=128 heads=8 L=2 offset=700", 102, wide, 700, 2, 800);
}

#[test]
fn strided_and_lazy_inputs() {
    let _g = lock();
    let layer = Layer::new(110, LLAMA);
    // x as a transposed view: [1, 3, 64] with strides [.., 1, 3].
    let xt = randn(110, &[1, 64, 3], 1.0);
    let x = xt.transpose(&[0, 2, 1]).unwrap();
    let keys = random_cache(111, &layer, 8);
    let values = random_cache(112, &layer, 8);
    check_step("transposed x", &layer, &x, &keys, &values, 5);
    // x unevaluated.
    let x = randn(113, &[1, 2, 64], 1.0).mul_scalar(2.0).unwrap();
    check_step("lazy x", &layer, &x, &keys, &values, 4);
    // Lazy, row-sliced projection weights and a lazy norm weight.
    let big = Proj::new(114, 2 * 64, 64, 32, 4, Dtype::Float16);
    let lazy = |a: &Array| a.slice_axis(0, 64, 128).unwrap().add(&Array::zeros(&[1], a.dtype()).unwrap()).unwrap();
    let mut layer = layer;
    layer.o = Proj { w: lazy(&big.w), scales: lazy(&big.scales), biases: lazy(&big.biases), group: 32, bits: 4, bias: None };
    layer.post_norm = layer.post_norm.mul_scalar(1.5).unwrap();
    let x = randn(115, &[1, 1, 64], 1.0);
    check_step("lazy sliced o_proj", &layer, &x, &keys, &values, 5);
}

// ---------------------------------------------------------------------------
// Cache semantics.

#[test]
fn held_cache_inputs_are_not_modified() {
    let _g = lock();
    let layer = Layer::new(200, LLAMA);
    let (offset, capacity) = (5, 8);
    let keys = random_cache(201, &layer, capacity);
    let values = random_cache(202, &layer, capacity);
    let (keys_before, values_before) = (to_f32(&keys), to_f32(&values));
    // Two different steps from the same cache, evaluated together: each must
    // see the old cache, and neither may write into it.
    let x1 = randn(203, &[1, 1, 64], 1.0);
    let x2 = randn(204, &[1, 2, 64], 1.0);
    let (o1, k1, v1) = layer.run(&x1, keys.clone(), values.clone(), offset).unwrap();
    let (o2, k2, v2) = layer.run(&x2, keys.clone(), values.clone(), offset).unwrap();
    mlx_sys::eval([&o1, &k1, &v1, &o2, &k2, &v2]).unwrap();
    assert_eq!(to_f32(&keys), keys_before, "input keys changed");
    assert_eq!(to_f32(&values), values_before, "input values changed");
    check_outputs("held cache, first step", &layer, &x1, &keys, &values, offset, [&o1, &k1, &v1]);
    check_outputs("held cache, second step", &layer, &x2, &keys, &values, offset, [&o2, &k2, &v2]);
    // Not part of the contract (decoder_layer.h promises positions below
    // offset + L only), reported for information: on the copy path the rows
    // past the new ones are not copied from the input.
    let tail = |a: &Array| to_f32(&a.slice_axis(2, offset + 2, capacity).unwrap());
    eprintln!("held cache: rows past offset + L equal the input's: {}", tail(&k2) == tail(&keys));
    // And again after the outputs are gone: the inputs still hold the old cache.
    drop((o1, k1, v1, o2, k2, v2));
    check_step("held cache, third step", &layer, &x1, &keys, &values, offset);
    assert_eq!(to_f32(&keys), keys_before, "input keys changed");
    assert_eq!(to_f32(&values), values_before, "input values changed");
}

/// Decode steps that feed each step's output caches into the next and drop
/// them, as the model does. Checked two ways: against an MLX-op reference
/// chain run on its own copies from the same start, and, step by step,
/// against both references from (detached copies of) the kernel's own
/// previous caches.
fn run_chain(label: &str, layer: &Layer, keys: Array, values: Array, start: i32, lengths: &[i32], seed: u64) -> f64 {
    let label = format!("{label}{}", if layer.in_place { " [cache_in_place]" } else { "" });
    let mut chain_keys = detached_copy(&keys);
    let mut chain_values = detached_copy(&values);
    let (mut keys, mut values) = (Some(keys), Some(values));
    let mut offset = start;
    let mut worst = 0f64;
    for (step, &l) in lengths.iter().enumerate() {
        let x = randn(seed + step as u64, &[1, l, layer.spec.hidden], 1.0);
        let (prev_keys, prev_values) = (detached_copy(keys.as_ref().unwrap()), detached_copy(values.as_ref().unwrap()));
        // The kernel's node becomes the only holder of the old caches.
        let (out, k, v) = layer.run(&x, keys.take().unwrap(), values.take().unwrap(), offset).unwrap();
        mlx_sys::eval([&out, &k, &v]).unwrap();
        let end = offset + l;
        // The chain's caches carry every earlier step's rounding.
        let fewest_rows = lengths[..=step].iter().copied().min().unwrap_or(l);
        let tol = tol(layer, end, fewest_rows);
        let name = format!("{label} step {step} (L={l}, offset={offset})");
        let (e, _) = check_outputs(&name, layer, &x, &prev_keys, &prev_values, offset, [&out, &k, &v]);
        let (want, want_k, want_v) = layer.reference(&x, &chain_keys, &chain_values, offset, Matmul::Mlx);
        let chain = Errors {
            out: compare(&format!("{name} vs MLX chain: out"), &out, &want, tol),
            keys: compare(&format!("{name} vs MLX chain: keys"), &rows(&k, end), &rows(&want_k, end), tol),
            values: compare(&format!("{name} vs MLX chain: values"), &rows(&v, end), &rows(&want_v, end), tol),
        };
        eprintln!("{name}: vs the MLX-op chain: {chain}");
        worst = worst.max(e.max()).max(chain.max());
        chain_keys = want_k;
        chain_values = want_v;
        keys = Some(k);
        values = Some(v);
        offset = end;
    }
    worst
}

#[test]
fn decode_chain_matches_step_by_step_reference() {
    let _g = lock();
    for in_place in [false, true] {
        let mut layer = Layer::new(300, LLAMA);
        layer.in_place = in_place;
        let capacity = 16;
        let keys = random_cache(301, &layer, capacity);
        let values = random_cache(302, &layer, capacity);
        run_chain("chain", &layer, keys, values, 0, &[1, 1, 3, 1, 1, 2, 1], 303);
        // Several options, from a cache prefilled with 5 positions.
        let mut layer = Layer::new(
            304,
            Config { qkv_bias: true, qk_norm: true, rope_freqs: true, sdtype: Dtype::Float16, ..LLAMA },
        );
        layer.in_place = in_place;
        let keys = random_cache(305, &layer, 12);
        let values = random_cache(306, &layer, 12);
        run_chain("chain (options)", &layer, keys, values, 5, &[1, 1, 1, 2, 1, 1], 307);
    }
}

#[test]
fn lazy_chain_evaluated_once() {
    let _g = lock();
    // Three steps built on each other's unevaluated caches, evaluated together
    // at the end; with cache_in_place all three write one buffer in turn.
    for in_place in [false, true] {
        let mut layer = Layer::new(310, LLAMA);
        layer.in_place = in_place;
        let keys = random_cache(311, &layer, 10);
        let values = random_cache(312, &layer, 10);
        let (mut ref_k, mut ref_v) = (detached_copy(&keys), detached_copy(&values));
        let (mut k, mut v) = (keys, values);
        let mut offset = 2;
        let mut steps = vec![];
        for (i, l) in [1, 3, 1].into_iter().enumerate() {
            let x = randn(313 + i as u64, &[1, l, 64], 1.0);
            let (out, k2, v2) = layer.run(&x, k, v, offset).unwrap();
            let (want, want_k, want_v) = layer.reference(&x, &ref_k, &ref_v, offset, Matmul::Mlx);
            steps.push((out, want, offset + l));
            (k, v, ref_k, ref_v) = (k2, v2, want_k, want_v);
            offset += l;
        }
        let outs: Vec<&Array> = steps.iter().map(|(o, _, _)| o).chain([&k, &v]).collect();
        mlx_sys::eval(outs).unwrap();
        for (i, (out, want, end)) in steps.iter().enumerate() {
            let e = compare(&format!("lazy chain in_place={in_place} step {i}: out"), out, want, tol(&layer, *end, 1));
            eprintln!("lazy chain in_place={in_place} step {i}: out {e:.2e}");
        }
        let t = tol(&layer, offset, 1);
        let ek = compare("lazy chain: keys", &rows(&k, offset), &rows(&ref_k, offset), t);
        let ev = compare("lazy chain: values", &rows(&v, offset), &rows(&ref_v, offset), t);
        eprintln!("lazy chain in_place={in_place} final caches: keys {ek:.2e}, values {ev:.2e}");
    }
}

/// Bytes by which the allocator's high-water mark rose over one step whose
/// input caches nothing but the kernel's node holds.
fn step_peak_growth(layer: &Layer, keys: Array, values: Array, offset: i32) -> (usize, [Array; 3]) {
    let x = randn(400 + offset as u64, &[1, 1, layer.spec.hidden], 1.0);
    let (out, k, v) = layer.run(&x, keys, values, offset).unwrap();
    let before = mlx_sys::memory::active_memory();
    mlx_sys::memory::reset_peak_memory();
    mlx_sys::eval([&out, &k, &v]).unwrap();
    let peak = mlx_sys::memory::peak_memory();
    (peak.saturating_sub(before), [out, k, v])
}

/// Peak growth of four chained decode steps over 1 MiB caches, and the
/// size of one cache.
fn chain_peak_growth(in_place: bool) -> (Vec<usize>, usize) {
    let mut layer = Layer::new(410, LLAMA);
    layer.in_place = in_place;
    let capacity = 8192;
    let cache_bytes = (layer.spec.kv_heads * capacity * layer.spec.head_dim * 4) as usize;
    let mut keys = random_cache(411, &layer, capacity);
    let mut values = random_cache(412, &layer, capacity);
    let mut growth = vec![];
    for offset in 0..4 {
        let (grew, [_, k, v]) = step_peak_growth(&layer, keys, values, offset);
        eprintln!("cache_in_place={in_place}, step at offset {offset}: peak grew by {grew} bytes (one cache is {cache_bytes})");
        growth.push(grew);
        keys = k;
        values = v;
    }
    (growth, cache_bytes)
}

#[test]
fn in_place_steps_copy_no_cache() {
    let _g = lock();
    let (growth, cache_bytes) = chain_peak_growth(true);
    assert!(
        growth.iter().all(|&g| g < cache_bytes / 2),
        "steps allocated {growth:?} bytes (one cache is {cache_bytes}): the caches were copied"
    );
}

/// The same probe for a single-output MLX op, showing that the probe can see
/// donation at all: `x + 1` on an array nothing else holds reuses its buffer.
#[test]
fn donation_probe_sees_mlx_donating() {
    let _g = lock();
    let a = randn(420, &[1, 2, 8192, 16], 1.0);
    let b = a.add_scalar(1.0).unwrap();
    drop(a);
    let before = mlx_sys::memory::active_memory();
    mlx_sys::memory::reset_peak_memory();
    b.eval().unwrap();
    let grew = mlx_sys::memory::peak_memory().saturating_sub(before);
    eprintln!("x + 1 with x donatable: peak grew by {grew} bytes (x is {} bytes)", b.nbytes());
    assert!(grew < b.nbytes() / 2, "MLX's own op did not donate either ({grew} bytes): the probe is wrong");
}

#[test]
fn in_place_cache_with_held_references() {
    let _g = lock();
    // cache_in_place writes the new rows into the input buffers even while
    // the caller holds them; rows below offset must stay as they were.
    let mut layer = Layer::new(430, LLAMA);
    layer.in_place = true;
    let (offset, capacity) = (5, 9);
    let keys = random_cache(431, &layer, capacity);
    let values = random_cache(432, &layer, capacity);
    let (keys_before, values_before) = (detached_copy(&keys), detached_copy(&values));
    let x = randn(433, &[1, 3, 64], 1.0);
    let (out, k, v) = layer.run(&x, keys.clone(), values.clone(), offset).unwrap();
    mlx_sys::eval([&out, &k, &v]).unwrap();
    check_outputs("in place, held", &layer, &x, &keys_before, &values_before, offset, [&out, &k, &v]);
    let end = offset + 3;
    for (name, held, before, got) in [("keys", &keys, &keys_before, &k), ("values", &values, &values_before, &v)] {
        assert_eq!(to_f32(&rows(held, offset)), to_f32(&rows(before, offset)), "held {name}: prefix changed");
        // Written in place: the held input shows the new rows.
        assert_eq!(
            to_f32(&held.slice_axis(2, offset, end).unwrap()),
            to_f32(&got.slice_axis(2, offset, end).unwrap()),
            "held {name}: cache_in_place did not write the input buffer"
        );
    }
}

#[test]
fn in_place_cache_window_of_a_bigger_buffer() {
    let _g = lock();
    // The caches are heads 2..4 of [1, 4, capacity, D] buffers: row-contiguous
    // windows at a nonzero offset. In place, the kernel may write only rows
    // offset..offset+L of those two heads.
    let mut layer = Layer::new(440, LLAMA);
    layer.in_place = true;
    let (offset, capacity, d) = (4, 8, layer.spec.head_dim);
    let big_k = randn(441, &[1, 4, capacity, d], 1.0);
    let big_v = randn(442, &[1, 4, capacity, d], 1.0);
    let (big_k0, big_v0) = (detached_copy(&big_k), detached_copy(&big_v));
    let keys = big_k.slice_axis(1, 2, 4).unwrap();
    let values = big_v.slice_axis(1, 2, 4).unwrap();
    let x = randn(443, &[1, 2, 64], 1.0);
    let (out, k, v) = layer.run(&x, keys.clone(), values.clone(), offset).unwrap();
    mlx_sys::eval([&out, &k, &v]).unwrap();
    let old_k = big_k0.slice_axis(1, 2, 4).unwrap();
    let old_v = big_v0.slice_axis(1, 2, 4).unwrap();
    check_outputs("in place, window", &layer, &x, &old_k, &old_v, offset, [&out, &k, &v]);
    let end = offset + 2;
    for (name, big, before) in [("keys", &big_k, &big_k0), ("values", &big_v, &big_v0)] {
        let (now, was) = (to_f32(big), to_f32(before));
        let mut written = 0;
        for (i, (a, b)) in now.iter().zip(&was).enumerate() {
            let (head, row) = (i / (capacity * d) as usize, (i / d as usize) % capacity as usize);
            let allowed = head >= 2 && row >= offset as usize && row < end as usize;
            if a != b {
                assert!(allowed, "{name}: element {i} (head {head}, row {row}) outside the window was written");
                written += 1;
            }
        }
        eprintln!(
            "in place, window: {written} elements of the big {name} buffer rewritten (in place: {})",
            written > 0
        );
    }
}

#[test]
fn lazy_zero_cache() {
    let _g = lock();
    lazy_zero_cache_with(false);
    lazy_zero_cache_with(true);
}

fn lazy_zero_cache_with(in_place: bool) {
    let mut layer = Layer::new(500, LLAMA);
    layer.in_place = in_place;
    let shape = [1, layer.spec.kv_heads, 10, layer.spec.head_dim];
    // Unevaluated zeros (a broadcast scalar): offset 0, then a chain.
    let keys = Array::zeros(&shape, Dtype::Float32).unwrap();
    let values = Array::zeros(&shape, Dtype::Float32).unwrap();
    let x = randn(501, &[1, 2, 64], 1.0);
    check_step("lazy zeros L=2 offset=0", &layer, &x, &keys, &values, 0);
    check_step("lazy zeros L=1 offset=0", &layer, &x.slice_axis(1, 0, 1).unwrap(), &keys, &values, 0);
    // Array::zeros evaluates to a dense buffer (MLX's Full), which only this
    // test holds: with cache_in_place the kernel may write it (the caller's
    // contract), without it must not.
    let all_zero = |a: &Array| to_f32(a).iter().all(|&v| v == 0.0);
    if !in_place {
        assert!(all_zero(&keys) && all_zero(&values), "a held zero cache was written without cache_in_place");
    }
    run_chain("lazy zeros chain", &layer, keys, values, 0, &[2, 1, 1, 3], 502);
    // An explicit broadcast of a one-element zero.
    let zero = Array::zeros(&[1, 1, 1, 1], Dtype::Float32).unwrap();
    let keys = zero.broadcast_to(&shape).unwrap();
    let values = zero.broadcast_to(&shape).unwrap();
    check_step("broadcast zero L=1 offset=0", &layer, &x.slice_axis(1, 1, 2).unwrap(), &keys, &values, 0);
    // A stride-0 view is never written, in place or not.
    assert!(all_zero(&zero) && all_zero(&keys), "a broadcast zero cache was written (in_place={in_place})");
    // A cache grown lazily the way the model grows it: the used prefix
    // concatenated with fresh zeros.
    let prefix_k = random_cache(503, &layer, 5);
    let prefix_v = random_cache(504, &layer, 5);
    let grow = |p: &Array| {
        mlx_sys::concatenate(
            &[p.clone(), Array::zeros(&[1, layer.spec.kv_heads, 7, layer.spec.head_dim], Dtype::Float32).unwrap()],
            2,
        )
        .unwrap()
    };
    let (pk, pv) = (to_f32(&prefix_k), to_f32(&prefix_v));
    check_step("grown lazily L=2 offset=5", &layer, &x, &grow(&prefix_k), &grow(&prefix_v), 5);
    run_chain("grown lazily chain", &layer, grow(&prefix_k), grow(&prefix_v), 5, &[1, 2, 1], 505);
    assert!(to_f32(&prefix_k) == pk && to_f32(&prefix_v) == pv, "the grown caches' sources changed");
}

#[test]
fn strided_cache_views() {
    let _g = lock();
    for in_place in [false, true] {
        let mut layer = Layer::new(510, LLAMA);
        layer.in_place = in_place;
        let (kv, d) = (layer.spec.kv_heads, layer.spec.head_dim);
        let x = randn(511, &[1, 2, 64], 1.0);
        // Views that are not dense rows: the kernel must read them through
        // their strides and, even with cache_in_place, write new buffers.
        // [1, capacity, kv_heads, D] transposed to [1, kv_heads, capacity, D].
        let kbase = randn(512, &[1, 9, kv, d], 1.0);
        let vbase = randn(513, &[1, 9, kv, d], 1.0);
        let (kb0, vb0) = (to_f32(&kbase), to_f32(&vbase));
        let kt = kbase.transpose(&[0, 2, 1, 3]).unwrap();
        let vt = vbase.transpose(&[0, 2, 1, 3]).unwrap();
        check_step(&format!("transposed cache L=2 offset=6 in_place={in_place}"), &layer, &x, &kt, &vt, 6);
        // A window of a bigger buffer along the positions, and a cache whose
        // head_dim is strided.
        let kbig = randn(514, &[1, kv, 20, d], 1.0);
        let vbig = randn(515, &[1, kv, 20, 2 * d], 1.0);
        let (kg0, vg0) = (to_f32(&kbig), to_f32(&vbig));
        let kw = kbig.slice_axis(2, 4, 14).unwrap();
        let vw = vbig.slice(&[0, 0, 3, 0], &[1, kv, 13, 2 * d], &[1, 1, 1, 2]).unwrap();
        check_step(&format!("windowed/strided cache L=2 offset=7 in_place={in_place}"), &layer, &x, &kw, &vw, 7);
        assert!(
            to_f32(&kbase) == kb0 && to_f32(&vbase) == vb0 && to_f32(&kbig) == kg0 && to_f32(&vbig) == vg0,
            "a strided cache view's buffer was written (in_place={in_place})"
        );
    }
}

// ---------------------------------------------------------------------------
// Errors: each must come back as an Err naming the problem (an abort would
// take the test process down).

fn expect_err(label: &str, result: mlx_sys::Result<(Array, Array, Array)>, needle: &str) {
    match result {
        Ok(_) => panic!("{label}: expected an error mentioning `{needle}`, got Ok"),
        Err(e) => {
            eprintln!("{label}: {e}");
            assert!(e.message().contains(needle), "{label}: error `{e}` does not mention `{needle}`");
        }
    }
}

fn fake_quantized(n: i32, cols: i32, groups: i32) -> [Array; 3] {
    [
        Array::zeros(&[n, cols], Dtype::Uint32).unwrap(),
        Array::ones(&[n, groups], Dtype::Float32).unwrap(),
        Array::zeros(&[n, groups], Dtype::Float32).unwrap(),
    ]
}

#[test]
fn rejects_malformed_inputs() {
    let _g = lock();
    let layer = Layer::new(600, Config { qkv_bias: true, qk_norm: true, rope_freqs: true, ..LLAMA });
    let (kv, d) = (layer.spec.kv_heads, layer.spec.head_dim);
    let x = randn(601, &[1, 1, 64], 1.0);
    let keys = random_cache(602, &layer, 8);
    let values = random_cache(603, &layer, 8);
    let good = layer.weights();
    let spec = layer.spec(5);
    let run = |w: &DecoderLayerWeights, spec: &DecoderLayerSpec| kernels::decoder_layer(&x, w, &keys, &values, spec);
    // The good weights with one change.
    let with = |change: &dyn Fn(&mut DecoderLayerWeights)| {
        let mut w = good.clone();
        change(&mut w);
        w
    };

    // x.
    let run_x = |x: &Array| kernels::decoder_layer(x, &good, &keys, &values, &spec);
    expect_err("x float16", run_x(&x.astype(Dtype::Float16).unwrap()), "x must be float32");
    expect_err("x bfloat16", run_x(&x.astype(Dtype::Bfloat16).unwrap()), "x must be float32");
    expect_err("x hidden 32", run_x(&randn(604, &[1, 1, 32], 1.0)), "x must be float32 [1, L, 64]");
    expect_err("x batch 2", run_x(&randn(605, &[2, 1, 64], 1.0)), "x must be");
    expect_err("x 2-D", run_x(&randn(606, &[1, 64], 1.0)), "x must be");
    expect_err("x with L=0", run_x(&Array::zeros(&[1, 0, 64], Dtype::Float32).unwrap()), "x must be");

    // Norm weights.
    expect_err("input norm of 32", run(&with(&|w| w.input_norm = randn(607, &[32], 1.0)), &spec), "input_layernorm");
    expect_err(
        "post norm int32",
        run(&with(&|w| w.post_attention_norm = Array::from_slice(&[1i32; 64], &[64]).unwrap()), &spec),
        "post_attention_layernorm",
    );

    // Projections: wrong rows, dtype, scales.
    let wrong_rows = Proj::new(608, 80, 64, 32, 4, Dtype::Float32).projection();
    expect_err("q_proj with 80 rows", run(&with(&|w| w.q_proj = QuantizedProjection { bias: w.q_proj.bias.clone(), ..wrong_rows.clone() }), &spec), "q_proj");
    let gate95 = Proj::new(609, 95, 64, 32, 4, Dtype::Float32).projection();
    expect_err("gate_proj with 95 rows", run(&with(&|w| w.gate_proj = gate95.clone()), &spec), "gate_proj");
    let down64 = Proj::new(610, 64, 64, 32, 4, Dtype::Float32).projection();
    expect_err("down_proj with 64 input features", run(&with(&|w| w.down_proj = down64.clone()), &spec), "down_proj");
    expect_err(
        "k_proj weight int32",
        run(&with(&|w| w.k_proj.weight = layer.k.w.astype(Dtype::Int32).unwrap()), &spec),
        "k_proj: weight must be uint32",
    );
    // Scales with 3 groups for 64 input features.
    let three_groups = |w: &mut DecoderLayerWeights| {
        w.v_proj.scales = Array::ones(&[32, 3], Dtype::Float32).unwrap();
        w.v_proj.biases = Array::zeros(&[32, 3], Dtype::Float32).unwrap();
    };
    expect_err("v_proj scales [32, 3]", run(&with(&three_groups), &spec), "v_proj");
    // Biases of another shape than the scales.
    expect_err(
        "o_proj biases [64, 1]",
        run(&with(&|w| w.o_proj.biases = layer.o.biases.slice_axis(1, 0, 1).unwrap()), &spec),
        "o_proj: scales and biases",
    );
    // Scales and biases of different dtypes.
    expect_err(
        "up_proj f16 scales, f32 biases",
        run(&with(&|w| w.up_proj.scales = layer.up.scales.astype(Dtype::Float16).unwrap()), &spec),
        "up_proj: scales and biases",
    );
    // Scales of another row count.
    expect_err(
        "q_proj scales of 32 rows",
        run(&with(&|w| w.q_proj.scales = layer.q.scales.slice_axis(0, 0, 32).unwrap()), &spec),
        "q_proj: scales and biases",
    );
    // 7 bits (64 features in 14 words) and 4 bits in groups of 4: shapes MLX
    // cannot produce, which the kernel must refuse.
    let fake = |cols: i32, groups: i32| {
        let [weight, scales, biases] = fake_quantized(64, cols, groups);
        QuantizedProjection { weight, scales, biases, bias: None }
    };
    let seven = fake(14, 2);
    expect_err("7-bit q_proj", run(&with(&|w| w.q_proj = seven.clone()), &spec), "7-bit weights in groups of 32 are not supported");
    let groups_of_4 = fake(8, 16);
    expect_err("4-bit groups of 4", run(&with(&|w| w.q_proj = groups_of_4.clone()), &spec), "not supported");

    // Caches.
    let run_cache = |k: &Array, v: &Array, spec: &DecoderLayerSpec| kernels::decoder_layer(&x, &good, k, v, spec);
    let small = random_cache(611, &layer, 5);
    expect_err("keys capacity 5 < 6", run_cache(&small, &values, &spec), "keys cache must be float32 [1, 2, >= 6, 16]");
    expect_err("values capacity 5 < 6", run_cache(&keys, &small, &spec), "values cache");
    let r = run_cache(&random_cache(612, &layer, 6), &random_cache(613, &layer, 6), &spec)
        .expect("capacity exactly offset + L is enough");
    mlx_sys::eval([&r.0, &r.1, &r.2]).unwrap();
    let spec3 = layer.spec(4);
    let x3 = randn(614, &[1, 3, 64], 1.0);
    let (k6, v6) = (random_cache(615, &layer, 6), random_cache(616, &layer, 6));
    expect_err("capacity 6 < 4 + 3", kernels::decoder_layer(&x3, &good, &k6, &v6, &spec3), ">= 7");
    let (k7, v7) = (random_cache(617, &layer, 7), random_cache(618, &layer, 7));
    let r = kernels::decoder_layer(&x3, &good, &k7, &v7, &spec3).expect("capacity 7 for offset 4 + 3");
    mlx_sys::eval([&r.0, &r.1, &r.2]).unwrap();
    expect_err("keys float16", run_cache(&keys.astype(Dtype::Float16).unwrap(), &values, &spec), "keys cache");
    expect_err("values with 4 kv heads", run_cache(&keys, &randn(619, &[1, 4, 8, d], 1.0), &spec), "values cache");
    expect_err("keys head_dim 8", run_cache(&randn(620, &[1, kv, 8, 8], 1.0), &values, &spec), "keys cache");
    expect_err("keys 3-D", run_cache(&randn(621, &[kv, 8, d], 1.0), &values, &spec), "keys cache");

    // Optional arrays.
    expect_err("k bias of 64", run(&with(&|w| w.k_proj.bias = Some(randn(622, &[64], 1.0))), &spec), "k_proj bias");
    expect_err("k_norm of 32", run(&with(&|w| w.k_norm = Some(randn(623, &[32], 1.0))), &spec), "k_norm weight");
    expect_err("freqs of 16", run(&with(&|w| w.rope_freqs = Some(randn(624, &[16], 1.0))), &spec), "rope freqs");
    expect_err("q_norm without k_norm", run(&with(&|w| w.k_norm = None), &spec), "q_norm and k_norm");
    expect_err("k_norm without q_norm", run(&with(&|w| w.q_norm = None), &spec), "q_norm and k_norm");

    // The spec itself.
    let bad = |f: fn(&mut DecoderLayerSpec)| {
        let mut s = spec;
        f(&mut s);
        s
    };
    expect_err("heads 4, kv_heads 3", run(&good, &bad(|s| s.kv_heads = 3)), "invalid dimensions");
    expect_err("kv_heads 0", run(&good, &bad(|s| s.kv_heads = 0)), "invalid dimensions");
    expect_err("heads 0", run(&good, &bad(|s| s.heads = 0)), "invalid dimensions");
    expect_err("hidden -1", run(&good, &bad(|s| s.hidden = -1)), "invalid dimensions");
    expect_err("negative offset", run(&good, &bad(|s| s.offset = -1)), "offset");
    expect_err("odd rope dims", run(&good, &bad(|s| s.rope_dims = 7)), "rope dims");
    expect_err("rope dims > head_dim", run(&good, &bad(|s| s.rope_dims = 18)), "rope dims");
    expect_err("rope dims 0", run(&good, &bad(|s| s.rope_dims = 0)), "rope dims");
    // With heads 2 of the same head_dim the projections no longer fit.
    expect_err("heads 2 (q_proj of 4 heads)", run(&good, &bad(|s| s.heads = 2)), "q_proj");
    // Without freqs, the base must be positive; with them it is unused.
    let no_freqs = with(&|w| w.rope_freqs = None);
    expect_err("rope base 0", run(&no_freqs, &bad(|s| s.rope_base = 0.0)), "rope base");
    let r = run(&good, &bad(|s| s.rope_base = 0.0)).expect("rope base 0 with freqs");
    mlx_sys::eval([&r.0, &r.1, &r.2]).unwrap();

    // After all that, the good inputs still run and match.
    check_step("after errors", &layer, &x, &keys, &values, 5);
}

/// B sequences in one node (`forward_batch`), each over its own cache at its
/// own offset, give each sequence exactly (bit for bit) what it gets alone:
/// the node reads each weight once for all rows but computes every row as it
/// would alone. Rerun on every kernel path by the child processes below.
#[test]
fn batched_sequences_match_each_alone() {
    let _g = lock();
    for (seed, c, l) in [
        (41, LLAMA, 1),
        (42, Config { bits: 8, group: 32, sdtype: Dtype::Float16, ..LLAMA }, 1),
        (43, Config { qkv_bias: true, qk_norm: true, rope_freqs: true, ..LLAMA }, 1),
        (44, LLAMA, 3),
        (45, Config { bits: 8, group: 32, sdtype: Dtype::Float16, ..LLAMA }, 16),
    ] {
        let layer = Layer::new(seed, c);
        let offsets = [0, 7, 3, 40, 1, 19, 2];
        let b = offsets.len() as i32;
        let x = randn(seed ^ 0x5eed, &[b, l, c.hidden], 1.0);
        let caches: Vec<(Array, Array)> = offsets
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let cap = o + l + 2 * i as i32;
                (random_cache(seed * 10 + i as u64, &layer, cap), random_cache(seed * 10 + 5 + i as u64, &layer, cap))
            })
            .collect();
        let spec = layer.spec(0);
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        let refs: Vec<kernels::SequenceCache<'_>> =
            caches.iter().zip(offsets).map(|((k, v), offset)| kernels::SequenceCache { keys: k, values: v, offset }).collect();
        let (out, written) = prepared.forward_batch(&x, &refs, &spec).unwrap();
        assert_eq!(out.shape(), vec![b, l, c.hidden]);
        assert_eq!(written.len(), offsets.len());
        for (i, &offset) in offsets.iter().enumerate() {
            let xi = x.slice_axis(0, i as i32, i as i32 + 1).unwrap();
            let (k, v) = (detached_copy(&caches[i].0), detached_copy(&caches[i].1));
            let (alone, ka, va) = prepared.forward(&xi, &k, &v, &layer.spec(offset)).unwrap();
            let batched = out.slice_axis(0, i as i32, i as i32 + 1).unwrap();
            assert_eq!(to_f32(&batched), to_f32(&alone), "seed {seed}, sequence {i}: output differs from alone");
            let end = offset + l;
            assert_eq!(to_f32(&rows(&written[i].0, end)), to_f32(&rows(&ka, end)), "seed {seed}, sequence {i}: keys");
            assert_eq!(to_f32(&rows(&written[i].1, end)), to_f32(&rows(&va, end)), "seed {seed}, sequence {i}: values");
        }
        // And one sequence of the batch against the MLX reference.
        let i = 3;
        let xi = x.slice_axis(0, i as i32, i as i32 + 1).unwrap();
        check_outputs(
            &format!("batched seed {seed}"),
            &layer,
            &xi,
            &caches[i].0,
            &caches[i].1,
            offsets[i],
            [&out.slice_axis(0, i as i32, i as i32 + 1).unwrap(), &written[i].0, &written[i].1],
        );
    }
}

/// A batch with a missing cache, a wrong x or a cache too short names it.
#[test]
fn batched_bad_inputs_are_errors() {
    let _g = lock();
    let layer = Layer::new(45, LLAMA);
    let spec = layer.spec(0);
    let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
    let (k, v) = (random_cache(451, &layer, 8), random_cache(452, &layer, 8));
    let two = [kernels::SequenceCache { keys: &k, values: &v, offset: 2 }, kernels::SequenceCache { keys: &k, values: &v, offset: 7 }];
    let x3 = randn(453, &[3, 1, LLAMA.hidden], 1.0);
    let err = prepared.forward_batch(&x3, &two, &spec).err().expect("3 rows for 2 caches");
    assert!(err.to_string().contains("x must be float32 [2, L, 64]"), "{err}");
    let x2 = randn(454, &[2, 2, LLAMA.hidden], 1.0);
    let err = prepared.forward_batch(&x2, &two, &spec).err().expect("offset 7 + 2 > capacity 8");
    assert!(err.to_string().contains("keys cache 1 must be float32 [1, 2, >= 9, 16]"), "{err}");
    let err = prepared.forward_batch(&x2, &[], &spec).err().expect("no caches");
    assert!(err.to_string().contains("one keys and one values cache per offset"), "{err}");
}

// ---------------------------------------------------------------------------
// Paged KV pools.

const POOL_BLOCK: i32 = 16;

/// A `[kv_heads, blocks, block, D]` pool of random blocks, with positions `0..upto` of each
/// contiguous `[1, kv_heads, capacity, D]` cache copied into the blocks of its
/// table.
fn pool_holding(seed: u64, blocks: i32, caches: &[&Array], tables: &[Vec<i32>], upto: &[i32]) -> Array {
    let (h, d) = (caches[0].dim(1), caches[0].dim(3));
    let bs = POOL_BLOCK;
    let mut pool = to_f32(&randn(seed, &[h, blocks, bs, d], 1.0));
    for ((cache, table), &n) in caches.iter().zip(tables).zip(upto) {
        let cap = cache.dim(2);
        let data = to_f32(cache);
        for g in 0..h {
            for t in 0..n {
                let src = ((g * cap + t) * d) as usize;
                let dst = (((g * blocks + table[(t / bs) as usize]) * bs + t % bs) * d) as usize;
                pool[dst..dst + d as usize].copy_from_slice(&data[src..src + d as usize]);
            }
        }
    }
    Array::from_slice(&pool, &[h, blocks, bs, d]).unwrap()
}

/// Positions `0..upto` of the sequence with `table`, out of a pool, as a
/// `[1, kv_heads, upto, D]` array.
fn pool_rows(pool: &Array, table: &[i32], upto: i32) -> Array {
    let (h, blocks, bs, d) = (pool.dim(0), pool.dim(1), pool.dim(2), pool.dim(3));
    let data = to_f32(pool);
    let mut out = Vec::with_capacity((h * upto * d) as usize);
    for g in 0..h {
        for t in 0..upto {
            let at = (((g * blocks + table[(t / bs) as usize]) * bs + t % bs) * d) as usize;
            out.extend_from_slice(&data[at..at + d as usize]);
        }
    }
    Array::from_slice(&out, &[1, h, upto, d]).unwrap()
}

/// Block tables for sequences needing `lengths` positions: distinct blocks,
/// scattered over a pool of `blocks`.
fn scattered_tables(lengths: &[i32], blocks: i32) -> Vec<Vec<i32>> {
    let mut next = 0;
    lengths
        .iter()
        .map(|&n| {
            (0..(n + POOL_BLOCK - 1) / POOL_BLOCK)
                .map(|_| {
                    next += 1;
                    (next * 7) % blocks
                })
                .collect()
        })
        .collect()
}

/// Sequences whose caches live in a paged pool compute exactly what they
/// compute over contiguous caches, bit for bit, and their new keys and
/// values land in their own blocks.
#[test]
fn paged_pool_matches_contiguous_caches() {
    let _g = lock();
    let wide = Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA };
    for (seed, c, l) in [(61, LLAMA, 1), (62, wide, 1), (63, wide, 3), (64, Config { qk_norm: true, ..wide }, 2)] {
        let layer = Layer::new(seed, c);
        let offsets = [0, 7, 40, 19, 33, 16];
        let b = offsets.len() as i32;
        let x = randn(seed ^ 0x9a9e, &[b, l, c.hidden], 1.0);
        let caches: Vec<(Array, Array)> = offsets
            .iter()
            .enumerate()
            .map(|(i, &o)| (random_cache(seed * 10 + i as u64, &layer, o + l), random_cache(seed * 10 + 5 + i as u64, &layer, o + l)))
            .collect();
        let needed: Vec<i32> = offsets.iter().map(|o| o + l).collect();
        // 7 is prime to the pool size: the blocks are distinct and out of order.
        let blocks = 61;
        let tables = scattered_tables(&needed, blocks);
        let keys: Vec<&Array> = caches.iter().map(|c| &c.0).collect();
        let values: Vec<&Array> = caches.iter().map(|c| &c.1).collect();
        let pool_k = pool_holding(seed + 1, blocks, &keys, &tables, &offsets);
        let pool_v = pool_holding(seed + 2, blocks, &values, &tables, &offsets);

        let spec = layer.spec(0);
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        let refs: Vec<kernels::SequenceCache<'_>> =
            caches.iter().zip(offsets).map(|((k, v), offset)| kernels::SequenceCache { keys: k, values: v, offset }).collect();
        let (want, written) = prepared.forward_batch(&x, &refs, &spec).unwrap();
        let sequences: Vec<kernels::PagedSequence<'_>> =
            tables.iter().zip(offsets).map(|(table, offset)| kernels::PagedSequence { table, offset }).collect();
        let (got, pk, pv) = prepared.forward_paged(&x, &pool_k, &pool_v, &sequences, &spec).unwrap();
        assert_eq!(to_f32(&got), to_f32(&want), "seed {seed}: paged output differs from contiguous");
        for (i, table) in tables.iter().enumerate() {
            let end = needed[i];
            assert_eq!(to_f32(&pool_rows(&pk, table, end)), to_f32(&written[i].0), "seed {seed}, sequence {i}: keys");
            assert_eq!(to_f32(&pool_rows(&pv, table, end)), to_f32(&written[i].1), "seed {seed}, sequence {i}: values");
        }
    }
}

/// A prefill chunk whose keys and values live in a paged pool: the same
/// attention as over the contiguous cache, bit for bit.
#[test]
fn paged_causal_attention_matches_contiguous() {
    let _g = lock();
    for (seed, heads, kv_heads, d, offset, l) in [(71, 4, 2, 64, 0, 20), (72, 6, 3, 64, 37, 29), (73, 4, 4, 128, 16, 16), (74, 8, 2, 32, 100, 9)] {
        let q = randn(seed, &[1, heads, l, d], 1.0);
        let k_new = randn(seed + 1, &[1, kv_heads, l, d], 1.0);
        let v_new = randn(seed + 2, &[1, kv_heads, l, d], 1.0);
        let k_old = randn(seed + 3, &[1, kv_heads, offset.max(1), d], 1.0);
        let v_old = randn(seed + 4, &[1, kv_heads, offset.max(1), d], 1.0);
        let (k_all, v_all) = if offset == 0 {
            (k_new.clone(), v_new.clone())
        } else {
            (
                mlx_sys::concatenate(&[k_old.slice_axis(2, 0, offset).unwrap(), k_new.clone()], 2).unwrap(),
                mlx_sys::concatenate(&[v_old.slice_axis(2, 0, offset).unwrap(), v_new.clone()], 2).unwrap(),
            )
        };
        let want = kernels::causal_attention(&q, &k_all, &v_all, 0.125).unwrap();
        let blocks = 23;
        let table = scattered_tables(&[offset + l], blocks).remove(0);
        let pool_k = pool_holding(seed + 5, blocks, &[&k_old], &[table.clone()], &[offset]);
        let pool_v = pool_holding(seed + 6, blocks, &[&v_old], &[table.clone()], &[offset]);
        let (got, pk, pv) = kernels::paged_causal_attention(&q, &k_new, &v_new, &pool_k, &pool_v, &table, offset, 0.125, kernels::KvWindow::ALL, 0).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert_eq!(to_f32(&got), to_f32(&want), "seed {seed}: paged attention differs");
        assert_eq!(to_f32(&pool_rows(&pk, &table, offset + l)), to_f32(&k_all), "seed {seed}: keys in the pool");
        assert_eq!(to_f32(&pool_rows(&pv, &table, offset + l)), to_f32(&v_all), "seed {seed}: values in the pool");
    }
}

/// Softmax attention in f64 for query rows at positions `offset..offset + L`
/// of one sequence (`q` [1, H, L, D], `k`/`v` [1, Hkv, S, D]), each seeing
/// the positions `window` allows. Returns [1, H, L, D].
fn windowed_attention_f64(q: &Array, k: &Array, v: &Array, scale: f32, window: kernels::KvWindow) -> Vec<f32> {
    let (h, l, d, hkv, s) = (q.dim(1) as usize, q.dim(2) as usize, q.dim(3) as usize, k.dim(1) as usize, k.dim(2) as usize);
    let (q, k, v) = (to_f32(q), to_f32(k), to_f32(v));
    let offset = s - l;
    let mut out = vec![0f32; h * l * d];
    for head in 0..h {
        let g = head / (h / hkv);
        for i in 0..l {
            let p = offset + i;
            let seen: Vec<usize> = (0..=p).filter(|&t| t < window.keep.max(0) as usize || t >= window.first_recent(p)).collect();
            let qi = &q[(head * l + i) * d..][..d];
            let scores: Vec<f64> = seen
                .iter()
                .map(|&t| qi.iter().zip(&k[(g * s + t) * d..][..d]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64)
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (&t, w) in seen.iter().zip(&e) {
                for j in 0..d {
                    out[(head * l + i) * d + j] += (w / sum * v[(g * s + t) * d + j] as f64) as f32;
                }
            }
        }
    }
    out
}

/// Prefill attention with a sliding window over a paged pool: the masked
/// result (f64 reference, 1e-5), bit for bit the same however the prompt is
/// cut into calls, with the blocks below the window gone (-1) from the
/// table; and the same loops on every kernel path (see the subprocess test).
#[test]
fn windowed_paged_attention_is_masked_and_chunking_invariant() {
    let _g = lock();
    for (seed, heads, kv_heads, d, window, cuts) in [
        (81u64, 4, 2, 64, kernels::KvWindow { window: 40, keep: 4 }, vec![0, 37, 90, 150]),
        (82, 6, 3, 64, kernels::KvWindow { window: 100, keep: 0 }, vec![0, 150]),
        (83, 4, 4, 128, kernels::KvWindow { window: 17, keep: 33 }, vec![0, 5, 64, 65, 130]),
        (84, 8, 2, 32, kernels::KvWindow { window: 64, keep: 1 }, vec![0, 128, 129, 200]),
    ] {
        let total = *cuts.last().unwrap();
        let q = randn(seed, &[1, heads, total, d], 1.0);
        let k = randn(seed + 1, &[1, kv_heads, total, d], 1.0);
        let v = randn(seed + 2, &[1, kv_heads, total, d], 1.0);
        let want = windowed_attention_f64(&q, &k, &v, 0.125, window);
        let blocks = 41;
        let table = scattered_tables(&[total], blocks).remove(0);
        // Once per cut: each call's table has the blocks no new token sees dropped.
        let run = |cuts: &[i32]| -> Vec<f32> {
            let mut pool_k = randn(seed + 3, &[kv_heads, blocks, POOL_BLOCK, d], 1.0);
            let mut pool_v = randn(seed + 4, &[kv_heads, blocks, POOL_BLOCK, d], 1.0);
            let mut rows = vec![0f32; (heads * total * d) as usize];
            for pair in cuts.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                let mut visible = table.clone();
                let lo = window.first_recent(a as usize) as i32;
                for (i, id) in visible.iter_mut().enumerate() {
                    let i = i as i32;
                    if i * POOL_BLOCK >= window.keep && (i + 1) * POOL_BLOCK <= lo {
                        *id = -1;
                    }
                }
                let part = |x: &Array| x.slice_axis(2, a, b).unwrap();
                let (out, pk, pv) = kernels::paged_causal_attention(
                    &part(&q), &part(&k), &part(&v), &pool_k, &pool_v, &visible, a, 0.125, window, 0,
                )
                .unwrap();
                let out = to_f32(&out);
                let n = (b - a) as usize;
                for head in 0..heads as usize {
                    for i in 0..n {
                        let dst = (head * total as usize + a as usize + i) * d as usize;
                        rows[dst..dst + d as usize].copy_from_slice(&out[(head * n + i) * d as usize..][..d as usize]);
                    }
                }
                (pool_k, pool_v) = (pk, pv);
            }
            rows
        };
        let whole = run(&[0, total]);
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = whole.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-5 * scale.max(1.0), "seed {seed}: windowed attention off by {worst} (scale {scale})");
        assert_eq!(run(&cuts), whole, "seed {seed}: cut at {cuts:?}, the rows differ from one call");
    }
}

/// The fused block with a sliding window: the masked reference on a
/// contiguous cache, and bit for bit the same over a paged pool whose
/// blocks below the window are gone.
#[test]
fn windowed_layer_matches_masked_reference() {
    let _g = lock();
    let wide = Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA };
    for (seed, c, window, keep, offset, l) in [(91u64, LLAMA, 24, 4, 70, 1), (92, wide, 40, 0, 100, 1), (93, wide, 33, 2, 90, 3), (94, wide, 500, 4, 60, 2)] {
        let mut layer = Layer::new(seed, c);
        layer.spec.kv_window = window;
        layer.spec.kv_keep = keep;
        let x = randn(seed ^ 0x77, &[1, l, c.hidden], 1.0);
        let keys = random_cache(seed ^ 0xe1, &layer, offset + l);
        let values = random_cache(seed ^ 0xe2, &layer, offset + l);
        let (errors, _) = check_step(&format!("window {window} keep {keep}"), &layer, &x, &keys, &values, offset);
        assert!(errors.max() < 1e-4, "seed {seed}: {errors}");

        let blocks = 31;
        let mut table = scattered_tables(&[offset + l], blocks).remove(0);
        let pool_k = pool_holding(seed + 1, blocks, &[&keys], &[table.clone()], &[offset]);
        let pool_v = pool_holding(seed + 2, blocks, &[&values], &[table.clone()], &[offset]);
        let seen = kernels::KvWindow { window, keep };
        let lo = seen.first_recent(offset as usize) as i32;
        let full = table.clone();
        for (i, id) in table.iter_mut().enumerate() {
            let i = i as i32;
            if i * POOL_BLOCK >= keep && (i + 1) * POOL_BLOCK <= lo {
                *id = -1;
            }
        }
        let spec = layer.spec(offset);
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        let sequences = [kernels::PagedSequence { table: &table, offset }];
        let (got, pk, pv) = prepared.forward_paged(&x, &pool_k, &pool_v, &sequences, &spec).unwrap();
        // The same prepared weights on the contiguous cache (their copies
        // may round differently from the unprepared block checked above).
        let (out, written_k, written_v) =
            prepared.forward(&x, &detached_copy(&keys), &detached_copy(&values), &spec).unwrap();
        assert_eq!(to_f32(&got), to_f32(&out), "seed {seed}: paged windowed output differs from contiguous");
        mlx_sys::eval([&out, &written_k, &written_v]).unwrap();
        let label = format!("prepared, window {window} keep {keep}");
        let (prepared_errors, _) = check_outputs(&label, &layer, &x, &keys, &values, offset, [&out, &written_k, &written_v]);
        assert!(prepared_errors.max() < 1e-4, "seed {seed}: prepared {prepared_errors}");
        let new = |a: &Array| a.slice_axis(2, offset, offset + l).unwrap();
        assert_eq!(to_f32(&new(&pool_rows(&pk, &full, offset + l))), to_f32(&new(&written_k)), "seed {seed}: keys");
        assert_eq!(to_f32(&new(&pool_rows(&pv, &full, offset + l))), to_f32(&new(&written_v)), "seed {seed}: values");
        if window < offset {
            // A block the window still needs may not be missing.
            let mut bad = full.clone();
            bad[(lo / POOL_BLOCK) as usize] = -1;
            let bad_seq = [kernels::PagedSequence { table: &bad, offset }];
            let e = prepared.forward_paged(&x, &pool_k, &pool_v, &bad_seq, &spec).err().expect("a needed block is -1").to_string();
            assert!(e.contains("block id -1 at table index"), "{e}");
        }
    }
}

/// Tables that do not cover the new positions, ids outside the pool, two
/// sequences writing one block and a block size that is not a multiple of 8
/// are errors that say so.
#[test]
fn paged_bad_inputs_are_errors() {
    let _g = lock();
    let layer = Layer::new(75, LLAMA);
    let spec = layer.spec(0);
    let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
    let pool = randn(751, &[2, 4, 16, 16], 1.0);
    let x2 = randn(752, &[2, 1, LLAMA.hidden], 1.0);
    let run = |tables: &[&[i32]], offsets: &[i32], pool: &Array| {
        let seqs: Vec<kernels::PagedSequence<'_>> =
            tables.iter().zip(offsets).map(|(t, &offset)| kernels::PagedSequence { table: t, offset }).collect();
        prepared.forward_paged(&x2, pool, pool, &seqs, &spec).err().expect("an error").to_string()
    };
    let e = run(&[&[0], &[1]], &[3, 16], &pool);
    assert!(e.contains("the block table of sequence 1 holds 16 positions, 17 needed"), "{e}");
    let e = run(&[&[0], &[9]], &[3, 5], &pool);
    assert!(e.contains("block id 9 of sequence 1 at table index 0 is outside the pool of 4"), "{e}");
    let e = run(&[&[2], &[2]], &[3, 5], &pool);
    assert!(e.contains("two sequences write the same block"), "{e}");
    let odd = randn(753, &[2, 4, 12, 16], 1.0);
    let e = run(&[&[0], &[1]], &[3, 5], &odd);
    assert!(e.contains("block (a power of two >= 8)"), "{e}");
    // Shared prefix blocks may be read by both.
    let seqs = [kernels::PagedSequence { table: &[2, 0], offset: 16 }, kernels::PagedSequence { table: &[2, 1], offset: 16 }];
    assert!(prepared.forward_paged(&x2, &pool, &pool, &seqs, &spec).is_ok());
    let q = randn(754, &[1, 4, 3, 16], 1.0);
    let k = randn(755, &[1, 2, 3, 16], 1.0);
    let e = kernels::paged_causal_attention(&q, &k, &k, &pool, &pool, &[0], 14, 0.25, kernels::KvWindow::ALL, 0).err().expect("short table").to_string();
    assert!(e.contains("holds 16 positions, 17 needed"), "{e}");
}

/// A pool's pages are resident once written and handed back on release.
#[test]
fn pool_pages_are_resident_only_when_used() {
    let _g = lock();
    // 64 blocks of 2 * 16 * 64 floats = 8 KiB each.
    let block_bytes = 2 * 16 * 64 * 4;
    let keys = kernels::kv_pool_buffer(64, 2, 16, 64).unwrap();
    let values = kernels::kv_pool_buffer(64, 2, 16, 64).unwrap();
    assert_eq!(keys.shape(), vec![2, 64, 16, 64]);
    assert_eq!(kernels::resident_bytes(&keys).unwrap(), 0, "a fresh pool holds no pages");
    let layer = Layer::new(76, Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA });
    let spec = kernels::DecoderLayerSpec { cache_in_place: true, ..layer.spec(0) };
    let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
    let x = randn(761, &[1, 20, 128], 1.0);
    let (out, pk, pv) =
        prepared.forward_paged(&x, &keys, &values, &[kernels::PagedSequence { table: &[5, 9], offset: 0 }], &spec).unwrap();
    mlx_sys::eval([&out, &pk, &pv]).unwrap();
    // Written in place: the pools' own pages, two blocks each.
    assert_eq!(kernels::resident_bytes(&keys).unwrap(), 2 * block_bytes);
    assert_eq!(kernels::resident_bytes(&pk).unwrap(), 2 * block_bytes);
    kernels::kv_pool_release(&pk, &[5]).unwrap();
    assert_eq!(kernels::resident_bytes(&pk).unwrap(), block_bytes);
    assert!(kernels::kv_pool_release(&pk, &[64]).is_err(), "a block outside the pool");
}

// ---------------------------------------------------------------------------
// The 8-bit pool (mlx-lm's QuantizedKVCache: group 64, 8 bits).

/// Where one head's row lives in an 8-bit pool `[blocks, layers, 2, kv_heads, section]`.
struct Q8Pool {
    bytes: Vec<u8>,
    layers: usize,
    kv_heads: usize,
    block: usize,
    dim: usize,
}

impl Q8Pool {
    fn read(pool: &Array, dim: i32) -> Q8Pool {
        let shape = pool.shape();
        let dim = dim as usize;
        let row = dim + 8 * (dim / 64);
        Q8Pool {
            bytes: pool.to_vec::<u8>().unwrap(),
            layers: shape[1] as usize,
            kv_heads: shape[3] as usize,
            block: shape[4] as usize / row,
            dim,
        }
    }

    /// (quantized bytes, scales, biases) of position `t` of `table`.
    fn row(&self, table: &[i32], layer: usize, kind: usize, head: usize, t: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let groups = self.dim / 64;
        let section = self.block * (self.dim + 8 * groups);
        let block_bytes = section * 2 * self.kv_heads * self.layers;
        let at = table[t / self.block] as usize * block_bytes + ((layer * 2 + kind) * self.kv_heads + head) * section;
        let r = t % self.block;
        let floats = |from: usize| -> Vec<f32> {
            (0..groups).map(|g| f32::from_le_bytes(self.bytes[from + 4 * g..from + 4 * g + 4].try_into().unwrap())).collect()
        };
        let q = self.bytes[at + r * self.dim..at + (r + 1) * self.dim].to_vec();
        let scales = floats(at + self.block * self.dim + r * groups * 4);
        let biases = floats(at + self.block * self.dim + self.block * groups * 4 + r * groups * 4);
        (q, scales, biases)
    }
}

/// MLX's own 8-bit quantization of one row: (bytes, scales, biases).
fn mx_quantize_row(row: &[f32]) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let a = Array::from_slice(row, &[1, row.len() as i32]).unwrap();
    let (w, s, b) = quantize(&a, 64, 8).unwrap();
    let bytes = w.to_vec::<u32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect();
    (bytes, to_f32(&s), to_f32(&b))
}

/// `x` ([1, H, S, D]) through MLX's quantize and dequantize (group 64, 8 bits).
fn mx_round_trip(x: &Array) -> Array {
    let (w, s, b) = quantize(x, 64, 8).unwrap();
    let out = mlx_sys::dequantize(&w, &s, &b, 64, 8).unwrap();
    out.eval().unwrap();
    out
}

const Q8_WIDE: Config = Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA };

/// The fused block writes each new key and value row into its layer of an
/// 8-bit pool exactly as `mx.quantize` quantizes it (bytes, scales and
/// biases), in every sequence's own blocks, and leaves the other layers'
/// sections untouched.
#[test]
fn eight_bit_pool_rows_are_mx_quantize() {
    let _g = lock();
    let wide128 = Config { head_dim: 128, heads: 2, kv_heads: 1, ..Q8_WIDE };
    for (seed, c) in [(81u64, Q8_WIDE), (82, wide128)] {
        let layer = Layer::new(seed, c);
        let (b, l, layers, blocks) = (2, 20, 3, 23);
        let x = randn(seed ^ 0x8b17, &[b, l, c.hidden], 1.0);
        let spec = DecoderLayerSpec { cache_in_place: true, kv_layer: 1, ..layer.spec(0) };
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        // The f32 rows, from contiguous caches.
        let caches: Vec<(Array, Array)> = (0..b).map(|i| (random_cache(seed + i as u64, &layer, l), random_cache(seed + 9, &layer, l))).collect();
        let refs: Vec<kernels::SequenceCache<'_>> = caches.iter().map(|(k, v)| kernels::SequenceCache { keys: k, values: v, offset: 0 }).collect();
        let f32_spec = DecoderLayerSpec { kv_layer: 0, ..layer.spec(0) };
        let (want_out, written) = prepared.forward_batch(&x, &refs, &f32_spec).unwrap();
        let pool = kernels::kv_pool_buffer_q8(blocks, layers, c.kv_heads, POOL_BLOCK, c.head_dim).unwrap();
        let tables = scattered_tables(&[l, l], blocks);
        let sequences: Vec<kernels::PagedSequence<'_>> = tables.iter().map(|t| kernels::PagedSequence { table: t, offset: 0 }).collect();
        let (out, pk, _) = prepared.forward_paged(&x, &pool, &pool, &sequences, &spec).unwrap();
        mlx_sys::eval([&out, &pk]).unwrap();
        let q8 = Q8Pool::read(&pk, c.head_dim);
        let d = c.head_dim as usize;
        for (i, table) in tables.iter().enumerate() {
            for (kind, rows) in [to_f32(&written[i].0), to_f32(&written[i].1)].iter().enumerate() {
                for head in 0..c.kv_heads as usize {
                    for t in 0..l as usize {
                        let f = &rows[(head * l as usize + t) * d..][..d];
                        assert_eq!(q8.row(table, 1, kind, head, t), mx_quantize_row(f), "seed {seed}, sequence {i}, kind {kind}, head {head}, position {t}");
                        assert!(q8.row(table, 0, kind, head, t).0.iter().all(|&x| x == 0), "layer 0 was written");
                        assert!(q8.row(table, 2, kind, head, t).0.iter().all(|&x| x == 0), "layer 2 was written");
                    }
                }
            }
        }
        // The output attends over the quantized rows: close to the f32 one, not equal.
        let (got, want) = (to_f32(&out), to_f32(&want_out));
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        eprintln!("seed {seed}: 8-bit vs f32 cache, max|Δ|/max|ref| {worst:.2e}");
        assert!(worst > 0.0 && worst < 2e-2, "seed {seed}: {worst}");
    }
}

/// Prefill attention over an 8-bit pool is attention over the rows as
/// `mx.dequantize` restores them, bit for bit, across two calls (the
/// second reads what the first wrote) and with a window.
#[test]
fn eight_bit_prefill_attention_is_attention_over_dequantized_rows() {
    let _g = lock();
    for (seed, heads, kv_heads, d, first, l, window) in [
        (91u64, 4, 2, 64, 37, 29, kernels::KvWindow::ALL),
        (92, 4, 4, 128, 16, 16, kernels::KvWindow::ALL),
        (93, 6, 3, 64, 60, 21, kernels::KvWindow { window: 40, keep: 4 }),
    ] {
        let total = first + l;
        let q = randn(seed, &[1, heads, total, d], 1.0);
        let k = randn(seed + 1, &[1, kv_heads, total, d], 1.0);
        let v = randn(seed + 2, &[1, kv_heads, total, d], 1.0);
        let blocks = 23;
        let table = scattered_tables(&[total], blocks).remove(0);
        let pool = kernels::kv_pool_buffer_q8(blocks, 2, kv_heads, POOL_BLOCK, d).unwrap();
        let part = |x: &Array, a: i32, b: i32| x.slice_axis(2, a, b).unwrap();
        let (_, pool, _) = kernels::paged_causal_attention(&part(&q, 0, first), &part(&k, 0, first), &part(&v, 0, first), &pool, &pool, &table, 0, 0.125, window, 1).unwrap();
        let (got, pool, _) = kernels::paged_causal_attention(&part(&q, first, total), &part(&k, first, total), &part(&v, first, total), &pool, &pool, &table, first, 0.125, window, 1).unwrap();
        let (kd, vd) = (mx_round_trip(&k), mx_round_trip(&v));
        let got = to_f32(&got);
        let want = if window == kernels::KvWindow::ALL {
            to_f32(&part(&kernels::causal_attention(&q, &kd, &vd, 0.125).unwrap(), first, total))
        } else {
            windowed_attention_f64(&part(&q, first, total), &kd, &vd, 0.125, window)
        };
        let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        if window == kernels::KvWindow::ALL {
            assert_eq!(got, want, "seed {seed}: not attention over the dequantized rows");
        } else {
            assert!(worst < 1e-5, "seed {seed}: windowed, max|Δ| {worst}");
        }
        let rows = Q8Pool::read(&pool, d);
        let kf = to_f32(&k);
        for t in [0, first as usize - 1, first as usize, total as usize - 1] {
            let f = &kf[((kv_heads as usize - 1) * total as usize + t) * d as usize..][..d as usize];
            assert_eq!(rows.row(&table, 1, 0, kv_heads as usize - 1, t), mx_quantize_row(f), "seed {seed}, position {t}");
        }
    }
}

/// Decode over an 8-bit pool (the fused block's factored dot products)
/// against the f32 block over the same keys and values as `mx.dequantize`
/// restores them: only the new position, quantized in one and not in the
/// other, differs. With and without a window.
#[test]
fn eight_bit_decode_matches_attention_over_dequantized_rows() {
    let _g = lock();
    let wide128 = Config { head_dim: 128, heads: 4, kv_heads: 2, ..Q8_WIDE };
    for (seed, c, window) in [
        (101u64, Q8_WIDE, kernels::KvWindow::ALL),
        (102, wide128, kernels::KvWindow::ALL),
        (103, Q8_WIDE, kernels::KvWindow { window: 24, keep: 4 }),
    ] {
        let layer = Layer::new(seed, c);
        let (prompt, blocks) = (45, 23);
        let spec = DecoderLayerSpec { cache_in_place: true, kv_layer: 0, kv_window: window.window, kv_keep: window.keep, ..layer.spec(0) };
        let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
        let table = scattered_tables(&[prompt + 1], blocks).remove(0);
        let pool = kernels::kv_pool_buffer_q8(blocks, 1, c.kv_heads, POOL_BLOCK, c.head_dim).unwrap();
        let x = randn(seed ^ 0xdec0, &[1, prompt + 1, c.hidden], 1.0);
        let seq = |offset| [kernels::PagedSequence { table: &table, offset }];
        let (_, pool, _) = prepared.forward_paged(&x.slice_axis(1, 0, prompt).unwrap(), &pool, &pool, &seq(0), &spec).unwrap();
        let step = x.slice_axis(1, prompt, prompt + 1).unwrap();
        let (got, pool, _) = prepared.forward_paged(&step, &pool, &pool, &seq(prompt), &spec).unwrap();
        mlx_sys::eval([&got, &pool]).unwrap();
        // The dequantized prompt rows as contiguous f32 caches.
        let rows = Q8Pool::read(&pool, c.head_dim);
        let d = c.head_dim as usize;
        let cache = |kind: usize| {
            let mut out = vec![0f32; c.kv_heads as usize * (prompt as usize + 1) * d];
            for head in 0..c.kv_heads as usize {
                for t in 0..prompt as usize {
                    let (q, s, b) = rows.row(&table, 0, kind, head, t);
                    for i in 0..d {
                        out[(head * (prompt as usize + 1) + t) * d + i] = s[i / 64] * q[i] as f32 + b[i / 64];
                    }
                }
            }
            Array::from_slice(&out, &[1, c.kv_heads, prompt + 1, c.head_dim]).unwrap()
        };
        let f32_spec = DecoderLayerSpec { cache_in_place: false, ..spec };
        let refs = [kernels::SequenceCache { keys: &cache(0), values: &cache(1), offset: prompt }];
        let (want, _) = prepared.forward_batch(&step, &refs, &f32_spec).unwrap();
        let (got, want) = (to_f32(&got), to_f32(&want));
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        eprintln!("seed {seed}: 8-bit decode vs f32 over the dequantized rows, max|Δ|/max|ref| {worst:.2e}");
        assert!(worst < 1e-3, "seed {seed}: {worst}");
    }
}

/// An 8-bit pool passed with another values pool, a layer outside it, a
/// copy instead of in-place writes and a head size that is not whole groups
/// of 64 are errors that say so; a freed block hands back all its pages.
#[test]
fn eight_bit_pool_bad_inputs_and_pages() {
    let _g = lock();
    let layer = Layer::new(111, Q8_WIDE);
    let spec = DecoderLayerSpec { cache_in_place: true, ..layer.spec(0) };
    let prepared = kernels::PreparedDecoderLayer::new(&layer.weights(), &spec).unwrap();
    // 8 layers, 2 heads of 64: a block is 2 * 8 * 2 * 16 * 72 bytes = 9 pages of 4 KiB.
    let (layers, block_bytes) = (8, 2 * 8 * 2 * 16 * 72);
    assert_eq!(kernels::kv_q8_block_bytes(8, 2, 16, 64), block_bytes);
    let pool = kernels::kv_pool_buffer_q8(16, layers, 2, POOL_BLOCK, 64).unwrap();
    let other = kernels::kv_pool_buffer_q8(16, layers, 2, POOL_BLOCK, 64).unwrap();
    assert_eq!(kernels::resident_bytes(&pool).unwrap(), 0, "a fresh pool holds no pages");
    let x = randn(112, &[1, 20, Q8_WIDE.hidden], 1.0);
    let seq = [kernels::PagedSequence { table: &[5, 9], offset: 0 }];
    let error = |keys: &Array, values: &Array, spec: &DecoderLayerSpec| prepared.forward_paged(&x, keys, values, &seq, spec).err().expect("an error").to_string();
    assert!(error(&pool, &other, &spec).contains("passed as both the keys and the values pool"));
    let e = error(&pool, &pool, &DecoderLayerSpec { kv_layer: 8, ..spec });
    assert!(e.contains("kv_layer 8 is outside the 8-bit pool's 8 layers"), "{e}");
    let e = error(&pool, &pool, &DecoderLayerSpec { cache_in_place: false, ..spec });
    assert!(e.contains("written in place only"), "{e}");
    let e = kernels::kv_pool_buffer_q8(4, 1, 2, 16, 96).err().expect("head_dim 96").to_string();
    assert!(e.contains("head_dim 96 is not a multiple"), "{e}");
    let mut current = pool.clone();
    for kv_layer in 0..layers {
        let (out, next, _) = prepared.forward_paged(&x, &current, &current, &seq, &DecoderLayerSpec { kv_layer, ..spec }).unwrap();
        mlx_sys::eval([&out, &next]).unwrap();
        current = next;
    }
    assert_eq!(kernels::resident_bytes(&pool).unwrap(), 2 * block_bytes, "two blocks of every layer, in place");
    kernels::kv_pool_release(&current, &[5]).unwrap();
    assert_eq!(kernels::resident_bytes(&current).unwrap(), block_bytes);
}

// ---------------------------------------------------------------------------
// The exact kernel paths.

/// Reruns every other test of this file in a child process per other kernel
/// path (`MLXCEL_KERNELS` is read once per process): the exact loops, with a
/// base tolerance of 1e-5 for every bit width, and the AVX2 integer loop
/// (forced on AVX-512 machines too), with the quantized-activation one.
#[test]
fn exact_kernel_paths_in_subprocesses() {
    if std::env::var_os("MLXCEL_DECODER_LAYER_CHILD").is_some() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for path in ["avx512", "avx2", "avx2-int8", "portable"] {
        let out = std::process::Command::new(&exe)
            .args(["--test-threads=1", "--nocapture", "--skip", "exact_kernel_paths_in_subprocesses"])
            .env("MLXCEL_KERNELS", path)
            .env("MLXCEL_DECODER_LAYER_CHILD", "1")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "MLXCEL_KERNELS={path}: the child run failed:\n{text}");
        // The worst error vs MLX's matmul over every case of the child run.
        let worst = text
            .lines()
            .filter_map(|l| l.split_once("vs MLX matmul: ").map(|(_, r)| r))
            .flat_map(|r| {
                r.split(|c: char| c == ',' || c == ';').filter_map(|f| f.split_whitespace().last()?.parse::<f64>().ok())
            })
            .fold(0f64, f64::max);
        let cases = text.lines().filter(|l| l.contains("vs MLX matmul: ")).count();
        eprintln!("MLXCEL_KERNELS={path}: {cases} checks passed, worst max|Δ|/max|ref| vs MLX matmul {worst:.2e}");
    }
}

/// Layers run as one stack node compute exactly what the chain of their
/// own nodes computes, bit for bit, and write the same rows into every
/// layer's pools: f32 pools (several sequences, decode and a few prompt
/// rows, a layer with its own window) and an 8-bit pool holding every layer.
#[test]
fn stacked_layers_match_the_chain_of_layer_nodes() {
    let _g = lock();
    let wide = Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA };
    let configs = [wide, Config { qk_norm: true, ..wide }, wide];
    let layers: Vec<Layer> = configs.iter().enumerate().map(|(i, &c)| Layer::new(201 + i as u64, c)).collect();
    let specs: Vec<DecoderLayerSpec> = layers
        .iter()
        .enumerate()
        .map(|(i, layer)| DecoderLayerSpec {
            cache_in_place: true,
            kv_window: if i == 1 { 24 } else { 0 },
            kv_keep: if i == 1 { 4 } else { 0 },
            ..layer.spec(0)
        })
        .collect();
    let prepared: Vec<kernels::PreparedDecoderLayer> =
        layers.iter().zip(&specs).map(|(l, s)| kernels::PreparedDecoderLayer::new(&l.weights(), s).unwrap()).collect();
    let stack = kernels::PreparedDecoderStack::new(&prepared);
    assert_eq!(stack.len(), 3);

    // f32 pools, one pair per layer.
    for l in [1, 3] {
        let offsets = [0, 7, 40];
        let needed: Vec<i32> = offsets.iter().map(|o| o + l).collect();
        let blocks = 29;
        let tables = scattered_tables(&needed, blocks);
        let sequences: Vec<kernels::PagedSequence<'_>> =
            tables.iter().zip(offsets).map(|(table, offset)| kernels::PagedSequence { table, offset }).collect();
        let x = randn(0x57ac + l as u64, &[3, l, wide.hidden], 1.0);
        // Two copies of the same pools: one for the chain, one for the stack.
        let pools = |layer: usize| {
            let shape = [wide.kv_heads, blocks, POOL_BLOCK, wide.head_dim];
            (randn(300 + layer as u64, &shape, 1.0), randn(400 + layer as u64, &shape, 1.0))
        };
        let mut h = x.clone();
        let mut chained = Vec::new();
        for (i, p) in prepared.iter().enumerate() {
            let (k, v) = pools(i);
            let (out, k, v) = p.forward_paged(&h, &k, &v, &sequences, &specs[i]).unwrap();
            h = out;
            chained.push((k, v));
        }
        let stack_pools: Vec<(Array, Array)> = (0..3).map(pools).collect();
        let (got, written) = stack.forward_paged(&x, &stack_pools, &sequences, &specs).unwrap();
        assert_eq!(to_f32(&got), to_f32(&h), "L {l}: the stack's output differs from the chain's");
        assert_eq!(written.len(), 3);
        for (i, ((k, v), (ck, cv))) in written.iter().zip(&chained).enumerate() {
            assert_eq!(to_f32(k), to_f32(ck), "L {l}, layer {i}: keys");
            assert_eq!(to_f32(v), to_f32(cv), "L {l}, layer {i}: values");
        }
    }

    // One 8-bit pool for every layer: a prompt, then a decode step.
    let q8_specs: Vec<DecoderLayerSpec> = specs.iter().enumerate().map(|(i, s)| DecoderLayerSpec { kv_layer: i as i32, ..*s }).collect();
    let (prompt, blocks) = (21, 13);
    let table = scattered_tables(&[prompt + 1], blocks).remove(0);
    let seq = |offset| [kernels::PagedSequence { table: &table, offset }];
    let x = randn(0x58, &[1, prompt + 1, wide.hidden], 1.0);
    let run = |stacked: bool| {
        let mut pool = kernels::kv_pool_buffer_q8(blocks, 3, wide.kv_heads, POOL_BLOCK, wide.head_dim).unwrap();
        let mut out = None;
        for (start, end) in [(0, prompt), (prompt, prompt + 1)] {
            let mut h = x.slice_axis(1, start, end).unwrap();
            if stacked {
                let pools = vec![(pool.clone(), pool.clone()); 3];
                let (o, written) = stack.forward_paged(&h, &pools, &seq(start), &q8_specs).unwrap();
                h = o;
                pool = written[2].0.clone();
            } else {
                for (i, p) in prepared.iter().enumerate() {
                    let (o, written, _) = p.forward_paged(&h, &pool, &pool, &seq(start), &q8_specs[i]).unwrap();
                    h = o;
                    pool = written;
                }
            }
            out = Some(h);
        }
        (to_f32(&out.unwrap()), to_f32(&pool.astype(Dtype::Float32).unwrap()))
    };
    let (chain_out, chain_pool) = run(false);
    let (stack_out, stack_pool) = run(true);
    assert_eq!(stack_out, chain_out, "8-bit pool: the stack's output differs from the chain's");
    assert_eq!(stack_pool, chain_pool, "8-bit pool: the stack wrote other rows");
}

/// A stack's inputs that do not match its layers are errors that name what
/// is wrong, and the layer.
#[test]
fn stack_bad_inputs_are_errors() {
    let _g = lock();
    let wide = Config { hidden: 128, heads: 4, kv_heads: 2, head_dim: 64, intermediate: 128, ..LLAMA };
    let layers = [Layer::new(211, wide), Layer::new(212, LLAMA)];
    let specs: Vec<DecoderLayerSpec> = layers.iter().map(|l| DecoderLayerSpec { cache_in_place: true, ..l.spec(0) }).collect();
    let prepared: Vec<kernels::PreparedDecoderLayer> =
        layers.iter().zip(&specs).map(|(l, s)| kernels::PreparedDecoderLayer::new(&l.weights(), s).unwrap()).collect();
    let table = [0, 1];
    let seq = [kernels::PagedSequence { table: &table, offset: 3 }];
    let pool = |c: Config| {
        let shape = [c.kv_heads, 4, POOL_BLOCK, c.head_dim];
        (randn(1, &shape, 1.0), randn(2, &shape, 1.0))
    };
    let x = randn(3, &[1, 1, wide.hidden], 1.0);
    let error = |stack: &kernels::PreparedDecoderStack, pools: &[(Array, Array)], specs: &[DecoderLayerSpec]| {
        stack.forward_paged(&x, pools, &seq, specs).err().expect("an error").to_string()
    };
    let empty = kernels::PreparedDecoderStack::new(std::iter::empty());
    assert!(empty.is_empty());
    let e = error(&empty, &[], &[]);
    assert!(e.contains("at least one layer"), "{e}");
    let one = kernels::PreparedDecoderStack::new(&prepared[..1]);
    let e = error(&one, &[pool(wide), pool(wide)], &specs[..1]);
    assert!(e.contains("1 layers got 1 specs, 2 key pools"), "{e}");
    // Layer 1 has another hidden size than x.
    let both = kernels::PreparedDecoderStack::new(&prepared);
    let e = error(&both, &[pool(wide), pool(LLAMA)], &specs);
    assert!(e.contains("layer 1"), "{e}");
    assert!(one.forward_paged(&x, &[pool(wide)], &seq, &specs[..1]).is_ok());
}
