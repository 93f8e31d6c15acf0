//! Image parts in `/v1/chat/completions` over HTTP, on the tiny random
//! SmolVLM (mlxcel-models/tests/data/tiny/smolvlm) through the server's own
//! loader and router (audio_http_tests' `start`): OpenAI's `image_url` data
//! URLs give the engine's greedy reply; http(s) URLs, local paths, bad
//! images, images over --max-image-bytes (413) and images for a text-only
//! model are refused with the part or the architecture named.

use std::path::PathBuf;

use base64::Engine as _;
use mlxcel_engine::{ContentPart, Engine, GenerationRequest, Message, Prompt, SamplingParams};
use serde_json::{json, Value};

use crate::audio_http_tests::{error_of, request, start};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../mlxcel-models/tests/data/tiny/smolvlm")
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn chat(address: &str, content: Value) -> (u16, String) {
    let body = json!({ "messages": [{ "role": "user", "content": content }], "max_tokens": 16, "temperature": 0 });
    let (status, _, body) = request(address, "/v1/chat/completions", "application/json", body.to_string().as_bytes());
    (status, body)
}

#[test]
fn image_url_parts_and_their_errors() {
    let png = std::fs::read(dir().join("images/landscape.png")).unwrap();
    let address = start(&["--model", dir().to_str().unwrap(), "--max-image-bytes", "100000"]);
    let image = json!({ "type": "image_url", "image_url": { "url": data_url(&png) } });

    // The engine's own greedy reply to the same message.
    let engine = Engine::load(&dir()).unwrap();
    let message = Message::user(vec![ContentPart::image_bytes(png.clone()), ContentPart::text("Describe this image.")]);
    let prompt = Prompt::Chat(vec![message]);
    let n_prompt = engine.tokenize_prompt(&prompt).unwrap().len();
    let mut want = GenerationRequest::new(prompt);
    want.params = SamplingParams { temperature: 0.0, max_tokens: 16, ..Default::default() };
    let want = engine.generate(&want, |_| true).unwrap();

    let (status, body) = chat(&address, json!([image, { "type": "text", "text": "Describe this image." }]));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(want.text.as_str()), "{body}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(n_prompt as u64), "image tokens counted: {body}");
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(want.tokens.len() as u64));
    // `image_url` as a bare string works too.
    let (status, body) = chat(&address, json!([{ "type": "image_url", "image_url": data_url(&png) }, { "type": "text", "text": "Describe this image." }]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["choices"][0]["message"]["content"].as_str(), Some(want.text.as_str()));
    // Text-only messages on a VLM: text parts joined, as before.
    let (status, body) = chat(&address, json!([{ "type": "text", "text": "Hello" }]));
    assert_eq!(status, 200, "{body}");

    // Errors: 400 naming the part, or `images` for what the decoder says.
    let cases = [
        (json!({ "type": "image_url", "image_url": { "url": "https://example.com/cat.png" } }), "messages[0].content[0]", "not fetched"),
        (json!({ "type": "image_url", "image_url": { "url": "data:image/png;base64,@@@" } }), "messages[0].content[0]", "base64"),
        (json!({ "type": "image_url", "image_url": {} }), "messages[0].content[0]", "image_url.url"),
        (json!({ "type": "image", "path": "/etc/passwd" }), "messages[0].content[0]", "not accepted"),
        (json!({ "type": "input_audio", "input_audio": {} }), "messages[0].content[0]", "not supported"),
        (json!({ "type": "image_url", "image_url": { "url": data_url(b"not an image") } }), "images", "not an image in a supported format"),
        (json!({ "type": "image_url", "image_url": { "url": data_url(&png[..png.len() / 3]) } }), "images", "PNG"),
    ];
    for (part, param, needle) in cases {
        let (status, body) = chat(&address, json!([part, { "type": "text", "text": "Hi" }]));
        let (code, kind, got) = error_of(status, &body);
        assert_eq!((code, kind.as_str(), got.as_str()), (400, "invalid_request_error", Some(param)), "{body}");
        assert!(body.contains(needle), "{needle}: {body}");
    }
    // Over --max-image-bytes: 413, and the server goes on.
    let (status, body) = chat(&address, json!([{ "type": "image_url", "image_url": { "url": data_url(&vec![0u8; 100_001]) } }]));
    assert_eq!(error_of(status, &body).0, 413);
    assert!(body.contains("more than the limit of 100000 bytes") && body.contains("--max-image-bytes"), "{body}");
    let (status, body) = chat(&address, json!([image, { "type": "text", "text": "Describe this image." }]));
    assert_eq!(status, 200, "{body}");
}

#[test]
fn images_for_a_text_only_model_name_its_architecture() {
    let address = start(&[]); // the default model, SmolLM2 (llama)
    let png = std::fs::read(dir().join("images/landscape.png")).unwrap();
    let (status, body) = chat(&address, json!([{ "type": "image_url", "image_url": { "url": data_url(&png) } }, { "type": "text", "text": "Hi" }]));
    let (code, _, param) = error_of(status, &body);
    assert_eq!((code, param.as_str()), (400, Some("images")), "{body}");
    assert!(body.contains("`llama`, a text-only architecture"), "{body}");
}
