//! The Idefics3 / SmolVLM image processor, as transformers'
//! `Idefics3ImageProcessorPil` / `SmolVLMImageProcessorPil` (transformers
//! 5.24, what mlx-vlm 0.7.10 runs) computes it for one image:
//!
//! 1. resize so the longest edge is `size.longest_edge` (odd short edges
//!    rounded up to even; never above 4096);
//! 2. with `do_image_splitting`, resize up to multiples of
//!    `max_image_size.longest_edge` (M) on both sides, cut it into M×M tiles
//!    row by row, and add the whole image resized to M×M as the last, the
//!    global tile; without it, resize to M×M;
//! 3. rescale by `rescale_factor` in double precision, round to f32, and
//!    normalize with `image_mean` / `image_std` in f32.
//!
//! Resizing is Pillow's, reproduced exactly ([`crate::resample`]). The text
//! that stands for an image in the prompt (`<fake_token_around_image>`,
//! `<row_i_col_j>`, `<global-img>`, `image_seq_len` × `<image>`) comes from
//! [`Idefics3Processor::prompt_for`].

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::decode::RgbImage;
use crate::error::{Error, Result};
use crate::resample::{resize, Filter};

/// The placeholder a chat template writes for each image.
pub const IMAGE_TOKEN: &str = "<image>";
pub const FAKE_IMAGE_TOKEN: &str = "<fake_token_around_image>";
pub const GLOBAL_IMAGE_TOKEN: &str = "<global-img>";

/// Transformers' cap on the resized image (`MAX_IMAGE_SIZE`).
const MAX_IMAGE_SIZE: u32 = 4096;

#[derive(Debug, Clone, Deserialize)]
struct LongestEdge {
    longest_edge: u32,
}

/// `preprocessor_config.json`, under transformers' names and defaults.
#[derive(Debug, Clone, Deserialize)]
struct PreprocessorConfig {
    #[serde(default = "yes")]
    do_convert_rgb: bool,
    #[serde(default = "yes")]
    do_resize: bool,
    #[serde(default = "default_size")]
    size: LongestEdge,
    #[serde(default = "default_resample")]
    resample: i64,
    #[serde(default = "yes")]
    do_image_splitting: bool,
    #[serde(default = "default_max_image_size")]
    max_image_size: LongestEdge,
    #[serde(default = "yes")]
    do_rescale: bool,
    #[serde(default = "default_rescale")]
    rescale_factor: f64,
    #[serde(default = "yes")]
    do_normalize: bool,
    #[serde(default = "default_half")]
    image_mean: Vec<f32>,
    #[serde(default = "default_half")]
    image_std: Vec<f32>,
}

fn yes() -> bool {
    true
}
fn default_size() -> LongestEdge {
    LongestEdge { longest_edge: 4 * 364 }
}
fn default_max_image_size() -> LongestEdge {
    LongestEdge { longest_edge: 364 }
}
fn default_resample() -> i64 {
    1 // LANCZOS
}
fn default_rescale() -> f64 {
    1.0 / 255.0
}
fn default_half() -> Vec<f32> {
    vec![0.5; 3]
}

/// One image as the vision tower takes it.
#[derive(Debug, Clone)]
pub struct ProcessedImage {
    /// `[tiles, 3, side, side]` f32, channels first (transformers' layout):
    /// the row-major tiles, then the global tile.
    pub pixel_values: Vec<f32>,
    pub tiles: usize,
    pub side: usize,
    /// Tile rows and columns (0 and 0: not split, one tile).
    pub rows: usize,
    pub cols: usize,
}

/// The image processor of an Idefics3 / SmolVLM checkpoint, with the number
/// of `<image>` tokens each tile becomes.
#[derive(Debug, Clone)]
pub struct Idefics3Processor {
    config: PreprocessorConfig,
    filter: Filter,
    image_seq_len: usize,
}

