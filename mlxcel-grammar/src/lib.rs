//! Structured output: a request's JSON schema, regular expression or Lark
//! grammar compiled, against the model's vocabulary, into a matcher that
//! gives the tokens allowed at each step.
//!
//! The constrained-decoding library is [llguidance] (the engine behind
//! structured output in vLLM, SGLang and llama.cpp's `--llguidance`): an
//! Earley parser over a lexer of derivative-based regexes, walking the
//! token trie to build each mask in well under a millisecond for 50k-token
//! vocabularies, with JSON schema, regex and Lark front ends in one crate.
//! `docs/sampling.md` says why it was chosen over outlines-core.
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use mlxcel_tokenizer::Tokenizer;

pub use toktrie::SimpleVob as TokenMask;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The constraint does not compile; `name` is the option that gave it
    /// (`json_schema`, `regex` or `grammar`).
    #[error("{name}: {message}")]
    Invalid { name: &'static str, message: String },
    /// The model's tokenizer could not be read into a token trie.
    #[error("structured output is not available for this tokenizer: {0}")]
    Tokenizer(String),
    /// The matcher failed on a token it was given (a token outside the mask).
    #[error("structured output: {0}")]
    Matcher(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON schema (as JSON text). Output is compact JSON (no whitespace
    /// between tokens) unless the schema's `x-guidance` object says
    /// otherwise (llguidance's JSON options).
    JsonSchema(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect; `start` is the start rule).
    Lark(String),
}

impl Constraint {
    /// The option that carries this kind of constraint.
    pub fn option_name(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar> {
        let invalid = |message: String| Error::Invalid { name: self.option_name(), message };
        Ok(match self {
            Constraint::JsonSchema(text) => {
                let mut schema: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
                if let Some(object) = schema.as_object_mut() {
                    object.entry("x-guidance").or_insert_with(|| serde_json::json!({ "whitespace_flexible": false }));
                } else if !schema.is_boolean() {
                    return Err(invalid("a JSON schema is an object (or true/false)".into()));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// Compiles constraints for one model: its vocabulary as a token trie,
/// built once (tens of milliseconds) and shared by every request.
/// `Send + Sync`; compiling may run on any thread.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`, with masks of `model_vocab` entries
    /// (the model's logits; ids past the tokenizer's are never allowed).
    pub fn new(tokenizer: &Tokenizer, model_vocab: usize) -> Result<Self> {
        let fail = |e: &dyn std::fmt::Display| Error::Tokenizer(e.to_string());
        let json = tokenizer.inner().to_string(false).map_err(|e| fail(&e))?;
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json.as_bytes()).map_err(|e| fail(&e))?;
        let vocab = bytes.tokrx_info().vocab_size;
        let eos: Vec<u32> = tokenizer.eos_token_ids().iter().copied().filter(|&id| id < vocab).collect();
        if !eos.is_empty() {
            bytes.set_eos_tokens(&eos);
        }
        let env = bytes.into_tok_env(Some(model_vocab.max(vocab as usize))).map_err(|e| fail(&e))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| fail(&e))?;
        factory.quiet();
        Ok(GrammarCompiler { factory: Arc::new(factory) })
    }

    /// A fresh matcher for `constraint`, or `Error::Invalid` naming the
    /// option when it does not compile.
    pub fn compile(&self, constraint: &Constraint) -> Result<TokenMatcher> {
        let parser = self
            .factory
            .create_parser(constraint.grammar()?)
            .map_err(|e| Error::Invalid { name: constraint.option_name(), message: e.to_string() })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(Error::Invalid { name: constraint.option_name(), message });
        }
        Ok(TokenMatcher { matcher })
    }
}

/// One request's position in its constraint. Not `Sync`: one row owns it.
pub struct TokenMatcher {
    matcher: Matcher,
}

impl TokenMatcher {
    /// The tokens allowed next: only the end-of-sequence tokens once the
    /// constraint is complete and nothing may follow.
    pub fn allowed(&mut self) -> Result<TokenMask> {
        self.matcher.compute_mask_or_eos().map_err(|e| Error::Matcher(e.to_string()))
    }

    /// Advances past `token`, which must be allowed.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| Error::Matcher(e.to_string()))
    }

    /// Undoes the last `tokens` consumed tokens.
    pub fn rollback(&mut self, tokens: usize) -> Result<()> {
        self.matcher.rollback(tokens).map_err(|e| Error::Matcher(e.to_string()))
    }

    /// The tokens the constraint forces next (none when more than one may follow).
    pub fn forced(&mut self) -> Vec<u32> {
        self.matcher.compute_ff_tokens()
    }

    /// Whether the output is complete: the constraint allows nothing but the end.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output so far may end here.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn byte_tokenizer() -> Tokenizer {
        // A byte-level BPE vocabulary of the 256 bytes and a few merges.
        let mut vocab = serde_json::Map::new();
        let bytes_to_unicode = |b: u8| -> char {
            let self_mapped = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            if self_mapped {
                b as char
            } else {
                let offset = (0..b).filter(|&c| !matches!(c, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)).count() as u32;
                char::from_u32(256 + offset).unwrap()
            }
        };
        for b in 0..=255u8 {
            vocab.insert(bytes_to_unicode(b).to_string(), serde_json::json!(b as u32));
        }
        vocab.insert("<eos>".into(), serde_json::json!(256));
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 256, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
        });
        let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
        Tokenizer::from_tokenizer(inner)
    }

    #[test]
    fn a_regex_allows_only_its_language_and_ends() {
        let tokenizer = byte_tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, 260).unwrap();
        let mut m = compiler.compile(&Constraint::Regex("ab[0-9]".into())).unwrap();
        let mask = m.allowed().unwrap();
        assert!(mask.is_allowed(b'a' as u32) && !mask.is_allowed(b'b' as u32) && !mask.is_allowed(259));
        assert_eq!(m.forced(), [b'a' as u32, b'b' as u32]);
        m.consume(b'a' as u32).unwrap();
        m.consume(b'b' as u32).unwrap();
        let mask = m.allowed().unwrap();
        assert_eq!(mask.num_set(), 10);
        m.consume(b'7' as u32).unwrap();
        assert!(m.is_accepting());
        m.rollback(1).unwrap();
        assert_eq!(m.allowed().unwrap().num_set(), 10);
        assert!(m.consume(b'x' as u32).is_err());
    }

    #[test]
    fn invalid_constraints_name_their_option() {
        let tokenizer = byte_tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, 257).unwrap();
        for (constraint, name) in [
            (Constraint::JsonSchema("{not json".into()), "json_schema"),
            (Constraint::JsonSchema("[1, 2]".into()), "json_schema"),
            (Constraint::JsonSchema(r#"{"type": "frobnicate"}"#.into()), "json_schema"),
            (Constraint::Regex("a(b".into()), "regex"),
            (Constraint::Lark("start: missing_rule".into()), "grammar"),
        ] {
            let err = compiler.compile(&constraint).err().unwrap_or_else(|| panic!("{constraint:?} compiled"));
            assert!(err.to_string().starts_with(&format!("{name}: ")), "{err}");
        }
    }

    #[test]
    fn json_output_is_compact_by_default() {
        let tokenizer = byte_tokenizer();
        let compiler = GrammarCompiler::new(&tokenizer, 257).unwrap();
        let mut m = compiler.compile(&Constraint::JsonSchema(r#"{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}"#.into())).unwrap();
        for &b in br#"{"a":"# {
            m.consume(b as u32).unwrap();
        }
        assert!(!m.allowed().unwrap().is_allowed(b' ' as u32));
        for &b in b"12}" {
            m.consume(b as u32).unwrap();
        }
        assert!(m.is_accepting());
        assert!(m.allowed().unwrap().is_allowed(256), "the end-of-sequence token closes the output");
    }
}
