//! Tokenizer wrapper and streaming detokenization.
//!
//! [`Tokenizer::from_dir`] reads a Hugging Face / MLX checkpoint directory:
//! `tokenizer.json` (required), `tokenizer_config.json`, `special_tokens_map.json`,
//! `chat_template.jinja` / `chat_template.json` and `generation_config.json` (all optional).

mod stream;

use std::fmt;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokenizers::{DecoderWrapper, ModelWrapper, PreTokenizerWrapper};

use crate::chat_template::{ChatTemplate, RenderOptions};
use crate::error::{Error, Result};

pub use stream::{StreamDecodeState, StreamDecoder};

/// A Hugging Face tokenizer plus the checkpoint's special tokens and chat templates.
///
/// `Tokenizer` is `Send + Sync`: share one behind an `Arc` across threads; every method
/// takes `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    /// Named templates; the default one (if any) is named `"default"`.
    chat_templates: Vec<(String, ChatTemplate)>,
}

/// The tokenization algorithm of the underlying model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// GPT-2 style BPE over bytes mapped to printable characters.
    ByteLevelBpe,
    /// SentencePiece style BPE whose unknown characters fall back to `<0xXX>` tokens.
    ByteFallbackBpe,
    Bpe,
    WordPiece,
    WordLevel,
    Unigram,
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenizerKind::ByteLevelBpe => "BPE (byte-level)",
            TokenizerKind::ByteFallbackBpe => "BPE (byte-fallback)",
            TokenizerKind::Bpe => "BPE",
            TokenizerKind::WordPiece => "WordPiece",
            TokenizerKind::WordLevel => "WordLevel",
            TokenizerKind::Unigram => "Unigram",
        })
    }
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field(
                "chat_templates",
                &self.chat_template_names().collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer of a checkpoint directory.
    ///
    /// `chat_template.jinja` takes precedence over `tokenizer_config.json`'s
    /// `chat_template`, which takes precedence over `chat_template.json`. All of
    /// `generation_config.json`'s `eos_token_id`s count as end of sequence, together
    /// with the tokenizer's `eos_token`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer_path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&tokenizer_path).map_err(|e| Error::io(&tokenizer_path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| Error::invalid_file(&tokenizer_path, format!("invalid tokenizer: {e}")))?;

        let config: TokenizerConfig =
            read_optional_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let special_map: SpecialTokensMap =
            read_optional_json(&dir.join("special_tokens_map.json"))?.unwrap_or_default();
        let generation: GenerationConfig =
            read_optional_json(&dir.join("generation_config.json"))?.unwrap_or_default();

        let pick = |own: Option<SpecialToken>, fallback: Option<SpecialToken>| {
            own.and_then(SpecialToken::into_content)
                .or_else(|| fallback.and_then(SpecialToken::into_content))
        };
        let bos_token = pick(config.bos_token, special_map.bos_token);
        let eos_token = pick(config.eos_token, special_map.eos_token);
        let pad_token = pick(config.pad_token, special_map.pad_token);
        let unk_token = pick(config.unk_token, special_map.unk_token);

        let chat_templates = load_chat_templates(dir, config.chat_template)?;

        let mut tokenizer = Self {
            inner,
            bos_token,
            eos_token,
            pad_token,
            unk_token,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            add_bos_token: config.add_bos_token,
            add_eos_token: config.add_eos_token,
            chat_templates,
        };
        tokenizer.bos_token_id = tokenizer
            .bos_token
            .as_deref()
            .and_then(|t| tokenizer.inner.token_to_id(t))
            .or_else(|| {
                generation
                    .bos_token_id
                    .and_then(|ids| ids.into_vec().first().copied())
            });
        let mut eos_ids = generation
            .eos_token_id
            .map(TokenIds::into_vec)
            .unwrap_or_default();
        eos_ids.extend(
            tokenizer
                .eos_token
                .as_deref()
                .and_then(|t| tokenizer.inner.token_to_id(t)),
        );
        for id in eos_ids {
            if !tokenizer.eos_token_ids.contains(&id) {
                tokenizer.eos_token_ids.push(id);
            }
        }
        Ok(tokenizer)
    }

    /// Wraps an already built `tokenizers::Tokenizer` with no special tokens or templates.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer) -> Self {
        Self {
            inner,
            bos_token: None,
            eos_token: None,
            pad_token: None,
            unk_token: None,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            add_bos_token: None,
            add_eos_token: None,
            chat_templates: Vec::new(),
        }
    }

    /// The wrapped Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text`. With `add_special_tokens`, the post-processor's tokens are added and
    /// `tokenizer_config.json`'s explicit `add_bos_token` / `add_eos_token` are honoured.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text, add_special_tokens)?;
        if !add_special_tokens {
            return Ok(ids);
        }
        if let Some(bos) = self.bos_token_id {
            match self.add_bos_token {
                Some(true) if ids.first() != Some(&bos) => ids.insert(0, bos),
                // Drop the BOS only if the post-processor added it (not the text).
                Some(false)
                    if ids.first() == Some(&bos)
                        && self.encode_raw(text, false)?.first() != Some(&bos) =>
                {
                    ids.remove(0);
                }
                _ => {}
            }
        }
        if let (Some(true), Some(eos)) = (self.add_eos_token, self.eos_token_id()) {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    fn encode_raw(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes `ids`; with `skip_special_tokens`, special tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("decode: {e}")))
    }

    /// A decoder that turns generated ids into text pieces as they arrive.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }

    /// Every id that ends generation (generation config's `eos_token_id`s, then `eos_token`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The id of `eos_token`, if it is in the vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token
            .as_deref()
            .and_then(|t| self.inner.token_to_id(t))
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn kind(&self) -> TokenizerKind {
        match self.inner.get_model() {
            ModelWrapper::BPE(_) if self.is_byte_level() => TokenizerKind::ByteLevelBpe,
            ModelWrapper::BPE(_) if self.has_byte_fallback() => TokenizerKind::ByteFallbackBpe,
            ModelWrapper::BPE(_) => TokenizerKind::Bpe,
            ModelWrapper::WordPiece(_) => TokenizerKind::WordPiece,
            ModelWrapper::WordLevel(_) => TokenizerKind::WordLevel,
            ModelWrapper::Unigram(_) => TokenizerKind::Unigram,
        }
    }

    fn is_byte_level(&self) -> bool {
        let decoder = self
            .inner
            .get_decoder()
            .is_some_and(|d| decoder_any(d, &|d| matches!(d, DecoderWrapper::ByteLevel(_))));
        let pre_tokenizer = self
            .inner
            .get_pre_tokenizer()
            .is_some_and(pre_tokenizer_is_byte_level);
        decoder || pre_tokenizer
    }

    fn has_byte_fallback(&self) -> bool {
        self.inner
            .get_decoder()
            .is_some_and(|d| decoder_any(d, &|d| matches!(d, DecoderWrapper::ByteFallback(_))))
    }

    /// The default chat template.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.named_chat_template("default")
    }

    /// A named chat template such as `"tool_use"` or `"rag"`.
    pub fn named_chat_template(&self, name: &str) -> Option<&ChatTemplate> {
        self.chat_templates
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }

    pub fn chat_template_names(&self) -> impl Iterator<Item = &str> {
        self.chat_templates.iter().map(|(n, _)| n.as_str())
    }

    /// Renders `messages` with the default chat template and this tokenizer's special tokens.
    pub fn apply_chat_template<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with(
            messages,
            RenderOptions::with_generation_prompt(add_generation_prompt),
        )
    }

    /// Like [`apply_chat_template`](Self::apply_chat_template) with full options. Special
    /// tokens left unset are filled in; when `tools` are given and there is a `tool_use`
    /// template, it is used.
    pub fn apply_chat_template_with<M: Serialize>(
        &self,
        messages: &[M],
        mut options: RenderOptions,
    ) -> Result<String> {
        let template = options
            .tools
            .as_ref()
            .and_then(|_| self.named_chat_template("tool_use"))
            .or_else(|| self.chat_template())
            .ok_or_else(|| Error::ChatTemplate("this tokenizer has no chat template".into()))?;
        let fill = |slot: &mut Option<String>, value: &Option<String>| {
            if slot.is_none() {
                slot.clone_from(value);
            }
        };
        fill(&mut options.bos_token, &self.bos_token);
        fill(&mut options.eos_token, &self.eos_token);
        fill(&mut options.pad_token, &self.pad_token);
        fill(&mut options.unk_token, &self.unk_token);
        template.render(messages, &options)
    }
}

