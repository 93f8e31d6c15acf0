#!/usr/bin/env bash
# One answer everywhere: the same prompt, sampling parameters and seed give the
# same tokens and text through Rust (the CLI), C (examples/c/generate.c over
# libmlxcel), Python (import mlxcel) and Node (require('mlxcel')).
# Run after the workspace and both bindings are built (./test.sh does that).
set -euo pipefail
cd "$(dirname "$0")/.."
prompt="Once upon a time"
temp=0.8
seed=1234
max_tokens=24
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cargo build --release --quiet -p mlxcel -p mlxcel-capi
./target/release/mlxcel generate --prompt "$prompt" --temp "$temp" --seed "$seed" --max-tokens "$max_tokens" --show-tokens \
  >"$work/rust.txt" 2>"$work/rust.err"
sed -n 's/^tokens: //p' "$work/rust.err" >"$work/rust.tokens"

cc -std=c11 -O1 -I include examples/c/generate.c -L target/release -lmlxcel -Wl,-rpath,"$PWD/target/release" -o "$work/generate_c"
"$work/generate_c" --temp "$temp" --seed "$seed" --max-tokens "$max_tokens" "$prompt" >"$work/c.txt" 2>/dev/null

bindings/python/.venv/bin/python - "$prompt" "$temp" "$seed" "$max_tokens" >"$work/python.tokens" 3>"$work/python.txt" <<'PY'
import json, os, sys
import mlxcel
prompt, temp, seed, max_tokens = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stream = mlxcel.load().stream(prompt, temperature=temp, seed=seed, max_tokens=max_tokens)
for _ in stream:
    pass
print(json.dumps(stream.tokens))
os.write(3, (stream.text + "\n").encode())
PY

node - "$prompt" "$temp" "$seed" "$max_tokens" >"$work/node.txt" <<'JS'
const [prompt, temp, seed, maxTokens] = process.argv.slice(2);
require('./bindings/node').loadModel().then(async (model) => {
  const text = await model.generate(prompt, { temperature: Number(temp), seed: Number(seed), maxTokens: Number(maxTokens) });
  process.stdout.write(text + '\n');
});
JS

status=0
cmp -s "$work/rust.tokens" "$work/python.tokens" || { echo "tokens differ: Rust $(cat "$work/rust.tokens") vs Python $(cat "$work/python.tokens")"; status=1; }
for lang in c python node; do
  cmp -s "$work/rust.txt" "$work/$lang.txt" || { echo "text differs: Rust vs $lang"; diff "$work/rust.txt" "$work/$lang.txt" || true; status=1; }
done
[ -s "$work/rust.tokens" ] || { echo "no tokens from Rust"; status=1; }
if [ $status -eq 0 ]; then
  echo "same answer in Rust, C, Python and Node: $(cat "$work/rust.tokens")"
fi
exit $status
