//! `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` rebuilt from the
//! GGUF vocabulary (`tokenizer.ggml.*`), in the form Hugging Face `tokenizers` loads.

use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};

use crate::arch::ids_json;
use crate::reader::{GgufFile, Value};
use crate::error::{Error, Result};

/// GGUF token types (`llama_token_type`).
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// Control tokens that end a turn: generation stops on them too.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
];

/// Llama 3's pre-tokenizer split (`tokenizer.ggml.pre = llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's pre-tokenizer split (`tokenizer.ggml.pre = qwen2`): single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer side of a converted checkpoint.
pub struct TokenizerFiles {
    pub tokenizer: Json,
    pub tokenizer_config: Json,
    pub generation_config: Json,
    pub chat_template: Option<String>,
    pub bos_id: Option<u64>,
    /// All ids that end generation.
    pub eos_ids: Vec<u64>,
}

struct Vocab {
    tokens: Vec<String>,
    types: Vec<i64>,
    scores: Vec<f32>,
}

/// Builds the tokenizer files; `arch` is `general.architecture` (Gemma orders merges differently).
pub fn build(gguf: &GgufFile, arch: &str, max_length: u64) -> Result<TokenizerFiles> {
    let invalid = |m: String| Error::invalid_file(&gguf.path, m);
    let model = gguf
        .get_str("tokenizer.ggml.model")
        .ok_or_else(|| invalid("missing `tokenizer.ggml.model`".into()))?;
    let vocab = read_vocab(gguf)?;
    let n = vocab.tokens.len() as u64;
    let id = |key: &str| gguf.get_u64(key).filter(|&i| i < n);

    let bos_id = id("tokenizer.ggml.bos_token_id");
    let eos_id = id("tokenizer.ggml.eos_token_id");
    let unk_id = id("tokenizer.ggml.unknown_token_id");
    let pad_id = id("tokenizer.ggml.padding_token_id");
    let mut eos_ids: Vec<u64> = [
        eos_id,
        id("tokenizer.ggml.eot_token_id"),
        id("tokenizer.ggml.eom_token_id"),
    ]
    .into_iter()
    .flatten()
    .collect();
    for (i, (tok, &ty)) in vocab.tokens.iter().zip(&vocab.types).enumerate() {
        if ty == TOKEN_CONTROL && END_OF_TURN.contains(&tok.as_str()) {
            eos_ids.push(i as u64);
        }
    }
    let mut seen = std::collections::HashSet::new();
    eos_ids.retain(|i| seen.insert(*i));

    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(Error::Unsupported {
                path: gguf.path.clone(),
                message: format!("tokenizer model `{other}` (supported: gpt2, llama)"),
            })
        }
    };
    let add_bos = gguf.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(spm);
    let add_eos = gguf
        .get_bool("tokenizer.ggml.add_eos_token")
        .unwrap_or(false);
    let token = |i: Option<u64>| i.map(|i| vocab.tokens[i as usize].clone());
    let post = post_processor(
        spm,
        add_bos.then_some(bos_id).flatten(),
        add_eos.then_some(eos_id).flatten(),
        &vocab,
    );

    let tokenizer = if spm {
        let add_prefix = gguf
            .get_bool("tokenizer.ggml.add_space_prefix")
            .unwrap_or(true);
        // Gemma's scores do not follow its merge order; the vocabulary order does.
        let by_position = arch.starts_with("gemma");
        spm_tokenizer(&vocab, token(unk_id), add_prefix, by_position, post)
    } else {
        let merges = gguf
            .get_array("tokenizer.ggml.merges")
            .ok_or_else(|| invalid("missing `tokenizer.ggml.merges`".into()))?;
        let merges = merges
            .iter()
            .map(|m| {
                m.as_str()
                    .and_then(|m| m.split_once(' '))
                    .map(|(a, b)| json!([a, b]))
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                invalid("`tokenizer.ggml.merges` holds an entry that is not \"a b\"".into())
            })?;
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        bpe_tokenizer(&vocab, merges, pre, post)
    };

    let chat_template = gguf.get_str("tokenizer.chat_template").map(str::to_string);
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    config.insert("add_bos_token".into(), add_bos.into());
    config.insert("add_eos_token".into(), add_eos.into());
    config.insert("clean_up_tokenization_spaces".into(), false.into());
    config.insert("model_max_length".into(), max_length.into());
    for (key, id) in [
        ("bos_token", bos_id),
        ("eos_token", eos_id),
        ("unk_token", unk_id),
        ("pad_token", pad_id),
    ] {
        if let Some(t) = token(id) {
            config.insert(key.into(), t.into());
        }
    }
    if let Some(t) = &chat_template {
        config.insert("chat_template".into(), t.clone().into());
    }

    let mut generation = Map::new();
    if let Some(bos) = bos_id {
        generation.insert("bos_token_id".into(), bos.into());
    }
    if let Some(eos) = ids_json(&eos_ids) {
        generation.insert("eos_token_id".into(), eos);
    }
    if let Some(pad) = pad_id {
        generation.insert("pad_token_id".into(), pad.into());
    }

    Ok(TokenizerFiles {
        tokenizer,
        tokenizer_config: Json::Object(config),
        generation_config: Json::Object(generation),
        chat_template,
        bos_id,
        eos_ids,
    })
}

