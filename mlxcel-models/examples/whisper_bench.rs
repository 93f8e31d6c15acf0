//! Times Whisper's encoder (one 30 s window) and one decoder step.
//!
//!     cargo run --release -p mlxcel-models --example whisper_bench -- DIR
use std::time::Instant;

fn main() {
    let dir = std::env::args().nth(1).expect("usage: whisper_bench CHECKPOINT_DIR");
    let model = mlxcel_models::whisper::Whisper::load(std::path::Path::new(&dir)).unwrap();
    let d = model.dims().clone();
    let steps: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(20);
    let mel: Vec<f32> = (0..d.n_mels * d.n_frames()).map(|i| ((i % 97) as f32 / 97.0) - 0.5).collect();
    for round in 0..3 {
        let t = Instant::now();
        let audio = model.encode(&mel).unwrap();
        audio.eval().unwrap();
        let encode = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut decoder = model.decoder(&audio).unwrap();
        let cross = t.elapsed().as_secs_f64();
        let t = Instant::now();
        decoder.forward(&[50257, 50363], &[1]).unwrap();
        let prompt = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..steps {
            decoder.forward(&[400], &[0]).unwrap();
        }
        let step = t.elapsed().as_secs_f64() / steps as f64;
        println!("round {round}: encode {:.1} ms, cross KV {:.1} ms, prompt {:.1} ms, decode step {:.2} ms", encode * 1e3, cross * 1e3, prompt * 1e3, step * 1e3);
    }
}
