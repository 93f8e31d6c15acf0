//! MLX's op-by-op path (dense checkpoints) takes batched rows:
//! `forward_batch` over rows with different cache offsets runs the norms,
//! projections and MLP once over the batch, RoPE and attention per row, and
//! each row's logits must equal, bit for bit, what the row gets alone.

use std::path::{Path, PathBuf};

use mlx_sys::Array;
use mlxcel_models::cache::KvCache;
use mlxcel_models::model::{load_network, LanguageModel};

fn tiny_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny").join(name)
}

fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32]).unwrap()
}

/// Caches that have seen prompts of `prompt_lens[b]` tokens (offsets differ).
fn primed(model: &dyn LanguageModel, prompt_lens: &[usize]) -> Vec<Vec<Box<dyn KvCache>>> {
    prompt_lens
        .iter()
        .enumerate()
        .map(|(b, &n)| {
            let ids: Vec<i32> = (0..n as i32).map(|i| (i * 7 + b as i32 * 13 + 1) % 500).collect();
            let mut caches = model.new_caches();
            model.forward_last(&tokens(&ids), &mut caches).unwrap().eval().unwrap();
            caches
        })
        .collect()
}

/// B = 3 rows at offsets 5, 11 and 2, `new` new tokens each: the batch's
/// last-position logits equal each row's own `forward_last`, bit for bit,
/// and the caches advance alike.
fn check(name: &str, new: usize) {
    let (model, _) = load_network(&tiny_dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = model.as_ref();
    let offsets = [5usize, 11, 2];
    let rows: Vec<Vec<i32>> =
        (0..3).map(|b| (0..new as i32).map(|i| (i * 31 + b * 101 + 3) % 500).collect()).collect();

    let mut alone_caches = primed(model, &offsets);
    let alone: Vec<Vec<f32>> = rows
        .iter()
        .zip(alone_caches.iter_mut())
        .map(|(ids, caches)| {
            let logits = model.forward_last(&tokens(ids), caches).unwrap();
            logits.to_vec::<f32>().unwrap()
        })
        .collect();

    let mut batch_caches = primed(model, &offsets);
    let flat: Vec<i32> = rows.concat();
    let batch_tokens = Array::from_slice(&flat, &[3, new as i32]).unwrap();
    let mut views: Vec<&mut [Box<dyn KvCache>]> = batch_caches.iter_mut().map(|c| c.as_mut_slice()).collect();
    let logits = model.forward_batch(&batch_tokens, &mut views).unwrap();
    assert_eq!(logits.shape()[0], 3, "{name}");
    let vocab = logits.shape()[1] as usize;
    let batch = logits.to_vec::<f32>().unwrap();
    for b in 0..3 {
        let row = &batch[b * vocab..(b + 1) * vocab];
        assert_eq!(row.len(), alone[b].len(), "{name} row {b}");
        let differing = row.iter().zip(&alone[b]).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differing, 0, "{name}, {new} new tokens: row {b} differs from alone in {differing} of {vocab} logits");
        assert!(row.iter().any(|x| *x != 0.0), "{name} row {b}: all-zero logits");
        for (layer, (a, c)) in alone_caches[b].iter().zip(&batch_caches[b]).enumerate() {
            assert_eq!(a.offset(), c.offset(), "{name} row {b} layer {layer}");
            assert_eq!(c.offset(), offsets[b] + new, "{name} row {b} layer {layer}");
        }
    }
}

#[test]
fn dense_f32_batch_rows_equal_alone() {
    for new in [1, 4, 17] {
        check("llama", new);
    }
}

#[test]
fn dense_f16_and_bf16_batch_rows_equal_alone() {
    for name in ["llama_f16", "llama_bf16"] {
        for new in [1, 6] {
            check(name, new);
        }
    }
}

#[test]
fn qk_norm_and_qkv_bias_batch_rows_equal_alone() {
    // qwen3: per-head q/k norms; qwen2: q/k/v biases.
    for name in ["qwen3", "qwen2"] {
        for new in [1, 5, 20] {
            check(name, new);
        }
    }
}

#[test]
fn tied_and_scaled_rope_batch_rows_equal_alone() {
    for name in ["llama_tied", "llama_rope_llama3"] {
        check(name, 1);
        check(name, 3);
    }
}

#[test]
fn gemma2_olmo2_and_phi3_batch_rows_equal_alone() {
    // gemma2: soft-capped scores per row, final cap; olmo2: post-norms and
    // whole-projection q/k norms; phi3: split fused projections, su RoPE.
    // The 4-bit ones run the quantized kernels over the batch (phi3's the
    // fused block).
    for name in ["gemma2", "olmo2", "phi3_su", "gemma2_q4_g32", "olmo2_q4_g32", "phi3_q4_g32"] {
        for new in [1, 4, 17] {
            check(name, new);
        }
    }
}
