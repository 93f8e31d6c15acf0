//! Our sampler chain against llama.cpp's samplers, stage by stage and as
//! the default chain (tests/reference/make_sampler_goldens.py: 24 candidate
//! arrays of 64 tokens, random, with ties, with -inf entries and with one
//! dominant token, over histories with repeats that do and do not cross a
//! DRY sequence breaker; SmolLM2's vocabulary for the breakers).
//!
//! For each, the candidates left must be the same tokens (where a run of
//! equal logits straddles a cut, which of them stay is llama.cpp's sort
//! order, not a rule: those may differ), with the same logits, and the
//! softmax over them within 1e-6. Typical-p over a candidate array with
//! -inf logits is left out: llama.cpp computes a NaN entropy there and
//! sorts by NaN, so its result has no defined order (ours treats those
//! tokens as the least typical).

use mlxcel_engine::sampler_chain::{self, Candidate, Candidates, DryBreakers, SamplerStage};
use mlxcel_engine::SamplingParams;
use mlxcel_models::tokenizer::Tokenizer;
use mlxcel_tests::{default_model_dir, repo_root};
use rand::SeedableRng;
use serde_json::Value;

fn float(v: &Value) -> f32 {
    match v {
        Value::String(s) if s == "-inf" => f32::NEG_INFINITY,
        Value::String(s) if s == "inf" => f32::INFINITY,
        v => v.as_f64().unwrap() as f32,
    }
}

/// Every stage off, llama.cpp's neutral values (temperature 1).
fn base() -> SamplingParams {
    SamplingParams { temperature: 1.0, repetition_context_size: 64, ..Default::default() }
}

fn params_of(stage: &str, p: &Value) -> SamplingParams {
    let f = |k: &str, d: f32| p.get(k).map_or(d, float);
    let u = |k: &str, d: usize| p.get(k).and_then(Value::as_u64).map_or(d, |v| v as usize);
    let b = base();
    SamplingParams {
        samplers: (stage != "default_chain").then(|| vec![SamplerStage::from_name(stage).unwrap()]),
        logit_bias: p
            .get("logit_bias")
            .map(|l| l.as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap() as u32, float(&e[1]))).collect())
            .unwrap_or_default(),
        min_keep: u("min_keep", 0),
        temperature: f("temperature", b.temperature),
        top_k: u("top_k", 0) as u32,
        top_p: f("top_p", b.top_p),
        min_p: f("min_p", b.min_p),
        typical_p: f("typical_p", b.typical_p),
        top_n_sigma: f("top_n_sigma", b.top_n_sigma),
        repetition_penalty: f("repetition_penalty", 1.0),
        repetition_context_size: u("repetition_context_size", 64),
        frequency_penalty: f("frequency_penalty", 0.0),
        presence_penalty: f("presence_penalty", 0.0),
        dry_multiplier: f("dry_multiplier", 0.0),
        dry_base: f("dry_base", 1.75),
        dry_allowed_length: u("dry_allowed_length", 2),
        dry_penalty_last_n: p.get("dry_penalty_last_n").and_then(Value::as_u64).map(|v| v as usize),
        xtc_probability: f("xtc_probability", 0.0),
        xtc_threshold: f("xtc_threshold", 0.1),
        ..b
    }
}

fn softmax(logits: &[f32]) -> Vec<f32> {
    Candidates { items: logits.iter().map(|&logit| Candidate { id: 0, logit }).collect(), sorted: false }.probabilities()
}

/// Compares two outcomes; returns the worst probability difference, or what differs.
fn compare(label: &str, ours: &[(u32, f32)], theirs: &[(u32, f32)]) -> Result<f32, String> {
    let finite = |v: &[(u32, f32)]| {
        let mut v: Vec<(u32, f32)> = v.iter().copied().filter(|x| x.1 > f32::NEG_INFINITY).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    };
    let (a, b) = (finite(ours), finite(theirs));
    if a.len() != b.len() {
        return Err(format!("{label}: {} candidates left, llama.cpp {}\n ours {a:?}\n theirs {b:?}", a.len(), b.len()));
    }
    if a.is_empty() {
        return Ok(0.0);
    }
    for (x, y) in a.iter().zip(&b) {
        if (x.1 - y.1).abs() > 1e-5 * x.1.abs().max(1.0) {
            return Err(format!("{label}: logits {x:?} vs {y:?}"));
        }
    }
    // Ties at either end of what is left (filters cut from below, XTC from above).
    let (low, high) = (b.last().unwrap().1, b[0].1);
    let strict = |v: &[(u32, f32)]| {
        let mut ids: Vec<u32> = v.iter().filter(|x| (x.1 - low).abs() > 1e-6 && (x.1 - high).abs() > 1e-6).map(|x| x.0).collect();
        ids.sort();
        ids
    };
    if strict(&a) != strict(&b) {
        return Err(format!("{label}: different tokens above the cut"));
    }
    let (pa, pb) = (softmax(&a.iter().map(|x| x.1).collect::<Vec<_>>()), softmax(&b.iter().map(|x| x.1).collect::<Vec<_>>()));
    Ok(pa.iter().zip(&pb).fold(0f32, |m, (x, y)| m.max((x - y).abs())))
}

