//! The paged KV pool on the real default model (SmolLM2-135M-Instruct,
//! 4-bit): rows whose keys and values live in pool blocks get exactly the
//! tokens of contiguous caches, requests that do not fit wait or fail with a
//! clear error, and the pool's resident memory follows its block accounting.

use std::sync::Arc;

use mlx_sys::{Array, Dtype};
use mlxcel_engine::{Engine, EngineLimits, Error, GenerationRequest, Prompt, SamplingParams};
use mlxcel_models::nn::RowKernels;
use mlxcel_models::paged::{PoolUsage, BLOCK_TOKENS};
use mlxcel_tests::default_engine;

const PASSAGE: &str = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
    combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, \
    presses were running in more than two hundred European cities, and the price of books fell sharply.";

fn greedy(prompt: &str, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        params: SamplingParams { max_tokens, ..Default::default() },
        ignore_eos: true,
        ..GenerationRequest::new(Prompt::Text(prompt.into()))
    }
}

/// Greedy decoding through the model API over contiguous caches, with the
/// kernels the engine picks for the prompt (its prefill in one chunk).
fn contiguous_greedy(engine: &Engine, prompt: &str, max_tokens: usize) -> Vec<u32> {
    let model = engine.model();
    let ids = model.tokenizer().encode(prompt, true).unwrap();
    let kernels = if ids.len() > mlxcel_engine::prefix_cache::MIN_PROMPT_TOKENS { RowKernels::Prefill } else { RowKernels::ByCount };
    let mut caches = model.network().new_caches();
    let input: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    let mut logits = model.network().forward_last_with(&Array::from_slice(&input, &[1, input.len() as i32]).unwrap(), &mut caches, kernels).unwrap();
    let mut out = Vec::new();
    loop {
        let token = logits.reshape(&[-1]).unwrap().argmax(0, false).unwrap().astype(Dtype::Uint32).unwrap().item::<u32>().unwrap();
        out.push(token);
        if out.len() == max_tokens {
            return out;
        }
        let next = Array::from_slice(&[token as i32], &[1, 1]).unwrap();
        logits = model.network().forward_last(&next, &mut caches).unwrap();
    }
}

#[test]
fn paged_rows_match_contiguous_caches() {
    let engine = default_engine();
    assert!(engine.model().network().reads_paged_kv(), "the default model runs on the paged pool");
    for prompt in ["The capital of France is", PASSAGE] {
        let want = contiguous_greedy(&engine, prompt, 24);
        let got = engine.generate(&greedy(prompt, 24), |_| true).unwrap().tokens;
        assert_eq!(got, want, "{prompt:?}: the paged pool changed the tokens");
    }
}

/// A pool of `blocks` blocks for the default model.
fn small_engine(blocks: usize) -> Engine {
    let engine = default_engine();
    let bytes = blocks * engine.kv_pool().block_bytes();
    Engine::with_limits(engine.model().clone(), EngineLimits { kv_pool_bytes: bytes, ..Default::default() }).unwrap()
}

#[test]
fn requests_wait_for_room_and_one_too_large_fails_alone() {
    // 12 blocks: 192 positions.
    let engine = small_engine(12);
    assert_eq!(engine.kv_pool().usage().total, 12);
    let too_large = engine.generate(&greedy(PASSAGE, 400), |_| true).err().expect("needs more than the pool");
    assert!(matches!(too_large, Error::KvPoolTooSmall { .. }), "{too_large:?}");
    let message = too_large.to_string();
    assert!(message.contains("more than the KV pool's budget of 8 MiB"), "{message}");
    // Each needs 6 or 7 blocks: no two fit at once, so they run one after
    // the other, each with the tokens it gets alone on a large pool.
    let prompts = ["Once upon a time", "The three primary colours are", "In 1492, Columbus", "def fibonacci(n):"];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| default_engine().generate(&greedy(p, 90), |_| true).unwrap().tokens).collect();
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| engine.generate(&greedy(p, 90), |_| true).unwrap().tokens)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, alone);
    let usage = engine.kv_pool().usage();
    assert_eq!((usage.in_use, usage.reserved), (0, 0), "every row gave its blocks back: {usage:?}");
}

