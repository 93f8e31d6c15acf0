//! The rotating (sliding-window) KV cache on the real default model
//! (SmolLM2-135M-Instruct, 4-bit), against mlx-lm's `RotatingKVCache`
//! (tests/reference/make_rotating_goldens.py: the checkpoint dequantized to
//! float32, the prompt fed one token at a time), and the memory it saves.

use mlx_sys::kernels::KvWindow;
use mlx_sys::{Array, Dtype};
use mlxcel_engine::{Engine, EngineLimits, Error, GenerationRequest, LimitOptions, Prompt, SamplingParams};
use mlxcel_models::paged::{KvPool, PagedKvCache, RowBlocks, BLOCK_TOKENS};
use mlxcel_tests::{default_engine, repo_root, smollm2_sequence_tolerance};
use serde_json::Value;

fn goldens() -> Value {
    let path = repo_root().join("tests/reference/goldens/smollm2_rotating.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn window_of(case: &Value) -> (usize, usize) {
    (case["max_size"].as_u64().unwrap() as usize, case["keep"].as_u64().unwrap() as usize)
}

fn rotating_engine(max_kv_size: usize, kv_keep: usize) -> Engine {
    let limits = EngineLimits { max_kv_size: Some(max_kv_size), kv_keep, ..Default::default() };
    Engine::with_limits(default_engine().model().clone(), limits).unwrap()
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

/// Every position's logits of prompt + reference continuation over one
/// windowed row of the paged pool, fed `chunk` tokens per forward pass;
/// returns the worst |Δlogit| at the reference's top-16 tokens and the worst
/// |Δlogsumexp|, and the most blocks the row held.
fn teacher_forced(case: &Value, ids: &[u32], chunk: usize) -> (f32, f32, usize) {
    let engine = default_engine();
    let network = engine.model().network();
    let (max_size, keep) = window_of(case);
    let window = KvWindow { window: (max_size - keep) as i32, keep: keep as i32 };
    let pool = KvPool::new(network.shape(), 64 << 20, true, window, Default::default()).unwrap();
    let bound = pool.window_blocks(ids.len(), chunk);
    let blocks = RowBlocks::new(pool.clone(), Vec::new(), pool.reserve(bound).unwrap());
    let mut caches = PagedKvCache::for_row(blocks, network.shape().num_layers, 0);
    let (mut worst_logit, mut worst_lse, mut most_held) = (0f32, 0f32, 0);
    for (c, piece) in ids.chunks(chunk).enumerate() {
        let input: Vec<i32> = piece.iter().map(|&t| t as i32).collect();
        let tokens = Array::from_slice(&input, &[1, input.len() as i32]).unwrap();
        let logits = network.forward(&tokens, &mut caches).unwrap().astype(Dtype::Float32).unwrap();
        let lse = logits.logsumexp(&[-1], false).unwrap().to_vec::<f32>().unwrap();
        let logits = logits.to_vec::<f32>().unwrap();
        let vocab = logits.len() / piece.len();
        for i in 0..piece.len() {
            let p = c * chunk + i;
            let top = &case["top_ids"][p];
            for (k, id) in top.as_array().unwrap().iter().enumerate() {
                let want = case["top_logits"][p][k].as_f64().unwrap() as f32;
                worst_logit = worst_logit.max((logits[i * vocab + id.as_u64().unwrap() as usize] - want).abs());
            }
            worst_lse = worst_lse.max((lse[i] - case["logsumexp"][p].as_f64().unwrap() as f32).abs());
        }
        let paged = caches[0].as_paged().unwrap();
        most_held = most_held.max(paged.row_blocks().lock().unwrap().held());
    }
    (worst_logit, worst_lse, most_held)
}

/// Prefill over the window, in one pass and in chunks, gives mlx-lm's
/// logits at every position (the same tolerance as the full-attention
/// teacher-forced test), and the row never holds more than its bound.
#[test]
fn windowed_prefill_matches_mlx_lm() {
    let goldens = goldens();
    for case in goldens["cases"].as_array().unwrap() {
        let mut ids = u32s(&goldens["input_ids"]);
        ids.extend(u32s(&case["tokens"]));
        // The reference records logits up to the last token's input; whole
        // chunks of 37 tokens (over 32: every pass runs the prefill kernels).
        const CHUNK: usize = 37;
        ids.truncate(case["top_ids"].as_array().unwrap().len() / CHUNK * CHUNK);
        for chunk in [ids.len(), CHUNK] {
            let (logit, lse, held) = teacher_forced(case, &ids, chunk);
            eprintln!("window {:?}, chunks of {chunk}: max |Δlogit| {logit:.2e}, |Δlogsumexp| {lse:.2e}, {held} blocks held", window_of(case));
            let tolerance = smollm2_sequence_tolerance();
            assert!(logit <= tolerance && lse <= tolerance, "window {:?}, chunks of {chunk}: {logit} / {lse}", window_of(case));
            let (max_size, _) = window_of(case);
            if chunk < ids.len() {
                // One pass reads every block; chunks hand back what later ones do not see.
                assert!(held <= (max_size + 2 * chunk).div_ceil(BLOCK_TOKENS) + 2, "{held} blocks held");
                assert!(held < ids.len().div_ceil(BLOCK_TOKENS), "the row kept every block ({held})");
            }
        }
    }
}

/// Decoding through the engine with `max_kv_size` gives mlx-lm's greedy
/// tokens (a first difference only at a near tie, top-2 gap < 0.02, as in
/// the full-attention parity test), with the prompt in one chunk or many.
#[test]
fn windowed_greedy_tokens_match_mlx_lm() {
    let goldens = goldens();
    let ids = u32s(&goldens["input_ids"]);
    for case in goldens["cases"].as_array().unwrap() {
        let (max_size, keep) = window_of(case);
        let engine = rotating_engine(max_size, keep);
        let want = u32s(&case["tokens"]);
        let gaps: Vec<f64> = case["top2_gap"].as_array().unwrap().iter().map(|g| g.as_f64().unwrap()).collect();
        for chunk in [512, 48] {
            let got = engine.generate(&greedy_ids(&ids, want.len(), chunk), |_| true).unwrap().tokens;
            match got.iter().zip(&want).position(|(a, b)| a != b) {
                None => assert_eq!(got.len(), want.len()),
                Some(step) => assert!(
                    gaps[step] < 0.02,
                    "window {:?}, chunks of {chunk}: token {step} differs ({} vs {}) where the reference's top-2 gap is {}",
                    (max_size, keep), got[step], want[step], gaps[step]
                ),
            }
        }
    }
}

/// A long generation under a window holds a bounded number of blocks (its
/// stats' KV bytes), far fewer than without one, and gives them all back.
#[test]
fn a_rotating_row_holds_only_its_window() {
    let ids = u32s(&goldens()["input_ids"]);
    let request = greedy_ids(&ids, 200, 64);
    let full = default_engine().generate(&request, |_| true).unwrap();
    let engine = rotating_engine(90, 4);
    let rotating = engine.generate(&request, |_| true).unwrap();
    let pool = engine.kv_pool();
    let bound = pool.window_blocks(ids.len() + 200, 64);
    eprintln!(
        "KV bytes of 200 + 200 positions: {} without a window, {} with max_kv_size 90 (bound {} blocks of {})",
        full.stats.kv_cache_bytes,
        rotating.stats.kv_cache_bytes,
        bound,
        pool.block_bytes()
    );
    assert_eq!(full.stats.kv_cache_bytes, (ids.len() + 199).div_ceil(BLOCK_TOKENS) * pool.block_bytes());
    assert!(rotating.stats.kv_cache_bytes <= bound * pool.block_bytes(), "{}", rotating.stats.kv_cache_bytes);
    assert!(rotating.stats.kv_cache_bytes * 3 < full.stats.kv_cache_bytes);
    assert_eq!(pool.usage().in_use, 0);
    assert_eq!(pool.usage().reserved, 0);
}

/// Rows of a windowed engine are batch invariant and prefix-cache invariant:
/// each gets the tokens it gets alone with a cold cache.
#[test]
fn windowed_rows_match_alone_in_a_batch_and_from_the_cache() {
    let ids = u32s(&goldens()["input_ids"]);
    let prompts: Vec<Vec<u32>> = vec![ids[..150].to_vec(), ids[20..200].to_vec(), ids[..40].to_vec(), ids[..180].to_vec()];
    let requests: Vec<GenerationRequest> = prompts.iter().map(|p| greedy_ids(p, 40, 64)).collect();
    let cold = |request: &GenerationRequest| {
        let engine = rotating_engine(90, 4);
        engine.generate(&GenerationRequest { cache_prompt: false, ..request.clone() }, |_| true).unwrap().tokens
    };
    let alone: Vec<Vec<u32>> = requests.iter().map(cold).collect();
    let engine = rotating_engine(90, 4);
    let batch: Vec<Vec<u32>> = engine.generate_batch(&requests).into_iter().map(|r| r.unwrap().tokens).collect();
    assert_eq!(batch, alone, "batched rows differ from alone");
    // The 180-token prompt shares 150 tokens' blocks with the first; run again, it is a cache hit.
    let again = engine.generate(&requests[3], |_| true).unwrap();
    assert!(again.stats.cached_tokens >= 144, "cached {}", again.stats.cached_tokens);
    assert_eq!(again.tokens, alone[3], "a cache hit changed the tokens");
}

#[test]
fn invalid_windows_are_refused_with_the_option_named() {
    let cases = [
        (LimitOptions { max_kv_size: Some(4), ..Default::default() }, "must be larger than kv_keep (4), got 4"),
        (LimitOptions { max_kv_size: Some(8), kv_keep: Some(8), ..Default::default() }, "must be larger than kv_keep (8)"),
        (LimitOptions { max_kv_size: Some(0), ..Default::default() }, "must be an integer in [1, 2**31), got 0"),
        (LimitOptions { max_kv_size: Some(1 << 31), ..Default::default() }, "got 2147483648"),
        (LimitOptions { max_kv_size: Some(64), kv_keep: Some(-1), ..Default::default() }, "got -1"),
    ];
    for (options, message) in cases {
        match options.resolve() {
            Err(Error::InvalidParameter { name, message: got }) => {
                assert!(name == "max_kv_size" || name == "kv_keep", "{name}");
                assert!(got.contains(message), "{got}");
            }
            other => panic!("{options:?}: {other:?}"),
        }
    }
    let limits = LimitOptions { max_kv_size: Some(64), kv_keep: Some(0), ..Default::default() }.resolve().unwrap();
    assert_eq!(limits.window().unwrap(), KvWindow { window: 64, keep: 0 });
}
