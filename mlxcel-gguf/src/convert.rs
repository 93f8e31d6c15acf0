//! GGUF -> MLX / Hugging Face checkpoint directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::{json, Map, Value as Json};

use crate::affine::{AffineMatrix, SUPPORTED_BITS};
use crate::arch::{is_norm, is_quantizable, HParams, ROPE_FACTORS, ROPE_FREQS};
use crate::dequant::{can_dequantize, dequantize};
use crate::ggml_type::GgmlType;
use crate::hf_tokenizer;
use crate::reader::{GgufFile, TensorInfo};
use crate::safetensors_out::{SafetensorsWriter, TensorSpec};
use crate::error::{Error, Result};

/// Group sizes MLX's affine kernels support.
pub const SUPPORTED_GROUP_SIZES: [u32; 3] = [32, 64, 128];

/// Options of [`convert_gguf`].
#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Re-quantize every linear layer and the embedding to this many bits (2, 3, 4, 5, 6, 8).
    pub q_bits: Option<u32>,
    /// Group size for `q_bits` (32, 64, 128; default 64 as in mlx-lm).
    pub q_group_size: Option<u32>,
}

/// Where [`convert_gguf_with_progress`] is: `done` of `total` tensors written, the last
/// one being `tensor` (its Hugging Face name).
#[derive(Debug, Clone, Copy)]
pub struct ConvertProgress<'a> {
    pub done: usize,
    pub total: usize,
    pub tensor: &'a str,
}

/// What [`convert_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub out_dir: PathBuf,
    /// `general.architecture` of the GGUF file.
    pub architecture: String,
    /// `model_type` of `config.json`.
    pub model_type: String,
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// Bytes of all files written.
    pub bytes_written: u64,
    /// Layers stored quantized (with `.scales` / `.biases`).
    pub quantized_layers: usize,
    /// GGUF tensors dequantized to floating point.
    pub dequantized_tensors: usize,
    /// GGUF tensors left out, with the reason.
    pub skipped: Vec<String>,
}

/// Default group size when only `q_bits` is given (mlx-lm's default).
const DEFAULT_GROUP_SIZE: u32 = 64;

/// How one GGUF tensor is written.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Encoding {
    /// Bytes copied as they are (F32, F16, BF16).
    Copy,
    /// Dequantized (or converted) to a float type.
    Float(FloatType),
    /// Q4_0 / Q4_1 / Q8_0 mapped exactly onto affine 4 / 8 bits, group 32.
    AffineExact,
    /// Dequantized, then quantized with MLX's affine algorithm.
    Requantize { bits: u32, group_size: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FloatType {
    F32,
    F16,
    BF16,
}

impl FloatType {
    fn dtype(self) -> &'static str {
        match self {
            FloatType::F32 => "F32",
            FloatType::F16 => "F16",
            FloatType::BF16 => "BF16",
        }
    }

    fn size(self) -> u64 {
        if self == FloatType::F32 {
            4
        } else {
            2
        }
    }

    fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        match self {
            FloatType::F32 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            FloatType::F16 => values
                .iter()
                .for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
            FloatType::BF16 => values
                .iter()
                .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        }
    }
}

/// One GGUF tensor and how it becomes safetensors tensors.
struct Job<'a> {
    info: &'a TensorInfo,
    hf_name: String,
    encoding: Encoding,
    /// Heads of the llama.cpp Q/K row permutation to undo.
    unpermute_heads: Option<usize>,
    /// Subtracted from every value (norm gains llama.cpp shifted, [`crate::Architecture::norm_shift`]).
    shift: f32,
}

