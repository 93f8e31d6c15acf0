//! Pillow's convolution resampling (`Image.resize` with BOX, BILINEAR,
//! HAMMING, BICUBIC or LANCZOS, no `reducing_gap`) on 8-bit RGB, computed as
//! Pillow's `libImaging/Resample.c` computes it: the same filter weights in
//! double precision, normalized per output pixel, rounded to 22-bit fixed
//! point, a horizontal pass then a vertical pass over 8-bit intermediates,
//! each sum rounded and clipped to 0..255. So the result is Pillow's, byte
//! for byte (checked against Pillow 13 through transformers' processor in
//! `mlxcel-vision/tests/idefics3.rs`).

use crate::decode::RgbImage;

/// Pillow's resampling filters (`PIL.Image.Resampling`; NEAREST is not a
/// convolution and is not offered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Box,
    Bilinear,
    Hamming,
    Bicubic,
    Lanczos,
}

impl Filter {
    /// Pillow's enum value (`resample` in a `preprocessor_config.json`):
    /// 1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING.
    pub fn from_pil(value: i64) -> Option<Filter> {
        Some(match value {
            1 => Filter::Lanczos,
            2 => Filter::Bilinear,
            3 => Filter::Bicubic,
            4 => Filter::Box,
            5 => Filter::Hamming,
            _ => return None,
        })
    }

    fn support(self) -> f64 {
        match self {
            Filter::Box => 0.5,
            Filter::Bilinear | Filter::Hamming => 1.0,
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Filter::Bilinear => {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            Filter::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    // Pillow's constants are C floats.
                    x.sin() / x * (0.54f32 as f64 + 0.46f32 as f64 * x.cos())
                }
            }
            Filter::Bicubic => {
                let a = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            Filter::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Each output position's first input index and its fixed-point weights.
struct Coefficients {
    bounds: Vec<(usize, usize)>,
    weights: Vec<Vec<i32>>,
}

/// Pillow's `precompute_coeffs` over the whole input (box 0..in_size), then
/// `normalize_coeffs_8bpc`.
fn coefficients(in_size: usize, out_size: usize, filter: Filter) -> Coefficients {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast truncates toward zero, as `as` does.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let count = xmax.saturating_sub(xmin);
        let mut k: Vec<f64> = (0..count).map(|x| filter.weight((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
        let total: f64 = k.iter().sum();
        if total != 0.0 {
            k.iter_mut().for_each(|w| *w /= total);
        }
        let fixed = k
            .iter()
            .map(|&w| {
                let v = w * (1u32 << PRECISION_BITS) as f64;
                if w < 0.0 {
                    (-0.5 + v) as i32
                } else {
                    (0.5 + v) as i32
                }
            })
            .collect();
        bounds.push((xmin, count));
        weights.push(fixed);
    }
    Coefficients { bounds, weights }
}

fn clip8(sum: i64) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `image` resized to `width` × `height` with `filter`, as Pillow's
/// `Image.resize((width, height), filter)` on an RGB image.
pub fn resize(image: &RgbImage, width: u32, height: u32, filter: Filter) -> RgbImage {
    assert!(width > 0 && height > 0, "resize to an empty image");
    if image.width == width && image.height == height {
        return image.clone();
    }
    let (in_w, in_h) = (image.width as usize, image.height as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    let vertical = coefficients(in_h, out_h, filter);
    // The rows the vertical pass reads.
    let first_row = vertical.bounds[0].0;
    let last_row = vertical.bounds[out_h - 1].0 + vertical.bounds[out_h - 1].1;
    let half = 1i64 << (PRECISION_BITS - 1);

    // Horizontal pass over the rows the vertical pass needs.
    let (temp, temp_w, row_offset) = if out_w != in_w {
        let horizontal = coefficients(in_w, out_w, filter);
        let rows = last_row - first_row;
        let mut temp = vec![0u8; rows * out_w * 3];
        for y in 0..rows {
            let src = &image.data[(y + first_row) * in_w * 3..][..in_w * 3];
            let dst = &mut temp[y * out_w * 3..][..out_w * 3];
            for (xx, ((xmin, count), k)) in horizontal.bounds.iter().zip(&horizontal.weights).enumerate() {
                let mut sums = [half; 3];
                for (x, &w) in k.iter().enumerate().take(*count) {
                    let p = &src[(xmin + x) * 3..][..3];
                    for c in 0..3 {
                        sums[c] += p[c] as i64 * w as i64;
                    }
                }
                for c in 0..3 {
                    dst[xx * 3 + c] = clip8(sums[c]);
                }
            }
        }
        (temp, out_w, first_row)
    } else {
        (image.data.clone(), in_w, 0)
    };
    if out_h == in_h {
        return RgbImage::new(width, height, temp);
    }
    // Vertical pass.
    let mut out = vec![0u8; out_w * out_h * 3];
    for (yy, ((ymin, count), k)) in vertical.bounds.iter().zip(&vertical.weights).enumerate() {
        let dst = &mut out[yy * out_w * 3..][..out_w * 3];
        for xx in 0..temp_w {
            let mut sums = [half; 3];
            for (y, &w) in k.iter().enumerate().take(*count) {
                let p = &temp[((ymin + y - row_offset) * temp_w + xx) * 3..][..3];
                for c in 0..3 {
                    sums[c] += p[c] as i64 * w as i64;
                }
            }
            for c in 0..3 {
                dst[xx * 3 + c] = clip8(sums[c]);
            }
        }
    }
    RgbImage::new(width, height, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_a_copy() {
        let image = RgbImage::new(2, 1, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(resize(&image, 2, 1, Filter::Lanczos), image);
    }

    #[test]
    fn constant_images_stay_constant() {
        let image = RgbImage::new(7, 5, [10u8, 200, 90].repeat(35));
        for filter in [Filter::Box, Filter::Bilinear, Filter::Hamming, Filter::Bicubic, Filter::Lanczos] {
            let out = resize(&image, 12, 3, filter);
            assert!(out.data.chunks(3).all(|p| p == [10, 200, 90]), "{filter:?}");
        }
    }
}
