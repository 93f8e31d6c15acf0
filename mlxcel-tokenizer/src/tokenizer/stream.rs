//! Incremental detokenization for streaming generated text.

use super::Tokenizer;
use crate::error::{Error, Result};

const REPLACEMENT_CHAR: char = '\u{FFFD}';

/// Turns generated ids into text pieces as they arrive.
///
/// Pieces never end in a broken UTF-8 sequence: while the decoded tail ends in U+FFFD
/// (e.g. half of an emoji split over byte-level tokens) the text is held back. The
/// concatenation of every piece from [`step`](Self::step) and a final
/// [`finish`](Self::finish) equals `tokenizer.decode(all_ids, skip_special_tokens)`.
///
/// Each step decodes only a small window: the tokens of the previously emitted piece
/// (context for decoders that look at neighbours, such as leading-space rules) plus the
/// tokens not yet emitted.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    state: StreamDecodeState,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        Self { tokenizer, state: StreamDecodeState::new(skip_special_tokens) }
    }

    /// Adds one id; returns the new text, or `None` while it is held back.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.state.step(self.tokenizer, id)
    }

    /// Flushes held-back text (possibly ending in U+FFFD). Call once generation has ended;
    /// stepping afterwards continues as if the flushed text had been complete.
    pub fn finish(&mut self) -> Result<Option<String>> {
        self.state.finish(self.tokenizer)
    }
}

/// A [`StreamDecoder`] without its tokenizer borrow, for owners that keep the
/// tokenizer elsewhere (the engine's rows): each call takes the tokenizer.
#[derive(Debug, Clone)]
pub struct StreamDecodeState {
    skip_special_tokens: bool,
    /// The window: context ids (`..read_offset`), then ids not yet emitted.
    ids: Vec<u32>,
    /// `decode(ids[..read_offset])`: the text the window's decoding must start with.
    prefix: String,
    read_offset: usize,
}

impl StreamDecodeState {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self { skip_special_tokens, ids: Vec::new(), prefix: String::new(), read_offset: 0 }
    }

    /// [`StreamDecoder::step`].
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.decode_window(tokenizer)?;
        if text.len() <= self.prefix.len() || text.ends_with(REPLACEMENT_CHAR) {
            return Ok(None);
        }
        self.emit(tokenizer, text)
    }

    /// [`StreamDecoder::finish`].
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let text = self.decode_window(tokenizer)?;
        self.emit(tokenizer, text)
    }

    /// Emits `text` past the prefix and slides the window to the ids just emitted.
    fn emit(&mut self, tokenizer: &Tokenizer, text: String) -> Result<Option<String>> {
        let Some(piece) = text.strip_prefix(self.prefix.as_str()) else {
            return Err(Error::Tokenizer(format!(
                "stream decode: decoding after id {} changed already emitted text {:?} to {:?}",
                self.ids.last().copied().unwrap_or_default(),
                self.prefix,
                text
            )));
        };
        let piece = piece.to_string();
        if self.read_offset == 0 {
            self.prefix = text;
        } else {
            self.ids.drain(..self.read_offset);
            self.prefix = self.decode_window(tokenizer)?;
        }
        self.read_offset = self.ids.len();
        Ok((!piece.is_empty()).then_some(piece))
    }

    fn decode_window(&self, tokenizer: &Tokenizer) -> Result<String> {
        tokenizer.decode(&self.ids, self.skip_special_tokens)
    }
}
