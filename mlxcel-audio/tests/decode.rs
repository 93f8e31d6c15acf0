//! Decoding from hand-made WAV buffers: every PCM layout, downmixing, and every error case.

use mlxcel_audio::{decode_bytes, decode_bytes_native, decode_file, load_file, Error, MAX_DURATION_SECS};

/// A RIFF/WAVE file: a `fmt ` chunk (tag, channels, rate, bits; block align and byte rate
/// derived unless given) and a `data` chunk whose declared length may differ from its bytes.
struct Wav {
    tag: u16,
    channels: u16,
    rate: u32,
    bits: u16,
    block_align: Option<u16>,
    declared_data_len: Option<u32>,
    fmt_extra: Vec<u8>,
}

impl Wav {
    fn pcm(channels: u16, rate: u32, bits: u16) -> Wav {
        Wav { tag: 1, channels, rate, bits, block_align: None, declared_data_len: None, fmt_extra: Vec::new() }
    }

    fn bytes(&self, data: &[u8]) -> Vec<u8> {
        let block_align = self.block_align.unwrap_or((u32::from(self.channels) * u32::from(self.bits) / 8) as u16);
        let mut fmt = Vec::new();
        fmt.extend(self.tag.to_le_bytes());
        fmt.extend(self.channels.to_le_bytes());
        fmt.extend(self.rate.to_le_bytes());
        fmt.extend(self.rate.wrapping_mul(u32::from(block_align)).to_le_bytes());
        fmt.extend(block_align.to_le_bytes());
        fmt.extend(self.bits.to_le_bytes());
        if !self.fmt_extra.is_empty() {
            fmt.extend((self.fmt_extra.len() as u16).to_le_bytes());
            fmt.extend(&self.fmt_extra);
        }
        let data_len = self.declared_data_len.unwrap_or(data.len() as u32);
        let mut out = Vec::new();
        out.extend(b"RIFF");
        out.extend((4 + 8 + fmt.len() as u32 + 8).saturating_add(data_len).to_le_bytes());
        out.extend(b"WAVE");
        out.extend(b"fmt ");
        out.extend((fmt.len() as u32).to_le_bytes());
        out.extend(fmt);
        out.extend(b"data");
        out.extend(data_len.to_le_bytes());
        out.extend(data);
        out
    }
}

fn i16_bytes(samples: &[i16]) -> Vec<u8> {
    samples.iter().flat_map(|s| s.to_le_bytes()).collect()
}

/// A deterministic, full-range test signal.
fn ramp_i16(n: usize) -> Vec<i16> {
    (0..n).map(|i| ((i as i64 * 7919) % 65536 - 32768) as i16).collect()
}

#[test]
fn pcm16_mono_16k_is_exact() {
    let s = ramp_i16(4000);
    let wav = Wav::pcm(1, 16_000, 16).bytes(&i16_bytes(&s));
    let out = decode_bytes(&wav, Some("wav")).unwrap();
    let expected: Vec<f32> = s.iter().map(|&x| f32::from(x) / 32768.0).collect();
    assert_eq!(out, expected);
    // Without a hint, and through a file.
    assert_eq!(decode_bytes(&wav, None).unwrap(), expected);
    let path = std::env::temp_dir().join(format!("mlxcel-audio-test-{}.wav", std::process::id()));
    std::fs::write(&path, &wav).unwrap();
    let from_file = load_file(&path);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(from_file.unwrap(), expected);
}

#[test]
fn every_pcm_width_and_float() {
    // One stereo frame pattern per format; the mono result is the mean of the channels.
    let n = 1000;
    let frames: Vec<(f64, f64)> =
        (0..n).map(|i| (((i * 37) % 200) as f64 / 100.0 - 1.0, ((i * 53) % 200) as f64 / 100.0 - 1.0)).collect();
    let expect = |q: &dyn Fn(f64) -> f64| -> Vec<f32> { frames.iter().map(|&(l, r)| ((q(l) + q(r)) / 2.0) as f32).collect() };

    // 8-bit unsigned.
    let data: Vec<u8> = frames.iter().flat_map(|&(l, r)| [(l * 127.0 + 128.0) as u8, (r * 127.0 + 128.0) as u8]).collect();
    let got = decode_bytes(&Wav::pcm(2, 16_000, 8).bytes(&data), None).unwrap();
    let want = expect(&|x| ((x * 127.0 + 128.0) as u8 as f64 - 128.0) / 128.0);
    assert_close(&got, &want, 1e-6, "u8");

    // 16, 24 and 32-bit signed.
    for bits in [16u32, 24, 32] {
        let scale = (1i64 << (bits - 1)) as f64;
        let q = |x: f64| (x * (scale - 1.0)).round() as i64;
        let data: Vec<u8> = frames
            .iter()
            .flat_map(|&(l, r)| [q(l), q(r)])
            .flat_map(|v| v.to_le_bytes()[..bits as usize / 8].to_vec())
            .collect();
        let got = decode_bytes(&Wav::pcm(2, 16_000, bits as u16).bytes(&data), None).unwrap();
        let want = expect(&|x| q(x) as f64 / scale);
        assert_close(&got, &want, 1e-6, &format!("s{bits}"));
    }

    // 32-bit float (format tag 3).
    let data: Vec<u8> = frames.iter().flat_map(|&(l, r)| [l as f32, r as f32]).flat_map(f32::to_le_bytes).collect();
    let wav = Wav { tag: 3, ..Wav::pcm(2, 16_000, 32) };
    let got = decode_bytes(&wav.bytes(&data), None).unwrap();
    assert_close(&got, &expect(&|x| x as f32 as f64), 1e-7, "f32");
}

