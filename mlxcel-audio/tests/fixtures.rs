//! The Whisper test clips (tests/fixtures/audio, made by its make_clips.sh): each decodes with the
//! sample count faster-whisper's decode_audio (PyAV) gives, and the WAVs match their raw PCM.

use std::path::PathBuf;

use mlxcel_audio::{decode_file, load_file};

fn clip(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/audio").join(name);
    assert!(path.exists(), "missing fixture {} (tests/fixtures/audio/make_clips.sh makes it)", path.display());
    path
}

/// The `data` chunk of a plain PCM WAV, as little-endian i16.
fn wav_pcm16(bytes: &[u8]) -> Vec<i16> {
    let mut at = 12;
    while at + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        if &bytes[at..at + 4] == b"data" {
            return bytes[at + 8..at + 8 + len].chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect();
        }
        at += 8 + len + (len & 1);
    }
    panic!("no data chunk");
}

#[test]
fn mono_16k_wav_is_its_pcm() {
    let path = clip("en_mono_16k.wav");
    let pcm = wav_pcm16(&std::fs::read(&path).unwrap());
    let want: Vec<f32> = pcm.iter().map(|&s| f32::from(s) / 32768.0).collect();
    assert_eq!(load_file(&path).unwrap(), want);
}

#[test]
fn stereo_44k_wav_is_downmixed_and_resampled() {
    let path = clip("en_stereo_44k.wav");
    let pcm = wav_pcm16(&std::fs::read(&path).unwrap());
    let decoded = decode_file(&path).unwrap();
    assert_eq!((decoded.info.sample_rate, decoded.info.channels, decoded.info.frames), (44_100, 2, 150_964));
    let mean: Vec<f32> = pcm.chunks_exact(2).map(|f| (f32::from(f[0]) / 32768.0 + f32::from(f[1]) / 32768.0) / 2.0).collect();
    assert_eq!(decoded.samples, mean);
    // faster-whisper (swresample) gives 54,772 samples at 16 kHz; so does ceil(n * 16000 / 44100).
    assert_eq!(decoded.into_16k().unwrap().len(), 54_772);
}

#[test]
fn flac_and_mp3_clips() {
    // (clip, samples at 16 kHz as faster-whisper's decode_audio returns them)
    for (name, samples) in [
        ("en_fox_us.flac", 46_536usize),
        ("silence_5s.flac", 80_000),
        ("en_news_2min.flac", 1_951_290),
        ("en_compressed.mp3", 48_960),
    ] {
        let decoded = decode_file(&clip(name)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((decoded.info.sample_rate, decoded.info.channels), (16_000, 1), "{name}");
        assert_eq!(decoded.samples.len(), samples, "{name}");
        assert!(decoded.samples.iter().all(|x| (-1.0..=1.0).contains(x)), "{name}");
        if name.starts_with("silence") {
            assert!(decoded.samples.iter().all(|&x| x == 0.0));
        }
    }
}
