//! Whisper on the real packaged weights (tiny.en and the multilingual base,
//! CTranslate2 float16 from faster-whisper's format, converted on first use)
//! against faster-whisper 1.2.1's goldens (`tests/reference/goldens/whisper_*.json`,
//! `make_whisper_goldens.py`): the same text, segments, timestamps and
//! tokens on every clip of `tests/fixtures/audio/`, greedy (`beam_size=1`).
//!
//! Windows where faster-whisper fell back to sampling (temperature > 0, which
//! no other implementation can reproduce) are compared on its
//! temperature-0-only run, decoded here with `temperatures = [0]`.
//!
//! Clips that are not 16 kHz PCM or FLAC (the 44.1 kHz stereo WAV, the MP3)
//! reach faster-whisper through FFmpeg's resampler and decoder, and mlxcel
//! through its own, so the samples differ slightly (base then writes "of"
//! for "on" on the 44.1 kHz clip). Those clips are compared against
//! faster-whisper run on mlxcel's own samples
//! (`make_whisper_resampled_goldens.py`), which checks the model and the
//! decoding alone.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlxcel_engine::{Audio, Task, TranscribeOptions, Transcriber};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn golden(model: &str) -> Value {
    let path = repo().join(format!("tests/reference/goldens/whisper_{model}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn transcriber(name: &'static str) -> &'static Transcriber {
    static TINY: OnceLock<Transcriber> = OnceLock::new();
    static BASE: OnceLock<Transcriber> = OnceLock::new();
    let cell = if name == "whisper-tiny.en" { &TINY } else { &BASE };
    cell.get_or_init(|| Transcriber::load(Path::new(name)).unwrap_or_else(|e| panic!("loading {name}: {e}")))
}

/// The golden run to compare against, and the options that reproduce it.
fn reference_runs(clip: &Value) -> Vec<(&Value, TranscribeOptions)> {
    let runs = clip["runs"].as_array().unwrap();
    let mut out = Vec::new();
    for task in ["transcribe", "translate"] {
        let of_task: Vec<&Value> = runs.iter().filter(|r| r["compute_type"] == "float32" && r["task"] == task).collect();
        let Some(default) = of_task.iter().find(|r| r["temperature_option"] == "default fallback list") else { continue };
        let run = if let Some(own) = of_task.iter().find(|r| r["audio_input"] == "mlxcel 16 kHz samples") {
            *own
        } else if default["fallback"] == true {
            *of_task.iter().find(|r| r["temperature_option"] == "0.0 only").expect("a temperature-0 run for a fallback clip")
        } else {
            *default
        };
        let mut options = TranscribeOptions { task: Task::parse(task).unwrap(), ..Default::default() };
        if run["temperature_option"] == "0.0 only" {
            options.temperatures = vec![0.0];
        }
        if task == "translate" {
            options.language = run["language"].as_str().map(String::from);
        }
        out.push((run, options));
    }
    out
}

fn check_model(model: &'static str, name: &'static str) {
    let golden = golden(model);
    let whisper = transcriber(name);
    let mut checked = 0;
    let mut failures = Vec::new();
    for (clip_name, clip) in golden["clips"].as_object().unwrap() {
        let path = repo().join("tests/fixtures/audio").join(clip_name);
        let tolerance = 2e-3;
        for (run, options) in reference_runs(clip) {
            let got = whisper.transcribe(Audio::File(&path), &options).unwrap_or_else(|e| panic!("{clip_name}: {e}"));
            checked += 1;
            let want_text = run["text"].as_str().unwrap();
            let label = format!("{model} {clip_name} {}", options.task.name());
            if got.text != want_text {
                failures.push(format!("{label}: text\n  got:  {:?}\n  want: {want_text:?}", got.text));
                continue;
            }
            assert_eq!(got.language, run["language"].as_str().unwrap(), "{label}: language");
            if run["language_probability"].as_f64().unwrap() < 1.0 && options.language.is_none() {
                let want = run["language_probability"].as_f64().unwrap();
                assert!((got.language_probability as f64 - want).abs() < tolerance, "{label}: language probability {} vs {want}", got.language_probability);
            }
            let want_segments = run["segments"].as_array().unwrap();
            assert_eq!(got.segments.len(), want_segments.len(), "{label}: segments");
            for (g, w) in got.segments.iter().zip(want_segments) {
                let tokens: Vec<u32> = w["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
                assert_eq!(g.tokens, tokens, "{label}: segment {} tokens", g.id);
                assert_eq!(g.seek as u64, w["seek"].as_u64().unwrap(), "{label}: segment {} seek", g.id);
                for (field, got, want) in [("start", g.start, &w["start"]), ("end", g.end, &w["end"])] {
                    assert!((got - want.as_f64().unwrap()).abs() < 1e-6, "{label}: segment {} {field} {got} vs {want}", g.id);
                }
                let lp = w["avg_logprob"].as_f64().unwrap();
                assert!((g.avg_logprob - lp).abs() < tolerance, "{label}: segment {} avg_logprob {} vs {lp}", g.id, g.avg_logprob);
                let ns = w["no_speech_prob"].as_f64().unwrap();
                assert!((g.no_speech_prob - ns).abs() < tolerance, "{label}: segment {} no_speech_prob {} vs {ns}", g.id, g.no_speech_prob);
            }
        }
    }
    assert!(failures.is_empty(), "{} of {checked} runs differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 12, "only {checked} runs checked");
}

#[test]
fn tiny_en_matches_faster_whisper() {
    check_model("tiny.en", "whisper-tiny.en");
}

#[test]
fn base_matches_faster_whisper() {
    check_model("base", "whisper-base");
}

/// The converted checkpoints load in mlx-whisper 0.4.3 as they are (its
/// layout), and give its logits: the same log-mel window and tokens through
/// both (`make_whisper_mlx_goldens.py`). mlx-whisper computes the encoder's
/// sinusoids in float32 where mlxcel reads the stored float16 table, as
/// faster-whisper does: measured 3.9e-4 (tiny.en) and 3.8e-4 (base) of the
/// largest |logit|, held to 1e-3.
#[test]
fn logits_match_mlx_whisper() {
    let golden = mlx_sys::io::load_safetensors(&repo().join("tests/reference/goldens/whisper_mlx.safetensors")).unwrap();
    let get = |name: &str| golden.arrays.get(name).unwrap_or_else(|| panic!("golden `{name}`")).clone();
    let mel: Vec<f32> = get("mel").to_vec().unwrap();
    for (model, name) in [("tiny.en", "whisper-tiny.en"), ("base", "whisper-base")] {
        let dir = mlxcel_hub::resolve_model(Path::new(name), &Default::default(), &mut |_| {}).unwrap();
        let whisper = mlxcel_models::whisper::Whisper::load(&dir).unwrap();
        let tokens: Vec<u32> = get(&format!("tokens_{model}")).to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
        let want: Vec<f32> = get(&format!("logits_{model}")).to_vec().unwrap();
        let audio = whisper.encode(&mel).unwrap();
        let mut decoder = whisper.decoder(&audio).unwrap();
        let rows: Vec<usize> = (tokens.len() - 4..tokens.len()).collect();
        let got: Vec<f32> = decoder.forward(&tokens, &rows).unwrap().concat();
        assert_eq!(got.len(), want.len(), "{model}: logits");
        let range = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{model}: max |Δlogit| {worst:.3e} of max |logit| {range:.2} ({:.2e})", worst / range);
        assert!(worst <= 1e-3 * range, "{model}: max |Δlogit| {worst} > 1e-3 × {range}");
        let vocab = want.len() / 4;
        for (row, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
            let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
            assert_eq!(argmax(g), argmax(w), "{model}: row {row} argmax");
        }
    }
}

/// Bad audio fails the call with `InvalidParameter` naming `audio` and what
/// is wrong; the process and the transcriber carry on.
#[test]
fn bad_audio_is_a_clear_error() {
    let whisper = transcriber("whisper-tiny.en");
    let options = TranscribeOptions::default();
    let clip = std::fs::read(repo().join("tests/fixtures/audio/en_mono_16k.wav")).unwrap();
    let text_file = repo().join("tests/fixtures/audio/README.md");
    let cases: Vec<(&str, Audio, &str)> = vec![
        ("empty bytes", Audio::Bytes(&[]), "empty"),
        ("a truncated WAV", Audio::Bytes(&clip[..30]), "truncated"),
        ("text", Audio::File(&text_file), "not audio"),
        ("a missing file", Audio::File(Path::new("/nonexistent/clip.wav")), "/nonexistent/clip.wav"),
        ("no samples", Audio::Samples(&[]), "no audio samples"),
        ("NaN", Audio::Samples(&[0.0, f32::NAN]), "sample 1 is not a finite number"),
    ];
    for (what, audio, expect) in cases {
        let err = whisper.transcribe(audio, &options).expect_err(what);
        assert_eq!(err.code(), mlxcel_engine::ErrorKind::InvalidParameter, "{what}: {err}");
        assert_eq!(err.parameter(), Some("audio"), "{what}: {err}");
        assert!(err.to_string().to_lowercase().contains(expect), "{what}: `{err}` should say `{expect}`");
    }
    // A WAV header claiming 4 GiB of data, and a huge channel count: refused, nothing allocated.
    let mut huge = clip.clone();
    huge[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(whisper.transcribe(Audio::Bytes(&huge), &options).is_err());
    let mut channels = clip.clone();
    channels[22..24].copy_from_slice(&u16::MAX.to_le_bytes());
    assert!(whisper.transcribe(Audio::Bytes(&channels), &options).is_err());
    let bad_options = TranscribeOptions { language: Some("de".into()), ..Default::default() };
    let err = whisper.transcribe(Audio::Bytes(&clip), &bad_options).unwrap_err();
    assert_eq!(err.parameter(), Some("language"), "{err}");
    // Still serving.
    let ok = whisper.transcribe(Audio::Bytes(&clip), &options).unwrap();
    assert_eq!(ok.text, " This file is a plain 16 bit frame file.");
}

/// One transcriber on several threads at once: each result is the one it gets alone.
#[test]
fn threads_share_one_transcriber() {
    let whisper = transcriber("whisper-tiny.en");
    let clips = ["en_fox_us.flac", "en_scotland.flac", "en_question_f3.flac", "silence_5s.flac"];
    let alone: Vec<String> = clips
        .iter()
        .map(|c| whisper.transcribe(Audio::File(&repo().join("tests/fixtures/audio").join(c)), &TranscribeOptions::default()).unwrap().text)
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = clips
            .iter()
            .map(|c| {
                let path = repo().join("tests/fixtures/audio").join(c);
                scope.spawn(move || whisper.transcribe(Audio::File(&path), &TranscribeOptions::default()).unwrap().text)
            })
            .collect();
        for (handle, want) in handles.into_iter().zip(&alone) {
            assert_eq!(&handle.join().unwrap(), want);
        }
    });
}