#[test]
fn many_channels_and_other_rates() {
    // 6 channels at 22.05 kHz: channel c holds c / 10, so the mean is 0.25.
    let frames = 2205;
    let data: Vec<u8> = (0..frames)
        .flat_map(|_| (0..6).map(|c| (c as f32 / 10.0 * 32768.0) as i16))
        .flat_map(i16::to_le_bytes)
        .collect();
    let decoded = decode_bytes_native(&Wav::pcm(6, 22_050, 16).bytes(&data), None).unwrap();
    assert_eq!((decoded.info.sample_rate, decoded.info.channels, decoded.info.frames), (22_050, 6, frames as u64));
    assert_eq!(decoded.info.codec, "pcm_s16le");
    assert!(decoded.samples.iter().all(|&x| (x - 0.25).abs() < 1e-4));
    let at16k = decoded.into_16k().unwrap();
    assert_eq!(at16k.len(), 1600); // ceil(2205 * 16000 / 22050)
    // A constant resamples to itself away from the edges.
    assert!(at16k[100..1500].iter().all(|&x| (x - 0.25).abs() < 1e-3), "{:?}", &at16k[100..110]);
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max |diff| {worst} > {tol}");
}

// ---- errors -------------------------------------------------------------------------------

/// Decodes `bytes` and returns the error, its message checked for `needle`.
fn error_of(bytes: &[u8], needle: &str) -> Error {
    let err = decode_bytes(bytes, Some("wav")).expect_err("decoding should fail");
    let message = err.to_string();
    assert!(message.contains(needle), "message {message:?} lacks {needle:?}");
    err
}