#[test]
fn every_stage_and_the_default_chain_match_llama_cpp() {
    let path = repo_root().join("tests/reference/goldens/llama_cpp_samplers.json");
    let goldens: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let tokenizer = Tokenizer::from_dir(&default_model_dir()).unwrap();
    let strings: Vec<String> = goldens["dry_sequence_breakers"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
    let breakers = DryBreakers::new(
        &strings,
        tokenizer.vocab_size(),
        |id| tokenizer.decode(&[id], false).unwrap_or_default().into_bytes(),
        |text| tokenizer.encode(&String::from_utf8_lossy(text), false).unwrap_or_default(),
    );
    let mut worst = std::collections::BTreeMap::<String, f32>::new();
    let mut checked = 0;
    let mut failures = Vec::new();
    let mut skipped = 0;
    for (c, case) in goldens["cases"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let logits: Vec<f32> = case["logits"].as_array().unwrap().iter().map(float).collect();
        let history: Vec<u32> = case["history"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        for result in case["results"].as_array().unwrap() {
            let stage = result["stage"].as_str().unwrap();
            if stage == "typ_p" && logits.contains(&f32::NEG_INFINITY) {
                // llama.cpp's entropy is NaN over a -inf logit, and its sort by NaN has no order.
                skipped += 1;
                continue;
            }
            let params = params_of(stage, &result["params"]);
            let mut candidates = Candidates { items: ids.iter().zip(&logits).map(|(&id, &logit)| Candidate { id, logit }).collect(), sorted: false };
            sampler_chain::apply_logit_bias(&params.logit_bias, &mut candidates);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
            for &s in sampler_chain::stages(&params) {
                sampler_chain::apply_stage(s, &params, &mut candidates, &history, &breakers, &mut rng);
            }
            let ours: Vec<(u32, f32)> = candidates.items.iter().map(|x| (x.id, x.logit)).collect();
            let theirs: Vec<(u32, f32)> = result["out"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap() as u32, float(&e[1]))).collect();
            let label = format!("case {c} ({}), {stage} {}", case["kind"], result["params"]);
            match compare(&label, &ours, &theirs) {
                Ok(d) if d <= 1e-6 => {
                    let w = worst.entry(stage.to_string()).or_default();
                    *w = w.max(d);
                    checked += 1;
                }
                Ok(d) => failures.push(format!("{label}: probabilities differ by {d}")),
                Err(e) => failures.push(e),
            }
        }
    }
    eprintln!("{checked} outcomes checked, {skipped} typical-p outcomes over -inf logits skipped; worst |Δp| per stage: {worst:?}");
    assert_eq!(skipped, 12);
    assert!(failures.is_empty(), "{} outcomes differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 24 * 20, "{checked}");
}

/// The DRY cases exercise what they are for: in the cases whose history
/// ends by repeating 4 tokens, the token that extends the repeat loses
/// 0.8 * 1.75^(4 - 2) = 2.45; where a breaker sits inside that repeat, no
/// repeat reaches past it and no token loses more than 0.8 * 1.75^0.
#[test]
fn the_dry_goldens_penalize_repeats_and_stop_at_breakers() {
    let path = repo_root().join("tests/reference/goldens/llama_cpp_samplers.json");
    let goldens: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut long_repeats = 0;
    for (c, case) in goldens["cases"].as_array().unwrap().iter().enumerate() {
        let logits: Vec<f32> = case["logits"].as_array().unwrap().iter().map(float).collect();
        let ids: Vec<u64> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let dry = case["results"].as_array().unwrap().iter().find(|r| r["stage"] == "dry").unwrap();
        assert_eq!(dry["params"]["dry_multiplier"].as_f64(), Some(0.8));
        let most = dry["out"].as_array().unwrap().iter().fold(0f32, |m, e| {
            let i = ids.iter().position(|&id| id == e[0].as_u64().unwrap()).unwrap();
            let d = logits[i] - float(&e[1]);
            if d.is_finite() { m.max(d) } else { m }
        });
        if c % 2 == 0 {
            long_repeats += (most >= 2.44) as usize;
        } else {
            assert!(most <= 0.8 + 1e-5, "case {c}: a penalty of {most} reached across the breaker");
        }
    }
    assert!(long_repeats >= 8, "{long_repeats} of 12 repeating cases penalized the repeat");
}
