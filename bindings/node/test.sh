#!/usr/bin/env bash
# Builds the Node addon (release) and runs its tests:
#   1. npm dev dependencies (TypeScript, @types/node, @napi-rs/cli), installed
#      only when package-lock.json changed since the last install;
#   2. the addon: cargo build --release -p mlxcel-node, copied to
#      mlxcel.<platform>.node (scripts/build.js; shares target/release with
#      the workspace's cargo build/test --release);
#   3. a type check of index.d.ts (test/types.ts);
#   4. node --test (the default model is fetched into the cache on first use);
#   5. `npm install` of this directory from a scratch project, then
#      require('mlxcel') there (skip with MLXCEL_NODE_SKIP_INSTALL_TEST=1).
# Extra arguments go to node --test (e.g. --test-name-pattern=chat).
set -euo pipefail
cd "$(dirname "$0")"
here=$(pwd)

command -v node >/dev/null || { echo "node is required (>= 18)" >&2; exit 1; }
command -v npm >/dev/null || { echo "npm is required" >&2; exit 1; }

t0=$(date +%s)
stamp=node_modules/.mlxcel-lock-stamp
if [[ ! -f $stamp ]] || ! cmp -s package-lock.json "$stamp"; then
  echo "== npm ci"
  npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
  cp package-lock.json "$stamp"
fi

echo "== build the addon (release)"
node scripts/build.js

echo "== type check index.d.ts"
node_modules/.bin/tsc -p test/tsconfig.json

echo "== node --test"
node --test --test-reporter=spec "$@" test/

if [[ ${MLXCEL_NODE_SKIP_INSTALL_TEST:-0} != 1 ]]; then
  echo "== npm install of bindings/node from a scratch project"
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  (
    cd "$scratch"
    npm init -y >/dev/null
    npm install --no-audit --no-fund --loglevel=error "$here"
    out=$(node -e "require('mlxcel').loadModel().then(m => m.generate('The capital of France is', {maxTokens: 4})).then(t => console.log(JSON.stringify(t)))")
    echo "generated: $out"
    [[ $out == '" Paris'* ]] || { echo "unexpected output from the installed package: $out" >&2; exit 1; }
  )
fi
echo "== bindings/node: all passed in $(( $(date +%s) - t0 )) s"
