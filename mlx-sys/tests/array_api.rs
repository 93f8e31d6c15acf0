//! The safe Array API against values computed by hand.

use std::collections::BTreeMap;

use half::{bf16, f16};
use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::{concatenate, io, memory, quantize, quantized_matmul, random, where_, Array, Dtype};

fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn assert_close(actual: &[f32], expected: &[f32], tol: f32) {
    assert_eq!(actual.len(), expected.len(), "length");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!((a - e).abs() <= tol * (1.0 + e.abs()), "element {i}: {a} vs {e}");
    }
}

#[test]
fn round_trips_every_dtype() {
    let f = [1.5f32, -2.0, 3.25, 0.0];
    assert_eq!(arr(&f, &[2, 2]).to_vec::<f32>().unwrap(), f);
    let h: Vec<f16> = f.iter().map(|&x| f16::from_f32(x)).collect();
    assert_eq!(Array::from_slice(&h, &[4]).unwrap().to_vec::<f16>().unwrap(), h);
    let b: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(Array::from_slice(&b, &[4]).unwrap().to_vec::<bf16>().unwrap(), b);
    assert_eq!(Array::from_slice(&[1i32, -7], &[2]).unwrap().to_vec::<i32>().unwrap(), [1, -7]);
    assert_eq!(Array::from_slice(&[7u32, 9], &[2]).unwrap().to_vec::<u32>().unwrap(), [7, 9]);
    assert_eq!(Array::from_slice(&[0u8, 255], &[2]).unwrap().to_vec::<u8>().unwrap(), [0, 255]);
    assert_eq!(Array::from_slice(&[true, false], &[2]).unwrap().to_vec::<bool>().unwrap(), [true, false]);
    let a = arr(&f, &[2, 2]);
    assert_eq!(a.shape(), [2, 2]);
    assert_eq!(a.dtype(), Dtype::Float32);
    assert_eq!(a.size(), 4);
    assert_eq!(a.nbytes(), 16);
    a.eval().unwrap();
    assert_eq!(a.strides(), [2, 1]);
    assert_eq!(a.astype(Dtype::Float16).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(), f);
    // A transposed view reads back in logical row-major order.
    assert_eq!(a.transpose(&[1, 0]).unwrap().to_vec::<f32>().unwrap(), [1.5, 3.25, -2.0, 0.0]);
}

#[test]
fn errors_instead_of_aborting() {
    let a = arr(&[1.0; 6], &[2, 3]);
    let err = a.matmul(&a).unwrap_err();
    assert!(err.message().contains("matmul") || err.message().contains("shape"), "{err}");
    let err = Array::from_bytes(&[0u8; 7], &[2], Dtype::Float32).unwrap_err();
    assert!(err.message().contains("byte length 7"), "{err}");
    let err = a.to_vec::<i32>().unwrap_err();
    assert!(err.message().contains("dtype float32"), "{err}");
    let err = a.reshape(&[4, 2]).unwrap_err();
    assert!(!err.message().is_empty());
    // A bad dtype for an op: quantizing integers.
    let ints = Array::from_slice(&[1i32; 64], &[2, 32]).unwrap();
    assert!(quantize(&ints, 32, 4).is_err());
    let err = io::load_safetensors(std::path::Path::new("/nonexistent/model.safetensors")).unwrap_err();
    assert!(err.message().contains("/nonexistent/model.safetensors"), "{err}");
    // The process is still healthy.
    assert_eq!(a.sum(&[0, 1], false).unwrap().item::<f32>().unwrap(), 6.0);
}