impl Job<'_> {
    fn module(&self) -> &str {
        self.hf_name
            .strip_suffix(".weight")
            .unwrap_or(&self.hf_name)
    }

    fn quantization(&self) -> Option<(u32, u32)> {
        match (self.encoding, self.info.ggml_type) {
            (Encoding::AffineExact, GgmlType::Q8_0) => Some((8, 32)),
            (Encoding::AffineExact, _) => Some((4, 32)),
            (Encoding::Requantize { bits, group_size }, _) => Some((bits, group_size)),
            _ => None,
        }
    }

    fn specs(&self) -> Vec<TensorSpec> {
        let shape = self.info.shape();
        let n = self.info.n_elements();
        let spec = |name: String, dtype, shape, n_bytes| TensorSpec {
            name,
            dtype,
            shape,
            n_bytes,
        };
        match self.encoding {
            Encoding::Copy => {
                let dtype = float_type(self.info.ggml_type)
                    .expect("Copy is for float types")
                    .dtype();
                vec![spec(self.hf_name.clone(), dtype, shape, self.info.n_bytes)]
            }
            Encoding::Float(t) => vec![spec(self.hf_name.clone(), t.dtype(), shape, n * t.size())],
            Encoding::AffineExact | Encoding::Requantize { .. } => {
                let (bits, group) = self.quantization().expect("quantized encoding");
                let (rows, cols) = self.info.rows_cols();
                let groups = cols / group as usize;
                let packed = cols * bits as usize / 32;
                vec![
                    spec(
                        self.hf_name.clone(),
                        "U32",
                        vec![rows, packed],
                        (rows * packed * 4) as u64,
                    ),
                    spec(
                        format!("{}.scales", self.module()),
                        "F16",
                        vec![rows, groups],
                        (rows * groups * 2) as u64,
                    ),
                    spec(
                        format!("{}.biases", self.module()),
                        "F16",
                        vec![rows, groups],
                        (rows * groups * 2) as u64,
                    ),
                ]
            }
        }
    }
}

fn float_type(ty: GgmlType) -> Option<FloatType> {
    match ty {
        GgmlType::F32 => Some(FloatType::F32),
        GgmlType::F16 => Some(FloatType::F16),
        GgmlType::BF16 => Some(FloatType::BF16),
        _ => None,
    }
}

/// Converts a GGUF file into an MLX checkpoint directory at `out_dir` (which must not exist or
/// be empty): `model.safetensors`, `config.json`, `tokenizer.json`, `tokenizer_config.json`,
/// `generation_config.json` and `chat_template.jinja` (when the GGUF has a template).
///
/// Everything is written into a temporary sibling directory that is renamed at the end, so a
/// failed conversion leaves nothing behind.
pub fn convert_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
) -> Result<ConvertReport> {
    convert_gguf_with_progress(gguf_path, out_dir, opts, &mut |_| {})
}

/// [`convert_gguf`], calling `on_progress` after each tensor is written.
pub fn convert_gguf_with_progress(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
    on_progress: &mut dyn FnMut(ConvertProgress),
) -> Result<ConvertReport> {
    let gguf = GgufFile::open(gguf_path)?;
    let hp = HParams::from_gguf(&gguf)?;
    let requant = check_options(&gguf, opts)?;
    let (jobs, skipped) = plan(&gguf, &hp, requant)?;
    let tokenizer = hf_tokenizer::build(&gguf, &hp.name, hp.max_position_embeddings)?;

    let mut config = hp.config_json(&gguf, tokenizer.bos_id, &tokenizer.eos_ids);
    if let Some(q) = quantization_json(&jobs, requant) {
        let obj = config.as_object_mut().expect("config is an object");
        obj.insert("quantization".into(), q.clone());
        obj.insert("quantization_config".into(), q);
    }

    if out_dir.exists()
        && fs::read_dir(out_dir)
            .map_err(|e| Error::io(out_dir, e))?
            .next()
            .is_some()
    {
        return Err(Error::io(
            out_dir,
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "output directory exists and is not empty",
            ),
        ));
    }
    let staging = StagingDir::create(out_dir)?;
    let dir = staging.path.clone();

    let specs: Vec<TensorSpec> = jobs.iter().flat_map(Job::specs).collect();
    let n_tensors = specs.len();
    let mut writer = SafetensorsWriter::create(&dir.join("model.safetensors"), specs)?;
    for (done, job) in jobs.iter().enumerate() {
        for data in encode(&gguf, job)? {
            writer.write_next(&data)?;
        }
        on_progress(ConvertProgress {
            done: done + 1,
            total: jobs.len(),
            tensor: &job.hf_name,
        });
    }
    let mut bytes_written = writer.finish()?;

    let mut write = |name: &str, contents: &[u8]| -> Result<()> {
        let path = dir.join(name);
        fs::write(&path, contents).map_err(|e| Error::io(&path, e))?;
        bytes_written += contents.len() as u64;
        Ok(())
    };
    write("config.json", &pretty(&config))?;
    write(
        "tokenizer.json",
        &serde_json::to_vec(&tokenizer.tokenizer).expect("JSON value"),
    )?;
    write(
        "tokenizer_config.json",
        &pretty(&tokenizer.tokenizer_config),
    )?;
    write(
        "generation_config.json",
        &pretty(&tokenizer.generation_config),
    )?;
    if let Some(template) = &tokenizer.chat_template {
        write("chat_template.jinja", template.as_bytes())?;
    }
    staging.finish(out_dir)?;

    Ok(ConvertReport {
        out_dir: out_dir.to_path_buf(),
        architecture: hp.name.clone(),
        model_type: config["model_type"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        tensors: n_tensors,
        bytes_written,
        quantized_layers: jobs.iter().filter(|j| j.quantization().is_some()).count(),
        dequantized_tensors: jobs
            .iter()
            .filter(|j| float_type(j.info.ggml_type).is_none() && j.quantization().is_none())
            .count(),
        skipped,
    })
}

