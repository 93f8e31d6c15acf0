//! The Idefics3 / SmolVLM image processor against transformers' (Pillow)
//! on the tiny SmolVLM goldens (`tests/reference/make_vlm_goldens.py`), and
//! bad images.

use std::path::PathBuf;

use mlxcel_vision::{decode_image, DecodeLimits, Idefics3Processor};
use safetensors::SafeTensors;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../mlxcel-models/tests/data/tiny/smolvlm")
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

fn tensor<T: Copy>(st: &SafeTensors, name: &str, from: fn([u8; 4]) -> T) -> (Vec<T>, Vec<usize>) {
    let view = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    let data = view.data().chunks(4).map(|c| from(c.try_into().unwrap())).collect();
    (data, view.shape().to_vec())
}

#[test]
fn preprocessing_matches_transformers() {
    let golden = golden();
    let bytes = std::fs::read(dir().join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let processor = Idefics3Processor::from_dir(&dir(), golden["image_seq_len"].as_u64().unwrap() as usize).unwrap();
    for (i, image) in golden["images"].as_array().unwrap().iter().enumerate() {
        let file = image["file"].as_str().unwrap();
        let decoded = decode_image(&std::fs::read(dir().join(file)).unwrap(), file, &DecodeLimits::default()).unwrap();
        // Decoding: Pillow's RGB bytes (PNG exactly; JPEG within a few levels, see below).
        let rgb = st.tensor(&format!("image{i}.rgb")).unwrap();
        assert_eq!(rgb.shape(), [decoded.height as usize, decoded.width as usize, 3], "{file}");
        let rgb_diff = rgb.data().iter().zip(&decoded.data).map(|(&a, &b)| (a as i32 - b as i32).abs()).max().unwrap();
        let (want, shape) = tensor(&st, &format!("image{i}.pixel_values"), f32::from_le_bytes);
        // From Pillow's own RGB bytes, the processor must give transformers' values bit for bit.
        let pillow = mlxcel_vision::RgbImage::new(decoded.width, decoded.height, rgb.data().to_vec());
        let exact = processor.process(&pillow).unwrap();
        assert_eq!((exact.tiles, exact.rows, exact.cols), (shape[0], image["rows"].as_u64().unwrap() as usize, image["cols"].as_u64().unwrap() as usize), "{file}");
        assert_eq!(exact.pixel_values, want, "{file}: pixel values from Pillow's RGB");
        let ours = processor.process(&decoded).unwrap();
        let max_diff = ours.pixel_values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{file}: decoded RGB max |Δ| {rgb_diff} levels; pixel values max |Δ| {max_diff:.3e}");
        if file.ends_with(".png") {
            assert_eq!(rgb_diff, 0, "{file}: PNG decoding must be exact");
            assert_eq!(max_diff, 0.0, "{file}");
        } else {
            // zune-jpeg against libjpeg-turbo: a few levels on some pixels
            // (measured: 4 decoded, 6 after resizing, i.e. 0.047 normalized).
            let mean = ours.pixel_values.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / want.len() as f64;
            eprintln!("{file}: pixel values mean |Δ| {mean:.3e}");
            assert!(rgb_diff <= 6, "{file}: JPEG decoding off by {rgb_diff} levels");
            assert!(max_diff <= 8.0 * 2.0 / 255.0 + 1e-6, "{file}: {max_diff}");
            assert!(mean <= 2.0 / 255.0, "{file}: mean {mean}");
        }
        let (mask, _) = tensor(&st, &format!("image{i}.pixel_attention_mask"), i32::from_le_bytes);
        assert!(mask.iter().all(|&m| m == 1), "{file}: padded tiles");
    }
}

#[test]
fn prompts_expand_as_mlx_vlm() {
    let golden = golden();
    let processor = Idefics3Processor::from_dir(&dir(), golden["image_seq_len"].as_u64().unwrap() as usize).unwrap();
    let tokenizer = tokenizers::Tokenizer::from_file(dir().join("tokenizer.json")).ok();
    let _ = tokenizer; // token ids are checked in mlxcel-models/tests/vlm_parity.rs
    for case in golden["cases"].as_array().unwrap() {
        let images: Vec<_> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let f = f.as_str().unwrap();
                let image = decode_image(&std::fs::read(dir().join(f)).unwrap(), f, &DecodeLimits::default()).unwrap();
                processor.process(&image).unwrap()
            })
            .collect();
        let text = processor.expand_prompt(case["prompt"].as_str().unwrap(), &images).unwrap();
        let count = text.matches("<image>").count();
        assert_eq!(count, images.iter().map(|i| i.tiles).sum::<usize>() * processor.image_seq_len());
        assert!(processor.expand_prompt(case["prompt"].as_str().unwrap(), &images[..images.len() - 1]).is_err());
    }
}

fn message(bytes: &[u8]) -> String {
    decode_image(bytes, "test-image", &DecodeLimits::default()).unwrap_err().to_string()
}

#[test]
fn bad_images_fail_with_clear_errors() {
    assert!(message(b"").contains("empty"), "{}", message(b""));
    assert!(message(b"hello, world").contains("not an image"), "{}", message(b"hello, world"));
    let png = std::fs::read(dir().join("images/landscape.png")).unwrap();
    let truncated = message(&png[..png.len() / 2]);
    assert!(truncated.contains("test-image") && truncated.contains("PNG"), "{truncated}");
    let jpeg = std::fs::read(dir().join("images/portrait.jpg")).unwrap();
    let truncated = message(&jpeg[..200]);
    assert!(truncated.contains("JPEG"), "{truncated}");
    // A PNG header claiming 100000×100000 pixels: refused before any pixel is decoded.
    let mut huge = png.clone();
    huge[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&huge[12..29]);
    huge[29..33].copy_from_slice(&crc.to_be_bytes());
    let huge = message(&huge);
    assert!(huge.contains("100000×100000") && huge.contains("over the limit"), "{huge}");
    // A TIFF header: a known format this build does not decode.
    let tiff = message(b"II*\0\x08\0\0\0\0\0");
    assert!(tiff.contains("not supported") || tiff.contains("not an image"), "{tiff}");
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}