#[test]
fn arithmetic_and_reductions() {
    let a = arr(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = arr(&[5.0, 6.0, 7.0, 8.0], &[2, 2]);
    assert_eq!(a.matmul(&b).unwrap().to_vec::<f32>().unwrap(), [19.0, 22.0, 43.0, 50.0]);
    assert_eq!(a.add(&b).unwrap().to_vec::<f32>().unwrap(), [6.0, 8.0, 10.0, 12.0]);
    assert_eq!(a.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), [2.0, 4.0, 6.0, 8.0]);
    assert_eq!(a.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(), [3.0, 7.0]);
    assert_eq!(a.max(&[0], true).unwrap().shape(), [1, 2]);
    assert_eq!(b.argmax(-1, false).unwrap().to_vec::<u32>().unwrap(), [1, 1]);
    let sm = arr(&[0.0, 0.0], &[2]).softmax(&[0], true).unwrap().to_vec::<f32>().unwrap();
    assert_close(&sm, &[0.5, 0.5], 1e-6);
    let lse = arr(&[0.0, 0.0], &[2]).logsumexp(&[0], false).unwrap().item::<f32>().unwrap();
    assert_close(&[lse], &[2f32.ln()], 1e-6);
    assert_eq!(arr(&[1.0, 2.0, 3.0], &[3]).cumsum(0, false, true).unwrap().to_vec::<f32>().unwrap(), [1.0, 3.0, 6.0]);
    let cond = Array::from_slice(&[true, false], &[2]).unwrap();
    let w = where_(&cond, &arr(&[1.0, 1.0], &[2]), &arr(&[9.0, 9.0], &[2])).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), [1.0, 9.0]);
    let silu = arr(&[0.0, 1.0], &[2]).silu().unwrap().to_vec::<f32>().unwrap();
    assert_close(&silu, &[0.0, 1.0 / (1.0 + (-1f32).exp())], 1e-6);
}

#[test]
fn sorting_and_selection() {
    let v = arr(&[3.0, 1.0, 4.0, 1.5, 9.0, 2.0], &[6]);
    assert_eq!(v.sort(0).unwrap().to_vec::<f32>().unwrap(), [1.0, 1.5, 2.0, 3.0, 4.0, 9.0]);
    assert_eq!(v.argsort(0).unwrap().to_vec::<u32>().unwrap(), [1, 3, 5, 0, 2, 4]);
    let mut top = v.topk(2, 0).unwrap().to_vec::<f32>().unwrap();
    top.sort_by(f32::total_cmp);
    assert_eq!(top, [4.0, 9.0]);
    let part = v.argpartition(3, 0).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(part[3], 0, "index of the 4th smallest (3.0)");
    let idx = Array::from_slice(&[2i32, 0], &[2]).unwrap();
    assert_eq!(v.take(&idx, 0).unwrap().to_vec::<f32>().unwrap(), [4.0, 3.0]);
    let m = arr(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let rows = Array::from_slice(&[2i32, 0], &[2]).unwrap();
    assert_eq!(m.gather(&[rows], &[0], &[1, 2]).unwrap().reshape(&[4]).unwrap().to_vec::<f32>().unwrap(), [5.0, 6.0, 1.0, 2.0]);
    let along = Array::from_slice(&[1i32, 0, 1], &[3, 1]).unwrap();
    assert_eq!(m.take_along_axis(&along, 1).unwrap().to_vec::<f32>().unwrap(), [2.0, 3.0, 6.0]);
}

#[test]
fn slicing_and_joining() {
    let m = arr(&(0..12).map(|x| x as f32).collect::<Vec<_>>(), &[3, 4]);
    let s = m.slice(&[1, 1], &[3, 3], &[1, 1]).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), [5.0, 6.0, 9.0, 10.0]);
    assert_eq!(m.slice_axis(1, 3, 4).unwrap().to_vec::<f32>().unwrap(), [3.0, 7.0, 11.0]);
    let z = Array::zeros(&[2, 2], Dtype::Float32).unwrap();
    let u = m.slice_update(&z, &[0, 0], &[2, 2], &[1, 1]).unwrap();
    assert_eq!(u.slice_axis(0, 0, 1).unwrap().to_vec::<f32>().unwrap(), [0.0, 0.0, 2.0, 3.0]);
    let c = concatenate(&[m.clone(), m.clone()], 0).unwrap();
    assert_eq!(c.shape(), [6, 4]);
    assert_eq!(m.reshape(&[2, -1]).unwrap().shape(), [2, 6]);
    assert_eq!(m.expand_dims(0).unwrap().shape(), [1, 3, 4]);
    assert_eq!(Array::arange(0.0, 5.0, 1.0, Dtype::Int32).unwrap().to_vec::<i32>().unwrap(), [0, 1, 2, 3, 4]);
}

