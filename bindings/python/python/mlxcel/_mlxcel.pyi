"""Type stubs for the mlxcel._mlxcel extension (re-exported by ``mlxcel``)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple, TypedDict, Union

__version__: str
#: The pinned MLX version the extension was built against.
MLX_VERSION: str

#: An OpenAI-style chat message, e.g. ``{"role": "user", "content": "Hi"}``.
#: A chat message: ``{"role": ..., "content": ...}``, content a str or a list
#: of parts: ``{"type": "text", "text": str}``, ``{"type": "image", "path": str}``,
#: ``{"type": "image", "data": bytes}`` (a whole image file) or OpenAI's
#: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.
Message = Mapping[str, Any]
#: Text, or token ids used as they are.
PromptLike = Union[str, Sequence[int]]
Stop = Union[str, Sequence[str], None]

def generation_defaults() -> dict:
    """The engine's default of every generation keyword argument and of
    ``prefill_chunk``: what an omitted argument means, the same in C and Node."""

def default_model_path(*, progress: bool = True) -> pathlib.Path:
    """The default model's directory, fetched and converted on first use
    (reporting on ``sys.stderr`` unless ``progress=False``)."""

class Chunk:
    """One piece of streamed text.

    ``finish_reason`` is None on every chunk but the last one, which has empty
    ``text``, ``token`` None and ``finish_reason`` "stop" (EOS or a stop
    string), "length" (max_tokens) or "cancelled".
    """

    @property
    def text(self) -> str: ...
    @property
    def token(self) -> Optional[int]:
        """The token that completed this text (None on the last chunk)."""
    @property
    def finish_reason(self) -> Optional[str]: ...
    @property
    def logprobs(self) -> List[TokenLogprob]:
        """The logprobs of the tokens since the previous chunk, with
        ``logprobs=N`` (empty otherwise)."""

class TokenLogprob:
    """A generated token's log-probability and its most likely
    alternatives, most likely first. By default from the model's own
    distribution; with ``post_sampling_probs=True`` from the distribution the
    token was drawn from (after penalties, filters and temperature)."""

    @property
    def token(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top_logprobs(self) -> List[Tuple[int, float]]: ...

class Stream(Iterator[Chunk]):
    """Chunks of a generation (a row of the engine's scheduler).

    Closing it (``close()``, leaving a ``with`` block, or dropping it) cancels
    the generation. Ctrl-C while waiting for a chunk cancels it and raises
    KeyboardInterrupt.
    """

    def __iter__(self) -> Stream: ...
    def __next__(self) -> Chunk: ...
    def close(self) -> None:
        """Cancels the generation; iteration then ends. Safe from any thread."""
    def __enter__(self) -> Stream: ...
    def __exit__(self, *args: object) -> bool: ...
    @property
    def finish_reason(self) -> Optional[str]:
        """"stop", "length" or "cancelled" once the stream has ended, else None."""
    @property
    def text(self) -> Optional[str]:
        """The whole generated text once the stream has ended, else None."""
    @property
    def tokens(self) -> Optional[List[int]]:
        """All generated token ids once the stream has ended, else None."""
    @property
    def logprobs(self) -> Optional[List[TokenLogprob]]:
        """Every generated token's logprobs once the stream has ended (with
        ``logprobs=N``), else None."""
    @property
    def stats(self) -> Optional[dict[str, Union[int, float]]]:
        """prompt_tokens, generated_tokens, time_to_first_token (s),
        prompt_tokens_per_second, decode_tokens_per_second, kv_cache_bytes
        (this run's KV cache), process_peak_memory_bytes (process-wide: MLX's
        high-water mark over every run in the process, never reset by a run,
        plus the weights the kernels keep in their own memory on the CPU),
        cached_tokens (prompt tokens taken from the prefix cache),
        draft_tokens and accepted_tokens (speculative decoding's draft tokens
        proposed and accepted; 0 without it), mask_time (s; structured
        output's time computing token masks, 0 without a constraint); None
        until the stream has ended."""

class ModelInfo:
    """What a checkpoint is: architecture, size and quantization."""

    @property
    def architecture(self) -> str:
        """The config's ``model_type``, e.g. "llama"."""
    @property
    def parameters(self) -> int: ...
    @property
    def bytes(self) -> int:
        """Bytes of weights as stored (quantized or not)."""
    @property
    def quantization(self) -> Optional[dict[str, int]]:
        """``{"bits": ..., "group_size": ...}`` of the quantization that covers
        most parameters; None for an unquantized model."""
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def context_length(self) -> Optional[int]: ...
    @property
    def dtype(self) -> str:
        """The compute dtype, e.g. "float16"."""
    @property
    def tokenizer(self) -> str:
        """The tokenizer's kind, e.g. "BPE (byte-level)"."""
    @property
    def groups(self) -> List[dict[str, Any]]:
        """Per module group: name, count, quantization, dtype, parameters."""
    def to_dict(self) -> dict[str, Any]: ...

class Model:
    """A loaded model. One Model may be used from several threads at once;
    every call releases the GIL while MLX works."""

    def __init__(
        self,
        path: Union[str, os.PathLike[str], None] = None,
        *,
        prefill_chunk: Optional[int] = None,
        progress: bool = True,
        kv_pool_bytes: Optional[int] = None,
        max_kv_size: Optional[int] = None,
        kv_keep: Optional[int] = None,
        kv_bits: Optional[int] = None,
        draft_model: Union[str, os.PathLike[str], None] = None,
        q_bits: Optional[int] = None,
        q_group_size: Optional[int] = None,
    ) -> None:
        """Loads a model directory (MLX / Hugging Face layout).

        ``None`` loads the default model, SmolLM2-135M-Instruct, fetched and
        converted into ``~/.cache/mlxcel`` on first use; that first fetch reports
        its steps on ``sys.stderr`` unless ``progress=False``. ``prefill_chunk`` is
        the number of prompt tokens per forward pass (None: the engine's default,
        512): small values let ``Stream.close()`` stop a long prompt sooner.
        ``kv_pool_bytes`` is the byte budget of the KV pool every generation's
        keys and values share (None: 1 GiB; at least 1 MiB; only blocks in use
        are resident): a generation that does not fit beside the running ones
        waits, one whose prompt plus ``max_tokens`` exceeds the whole pool raises
        InvalidParameter naming ``max_tokens``. ``max_kv_size`` makes every
        generation's KV cache a rotating one of that many positions (mlx-lm's
        ``--max-kv-size``): each token attends to the first ``kv_keep`` positions
        (default 4) and the latest ``max_kv_size - kv_keep``, and a generation
        holds only those however long it runs. ``kv_bits=8`` keeps keys and
        values in 8 bits (mlx-lm's ``--kv-bits 8``, group 64): 3.6 times more
        positions in the same pool. Both need a quantized checkpoint on the CPU
        (the paged KV pool); 8 bits also a head size that is a multiple of 64.
        ``draft_model`` loads a second, smaller checkpoint with the same
        tokenizer that drafts tokens for ``speculation="draft"``.
        ``q_bits`` (2, 3, 4, 5, 6 or 8) quantizes a dense (f32/f16/bf16)
        checkpoint as it loads, in groups of ``q_group_size`` (32, 64 or 128;
        None: 64), bit-identically to ``mlx_lm.convert -q``; nothing is written.

        Raises ModelLoadError (also for the draft model, and for ``q_bits`` on
        an already quantized checkpoint), or InvalidParameter for a bad
        ``prefill_chunk``, ``kv_pool_bytes``, ``max_kv_size``, ``kv_keep``,
        ``kv_bits``, ``q_bits`` or ``q_group_size``, or a ``draft_model`` with
        another tokenizer.
        """
    def generate(
        self,
        prompt: PromptLike,
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: Optional[int] = None,
        seed: Optional[int] = None,
        stop: Stop = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        dry_multiplier: Optional[float] = None,
        dry_base: Optional[float] = None,
        dry_allowed_length: Optional[int] = None,
        dry_penalty_last_n: Optional[int] = None,
        dry_sequence_breakers: Optional[Sequence[str]] = None,
        top_n_sigma: Optional[float] = None,
        typical_p: Optional[float] = None,
        xtc_probability: Optional[float] = None,
        xtc_threshold: Optional[float] = None,
        min_keep: Optional[int] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        samplers: Union[str, Sequence[str], None] = None,
        logprobs: Optional[int] = None,
        post_sampling_probs: Optional[bool] = None,
        speculation: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        json_schema: Union[str, dict[str, Any], None] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> str:
        """Generates a continuation of ``prompt``.

        An omitted (or None) argument takes the engine's default, listed by
        ``mlxcel.generation_defaults()`` (greedy, 256 tokens, no filters).
        temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and
        repetition_penalty 1 turn those filters off. ``seed`` makes sampling
        reproducible. Generation stops at EOS, ``max_tokens``, or before the
        first occurrence of a ``stop`` string.

        The sampler chain's options are llama-server's, with its defaults
        (all off): ``frequency_penalty`` and ``presence_penalty`` (over the
        last ``repetition_context_size`` tokens), DRY (``dry_multiplier``,
        ``dry_base`` 1.75, ``dry_allowed_length`` 2, ``dry_penalty_last_n``
        -1 = the whole history, ``dry_sequence_breakers`` ``["\\n", ":",
        "\"", "*"]``), ``top_n_sigma``, ``typical_p``, XTC
        (``xtc_probability``, ``xtc_threshold`` 0.1), ``min_keep``,
        ``logit_bias`` ({token id: bias}, ``-math.inf`` bans a token), and
        ``samplers``: the stages in order (default ``penalties;dry;
        top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature``). Greedy and
        plain temperature sampling run on the device; any filter or chain
        option runs llama.cpp's sampler chain on the host.

        ``logprobs=N`` (0-20) reports each token's log-probability and its N
        most likely alternatives on the stream's chunks and its ``logprobs``
        (``post_sampling_probs=True``: from the distribution the token was
        drawn from instead of the model's).

        ``speculation`` decodes speculatively: ``"prompt-lookup"`` drafts
        tokens from n-gram matches in the prompt and output, ``"draft"`` from
        the ``draft_model`` given to ``load``; ``"off"`` (the default) does
        not. The model checks each draft of up to ``draft_max`` tokens (1-14,
        default 8; shorter than ``draft_min``, default 0, are not checked) in
        one forward pass, and the tokens are those of plain decoding, greedy
        or seeded (with a draft model at a temperature > 0, the same
        distribution instead). ``Stream.stats`` counts the draft tokens.

        Structured output, at most one of: ``json_schema`` (a JSON schema, as
        its text or a dict; the output is compact JSON that validates against
        it), ``regex`` (a regular expression the whole output matches) or
        ``grammar`` (a Lark grammar, llguidance's dialect). Every token is
        masked to those the constraint allows; one that does not compile
        raises InvalidParameter naming it.

        Raises InvalidParameter (bad values, empty or too long prompt),
        TypeError (wrong types), GenerationError, KeyboardInterrupt.
        """
    def generate_batch(
        self,
        prompts: Sequence[PromptLike],
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: Optional[int] = None,
        seed: Optional[int] = None,
        stop: Stop = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        dry_multiplier: Optional[float] = None,
        dry_base: Optional[float] = None,
        dry_allowed_length: Optional[int] = None,
        dry_penalty_last_n: Optional[int] = None,
        dry_sequence_breakers: Optional[Sequence[str]] = None,
        top_n_sigma: Optional[float] = None,
        typical_p: Optional[float] = None,
        xtc_probability: Optional[float] = None,
        xtc_threshold: Optional[float] = None,
        min_keep: Optional[int] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        samplers: Union[str, Sequence[str], None] = None,
        logprobs: Optional[int] = None,
        post_sampling_probs: Optional[bool] = None,
        speculation: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        json_schema: Union[str, dict[str, Any], None] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> List[str]:
        """Generates a continuation of every prompt as one batch (the model
        decodes all of them in each forward pass); the texts come back in
        order, each exactly what ``generate`` returns for it alone. Raises
        like ``generate`` on the first prompt that fails.
        """
    def stream(
        self,
        prompt: PromptLike,
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: Optional[int] = None,
        seed: Optional[int] = None,
        stop: Stop = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        dry_multiplier: Optional[float] = None,
        dry_base: Optional[float] = None,
        dry_allowed_length: Optional[int] = None,
        dry_penalty_last_n: Optional[int] = None,
        dry_sequence_breakers: Optional[Sequence[str]] = None,
        top_n_sigma: Optional[float] = None,
        typical_p: Optional[float] = None,
        xtc_probability: Optional[float] = None,
        xtc_threshold: Optional[float] = None,
        min_keep: Optional[int] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        samplers: Union[str, Sequence[str], None] = None,
        logprobs: Optional[int] = None,
        post_sampling_probs: Optional[bool] = None,
        speculation: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        json_schema: Union[str, dict[str, Any], None] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> Stream:
        """Like ``generate``, yielding Chunks as the text is generated."""
    def chat(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: Optional[int] = None,
        seed: Optional[int] = None,
        stop: Stop = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        dry_multiplier: Optional[float] = None,
        dry_base: Optional[float] = None,
        dry_allowed_length: Optional[int] = None,
        dry_penalty_last_n: Optional[int] = None,
        dry_sequence_breakers: Optional[Sequence[str]] = None,
        top_n_sigma: Optional[float] = None,
        typical_p: Optional[float] = None,
        xtc_probability: Optional[float] = None,
        xtc_threshold: Optional[float] = None,
        min_keep: Optional[int] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        samplers: Union[str, Sequence[str], None] = None,
        logprobs: Optional[int] = None,
        post_sampling_probs: Optional[bool] = None,
        speculation: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        json_schema: Union[str, dict[str, Any], None] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> str:
        """The assistant's reply to ``messages``, rendered with the model's
        chat template (with the generation prompt)."""
    def chat_stream(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        repetition_context_size: Optional[int] = None,
        seed: Optional[int] = None,
        stop: Stop = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        dry_multiplier: Optional[float] = None,
        dry_base: Optional[float] = None,
        dry_allowed_length: Optional[int] = None,
        dry_penalty_last_n: Optional[int] = None,
        dry_sequence_breakers: Optional[Sequence[str]] = None,
        top_n_sigma: Optional[float] = None,
        typical_p: Optional[float] = None,
        xtc_probability: Optional[float] = None,
        xtc_threshold: Optional[float] = None,
        min_keep: Optional[int] = None,
        logit_bias: Optional[Mapping[int, float]] = None,
        samplers: Union[str, Sequence[str], None] = None,
        logprobs: Optional[int] = None,
        post_sampling_probs: Optional[bool] = None,
        speculation: Optional[str] = None,
        draft_max: Optional[int] = None,
        draft_min: Optional[int] = None,
        json_schema: Union[str, dict[str, Any], None] = None,
        regex: Optional[str] = None,
        grammar: Optional[str] = None,
    ) -> Stream:
        """Like ``chat``, yielding Chunks."""
    def tokenize(self, text: str, add_special_tokens: bool = True) -> List[int]: ...
    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str: ...
    @property
    def supports_images(self) -> bool:
        """Whether chat messages may hold image parts (a vision-language model)."""
    @property
    def info(self) -> ModelInfo: ...
    @property
    def path(self) -> pathlib.Path:
        """The checkpoint directory."""
    @property
    def eos_token_ids(self) -> List[int]: ...
    @property
    def prefill_chunk(self) -> int: ...

class Embedder:
    """A loaded sentence-embedding model. One Embedder may be used from
    several threads at once; ``embed`` releases the GIL, and a text's vector
    is the same whatever it is embedded with."""

    def __init__(self, path: Union[str, os.PathLike[str], None] = None, *, progress: bool = True) -> None:
        """Loads a sentence-transformers checkpoint directory, or a packaged
        model by name; None loads all-MiniLM-L6-v2 (fetched on first use,
        reported on ``sys.stderr`` when ``progress``). Raises
        ``ModelLoadError`` (a language model's directory included)."""
    def embed(self, texts: Union[str, Sequence[str]]) -> Any:
        """One vector per text: a float32 ``numpy.ndarray`` of shape
        ``(len(texts), dims)`` when NumPy is installed, else a list of lists
        of float. A single str gives one vector. No texts (or more than
        4096) raises ``InvalidParameter`` (``name`` "input")."""
    def token_counts(self, texts: Sequence[str]) -> List[int]:
        """Tokens each text runs as (special tokens included, after truncation)."""
    @property
    def dims(self) -> int: ...
    @property
    def max_tokens(self) -> int:
        """Tokens a text keeps; longer texts are truncated (special tokens kept)."""
    @property
    def path(self) -> pathlib.Path: ...

class Reranker:
    """A loaded cross-encoder (``*ForSequenceClassification`` with one
    label). One Reranker may be used from several threads at once; a pair's
    score is the same whatever it is scored with."""

    def __init__(self, path: Union[str, os.PathLike[str]], *, progress: bool = True) -> None: ...
    def rerank(self, query: str, documents: Sequence[str]) -> List[float]:
        """One relevance score per document, in order: the classifier's raw
        logit (higher is more relevant). No documents raises
        ``InvalidParameter`` (``name`` "documents")."""
    @property
    def max_tokens(self) -> int: ...
    @property
    def path(self) -> pathlib.Path: ...

class Segment(TypedDict):
    """One stretch of speech in ``Transcriber.transcribe``'s result."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: List[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float

class Transcription(TypedDict):
    """What ``Transcriber.transcribe`` returns (a plain dict)."""

    task: str
    text: str
    language: str
    language_probability: float
    duration: float
    segments: List[Segment]

class Transcriber:
    """A loaded Whisper model (speech to text). One Transcriber may be used
    from several threads at once; ``transcribe`` releases the GIL, and a
    transcription never depends on what runs beside it."""

    def __init__(self, path: Union[str, os.PathLike[str], None] = None, *, progress: bool = True) -> None:
        """Loads a Whisper checkpoint directory (mlx-whisper's layout), or a
        packaged model by name ("whisper-tiny.en", "whisper-base"); None
        loads whisper-tiny.en (fetched and converted on first use, reported
        on ``sys.stderr`` when ``progress``). Raises ``ModelLoadError``."""
    def transcribe(
        self,
        audio: Union[str, os.PathLike[str], bytes, bytearray, memoryview, Sequence[float], Any],
        *,
        language: Optional[str] = None,
        task: str = "transcribe",
        temperature: Union[float, Sequence[float], None] = None,
        best_of: int = 5,
        initial_prompt: Optional[str] = None,
        condition_on_previous_text: bool = True,
        without_timestamps: bool = False,
        compression_ratio_threshold: Optional[float] = 2.4,
        log_prob_threshold: Optional[float] = -1.0,
        no_speech_threshold: Optional[float] = 0.6,
        prompt_reset_on_temperature: float = 0.5,
        max_initial_timestamp: float = 1.0,
        suppress_blank: bool = True,
        seed: int = 0,
    ) -> Transcription:
        """Transcribes (``task="translate"``: translates to English) ``audio``:
        a path, an audio file's bytes (WAV, FLAC, MP3, Ogg Vorbis; any rate
        and channels), or mono samples in [-1, 1] at 16 kHz (a 1-D NumPy
        array, cast to float32, or a list of float). The defaults are the
        engine's (faster-whisper's with beam_size=1); ``temperature`` None is
        the fallback list 0, 0.2, ..., 1.0; a threshold of None is off.
        Bad audio or an option out of range raises ``InvalidParameter``
        (``name`` "audio", "language", "task", "temperatures", ...)."""
    def detect_language(self, audio: Union[str, os.PathLike[str], bytes, Sequence[float], Any]) -> List[Tuple[str, float]]:
        """(code, probability) pairs for the first 30 seconds, most likely
        first. English-only models raise ``InvalidParameter``."""
    @property
    def is_multilingual(self) -> bool: ...
    @property
    def languages(self) -> List[str]: ...
    @property
    def path(self) -> pathlib.Path: ...

def _matmul_seconds(n: int = 1024) -> float: ...
def _stop_engines(timeout: float = 10.0) -> bool:
    """Stops every engine's scheduler thread (registered with atexit)."""

