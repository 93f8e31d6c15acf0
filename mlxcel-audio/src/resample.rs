//! Sample-rate conversion to [`SAMPLE_RATE`](crate::SAMPLE_RATE) with rubato's FFT resampler.

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler, WindowFunction};

use crate::decode::MAX_SAMPLE_RATE;
use crate::error::{Error, Result};
use crate::SAMPLE_RATE;

/// The chunk size handed to rubato (a hint; it rounds to the rate pair's smallest block). One
/// FFT block of at least this many input frames gives an anti-aliasing filter whose passband
/// reaches about 98% of 8 kHz, which covers Whisper's highest mel band.
const CHUNK_HINT: usize = 2048;

/// Converts mono samples at `rate` Hz to [`SAMPLE_RATE`](crate::SAMPLE_RATE).
///
/// At 16 kHz the samples come back untouched (bit-exact). Otherwise the output has
/// `ceil(len * 16000 / rate)` samples, aligned with the input (the filter's delay is trimmed).
/// See the crate documentation for the choice of resampler and its measured accuracy.
pub fn resample(samples: &[f32], rate: u32) -> Result<Vec<f32>> {
    if rate == 0 || rate > MAX_SAMPLE_RATE {
        return Err(Error::invalid_argument("rate", format!("{rate} Hz (expected 1 to {MAX_SAMPLE_RATE} Hz)")));
    }
    if rate == SAMPLE_RATE {
        return Ok(samples.to_vec());
    }
    if samples.is_empty() {
        return Ok(Vec::new());
    }
    let mut resampler = Fft::<f32>::new_custom(
        rate as usize,
        SAMPLE_RATE as usize,
        CHUNK_HINT,
        1,
        1,
        WindowFunction::BlackmanHarris2,
        FixedSync::Both,
    )
    .map_err(|e| Error::Resample { message: e.to_string() })?;
    let input = InterleavedSlice::new(samples, 1, samples.len()).map_err(|e| Error::Resample { message: e.to_string() })?;
    let mut out = vec![0.0f32; resampler.process_all_needed_output_len(samples.len())];
    let out_frames = out.len();
    let mut output =
        InterleavedSlice::new_mut(&mut out[..], 1, out_frames).map_err(|e| Error::Resample { message: e.to_string() })?;
    let (_, written) = resampler
        .process_all_into_buffer(&input, &mut output, samples.len(), None)
        .map_err(|e| Error::Resample { message: e.to_string() })?;
    out.truncate(written);
    Ok(out)
}
