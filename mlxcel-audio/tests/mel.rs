//! The log-mel spectrogram against faster-whisper 1.2.1 (golden from
//! tests/reference/make_whisper_mel_golden.py) and against a naive f64 reference.

use std::path::PathBuf;

use mlxcel_audio::{load_file, log_mel_spectrogram, mel_filters, Error, MelExtractor, HOP_LENGTH, N_FFT, N_FREQS};
use safetensors::SafeTensors;

const GOLDEN: &str = "tests/reference/goldens/whisper_mel.safetensors";

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The golden's bytes; fails (never skips) when the file is missing.
fn golden_bytes() -> Vec<u8> {
    let path = workspace().join(GOLDEN);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "missing golden {} ({e}): generate it with `tests/reference/run.sh tests/reference/make_whisper_mel_golden.py`",
            path.display()
        )
    })
}

fn tensor(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{GOLDEN}: tensor `{name}`: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{GOLDEN}: `{name}` is not float32");
    let data = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    (t.shape().to_vec(), data)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn mel_matches_faster_whisper() {
    let bytes = golden_bytes();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, audio) = tensor(&st, "audio");
    let (shape, want) = tensor(&st, "mel");
    // faster-whisper's transcribe() calls the extractor with padding=160.
    let mel = log_mel_spectrogram(&audio, 80, 160).unwrap();
    assert_eq!([mel.n_mels, mel.frames], [shape[0], shape[1]]);
    assert_eq!(mel.frames, audio.len() / HOP_LENGTH + 1);
    let diff = max_abs_diff(&mel.data, &want);
    println!("max |mel - faster-whisper| = {diff:e} over {} values", want.len());
    assert!(diff <= 1e-4, "max |mel - faster-whisper| = {diff} > 1e-4");
}

#[test]
fn mel_filters_match_faster_whisper() {
    let bytes = golden_bytes();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, want) = tensor(&st, "mel_filters");
    assert_eq!(shape, [80, N_FREQS]);
    let diff = max_abs_diff(&mel_filters(80).unwrap(), &want);
    assert!(diff <= 1e-9, "max |filters - faster-whisper| = {diff}");
}

#[test]
fn golden_clip_decodes_to_the_golden_audio() {
    // The golden's audio is faster-whisper's decode_audio of a 16 kHz FLAC: int16 / 32768, which
    // our decoder must reproduce bit for bit.
    let bytes = golden_bytes();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let clip = meta.metadata().as_ref().and_then(|m| m.get("clip")).expect("golden metadata `clip`").clone();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, want) = tensor(&st, "audio");
    let got = load_file(&workspace().join(&clip)).unwrap();
    assert_eq!(got.len(), want.len(), "{clip}");
    assert!(got == want, "{clip}: decoded samples differ, max {}", max_abs_diff(&got, &want));
}

#[test]
fn large_v3_128_mel_filters() {
    // Reference numbers from faster-whisper 1.2.1: FeatureExtractor(feature_size=128).mel_filters
    // (sum, index-weighted sum, max, nonzeros, three entries).
    let f = mel_filters(128).unwrap();
    assert_eq!(f.len(), 128 * N_FREQS);
    let sum: f64 = f.iter().map(|&x| f64::from(x)).sum();
    let weighted: f64 = f.iter().enumerate().map(|(i, &x)| f64::from(x) * (i % N_FREQS) as f64).sum();
    let max = f.iter().cloned().fold(0.0f32, f32::max);
    assert!((sum - 3.1909855198109653).abs() < 1e-6, "{sum}");
    assert!((weighted - 192.31531729731978).abs() < 1e-4, "{weighted}");
    assert_eq!(max, 0.04168174788355827f64 as f32);
    assert_eq!(f.iter().filter(|&&x| x != 0.0).count(), 394);
    assert_eq!(f[1], 0.012373986653983593f64 as f32);
    assert_eq!(f[50 * N_FREQS + 18], 0.0);
    assert_eq!(f[127 * N_FREQS + 192], 0.0016171716852113605f64 as f32);
    // Every band has weight, and a 128-band spectrogram computes.
    assert!(f.chunks_exact(N_FREQS).all(|band| band.iter().any(|&x| x > 0.0)));
    let audio: Vec<f32> = (0..16_000).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
    let mel = log_mel_spectrogram(&audio, 128, 160).unwrap();
    assert_eq!((mel.n_mels, mel.frames, mel.data.len()), (128, 101, 128 * 101));
    assert!(mel.data.iter().all(|x| x.is_finite()));
}

