#!/usr/bin/env node
// Soak test of require('mlxcel'): many requests on one model, some generated
// to the end, some streams left early (cancelled), some aborted, with the
// process's RSS and thread count at checkpoints. Memory and threads must
// plateau: `rssGrowthLastHalfMiB` compares the last checkpoint with the one
// at half way.
//
// Usage: node benches/soak.js [requests=5000] [every=500] [out.json]
// (after bindings/node/test.sh has built the addon)
'use strict'
const fs = require('node:fs')
const path = require('node:path')
const { loadModel } = require(path.join(__dirname, '..', 'bindings', 'node'))

function status(key) {
  const line = fs.readFileSync('/proc/self/status', 'utf8').split('\n').find((l) => l.startsWith(key))
  return line ? parseInt(line.split(/\s+/)[1], 10) : 0
}

async function main() {
  const requests = parseInt(process.argv[2] || '5000', 10)
  const every = parseInt(process.argv[3] || '500', 10)
  const out = process.argv[4]
  const model = await loadModel(undefined, { progress: false })
  const prompts = ['The capital of France is', 'def add(a, b):', 'Once upon a time', 'Water boils at']
  const checkpoints = []
  const start = Date.now()
  for (let i = 1; i <= requests; i++) {
    const prompt = `${prompts[i % prompts.length]} (${i})`
    const kind = i % 4
    if (kind === 0) {
      await model.generate(prompt, { maxTokens: 4 })
    } else if (kind === 1) {
      for await (const chunk of model.stream(prompt, { maxTokens: 4 })) void chunk
    } else if (kind === 2) {
      for await (const chunk of model.stream(prompt, { maxTokens: 64 })) { void chunk; break } // left early
    } else {
      const controller = new AbortController()
      const pending = model.generate(prompt, { maxTokens: 64, signal: controller.signal })
      setTimeout(() => controller.abort(), 5)
      await pending.catch(() => {})
    }
    if (i % every === 0) {
      global.gc?.()
      const point = { requests: i, rssMiB: status('VmRSS:') / 1024, threads: status('Threads:'), seconds: (Date.now() - start) / 1000 }
      checkpoints.push(point)
      console.log(JSON.stringify(point))
    }
  }
  const half = checkpoints[Math.max(0, Math.floor(checkpoints.length / 2) - 1)]
  const last = checkpoints[checkpoints.length - 1]
  const report = { binding: 'node', requests, checkpoints, rssGrowthLastHalfMiB: last.rssMiB - half.rssMiB, threadsFirstLast: [checkpoints[0].threads, last.threads] }
  console.log(JSON.stringify({ ...report, checkpoints: undefined }))
  if (out) fs.writeFileSync(out, JSON.stringify(report, null, 1))
}

main().catch((e) => { console.error(e); process.exit(1) })
