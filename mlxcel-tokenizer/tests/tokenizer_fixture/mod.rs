//! A tiny byte-level BPE checkpoint directory written on the fly (no network, no files in git).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// A non-special added token.
pub const THINK: &str = "<think>";

/// GPT-2's byte → printable char mapping.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(b) {
        return char::from(b);
    }
    let offset = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + offset).unwrap()
}

fn token_text(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_char(b)).collect()
}

/// Byte sequences merged (left to right) into one token each.
fn merged_byte_words() -> Vec<Vec<u8>> {
    let mut words: Vec<Vec<u8>> = [
        "Hello", " world", " the", " cat", "ing", " 😀", "中文", " don", "'t",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    words.push("😀".as_bytes()[..2].to_vec()); // first half of the emoji
    words.push("😀".as_bytes()[2..].to_vec()); // second half
    words.push("中".as_bytes()[..2].to_vec()); // two of three bytes
    words.push("🇫🇷".as_bytes()[1..6].to_vec()); // straddles both flag code points
    words
}

/// The `tokenizer.json` of a byte-level BPE with 256 byte tokens, some merges and the
/// special tokens in [`SPECIAL_TOKENS`] plus [`THINK`]. With `bos`, a template
/// post-processor prepends `<|endoftext|>`.
pub fn byte_level_bpe_json(bos: bool) -> Value {
    let mut vocab: Vec<String> = (0..=255u8).map(|b| token_text(&[b])).collect();
    let mut merges: Vec<(String, String)> = Vec::new();
    for word in merged_byte_words() {
        let mut current = token_text(&word[..1]);
        for &b in &word[1..] {
            let next = token_text(&[b]);
            let merged = format!("{current}{next}");
            if !vocab.contains(&merged) {
                merges.push((current.clone(), next));
                vocab.push(merged.clone());
            }
            current = merged;
        }
    }
    let base = vocab.len();
    let vocab_json: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let mut added = Vec::new();
    for (i, token) in SPECIAL_TOKENS.iter().enumerate() {
        added.push(added_token(base + i, token, true));
    }
    added.push(added_token(base + SPECIAL_TOKENS.len(), THINK, false));
    let bos_id = base; // <|endoftext|>
    let post_processor = if bos {
        json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos_id], "tokens": ["<|endoftext|>"]}}
        })
    } else {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab_json,
            "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
        }
    })
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": special})
}

/// A fresh, empty directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mlxcel-tokenizer-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn write_json(dir: &Path, file: &str, value: &Value) {
    std::fs::write(dir.join(file), serde_json::to_string_pretty(value).unwrap()).unwrap();
}

/// A checkpoint directory with `tokenizer.json` and a ChatML-style `tokenizer_config.json`.
pub fn checkpoint_dir(name: &str) -> PathBuf {
    let dir = temp_dir(name);
    write_json(&dir, "tokenizer.json", &byte_level_bpe_json(false));
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({
            "bos_token": null,
            "eos_token": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true},
            "pad_token": "<|endoftext|>",
            "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        }),
    );
    dir
}