fn decoder_any(decoder: &DecoderWrapper, pred: &dyn Fn(&DecoderWrapper) -> bool) -> bool {
    match decoder {
        DecoderWrapper::Sequence(seq) => seq.get_decoders().iter().any(|d| decoder_any(d, pred)),
        d => pred(d),
    }
}

fn pre_tokenizer_is_byte_level(pre: &PreTokenizerWrapper) -> bool {
    match pre {
        PreTokenizerWrapper::ByteLevel(_) => true,
        PreTokenizerWrapper::Sequence(seq) => seq.as_ref().iter().any(pre_tokenizer_is_byte_level),
        _ => false,
    }
}

#[derive(Debug, Default, Deserialize)]
struct TokenizerConfig {
    bos_token: Option<SpecialToken>,
    eos_token: Option<SpecialToken>,
    pad_token: Option<SpecialToken>,
    unk_token: Option<SpecialToken>,
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    chat_template: Option<ChatTemplateField>,
}

#[derive(Debug, Default, Deserialize)]
struct SpecialTokensMap {
    bos_token: Option<SpecialToken>,
    eos_token: Option<SpecialToken>,
    pad_token: Option<SpecialToken>,
    unk_token: Option<SpecialToken>,
}

/// `"<s>"` or `{"content": "<s>", "lstrip": false, ...}` (an `AddedToken`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Text(String),
    Added {
        content: String,
    },
    /// Anything else (e.g. `null`-like shapes) means no token.
    Other(#[allow(dead_code)] serde_json::Value),
}

