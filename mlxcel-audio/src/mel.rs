//! Whisper's log-mel spectrogram, as faster-whisper 1.2.1's `FeatureExtractor` computes it.

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

use crate::error::{Error, Result};
use crate::SAMPLE_RATE;

/// FFT size (25 ms at 16 kHz).
pub const N_FFT: usize = 400;
/// Hop between frames (10 ms at 16 kHz).
pub const HOP_LENGTH: usize = 160;
/// Frequency bins of one frame's one-sided spectrum.
pub const N_FREQS: usize = N_FFT / 2 + 1;
/// Samples in Whisper's 30-s window.
pub const N_SAMPLES: usize = 30 * SAMPLE_RATE as usize;
/// Frames in Whisper's 30-s window.
pub const N_FRAMES: usize = N_SAMPLES / HOP_LENGTH;
/// The most mel bands accepted (Whisper uses 80, large-v3 128).
pub const MAX_MELS: usize = 512;

/// A log-mel spectrogram: `data[m * frames + t]` is band `m` of frame `t`.
#[derive(Debug, Clone, PartialEq)]
pub struct LogMel {
    pub n_mels: usize,
    pub frames: usize,
    /// `[n_mels][frames]`, row-major.
    pub data: Vec<f32>,
}

impl LogMel {
    /// Band `m` over every frame.
    pub fn band(&self, m: usize) -> &[f32] {
        &self.data[m * self.frames..(m + 1) * self.frames]
    }
}

/// The slaney-normalised mel filterbank, `[n_mels][N_FREQS]` row-major, as faster-whisper's
/// `FeatureExtractor.get_mel_filters(16000, 400, n_mels)` computes it (in f64, then cast to f32).
pub fn mel_filters(n_mels: usize) -> Result<Vec<f32>> {
    check_mels(n_mels)?;
    let sr = f64::from(SAMPLE_RATE);
    // np.fft.rfftfreq(n=400, d=1/sr): k * (1 / (n * d)).
    let val = 1.0 / (N_FFT as f64 * (1.0 / sr));
    let fftfreqs: Vec<f64> = (0..N_FREQS).map(|k| k as f64 * val).collect();

    // np.linspace(0, 45.245640471924965, n_mels + 2), then the slaney mel -> Hz mapping.
    let (min_mel, max_mel) = (0.0f64, 45.245640471924965f64);
    let num = n_mels + 2;
    let step = (max_mel - min_mel) / (num - 1) as f64;
    let mut mels: Vec<f64> = (0..num).map(|i| i as f64 * step + min_mel).collect();
    mels[num - 1] = max_mel;
    let f_sp = 200.0 / 3.0;
    let min_log_hz = 1000.0;
    let min_log_mel = min_log_hz / f_sp;
    let logstep = 6.4f64.ln() / 27.0;
    let freqs: Vec<f64> = mels
        .iter()
        .map(|&m| if m >= min_log_mel { min_log_hz * (logstep * (m - min_log_mel)).exp() } else { f_sp * m })
        .collect();

    let mut weights = vec![0.0f32; n_mels * N_FREQS];
    for m in 0..n_mels {
        let fdiff_lo = freqs[m + 1] - freqs[m];
        let fdiff_hi = freqs[m + 2] - freqs[m + 1];
        let enorm = 2.0 / (freqs[m + 2] - freqs[m]);
        for (k, &f) in fftfreqs.iter().enumerate() {
            let lower = -(freqs[m] - f) / fdiff_lo;
            let upper = (freqs[m + 2] - f) / fdiff_hi;
            let w = 0.0f64.max(lower.min(upper));
            weights[m * N_FREQS + k] = (w * enorm) as f32;
        }
    }
    Ok(weights)
}

/// One mel band's nonzero run of weights, starting at FFT bin `start`.
struct Band {
    start: usize,
    weights: Vec<f32>,
}

/// Computes log-mel spectrograms; holds the FFT plan, the window and the sparse filterbank, so
/// reusing one across calls saves their setup (about 0.1 ms).
pub struct MelExtractor {
    n_mels: usize,
    window: [f32; N_FFT],
    bands: Vec<Band>,
    fft: Arc<dyn RealToComplex<f32>>,
}

