//! Container and codec decoding with symphonia, downmixed to mono at the source rate.

use std::fs::File;
use std::io::{Cursor, ErrorKind};
use std::path::Path;

use symphonia::core::codecs::audio::well_known as codec;
use symphonia::core::codecs::audio::{AudioCodecId, AudioDecoderOptions};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::{MediaSource, MediaSourceStream};
use symphonia::core::meta::MetadataOptions;

use crate::error::{Error, Result};
use crate::resample::resample;

/// The longest audio decoded: 4 hours. Longer input is refused with [`Error::TooLong`] as soon as
/// the decoded length passes the limit, so no header claim makes us allocate more than this.
pub const MAX_DURATION_SECS: u64 = 4 * 3600;
/// The most channels a stream may have (third-order ambisonics has 16, 22.2 sound 24).
pub const MAX_CHANNELS: usize = 64;
/// The highest source sample rate accepted, in Hz (DXD / 8x is 705.6 kHz).
pub const MAX_SAMPLE_RATE: u32 = 768_000;

/// What the source was, before downmixing and resampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AudioInfo {
    /// The source sample rate in Hz.
    pub sample_rate: u32,
    /// The source channel count (the samples are their average).
    pub channels: usize,
    /// Decoded frames (samples per channel) at the source rate.
    pub frames: u64,
    /// The decoder's short codec name (`pcm_s16le`, `flac`, `mp3`, `vorbis`...).
    pub codec: String,
    /// Packets the decoder rejected as corrupt and skipped (MP3 and Vorbis streams may carry a
    /// damaged frame; a stream where every packet is corrupt is an error instead).
    pub skipped_packets: usize,
}

impl AudioInfo {
    /// The duration in seconds at the source rate.
    pub fn duration_secs(&self) -> f64 {
        self.frames as f64 / f64::from(self.sample_rate)
    }
}

/// Decoded audio at its source rate: mono samples (the average of the channels) in [-1, 1].
#[derive(Debug, Clone)]
pub struct Decoded {
    pub samples: Vec<f32>,
    pub info: AudioInfo,
}

impl Decoded {
    /// The samples resampled to [`SAMPLE_RATE`](crate::SAMPLE_RATE) (untouched if already there).
    pub fn into_16k(self) -> Result<Vec<f32>> {
        if self.info.sample_rate == crate::SAMPLE_RATE {
            return Ok(self.samples);
        }
        resample(&self.samples, self.info.sample_rate)
    }
}

/// Decodes an audio file (WAV, FLAC, MP3, Ogg Vorbis) to mono f32 samples at
/// [`SAMPLE_RATE`](crate::SAMPLE_RATE). Errors name the path ([`Error::File`] or [`Error::Io`]).
pub fn load_file(path: &Path) -> Result<Vec<f32>> {
    decode_file(path)?.into_16k().map_err(|e| e.in_file(path))
}

/// Decodes an audio file held in memory; `extension_hint` (`"wav"`, `"mp3"`..., without the dot)
/// helps the probe but the content decides.
pub fn decode_bytes(bytes: &[u8], extension_hint: Option<&str>) -> Result<Vec<f32>> {
    decode_bytes_native(bytes, extension_hint)?.into_16k()
}

/// Like [`load_file`], but keeps the source rate and reports what the source was.
pub fn decode_file(path: &Path) -> Result<Decoded> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if meta.is_dir() {
        return Err(io(std::io::Error::new(ErrorKind::IsADirectory, "is a directory")));
    }
    if meta.len() == 0 {
        return Err(Error::EmptyInput.in_file(path));
    }
    let ext = path.extension().and_then(|e| e.to_str());
    decode_source(Box::new(file), ext).map_err(|e| e.in_file(path))
}

/// Like [`decode_bytes`], but keeps the source rate and reports what the source was.
pub fn decode_bytes_native(bytes: &[u8], extension_hint: Option<&str>) -> Result<Decoded> {
    if bytes.is_empty() {
        return Err(Error::EmptyInput);
    }
    decode_source(Box::new(Cursor::new(bytes)), extension_hint)
}

