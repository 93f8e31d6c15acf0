//! Llama 3's RoPE frequency schedule, shared by the loader (which runs it) and the converter
//! (which recovers it from llama.cpp's `rope_freqs.weight`), so both compute it identically.

/// The `llama3` `rope_scaling` parameters, with mlx-lm's defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

/// The largest relative difference between llama.cpp's factors and [`Llama3Scaling::factors`]
/// that [`Llama3Scaling::from_factors`] accepts: f32 rounding of the periods, amplified up
/// to `factor` times by the smoothing (measured below 2e-6 for factors up to 32).
pub const LLAMA3_FACTOR_TOLERANCE: f32 = 1e-5;

/// `original_max_position_embeddings` llama.cpp assumes when it writes `rope_freqs`.
const LLAMA_CPP_OLD_CONTEXT: f64 = 8192.0;

impl Llama3Scaling {
    /// mlx-lm's defaults for the optional keys.
    pub fn new(factor: f32, low: Option<f32>, high: Option<f32>, old_context: Option<f32>) -> Self {
        Llama3Scaling {
            factor,
            low_freq_factor: low.unwrap_or(1.0),
            high_freq_factor: high.unwrap_or(4.0),
            original_max_position_embeddings: old_context.unwrap_or(8192.0),
        }
    }

    /// The scaled period of each of the `dims / 2` rotated pairs (mlx-lm's `Llama3RoPE._freqs`,
    /// what `fast::rope` takes as `freqs`).
    pub fn periods(&self, dims: usize, base: f32) -> Vec<f32> {
        let (factor, low, high) = (self.factor, self.low_freq_factor, self.high_freq_factor);
        let old_context = self.original_max_position_embeddings;
        let (low_wavelen, high_wavelen) = (old_context / low, old_context / high);
        (0..dims / 2)
            .map(|i| {
                let period = base.powf((2 * i) as f32 / dims as f32);
                let wavelen = 2.0 * std::f32::consts::PI * period;
                let scaled = if wavelen > low_wavelen { period * factor } else { period };
                if wavelen > high_wavelen && wavelen < low_wavelen {
                    let smooth = (old_context / wavelen - low) / (high - low);
                    scaled / ((1.0 - smooth) / factor + smooth)
                } else {
                    scaled
                }
            })
            .collect()
    }

    /// How much [`Self::periods`] stretches each pair's unscaled period: llama.cpp's
    /// `rope_freqs` (it divides each pair's angle by its factor).
    pub fn factors(&self, dims: usize, base: f32) -> Vec<f32> {
        self.periods(dims, base)
            .iter()
            .enumerate()
            .map(|(i, p)| p / base.powf((2 * i) as f32 / dims as f32))
            .collect()
    }

