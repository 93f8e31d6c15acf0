//! The Engine on the real default model (SmolLM2-135M-Instruct, 4-bit).

use std::sync::Arc;

use mlxcel_engine::{CancelFlag, Error, FinishReason, GenerationRequest, Message, Prompt, SamplingParams};
use mlxcel_tests::default_engine;

fn request(prompt: &str, params: SamplingParams) -> GenerationRequest {
    GenerationRequest { params, ..GenerationRequest::new(Prompt::Text(prompt.into())) }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ..Default::default() }
}

#[test]
fn greedy_continuation_is_coherent_and_streams_exactly_the_output() {
    let engine = default_engine();
    let mut streamed = String::new();
    let out = engine
        .generate(&request("The capital of France is", greedy(12)), |p| {
            streamed.push_str(p.text);
            true
        })
        .unwrap();
    assert!(out.text.starts_with(" Paris."), "{:?}", out.text);
    assert_eq!(streamed, out.text);
    assert_eq!(out.tokens.len(), 12);
    assert_eq!(out.finish_reason, FinishReason::Length);
    assert_eq!(out.text, engine.model().tokenizer().decode(&out.tokens, true).unwrap());
    assert_eq!(out.stats.prompt_tokens, 5);
    assert!(out.stats.process_peak_memory_bytes > 0);
    let positions = out.stats.prompt_tokens + out.stats.generated_tokens - 1;
    assert!(out.stats.kv_cache_bytes >= engine.model().info().shape.kv_bytes_per_token() * positions, "{:?}", out.stats);
}

#[test]
fn chat_prompt_stops_at_eos() {
    let engine = default_engine();
    let req = GenerationRequest {
        params: greedy(64),
        ..GenerationRequest::new(Prompt::Chat(vec![Message::user("What is the capital of France?")]))
    };
    let out = engine.generate(&req, |_| true).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert!(engine.model().tokenizer().is_eos(*out.tokens.last().unwrap()));
    assert!(out.text.contains("Paris"), "{:?}", out.text);
    // The template inserted SmolLM2's default system prompt.
    let ids = engine.tokenize_prompt(&req.prompt).unwrap();
    let rendered = engine.model().tokenizer().decode(&ids, false).unwrap();
    assert!(rendered.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), "{rendered}");
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let engine = default_engine();
    let params = SamplingParams { stop: vec![".".into()], ..greedy(32) };
    let out = engine.generate(&request("The capital of France is", params), |_| true).unwrap();
    assert_eq!(out.text, " Paris");
    assert_eq!(out.finish_reason, FinishReason::Stop);
}

#[test]
fn chunked_prefill_matches_a_single_pass() {
    let engine = default_engine();
    let prompt = "Once upon a time, in a small village, there lived an old baker who";
    let whole = engine.generate(&request(prompt, greedy(16)), |_| true).unwrap();
    let chunked = GenerationRequest { prefill_chunk: 3, ..request(prompt, greedy(16)) };
    assert_eq!(engine.generate(&chunked, |_| true).unwrap().tokens, whole.tokens);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let engine = default_engine();
    let params = |seed| SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(seed), ..greedy(24) };
    let a = engine.generate(&request("My favourite animal is", params(7)), |_| true).unwrap();
    let b = engine.generate(&request("My favourite animal is", params(7)), |_| true).unwrap();
    let c = engine.generate(&request("My favourite animal is", params(8)), |_| true).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
}

#[test]
fn callback_and_flag_cancel() {
    let engine = default_engine();
    let mut pieces = 0;
    let out = engine
        .generate(&request("The capital of France is", greedy(32)), |_| {
            pieces += 1;
            false
        })
        .unwrap();
    assert_eq!((pieces, out.finish_reason), (1, FinishReason::Cancelled));
    assert!(out.tokens.len() <= 2);

    let flag = CancelFlag::new();
    flag.cancel();
    let long_prompt = "word ".repeat(40);
    let req = GenerationRequest { cancel: Some(flag), prefill_chunk: 8, ..request(&long_prompt, greedy(8)) };
    let out = engine.generate(&req, |_| panic!("no piece after cancellation")).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(out.tokens.is_empty());
}