fn decode_source<'s>(source: Box<dyn MediaSource + 's>, ext: Option<&str>) -> Result<Decoded> {
    let mss = MediaSourceStream::new(source, Default::default());
    let mut hint = Hint::new();
    if let Some(ext) = ext {
        hint.with_extension(ext);
    }
    let mut format = symphonia::default::get_probe()
        .probe(&hint, mss, FormatOptions::default(), MetadataOptions::default())
        .map_err(probe_error)?;
    let track = format.default_track(TrackType::Audio).ok_or(Error::NoAudioTrack)?;
    let track_id = track.id;
    let declared_frames = track.num_frames;
    let params = track.codec_params.as_ref().and_then(|p| p.audio()).ok_or(Error::NoAudioTrack)?.clone();
    if let Some(rate) = params.sample_rate {
        check_rate(rate)?;
    }
    if let Some(channels) = &params.channels {
        check_channels(channels.count())?;
    }
    // Verification checks a FLAC file's MD5 of its decoded samples.
    let mut options = AudioDecoderOptions::default();
    options.verify = true;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &options)
        .map_err(|e| codec_error(e, params.codec))?;
    let codec_name = decoder.codec_info().short_name.to_string();

    let mut samples: Vec<f32> = Vec::new();
    let mut interleaved: Vec<f32> = Vec::new();
    let mut spec: Option<(u32, usize)> = None;
    let mut max_frames = u64::MAX;
    let mut skipped = 0usize;
    let mut first_skip: Option<&'static str> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(packet)) => packet,
            Ok(None) => break,
            // A chained Ogg stream starts a new logical stream: we keep the first.
            Err(SymError::ResetRequired) => break,
            Err(e) => return Err(stream_error(e)),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buf = match decoder.decode(&packet) {
            Ok(buf) => buf,
            Err(SymError::DecodeError(message)) => {
                skipped += 1;
                first_skip.get_or_insert(message);
                continue;
            }
            Err(e) => return Err(stream_error(e)),
        };
        let rate = buf.spec().rate();
        let channels = buf.spec().channels().count();
        match spec {
            None => {
                check_rate(rate)?;
                check_channels(channels)?;
                spec = Some((rate, channels));
                max_frames = MAX_DURATION_SECS * u64::from(rate);
            }
            Some(s) if s != (rate, channels) => {
                return Err(Error::InvalidHeader {
                    message: format!(
                        "the stream changes from {} Hz, {} channels to {rate} Hz, {channels} channels",
                        s.0, s.1
                    ),
                });
            }
            Some(_) => {}
        }
        let frames = buf.frames();
        if samples.len() as u64 + frames as u64 > max_frames {
            return Err(Error::TooLong { max_secs: MAX_DURATION_SECS, max_frames, rate });
        }
        if channels == 1 {
            let start = samples.len();
            samples.resize(start + frames, 0.0);
            buf.copy_to_slice_interleaved(&mut samples[start..]);
        } else {
            interleaved.resize(frames * channels, 0.0);
            buf.copy_to_slice_interleaved(&mut interleaved[..]);
            let scale = 1.0 / channels as f32;
            samples.extend(interleaved.chunks_exact(channels).map(|f| f.iter().sum::<f32>() * scale));
        }
    }
    let Some((sample_rate, channels)) = spec else {
        return Err(match first_skip {
            Some(message) => Error::Malformed { message: message.to_string() },
            None => Error::NoSamples,
        });
    };
    if samples.is_empty() {
        return Err(Error::NoSamples);
    }
    let frames = samples.len() as u64;
    if let Some(declared) = declared_frames.filter(|&d| d > frames) {
        return Err(Error::Truncated {
            message: format!("the header declares {declared} frames, the data holds {frames}"),
        });
    }
    if decoder.finalize().verify_ok == Some(false) {
        return Err(Error::Malformed { message: "the decoded samples do not match the file's MD5 checksum".into() });
    }
    Ok(Decoded {
        samples,
        info: AudioInfo { sample_rate, channels, frames, codec: codec_name, skipped_packets: skipped },
    })
}

