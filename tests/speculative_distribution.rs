//! Rejection sampling keeps the target's distribution: on a tiny random
//! llama (mlxcel-models/tests/data/tiny/llama, vocabulary 512) drafted for
//! by a perturbed copy of itself, the next three tokens after the first are
//! drawn 20,000 times with and 20,000 times without speculation, and a
//! chi-square test of homogeneity must not reject (p > 0.01), while it
//! does reject the draft model's own distribution (p < 1e-6).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_sys::Dtype;
use mlxcel_engine::{Engine, EngineLimits, GenerationRequest, Prompt, SamplingParams, Speculation};
use mlxcel_models::Model;
use mlxcel_tests::tiny_llama_with_default_tokenizer;
use statrs::distribution::{ChiSquared, ContinuousCDF};

const SAMPLES: usize = 20_000;

/// tiny/llama's config and weights, each weight plus Gaussian noise of
/// `noise` times its own RMS (none at 0), with the default model's
/// tokenizer files (its ids 0..512 cover the tiny vocabulary).
fn tiny_model(out: &Path, noise: f32, seed: u64) -> Arc<Model> {
    let tiny = tiny_llama_with_default_tokenizer(out);
    let weights = mlx_sys::io::load_safetensors(&tiny.join("model.safetensors")).unwrap();
    let mut key = mlx_sys::random::key(seed).unwrap();
    let mut perturbed = BTreeMap::new();
    for (name, w) in weights.arrays {
        let w = w.astype(Dtype::Float32).unwrap();
        let rms = w.square().unwrap().reshape(&[-1]).unwrap().mean(&[0], false).unwrap().sqrt().unwrap().item::<f32>().unwrap();
        let keys = mlx_sys::random::split(&key, 2).unwrap();
        key = keys[0].clone();
        let e = mlx_sys::random::normal(&w.shape(), Dtype::Float32, 0.0, noise * rms, &keys[1]).unwrap();
        perturbed.insert(name, w.add(&e).unwrap());
    }
    mlx_sys::io::save_safetensors(&out.join("model.safetensors"), &perturbed, &BTreeMap::from([("format".to_string(), "mlx".to_string())])).unwrap();
    Arc::new(Model::load(out).unwrap())
}

/// The 2nd to 4th tokens of `samples` seeded generations, counted.
fn counts(engine: &Engine, samples: usize, speculation: Speculation, seed_base: u64) -> (HashMap<[u32; 3], usize>, usize, usize) {
    let mut counts = HashMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for chunk in (0..samples as u64).collect::<Vec<_>>().chunks(500) {
        let requests: Vec<GenerationRequest> = chunk
            .iter()
            .map(|&i| GenerationRequest {
                params: SamplingParams {
                    temperature: 1.0,
                    top_k: 4,
                    seed: Some(seed_base + i),
                    max_tokens: 5,
                    speculation,
                    draft_max: 3,
                    draft_min: 3,
                    ..Default::default()
                },
                ignore_eos: true,
                cache_prompt: false,
                ..GenerationRequest::new(Prompt::Tokens(vec![11, 200, 37, 451, 90]))
            })
            .collect();
        for output in engine.generate_batch(&requests) {
            let output = output.unwrap();
            *counts.entry([output.tokens[1], output.tokens[2], output.tokens[3]]).or_insert(0) += 1;
            drafted += output.stats.draft_tokens;
            accepted += output.stats.accepted_tokens;
        }
    }
    (counts, drafted, accepted)
}

/// Pearson's chi-square test of homogeneity of two samples; cells expected
/// below 5 in either sample are pooled into one. Returns (statistic, df, p).
fn homogeneity(a: &HashMap<[u32; 3], usize>, b: &HashMap<[u32; 3], usize>) -> (f64, f64, f64) {
    let (na, nb) = (a.values().sum::<usize>() as f64, b.values().sum::<usize>() as f64);
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    let keys: std::collections::BTreeSet<&[u32; 3]> = a.keys().chain(b.keys()).collect();
    for key in keys {
        let (x, y) = (*a.get(key).unwrap_or(&0) as f64, *b.get(key).unwrap_or(&0) as f64);
        let total = x + y;
        if total * na.min(nb) / (na + nb) < 5.0 {
            pooled = (pooled.0 + x, pooled.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    if pooled.0 + pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let statistic: f64 = cells
        .iter()
        .map(|&(x, y)| {
            let total = x + y;
            let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
            (x - ea).powi(2) / ea + (y - eb).powi(2) / eb
        })
        .sum();
    let df = (cells.len() - 1) as f64;
    (statistic, df, 1.0 - ChiSquared::new(df).unwrap().cdf(statistic))
}

#[test]
fn rejection_sampling_keeps_the_distribution_of_the_next_three_tokens() {
    let dir: PathBuf = std::env::temp_dir().join(format!("mlxcel-spec-distribution-{}", std::process::id()));
    let target = tiny_model(&dir.join("target"), 0.0, 1);
    let draft = tiny_model(&dir.join("draft"), 0.05, 2);
    let engine = Engine::with_draft(target, EngineLimits::default(), Some(draft.clone())).unwrap();
    let (plain, none, _) = counts(&engine, SAMPLES, Speculation::Off, 0);
    let (spec, drafted, accepted) = counts(&engine, SAMPLES, Speculation::Draft, 1_000_000);
    // The test's power: the draft model's own distribution, close to the
    // target's (about half its tokens are accepted), is told apart.
    let (draft_alone, _, _) = counts(&Engine::new(draft), SAMPLES / 10, Speculation::Off, 2_000_000);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(none, 0);
    let acceptance = accepted as f64 / drafted as f64;
    // Both branches run: drafts are kept and drafts are resampled.
    assert!(drafted >= SAMPLES && (0.2..0.95).contains(&acceptance), "{accepted} of {drafted} drafts accepted");
    let (statistic, df, p) = homogeneity(&plain, &spec);
    println!("{} cells, chi-square {statistic:.1} on {df} df, p = {p:.4}; {accepted} of {drafted} drafts accepted", plain.len());
    assert!(df >= 20.0, "the test needs cells to compare ({df} df)");
    assert!(p > 0.01, "the distributions differ: chi-square {statistic:.1} on {df} df, p = {p:.5}");
    let (statistic, df, p) = homogeneity(&plain, &draft_alone);
    println!("the draft model alone: chi-square {statistic:.1} on {df} df, p = {p:.2e}");
    assert!(p < 1e-6, "the test cannot tell the draft model from the target (p = {p})");
}
