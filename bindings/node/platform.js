// The file name of the native addon for this platform, as @napi-rs/cli's
// `napi build --platform` names it: mlxcel.<platform>-<arch>[-<abi>].node,
// e.g. mlxcel.linux-x64-gnu.node, mlxcel.darwin-arm64.node.
'use strict'

function isMusl() {
  if (process.platform !== 'linux') return false
  try {
    const report = process.report && process.report.getReport()
    const header = typeof report === 'string' ? JSON.parse(report).header : report && report.header
    return !(header && header.glibcVersionRuntime)
  } catch {
    return false
  }
}

function platformTriple() {
  const { platform, arch } = process
  if (platform === 'linux') {
    if (arch === 'arm') return 'linux-arm-gnueabihf'
    return `linux-${arch}-${isMusl() ? 'musl' : 'gnu'}`
  }
  if (platform === 'win32') return `win32-${arch}-msvc`
  return `${platform}-${arch}`
}

function addonFileName() {
  return `mlxcel.${platformTriple()}.node`
}

module.exports = { addonFileName, platformTriple }
