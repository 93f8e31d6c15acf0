//! OpenAI's speech to text: `POST /v1/audio/transcriptions` and
//! `/v1/audio/translations` over the `--whisper-model`'s `Transcriber`
//! (multipart/form-data uploads, parsed by axum's multer-based `Multipart`).
//! Defaults and checks are the engine's; only the form fields and the
//! response formats live here.

use std::sync::Arc;

use axum::extract::multipart::{Multipart, MultipartError, MultipartRejection};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use mlxcel_engine::{Audio, Task, TranscribeOptions, Transcription};
use serde_json::{json, Value};

use crate::api_error::{ApiError, ApiResult};
use crate::state::AppState;

/// OpenAI's upload limit (25 MB), the default of `--max-audio-bytes`.
pub const DEFAULT_MAX_AUDIO_BYTES: usize = 25 << 20;

pub async fn transcriptions(State(state): State<Arc<AppState>>, form: Result<Multipart, MultipartRejection>) -> Response {
    run(state, form, Task::Transcribe).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn translations(State(state): State<Arc<AppState>>, form: Result<Multipart, MultipartRejection>) -> Response {
    run(state, form, Task::Translate).await.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Text,
    VerboseJson,
    Srt,
    Vtt,
}

/// The form's fields (OpenAI's names).
#[derive(Default)]
struct Form {
    file: Option<Vec<u8>>,
    language: Option<String>,
    prompt: Option<String>,
    response_format: Option<String>,
    temperature: Option<String>,
    granularities: Vec<String>,
    stream: Option<String>,
}

fn multipart_error(state: &AppState, e: MultipartError) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the upload is larger than this server's limit of {} bytes (raise --max-audio-bytes)", state.config.audio_limit),
        );
    }
    ApiError::bad_request(format!("invalid multipart/form-data body: {}", e.body_text()))
}

async fn read_form(state: &AppState, form: Result<Multipart, MultipartRejection>) -> ApiResult<Form> {
    let mut multipart = form.map_err(|e| ApiError::bad_request(format!("expected a multipart/form-data body with a `file` field: {}", e.body_text())))?;
    let mut form = Form::default();
    while let Some(field) = multipart.next_field().await.map_err(|e| multipart_error(state, e))? {
        let name = field.name().unwrap_or_default().to_string();
        if name == "file" {
            form.file = Some(field.bytes().await.map_err(|e| multipart_error(state, e))?.to_vec());
            continue;
        }
        let value = field.text().await.map_err(|e| multipart_error(state, e))?;
        match name.as_str() {
            "language" => form.language = Some(value),
            "prompt" => form.prompt = Some(value),
            "response_format" => form.response_format = Some(value),
            "temperature" => form.temperature = Some(value),
            "timestamp_granularities[]" | "timestamp_granularities" => form.granularities.push(value),
            "stream" => form.stream = Some(value),
            // `model` names the --whisper-model whatever it says (the SDKs send "whisper-1"); others are ignored.
            _ => {}
        }
    }
    Ok(form)
}

async fn run(state: Arc<AppState>, form: Result<Multipart, MultipartRejection>, task: Task) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let Some((_, transcriber)) = loaded.transcriber.clone() else {
        return Err(ApiError::not_supported(
            "this server has no speech-to-text model: start it with --whisper-model PATH|NAME (e.g. whisper-tiny.en)",
        ));
    };
    let form = read_form(&state, form).await?;
    let file = form.file.ok_or_else(|| ApiError::field("file", "is required (the audio file, as a multipart/form-data file field)"))?;
    let format = match form.response_format.as_deref().unwrap_or("json") {
        "json" => Format::Json,
        "text" => Format::Text,
        "verbose_json" => Format::VerboseJson,
        "srt" => Format::Srt,
        "vtt" => Format::Vtt,
        other => return Err(ApiError::field("response_format", format!("`{other}` (json, text, verbose_json, srt or vtt)"))),
    };
    if form.stream.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("true")) {
        return Err(ApiError::field("stream", "streaming transcriptions are not supported"));
    }
    if let Some(other) = form.granularities.iter().find(|g| g.as_str() != "segment") {
        return Err(ApiError::field("timestamp_granularities[]", format!("`{other}`: only `segment` timestamps are supported")));
    }
    let defaults = TranscribeOptions::default();
    // OpenAI: 0 (the default) raises the temperature as the thresholds say; another value is used alone.
    let temperatures = match form.temperature.as_deref().map(str::trim) {
        None | Some("") => defaults.temperatures.clone(),
        Some(text) => match text.parse::<f32>() {
            Ok(t) if t == 0.0 => defaults.temperatures.clone(),
            Ok(t) => vec![t],
            Err(_) => return Err(ApiError::field("temperature", format!("`{text}` is not a number"))),
        },
    };
    let options = TranscribeOptions {
        task,
        language: form.language.filter(|l| !l.trim().is_empty()).map(|l| l.trim().to_string()),
        temperatures,
        initial_prompt: form.prompt,
        ..defaults
    };
    let transcription = tokio::task::spawn_blocking(move || transcriber.transcribe(Audio::Bytes(&file), &options))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("the transcription task failed: {e}")))?
        .map_err(|e| {
            ApiError::from_engine(&e, |name| match name {
                "audio" => "file",
                "temperatures" => "temperature",
                "initial_prompt" => "prompt",
                other => other,
            })
        })?;
    Ok(respond(&transcription, task, format))
}