impl Idefics3Processor {
    /// Reads `preprocessor_config.json` (transformers' defaults where it is
    /// absent) and `processor_config.json`'s `image_seq_len` from `dir`.
    /// `image_seq_len` is what the model's vision tower and connector make
    /// of one tile, `(image_size / patch_size)² / scale_factor²`; a
    /// `processor_config.json` that says otherwise is an error.
    pub fn from_dir(dir: &Path, image_seq_len: usize) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let config: PreprocessorConfig = if path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
            serde_json::from_str(&text).map_err(|e| Error::Config { path: path.clone(), message: e.to_string() })?
        } else {
            serde_json::from_value(Value::Object(Default::default())).expect("defaults")
        };
        let processor = dir.join("processor_config.json");
        if processor.exists() {
            let text = std::fs::read_to_string(&processor).map_err(|source| Error::Io { path: processor.clone(), source })?;
            let value: Value = serde_json::from_str(&text).map_err(|e| Error::Config { path: processor.clone(), message: e.to_string() })?;
            if let Some(n) = value.get("image_seq_len").and_then(Value::as_u64) {
                if n as usize != image_seq_len {
                    return Err(Error::Config {
                        path: processor,
                        message: format!(
                            "image_seq_len {n}, but the vision tower and connector make {image_seq_len} features of each tile"
                        ),
                    });
                }
            }
        }
        Self::new(config, image_seq_len, &path)
    }

    fn new(config: PreprocessorConfig, image_seq_len: usize, path: &Path) -> Result<Self> {
        let bad = |message: String| Error::Config { path: path.into(), message };
        let filter = Filter::from_pil(config.resample)
            .ok_or_else(|| bad(format!("resample {} is not supported (1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING)", config.resample)))?;
        if config.image_mean.len() != 3 || config.image_std.len() != 3 {
            return Err(bad("image_mean and image_std need 3 values (RGB)".into()));
        }
        if config.max_image_size.longest_edge == 0 || config.size.longest_edge == 0 {
            return Err(bad("size.longest_edge and max_image_size.longest_edge must be positive".into()));
        }
        if !config.do_convert_rgb {
            return Err(bad("do_convert_rgb false is not supported: images are decoded to RGB".into()));
        }
        if config.do_image_splitting && config.do_resize && config.size.longest_edge < config.max_image_size.longest_edge {
            // Images would be padded to one size, with patch masks in the vision tower.
            return Err(bad("size.longest_edge below max_image_size.longest_edge (padded tiles) is not supported".into()));
        }
        Ok(Idefics3Processor { config, filter, image_seq_len })
    }

    /// Features (and `<image>` tokens) per tile.
    pub fn image_seq_len(&self) -> usize {
        self.image_seq_len
    }

    /// The tile side the vision tower takes (`max_image_size.longest_edge`).
    pub fn tile_side(&self) -> usize {
        self.config.max_image_size.longest_edge as usize
    }

    /// Steps 1-3 of the module description for one image.
    pub fn process(&self, image: &RgbImage) -> Result<ProcessedImage> {
        let c = &self.config;
        let m = c.max_image_size.longest_edge;
        let mut image = image.clone();
        if c.do_resize {
            let (h, w) = rescale_to_max_len(image.height, image.width, c.size.longest_edge);
            let (h, w) = scale_below_upper_bound(h, w, MAX_IMAGE_SIZE);
            image = resize(&image, w, h, self.filter);
        }
        let (frames, rows, cols) = if c.do_image_splitting {
            let (h, w) = resize_for_vision_encoder(image.height, image.width, m);
            image = resize(&image, w, h, self.filter);
            split(&image, m, self.filter)
        } else {
            (vec![resize(&image, m, m, self.filter)], 0, 0)
        };
        let side = m as usize;
        if let Some(frame) = frames.iter().find(|f| f.width != m || f.height != m) {
            return Err(Error::image("image", format!("a {}×{} tile, not {m}×{m}: padded tiles are not supported", frame.width, frame.height)));
        }
        let mut pixel_values = Vec::with_capacity(frames.len() * 3 * side * side);
        for frame in &frames {
            for channel in 0..3 {
                let (mean, std) = (c.image_mean[channel], c.image_std[channel]);
                pixel_values.extend(frame.data.iter().skip(channel).step_by(3).map(|&v| {
                    let mut x = v as f32;
                    if c.do_rescale {
                        x = (v as f64 * c.rescale_factor) as f32;
                    }
                    if c.do_normalize {
                        x = (x - mean) / std;
                    }
                    x
                }));
            }
        }
        Ok(ProcessedImage { pixel_values, tiles: frames.len(), side, rows, cols })
    }

    /// The text that replaces one image's `<image>` placeholder, as
    /// mlx-vlm's `get_image_prompt_string`.
    pub fn prompt_for(&self, image: &ProcessedImage) -> String {
        let tokens = IMAGE_TOKEN.repeat(self.image_seq_len);
        let global = format!("{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{tokens}{FAKE_IMAGE_TOKEN}");
        if image.rows == 0 && image.cols == 0 {
            return global;
        }
        let mut text = String::new();
        for row in 1..=image.rows {
            for col in 1..=image.cols {
                text.push_str(&format!("{FAKE_IMAGE_TOKEN}<row_{row}_col_{col}>{tokens}"));
            }
            text.push('\n');
        }
        text.push('\n');
        text.push_str(&global);
        text
    }

    /// `text` (a rendered prompt with one `<image>` per image) with each
    /// placeholder replaced by its image's [`prompt_for`](Self::prompt_for),
    /// in order; an error unless the counts agree.
    pub fn expand_prompt(&self, text: &str, images: &[ProcessedImage]) -> Result<String> {
        let parts: Vec<&str> = text.split(IMAGE_TOKEN).collect();
        if parts.len() - 1 != images.len() {
            return Err(Error::Prompt(format!(
                "the prompt has {} {IMAGE_TOKEN} placeholders for {} images",
                parts.len() - 1,
                images.len()
            )));
        }
        let mut out = parts[0].to_string();
        for (image, part) in images.iter().zip(&parts[1..]) {
            out.push_str(&self.prompt_for(image));
            out.push_str(part);
        }
        Ok(out)
    }
}

