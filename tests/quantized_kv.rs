//! The 8-bit KV cache on the real default model (SmolLM2-135M-Instruct,
//! 4-bit), against mlx-lm's `QuantizedKVCache(group_size=64, bits=8)`
//! (tests/reference/make_quantized_kv_goldens.py: the checkpoint dequantized
//! to float32, the prompt in one pass), and the memory it saves.

use std::sync::Arc;

use mlx_sys::kernels::KvWindow;
use mlx_sys::{Array, Dtype};
use mlxcel_engine::{Engine, EngineLimits, Error, GenerationRequest, KvFormat, LimitOptions, Prompt, SamplingParams};
use mlxcel_models::paged::{KvPool, PagedKvCache, RowBlocks, BLOCK_TOKENS};
use mlxcel_tests::{default_engine, repo_root};
use serde_json::Value;

fn goldens() -> Value {
    let path = repo_root().join("tests/reference/goldens/smollm2_kv8.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn engine_with(limits: EngineLimits) -> Engine {
    Engine::with_limits(default_engine().model().clone(), limits).unwrap()
}

fn eight_bit() -> EngineLimits {
    EngineLimits { kv_format: KvFormat::Q8, ..Default::default() }
}

/// Prompt ids, greedy, EOS ignored, prompts cut into `prefill_chunk` tokens.
fn greedy_ids(ids: &[u32], max_tokens: usize, prefill_chunk: usize) -> GenerationRequest {
    GenerationRequest {
        params: SamplingParams { max_tokens, ..Default::default() },
        prefill_chunk,
        ignore_eos: true,
        ..GenerationRequest::new(Prompt::Tokens(ids.to_vec()))
    }
}

/// Every position's logits of prompt + reference continuation over one row
/// of an 8-bit pool, fed `chunk` tokens per forward pass (over 32: the
/// prefill kernels) or the prompt in one pass and then one token at a time
/// (`chunk` 0: the fused decode block, as the reference decodes); returns
/// the worst |Δlogit| at the reference's top-16 tokens, and the worst and
/// the mean |Δlogsumexp|.
fn teacher_forced(golden: &Value, ids: &[u32], chunk: usize) -> (f32, f32, f32) {
    let engine = default_engine();
    let network = engine.model().network();
    let pool = KvPool::new(network.shape(), 64 << 20, true, KvWindow::ALL, KvFormat::Q8).unwrap();
    let blocks = RowBlocks::new(pool.clone(), Vec::new(), pool.reserve(KvPool::blocks_for(ids.len())).unwrap());
    let mut caches = PagedKvCache::for_row(blocks, network.shape().num_layers, 0);
    let prompt = golden["input_ids"].as_array().unwrap().len();
    let pieces: Vec<&[u32]> = if chunk == 0 {
        std::iter::once(&ids[..prompt]).chain(ids[prompt..].chunks(1)).collect()
    } else {
        ids.chunks(chunk).collect()
    };
    let (mut worst_logit, mut worst_lse, mut sum_lse, mut p) = (0f32, 0f32, 0f32, 0);
    for piece in pieces {
        let input: Vec<i32> = piece.iter().map(|&t| t as i32).collect();
        let tokens = Array::from_slice(&input, &[1, input.len() as i32]).unwrap();
        let logits = network.forward(&tokens, &mut caches).unwrap().astype(Dtype::Float32).unwrap();
        let lse = logits.logsumexp(&[-1], false).unwrap().to_vec::<f32>().unwrap();
        let logits = logits.to_vec::<f32>().unwrap();
        let vocab = logits.len() / piece.len();
        for i in 0..piece.len() {
            for (k, id) in golden["top_ids"][p].as_array().unwrap().iter().enumerate() {
                let want = golden["top_logits"][p][k].as_f64().unwrap() as f32;
                worst_logit = worst_logit.max((logits[i * vocab + id.as_u64().unwrap() as usize] - want).abs());
            }
            let d = (lse[i] - golden["logsumexp"][p].as_f64().unwrap() as f32).abs();
            worst_lse = worst_lse.max(d);
            sum_lse += d;
            p += 1;
        }
    }
    (worst_logit, worst_lse, sum_lse / p as f32)
}

/// Prefill and decode over the 8-bit pool give mlx-lm's logits at every
/// position of prompt + continuation, with the prompt in one pass or in
/// chunks, within 1.5 times mlx-lm's own last-bit envelope (the goldens'
/// `last_bit_envelope`: how far mlx-lm moves when its keys and values are
/// perturbed by 1e-6 relative before they are quantized, about 0.26 logit
/// and 0.14 logsumexp at worst, 0.037 logsumexp on average). Rows whose
/// f32 keys are equal quantize bit for bit as `mx.quantize` does (the
/// kernel tests in mlx-sys/tests/decoder_layer.rs); the two f32 models
/// differ in the last bits, and 8-bit rounding edges amplify that.
#[test]
fn eight_bit_logits_match_mlx_lm() {
    let golden = goldens();
    let envelope = |key: &str| 1.5 * golden["last_bit_envelope"][key].as_f64().unwrap() as f32;
    let mut ids = u32s(&golden["input_ids"]);
    ids.extend(u32s(&golden["tokens"]));
    ids.truncate(golden["top_ids"].as_array().unwrap().len());
    for chunk in [0, ids.len(), 37] {
        let (logit, lse, mean) = teacher_forced(&golden, &ids, chunk);
        eprintln!("8-bit KV, chunks of {chunk}: max |Δlogit| {logit:.3}, |Δlogsumexp| max {lse:.3}, mean {mean:.4}");
        assert!(logit <= envelope("max_logit"), "chunks of {chunk}: |Δlogit| {logit}");
        assert!(lse <= envelope("max_logsumexp") && mean <= envelope("mean_logsumexp"), "chunks of {chunk}: |Δlogsumexp| {lse}, mean {mean}");
    }
}

/// Decoding through the engine with `kv_bits` 8 gives mlx-lm's greedy
/// tokens, with the prompt in one chunk or many (a first difference only at
/// a near tie, top-2 gap < 0.02, as in the f32 parity test).
#[test]
fn eight_bit_greedy_tokens_match_mlx_lm() {
    let golden = goldens();
    let ids = u32s(&golden["input_ids"]);
    let want = u32s(&golden["tokens"]);
    let gaps: Vec<f64> = golden["top2_gap"].as_array().unwrap().iter().map(|g| g.as_f64().unwrap()).collect();
    let engine = engine_with(eight_bit());
    for chunk in [512, 48] {
        let got = engine.generate(&greedy_ids(&ids, want.len(), chunk), |_| true).unwrap().tokens;
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => assert_eq!(got.len(), want.len()),
            Some(step) => assert!(
                gaps[step] < 0.02,
                "chunks of {chunk}: token {step} differs ({} vs {}) where the reference's top-2 gap is {}",
                got[step], want[step], gaps[step]
            ),
        }
    }
}

