//! Resampling to 16 kHz: frequency, amplitude, phase (the filter delay is trimmed), the
//! anti-aliasing stopband, lengths, and the bit-exact 16 kHz pass-through.

use std::f64::consts::PI;

use mlxcel_audio::{decode_bytes_native, resample, SAMPLE_RATE};

fn sine(rate: u32, freq: f64, amplitude: f64, secs: f64) -> Vec<f32> {
    let n = (f64::from(rate) * secs) as usize;
    (0..n).map(|i| (amplitude * (2.0 * PI * freq * i as f64 / f64::from(rate)).sin()) as f32).collect()
}

/// Least-squares fit of `a sin(wt) + b cos(wt)` to `out` at 16 kHz, away from the first and
/// last 20 ms: (amplitude, delay in seconds, max |residual|).
fn fit(out: &[f32], freq: f64) -> (f64, f64, f64) {
    let w = 2.0 * PI * freq / 16_000.0;
    let range = 320..out.len() - 320;
    let (mut ss, mut cc, mut sc, mut ys, mut yc) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for i in range.clone() {
        let (s, c, y) = ((w * i as f64).sin(), (w * i as f64).cos(), f64::from(out[i]));
        ss += s * s;
        cc += c * c;
        sc += s * c;
        ys += y * s;
        yc += y * c;
    }
    let det = ss * cc - sc * sc;
    let a = (ys * cc - yc * sc) / det;
    let b = (yc * ss - ys * sc) / det;
    let residual = range
        .map(|i| (f64::from(out[i]) - a * (w * i as f64).sin() - b * (w * i as f64).cos()).abs())
        .fold(0.0, f64::max);
    // a sin(wt) + b cos(wt) = A sin(w(t - delay)).
    (a.hypot(b), -b.atan2(a) / (2.0 * PI * freq), residual)
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64).sqrt()
}

/// Upward zero crossings per second, interpolated: the frequency of a clean sine.
fn frequency(x: &[f32]) -> f64 {
    let ups: Vec<f64> = (1..x.len())
        .filter(|&i| x[i - 1] < 0.0 && x[i] >= 0.0)
        .map(|i| (i - 1) as f64 + f64::from(x[i - 1]) / f64::from(x[i - 1] - x[i]))
        .collect();
    (ups.len() - 1) as f64 / (ups[ups.len() - 1] - ups[0]) * 16_000.0
}

#[test]
fn sine_at_44k1_keeps_frequency_amplitude_and_phase() {
    let out = resample(&sine(44_100, 1000.0, 0.5, 2.0), 44_100).unwrap();
    assert_eq!(out.len(), 32_000);
    let f = frequency(&out[320..31_680]);
    assert!((f - 1000.0).abs() < 0.01, "frequency {f} Hz");
    let amp = rms(&out[320..31_680]) * 2f64.sqrt();
    assert!((amp - 0.5).abs() < 0.5e-3, "amplitude {amp}");
    // The output is the input's sine, up to a delay of less than one 16 kHz sample (rubato trims
    // its filter's delay in whole samples: 11 us remain at 44.1 kHz, 21 us at 48 kHz), plus less
    // than 1e-4 of anything else.
    let (amp, delay, residual) = fit(&out, 1000.0);
    assert!((amp - 0.5).abs() < 0.5e-3, "fitted amplitude {amp}");
    assert!(delay.abs() <= 1.0 / 16_000.0, "delay {:.2} us", delay * 1e6);
    assert!(residual < 1e-4, "residual {residual}");
}

#[test]
fn passband_and_stopband() {
    for rate in [44_100u32, 48_000, 22_050, 32_000, 96_000, 8_000, 11_025] {
        let nyquist = f64::from(rate.min(SAMPLE_RATE)) / 2.0;
        // Passband: tones up to 7 kHz (below the lower Nyquist) keep amplitude and phase.
        for freq in [100.0, 3000.0, 7000.0f64] {
            if freq >= nyquist * 0.9 {
                continue;
            }
            let out = resample(&sine(rate, freq, 0.5, 1.0), rate).unwrap();
            let (amp, delay, residual) = fit(&out, freq);
            let what = format!("{rate} Hz, {freq} Hz tone: amplitude {amp}, delay {:.2} us, residual {residual}", delay * 1e6);
            assert!((amp - 0.5).abs() < 5e-3 && delay.abs() <= 1.0 / 16_000.0 && residual < 1e-3, "{what}");
        }
        // Stopband: a 10 kHz tone (it would alias to 6 kHz) is gone: below -60 dB.
        if f64::from(rate) / 2.0 > 10_000.0 {
            let out = resample(&sine(rate, 10_000.0, 0.5, 1.0), rate).unwrap();
            let level = rms(&out[320..out.len() - 320]) / (0.5 / 2f64.sqrt());
            assert!(level < 1e-3, "{rate} Hz: a 10 kHz tone comes out at {:.1} dB", 20.0 * level.log10());
        }
    }
}

#[test]
fn lengths_and_pass_through() {
    for (rate, n) in [(44_100u32, 150_964usize), (48_000, 1), (8_000, 7), (22_050, 2205), (44_101, 44_101)] {
        let out = resample(&vec![0.1; n], rate).unwrap();
        assert_eq!(out.len(), (n as u64 * 16_000).div_ceil(u64::from(rate)) as usize, "{rate} Hz, {n} samples");
    }
    assert!(resample(&[], 44_100).unwrap().is_empty());
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.123).sin() * 0.9).collect();
    let same = resample(&x, 16_000).unwrap();
    assert!(same.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn ogg_vorbis_48k_stereo_tone() {
    // tests/data/tone_440hz_48k_stereo.ogg: `sox -R -D -n -r 48000 -c 2 ... synth 1.0 sine 440 vol 0.5`.
    let bytes = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tone_440hz_48k_stereo.ogg")).unwrap();
    let decoded = decode_bytes_native(&bytes, Some("ogg")).unwrap();
    assert_eq!((decoded.info.sample_rate, decoded.info.channels, decoded.info.codec.as_str()), (48_000, 2, "vorbis"));
    assert_eq!(decoded.info.frames, 48_000);
    let out = decoded.into_16k().unwrap();
    assert_eq!(out.len(), 16_000);
    let f = frequency(&out[1600..14_400]);
    assert!((f - 440.0).abs() < 0.05, "frequency {f} Hz");
    let amp = rms(&out[1600..14_400]) * 2f64.sqrt();
    assert!((amp - 0.5).abs() < 5e-3, "amplitude {amp}");
}