fn read_vocab(gguf: &GgufFile) -> Result<Vocab> {
    let invalid = |m: &str| Error::invalid_file(&gguf.path, m);
    let tokens = gguf
        .get_array("tokenizer.ggml.tokens")
        .ok_or_else(|| invalid("missing `tokenizer.ggml.tokens`"))?
        .iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| invalid("`tokenizer.ggml.tokens` is not an array of strings"))?;
    let numbers = |key: &str, default: f64| -> Result<Vec<f64>> {
        match gguf.get_array(key) {
            None => Ok(vec![default; tokens.len()]),
            Some(a) if a.len() == tokens.len() => a
                .iter()
                .map(Value::as_f64)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| invalid(&format!("`{key}` is not an array of numbers"))),
            Some(a) => Err(invalid(&format!(
                "`{key}` has {} entries for {} tokens",
                a.len(),
                tokens.len()
            ))),
        }
    };
    let types = numbers("tokenizer.ggml.token_type", 1.0)?
        .into_iter()
        .map(|t| t as i64)
        .collect();
    let scores = numbers("tokenizer.ggml.scores", 0.0)?
        .into_iter()
        .map(|s| s as f32)
        .collect();
    Ok(Vocab {
        tokens,
        types,
        scores,
    })
}

fn added_token(id: usize, content: &str, special: bool) -> Json {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": special,
    })
}

/// `TemplateProcessing` adding BOS/EOS, or `None` when nothing is added.
fn template(bos: Option<u64>, eos: Option<u64>, vocab: &Vocab) -> Option<Json> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let name = |id: u64| vocab.tokens[id as usize].clone();
    let mut special_tokens = Map::new();
    let piece = |id: Option<u64>, type_id: u32| {
        id.map(|id| json!({"SpecialToken": {"id": name(id), "type_id": type_id}}))
    };
    for id in [bos, eos].into_iter().flatten() {
        special_tokens.insert(
            name(id),
            json!({"id": name(id), "ids": [id], "tokens": [name(id)]}),
        );
    }
    let seq = |s: &str, type_id: u32| Some(json!({"Sequence": {"id": s, "type_id": type_id}}));
    let single: Vec<Json> = [piece(bos, 0), seq("A", 0), piece(eos, 0)]
        .into_iter()
        .flatten()
        .collect();
    let pair: Vec<Json> = [
        piece(bos, 0),
        seq("A", 0),
        piece(eos, 0),
        piece(bos, 1),
        seq("B", 1),
        piece(eos, 1),
    ]
    .into_iter()
    .flatten()
    .collect();
    Some(
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens}),
    )
}

fn post_processor(spm: bool, bos: Option<u64>, eos: Option<u64>, vocab: &Vocab) -> Json {
    let template = template(bos, eos, vocab);
    if spm {
        return template.unwrap_or(Json::Null);
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
    match template {
        Some(t) => json!({"type": "Sequence", "processors": [byte_level, t]}),
        None => byte_level,
    }
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
fn bpe_tokenizer(vocab: &Vocab, merges: Vec<Json>, pre: &str, post_processor: Json) -> Json {
    let byte_level = |use_regex: bool, trim_offsets: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let (pre_tokenizer, normalizer, ignore_merges) = match pre {
        "smollm" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true, true)]}),
            Json::Null,
            false,
        ),
        "llama-bpe" | "llama3" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false, true)]}),
            Json::Null,
            true,
        ),
        "qwen2" => (
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false, false)]}),
            json!({"type": "NFC"}),
            false,
        ),
        // "gpt2", "default" and others: GPT-2's own regex, built into ByteLevel.
        _ => (byte_level(true, true), Json::Null, false),
    };

    let mut vocab_map = Map::new();
    let mut added = Vec::new();
    for (id, (tok, &ty)) in vocab.tokens.iter().zip(&vocab.types).enumerate() {
        match ty {
            TOKEN_CONTROL | TOKEN_UNKNOWN => {
                added.push(added_token(id, tok, true));
                vocab_map.insert(tok.clone(), id.into());
            }
            TOKEN_USER_DEFINED => {
                // llama.cpp stores user-defined tokens as plain text; the BPE vocab wants bytes.
                let text = byte_level_decode(tok).unwrap_or_else(|| tok.clone());
                added.push(added_token(id, &text, false));
                vocab_map.insert(byte_level_encode(&text), id.into());
            }
            // Vocabulary pieces are byte symbols; re-spell any a converter left as plain text.
            _ if tok.chars().all(is_byte_symbol) => {
                vocab_map.insert(tok.clone(), id.into());
            }
            _ => {
                vocab_map.insert(byte_level_encode(tok), id.into());
            }
        }
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab_map, "merges": merges,
        },
    })
}

