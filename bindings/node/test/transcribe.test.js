// Speech to text from Node: loadTranscriber(...).transcribe is a translation
// of the engine's Whisper Transcriber, on the packaged whisper-tiny.en and the
// Whisper test clips (tests/fixtures/audio; their faster-whisper texts are in
// tests/reference/goldens/whisper_tiny.en.json).
'use strict'

const { test, before, describe } = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')
const { loadTranscriber, Transcriber } = require('..')

const CLIPS = path.join(__dirname, '..', '..', '..', 'tests', 'fixtures', 'audio')
const FOX = ' The quick brown fox jump over the lazy nog.'
const WAV = ' This file is a plain 16 bit frame file.'

async function rejectsWith(promise, code, param) {
  await assert.rejects(promise, (error) => {
    assert.ok(error instanceof Error, `expected an Error, got ${error}`)
    assert.equal(error.code, code, `${error.name}: ${error.message}`)
    if (param) assert.equal(error.param, param, error.message)
    return true
  })
}

// The samples of a 16-bit PCM mono WAV file, as int16 / 32768.
function wavSamples(file) {
  const data = fs.readFileSync(file)
  let at = 12
  while (at + 8 <= data.length) {
    const size = data.readUInt32LE(at + 4)
    if (data.toString('latin1', at, at + 4) === 'data') {
      const samples = new Float32Array(size / 2)
      for (let i = 0; i < samples.length; i++) samples[i] = data.readInt16LE(at + 8 + 2 * i) / 32768
      return samples
    }
    at += 8 + size + (size & 1)
  }
  throw new Error(`${file}: no data chunk`)
}

describe('transcribe', () => {
  let transcriber

  before(async () => {
    transcriber = await loadTranscriber({ progress: false })
  })

  test('loadTranscriber() loads whisper-tiny.en', () => {
    assert.ok(transcriber instanceof Transcriber)
    assert.equal(transcriber.isMultilingual, false)
    assert.deepEqual([...transcriber.languages], [])
    assert.ok(fs.existsSync(transcriber.path))
    assert.throws(() => new Transcriber({}), { code: 'INVALID_ARGUMENT' })
  })

  test('a file by its path', async () => {
    const result = await transcriber.transcribe(path.join(CLIPS, 'en_fox_us.flac'))
    assert.equal(result.text, FOX)
    assert.equal(result.task, 'transcribe')
    assert.equal(result.language, 'en')
    assert.equal(result.languageProbability, 1)
    assert.ok(Math.abs(result.duration - 2.909) < 1e-3)
    assert.equal(result.segments.length, 1)
    const [segment] = result.segments
    assert.deepEqual(Object.keys(segment).sort(), [
      'avgLogprob', 'compressionRatio', 'end', 'id', 'noSpeechProb', 'seek', 'start', 'temperature', 'text', 'tokens',
    ])
    assert.equal(segment.id, 0)
    assert.equal(segment.start, 0)
    assert.ok(segment.end > 2 && segment.end <= 3)
    assert.equal(segment.text, FOX)
    assert.equal(segment.tokens[0], 50363)
    assert.equal(segment.temperature, 0)
    assert.equal(result.code, undefined)
  })

  test('bytes and samples', async () => {
    const bytes = fs.readFileSync(path.join(CLIPS, 'en_fox_us.flac'))
    assert.equal((await transcriber.transcribe(bytes)).text, FOX)
    assert.equal((await transcriber.transcribe(new Uint8Array(bytes))).text, FOX)
    const samples = wavSamples(path.join(CLIPS, 'en_mono_16k.wav'))
    assert.equal(samples.length, 45728)
    const fromSamples = await transcriber.transcribe(samples)
    assert.equal(fromSamples.text, WAV)
    assert.ok(Math.abs(fromSamples.duration - 2.858) < 1e-9)
    assert.deepEqual(await transcriber.transcribe(path.join(CLIPS, 'en_mono_16k.wav')), fromSamples)
    const textOnly = await transcriber.transcribe(samples, { temperature: 0, withoutTimestamps: true, language: 'en' })
    assert.equal(textOnly.text, WAV)
    assert.notEqual(textOnly.segments[0].tokens[0], 50363)
    const noThresholds = await transcriber.transcribe(samples, { temperature: [0, 0.5], noSpeechThreshold: null, compressionRatioThreshold: null })
    assert.equal(noThresholds.text, WAV)
  })

  test('two transcriptions at once on one transcriber', async () => {
    const [a, b] = await Promise.all([
      transcriber.transcribe(path.join(CLIPS, 'en_fox_us.flac')),
      transcriber.transcribe(wavSamples(path.join(CLIPS, 'en_mono_16k.wav'))),
    ])
    assert.equal(a.text, FOX)
    assert.equal(b.text, WAV)
  })

  test('bad input', async () => {
    await rejectsWith(transcriber.transcribe(path.join(CLIPS, 'no_such_clip.flac')), 'INVALID_PARAMETER', 'audio')
    await rejectsWith(transcriber.transcribe(Buffer.from('this is not audio at all')), 'INVALID_PARAMETER', 'audio')
    await rejectsWith(transcriber.transcribe(new Float32Array(0)), 'INVALID_PARAMETER', 'audio')
    await rejectsWith(transcriber.transcribe(new Float32Array([0, NaN])), 'INVALID_PARAMETER', 'audio')
    const quiet = new Float32Array(1600)
    for (const [options, param] of [
      [{ task: 'summarize' }, 'task'],
      [{ task: 'translate' }, 'task'],
      [{ language: 'de' }, 'language'],
      [{ temperature: 3 }, 'temperatures'],
      [{ temperature: [] }, 'temperatures'],
      [{ bestOf: 0 }, 'bestOf'],
      [{ maxInitialTimestamp: 31 }, 'maxInitialTimestamp'],
    ]) {
      await rejectsWith(transcriber.transcribe(quiet, options), 'INVALID_PARAMETER', param)
    }
    await rejectsWith(transcriber.transcribe(42), 'INVALID_ARGUMENT')
    await rejectsWith(transcriber.transcribe([0, 0.1]), 'INVALID_ARGUMENT')
    await rejectsWith(transcriber.transcribe(quiet, { temperature: 'hot' }), 'INVALID_ARGUMENT')
    await rejectsWith(transcriber.transcribe(quiet, { bestOf: -1 }), 'INVALID_ARGUMENT')
    await rejectsWith(transcriber.transcribe(quiet, { beamSize: 5 }), 'INVALID_ARGUMENT')
    await rejectsWith(transcriber.transcribe(quiet, { noSpeechThreshold: NaN }), 'INVALID_ARGUMENT')
    await rejectsWith(loadTranscriber('/nonexistent/mlxcel-whisper', { progress: false }), 'MODEL_LOAD')
    await rejectsWith(loadTranscriber(42), 'INVALID_ARGUMENT')
  })
})