fn pretty(v: &Json) -> Vec<u8> {
    let mut s = serde_json::to_vec_pretty(v).expect("JSON value");
    s.push(b'\n');
    s
}

/// Validates `--q-bits` / `--q-group-size`; returns `(bits, group_size)` when re-quantizing.
fn check_options(gguf: &GgufFile, opts: &ConvertOptions) -> Result<Option<(u32, u32)>> {
    let bad = |message: String| Error::Unsupported {
        path: gguf.path.clone(),
        message,
    };
    match (opts.q_bits, opts.q_group_size) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(bad(
            "a quantization group size needs a bit width (--q-bits)".into(),
        )),
        (Some(bits), group) => {
            let group = group.unwrap_or(DEFAULT_GROUP_SIZE);
            if !SUPPORTED_BITS.contains(&bits) {
                return Err(bad(format!(
                    "{bits}-bit quantization (MLX supports {SUPPORTED_BITS:?})"
                )));
            }
            if !SUPPORTED_GROUP_SIZES.contains(&group) {
                return Err(bad(format!(
                    "quantization group size {group} (MLX supports {SUPPORTED_GROUP_SIZES:?})"
                )));
            }
            Ok(Some((bits, group)))
        }
    }
}

/// Decides the encoding of every tensor.
fn plan<'a>(
    gguf: &'a GgufFile,
    hp: &HParams,
    requant: Option<(u32, u32)>,
) -> Result<(Vec<Job<'a>>, Vec<String>)> {
    let mut jobs = Vec::new();
    let mut skipped = Vec::new();
    for info in &gguf.tensors {
        let Some(hf_name) = hp.arch.hf_name(&info.name) else {
            if info.name == ROPE_FREQS {
                // `HParams::from_gguf` turned it into `rope_scaling` or refused it.
                let how = match &hp.rope_scaling {
                    Some(_) => "written as the llama3 `rope_scaling`",
                    None => "all 1, no scaling",
                };
                skipped.push(format!("{}: llama.cpp's RoPE frequency factors, {how}", info.name));
                continue;
            }
            if ROPE_FACTORS.contains(&info.name.as_str()) {
                // `HParams::from_gguf` wrote them as the `longrope` `rope_scaling`, or refused them.
                skipped.push(format!("{}: LongRoPE factors, written as the `longrope` `rope_scaling`", info.name));
                continue;
            }
            return Err(Error::Unsupported {
                path: gguf.path.clone(),
                message: format!(
                    "tensor `{}` has no Hugging Face counterpart for `{}`",
                    info.name, hp.name
                ),
            });
        };
        hp.arch.check_bias(gguf, &info.name)?;
        let ty = info.ggml_type;
        let (_, cols) = info.rows_cols();
        let quantizable = is_quantizable(&hf_name, info.dims.len());
        let exact = quantizable && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
        let exact_bits = if ty == GgmlType::Q8_0 { 8 } else { 4 };
        let float_fallback = if is_norm(&hf_name) || info.dims.len() == 1 {
            FloatType::F32
        } else {
            FloatType::F16
        };

        let shift = if is_norm(&hf_name) { hp.arch.norm_shift() } else { 0.0 };
        let encoding = match requant {
            Some((bits, group)) if quantizable => {
                if exact && bits == exact_bits && group == 32 {
                    Encoding::AffineExact
                } else if cols % group as usize == 0 {
                    Encoding::Requantize {
                        bits,
                        group_size: group,
                    }
                } else {
                    skipped.push(format!("{}: {cols} columns are not a multiple of group size {group}; kept in float16", info.name));
                    Encoding::Float(FloatType::F16)
                }
            }
            _ if exact && requant.is_none() => Encoding::AffineExact,
            _ if shift != 0.0 => Encoding::Float(FloatType::F32),
            _ => match float_type(ty) {
                Some(_) => Encoding::Copy,
                None => Encoding::Float(float_fallback),
            },
        };
        let needs_dequant = !matches!(encoding, Encoding::Copy | Encoding::AffineExact);
        if needs_dequant && !can_dequantize(ty) {
            return Err(Error::Unsupported {
                path: gguf.path.clone(),
                message: format!(
                    "tensor `{}` has type {ty}, which the converter cannot dequantize",
                    info.name
                ),
            });
        }

        let unpermute_heads = if hp.arch.permuted_qk() {
            match hf_name.split('.').rev().nth(1) {
                Some("q_proj") => Some(hp.num_heads as usize),
                Some("k_proj") => Some(hp.num_kv_heads as usize),
                _ => None,
            }
        } else {
            None
        };
        if let Some(heads) = unpermute_heads {
            let rows = info.dims.get(1).or(info.dims.first()).copied().unwrap_or(0) as usize;
            if heads == 0 || !rows.is_multiple_of(2 * heads) {
                return Err(Error::invalid_file(
                    &gguf.path,
                    format!(
                        "tensor `{}`: {rows} rows cannot be split into {heads} heads of row pairs",
                        info.name
                    ),
                ));
            }
        }
        jobs.push(Job {
            info,
            hf_name,
            encoding,
            unpermute_heads,
            shift,
        });
    }
    if !jobs
        .iter()
        .any(|j| j.hf_name == "model.embed_tokens.weight")
    {
        return Err(Error::MissingTensor {
            path: gguf.path.clone(),
            tensor: "token_embd.weight".into(),
        });
    }
    Ok((jobs, skipped))
}