#[test]
fn invalid_requests_are_named_errors() {
    let engine = default_engine();
    let bad = SamplingParams { top_p: 1.5, ..greedy(4) };
    match engine.generate(&request("Hi", bad), |_| true) {
        Err(Error::InvalidParameter { name: "top_p", .. }) => {}
        other => panic!("{other:?}"),
    }
    match engine.generate(&request("", greedy(4)), |_| true) {
        Err(Error::EmptyPrompt) => {}
        other => panic!("{other:?}"),
    }
    let out_of_vocab = GenerationRequest { params: greedy(4), ..GenerationRequest::new(Prompt::Tokens(vec![1, 999_999])) };
    let err = engine.generate(&out_of_vocab, |_| true).unwrap_err().to_string();
    assert!(err.contains("999999"), "{err}");
}

#[test]
fn one_engine_serves_four_threads_at_once() {
    let engine = default_engine();
    let prompts = ["The capital of France is", "def fibonacci(n):", "The capital of France is", "Water boils at"];
    let expected: Vec<_> =
        prompts.iter().map(|p| engine.generate(&request(p, greedy(16)), |_| true).unwrap().tokens).collect();
    let engine = Arc::new(engine);
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (engine, p) = (engine.clone(), p.to_string());
            std::thread::spawn(move || engine.generate(&request(&p, greedy(16)), |_| true).unwrap().tokens)
        })
        .collect();
    let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(got, expected);
}

#[test]
fn streams_from_a_background_thread() {
    use mlxcel_engine::{GenerationStream, StreamEvent};
    let engine = default_engine();
    let mut text = String::new();
    let mut done = None;
    for event in GenerationStream::start(&engine, request("The capital of France is", greedy(10))) {
        match event {
            StreamEvent::Piece { text: t, .. } => text.push_str(&t),
            StreamEvent::Done(output) => done = Some(output),
            StreamEvent::Failed(e) => panic!("{e}"),
        }
    }
    let done = done.expect("a Done event");
    assert_eq!(text, done.text);
    assert!(text.starts_with(" Paris."));

    // Dropping a stream cancels its generation.
    let mut stream = GenerationStream::start(&engine, request("Count to a hundred:", greedy(200)));
    let first = stream.next();
    assert!(matches!(first, Some(StreamEvent::Piece { .. })), "{first:?}");
    let flag = stream.cancel_flag().clone();
    drop(stream);
    assert!(flag.is_cancelled());
}

#[test]
fn a_cancelled_short_prompt_produces_nothing() {
    let engine = default_engine();
    let flag = CancelFlag::new();
    flag.cancel();
    let req = GenerationRequest { cancel: Some(flag), ..request("Hi", greedy(8)) };
    let out = engine.generate(&req, |_| panic!("no piece after cancellation")).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(out.tokens.is_empty());
}

/// The model's log-softmax at every position after the prompt, for
/// `prompt` followed by `generated` (one forward pass over contiguous caches).
fn model_logprobs(prompt: &[u32], generated: &[u32]) -> Vec<Vec<f32>> {
    let engine = default_engine();
    let network = engine.model().network();
    let mut ids: Vec<i32> = prompt.iter().chain(generated).map(|&t| t as i32).collect();
    ids.pop();
    let tokens = mlx_sys::Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    let logits = network.forward(&tokens, &mut network.new_caches()).unwrap().astype(mlx_sys::Dtype::Float32).unwrap();
    let lp = logits.subtract(&logits.logsumexp(&[-1], true).unwrap()).unwrap().to_vec::<f32>().unwrap();
    let vocab = lp.len() / ids.len();
    (prompt.len() - 1..ids.len()).map(|p| lp[p * vocab..(p + 1) * vocab].to_vec()).collect()
}