#[test]
fn missing_file_names_its_path() {
    let path = std::path::Path::new("/nonexistent/dir/speech.wav");
    let err = load_file(path).unwrap_err();
    assert!(matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/dir/speech.wav"), "{err}");
}

#[test]
fn empty_input() {
    assert!(matches!(decode_bytes(&[], None), Err(Error::EmptyInput)));
    let path = std::env::temp_dir().join(format!("mlxcel-audio-empty-{}.wav", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let err = load_file(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err.cause(), Error::EmptyInput), "{err:?}");
    assert!(err.to_string().contains(&*path.to_string_lossy()) && err.to_string().contains("0 bytes"), "{err}");
}

#[test]
fn truncated_header() {
    let wav = Wav::pcm(1, 16_000, 16).bytes(&i16_bytes(&ramp_i16(100)));
    for cut in [6, 12, 20, 30, 40] {
        let err = error_of(&wav[..cut], "");
        assert!(
            matches!(err, Error::Truncated { .. } | Error::UnknownFormat { .. }),
            "cut at {cut}: {err:?}"
        );
    }
    // Cut inside the fmt chunk, after the RIFF/WAVE magic: a truncated WAV, not an unknown format.
    assert!(matches!(error_of(&wav[..30], "truncated"), Error::Truncated { .. }));
}

#[test]
fn truncated_data() {
    // The data chunk declares 1,000 frames; 100 are there.
    let wav = Wav { declared_data_len: Some(2000), ..Wav::pcm(1, 16_000, 16) }.bytes(&i16_bytes(&ramp_i16(100)));
    let err = error_of(&wav, "truncated");
    assert!(matches!(err, Error::Truncated { .. }), "{err:?}");
    // And a real file cut anywhere in its samples.
    let wav = Wav::pcm(2, 16_000, 16).bytes(&i16_bytes(&ramp_i16(20_000)));
    for cut in [60, 1000, 30_001, wav.len() - 1] {
        let err = error_of(&wav[..cut], "truncated");
        assert!(matches!(err, Error::Truncated { .. }), "cut at {cut}: {err:?}");
    }
}

#[test]
fn not_audio() {
    for bytes in [
        &b"hello, this is a text file and not audio at all\n"[..],
        &[0u8; 4096][..],
        &b"{\"json\": true}"[..],
        &b"RIFF\x24\x00\x00\x00AVI LIST"[..],
    ] {
        let err = error_of(bytes, "not audio");
        assert!(matches!(err, Error::UnknownFormat { .. }), "{err:?}");
    }
}

#[test]
fn zero_samples() {
    let err = error_of(&Wav::pcm(1, 16_000, 16).bytes(&[]), "no samples");
    assert!(matches!(err, Error::NoSamples), "{err:?}");
}

#[test]
fn unsupported_codec() {
    // WAVE_FORMAT_MPEGLAYER3 (0x55) and Microsoft ADPCM (2): containers we read, codecs we don't.
    let wav = Wav { tag: 0x55, ..Wav::pcm(1, 16_000, 0) }.bytes(&[0u8; 64]);
    assert!(matches!(error_of(&wav, "unsupported"), Error::UnsupportedCodec { .. }));
    let mut coefs = vec![0xf4u8, 0x01, 7, 0]; // 500 samples per block, 7 coefficient pairs
    for (a, b) in [(256i16, 0i16), (512, -256), (0, 0), (192, 64), (240, 0), (460, -208), (392, -232)] {
        coefs.extend(a.to_le_bytes());
        coefs.extend(b.to_le_bytes());
    }
    let adpcm = Wav { tag: 2, block_align: Some(256), fmt_extra: coefs, ..Wav::pcm(1, 16_000, 4) };
    let err = error_of(&adpcm.bytes(&[0u8; 512]), "unsupported codec");
    assert!(matches!(&err, Error::UnsupportedCodec { message } if message.contains("ADPCM")), "{err:?}");
}

#[test]
fn absurd_headers() {
    let data = i16_bytes(&ramp_i16(64));
    // 0 channels, 65,535 channels, a 0 Hz and a 4 GHz sample rate, 13- and 0-bit samples.
    let cases = [
        (Wav { block_align: Some(2), ..Wav::pcm(0, 16_000, 16) }, "channel"),
        (Wav { block_align: Some(2), ..Wav::pcm(u16::MAX, 16_000, 16) }, "channel"),
        (Wav::pcm(1, 0, 16), "sample rate"),
        (Wav::pcm(1, 4_000_000_000, 16), "sample rate"),
        (Wav { block_align: Some(2), ..Wav::pcm(1, 16_000, 13) }, ""),
        (Wav { block_align: Some(2), ..Wav::pcm(1, 16_000, 0) }, ""),
    ];
    for (wav, needle) in cases {
        let err = error_of(&wav.bytes(&data), needle);
        assert!(
            matches!(err, Error::InvalidHeader { .. } | Error::UnsupportedCodec { .. }),
            "{} ch, {} Hz, {} bits: {err:?}",
            wav.channels,
            wav.rate,
            wav.bits
        );
    }
}

#[test]
fn huge_declared_length_allocates_nothing() {
    // The data chunk claims 4 GiB; 64 samples follow. The claim is not believed.
    let wav = Wav { declared_data_len: Some(u32::MAX), ..Wav::pcm(1, 16_000, 16) }.bytes(&i16_bytes(&ramp_i16(64)));
    match decode_bytes(&wav, None) {
        Ok(samples) => assert_eq!(samples.len(), 64),
        Err(err) => assert!(matches!(err, Error::Truncated { .. }), "{err:?}"),
    }
}

#[test]
fn longer_than_the_limit() {
    // At 1 Hz, the 4-hour limit is 14,400 frames: 14,401 are refused, 14,400 accepted.
    let limit = MAX_DURATION_SECS as usize;
    let ok = decode_bytes_native(&Wav::pcm(1, 1, 16).bytes(&i16_bytes(&vec![100; limit])), None).unwrap();
    assert_eq!(ok.info.frames, limit as u64);
    let err = decode_bytes_native(&Wav::pcm(1, 1, 16).bytes(&i16_bytes(&vec![100; limit + 1])), None).unwrap_err();
    assert!(matches!(err, Error::TooLong { max_secs: 14_400, .. }), "{err:?}");
    assert!(err.to_string().contains("14400 s"), "{err}");
}

#[test]
fn file_errors_name_the_path() {
    let path = std::env::temp_dir().join(format!("mlxcel-audio-text-{}.mp3", std::process::id()));
    std::fs::write(&path, b"definitely not an mp3 file, just some text that goes on").unwrap();
    let err = decode_file(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(err.cause(), Error::UnknownFormat { .. }), "{err:?}");
    assert!(err.to_string().starts_with(&*path.to_string_lossy()), "{err}");
}

#[test]
fn resample_rejects_a_zero_rate() {
    let err = mlxcel_audio::resample(&[0.0; 10], 0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { name: "rate", .. }), "{err:?}");
}
