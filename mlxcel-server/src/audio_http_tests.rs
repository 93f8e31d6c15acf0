//! `/v1/audio/transcriptions` and `/v1/audio/translations` over HTTP: the
//! server's own router and loader (`--whisper-model whisper-tiny.en`, the
//! default language model beside it) on a local port, multipart uploads of
//! the Whisper test clips (tests/fixtures/audio), every response format and
//! the error shapes (400 for bad audio or fields, 413 past --max-audio-bytes).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use clap::Parser;
use serde_json::Value;

use crate::cli::ServeArgs;
use crate::state::{AppState, Config};
use crate::ModelSource;

const FOX: &str = "The quick brown fox jump over the lazy nog.";

struct Source;

impl ModelSource for Source {
    fn default_model(&self, _offline: bool) -> Result<PathBuf, String> {
        mlxcel_hub::fetch_default_model(&Default::default(), &mut |_| {}).map_err(|e| e.to_string())
    }
    fn convert_gguf(&self, _gguf: &Path, _out: &Path) -> Result<(), String> {
        Err("no GGUF in these tests".into())
    }
}

fn clip(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/audio").join(name)).unwrap()
}

/// A server on a free local port, on its own runtime thread.
pub(crate) fn start(extra: &[&str]) -> String {
    let mut argv = vec!["serve", "--parallel", "1", "--max-audio-bytes", "200000"];
    argv.extend_from_slice(extra);
    let args = ServeArgs::try_parse_from(argv).unwrap();
    let loaded = crate::load(&args, &Source).unwrap();
    let config = Config {
        alias: "smol".into(),
        parallel: 1,
        max_queue: 4,
        metrics: false,
        slots_endpoint: true,
        web_ui: false,
        body_limit: args.max_body_bytes,
        audio_limit: args.max_audio_bytes,
    };
    let state = AppState::new(config);
    state.set_loaded(loaded);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, crate::router(state, Vec::new())).await.unwrap();
        });
    });
    address
}

/// One HTTP/1.1 request; the status, the content type and the body.
pub(crate) fn request(address: &str, path: &str, content_type: &str, body: &[u8]) -> (u16, String, String) {
    let mut stream = TcpStream::connect(address).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    // A server that refuses early (413) may close before the whole body is sent.
    let _ = stream.write_all(body);
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    let reply = String::from_utf8(reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let content_type = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type: ").map(str::to_string))
        .unwrap_or_default();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() };
    (status, content_type, body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

const BOUNDARY: &str = "mlxcel-test-boundary-7d1f";

/// A multipart/form-data body: text fields, then the file (when given).
fn form(fields: &[(&str, &str)], file: Option<&[u8]>) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend(format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes());
    }
    if let Some(file) = file {
        body.extend(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clip.flac\"\r\nContent-Type: audio/flac\r\n\r\n")
                .as_bytes(),
        );
        body.extend_from_slice(file);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

fn post_form(address: &str, path: &str, fields: &[(&str, &str)], file: Option<&[u8]>) -> (u16, String, String) {
    request(address, path, &format!("multipart/form-data; boundary={BOUNDARY}"), &form(fields, file))
}

pub(crate) fn error_of(status: u16, body: &str) -> (u16, String, Value) {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["error"]["code"], status, "{body}");
    (status, v["error"]["type"].as_str().unwrap().to_string(), v["error"]["param"].clone())
}