impl MelExtractor {
    pub fn new(n_mels: usize) -> Result<Self> {
        let dense = mel_filters(n_mels)?;
        let bands = dense
            .chunks_exact(N_FREQS)
            .map(|row| {
                let first = row.iter().position(|&w| w != 0.0);
                let last = row.iter().rposition(|&w| w != 0.0);
                match (first, last) {
                    (Some(a), Some(b)) => Band { start: a, weights: row[a..=b].to_vec() },
                    _ => Band { start: 0, weights: Vec::new() },
                }
            })
            .collect();
        // np.hanning(401)[:-1]: 0.5 + 0.5 cos(pi n / 400) for n = -400, -398, ..., 398, in f64.
        let mut window = [0.0f32; N_FFT];
        for (k, w) in window.iter_mut().enumerate() {
            let n = 2.0 * k as f64 - N_FFT as f64;
            *w = (0.5 + 0.5 * (std::f64::consts::PI * n / N_FFT as f64).cos()) as f32;
        }
        let fft = RealFftPlanner::<f32>::new().plan_fft_forward(N_FFT);
        Ok(MelExtractor { n_mels, window, bands, fft })
    }

    pub fn n_mels(&self) -> usize {
        self.n_mels
    }

    /// See [`log_mel_spectrogram`].
    pub fn compute(&self, samples: &[f32], padding: usize) -> Result<LogMel> {
        let len = samples.len().checked_add(padding).ok_or_else(|| Error::invalid_argument("padding", "too large"))?;
        // The STFT has 1 + len / HOP frames; faster-whisper drops the last one.
        let frames = len / HOP_LENGTH;
        if frames == 0 {
            return Err(Error::invalid_argument(
                "samples",
                format!(
                    "{} samples + {padding} padding give no frame (at least {HOP_LENGTH} are needed)",
                    samples.len()
                ),
            ));
        }
        if let Some(i) = samples.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid_argument("samples", format!("sample {i} is {}", samples[i])));
        }
        // The zero-padded signal, reflect-padded by N_FFT / 2 on each side (numpy's "reflect",
        // which for signals shorter than the pad reflects periodically).
        let half = N_FFT / 2;
        let at = |i: usize| if i < samples.len() { samples[i] } else { 0.0 };
        let mut padded = vec![0.0f32; len + 2 * half];
        padded[half..half + samples.len()].copy_from_slice(samples);
        let period = 2 * (len.max(2) - 1);
        let reflect = |i: isize| -> f32 {
            if len == 1 {
                return at(0);
            }
            let j = i.rem_euclid(period as isize) as usize;
            at(if j >= len { period - j } else { j })
        };
        for i in 0..half {
            padded[i] = reflect(i as isize - half as isize);
            padded[half + len + i] = reflect((len + i) as isize);
        }

        let mut data = vec![0.0f32; self.n_mels * frames];
        let mut frame = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = [0.0f32; N_FREQS];
        for t in 0..frames {
            let seg = &padded[t * HOP_LENGTH..t * HOP_LENGTH + N_FFT];
            for ((f, &x), &w) in frame.iter_mut().zip(seg).zip(&self.window) {
                *f = x * w;
            }
            self.fft
                .process_with_scratch(&mut frame, &mut spectrum, &mut scratch)
                .map_err(|e| Error::invalid_argument("samples", e.to_string()))?;
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = c.re * c.re + c.im * c.im;
            }
            for (m, band) in self.bands.iter().enumerate() {
                let bins = &power[band.start..band.start + band.weights.len()];
                let e: f32 = band.weights.iter().zip(bins).map(|(w, p)| w * p).sum();
                data[m * frames + t] = e;
            }
        }
        let mut max = f32::NEG_INFINITY;
        for x in data.iter_mut() {
            *x = x.max(1e-10).log10();
            max = max.max(*x);
        }
        let floor = max - 8.0;
        for x in data.iter_mut() {
            *x = (x.max(floor) + 4.0) / 4.0;
        }
        Ok(LogMel { n_mels: self.n_mels, frames, data })
    }
}

/// Whisper's log-mel spectrogram of 16 kHz mono `samples`, exactly as faster-whisper 1.2.1's
/// `FeatureExtractor(feature_size=n_mels)(samples, padding=padding)` computes it: `padding`
/// zeros appended, a centered STFT (N_FFT 400, hop 160, periodic Hann window, reflect padding),
/// the power spectrum without the last frame, the slaney mel filterbank, `log10` clamped at
/// 1e-10, a floor at the maximum minus 8, then `(x + 4) / 4`.
///
/// The result has `(samples.len() + padding) / 160` frames (faster-whisper's default padding is
/// 160). Fewer than 160 samples in all, a non-finite sample, or `n_mels` 0 are errors.
pub fn log_mel_spectrogram(samples: &[f32], n_mels: usize, padding: usize) -> Result<LogMel> {
    MelExtractor::new(n_mels)?.compute(samples, padding)
}

fn check_mels(n_mels: usize) -> Result<()> {
    if n_mels == 0 || n_mels > MAX_MELS {
        return Err(Error::invalid_argument("n_mels", format!("{n_mels} (expected 1 to {MAX_MELS})")));
    }
    Ok(())
}