impl SpecialToken {
    fn into_content(self) -> Option<String> {
        match self {
            SpecialToken::Text(s) | SpecialToken::Added { content: s } => Some(s),
            SpecialToken::Other(_) => None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatTemplateField {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Debug, Default, Deserialize)]
struct ChatTemplateFile {
    chat_template: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct GenerationConfig {
    bos_token_id: Option<TokenIds>,
    eos_token_id: Option<TokenIds>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

fn read_optional_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| Error::Json {
                path: path.to_path_buf(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn load_chat_templates(
    dir: &Path,
    from_config: Option<ChatTemplateField>,
) -> Result<Vec<(String, ChatTemplate)>> {
    let jinja_path = dir.join("chat_template.jinja");
    let config_path = dir.join("tokenizer_config.json");
    let (path, sources) = match std::fs::read_to_string(&jinja_path) {
        Ok(source) => (jinja_path, vec![("default".to_string(), source)]),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match from_config {
            Some(ChatTemplateField::Single(source)) => {
                (config_path, vec![("default".into(), source)])
            }
            Some(ChatTemplateField::Named(list)) => (
                config_path,
                list.into_iter().map(|t| (t.name, t.template)).collect(),
            ),
            None => {
                let json_path = dir.join("chat_template.json");
                let file: Option<ChatTemplateFile> = read_optional_json(&json_path)?;
                let sources = file
                    .and_then(|f| f.chat_template)
                    .map(|s| vec![("default".to_string(), s)])
                    .unwrap_or_default();
                (json_path, sources)
            }
        },
        Err(e) => return Err(Error::io(jinja_path, e)),
    };
    sources
        .into_iter()
        .map(|(name, source)| {
            let template = ChatTemplate::new(source).map_err(|e| {
                let detail = match e {
                    Error::ChatTemplate(message) => message,
                    other => other.to_string(),
                };
                Error::invalid_file(&path, format!("chat template `{name}`: {detail}"))
            })?;
            Ok((name, template))
        })
        .collect()
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
};
