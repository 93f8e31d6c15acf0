//! The batch-native engine on the real default model (SmolLM2-135M-Instruct,
//! 4-bit): a request's tokens do not depend on what else runs beside it.

use std::time::Duration;

use mlxcel_engine::{CancelFlag, Error, FinishReason, GenerationOutput, GenerationRequest, Prompt, SamplingParams};
use mlxcel_tests::default_engine;

/// Eight different requests: greedy and seeded sampling, different prompt
/// lengths and different `max_tokens`, so rows join and leave at other times.
fn requests() -> Vec<GenerationRequest> {
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village, there lived an old baker who",
        "def fibonacci(n):",
        "The three primary colours are",
        "Water boils at a temperature of",
        "My favourite animal is",
        "In 1969, the first humans to walk on the Moon were",
        "A haiku about autumn leaves:",
    ];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = if i % 2 == 0 {
                SamplingParams { max_tokens: 12 + 5 * i, ..Default::default() }
            } else {
                SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(100 + i as u64), max_tokens: 10 + 6 * i, ..Default::default() }
            };
            GenerationRequest { params, ignore_eos: i == 3, ..GenerationRequest::new(Prompt::Text(p.to_string())) }
        })
        .collect()
}

fn alone(requests: &[GenerationRequest]) -> Vec<GenerationOutput> {
    let engine = default_engine();
    requests.iter().map(|r| engine.generate(r, |_| true).unwrap()).collect()
}

fn assert_same(label: &str, got: &[GenerationOutput], want: &[GenerationOutput]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "{label}: request {i} differs from alone ({:?} vs {:?})", g.text, w.text);
        assert_eq!(g.text, w.text, "{label}: request {i}");
        assert_eq!(g.finish_reason, w.finish_reason, "{label}: request {i}");
    }
}

#[test]
fn a_batch_of_eight_gives_each_request_its_tokens_alone() {
    let reqs = requests();
    let want = alone(&reqs);
    assert!(want.iter().any(|o| o.tokens.len() >= 40), "some rows decode long enough to overlap");
    let engine = default_engine();
    let got: Vec<GenerationOutput> = engine.generate_batch(&reqs).into_iter().map(Result::unwrap).collect();
    assert_same("generate_batch", &got, &want);
}

