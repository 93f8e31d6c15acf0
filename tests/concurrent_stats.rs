//! Per-run statistics under concurrency, on the real default model: runs on
//! several threads at once each report their own figures (the same as when
//! run alone), and no run resets or lowers the process-wide MLX peak that
//! another run reports.

use std::sync::Barrier;

use mlxcel_engine::{GenerationOutput, GenerationRequest, Prompt, SamplingParams};
use mlxcel_tests::default_engine;

fn request(prompt: Prompt, max_tokens: usize, prefill_chunk: usize) -> GenerationRequest {
    GenerationRequest {
        params: SamplingParams { max_tokens, ..Default::default() },
        prefill_chunk,
        ..GenerationRequest::new(prompt)
    }
}

#[test]
fn concurrent_runs_report_their_own_stats_and_never_reset_the_process_peak() {
    let engine = default_engine();
    let model = engine.model();
    let fox = model.tokenizer().encode("the quick brown fox jumps over the lazy dog. ", false).unwrap();
    // A long prompt in one chunk: the run with the highest MLX peak.
    let big = request(Prompt::Tokens(fox.iter().copied().cycle().take(1500).collect()), 4, 1500);
    let small = request(Prompt::Text("The capital of France is".into()), 8, 64);
    let generate = |r: &GenerationRequest| engine.generate(r, |_| true).unwrap();

    let big_alone = generate(&big);
    let small_alone = generate(&small);
    // A run after the big one reports at least the big one's peak: runs
    // never reset the process-wide figure.
    let peak = big_alone.stats.process_peak_memory_bytes;
    assert!(peak >= model.info().weight_bytes as usize, "{peak}");
    assert!(small_alone.stats.process_peak_memory_bytes >= peak, "{:?} after {:?}", small_alone.stats, big_alone.stats);

    let requests = [&big, &small, &small, &small];
    let start = Barrier::new(requests.len());
    let outputs: Vec<GenerationOutput> = std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    generate(r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let kv_per_token = model.info().shape.kv_bytes_per_token();
    for (out, alone) in outputs.iter().zip([&big_alone, &small_alone, &small_alone, &small_alone]) {
        let (s, a) = (&out.stats, &alone.stats);
        assert_eq!(out.tokens, alone.tokens, "greedy tokens differ when run concurrently");
        assert_eq!((s.prompt_tokens, s.generated_tokens), (a.prompt_tokens, a.generated_tokens));
        // This run's own caches: as large as alone, whatever ran beside it
        // (the big prompt's second run adopts its prefix from the prefix
        // cache, whose buffers grow in one step instead of per chunk: at
        // most 256 positions apart).
        if s.cached_tokens == 0 {
            assert_eq!(s.kv_cache_bytes, a.kv_cache_bytes, "{s:?}");
        } else {
            assert_eq!(s.prompt_tokens, 1500, "only the long prompt is prefix-cached");
            assert!(s.kv_cache_bytes.abs_diff(a.kv_cache_bytes) <= 256 * kv_per_token, "{s:?} vs {a:?}");
        }
        assert!(s.kv_cache_bytes >= kv_per_token * (s.prompt_tokens + s.generated_tokens - 1), "{s:?}");
        assert!(s.process_peak_memory_bytes >= peak, "{s:?}: the process peak went below {peak}");
        assert!(s.prompt_time.as_secs_f64() > 0.0 && s.decode_time.as_secs_f64() > 0.0, "{s:?}");
        assert!(s.decode_tokens_per_second().is_finite() && s.decode_tokens_per_second() > 0.0, "{s:?}");
    }
}
