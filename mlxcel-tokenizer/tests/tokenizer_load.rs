//! Loading a checkpoint's tokenizer files; encode/decode; special tokens; chat templates.

mod tokenizer_fixture;

use mlxcel_tokenizer::chat_template::Message;
use mlxcel_tokenizer::tokenizer::{Tokenizer, TokenizerKind};
use mlxcel_tokenizer::Error;
use serde_json::json;
use tokenizer_fixture::{byte_level_bpe_json, checkpoint_dir, temp_dir, write_json};

#[test]
fn loads_checkpoint_dir_and_round_trips() {
    let dir = checkpoint_dir("round_trip");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.kind(), TokenizerKind::ByteLevelBpe);
    assert_eq!(tokenizer.kind().to_string(), "BPE (byte-level)");
    assert!(tokenizer.vocab_size() > 256);

    let text = "Hello world, the cat 😀 中文 🇫🇷 don't<|im_end|>";
    let ids = tokenizer.encode(text, true).unwrap();
    let im_end = tokenizer.token_to_id("<|im_end|>").unwrap();
    assert_eq!(
        ids.last(),
        Some(&im_end),
        "special tokens in text are recognised"
    );
    assert_eq!(
        tokenizer.token_to_id("Hello").map(|id| ids[0] == id),
        Some(true)
    );
    assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tokenizer.decode(&ids, true).unwrap(),
        "Hello world, the cat 😀 中文 🇫🇷 don't"
    );
}

#[test]
fn special_tokens_from_added_token_dicts_and_strings() {
    let dir = checkpoint_dir("special_tokens");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.bos_token(), None);
    assert_eq!(tokenizer.eos_token(), Some("<|im_end|>"));
    assert_eq!(tokenizer.pad_token(), Some("<|endoftext|>"));
    let im_end = tokenizer.token_to_id("<|im_end|>").unwrap();
    assert_eq!(tokenizer.eos_token_ids(), &[im_end]);
    assert!(tokenizer.is_eos(im_end));
}

#[test]
fn generation_config_eos_ids_all_count() {
    let dir = checkpoint_dir("generation_config");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let endoftext = tokenizer.token_to_id("<|endoftext|>").unwrap();
    let im_end = tokenizer.token_to_id("<|im_end|>").unwrap();

    write_json(
        &dir,
        "generation_config.json",
        &json!({"eos_token_id": [endoftext, im_end], "bos_token_id": 7}),
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.eos_token_ids(), &[endoftext, im_end]);
    assert_eq!(tokenizer.bos_token_id(), Some(7));

    write_json(
        &dir,
        "generation_config.json",
        &json!({"eos_token_id": endoftext}),
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.eos_token_ids(), &[endoftext, im_end]);
}

#[test]
fn add_bos_token_is_honoured() {
    let dir = temp_dir("add_bos");
    write_json(&dir, "tokenizer.json", &byte_level_bpe_json(true));
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({"bos_token": "<|endoftext|>", "add_bos_token": false}),
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let bos = tokenizer.bos_token_id().unwrap();
    assert_eq!(tokenizer.bos_token(), Some("<|endoftext|>"));
    // The post-processor would add BOS, but the config says not to.
    assert_ne!(tokenizer.encode("Hello", true).unwrap()[0], bos);
    // A BOS written in the text stays.
    assert_eq!(
        tokenizer.encode("<|endoftext|>Hello", true).unwrap()[0],
        bos
    );

    write_json(&dir, "tokenizer.json", &byte_level_bpe_json(false));
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({"bos_token": "<|endoftext|>", "add_bos_token": true}),
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let ids = tokenizer.encode("Hello", true).unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(ids.len(), 2);
    assert_eq!(tokenizer.encode("Hello", false).unwrap().len(), 1);
}

#[test]
fn missing_or_corrupt_files_name_the_file() {
    let dir = temp_dir("missing");
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let dir = checkpoint_dir("corrupt_config");
    std::fs::write(dir.join("tokenizer_config.json"), "[1, 2").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, Error::Json { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

    let dir = checkpoint_dir("corrupt_generation_config");
    std::fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": ").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(err.to_string().contains("generation_config.json"), "{err}");

    let dir = checkpoint_dir("broken_template");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}\n{{ m.content }",
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("chat_template.jinja") && message.contains("line 2"),
        "{message}"
    );
}

#[test]
fn chat_template_from_config_and_jinja_file() {
    let dir = checkpoint_dir("chat_template_sources");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let messages = [Message::user("Hi")];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, true).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        tokenizer
            .apply_chat_template(&[json!({"role": "user", "content": "Hi"})], false)
            .unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );

    // chat_template.jinja wins over tokenizer_config.json.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ messages[0].content }}{{ eos_token }}\n",
    )
    .unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tokenizer.apply_chat_template(&messages, true).unwrap(),
        "Hi<|im_end|>"
    );
}

#[test]
fn named_chat_templates() {
    let dir = checkpoint_dir("named_templates");
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({
            "eos_token": "<|im_end|>",
            "chat_template": [
                {"name": "default", "template": "default:{{ messages | length }}"},
                {"name": "tool_use", "template": "tools:{{ tools | length }}"}
            ]
        }),
    );
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tokenizer.chat_template_names().collect::<Vec<_>>(),
        ["default", "tool_use"]
    );
    let messages = [Message::user("Hi")];
    assert_eq!(
        tokenizer.apply_chat_template(&messages, false).unwrap(),
        "default:1"
    );
    let options = mlxcel_tokenizer::chat_template::RenderOptions {
        tools: Some(json!([{"type": "function"}])),
        ..Default::default()
    };
    assert_eq!(
        tokenizer
            .apply_chat_template_with(&messages, options)
            .unwrap(),
        "tools:1"
    );
    assert!(tokenizer.named_chat_template("rag").is_none());
}

#[test]
fn no_chat_template_is_an_error() {
    let dir = temp_dir("no_template");
    write_json(&dir, "tokenizer.json", &byte_level_bpe_json(false));
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert!(tokenizer.chat_template().is_none());
    let err = tokenizer
        .apply_chat_template(&[Message::user("Hi")], true)
        .unwrap_err();
    assert!(matches!(err, Error::ChatTemplate(_)), "{err}");
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let tokenizer = std::sync::Arc::new(Tokenizer::from_dir(&checkpoint_dir("threads")).unwrap());
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let tokenizer = tokenizer.clone();
            std::thread::spawn(move || {
                let text = format!("Hello world {i}");
                let ids = tokenizer.encode(&text, false).unwrap();
                assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}
