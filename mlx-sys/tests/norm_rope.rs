//! `kernels::rms_norm` and `kernels::rope` against f64 references and MLX's
//! `fast` ops, on awkward shapes, strided inputs and the fallbacks.

use mlx_sys::{fast, kernels, random, Array, Dtype};

fn normal(seed: u64, shape: &[i32]) -> Array {
    let key = random::key(seed).unwrap();
    random::normal(shape, Dtype::Float32, 0.0, 2.0, &key).unwrap()
}

fn values(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec().unwrap()
}

/// The elements of `a` in row-major order of its logical shape, whatever
/// its strides (MLX copies into a contiguous array for `to_vec`).
fn logical(a: &Array) -> Vec<f64> {
    values(a).into_iter().map(f64::from).collect()
}

#[test]
fn rms_norm_matches_an_f64_reference_and_mlx() {
    let eps = 1e-5f32;
    let shapes: &[&[i32]] = &[&[7], &[1, 576], &[3, 37], &[2, 5, 64], &[513, 576]];
    for (case, &shape) in shapes.iter().enumerate() {
        let d = *shape.last().unwrap();
        for weight_dtype in [None, Some(Dtype::Float32), Some(Dtype::Float16), Some(Dtype::Bfloat16)] {
            let x = normal(case as u64 * 10 + 1, shape);
            let weight = weight_dtype.map(|dt| normal(case as u64 * 10 + 2, &[d]).astype(dt).unwrap());
            let got = kernels::rms_norm(&x, weight.as_ref(), eps).unwrap();
            assert_eq!(got.shape(), shape.to_vec());
            assert_eq!(got.dtype(), Dtype::Float32);
            let mlx = values(&fast::rms_norm(&x, weight.as_ref(), eps).unwrap());
            let (xs, w) = (logical(&x), weight.as_ref().map(logical));
            let got = values(&got);
            for (r, row) in xs.chunks(d as usize).enumerate() {
                let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps as f64).sqrt();
                for (i, &v) in row.iter().enumerate() {
                    let at = r * d as usize + i;
                    let exact = v * inv * w.as_ref().map_or(1.0, |w| w[i]);
                    let bound = 1e-5 * exact.abs() + 1e-30;
                    assert!((got[at] as f64 - exact).abs() <= bound, "{shape:?} {weight_dtype:?} [{at}]: {} against {exact}", got[at]);
                    assert!((mlx[at] as f64 - exact).abs() <= bound, "MLX {shape:?} [{at}]");
                }
            }
        }
    }
}

#[test]
fn rms_norm_reads_strided_rows_and_falls_back_for_other_dtypes() {
    // [2, 64, 5] transposed: rows of 64 with a stride of 5 between features.
    let base = normal(7, &[2, 64, 5]);
    let x = base.transpose(&[0, 2, 1]).unwrap();
    let w = normal(8, &[64]);
    let got = values(&kernels::rms_norm(&x, Some(&w), 1e-6).unwrap());
    let contiguous = values(&kernels::rms_norm(&x.astype(Dtype::Float32).unwrap().reshape(&[2, 5, 64]).unwrap(), Some(&w), 1e-6).unwrap());
    assert_eq!(got, contiguous, "a strided x gives the contiguous one's bits");
    // float16 activations: MLX's own op, bit for bit.
    let half = normal(9, &[3, 40]).astype(Dtype::Float16).unwrap();
    let ours = kernels::rms_norm(&half, Some(&w.slice_axis(0, 0, 40).unwrap()), 1e-6).unwrap();
    let mlx = fast::rms_norm(&half, Some(&w.slice_axis(0, 0, 40).unwrap()), 1e-6).unwrap();
    assert_eq!(ours.dtype(), mlx.dtype());
    assert_eq!(values(&ours), values(&mlx));
    // A weight of the wrong size is MLX's error, not ours.
    assert!(kernels::rms_norm(&normal(10, &[2, 8]), Some(&normal(11, &[9])), 1e-6).and_then(|a| a.eval()).is_err());
}

struct RopeCase {
    shape: Vec<i32>,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: i32,
    explicit_freqs: bool,
    transposed: bool,
}