#[test]
fn quantization_round_trip() {
    let key = random::key(7).unwrap();
    let w = random::normal(&[64, 128], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let x = random::normal(&[3, 128], Dtype::Float32, 0.0, 1.0, &random::split(&key, 2).unwrap()[1]).unwrap();
    for (bits, group) in [(4, 32), (8, 64), (3, 128), (6, 32), (2, 64), (5, 32)] {
        let (q, scales, biases) = quantize(&w, group, bits).unwrap();
        assert_eq!(q.dtype(), Dtype::Uint32);
        assert_eq!(q.shape(), [64, 128 * bits / 32]);
        assert_eq!(scales.shape(), [64, 128 / group]);
        let deq = mlx_sys::dequantize(&q, &scales, &biases, group, bits).unwrap();
        let err = deq.subtract(&w).unwrap().abs().unwrap().max(&[0, 1], false).unwrap().item::<f32>().unwrap();
        let step_bound = 8.0 / ((1 << bits) - 1) as f32; // |w| < ~4 sigma
        assert!(err <= step_bound, "bits {bits}: max error {err}");
        let y = quantized_matmul(&x, &q, &scales, &biases, true, group, bits).unwrap();
        let reference = x.matmul(&deq.transpose(&[1, 0]).unwrap()).unwrap();
        assert_close(&y.to_vec::<f32>().unwrap(), &reference.to_vec::<f32>().unwrap(), 1e-3);
    }
}

#[test]
fn fast_ops_match_their_definitions() {
    let key = random::key(1).unwrap();
    let x = random::normal(&[2, 8], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let w = arr(&[0.5; 8], &[8]);
    let y = fast::rms_norm(&x, Some(&w), 1e-5).unwrap();
    let ms = x.square().unwrap().mean(&[-1], true).unwrap().add_scalar(1e-5).unwrap().rsqrt().unwrap();
    let expected = x.multiply(&ms).unwrap().multiply(&w).unwrap();
    assert_close(&y.to_vec::<f32>().unwrap(), &expected.to_vec::<f32>().unwrap(), 1e-5);

    let ln = fast::layer_norm(&x, None, None, 1e-5).unwrap();
    let mean = ln.mean(&[-1], false).unwrap().to_vec::<f32>().unwrap();
    assert_close(&mean, &[0.0, 0.0], 1e-5);

    // RoPE at position 0 is the identity; at position p it rotates pairs by p * theta_i.
    let v = arr(&[1.0, 0.0, 1.0, 0.0], &[1, 1, 1, 4]);
    assert_close(&fast::rope(&v, 4, false, 10000.0, 1.0, 0, None).unwrap().to_vec::<f32>().unwrap(), &[1.0, 0.0, 1.0, 0.0], 1e-6);
    let r = fast::rope(&v, 4, false, 10000.0, 1.0, 1, None).unwrap().to_vec::<f32>().unwrap();
    // The non-traditional layout rotates the pairs (x0, x2) and (x1, x3); theta_0 = 1.
    let (c, s) = (1f32.cos(), 1f32.sin());
    assert_close(&r, &[c - s, 0.0, s + c, 0.0], 1e-5);

    // Attention with one key returns its value.
    let q = random::normal(&[1, 2, 3, 4], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let k = random::normal(&[1, 1, 3, 4], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let vv = random::normal(&[1, 1, 3, 4], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let out = fast::scaled_dot_product_attention(&q, &k, &vv, 0.5, AttentionMask::Causal).unwrap();
    assert_eq!(out.shape(), [1, 2, 3, 4]);
    let first = out.slice(&[0, 0, 0, 0], &[1, 1, 1, 4], &[1, 1, 1, 1]).unwrap().to_vec::<f32>().unwrap();
    let v0 = vv.slice(&[0, 0, 0, 0], &[1, 1, 1, 4], &[1, 1, 1, 1]).unwrap().to_vec::<f32>().unwrap();
    assert_close(&first, &v0, 1e-5);
}

#[test]
fn random_is_reproducible_from_keys() {
    let a = random::uniform(0.0, 1.0, &[16], Dtype::Float32, &random::key(3).unwrap()).unwrap();
    let b = random::uniform(0.0, 1.0, &[16], Dtype::Float32, &random::key(3).unwrap()).unwrap();
    let c = random::uniform(0.0, 1.0, &[16], Dtype::Float32, &random::key(4).unwrap()).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_ne!(a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    let logits = arr(&[0.0, 100.0, 0.0], &[1, 3]);
    assert_eq!(random::categorical(&logits, -1, &random::key(0).unwrap()).unwrap().to_vec::<u32>().unwrap(), [1]);
}

#[test]
fn safetensors_round_trip_and_memory_counters() {
    let dir = std::env::temp_dir().join(format!("mlx-sys-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    let mut arrays = BTreeMap::new();
    arrays.insert("a".to_string(), arr(&[1.0, 2.0], &[2]));
    arrays.insert("b".to_string(), Array::from_slice(&[3i32], &[1]).unwrap());
    let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    io::save_safetensors(&path, &arrays, &meta).unwrap();
    let loaded = io::load_safetensors(&path).unwrap();
    assert_eq!(loaded.arrays["a"].to_vec::<f32>().unwrap(), [1.0, 2.0]);
    assert_eq!(loaded.arrays["b"].to_vec::<i32>().unwrap(), [3]);
    assert_eq!(loaded.metadata["format"], "mlx");
    std::fs::remove_dir_all(&dir).unwrap();

    memory::reset_peak_memory();
    let big = Array::ones(&[1024, 1024], Dtype::Float32).unwrap();
    mlx_sys::async_eval([&big]).unwrap();
    big.eval().unwrap();
    assert!(memory::active_memory() >= 4 << 20);
    assert!(memory::peak_memory() >= 4 << 20);
    let previous = memory::set_cache_limit(1 << 20).unwrap();
    memory::set_cache_limit(previous).unwrap();
}

/// Reading a result waits for that result only, not for work queued after
/// it: the engine queues the next decode step before it reads the token the
/// last one sampled.
#[test]
fn reading_a_result_does_not_wait_for_later_work() {
    let a = arr(&[1.0, 2.0], &[2]).mul_scalar(3.0).unwrap();
    mlx_sys::async_eval([&a]).unwrap();
    // About a second of work on one core, queued after `a`.
    let mut later = Array::ones(&[2048, 2048], Dtype::Float32).unwrap();
    for _ in 0..48 {
        later = later.tanh().unwrap().mul_scalar(1.5).unwrap();
    }
    mlx_sys::async_eval([&later]).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), [3.0, 6.0]);
    assert!(!later.is_available(), "reading `a` waited for the work queued after it");
    later.eval().unwrap();
    assert!(later.is_available());
}

#[test]
fn links_openblas_on_linux() {
    assert_eq!(mlx_sys::mlx_version(), mlx_sys::MLX_PIN);
    if !cfg!(target_os = "linux") {
        assert_eq!(mlx_sys::BLAS_BACKEND, "platform");
        return;
    }
    // What build.rs's probe sees on this machine now (build.rs reruns when
    // that changes): libopenblas.so in the multiarch folder where there is
    // one, else in /usr/lib64 or /usr/lib.
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let dirs = if std::path::Path::new(&multiarch).is_dir() { vec![multiarch] } else { vec!["/usr/lib64".into(), "/usr/lib".into()] };
    let found = dirs.iter().any(|d| std::path::Path::new(d).join("libopenblas.so").exists());
    // MLXCEL_BLAS at build time (this test is rebuilt when it changes).
    let bundled = option_env!("MLXCEL_BLAS") == Some("bundled");
    let expected = if found && !bundled { "openblas" } else { "bundled" };
    assert_eq!(
        mlx_sys::BLAS_BACKEND,
        expected,
        "libopenblas.so found: {found}, MLXCEL_BLAS=bundled: {bundled}; a stale build.rs result?"
    );
    // The process really has OpenBLAS mapped, or really does not.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert_eq!(maps.contains("libopenblas"), expected == "openblas", "libopenblas in /proc/self/maps");
    if expected == "openblas" {
        assert!(mlx_sys::blas_threads() >= 1);
    }
}

#[test]
fn streams_and_devices() {
    use mlx_sys::{Device, Stream};
    assert!(Device::Cpu.is_available().unwrap());
    let stream = Stream::new(Device::Cpu).unwrap();
    assert_eq!(stream.device(), Device::Cpu);
    let previous = Stream::default_for(Device::Cpu).unwrap();
    stream.set_default().unwrap();
    let y = arr(&[1.0, 2.0], &[2]).mul_scalar(3.0).unwrap();
    mlx_sys::async_eval([&y]).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), [3.0, 6.0]);
    previous.set_default().unwrap();
    // Without a GPU build, asking for the GPU is an error, not an abort.
    if !Device::Gpu.is_available().unwrap() {
        assert!(Stream::new(Device::Gpu).is_err());
    }
}