/// Logprobs by default are the model's own distribution (the log-softmax
/// of its logits, checked against a forward pass over the whole text, 1e-3)
/// with the top alternatives most likely first; after the chain they are
/// the distribution each token was drawn from; a row's logprobs are the
/// same alone and in a batch, and stream with their pieces.
#[test]
fn logprobs_report_the_models_or_the_samplers_distribution() {
    let engine = default_engine();
    let prompt = "The capital of France is";
    let params = SamplingParams { logprobs: Some(5), ..greedy(8) };
    let mut streamed = Vec::new();
    let out = engine
        .generate(&request(prompt, params.clone()), |p| {
            streamed.extend_from_slice(p.logprobs);
            true
        })
        .unwrap();
    assert_eq!(out.logprobs.len(), out.tokens.len());
    assert_eq!(streamed, out.logprobs, "the pieces carry every token's logprobs once");
    let ids = engine.tokenize_prompt(&Prompt::Text(prompt.into())).unwrap();
    let want = model_logprobs(&ids, &out.tokens);
    for (i, l) in out.logprobs.iter().enumerate() {
        assert_eq!(l.token, out.tokens[i]);
        assert_eq!(l.top.len(), 5);
        assert_eq!(l.top[0].0, l.token, "greedy picks the most likely token");
        assert!(l.top.windows(2).all(|w| w[0].1 >= w[1].1), "{:?}", l.top);
        assert!((l.logprob - want[i][l.token as usize]).abs() < 1e-3, "token {i}: {} vs {}", l.logprob, want[i][l.token as usize]);
        for &(id, lp) in &l.top {
            assert!((lp - want[i][id as usize]).abs() < 1e-3, "token {i}, alternative {id}");
        }
    }
    // Batched with other rows: the same logprobs, bit for bit.
    let other = request("Once upon a time", SamplingParams { logprobs: Some(2), ..greedy(12) });
    let batch = engine.generate_batch(&[request(prompt, params.clone()), other]);
    assert_eq!(batch[0].as_ref().unwrap().logprobs, out.logprobs);
    // After the chain: greedy draws from a point mass; top-k 3 at temperature 0.7 from 3 tokens.
    let post = |p: SamplingParams| engine.generate(&request(prompt, SamplingParams { post_sampling_probs: true, ..p }), |_| true).unwrap();
    let greedy_post = post(params.clone());
    assert!(greedy_post.logprobs.iter().all(|l| l.logprob == 0.0 && l.top == [(l.token, 0.0)]), "{:?}", greedy_post.logprobs[0]);
    let sampled = post(SamplingParams { temperature: 0.7, top_k: 3, seed: Some(3), ..params.clone() });
    for l in &sampled.logprobs {
        assert!(l.top.len() <= 3 && l.top.iter().any(|&(id, _)| id == l.token), "{l:?}");
        let mass: f32 = l.top.iter().map(|&(_, lp)| lp.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-5, "{mass}");
    }
    // Without the request: none; more than 20 alternatives: refused.
    assert!(engine.generate(&request(prompt, greedy(3)), |_| true).unwrap().logprobs.is_empty());
    let err = engine.generate(&request(prompt, SamplingParams { logprobs: Some(21), ..greedy(3) }), |_| true).unwrap_err();
    assert!(matches!(err, Error::InvalidParameter { name: "logprobs", .. }), "{err}");
}

/// Every front end that loads through the engine (the C API among them) takes
/// a packaged model's name as well as a directory.
#[test]
fn a_packaged_model_loads_by_name() {
    let by_name = mlxcel_engine::Engine::load(std::path::Path::new("SmolLM2-135M-Instruct")).unwrap();
    assert_eq!(by_name.model().dir(), mlxcel_tests::default_model_dir());
    let Err(err) = mlxcel_engine::Engine::load(std::path::Path::new("SmolLM2-135M-Instruct-qx")) else { panic!("loaded") };
    let err = err.to_string();
    assert!(err.contains("no such model directory") && err.contains("SmolLM2-135M-Instruct-qx"), "{err}");
}
