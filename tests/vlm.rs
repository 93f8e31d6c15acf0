//! Vision-language generation through the engine on the tiny SmolVLM
//! checkpoint (mlxcel-models/tests/data/tiny/smolvlm, mlx-vlm 0.7.10's
//! goldens): chat messages with image parts give the reference's greedy
//! tokens; a prompt with images never shares prefix-cache blocks (the same
//! token ids stand for different pixels); bad images and images for a
//! text-only model fail with errors that say why.

use std::path::{Path, PathBuf};

use mlxcel_engine::{ContentPart, Engine, EngineLimits, ErrorKind, GenerationRequest, Message, Prompt, QuantParams, SamplingParams};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../mlxcel-models/tests/data/tiny/smolvlm")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

/// A golden case's messages with its image files as path parts.
fn messages(case: &Value) -> Vec<Message> {
    let mut images = case["images"].as_array().unwrap().iter().map(|f| dir().join(f.as_str().unwrap()));
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let parts = m["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| match p["type"].as_str().unwrap() {
                    "image" => ContentPart::image_path(images.next().unwrap()),
                    _ => ContentPart::text(p["text"].as_str().unwrap()),
                })
                .collect::<Vec<_>>();
            Message::new(m["role"].as_str().unwrap(), parts)
        })
        .collect()
}

fn greedy(messages: Vec<Message>, n: usize) -> GenerationRequest {
    let mut request = GenerationRequest::new(Prompt::Chat(messages));
    request.params = SamplingParams { temperature: 0.0, max_tokens: n, ..Default::default() };
    request.ignore_eos = true;
    request
}

#[test]
fn chat_with_images_gives_the_reference_tokens() {
    let engine = Engine::load(&dir()).unwrap();
    assert!(engine.supports_images());
    for case in golden()["cases"].as_array().unwrap() {
        let want: Vec<u32> = case["greedy_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let ids: Vec<u32> = case["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(engine.tokenize_prompt(&Prompt::Chat(messages(case))).unwrap(), ids, "{}", case["name"]);
        let output = engine.generate(&greedy(messages(case), want.len()), |_| true).unwrap();
        assert_eq!(output.tokens, want, "{}", case["name"]);
        assert_eq!(output.stats.prompt_tokens, ids.len());
    }
    // The same images as bytes.
    let case = &golden()["cases"][0];
    let bytes = std::fs::read(dir().join(case["images"][0].as_str().unwrap())).unwrap();
    let message = Message::user(vec![ContentPart::image_bytes(bytes), ContentPart::text("Describe this image.")]);
    let want: Vec<u32> = case["greedy_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(engine.generate(&greedy(vec![message], want.len()), |_| true).unwrap().tokens, want);
}

/// Quantized at load, the text model runs the fused paged kernels with the
/// prefix cache on; prompts with images must neither adopt nor store blocks.
#[test]
fn prompts_with_images_share_no_cached_blocks() {
    let limits = EngineLimits { quantize: Some(QuantParams { bits: 8, group_size: 32 }), ..Default::default() };
    let engine = Engine::load_with(&dir(), limits.clone()).unwrap();
    let text = "Describe this image in every detail, please: the colours, the shapes, the light and what it shows.";
    let with = |image: &str| vec![Message::user(vec![ContentPart::image_path(dir().join(image)), ContentPart::text(text)])];
    let a = engine.generate(&greedy(with("images/landscape.png"), 8), |_| true).unwrap();
    let b = engine.generate(&greedy(with("images/square_rgba.png"), 8), |_| true).unwrap();
    let a_again = engine.generate(&greedy(with("images/landscape.png"), 8), |_| true).unwrap();
    assert_eq!(a.tokens, a_again.tokens);
    for output in [&a, &b, &a_again] {
        assert_eq!(output.stats.cached_tokens, 0);
    }
    // B as a fresh engine computes it.
    let fresh = Engine::load_with(&dir(), limits).unwrap();
    assert_eq!(fresh.generate(&greedy(with("images/square_rgba.png"), 8), |_| true).unwrap().tokens, b.tokens);
    // Text-only prompts still use the cache.
    let plain = || vec![Message::user(vec![ContentPart::text(text), ContentPart::text(text)])];
    engine.generate(&greedy(plain(), 4), |_| true).unwrap();
    let second = engine.generate(&greedy(plain(), 4), |_| true).unwrap();
    assert!(second.stats.cached_tokens > 0, "the prefix cache is on for text-only prompts");
}

#[test]
fn bad_images_fail_with_clear_errors() {
    let engine = Engine::load(&dir()).unwrap();
    let run = |part: ContentPart| {
        let error = engine.generate(&greedy(vec![Message::user(vec![part, ContentPart::text("Hi")])], 2), |_| true).unwrap_err();
        assert_eq!(error.code(), ErrorKind::InvalidParameter);
        assert_eq!(error.parameter(), Some("images"));
        error.to_string()
    };
    let empty = run(ContentPart::image_bytes(Vec::new()));
    assert!(empty.contains("image 1") && empty.contains("empty"), "{empty}");
    let text = run(ContentPart::image_bytes(b"not an image".to_vec()));
    assert!(text.contains("not an image in a supported format"), "{text}");
    let missing = run(ContentPart::image_path("/no/such/file.png"));
    assert!(missing.contains("/no/such/file.png"), "{missing}");
    let png = std::fs::read(dir().join("images/landscape.png")).unwrap();
    let truncated = run(ContentPart::image_bytes(png[..png.len() / 3].to_vec()));
    assert!(truncated.contains("PNG"), "{truncated}");
}

#[test]
fn images_for_a_text_only_model_name_its_architecture() {
    // The tiny llama checkpoint with the SmolVLM tokenizer beside it.
    let tmp = std::env::temp_dir().join(format!("mlxcel-vlm-text-only-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let llama = dir().join("../llama");
    for f in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(llama.join(f), tmp.join(f)).unwrap();
    }
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir().join(f), tmp.join(f)).unwrap();
    }
    let engine = Engine::load(&tmp).unwrap();
    assert!(!engine.supports_images());
    let message = Message::user(vec![ContentPart::image_path(dir().join("images/landscape.png")), ContentPart::text("Hi")]);
    let error = engine.generate(&greedy(vec![message], 2), |_| true).unwrap_err();
    let text = error.to_string();
    assert!(text.contains("`llama`") && text.contains("text-only") && text.contains("smolvlm"), "{text}");
    std::fs::remove_dir_all(&tmp).ok();
}