/// An 8-bit row holds 72 bytes per position, head and layer for 64-feature
/// heads, against 256 in f32 (3.56 times fewer), and the pool holds as many
/// more positions in the same budget.
#[test]
fn eight_bit_rows_take_72_of_256_bytes() {
    let ids = u32s(&goldens()["input_ids"]);
    let request = greedy_ids(&ids, 100, 64);
    let full = default_engine().generate(&request, |_| true).unwrap();
    let engine = engine_with(eight_bit());
    let small = engine.generate(&request, |_| true).unwrap();
    let shape = engine.model().network().shape();
    assert_eq!(shape.head_dim, 64);
    let blocks = (ids.len() + 99).div_ceil(BLOCK_TOKENS);
    assert_eq!(full.stats.kv_cache_bytes, blocks * 2 * shape.num_layers * shape.kv_heads * BLOCK_TOKENS * 256);
    assert_eq!(small.stats.kv_cache_bytes, blocks * 2 * shape.num_layers * shape.kv_heads * BLOCK_TOKENS * 72);
    assert_eq!(engine.kv_pool().usage().total, engine.kv_pool().budget_bytes() / engine.kv_pool().block_bytes());
    assert_eq!(engine.kv_pool().block_bytes() * 256, default_engine().kv_pool().block_bytes() * 72);
    eprintln!("KV bytes of 200 + 100 positions: {} in f32, {} in 8 bits", full.stats.kv_cache_bytes, small.stats.kv_cache_bytes);
}

