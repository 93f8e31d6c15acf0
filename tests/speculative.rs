//! Speculative decoding on the real default model (SmolLM2-135M-Instruct,
//! 4-bit).

use mlx_sys::{Array, Dtype};
use mlxcel_models::KvCache;
use mlxcel_tests::default_engine;

fn ids_array(ids: &[u32]) -> Array {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32]).unwrap()
}

fn floats(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap()
}

/// Verifying L tokens in one pass gives each position the logits of a
/// decode step, bit for bit: the ground of token-identical speculation.
#[test]
fn every_position_of_a_verify_pass_equals_a_decode_step() {
    let engine = default_engine();
    let model = engine.model();
    let net = model.network();
    let prompt = model.tokenizer().encode("The quick brown fox jumps over the lazy dog. The quick brown", true).unwrap();
    let follow: Vec<u32> = model.tokenizer().encode(" fox jumps over the lazy dog again and again, while the farmer watches from his porch", false).unwrap();
    for length in [2usize, 5, 9, 17] {
        let mut stepped: Vec<Box<dyn KvCache>> = net.new_caches();
        let mut verified: Vec<Box<dyn KvCache>> = net.new_caches();
        net.forward_last(&ids_array(&prompt), &mut stepped).unwrap();
        net.forward_last(&ids_array(&prompt), &mut verified).unwrap();
        let tokens = &follow[..length];
        let steps: Vec<Vec<f32>> = tokens.iter().map(|&t| floats(&net.forward_last(&ids_array(&[t]), &mut stepped).unwrap())).collect();
        let all = net.forward_batch_all(&ids_array(tokens), &mut [&mut verified[..]]).unwrap();
        for (l, want) in steps.iter().enumerate() {
            let got = floats(&all.slice_axis(1, l as i32, l as i32 + 1).unwrap());
            let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert_eq!(&got, want, "length {length}, position {l}: worst |Δ| {worst}");
        }
    }
}

use mlxcel_engine::{GenerationOutput, GenerationRequest, Prompt, SamplingParams, Speculation, MAX_DRAFT_TOKENS};

/// Twenty prompts: ten that quote or rewrite their input (where lookup
/// drafts are accepted) and ten open-ended ones (where they are not).
const PROMPTS: [&str; 20] = [
    "Repeat this sentence exactly: The old lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Copy the list: apples, pears, plums, cherries, apricots, peaches, grapes, figs.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "Rewrite in the past tense: I walk to the market, I buy bread, I talk to the baker, and I walk home.",
    "Quote the first line: 'It was the best of times, it was the worst of times, it was the age of wisdom.'",
    "The password is BLUE-HORSE-42. Say the password again: The password is",
    "Translate to uppercase: the quick brown fox jumps over the lazy dog",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Summarize: The meeting is on Monday at ten. The meeting is in room four. The meeting is about the budget.",
    "<ul><li>one</li><li>two</li><li>three</li><li>",
    "The capital of France is",
    "Once upon a time, in a small village, there lived an old baker who",
    "Write a haiku about the sea.",
    "What is the boiling point of water?",
    "Explain photosynthesis to a child.",
    "My favourite animal is",
    "Give three tips for learning to cook.",
    "In 1969, the first humans to walk on the Moon were",
    "Why is the sky blue?",
    "Name a famous painting and its painter.",
];

fn request(prompt: &str, params: SamplingParams) -> GenerationRequest {
    GenerationRequest { params, ignore_eos: true, ..GenerationRequest::new(Prompt::Text(prompt.to_string())) }
}

fn run(engine: &mlxcel_engine::Engine, prompt: &str, params: SamplingParams) -> GenerationOutput {
    engine.generate(&request(prompt, params), |_| true).unwrap()
}

/// Greedy decoding with prompt lookup gives the tokens of greedy decoding
/// without it, on every prompt, and lookup drafts are accepted where the
/// output quotes the prompt.
#[test]
fn greedy_prompt_lookup_is_token_identical() {
    let engine = default_engine();
    let mut accepted_on_quotes = 0;
    let mut drafted_on_quotes = 0;
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let plain = run(&engine, prompt, SamplingParams { max_tokens: 48, ..Default::default() });
        let spec = run(&engine, prompt, SamplingParams { max_tokens: 48, speculation: Speculation::PromptLookup, ..Default::default() });
        assert_eq!(spec.tokens, plain.tokens, "prompt {i} {prompt:?}: {:?} vs {:?}", spec.text, plain.text);
        assert_eq!(spec.finish_reason, plain.finish_reason, "prompt {i}");
        assert!(spec.stats.accepted_tokens <= spec.stats.draft_tokens, "prompt {i}");
        assert_eq!(plain.stats.draft_tokens, 0, "prompt {i}: no drafts without speculation");
        println!("prompt {i}: {} of {} drafts accepted, {} tokens", spec.stats.accepted_tokens, spec.stats.draft_tokens, spec.tokens.len());
        if i < 10 {
            accepted_on_quotes += spec.stats.accepted_tokens;
            drafted_on_quotes += spec.stats.draft_tokens;
        }
    }
    assert!(drafted_on_quotes > 0 && accepted_on_quotes * 2 > drafted_on_quotes, "quoting prompts: {accepted_on_quotes} of {drafted_on_quotes} drafts accepted");
}

