//! The prefix cache on the real default model (SmolLM2-135M-Instruct, 4-bit):
//! a prompt whose prefix comes from the cache gets exactly the tokens it
//! gets computed fresh.

use mlx_sys::{eval, Array};
use mlxcel_models::nn::RowKernels;
use mlxcel_tests::default_engine;

fn to_vec(a: &Array) -> Vec<f32> {
    a.astype(mlx_sys::Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

/// With `RowKernels::Prefill`, each position's logits and cache entries are
/// the same bit for bit however its prompt is cut into chunks: the property
/// that lets cached prompt blocks stand in for a fresh prefill.
#[test]
fn prefill_kernels_do_not_depend_on_chunking() {
    let engine = default_engine();
    let model = engine.model();
    assert!(model.network().chunking_invariant_prefill());
    let text = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
                combined movable metal type, oil-based ink and a wooden press adapted from wine making. \
                Within fifty years, presses were running in more than two hundred European cities.";
    let ids = model.tokenizer().encode(text, true).unwrap();
    assert!(ids.len() > 40, "{}", ids.len());
    let run = |cuts: &[usize]| -> (Vec<f32>, Vec<Vec<f32>>) {
        let mut caches = model.network().new_caches();
        let mut start = 0;
        let mut logits = None;
        for &end in cuts.iter().chain(std::iter::once(&ids.len())) {
            let chunk: Vec<i32> = ids[start..end].iter().map(|&t| t as i32).collect();
            let tokens = Array::from_slice(&chunk, &[1, chunk.len() as i32]).unwrap();
            let l = model.network().forward_last_with(&tokens, &mut caches, RowKernels::Prefill).unwrap();
            eval(caches.iter().flat_map(|c| c.state()).collect::<Vec<_>>().iter()).unwrap();
            logits = Some(l);
            start = end;
        }
        let n = ids.len() as i32;
        let kv = caches.iter().flat_map(|c| c.state()).map(|a| to_vec(&a.slice_axis(2, 0, n).unwrap())).collect();
        (to_vec(&logits.unwrap()), kv)
    };
    let whole = run(&[]);
    for cuts in [&[16][..], &[32, 33], &[7, 20, 41], &[ids.len() - 1]] {
        let cut = run(cuts);
        assert!(cut.0 == whole.0, "chunks at {cuts:?}: the last logits differ");
        assert!(cut.1 == whole.1, "chunks at {cuts:?}: the cached keys or values differ");
    }
}

use mlxcel_engine::{GenerationRequest, Message, Prompt, SamplingParams};

const DOCUMENT: &str = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
    combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, \
    presses were running in more than two hundred European cities, and the price of books fell so far that \
    ordinary merchants could own them. Scholars argue about how much the press changed: some say it made the \
    Reformation possible, others that it mostly sped up changes that were already under way.";

fn chat(turns: &[(&str, &str)], question: &str, params: SamplingParams) -> GenerationRequest {
    let mut messages = vec![Message::system(&format!("Answer questions about this text.\n\n{DOCUMENT}"))];
    for (q, a) in turns {
        messages.push(Message::user(*q));
        messages.push(Message::assistant(*a));
    }
    messages.push(Message::user(question));
    GenerationRequest { params, ..GenerationRequest::new(Prompt::Chat(messages)) }
}

/// A second chat turn whose first turn is cached gets exactly the tokens it
/// gets on an engine that computes it fresh, greedy and seeded.
#[test]
fn a_cached_prefix_gives_the_tokens_of_a_fresh_prefill() {
    for params in [
        SamplingParams { max_tokens: 24, ..Default::default() },
        SamplingParams { max_tokens: 24, temperature: 0.7, seed: Some(11), ..Default::default() },
    ] {
        let engine = default_engine();
        let first = engine.generate(&chat(&[], "Who built the first press?", params.clone()), |_| true).unwrap();
        assert_eq!(first.stats.cached_tokens, 0);
        let second_request = chat(&[("Who built the first press?", &first.text)], "When was that?", params.clone());
        let second = engine.generate(&second_request, |_| true).unwrap();
        let prompt_tokens = second.stats.prompt_tokens;
        assert!(second.stats.cached_tokens >= 100, "{} of {prompt_tokens} cached", second.stats.cached_tokens);
        assert!(second.stats.cached_tokens < prompt_tokens);
        let fresh = default_engine().generate(&second_request, |_| true).unwrap();
        assert_eq!(fresh.stats.cached_tokens, 0);
        assert_eq!(second.tokens, fresh.tokens, "cached {:?} vs fresh {:?}", second.text, fresh.text);
        // The same request again is served from the cache too, up to its last block.
        let again = engine.generate(&second_request, |_| true).unwrap();
        assert_eq!(again.tokens, fresh.tokens);
        assert!(again.stats.cached_tokens >= second.stats.cached_tokens);
        assert!(prompt_tokens - again.stats.cached_tokens <= 16, "{} of {prompt_tokens}", again.stats.cached_tokens);
    }
}

/// Rows with and without a cache hit in one batch each get their fresh tokens.
#[test]
fn cached_and_fresh_rows_in_one_batch_match_alone() {
    let params = SamplingParams { max_tokens: 16, ..Default::default() };
    let requests: Vec<GenerationRequest> = ["What fell in price?", "How many cities had presses?", "What is ink made of?"]
        .iter()
        .map(|q| chat(&[], q, params.clone()))
        .collect();
    let fresh: Vec<Vec<u32>> =
        requests.iter().map(|r| default_engine().generate(r, |_| true).unwrap().tokens).collect();
    let engine = default_engine();
    engine.generate(&requests[0], |_| true).unwrap();
    let batch = engine.generate_batch(&requests);
    for (i, out) in batch.iter().enumerate() {
        let out = out.as_ref().unwrap();
        assert!(out.stats.cached_tokens > 0, "request {i} shares the system prompt's blocks");
        assert_eq!(out.tokens, fresh[i], "request {i}");
    }
}
