//! A step's decoder blocks as one kernel node (`MLXCEL_STACK=1`, the
//! default) against one node per block (`MLXCEL_STACK=0`), on the real
//! default model: the same tokens and the same logprobs, bit for bit, for
//! rows alone and batched. The runtime configuration is fixed per process,
//! so each setting runs the ignored `child_prints_outputs` in a process of
//! its own, and this test compares what they print.

use std::process::Command;

use mlxcel_engine::{GenerationRequest, Prompt, SamplingParams};
use mlxcel_tests::default_engine;

const PROMPTS: [&str; 3] = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"];

fn run_child(stack: &str) -> (Vec<String>, u64) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--ignored", "--exact", "child_prints_outputs", "--nocapture", "--test-threads=1"])
        .env("MLXCEL_STACK", stack)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the child with MLXCEL_STACK={stack} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // libtest's "test child_prints_outputs ... " may start the first line.
    let printed = |prefix: &str| -> Vec<String> {
        stdout.lines().filter_map(|l| l.find(prefix).map(|at| l[at..].to_string())).collect()
    };
    let rows = printed("row ");
    let nodes = printed("stack nodes ")
        .first()
        .and_then(|l| l.strip_prefix("stack nodes "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the child prints its stack node count");
    (rows, nodes)
}

#[test]
fn stacked_blocks_give_what_block_nodes_give() {
    let (stacked, stack_nodes) = run_child("1");
    let (per_block, no_nodes) = run_child("0");
    assert_eq!(stacked.len(), 2 * PROMPTS.len(), "{stacked:?}");
    assert!(stack_nodes > 0, "MLXCEL_STACK=1 built no stack node");
    assert_eq!(no_nodes, 0, "MLXCEL_STACK=0 built stack nodes");
    for (s, p) in stacked.iter().zip(&per_block) {
        assert_eq!(s, p);
    }
}

#[test]
#[ignore = "run by stacked_blocks_give_what_block_nodes_give in a process of its own"]
fn child_prints_outputs() {
    let engine = default_engine();
    let requests: Vec<GenerationRequest> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest {
            params: SamplingParams { max_tokens: 10 + 4 * i, logprobs: Some(3), ..Default::default() },
            ignore_eos: true,
            ..GenerationRequest::new(Prompt::Text(p.to_string()))
        })
        .collect();
    let print = |kind: &str, i: usize, out: &mlxcel_engine::GenerationOutput| {
        // Logprobs as bits: equal means bit for bit.
        let bits: Vec<(u32, u32, Vec<(u32, u32)>)> = out
            .logprobs
            .iter()
            .map(|l| (l.token, l.logprob.to_bits(), l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect()))
            .collect();
        assert_eq!(out.tokens.len(), 10 + 4 * i);
        println!("row {i} {kind}: tokens {:?} logprobs {bits:?}", out.tokens);
    };
    for (i, r) in requests.iter().enumerate() {
        print("alone", i, &engine.generate(r, |_| true).unwrap());
    }
    for (i, out) in engine.generate_batch(&requests).into_iter().enumerate() {
        print("batched", i, &out.unwrap());
    }
    println!("stack nodes {}", mlx_sys::kernels::decoder_stack_nodes());
}