    /// The scaling whose [`Self::factors`] equal `factors` (llama.cpp's `rope_freqs.weight`)
    /// within [`LLAMA3_FACTOR_TOLERANCE`], or `None` when no llama3 schedule reproduces them.
    ///
    /// `factor` is the largest value (stored exactly). The smoothed pairs lie on
    /// `1/f = (1 - s)/factor + s` with `s` linear in `1/wavelen`, which fixes the two wavelength
    /// bounds; `low`/`high` follow for llama.cpp's context of 8192 (only their ratios to it
    /// matter). Fewer than two smoothed pairs leave mlx-lm's defaults as the only candidate.
    pub fn from_factors(factors: &[f32], dims: usize, base: f32) -> Option<Self> {
        if factors.len() != dims / 2 || factors.iter().any(|f| !f.is_finite() || *f < 1.0) {
            return None;
        }
        let factor = factors.iter().copied().fold(1.0f32, f32::max);
        if factor <= 1.0 {
            return None;
        }
        let old = LLAMA_CPP_OLD_CONTEXT;
        let margin = LLAMA3_FACTOR_TOLERANCE;
        // (1 / wavelen, s) of each smoothed pair.
        let points: Vec<(f64, f64)> = factors
            .iter()
            .enumerate()
            .filter(|(_, &f)| f > 1.0 + margin && f < factor * (1.0 - margin))
            .map(|(i, &f)| {
                let wavelen = 2.0 * std::f64::consts::PI * (base as f64).powf(2.0 * i as f64 / dims as f64);
                let inv_factor = 1.0 / factor as f64;
                (1.0 / wavelen, (1.0 / f as f64 - inv_factor) / (1.0 - inv_factor))
            })
            .collect();
        let mut candidates = vec![];
        if points.len() >= 2 {
            // Least squares s = a * x + b, with a = old / (high - low), b = -low / (high - low).
            let n = points.len() as f64;
            let (sx, sy) = points.iter().fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
            let (mx, my) = (sx / n, sy / n);
            let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
            let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
            if sxx > 0.0 && sxy > 0.0 {
                let a = sxy / sxx;
                let b = my - a * mx;
                let low = -b * old / a;
                let high = low + old / a;
                // Published values are round numbers; the fitted ones carry f32 noise.
                let snap = |v: f64| (v * 256.0).round() / 256.0;
                candidates.push((snap(low), snap(high)));
                candidates.push((low, high));
            }
        } else {
            candidates.push((1.0, 4.0));
        }
        candidates
            .into_iter()
            .filter(|&(low, high)| low > 0.0 && high > low)
            .map(|(low, high)| Llama3Scaling {
                factor,
                low_freq_factor: low as f32,
                high_freq_factor: high as f32,
                original_max_position_embeddings: old as f32,
            })
            .find(|s| {
                s.factors(dims, base).iter().zip(factors).all(|(ours, theirs)| {
                    (ours - theirs).abs() <= LLAMA3_FACTOR_TOLERANCE * theirs.abs()
                })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `rope_freqs` (convert_hf_to_gguf.py): f32 rates, the rest in f64.
    fn llama_cpp_factors(dims: usize, base: f32, factor: f64, low: f64, high: f64, old: f64) -> Vec<f32> {
        (0..dims / 2)
            .map(|i| {
                let rate = 1.0 / base.powf((2 * i) as f32 / dims as f32);
                let wavelen = 2.0 * std::f64::consts::PI / rate as f64;
                let f = if wavelen < old / high {
                    1.0
                } else if wavelen > old / low {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                f as f32
            })
            .collect()
    }

    #[test]
    fn recovers_published_llama3_schedules() {
        // Llama 3.1 8B, Llama 3.2 1B / 3B, and unusual bounds.
        for (dims, base, factor, low, high) in [
            (128, 500_000.0, 8.0, 1.0, 4.0),
            (64, 500_000.0, 32.0, 1.0, 4.0),
            (128, 500_000.0, 32.0, 1.0, 4.0),
            (64, 10_000.0, 4.0, 0.5, 2.5),
        ] {
            let theirs = llama_cpp_factors(dims, base, factor, low, high, 8192.0);
            let s = Llama3Scaling::from_factors(&theirs, dims, base)
                .unwrap_or_else(|| panic!("{dims} {base} {factor}"));
            assert_eq!(
                (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings),
                (factor as f32, low as f32, high as f32, 8192.0)
            );
            let ours = s.factors(dims, base);
            let worst = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs() / b).fold(0.0, f32::max);
            assert!(worst < 2e-6, "{dims} {base} {factor}: {worst}");
        }
    }

    #[test]
    fn refuses_what_no_llama3_schedule_gives() {
        let good = llama_cpp_factors(64, 500_000.0, 32.0, 1.0, 4.0, 8192.0);
        let smoothed = good.iter().position(|&f| f > 1.01 && f < 31.0).unwrap();
        for (what, i, scale) in [("smoothed pair", smoothed, 1.0001), ("unscaled pair", 0, 1.5), ("scaled pair", 31, 0.9)] {
            let mut bad = good.clone();
            bad[i] *= scale;
            assert_eq!(Llama3Scaling::from_factors(&bad, 64, 500_000.0), None, "{what}");
        }
        assert_eq!(Llama3Scaling::from_factors(&good[1..], 64, 500_000.0), None, "length");
        assert_eq!(Llama3Scaling::from_factors(&[1.0; 32], 64, 500_000.0), None, "all ones");
        let mut shrunk = good.clone();
        shrunk[31] = 0.5;
        assert_eq!(Llama3Scaling::from_factors(&shrunk, 64, 500_000.0), None, "below 1");
    }
}
