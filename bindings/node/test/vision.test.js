// Chat messages with image parts from Node on the tiny random SmolVLM
// (mlxcel-models/tests/data/tiny/smolvlm): `{ type: 'image', path }` and
// `{ type: 'image', data: Buffer }` give mlx-vlm's greedy tokens
// (golden.json); bad images and images for a text-only model reject with
// code INVALID_PARAMETER and param `images`.
'use strict'

const { test, before } = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const path = require('node:path')
const { loadModel } = require('..')

const DIR = path.join(__dirname, '..', '..', '..', 'mlxcel-models', 'tests', 'data', 'tiny', 'smolvlm')
const GOLDEN = JSON.parse(fs.readFileSync(path.join(DIR, 'golden.json'), 'utf8'))
const WANT = GOLDEN.cases[0].greedy_tokens
const PNG_PATH = path.join(DIR, 'images', 'landscape.png')
const PNG = fs.readFileSync(PNG_PATH)
const TEXT = { type: 'text', text: 'Describe this image.' }

let vlm
before(async () => {
  vlm = await loadModel(DIR)
})

const reply = (content) => vlm.chat([{ role: 'user', content }], { maxTokens: WANT.length, temperature: 0 })

async function rejectsWith(promise, code, param, needle) {
  await assert.rejects(promise, (error) => {
    assert.equal(error.code, code, `${error.name}: ${error.message}`)
    if (param) assert.equal(error.param, param, error.message)
    if (needle) assert.ok(error.message.includes(needle), error.message)
    return true
  })
}

test('image parts give the reference tokens', async () => {
  assert.equal(vlm.supportsImages, true)
  // chat() text skips special tokens (the tiny model's <row_i_col_j> among them).
  const want = vlm.detokenize(WANT, { skipSpecialTokens: true })
  assert.equal(await reply([{ type: 'image', path: PNG_PATH }, TEXT]), want)
  assert.equal(await reply([{ type: 'image', data: PNG }, TEXT]), want)
  assert.equal(await reply([{ type: 'image', data: new Uint8Array(PNG) }, TEXT]), want)
  const two = GOLDEN.cases[1]
  const images = two.images.slice()
  const content = two.messages[0].content.map((p) => (p.type === 'image' ? { type: 'image', path: path.join(DIR, images.shift()) } : p))
  assert.equal(await reply(content), vlm.detokenize(two.greedy_tokens, { skipSpecialTokens: true }))
  assert.ok(vlm.applyChatTemplate([{ role: 'user', content: [{ type: 'image', data: PNG }, TEXT] }]).includes('<image>'))
})

test('bad images reject naming images', async () => {
  await rejectsWith(reply([{ type: 'image', data: Buffer.from('not an image') }, TEXT]), 'INVALID_PARAMETER', 'images', 'not an image in a supported format')
  await rejectsWith(reply([{ type: 'image', data: PNG.subarray(0, PNG.length / 3) }, TEXT]), 'INVALID_PARAMETER', 'images', 'PNG')
  await rejectsWith(reply([{ type: 'image', path: '/no/such/file.png' }, TEXT]), 'INVALID_PARAMETER', 'images', '/no/such/file.png')
  await rejectsWith(reply([{ type: 'image', data: 'abc' }]), 'INVALID_ARGUMENT', null, 'Buffer')
  await rejectsWith(reply([{ type: 'image_url', image_url: { url: 'data:' } }]), 'INVALID_ARGUMENT', null, 'not supported')
  await rejectsWith(reply([{ type: 'image' }]), 'INVALID_ARGUMENT', null, 'path')
})

test('images for a text-only model name its architecture', async () => {
  const model = await loadModel()
  assert.equal(model.supportsImages, false)
  await rejectsWith(
    model.chat([{ role: 'user', content: [{ type: 'image', data: PNG }, TEXT] }], { maxTokens: 2 }),
    'INVALID_PARAMETER',
    'images',
    '`llama`, a text-only architecture',
  )
})