#[test]
fn requests_joining_at_other_times_from_threads_match_alone() {
    let reqs = requests();
    let want = alone(&reqs);
    let engine = default_engine();
    let got: Vec<GenerationOutput> = std::thread::scope(|s| {
        let handles: Vec<_> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let engine = engine.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(25 * ((i * 3) % 8) as u64));
                    engine.generate(r, |_| true).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_same("threads", &got, &want);
}

#[test]
fn a_bad_or_cancelled_row_ends_alone() {
    let reqs = requests();
    let want = alone(&reqs[..3]);
    let engine = default_engine();
    let cancel = CancelFlag::new();
    cancel.cancel();
    let mut batch = reqs[..3].to_vec();
    batch.insert(1, GenerationRequest { params: SamplingParams { top_k: 5, min_p: 2.0, ..Default::default() }, ..reqs[0].clone() });
    batch.insert(3, GenerationRequest { cancel: Some(cancel), ..reqs[1].clone() });
    batch.push(GenerationRequest::new(Prompt::Tokens(vec![1, 5_000_000])));
    let results = engine.generate_batch(&batch);
    assert!(matches!(results[1], Err(Error::InvalidParameter { name: "min_p", .. })), "{:?}", results[1]);
    assert_eq!(results[3].as_ref().unwrap().finish_reason, FinishReason::Cancelled);
    assert!(results[5].as_ref().unwrap_err().to_string().contains("5000000"));
    let good: Vec<GenerationOutput> = [0, 2, 4].iter().map(|&i| results[i].as_ref().unwrap().clone()).collect();
    assert_same("beside bad rows", &good, &want);
}

#[test]
fn a_dropped_stream_frees_its_row_and_the_others_go_on() {
    let reqs = requests();
    let want = alone(&reqs[..2]);
    let engine = default_engine();
    let mut dropped = mlxcel_engine::GenerationStream::start(&engine, reqs[6].clone());
    assert!(matches!(dropped.next(), Some(mlxcel_engine::StreamEvent::Piece { .. })));
    let results = std::thread::scope(|s| {
        let h = s.spawn(|| engine.generate_batch(&reqs[..2]));
        drop(dropped);
        h.join().unwrap()
    });
    let got: Vec<GenerationOutput> = results.into_iter().map(Result::unwrap).collect();
    assert_same("beside a dropped stream", &got, &want);
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// An engine's scheduler thread ends with the last handle on it (engine
/// clones and streams), so engines made and dropped leave no thread behind.
#[test]
fn dropping_the_last_handle_stops_the_scheduler_thread() {
    let model = default_engine().model().clone();
    let request = GenerationRequest { params: SamplingParams { max_tokens: 3, ..Default::default() }, ..requests()[0].clone() };
    mlxcel_engine::Engine::new(model.clone()).generate(&request, |_| true).unwrap();
    let before = threads();
    for _ in 0..5 {
        let engine = mlxcel_engine::Engine::new(model.clone());
        engine.generate(&request, |_| true).unwrap();
        let stream = mlxcel_engine::GenerationStream::start(&engine.clone(), request.clone());
        drop(engine);
        drop(stream);
    }
    assert_eq!(threads(), before, "scheduler threads left behind");
}

/// Short prompts of one length prefill together: the oldest row's `prefill`
/// runs every such row's prompt in one batched forward (within its budget),
/// and each row then decodes the tokens it gets alone. A row on its own
/// budget, or whose chunk is not its last, runs alone.
#[test]
fn prompts_of_one_length_prefill_in_one_forward_as_alone() {
    use mlxcel_engine::batch::{BatchEngine, RowEvent, RowRequest};
    use std::time::Instant;

    let engine = default_engine();
    let model = engine.model().clone();
    let texts = ["The capital of France", "My favourite animal is", "Water boils at a", "The three primary colours"];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| model.tokenizer().encode(t, true).unwrap()).collect();
    let length = prompts[0].len();
    assert!(prompts.iter().all(|p| p.len() == length), "{:?}", prompts.iter().map(Vec::len).collect::<Vec<_>>());
    let long: Vec<u32> = [prompts[0].clone(), prompts[1].clone()].concat();
    let row_request = |prompt: &[u32], i: usize| RowRequest {
        prompt: prompt.to_vec(),
        params: SamplingParams { max_tokens: 16, temperature: if i % 2 == 1 { 0.7 } else { 0.0 }, seed: Some(i as u64), ..Default::default() },
        prefill_chunk: 512,
        ignore_eos: true,
        cache_prompt: true,
        cancel: None,
        images: None,
    };
    let mut requests: Vec<RowRequest> = prompts.iter().enumerate().map(|(i, p)| row_request(p, i)).collect();
    requests.push(row_request(&long, 4));
    let want: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            let request = GenerationRequest {
                params: r.params.clone(),
                ignore_eos: true,
                ..GenerationRequest::new(Prompt::Tokens(r.prompt.clone()))
            };
            engine.generate(&request, |_| true).unwrap().tokens
        })
        .collect();

    let pool = BatchEngine::pool_for(&model, 64 << 20, Default::default(), Default::default()).unwrap();
    let mut batch = BatchEngine::new(model, pool, true);
    let rows: Vec<_> = requests.into_iter().map(|r| batch.open(r, Instant::now()).unwrap()).collect();
    // A budget of three prompts: rows 0-2 together, then row 3, then the longer one alone.
    assert_eq!(batch.prefill(rows[0], 3 * length), 3 * length);
    assert_eq!(batch.next_prefill().map(|(row, _)| row), Some(rows[3]));
    assert_eq!(batch.prefill(rows[3], 3 * length), length);
    assert_eq!(batch.prefill(rows[4], 512), 2 * length);
    let mut got = vec![Vec::new(); rows.len()];
    while !batch.is_empty() {
        for event in batch.step() {
            match event {
                RowEvent::Finished { row, output } => got[rows.iter().position(|&r| r == row).unwrap()] = output.tokens,
                RowEvent::Failed { error, .. } => panic!("{error}"),
                RowEvent::Piece { .. } => {}
            }
        }
    }
    assert_eq!(got, want, "rows prefilled together differ from alone");
}