/// Sample-and-match keeps a seeded request's tokens: the generator is
/// consumed once per emitted token, on the device sampler (temperature
/// alone) and on the host chain (top-k, top-p, min-p) alike.
#[test]
fn seeded_sampling_with_prompt_lookup_is_token_identical() {
    let engine = default_engine();
    let device = SamplingParams { temperature: 0.7, seed: Some(7), max_tokens: 40, ..Default::default() };
    let host = SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.9, min_p: 0.02, seed: Some(11), max_tokens: 40, ..Default::default() };
    assert!(device.on_device() && !host.on_device());
    let mut accepted = 0;
    for (i, prompt) in PROMPTS.iter().enumerate().step_by(2) {
        for params in [&device, &host] {
            let plain = run(&engine, prompt, params.clone());
            let spec = run(&engine, prompt, SamplingParams { speculation: Speculation::PromptLookup, ..params.clone() });
            assert_eq!(spec.tokens, plain.tokens, "prompt {i}, on device {}: {:?} vs {:?}", params.on_device(), spec.text, plain.text);
            accepted += spec.stats.accepted_tokens;
        }
    }
    assert!(accepted > 0, "some drafts were accepted");
}

/// Speculating rows beside plain ones in one batch: each gets its tokens
/// alone.
#[test]
fn speculating_rows_in_a_batch_match_alone() {
    let engine = default_engine();
    let requests: Vec<GenerationRequest> = PROMPTS
        .iter()
        .take(8)
        .enumerate()
        .map(|(i, p)| {
            let speculation = if i % 3 == 2 { Speculation::Off } else { Speculation::PromptLookup };
            let params = if i % 2 == 0 {
                SamplingParams { max_tokens: 20 + 4 * i, speculation, ..Default::default() }
            } else {
                SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(i as u64), max_tokens: 16 + 5 * i, speculation, ..Default::default() }
            };
            request(p, params)
        })
        .collect();
    let alone: Vec<GenerationOutput> = requests.iter().map(|r| engine.generate(r, |_| true).unwrap()).collect();
    let batched: Vec<GenerationOutput> = engine.generate_batch(&requests).into_iter().map(Result::unwrap).collect();
    for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
        assert_eq!(b.tokens, a.tokens, "request {i}: {:?} vs {:?}", b.text, a.text);
        assert_eq!(b.finish_reason, a.finish_reason, "request {i}");
    }
    assert!(batched.iter().map(|o| o.stats.accepted_tokens).sum::<usize>() > 0);
}

#[test]
fn draft_speculation_without_a_draft_model_is_refused() {
    let engine = default_engine();
    let params = SamplingParams { speculation: Speculation::Draft, max_tokens: 4, ..Default::default() };
    let err = engine.generate(&request("Hello", params), |_| true).unwrap_err().to_string();
    assert!(err.contains("speculation") && err.contains("draft"), "{err}");
    for draft_max in [0, MAX_DRAFT_TOKENS + 1] {
        let params = SamplingParams { speculation: Speculation::PromptLookup, draft_max, ..Default::default() };
        let err = params.validate().unwrap_err().to_string();
        assert!(err.contains("draft_max"), "{err}");
    }
    let params = SamplingParams { speculation: Speculation::PromptLookup, draft_max: 4, draft_min: 5, ..Default::default() };
    assert!(params.validate().unwrap_err().to_string().contains("draft_min"));
}

/// The 4-bit default model drafting for its 8-bit requantization: greedy
/// output equals the 8-bit model's alone, with drafting forced on
/// (draft_min) since the policy finds a draft this large does not pay on
/// the CPU.
#[test]
fn a_draft_model_keeps_greedy_tokens() {
    use std::sync::Arc;
    let target_dir = mlxcel_hub::default_model_requantized(8, 32).unwrap();
    let target = Arc::new(mlxcel_models::Model::load(&target_dir).unwrap());
    let draft = default_engine().model().clone();
    let engine = mlxcel_engine::Engine::with_draft(target, mlxcel_engine::EngineLimits::default(), Some(draft)).unwrap();
    let mut accepted = 0;
    for (i, prompt) in PROMPTS.iter().enumerate().step_by(4) {
        let plain = run(&engine, prompt, SamplingParams { max_tokens: 32, ..Default::default() });
        let spec = run(&engine, prompt, SamplingParams { max_tokens: 32, speculation: Speculation::Draft, draft_min: 3, draft_max: 5, ..Default::default() });
        assert_eq!(spec.tokens, plain.tokens, "prompt {i}: {:?} vs {:?}", spec.text, plain.text);
        assert!(spec.stats.draft_tokens > 0, "prompt {i}: drafting was forced");
        accepted += spec.stats.accepted_tokens;
    }
    assert!(accepted > 0);
    // Without draft_min the policy decides, from the models' sizes.
    let adaptive = run(&engine, PROMPTS[0], SamplingParams { max_tokens: 32, speculation: Speculation::Draft, ..Default::default() });
    let plain = run(&engine, PROMPTS[0], SamplingParams { max_tokens: 32, ..Default::default() });
    assert_eq!(adaptive.tokens, plain.tokens);
}

/// A draft model whose vocabulary differs from the target's is refused
/// when the engine is built, naming draft_model.
#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let dir = std::env::temp_dir().join(format!("mlxcel-draft-vocab-{}", std::process::id()));
    let tiny = mlxcel_tests::tiny_llama_with_default_tokenizer(&dir);
    std::fs::copy(tiny.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let err = mlxcel_engine::Engine::load_with_draft(&mlxcel_tests::default_model_dir(), mlxcel_engine::EngineLimits::default(), Some(&dir)).err().unwrap().to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(err.contains("draft_model"), "{err}");
}