/// faster-whisper's recipe written plainly in f64: numpy's reflect padding (a periodic mirror,
/// checked against np.pad for lengths 1 to 400), a direct DFT, the dense filterbank.
fn naive_log_mel(samples: &[f32], n_mels: usize, padding: usize) -> Vec<f32> {
    let mut x: Vec<f64> = samples.iter().map(|&s| f64::from(s)).collect();
    x.resize(samples.len() + padding, 0.0);
    let n = x.len();
    let half = N_FFT as isize / 2;
    let at = |i: isize| -> f64 {
        if n == 1 {
            return x[0];
        }
        let p = 2 * (n as isize - 1);
        let j = i.rem_euclid(p);
        x[if j >= n as isize { p - j } else { j } as usize]
    };
    let frames = n / HOP_LENGTH;
    let filters = mel_filters(n_mels).unwrap();
    let mut out = vec![0.0f64; n_mels * frames];
    for t in 0..frames {
        let mut power = vec![0.0f64; N_FREQS];
        for (k, p) in power.iter_mut().enumerate() {
            let (mut re, mut im) = (0.0, 0.0);
            for j in 0..N_FFT {
                let w = 0.5 - 0.5 * (2.0 * std::f64::consts::PI * j as f64 / N_FFT as f64).cos();
                let v = at((t * HOP_LENGTH + j) as isize - half) * w;
                let a = -2.0 * std::f64::consts::PI * (k * j) as f64 / N_FFT as f64;
                re += v * a.cos();
                im += v * a.sin();
            }
            *p = re * re + im * im;
        }
        for m in 0..n_mels {
            out[m * frames + t] = (0..N_FREQS).map(|k| f64::from(filters[m * N_FREQS + k]) * power[k]).sum();
        }
    }
    let logs: Vec<f64> = out.iter().map(|&v| v.max(1e-10).log10()).collect();
    let max = logs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    logs.iter().map(|&v| ((v.max(max - 8.0) + 4.0) / 4.0) as f32).collect()
}

#[test]
fn short_and_padded_inputs_match_the_recipe() {
    let signal: Vec<f32> = (0..2000).map(|i| ((i * i) as f32 * 1e-4).sin() * 0.5 + (i as f32 * 0.3).cos() * 0.1).collect();
    // Shorter than the 200-sample reflection, a single sample, exact hops, padding only.
    for (len, padding) in [(1, 160), (50, 160), (160, 0), (199, 1), (200, 0), (201, 160), (1000, 0), (2000, 160), (0, 480)] {
        let got = log_mel_spectrogram(&signal[..len], 80, padding).unwrap();
        let want = naive_log_mel(&signal[..len], 80, padding);
        assert_eq!(got.frames, (len + padding) / HOP_LENGTH);
        let diff = max_abs_diff(&got.data, &want);
        assert!(diff <= 1e-4, "len {len}, padding {padding}: max diff {diff}");
    }
}

#[test]
fn extractor_reuse_and_errors() {
    let extractor = MelExtractor::new(80).unwrap();
    let a: Vec<f32> = (0..8000).map(|i| (i as f32 * 0.01).sin()).collect();
    assert_eq!(extractor.compute(&a, 160).unwrap(), log_mel_spectrogram(&a, 80, 160).unwrap());
    assert!(matches!(log_mel_spectrogram(&a, 0, 0), Err(Error::InvalidArgument { name: "n_mels", .. })));
    let err = log_mel_spectrogram(&a[..100], 80, 59).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { name: "samples", .. }), "{err:?}");
    assert!(err.to_string().contains("160"), "{err}");
    let mut nan = a.clone();
    nan[7] = f32::NAN;
    let err = log_mel_spectrogram(&nan, 80, 160).unwrap_err();
    assert!(err.to_string().contains("sample 7 is NaN"), "{err}");
    // Digital silence: every value sits at the floor, (log10(1e-10) + 4) / 4.
    let mel = log_mel_spectrogram(&[0.0; 16_000], 80, 160).unwrap();
    assert!(mel.data.iter().all(|&x| x == -1.5), "{:?}", &mel.data[..4]);
}