#[test]
fn rope_matches_an_f64_reference_and_mlx() {
    let case = |shape: &[i32], dims, traditional, base, scale, offset, explicit_freqs, transposed| RopeCase {
        shape: shape.to_vec(),
        dims,
        traditional,
        base,
        scale,
        offset,
        explicit_freqs,
        transposed,
    };
    let cases = [
        case(&[1, 2, 3, 8], 8, false, 10000.0, 1.0, 0, false, false),
        case(&[1, 2, 3, 8], 8, true, 10000.0, 1.0, 0, false, false),
        case(&[2, 9, 37, 64], 64, false, 100000.0, 1.0, 17, false, true),
        case(&[2, 9, 37, 64], 32, false, 10000.0, 0.25, 5, false, true),
        case(&[1, 4, 513, 64], 64, false, 10000.0, 1.0, 0, false, false),
        case(&[1, 4, 513, 64], 64, false, 10000.0, 1.0, 0, true, false),
        case(&[4, 5, 70], 64, true, 500000.0, 1.0, 1000, false, false),
        case(&[4, 5, 16], 16, false, 10000.0, 1.0, 3, true, true),
    ];
    for (n, c) in cases.iter().enumerate() {
        let x = if c.transposed {
            // [.., L, H, D] laid out, viewed as [.., H, L, D] as attention does.
            let nd = c.shape.len();
            let mut stored = c.shape.clone();
            stored.swap(nd - 3, nd - 2);
            let mut axes: Vec<i32> = (0..nd as i32).collect();
            axes.swap(nd - 3, nd - 2);
            normal(100 + n as u64, &stored).transpose(&axes).unwrap()
        } else {
            normal(100 + n as u64, &c.shape)
        };
        let half = (c.dims / 2) as usize;
        let freqs = c.explicit_freqs.then(|| {
            let f: Vec<f32> = (0..half).map(|i| 1.5f32 * (1.0 + i as f32).powf(1.7)).collect();
            Array::from_slice(&f, &[half as i32]).unwrap()
        });
        let base = if c.explicit_freqs { 0.0 } else { c.base };
        let got = kernels::rope(&x, c.dims, c.traditional, base, c.scale, c.offset, freqs.as_ref()).unwrap();
        assert_eq!(got.shape(), c.shape);
        let mlx = values(&fast::rope(&x, c.dims, c.traditional, base, c.scale, c.offset, freqs.as_ref()).unwrap());
        let got = values(&got);
        let xs = logical(&x);
        let (d, l_count) = (*c.shape.last().unwrap() as usize, c.shape[c.shape.len() - 2] as usize);
        let inv: Vec<f64> = (0..half)
            .map(|i| match &freqs {
                Some(f) => 1.0 / values(f)[i] as f64,
                None => (-(i as f64) * (c.base as f64).ln() / half as f64).exp(),
            })
            .collect();
        for (r, row) in xs.chunks(d).enumerate() {
            let position = ((r % l_count) as f64 + c.offset as f64) * c.scale as f64;
            let mut exact = row.to_vec();
            let mut tol = vec![1e-30; d];
            for i in 0..half {
                let (a, b) = if c.traditional { (2 * i, 2 * i + 1) } else { (i, i + half) };
                let theta = position * inv[i];
                let (x1, x2) = (row[a], row[b]);
                exact[a] = x1 * theta.cos() - x2 * theta.sin();
                exact[b] = x1 * theta.sin() + x2 * theta.cos();
                // f32 angles: theta is off by a few ulp of itself.
                let t = (x1.abs() + x2.abs()) * (1e-6 + 4e-7 * theta.abs());
                tol[a] = t;
                tol[b] = t;
            }
            for i in 0..d {
                let at = r * d + i;
                assert!((got[at] as f64 - exact[i]).abs() <= tol[i], "case {n} row {r} [{i}]: {} against {}", got[at], exact[i]);
                assert!((mlx[at] as f64 - exact[i]).abs() <= tol[i], "MLX case {n} row {r} [{i}]");
            }
        }
    }
}

#[test]
fn rope_reuses_its_table_only_for_the_same_angles_and_falls_back_for_the_rest() {
    let x = normal(200, &[1, 3, 11, 32]);
    // The same call twice, then calls that differ in one parameter each: each
    // must equal a fresh computation's result (the table is rebuilt).
    let fresh = |offset: i32, scale: f32, base: f32| values(&fast::rope(&x, 32, false, base, scale, offset, None).unwrap());
    let ours = |offset: i32, scale: f32, base: f32| values(&kernels::rope(&x, 32, false, base, scale, offset, None).unwrap());
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| (p - q).abs() <= 1e-5 * (1.0 + q.abs()));
    for (offset, scale, base) in [(4, 1.0, 10000.0), (4, 1.0, 10000.0), (5, 1.0, 10000.0), (5, 0.5, 10000.0), (5, 0.5, 500.0)] {
        assert!(close(&ours(offset, scale, base), &fresh(offset, scale, base)), "offset {offset} scale {scale} base {base}");
    }
    // Alternating bases (Gemma 3's local and global layers) and more angle
    // sets than the tables kept, in turn.
    for _ in 0..2 {
        for base in [10000.0, 1_000_000.0, 10000.0, 500.0, 20.0, 7.0, 1_000_000.0] {
            assert!(close(&ours(3, 1.0, base), &fresh(3, 1.0, base)), "base {base}");
        }
    }
    // Two calls in one graph with different offsets.
    let a = kernels::rope(&x, 32, false, 10000.0, 1.0, 0, None).unwrap();
    let b = kernels::rope(&x, 32, false, 10000.0, 1.0, 9, None).unwrap();
    let sum = values(&a.add(&b).unwrap());
    let expect: Vec<f32> = fresh(0, 1.0, 10000.0).iter().zip(fresh(9, 1.0, 10000.0)).map(|(p, q)| p + q).collect();
    assert!(close(&sum, &expect));
    // float16 x: MLX's op, bit for bit; odd dims: MLX's error.
    let half = x.astype(Dtype::Float16).unwrap();
    assert_eq!(
        values(&kernels::rope(&half, 32, true, 10000.0, 1.0, 2, None).unwrap()),
        values(&fast::rope(&half, 32, true, 10000.0, 1.0, 2, None).unwrap())
    );
    assert!(kernels::rope(&x, 31, false, 10000.0, 1.0, 0, None).and_then(|a| a.eval()).is_err());
}
