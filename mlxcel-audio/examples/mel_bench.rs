//! Times Whisper's log-mel spectrogram of a 30-s window (3,000 frames) on one core.
//!
//!     cargo run --release -p mlxcel-audio --example mel_bench [-- N_MELS [ROUNDS]]

use std::time::Instant;

use mlxcel_audio::{log_mel_spectrogram, MelExtractor, N_SAMPLES, SAMPLE_RATE};

fn main() -> mlxcel_audio::Result<()> {
    let mut args = std::env::args().skip(1);
    let n_mels: usize = args.next().map_or(80, |a| a.parse().expect("N_MELS: a number"));
    let rounds: usize = args.next().map_or(50, |a| a.parse().expect("ROUNDS: a number"));
    // A 30-s window of a chirp with a little pseudo-random noise, like speech-level input.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let samples: Vec<f32> = (0..N_SAMPLES)
        .map(|i| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let t = i as f32 / SAMPLE_RATE as f32;
            0.3 * (2.0 * std::f32::consts::PI * (200.0 + 100.0 * t) * t).sin() + 0.01 * ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        })
        .collect();

    let extractor = MelExtractor::new(n_mels)?;
    let mut best = f64::INFINITY;
    let mut total = 0.0;
    let mut frames = 0;
    for _ in 0..rounds {
        let start = Instant::now();
        let mel = extractor.compute(&samples, 0)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        frames = mel.frames;
        best = best.min(ms);
        total += ms;
    }
    let start = Instant::now();
    log_mel_spectrogram(&samples, n_mels, 0)?;
    let cold = start.elapsed().as_secs_f64() * 1e3;
    println!(
        "log-mel of a 30-s window ({frames} frames, {n_mels} mels): {:.2} ms mean, {best:.2} ms best over {rounds} rounds \
         (MelExtractor reused); {cold:.2} ms with log_mel_spectrogram (filterbank and FFT plan built per call)",
        total / rounds as f64
    );
    Ok(())
}
