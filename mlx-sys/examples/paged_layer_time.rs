//! CPU time per decode step of one fused decoder block (SmolLM2-135M's
//! shapes, 4-bit, random weights) at a long context, over a contiguous cache
//! and over a paged pool (consecutive and scattered block tables), in
//! interleaved rounds. CPU time, not wall time, so it means something on a
//! loaded machine. Run with MLXCEL_NUM_THREADS=1.
//!
//! `MLXCEL_NUM_THREADS=1 cargo run --release -p mlx-sys --example paged_layer_time [-- offset steps]`

use mlx_sys::kernels::{self, DecoderLayerSpec, DecoderLayerWeights, PagedSequence, PreparedDecoderLayer, QuantizedProjection};
use mlx_sys::{quantize, random, Array, Dtype};

mod common;
use common::cpu_seconds;

fn projection(seed: u64, n: i32, k: i32) -> mlx_sys::Result<QuantizedProjection> {
    let key = random::key(seed)?;
    let (weight, scales, biases) = quantize(&random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, &key)?, 32, 4)?;
    mlx_sys::eval([&weight, &scales, &biases])?;
    Ok(QuantizedProjection { weight, scales, biases, bias: None })
}

fn main() -> mlx_sys::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<i32>().ok());
    let offset = args.next().flatten().unwrap_or(512);
    let steps = args.next().flatten().unwrap_or(300);
    let (hidden, heads, kv_heads, d, inter) = (576, 9, 3, 64, 1536);
    let weights = DecoderLayerWeights {
        input_norm: Array::ones(&[hidden], Dtype::Float32)?,
        q_proj: projection(1, heads * d, hidden)?,
        k_proj: projection(2, kv_heads * d, hidden)?,
        v_proj: projection(3, kv_heads * d, hidden)?,
        o_proj: projection(4, hidden, heads * d)?,
        post_attention_norm: Array::ones(&[hidden], Dtype::Float32)?,
        gate_proj: projection(5, inter, hidden)?,
        up_proj: projection(6, inter, hidden)?,
        down_proj: projection(7, hidden, inter)?,
        q_norm: None,
        k_norm: None,
        rope_freqs: None,
        attn_out_norm: None,
        mlp_out_norm: None,
        router: None,
    };
    let spec = DecoderLayerSpec {
        hidden,
        heads,
        kv_heads,
        head_dim: d,
        intermediate: inter,
        offset,
        norm_eps: 1e-5,
        rope_dims: d,
        rope_base: 10000.0,
        rope_scale: 1.0,
        rope_traditional: false,
        rope_mscale: 1.0,
        attn_scale: (d as f32).powf(-0.5),
        cache_in_place: true,
        kv_window: 0,
        kv_keep: 0,
        kv_layer: 0,
        activation: 0,
        experts: 0,
        top_k: 0,
        routing: 0,
    };
    let layer = PreparedDecoderLayer::new(&weights, &spec)?;
    let key = random::key(9)?;
    let x = random::normal(&[1, 1, hidden], Dtype::Float32, 0.0, 1.0, &key)?;
    let capacity = offset + 256;
    let keys = random::normal(&[1, kv_heads, capacity, d], Dtype::Float32, 0.0, 1.0, &key)?;
    let values = random::normal(&[1, kv_heads, capacity, d], Dtype::Float32, 0.0, 1.0, &key)?;
    let blocks = 4 * (capacity / 16);
    let pool_k = random::normal(&[kv_heads, blocks, 16, d], Dtype::Float32, 0.0, 1.0, &key)?;
    let pool_v = random::normal(&[kv_heads, blocks, 16, d], Dtype::Float32, 0.0, 1.0, &key)?;
    mlx_sys::eval([&x, &keys, &values, &pool_k, &pool_v])?;
    let n = offset / 16 + 1;
    let consecutive: Vec<i32> = (0..n).collect();
    let scattered: Vec<i32> = (0..n).map(|i| (i * 7) % blocks).collect();
    println!("path={} threads={} offset={offset}, {steps} steps per round (CPU ms per step)", kernels::path_name(kernels::KernelPath::Auto), kernels::num_threads());
    for round in 1..=3 {
        let t0 = cpu_seconds();
        for _ in 0..steps {
            let (out, _, _) = layer.forward(&x, &keys, &values, &spec)?;
            out.eval()?;
        }
        let contiguous = (cpu_seconds() - t0) / steps as f64;
        let mut paged = Vec::new();
        for table in [&consecutive, &scattered] {
            let t0 = cpu_seconds();
            for _ in 0..steps {
                let (out, _, _) = layer.forward_paged(&x, &pool_k, &pool_v, &[PagedSequence { table, offset }], &spec)?;
                out.eval()?;
            }
            paged.push((cpu_seconds() - t0) / steps as f64);
        }
        println!(
            "round {round}: contiguous {:.3} ms, paged consecutive {:.3} ms ({:.2}x), paged scattered {:.3} ms ({:.2}x)",
            contiguous * 1e3,
            paged[0] * 1e3,
            paged[0] / contiguous,
            paged[1] * 1e3,
            paged[1] / contiguous
        );
    }
    Ok(())
}