#[test]
fn transcriptions_in_every_format_and_their_errors() {
    let address = start(&["--whisper-model", mlxcel_hub::WHISPER_TINY_EN.name]);
    let fox = clip("en_fox_us.flac");
    let path = "/v1/audio/transcriptions";

    let (status, kind, body) = post_form(&address, path, &[("model", "whisper-1")], Some(&fox));
    assert_eq!((status, kind.as_str()), (200, "application/json"), "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), serde_json::json!({ "text": FOX }));

    let (status, _, body) = post_form(&address, path, &[("model", "whisper-1"), ("response_format", "verbose_json"), ("language", "en")], Some(&fox));
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["task"].as_str(), v["language"].as_str(), v["text"].as_str()), (Some("transcribe"), Some("en"), Some(FOX)));
    assert!((v["duration"].as_f64().unwrap() - 2.909).abs() < 1e-3);
    let segment = &v["segments"][0];
    assert_eq!(segment["text"], format!(" {FOX}"));
    assert_eq!((segment["id"].as_u64(), segment["seek"].as_u64(), segment["start"].as_f64()), (Some(0), Some(0), Some(0.0)));
    for key in ["end", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob"] {
        assert!(segment[key].is_number(), "{key}: {segment}");
    }
    assert_eq!(segment["tokens"][0], 50363);

    let (status, kind, body) = post_form(&address, path, &[("response_format", "text"), ("temperature", "0")], Some(&fox));
    assert_eq!((status, kind.as_str(), body.as_str()), (200, "text/plain; charset=utf-8", format!("{FOX}\n").as_str()));
    let (status, _, srt) = post_form(&address, path, &[("response_format", "srt")], Some(&fox));
    assert!(status == 200 && srt.starts_with("1\n00:00:00,000 --> 00:00:0") && srt.ends_with(&format!("\n{FOX}\n\n")), "{srt:?}");
    let (status, kind, vtt) = post_form(&address, path, &[("response_format", "vtt")], Some(&fox));
    assert!(status == 200 && kind.starts_with("text/vtt") && vtt.starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:0"), "{vtt:?}");

    // Errors, in OpenAI's shape with the field named.
    let (status, _, body) = post_form(&address, path, &[("model", "whisper-1")], Some(b"this is not audio"));
    assert_eq!(error_of(status, &body), (400, "invalid_request_error".into(), "file".into()));
    let (status, _, body) = post_form(&address, path, &[("model", "whisper-1")], None);
    assert_eq!(error_of(status, &body), (400, "invalid_request_error".into(), "file".into()));
    let (status, _, body) = post_form(&address, path, &[("response_format", "mp4")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "response_format");
    let (status, _, body) = post_form(&address, path, &[("temperature", "hot")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "temperature");
    let (status, _, body) = post_form(&address, path, &[("temperature", "5")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "temperature");
    let (status, _, body) = post_form(&address, path, &[("language", "de")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "language");
    let (status, _, body) = post_form(&address, path, &[("timestamp_granularities[]", "word")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "timestamp_granularities[]");
    let (status, _, body) = post_form(&address, "/v1/audio/translations", &[("model", "whisper-1")], Some(&fox));
    assert_eq!(error_of(status, &body).2, "task"); // tiny.en is English-only
    let (status, _, body) = request(&address, path, "application/json", br#"{"file": "x"}"#);
    assert_eq!(error_of(status, &body).0, 400);
    // Larger than --max-audio-bytes (200000): 413, and the server goes on.
    let (status, _, body) = post_form(&address, path, &[], Some(&clip("en_paragraph.flac")));
    assert_eq!(error_of(status, &body).0, 413);
    assert!(body.contains("--max-audio-bytes"), "{body}");
    let (status, _, body) = post_form(&address, path, &[], Some(&fox));
    assert_eq!((status, body), (200, format!("{{\"text\":\"{FOX}\"}}")));

    // Two uploads at once: each gets its own text.
    let wav = clip("en_mono_16k.wav");
    let other = {
        let address = address.clone();
        std::thread::spawn(move || post_form(&address, "/v1/audio/transcriptions", &[("response_format", "text")], Some(&wav)))
    };
    let (status, _, body) = post_form(&address, path, &[("response_format", "text")], Some(&fox));
    assert_eq!((status, body.as_str()), (200, format!("{FOX}\n").as_str()));
    let (status, _, body) = other.join().unwrap();
    assert_eq!((status, body.as_str()), (200, "This file is a plain 16 bit frame file.\n"));
}

#[test]
fn without_a_whisper_model_the_routes_say_so() {
    let address = start(&[]);
    let (status, _, body) = post_form(&address, "/v1/audio/transcriptions", &[], Some(b"x"));
    assert_eq!(error_of(status, &body), (501, "not_supported_error".into(), Value::Null));
    assert!(body.contains("--whisper-model"), "{body}");
}
