#!/usr/bin/env node
// Builds the native addon with cargo (release unless --debug) and copies it
// next to index.js as mlxcel.<platform>.node, the name index.js loads.
//
// This is what `npm install` runs (the package's `install` script), so it
// needs nothing from node_modules: only cargo. It builds in the workspace's
// own target directory (target/release), sharing every artifact with
// `cargo build --release` / `cargo test --release`; a re-run with nothing
// changed takes about a second.
//
// Environment:
//   MLXCEL_NODE_SKIP_BUILD=1  do nothing (e.g. an addon was put in place by hand)
//   CARGO                     the cargo binary (default: cargo on PATH)
//   MLX_DIR, MLXCEL_CACHE_DIR passed through to mlx-sys (see README.md)
'use strict'

const { spawnSync } = require('node:child_process')
const fs = require('node:fs')
const path = require('node:path')
const { addonFileName } = require('../platform')

function main() {
  if (process.env.MLXCEL_NODE_SKIP_BUILD === '1') {
    console.error('mlxcel: MLXCEL_NODE_SKIP_BUILD=1, not building the native addon')
    return 0
  }
  const debug = process.argv.includes('--debug')
  const root = path.resolve(__dirname, '..')
  const manifest = path.join(root, 'Cargo.toml')
  const cargo = process.env.CARGO || 'cargo'
  const args = ['build', '--manifest-path', manifest, '-p', 'mlxcel-node', '--message-format=json-render-diagnostics']
  if (!debug) args.push('--release')
  console.error(`mlxcel: building the native addon: ${cargo} ${args.join(' ')}`)
  const started = Date.now()
  const result = spawnSync(cargo, args, {
    cwd: root,
    stdio: ['ignore', 'pipe', 'inherit'],
    maxBuffer: 256 * 1024 * 1024,
    encoding: 'utf8',
  })
  if (result.error) {
    if (result.error.code === 'ENOENT') {
      console.error(`mlxcel: \`${cargo}\` was not found. Building the addon needs a Rust toolchain (https://rustup.rs).`)
    } else {
      console.error(`mlxcel: could not run cargo: ${result.error.message}`)
    }
    return 1
  }
  if (result.status !== 0) {
    console.error(`mlxcel: cargo build failed (exit status ${result.status})`)
    return result.status || 1
  }
  let built = null
  for (const line of result.stdout.split('\n')) {
    if (!line.startsWith('{')) continue
    let message
    try {
      message = JSON.parse(line)
    } catch {
      continue
    }
    if (message.reason !== 'compiler-artifact' || !message.target || !message.target.kind.includes('cdylib')) continue
    if (message.target.name !== 'mlxcel_node' && message.target.name !== 'mlxcel-node') continue
    built = message.filenames.find((f) => /\.(so|dylib|dll)$/.test(f)) || null
  }
  if (!built) {
    console.error('mlxcel: cargo did not report the mlxcel-node library')
    return 1
  }
  const dest = path.join(root, addonFileName())
  const src = fs.statSync(built)
  const old = fs.statSync(dest, { throwIfNoEntry: false })
  if (old && old.size === src.size && old.mtimeMs === src.mtimeMs) {
    console.error(`mlxcel: ${path.basename(dest)} is up to date (${((Date.now() - started) / 1000).toFixed(1)} s)`)
    return 0
  }
  // Copy then rename, so a process that has the old addon loaded keeps a
  // valid file and no one ever loads a half-written one.
  const tmp = `${dest}.${process.pid}.tmp`
  fs.copyFileSync(built, tmp)
  fs.utimesSync(tmp, src.atime, src.mtime)
  fs.renameSync(tmp, dest)
  console.error(`mlxcel: built ${path.basename(dest)} from ${built} (${((Date.now() - started) / 1000).toFixed(1)} s)`)
  return 0
}

process.exitCode = main()