fn check_rate(rate: u32) -> Result<()> {
    if rate == 0 || rate > MAX_SAMPLE_RATE {
        return Err(Error::InvalidHeader {
            message: format!("sample rate {rate} Hz (expected 1 to {MAX_SAMPLE_RATE} Hz)"),
        });
    }
    Ok(())
}

fn check_channels(channels: usize) -> Result<()> {
    if channels == 0 || channels > MAX_CHANNELS {
        return Err(Error::InvalidHeader {
            message: format!("{channels} channels (expected 1 to {MAX_CHANNELS})"),
        });
    }
    Ok(())
}

fn is_eof(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::UnexpectedEof
}

/// Errors while probing: the container could not be recognised or its header parsed.
fn probe_error(e: SymError) -> Error {
    match e {
        SymError::IoError(ref io) if is_eof(io) => Error::Truncated { message: "the input ends inside its header".into() },
        SymError::IoError(io) => Error::Malformed { message: io.to_string() },
        // The probe's own "no format matched" is Unsupported; a reader that recognised the
        // container but rejects a field says DecodeError or Unsupported with its own prefix.
        SymError::Unsupported(message) if message.starts_with("core (probe)") => {
            Error::UnknownFormat { message: message.to_string() }
        }
        SymError::Unsupported(message) => Error::UnsupportedCodec { message: message.to_string() },
        SymError::DecodeError(message) => Error::InvalidHeader { message: message.to_string() },
        SymError::LimitError(message) => Error::InvalidHeader { message: format!("limit reached: {message}") },
        other => Error::Malformed { message: other.to_string() },
    }
}

/// Errors while reading packets or decoding.
fn stream_error(e: SymError) -> Error {
    match e {
        SymError::IoError(ref io) if is_eof(io) => {
            Error::Truncated { message: "the input ends inside its audio data".into() }
        }
        SymError::IoError(io) => Error::Malformed { message: io.to_string() },
        SymError::DecodeError(message) => Error::Malformed { message: message.to_string() },
        SymError::Unsupported(message) => Error::UnsupportedCodec { message: message.to_string() },
        SymError::LimitError(message) => Error::Malformed { message: format!("limit reached: {message}") },
        other => Error::Malformed { message: other.to_string() },
    }
}

fn codec_error(e: SymError, id: AudioCodecId) -> Error {
    let name = codec_name(id);
    match e {
        SymError::Unsupported(_) => Error::UnsupportedCodec {
            message: format!("{name} (this build decodes PCM, FLAC, MP3 and Vorbis)"),
        },
        SymError::DecodeError(message) => Error::InvalidHeader { message: format!("{name}: {message}") },
        other => Error::Malformed { message: format!("{name}: {other}") },
    }
}

/// A readable name for the codecs a WAV, Ogg or other container commonly carries.
fn codec_name(id: AudioCodecId) -> String {
    let known = [
        (codec::CODEC_ID_ADPCM_MS, "Microsoft ADPCM"),
        (codec::CODEC_ID_ADPCM_IMA_WAV, "IMA ADPCM"),
        (codec::CODEC_ID_ADPCM_G722, "G.722 ADPCM"),
        (codec::CODEC_ID_ADPCM_G726, "G.726 ADPCM"),
        (codec::CODEC_ID_OPUS, "Opus"),
        (codec::CODEC_ID_SPEEX, "Speex"),
        (codec::CODEC_ID_AAC, "AAC"),
        (codec::CODEC_ID_ALAC, "ALAC"),
        (codec::CODEC_ID_AC3, "AC-3"),
        (codec::CODEC_ID_WMA, "WMA"),
        (codec::CODEC_ID_MP1, "MPEG-1 Layer I"),
        (codec::CODEC_ID_MP2, "MPEG-1 Layer II"),
    ];
    match known.iter().find(|(k, _)| *k == id) {
        Some((_, name)) => format!("codec {name}"),
        None => format!("codec id {id}"),
    }
}