/// SentencePiece BPE (`tokenizer.ggml.model = llama`), as `transformers` converts it.
fn spm_tokenizer(
    vocab: &Vocab,
    unk: Option<String>,
    add_space_prefix: bool,
    by_position: bool,
    post_processor: Json,
) -> Json {
    let replace = |from: &str, to: &str| json!({"type": "Replace", "pattern": {"String": from}, "content": to});
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace(" ", "▁")]})
    } else {
        replace(" ", "▁")
    };
    let mut decoders = vec![
        replace("▁", " "),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }

    // Gemma files store runs of spaces as spaces; the model looks them up as "▁▁...".
    let tokens: Vec<String> = vocab
        .tokens
        .iter()
        .map(|t| {
            if !t.is_empty() && t.chars().all(|c| c == ' ') {
                "▁".repeat(t.len())
            } else {
                t.clone()
            }
        })
        .collect();
    let mut vocab_map = Map::new();
    let mut added = Vec::new();
    for (id, (tok, &ty)) in tokens.iter().zip(&vocab.types).enumerate() {
        vocab_map.insert(tok.clone(), id.into());
        if matches!(ty, TOKEN_CONTROL | TOKEN_UNKNOWN | TOKEN_USER_DEFINED) {
            added.push(added_token(id, tok, ty != TOKEN_USER_DEFINED));
        }
    }
    let ranks: Vec<f32> = if by_position {
        (0..tokens.len()).map(|i| -(i as f32)).collect()
    } else {
        vocab.scores.clone()
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab_map, "merges": spm_merges(&tokens, &ranks),
        },
    })
}

/// BPE merges of a SentencePiece vocabulary, as `transformers` derives them: every split
/// `t = a + b` with `a` and `b` in the vocabulary is a merge; merges are ordered by the score
/// of `t` (highest first), then by the lengths of `a` and `b` (longest first), then by the ids
/// of `a` and `b`.
pub fn spm_merges(tokens: &[String], scores: &[f32]) -> Vec<Json> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, usize)> = Vec::new();
    for (t, tok) in tokens.iter().enumerate() {
        let start = merges.len();
        for (split, _) in tok.char_indices().skip(1) {
            if let (Some(&a), Some(&b)) = (ids.get(&tok[..split]), ids.get(&tok[split..])) {
                merges.push((scores[t], a, b));
            }
        }
        merges[start..].sort_by_key(|&(_, a, b)| (a, b));
    }
    // Stable: ties keep vocabulary order.
    let chars = |i: usize| tokens[i].chars().count();
    merges.sort_by(|x, y| {
        y.0.total_cmp(&x.0)
            .then(chars(y.1).cmp(&chars(x.1)))
            .then(chars(y.2).cmp(&chars(x.2)))
    });
    merges
        .into_iter()
        .map(|(_, a, b)| json!([tokens[a], tokens[b]]))
        .collect()
}

fn printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the others to U+0100...
fn byte_to_char(b: u8) -> char {
    if printable(b) {
        b as char
    } else {
        let offset = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + offset).expect("valid code point")
    }
}

/// Whether `c` is one of the 256 byte symbols of byte-level BPE.
fn is_byte_symbol(c: char) -> bool {
    match u32::from(c) {
        v @ 0..=255 => printable(v as u8),
        v => v < 256 + 68, // 68 = number of non-printable bytes
    }
}

/// Text as byte-level BPE symbols.
pub fn byte_level_encode(text: &str) -> String {
    text.bytes().map(byte_to_char).collect()
}

/// Byte-level symbols back to text; `None` if a char is not a byte symbol or the bytes are not UTF-8.
pub fn byte_level_decode(symbols: &str) -> Option<String> {
    let table: HashMap<char, u8> = (0..=255u8).map(|b| (byte_to_char(b), b)).collect();
    let bytes = symbols
        .chars()
        .map(|c| table.get(&c).copied())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}