/// Rows of an 8-bit engine are batch invariant and prefix-cache invariant,
/// with and without a window: each gets the tokens it gets alone with a
/// cold cache.
#[test]
fn eight_bit_rows_match_alone_in_a_batch_and_from_the_cache() {
    let ids = u32s(&goldens()["input_ids"]);
    let prompts: Vec<Vec<u32>> = vec![ids[..150].to_vec(), ids[20..200].to_vec(), ids[..40].to_vec(), ids[..180].to_vec()];
    let requests: Vec<GenerationRequest> = prompts.iter().map(|p| greedy_ids(p, 40, 64)).collect();
    for limits in [eight_bit(), EngineLimits { max_kv_size: Some(90), ..eight_bit() }] {
        let cold = |request: &GenerationRequest| {
            engine_with(limits).generate(&GenerationRequest { cache_prompt: false, ..request.clone() }, |_| true).unwrap().tokens
        };
        let alone: Vec<Vec<u32>> = requests.iter().map(cold).collect();
        let engine = engine_with(limits);
        let batch: Vec<Vec<u32>> = engine.generate_batch(&requests).into_iter().map(|r| r.unwrap().tokens).collect();
        assert_eq!(batch, alone, "{limits:?}: batched rows differ from alone");
        let again = engine.generate(&requests[3], |_| true).unwrap();
        assert!(again.stats.cached_tokens >= 144, "cached {}", again.stats.cached_tokens);
        assert_eq!(again.tokens, alone[3], "{limits:?}: a cache hit changed the tokens");
    }
}

/// The 8-bit pool's resident memory follows its block accounting within a
/// page at each end of every block (a block is 50.6 pages for SmolLM2):
/// freed blocks hand their pages back.
#[test]
fn eight_bit_resident_memory_follows_the_block_accounting() {
    let engine = engine_with(eight_bit());
    let pool = engine.kv_pool().clone();
    let (block, page) = (pool.block_bytes(), 4096);
    let checks = Arc::new(std::sync::Mutex::new(Vec::new()));
    let ids = u32s(&goldens()["input_ids"]);
    std::thread::scope(|s| {
        for i in 0..3 {
            let (pool, checks, engine, prompt) = (pool.clone(), checks.clone(), engine.clone(), ids[i * 30..].to_vec());
            s.spawn(move || {
                let mut pieces = 0;
                let request = GenerationRequest { cache_prompt: i != 1, ..greedy_ids(&prompt, 60 + 20 * i, 64) };
                engine
                    .generate(&request, |_| {
                        pieces += 1;
                        if pieces % 10 == 0 {
                            checks.lock().unwrap().push((pool.usage(), pool.resident_bytes().unwrap()));
                        }
                        true
                    })
                    .unwrap();
            });
        }
    });
    let checks = checks.lock().unwrap();
    assert!(checks.len() >= 6, "{}", checks.len());
    for (usage, resident) in checks.iter() {
        let held = usage.in_use + usage.cached_idle;
        let accounted = held * block;
        let at_most = accounted + usage.unmapping * block + 2 * page * held;
        assert!(*resident <= at_most, "{resident} resident > {at_most} ({usage:?})");
        assert!(*resident as f64 <= 1.05 * (accounted + usage.unmapping * block) as f64, "{resident} resident, {accounted} accounted");
        assert!(*resident + 3 * block >= accounted, "{resident} resident, {accounted} accounted ({usage:?})");
    }
    let usage = pool.usage();
    assert_eq!(usage.in_use, 0);
    assert!(usage.cached_idle >= 2, "{usage:?}");
    let resident = pool.resident_bytes().unwrap();
    let cached = usage.cached_idle * block;
    assert!(resident <= cached + 2 * page * usage.cached_idle && resident + 2 * page * usage.cached_idle >= cached, "{resident} resident, {cached} cached");
}

#[test]
fn kv_bits_other_than_8_are_refused_with_the_option_named() {
    for bits in [0, 4, 16, -8] {
        match (LimitOptions { kv_bits: Some(bits), ..Default::default() }).resolve() {
            Err(Error::InvalidParameter { name, message }) => {
                assert_eq!(name, "kv_bits");
                assert!(message.contains(&format!("must be 8 (8-bit keys and values, group 64")) && message.contains(&format!("got {bits}")), "{message}");
            }
            other => panic!("kv_bits {bits}: {other:?}"),
        }
    }
    let limits = LimitOptions { kv_bits: Some(8), ..Default::default() }.resolve().unwrap();
    assert_eq!(limits.kv_format, KvFormat::Q8);
    assert_eq!(LimitOptions::default().resolve().unwrap().kv_format, KvFormat::F32);
}
