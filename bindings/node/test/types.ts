// Compile-only check of index.d.ts (npm run typecheck); never run.
import { loadModel, Model, Chunk, ContentPart, GenerateOptions, LoadOptions, Message, ModelInfo, MlxcelError, FinishReason, Speculation, generationDefaults, loadEmbedder, Embedder, LoadEmbedderOptions, loadReranker, Reranker, loadTranscriber, Transcriber, Transcription, TranscribeOptions, Segment } from '..'

async function main(): Promise<void> {
  const model: Model = await loadModel()
  const other: Model = await loadModel('/path/to/model')
  const quiet: Model = await loadModel({ progress: false })
  const quietToo: Model = await loadModel(undefined, { progress: false })
  const loadOptions: LoadOptions = { progress: true, draftModel: '/path/to/draft' }
  const info: ModelInfo = model.info
  const layers: number = info.numLayers
  const context: number | undefined = info.contextLength
  const ids: number[] = model.tokenize('hi', { addSpecialTokens: false })
  const text: string = model.detokenize(ids) + model.detokenize(new Uint32Array(ids), { skipSpecialTokens: true })
  const messages: Message[] = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hi' }]
  const rendered: string = model.applyChatTemplate(messages, { addGenerationPrompt: true })
  const parts: ContentPart[] = [{ type: 'image', path: 'a.png' }, { type: 'image', data: Buffer.from([]) }, { type: 'image', data: new Uint8Array(0) }, { type: 'text', text: 'Hi' }]
  const withImages: Message[] = [{ role: 'user', content: parts }]
  const takesImages: boolean = model.supportsImages
  if (takesImages) await model.chat(withImages)
  const controller = new AbortController()
  const opts: GenerateOptions = {
    maxTokens: 8, temperature: 0.7, topP: 0.9, topK: 40, minP: 0.05,
    repetitionPenalty: 1.1, repetitionContextSize: 20, seed: 1, stop: ['\n'], signal: controller.signal, prefillChunk: 32,
  }
  const out: string = await model.generate('Hello', opts)
  const fromIds: string = await model.generate(ids, { stop: '.' })
  const method: Speculation = generationDefaults.speculation
  const speculated: string = await model.generate('Hello', { speculation: 'prompt-lookup', draftMax: 6, draftMin: 1 })
  const constrained: string = await model.generate('Hello', { jsonSchema: { type: 'object' } })
  const matched: string = await model.chat(messages, { jsonSchema: '{"type":"string"}', regex: undefined }) + (await model.generate('Hi', { grammar: 'start: "a"' }))
  const reply: string = await model.chat(messages, opts)
  for await (const chunk of model.stream('Hello', opts)) {
    const piece: string = chunk.text
    const token: number | null = chunk.token
    const reason: FinishReason | null = chunk.finishReason
    if (chunk.stats) console.log(chunk.stats.promptTokens, chunk.stats.decodeMs, chunk.stats.draftTokens, chunk.stats.acceptedTokens, chunk.stats.maskMs)
  }
  for await (const chunk of model.chatStream(messages)) {
    const c: Chunk = chunk
  }
  try {
    await model.generate('x', { temperature: -1 })
  } catch (e) {
    const error = e as MlxcelError
    if (error.code === 'INVALID_PARAMETER') console.log(error.param)
  }
  // @ts-expect-error: maxTokens is a number
  await model.generate('x', { maxTokens: '8' })
  // @ts-expect-error: unknown option
  await model.generate('x', { max_tokens: 8 })
  // @ts-expect-error: not a speculation method
  await model.generate('x', { speculation: 'lookup' })
  // @ts-expect-error: a regex is a string
  await model.generate('x', { regex: /a/ })
  // @ts-expect-error: Model is made by loadModel()
  new Model()

  const embedder: Embedder = await loadEmbedder()
  const named: Embedder = await loadEmbedder('all-MiniLM-L6-v2', { progress: false })
  const quietEmbedder: Embedder = await loadEmbedder({ progress: false })
  const embedderOptions: LoadEmbedderOptions = { progress: true }
  const dims: number = embedder.dims + embedder.maxTokens
  const vectors: Float32Array[] = await embedder.embed(['a', 'b'])
  const now: Float32Array[] = named.embedSync(['a'])
  // @ts-expect-error: embed takes an array of strings
  await embedder.embed('a')
  // @ts-expect-error: unknown option
  await loadEmbedder({ quiet: true })
  // @ts-expect-error: Embedder is made by loadEmbedder()
  new Embedder()
  const where: string = embedder.path
  const reranker: Reranker = await loadReranker('/some/cross-encoder', { progress: false })
  const scores: number[] = await reranker.rerank('q', ['a', 'b'])
  const pairTokens: number = reranker.maxTokens
  // @ts-expect-error: a reranker needs a path
  await loadReranker()
  // @ts-expect-error: documents are an array
  await reranker.rerank('q', 'a')
  void [quietEmbedder, embedderOptions, dims, vectors, now, where, scores, pairTokens]
  const transcriber: Transcriber = await loadTranscriber()
  const base: Transcriber = await loadTranscriber('whisper-base', { progress: false })
  const whisperOptions: TranscribeOptions = { language: 'de', task: 'translate', temperature: [0, 0.2], bestOf: 5, noSpeechThreshold: null }
  const heard: Transcription = await transcriber.transcribe('clip.flac', whisperOptions)
  const fromSamples: Transcription = await base.transcribe(new Float32Array(16000), { temperature: 0 })
  const fromBytes: Transcription = await base.transcribe(Buffer.from([1, 2]))
  const segment: Segment = heard.segments[0]
  const spoken: string = heard.text + segment.text + heard.language + fromSamples.task + fromBytes.duration
  const multilingual: boolean = base.isMultilingual && base.languages.length > 0
  // @ts-expect-error: audio is a path, bytes or samples
  await transcriber.transcribe(42)
  // @ts-expect-error: task is transcribe or translate
  await transcriber.transcribe('a.wav', { task: 'summarize' })
  void [spoken, multilingual]
  void [other, loadOptions, layers, context, text, rendered, out, fromIds, reply, method, speculated, constrained, matched]
}
void main
