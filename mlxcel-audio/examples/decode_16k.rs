//! Decodes an audio file as mlxcel's Whisper sees it (mono, 16 kHz) and
//! writes the samples as raw little-endian float32, for reference tools
//! (`tests/reference/make_whisper_goldens.py --mlxcel-samples`).
//!
//!     cargo run --release -p mlxcel-audio --example decode_16k -- IN OUT.f32

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: decode_16k IN OUT.f32");
        std::process::exit(2);
    }
    let samples = match mlxcel_audio::load_file(std::path::Path::new(&args[1])) {
        Ok(samples) => samples,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let bytes: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
    if let Err(e) = std::fs::write(&args[2], bytes) {
        eprintln!("error: {}: {e}", args[2]);
        std::process::exit(1);
    }
}