#[test]
fn cached_blocks_are_evicted_when_the_pool_needs_room() {
    let engine = small_engine(16);
    let first = engine.generate(&greedy(PASSAGE, 8), |_| true).unwrap();
    let again = engine.generate(&greedy(PASSAGE, 8), |_| true).unwrap();
    assert!(again.stats.cached_tokens >= 48, "the second run adopts the cached prompt: {}", again.stats.cached_tokens);
    assert_eq!(again.tokens, first.tokens);
    // A request that needs the whole pool evicts the idle cached blocks.
    let whole = 16 * BLOCK_TOKENS - 12;
    engine.generate(&greedy("Tell me a story about a dragon.", whole), |_| true).unwrap();
    assert_eq!(engine.kv_pool().usage().cached_idle, 0);
    let cold = engine.generate(&greedy(PASSAGE, 8), |_| true).unwrap();
    assert_eq!(cold.stats.cached_tokens, 0, "evicted");
    assert_eq!(cold.tokens, first.tokens);
}

#[test]
fn resident_pool_memory_follows_the_block_accounting() {
    let engine = Engine::new(default_engine().model().clone());
    let pool = engine.kv_pool().clone();
    let block = pool.block_bytes();
    // While rows run: the blocks they hold are resident at most, and at
    // least all but each row's last, partly written block.
    let checks = Arc::new(std::sync::Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for (i, prompt) in [PASSAGE, "Write a poem about the sea.", "List five fruits:"].iter().enumerate() {
            let (pool, checks, engine) = (pool.clone(), checks.clone(), engine.clone());
            s.spawn(move || {
                let mut pieces = 0;
                engine
                    .generate(&greedy(prompt, 60 + 20 * i), |_| {
                        pieces += 1;
                        if pieces % 10 == 0 {
                            // The other rows step meanwhile: bracket the count.
                            let before = pool.usage();
                            let resident = pool.resident_bytes().unwrap();
                            let after = pool.usage();
                            checks.lock().unwrap().push((before, resident, after));
                        }
                        true
                    })
                    .unwrap();
            });
        }
    });
    let checks = checks.lock().unwrap();
    assert!(checks.len() >= 6, "{}", checks.len());
    for (before, resident, after) in checks.iter() {
        let accounted = |u: &PoolUsage| (u.in_use + u.cached_idle) * block;
        // Blocks freed while a step runs keep their pages until it ends, and
        // a block taken between the reads comes out of a row's reservation.
        let at_most = |u: &PoolUsage| accounted(u) + (u.unmapping + u.reserved) * block;
        let at_most = at_most(before).max(at_most(after));
        assert!(*resident <= at_most, "{resident} resident > {at_most} accounted ({before:?} .. {after:?})");
        let at_least = accounted(before).min(accounted(after));
        assert!(*resident + 3 * block >= at_least, "{resident} resident, {at_least} accounted ({before:?} .. {after:?})");
    }
    // Idle: only the cached prompt blocks stay, every page of them resident.
    let usage = pool.usage();
    assert_eq!(usage.in_use, 0);
    assert!(usage.cached_idle >= 3, "{usage:?}");
    assert_eq!(pool.resident_bytes().unwrap(), usage.cached_idle * block);
}

#[test]
fn a_request_cancelled_while_it_waits_for_room_ends_at_once() {
    // 12 blocks: the first request holds 8 of them, the second needs 7.
    let engine = small_engine(12);
    let first = greedy("Once upon a time", 120);
    let cancel = mlxcel_engine::CancelFlag::new();
    let second = GenerationRequest { cancel: Some(cancel.clone()), ..greedy("The capital of France is", 100) };
    std::thread::scope(|s| {
        let running = s.spawn(|| engine.generate(&first, |_| true).unwrap());
        // Let the first row start, then queue the second behind it.
        while engine.kv_pool().usage().in_use == 0 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let waiting = s.spawn(|| engine.generate(&second, |_| true).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        cancel.cancel();
        let out = waiting.join().unwrap();
        assert_eq!(out.finish_reason, mlxcel_engine::FinishReason::Cancelled);
        assert!(out.tokens.is_empty(), "it never ran: {:?}", out.tokens);
        assert!(!running.is_finished(), "it ended before the row it waited for");
        assert_eq!(running.join().unwrap().tokens.len(), 120);
    });
}
