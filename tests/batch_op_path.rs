//! The batch engine on MLX's op-by-op path: the real default model with the
//! fused decode block off (`MLXCEL_FUSED=0`, set for this whole process
//! through `runtime::init`), so every decoder block runs
//! `DecoderBlock::forward_batch`'s batched norms, projections and MLP with
//! RoPE and attention per row. Each greedy request's tokens must equal its
//! tokens alone.

use std::sync::Arc;

use mlxcel_engine::{Engine, GenerationOutput, GenerationRequest, Prompt, SamplingParams};
use mlxcel_models::runtime::{self, RuntimeConfig};
use mlxcel_models::Model;
use mlxcel_tests::default_model_dir;

fn op_path_engine() -> Engine {
    let config = runtime::init(RuntimeConfig { fused_decode: false, ..RuntimeConfig::default() }).unwrap();
    assert!(!config.fused_decode);
    Engine::new(Arc::new(Model::load(&default_model_dir()).unwrap()))
}

#[test]
fn greedy_rows_on_the_op_path_equal_their_tokens_alone() {
    let engine = op_path_engine();
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village, there lived an old baker who",
        "def fibonacci(n):",
        "Water boils at a temperature of",
    ];
    let requests: Vec<GenerationRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest {
            params: SamplingParams { max_tokens: 8 + 6 * i, ..Default::default() },
            ignore_eos: true,
            ..GenerationRequest::new(Prompt::Text(p.to_string()))
        })
        .collect();
    let alone: Vec<GenerationOutput> = requests.iter().map(|r| engine.generate(r, |_| true).unwrap()).collect();
    let batch: Vec<GenerationOutput> = engine.generate_batch(&requests).into_iter().map(Result::unwrap).collect();
    for (i, (b, a)) in batch.iter().zip(&alone).enumerate() {
        assert_eq!(a.tokens.len(), 8 + 6 * i, "request {i} ran to max_tokens");
        assert_eq!(b.tokens, a.tokens, "request {i} differs from alone ({:?} vs {:?})", b.text, a.text);
    }
}
