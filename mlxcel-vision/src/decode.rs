//! Decoding an image file's bytes into 8-bit RGB, as mlx-vlm's `load_image`
//! does with Pillow: EXIF orientation applied, then `convert("RGB")` (an
//! alpha channel is dropped, grey is repeated, a palette is looked up).
//!
//! The dimensions are read from the header and checked against
//! [`DecodeLimits`] before any pixel is decoded, so a 100000×100000 PNG
//! header fails with an error naming its size, never an allocation.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

use crate::error::{Error, Result};

/// An 8-bit RGB image, row-major, 3 bytes per pixel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

impl RgbImage {
    pub fn new(width: u32, height: u32, data: Vec<u8>) -> Self {
        assert_eq!(data.len(), width as usize * height as usize * 3, "RGB data of the wrong length");
        RgbImage { width, height, data }
    }
}

/// What an image may be before it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest width and height, each (default 16384).
    pub max_side: u32,
    /// Largest width × height (default 64 Mi pixels: 192 MiB as RGB).
    pub max_pixels: u64,
    /// Largest file (default 64 MiB).
    pub max_bytes: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits { max_side: 16384, max_pixels: 64 << 20, max_bytes: 64 << 20 }
    }
}

/// The formats this build decodes.
pub const FORMATS: &str = "PNG, JPEG, WebP, GIF, BMP";

/// Decodes `bytes` (a whole image file) into RGB; `name` is what errors call
/// the image (its path, or e.g. `image 1`).
pub fn decode_image(bytes: &[u8], name: &str, limits: &DecodeLimits) -> Result<RgbImage> {
    if bytes.is_empty() {
        return Err(Error::image(name, "empty (0 bytes), not an image"));
    }
    if bytes.len() > limits.max_bytes {
        return Err(Error::image(name, format!("{} bytes, over the limit of {} bytes", bytes.len(), limits.max_bytes)));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::image(name, format!("cannot read: {e}")))?;
    let format = match reader.format() {
        Some(format @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif | ImageFormat::Bmp)) => format,
        Some(other) => return Err(Error::image(name, format!("{other:?} images are not supported ({FORMATS})"))),
        None => return Err(Error::image(name, format!("not an image in a supported format ({FORMATS})"))),
    };
    let what = format!("{format:?}").to_uppercase();
    let mut decoder = reader.into_decoder().map_err(|e| Error::image(name, format!("invalid {what}: {e}")))?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(Error::image(name, format!("{what} of {width}×{height} pixels has no pixels")));
    }
    if width > limits.max_side || height > limits.max_side || width as u64 * height as u64 > limits.max_pixels {
        return Err(Error::image(
            name,
            format!(
                "{what} of {width}×{height} pixels is over the limit ({} pixels a side, {} pixels in all)",
                limits.max_side, limits.max_pixels
            ),
        ));
    }
    let mut decode_limits = image::Limits::default();
    decode_limits.max_image_width = Some(limits.max_side);
    decode_limits.max_image_height = Some(limits.max_side);
    // Room for the decoder's own buffers: 16-bit RGBA at the largest size.
    decode_limits.max_alloc = Some(limits.max_pixels.saturating_mul(8));
    decoder.set_limits(decode_limits).map_err(|e| Error::image(name, format!("{what}: {e}")))?;
    let orientation = decoder.orientation().map_err(|e| Error::image(name, format!("invalid {what}: {e}")))?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(|e| Error::image(name, format!("invalid {what}: {e}")))?;
    image.apply_orientation(orientation);
    let rgb = image.into_rgb8();
    let (width, height) = rgb.dimensions();
    Ok(RgbImage::new(width, height, rgb.into_raw()))
}