/// Row `r` of llama.cpp's permuted Q/K comes from row `source_row(r)` of the HF layout; this
/// is the inverse: HF row `r` is GGUF row `source_row(r, rows, heads)`.
///
/// llama.cpp: `w.reshape(heads, 2, rows/heads/2, cols).swapaxes(1, 2)`; undone by
/// `w.reshape(heads, rows/heads/2, 2, cols).swapaxes(1, 2)`.
pub fn unpermute_source_row(r: usize, rows: usize, heads: usize) -> usize {
    let per_head = rows / heads;
    let half = per_head / 2;
    let (h, within) = (r / per_head, r % per_head);
    let (pair, i) = (within / half, within % half);
    h * per_head + i * 2 + pair
}

/// The safetensors data of one job (one buffer per spec).
fn encode(gguf: &GgufFile, job: &Job) -> Result<Vec<Vec<u8>>> {
    let info = job.info;
    let data = gguf.tensor_data(info);
    let ty = info.ggml_type;
    // A 1-D tensor (a bias or a norm) permutes elements: one "row" per element.
    let (rows, cols) = if info.dims.len() == 1 {
        (info.dims[0] as usize, 1)
    } else {
        info.rows_cols()
    };
    let source_row = |r: usize| match job.unpermute_heads {
        Some(heads) => unpermute_source_row(r, rows, heads),
        None => r,
    };
    let bad_data = || {
        Error::invalid_file(
            &gguf.path,
            format!("tensor `{}`: cannot decode its {ty} data", info.name),
        )
    };

    match job.encoding {
        Encoding::Copy if cols % ty.block_size() == 0 => {
            let row_bytes = data.len() / rows.max(1);
            let mut out = Vec::with_capacity(data.len());
            for r in 0..rows {
                let s = source_row(r);
                out.extend_from_slice(&data[s * row_bytes..(s + 1) * row_bytes]);
            }
            Ok(vec![out])
        }
        Encoding::AffineExact => {
            let m = match ty {
                GgmlType::Q4_0 => AffineMatrix::from_q4_0(data, rows, cols),
                GgmlType::Q4_1 => AffineMatrix::from_q4_1(data, rows, cols),
                _ => AffineMatrix::from_q8_0(data, rows, cols),
            };
            let m = if job.unpermute_heads.is_some() {
                m.permute_rows(source_row)
            } else {
                m
            };
            Ok(affine_buffers(&m))
        }
        Encoding::Copy | Encoding::Float(_) | Encoding::Requantize { .. } => {
            let values = RowValues::new(data, ty, rows, cols).ok_or_else(bad_data)?;
            let mut row = vec![0f32; cols];
            match job.encoding {
                Encoding::Requantize { bits, group_size } => {
                    // Quantize in chunks of rows to bound memory.
                    const CHUNK: usize = 256;
                    let mut m: Option<AffineMatrix> = None;
                    let mut chunk = Vec::with_capacity(CHUNK.min(rows) * cols);
                    for r in 0..rows {
                        values.row(source_row(r), &mut row).ok_or_else(bad_data)?;
                        chunk.extend_from_slice(&row);
                        if chunk.len() == CHUNK * cols || r + 1 == rows {
                            let part = AffineMatrix::quantize(
                                &chunk,
                                chunk.len() / cols,
                                cols,
                                bits,
                                group_size as usize,
                            );
                            match &mut m {
                                Some(m) => m.append_rows(part),
                                None => m = Some(part),
                            }
                            chunk.clear();
                        }
                    }
                    Ok(affine_buffers(&m.ok_or_else(bad_data)?))
                }
                _ => {
                    let out_type = match job.encoding {
                        Encoding::Float(t) => t,
                        _ => float_type(ty).ok_or_else(bad_data)?,
                    };
                    let mut out = Vec::with_capacity(rows * cols * out_type.size() as usize);
                    for r in 0..rows {
                        values.row(source_row(r), &mut row).ok_or_else(bad_data)?;
                        if job.shift != 0.0 {
                            row.iter_mut().for_each(|v| *v -= job.shift);
                        }
                        out_type.encode(&row, &mut out);
                    }
                    Ok(vec![out])
                }
            }
        }
    }
}