fn respond(t: &Transcription, task: Task, format: Format) -> Response {
    let text = |body: String, content_type: &'static str| ([(header::CONTENT_TYPE, content_type)], body).into_response();
    match format {
        Format::Json => axum::Json(json!({ "text": t.text.trim() })).into_response(),
        Format::Text => text(format!("{}\n", t.text.trim()), "text/plain; charset=utf-8"),
        Format::VerboseJson => axum::Json(verbose_json(t, task)).into_response(),
        Format::Srt => text(subtitles(t, ",", false), "text/plain; charset=utf-8"),
        Format::Vtt => text(subtitles(t, ".", true), "text/vtt; charset=utf-8"),
    }
}

/// OpenAI's `verbose_json` (the language as its code, e.g. `en`).
fn verbose_json(t: &Transcription, task: Task) -> Value {
    let segments: Vec<Value> = t
        .segments
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "seek": s.seek,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            })
        })
        .collect();
    json!({
        "task": task.name(),
        "language": t.language,
        "duration": t.duration,
        "text": t.text.trim(),
        "segments": segments,
    })
}

/// `HH:MM:SS,mmm` (SRT) or `HH:MM:SS.mmm` (WebVTT).
fn timestamp(seconds: f64, separator: &str) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round() as u64;
    format!("{:02}:{:02}:{:02}{separator}{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

/// One cue per segment: SRT numbers them from 1; WebVTT has its header.
fn subtitles(t: &Transcription, separator: &str, vtt: bool) -> String {
    let mut out = String::from(if vtt { "WEBVTT\n\n" } else { "" });
    for (i, s) in t.segments.iter().enumerate() {
        if !vtt {
            out.push_str(&format!("{}\n", i + 1));
        }
        out.push_str(&format!("{} --> {}\n{}\n\n", timestamp(s.start, separator), timestamp(s.end, separator), s.text.trim()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxcel_engine::Segment;

    fn transcription() -> Transcription {
        let segment = |id: usize, start: f64, end: f64, text: &str| Segment {
            id,
            seek: 0,
            start,
            end,
            text: text.into(),
            tokens: vec![50363, 1, 50491],
            temperature: 0.0,
            avg_logprob: -0.25,
            compression_ratio: 1.0,
            no_speech_prob: 0.01,
        };
        Transcription {
            text: " Hello there. General Kenobi.".into(),
            segments: vec![segment(0, 0.0, 1.5, " Hello there."), segment(1, 1.5, 3723.4567, " General Kenobi.")],
            language: "en".into(),
            language_probability: 1.0,
            duration: 3724.0,
        }
    }

    #[test]
    fn subtitles_in_srt_and_vtt() {
        let t = transcription();
        assert_eq!(
            subtitles(&t, ",", false),
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n00:00:01,500 --> 01:02:03,457\nGeneral Kenobi.\n\n"
        );
        assert_eq!(
            subtitles(&t, ".", true),
            "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n00:00:01.500 --> 01:02:03.457\nGeneral Kenobi.\n\n"
        );
    }

    #[test]
    fn verbose_json_has_openais_fields() {
        let v = verbose_json(&transcription(), Task::Translate);
        assert_eq!(v["task"], "translate");
        assert_eq!(v["text"], "Hello there. General Kenobi.");
        assert_eq!(v["duration"], 3724.0);
        let keys: Vec<&str> = v["segments"][0].as_object().unwrap().keys().map(String::as_str).collect();
        let mut want = vec!["id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob"];
        want.sort();
        let mut keys = keys;
        keys.sort();
        assert_eq!(keys, want);
    }
}
