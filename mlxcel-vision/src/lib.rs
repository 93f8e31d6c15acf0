//! Images for vision-language models, without MLX: decoding with checked
//! limits ([`decode`]), Pillow's resampling filters reproduced exactly
//! ([`resample`]), and the Idefics3 / SmolVLM image processor
//! ([`idefics3`]) that turns an image into normalized tiles plus the text
//! that stands for them in the prompt.

pub mod decode;
pub mod error;
pub mod idefics3;
pub mod resample;

pub use decode::{decode_image, DecodeLimits, RgbImage};
pub use error::{Error, Result};
pub use idefics3::{Idefics3Processor, ProcessedImage};
pub use resample::{resize, Filter};
