//! The audio front end of mlxcel's Whisper: files to 16 kHz mono samples to log-mel spectrograms.
//! Nothing here touches MLX.
//!
//! # The contract
//!
//! * [`load_file`] / [`decode_bytes`] decode WAV (PCM 8/16/24/32-bit integer, 32/64-bit float,
//!   A-law, µ-law; plain or `WAVE_FORMAT_EXTENSIBLE`; any channel count up to [`MAX_CHANNELS`] and
//!   any rate up to [`MAX_SAMPLE_RATE`]), FLAC, MP3 and Ogg Vorbis, and return mono `f32` samples
//!   in [-1, 1] at [`SAMPLE_RATE`] (16 kHz). Channels are downmixed by averaging. Integer PCM maps
//!   to floats as `x / 2^(bits-1)` (8-bit unsigned: `(x - 128) / 128`). [`decode_file`] and
//!   [`decode_bytes_native`] keep the source rate and also return an [`AudioInfo`] (source rate,
//!   channels, frames, codec).
//! * [`resample`] converts mono samples to 16 kHz. 16 kHz input comes back bit-exact.
//! * [`log_mel_spectrogram`] (or a reusable [`MelExtractor`]) is Whisper's log-mel spectrogram as
//!   faster-whisper 1.2.1's `FeatureExtractor` computes it, to within 1e-4 (the golden test,
//!   `tests/mel.rs`, measures 1.9e-5 on a 4-s clip); [`mel_filters`] is its filterbank, equal to
//!   faster-whisper's for 80 bands (the golden) and 128 (large-v3).
//! * Errors: every malformed input is an [`Error`], never a panic, and says what is wrong: a
//!   missing file (with its path), an empty input, a truncated file, bytes that are not audio, a
//!   container with no audio track, a codec not decoded here, an absurd header (0 Hz, 0 or
//!   thousands of channels), audio with no samples, audio longer than [`MAX_DURATION_SECS`]
//!   (4 hours). Decoding never allocates from a header's claim: samples are collected as they
//!   are decoded and refused once past the limit. Truncation is detected when the container
//!   declares its length (WAV, FLAC, an MP3 with a Xing/Info header) or a read ends mid-packet; a
//!   WAV that declares the "unknown length" 0xFFFFFFFF of some streaming writers is therefore
//!   reported as truncated.
//!
//! # Choices
//!
//! * **Decoding: symphonia** (0.6, pure Rust, MPL-2.0), the maintained Rust media framework,
//!   with only the `wav`, `pcm`, `flac`, `mp3`, `ogg` and `vorbis` features: no C library, no
//!   ffmpeg. Packets a lossy decoder rejects as corrupt (a damaged MP3 frame) are skipped, as
//!   ffmpeg does, and counted in [`AudioInfo::skipped_packets`]; a stream where none decodes is an
//!   error. A chained Ogg file yields its first logical stream.
//! * **Resampling: rubato's synchronous `Fft` resampler** (rubato 5, MIT/Apache-2.0). The ratio is
//!   fixed for a whole file, which is exactly what this resampler is for: it applies a windowed-sinc
//!   anti-aliasing low-pass (Blackman-Harris² window) in the frequency domain, overlap-add, and is
//!   several times faster than rubato's asynchronous sinc resampler at the same quality. One FFT
//!   block covers at least 2,048 input frames, which puts the passband edge at about 98% of 8 kHz
//!   (above Whisper's highest mel band, which ends at 8 kHz) and the stopband past it; the
//!   filter's delay is trimmed so the output lines up with the input to within one 16 kHz sample
//!   (11 us remain at 44.1 kHz, 21 us at 48 kHz). Measured (`tests/resample.rs`): a 1 kHz sine at
//!   44.1 kHz comes out at 1 kHz (within 0.01 Hz) with its amplitude within 0.1% and less than
//!   1e-4 of anything else; tones up to 7 kHz from 8 to 96 kHz sources keep their amplitude within
//!   1%; a 10 kHz tone (which would alias to 6 kHz) is attenuated by more than 60 dB. The output
//!   has `ceil(n * 16000 / rate)` samples, the count faster-whisper's decoder gives for the 44.1 kHz fixture. Exact agreement with ffmpeg's
//!   swresample (what faster-whisper's `decode_audio` uses through PyAV) is not a goal: no Rust
//!   resampler reproduces it, and Whisper's accuracy does not depend on the resampler's last bits.
//! * **The spectrogram: realfft** (the real-input front of rustfft) in `f32`, like numpy's
//!   `float32` path: one 400-point real FFT per frame, the power spectrum, then each mel band as a
//!   dot product over its nonzero bins only (about 2 bins per band on average instead of 201), so
//!   a 30-s window (3,000 frames) takes a few milliseconds on one core
//!   (`cargo run --release -p mlxcel-audio --example mel_bench`).

mod decode;
mod error;
mod mel;
mod resample;

pub use decode::{
    decode_bytes, decode_bytes_native, decode_file, load_file, AudioInfo, Decoded, MAX_CHANNELS, MAX_DURATION_SECS,
    MAX_SAMPLE_RATE,
};
pub use error::{Error, Result};
pub use mel::{
    log_mel_spectrogram, mel_filters, LogMel, MelExtractor, HOP_LENGTH, MAX_MELS, N_FFT, N_FRAMES, N_FREQS, N_SAMPLES,
};
pub use resample::resample;

/// The sample rate Whisper works at, in Hz.
pub const SAMPLE_RATE: u32 = 16_000;