/// Dequantized rows of a tensor; a tensor whose rows are not whole blocks is decoded at once.
struct RowValues<'a> {
    data: &'a [u8],
    ty: GgmlType,
    cols: usize,
    whole: Option<Vec<f32>>,
}

impl<'a> RowValues<'a> {
    fn new(data: &'a [u8], ty: GgmlType, rows: usize, cols: usize) -> Option<Self> {
        let whole = if !cols.is_multiple_of(ty.block_size()) {
            let mut all = vec![0f32; rows * cols];
            dequantize(ty, data, &mut all)?;
            Some(all)
        } else {
            None
        };
        Some(RowValues {
            data,
            ty,
            cols,
            whole,
        })
    }

    fn row(&self, r: usize, out: &mut [f32]) -> Option<()> {
        if let Some(all) = &self.whole {
            out.copy_from_slice(all.get(r * self.cols..(r + 1) * self.cols)?);
            return Some(());
        }
        let row_bytes = self.cols / self.ty.block_size() * self.ty.type_size();
        dequantize(
            self.ty,
            self.data.get(r * row_bytes..(r + 1) * row_bytes)?,
            out,
        )
    }
}

fn affine_buffers(m: &AffineMatrix) -> Vec<Vec<u8>> {
    let weight = m.weight.iter().flat_map(|w| w.to_le_bytes()).collect();
    let halves = |v: &[f16]| v.iter().flat_map(|h| h.to_le_bytes()).collect();
    vec![weight, halves(&m.scales), halves(&m.biases)]
}

/// mlx-lm's `quantization` block: the most common (or requested) setting, and per-module
/// entries for layers that differ from it.
fn quantization_json(jobs: &[Job], requant: Option<(u32, u32)>) -> Option<Json> {
    let layers: Vec<(&str, (u32, u32))> = jobs
        .iter()
        .filter_map(|j| Some((j.module(), j.quantization()?)))
        .collect();
    let mut counts: BTreeMap<(u32, u32), usize> = BTreeMap::new();
    for (_, q) in &layers {
        *counts.entry(*q).or_default() += 1;
    }
    let default = requant.or_else(|| counts.iter().max_by_key(|(_, &n)| n).map(|(&q, _)| q))?;
    let entry = |(bits, group_size): (u32, u32)| json!({"group_size": group_size, "bits": bits, "mode": "affine"});
    let mut q = entry(default).as_object().cloned().unwrap_or_else(Map::new);
    for (module, setting) in layers {
        if setting != default {
            q.insert(module.to_string(), entry(setting));
        }
    }
    Some(Json::Object(q))
}

/// A temporary sibling of the output directory, removed unless [`StagingDir::finish`] renames it.
struct StagingDir {
    path: PathBuf,
    done: bool,
}

impl StagingDir {
    fn create(out_dir: &Path) -> Result<Self> {
        let name = out_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model");
        let parent = out_dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let path = parent.join(format!(".{name}.partial-{}", std::process::id()));
        if path.exists() {
            fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        }
        fs::create_dir(&path).map_err(|e| Error::io(&path, e))?;
        Ok(StagingDir { path, done: false })
    }

    fn finish(mut self, out_dir: &Path) -> Result<()> {
        if out_dir.exists() {
            // Checked empty above; `rename` cannot replace a directory on every platform.
            fs::remove_dir(out_dir).map_err(|e| Error::io(out_dir, e))?;
        }
        fs::rename(&self.path, out_dir).map_err(|e| Error::io(out_dir, e))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}