/// transformers' `_resize_output_size_rescale_to_max_len` (min_len 1).
fn rescale_to_max_len(height: u32, width: u32, max_len: u32) -> (u32, u32) {
    let aspect = width as f64 / height as f64;
    let even = |x: i64| if x % 2 != 0 { x + 1 } else { x };
    let (h, w) = if width >= height {
        (even((max_len as f64 / aspect) as i64), max_len as i64)
    } else {
        (max_len as i64, even((max_len as f64 * aspect) as i64))
    };
    (h.max(1) as u32, w.max(1) as u32)
}

/// transformers' `_resize_output_size_scale_below_upper_bound`.
fn scale_below_upper_bound(height: u32, width: u32, max_len: u32) -> (u32, u32) {
    let aspect = width as f64 / height as f64;
    let (mut h, mut w) = (height as i64, width as i64);
    if width >= height && width > max_len {
        w = max_len as i64;
        h = (w as f64 / aspect) as i64;
    } else if height > width && height > max_len {
        h = max_len as i64;
        w = (h as f64 * aspect) as i64;
    }
    (h.max(1) as u32, w.max(1) as u32)
}

/// transformers' `resize_for_vision_encoder`: both sides up to multiples of `m`.
fn resize_for_vision_encoder(height: u32, width: u32, m: u32) -> (u32, u32) {
    let aspect = width as f64 / height as f64;
    let up = |x: f64| ((x / m as f64).ceil() as u32) * m;
    if width >= height {
        let w = up(width as f64);
        let h = (w as f64 / aspect) as i64;
        (up(h as f64), w)
    } else {
        let h = up(height as f64);
        let w = (h as f64 * aspect) as i64;
        (h, up(w as f64))
    }
}

/// transformers' `split_images`: row-major m×m crops, then the global tile.
fn split(image: &RgbImage, m: u32, filter: Filter) -> (Vec<RgbImage>, usize, usize) {
    if image.height <= m && image.width <= m {
        return (vec![image.clone()], 0, 0);
    }
    let rows = ((image.height - m) / m + 1) as usize;
    let cols = ((image.width - m) / m + 1) as usize;
    let mut frames = Vec::with_capacity(rows * cols + 1);
    let (w, side) = (image.width as usize, m as usize);
    for r in 0..rows {
        for c in 0..cols {
            let mut data = Vec::with_capacity(side * side * 3);
            for y in r * side..(r + 1) * side {
                let start = (y * w + c * side) * 3;
                data.extend_from_slice(&image.data[start..start + side * 3]);
            }
            frames.push(RgbImage::new(m, m, data));
        }
    }
    frames.push(resize(image, m, m, filter));
    (frames, rows, cols)
}
