//! Tokenizer wrapper and streaming detokenization.
